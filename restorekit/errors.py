"""The restorekit exception hierarchy.

Every error restorekit raises derives from ``RestoreKitError`` and, where one fits,
also from a built-in, so ``except FileNotFoundError`` keeps working::

    RestoreKitError
    ├── CheckpointNotFoundError        (FileNotFoundError)  no checkpoint at a path
    ├── CorruptCheckpointError         (ValueError)         unreadable index or shard
    │   └── ChecksumMismatchError                           crc32c of a tensor is wrong
    ├── InvalidArgumentError           (ValueError)         a bad argument, caught early
    │   ├── NoMatchError                                    a name, rule or pattern matches nothing
    │   ├── NameCollisionError                              two things onto one name
    │   ├── AssignmentMapError                              an assignment_map that cannot work
    │   ├── EditError                                       an edit that does not fit (shape, dtype)
    │   ├── GroupError                                      variable groups used wrongly
    │   └── VocabularyError                                 a vocabulary file or size that does not fit
    ├── IncompleteRestoreError         (ValueError)         strict restore with gaps; has .report
    ├── OutputError                    (OSError)            an output that cannot be written safely
    │   ├── OutputExistsError          (FileExistsError)    output would overwrite the source
    │   └── InsufficientSpaceError                          not enough free disk
    ├── GraphError                     (ValueError)         not a graph, truncated, unusable
    │   └── GraphTooLargeError                              over the 2 GB protobuf limit
    └── MissingDependencyError         (ImportError)        an optional extra is not installed
"""

from __future__ import annotations

__all__ = [
    "AssignmentMapError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "EditError",
    "GraphError",
    "GraphTooLargeError",
    "GroupError",
    "IncompleteRestoreError",
    "InsufficientSpaceError",
    "InvalidArgumentError",
    "MissingDependencyError",
    "NameCollisionError",
    "NoMatchError",
    "OutputError",
    "OutputExistsError",
    "RestoreKitError",
    "VocabularyError",
]


class RestoreKitError(Exception):
    """Base class of every error restorekit raises."""


class CheckpointNotFoundError(RestoreKitError, FileNotFoundError):
    """No checkpoint exists at the given path."""

    def __init__(self, message: str, path: str | None = None):
        Exception.__init__(self, message)
        self.path = path

    def __str__(self) -> str:
        return self.args[0]


class CorruptCheckpointError(RestoreKitError, ValueError):
    """A checkpoint index or data shard is truncated or malformed."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A tensor's bytes do not match the crc32c recorded in the index."""


class InvalidArgumentError(RestoreKitError, ValueError):
    """An argument that cannot work, rejected before anything is built or written."""


class NoMatchError(InvalidArgumentError):
    """A name, pattern or rule matched nothing. ``closest`` lists near misses."""

    def __init__(self, message: str, closest: tuple[str, ...] = ()):
        super().__init__(message)
        self.closest = tuple(closest)


class NameCollisionError(InvalidArgumentError):
    """Two or more names would end up under one name."""


class AssignmentMapError(InvalidArgumentError):
    """An ``assignment_map`` entry that cannot be applied."""


class EditError(InvalidArgumentError):
    """A checkpoint edit whose value does not fit (shape, dtype, index)."""


class GroupError(InvalidArgumentError):
    """Variable groups built wrongly or used with another graph."""


class VocabularyError(InvalidArgumentError):
    """A vocabulary file or size that does not fit a remap."""


class IncompleteRestoreError(RestoreKitError, ValueError):
    """A strict restore found variables it cannot restore. ``report`` has the details."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class OutputError(RestoreKitError, OSError):
    """An output that cannot be written safely."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OutputExistsError(OutputError, FileExistsError):
    """The output would overwrite its own source (use save_in_place) or an existing file."""


class InsufficientSpaceError(OutputError):
    """Not enough free disk space for the output."""


class GraphError(RestoreKitError, ValueError):
    """A file that is not a usable graph (GraphDef, MetaGraph or SavedModel)."""


class GraphTooLargeError(GraphError):
    """A graph over protobuf's 2 GB limit."""


class MissingDependencyError(RestoreKitError, ImportError):
    """An optional dependency is missing; the message names the pip extra."""


def format_names(names, limit: int = 8, sep: str = ", ") -> str:
    """Join names quoted with repr, cut long lists with '... and N more'."""
    names = list(names)
    shown = sep.join(repr(n) for n in names[:limit])
    if len(names) > limit:
        shown += f"{sep}... and {len(names) - limit} more"
    return shown
