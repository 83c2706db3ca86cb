"""The restorekit exception hierarchy.

Every error restorekit raises derives from ``RestoreKitError`` and, where one fits,
also from a built-in, so ``except FileNotFoundError`` keeps working:

    RestoreKitError
    ├── CheckpointNotFoundError        (FileNotFoundError)  no checkpoint at a path
    ├── CorruptCheckpointError         (ValueError)         unreadable index or shard
    │   ├── ChecksumMismatchError                           crc32c of a tensor is wrong
    │   ├── ExternalDataError                               a file whose data would be read from another file
    │   ├── UnknownFormatError                              a file that exists, in no format restorekit reads
    │   └── CheckpointChangedError                          a file replaced or rewritten while it was open
    ├── InvalidArgumentError           (ValueError)         a bad argument, caught early
    │   ├── NoMatchError                                    a name, rule or pattern matches nothing
    │   │   └── EntryNotFoundError         (KeyError)           a source has no entry of that name
    │   ├── NameCollisionError                              two things onto one name
    │   ├── AssignmentMapError                              an assignment_map that cannot work
    │   ├── EditError                                       an edit that does not fit (shape, dtype)
    │   ├── OutputNameError                                 an output name that contradicts `to` or is not ours
    │   ├── OptionNotApplicableError                        an option the source or target format does not take
    │   ├── GroupError                                      variable groups used wrongly
    │   │   └── UnknownVariableError       (NoMatchError)       a variable the groups do not hold
    │   ├── VocabularyError                                 a vocabulary file or size that does not fit
    │   └── SourceMismatchError                             sources that must agree differ (average)
    ├── IncompleteRestoreError         (ValueError)         strict restore with gaps; has .report
    ├── RunDirectoryError              (ValueError)         a run directory no restart may resume from
    ├── OutputError                    (OSError)            an output that cannot be written safely
    │   ├── OutputExistsError          (FileExistsError)    output would overwrite the source
    │   ├── InsufficientSpaceError                          not enough free disk
    │   └── WriteFailedError                                writing failed (disk full, read-only, ...); nothing left
    │       └── RankFailedError                             a rank of a distributed write failed; nothing published
    ├── GraphError                     (ValueError)         not a graph, truncated, unusable
    │   ├── GraphTooLargeError                              over the 2 GB protobuf limit
    │   └── CompressionError                                a converter refuses the model, or it moved too far
    └── MissingDependencyError         (ImportError)        an optional extra is not installed

    RestoreKitWarning                  (UserWarning)        something worked, but not as asked

Exceptions build their own messages from the facts callers pass: ``NoMatchError``
computes its near misses from ``name`` and ``candidates``, ``OutputExistsError``
carries ``path`` and ``is_source`` so the CLI can reword it without reading the text.

An error whose advice names an option or a call (``pass intersection=True``,
``restorekit.convert(...)``) is built with :meth:`RestoreKitError.worded` from a function
of a :class:`Wording`; :meth:`RestoreKitError.for_cli` words the same facts for the shell
(``--intersection``, ``restorekit convert ...``), leaving out options the command lacks.
"""

from __future__ import annotations

import difflib
from typing import Callable, Iterable

__all__ = [
    "AssignmentMapError",
    "CheckpointChangedError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CompressionError",
    "CorruptCheckpointError",
    "EditError",
    "ExternalDataError",
    "EntryNotFoundError",
    "GraphError",
    "GraphTooLargeError",
    "GroupError",
    "IncompleteRestoreError",
    "InsufficientSpaceError",
    "InvalidArgumentError",
    "MissingDependencyError",
    "NameCollisionError",
    "NoMatchError",
    "OptionNotApplicableError",
    "OutputError",
    "OutputExistsError",
    "OutputNameError",
    "RankFailedError",
    "RestoreKitError",
    "RestoreKitWarning",
    "SourceMismatchError",
    "RunDirectoryError",
    "UnknownFormatError",
    "UnknownVariableError",
    "VocabularyError",
    "Wording",
    "WriteFailedError",
]


class Wording:
    """How an error's advice names an option or a call: the Python API's way, or the shell's.

    ``flags`` (shell only) are the options the command at hand has, by keyword
    (``'intersection'``); :meth:`option` gives ``None`` for one it lacks, so the advice
    leaves it out rather than name a flag that does not exist.
    """

    def __init__(self, *, cli: bool = False, flags: Iterable[str] | None = None):
        self.cli = cli
        self.flags = None if flags is None else frozenset(flags)

    def option(self, name: str, value: object = True) -> str | None:
        """``name=value`` (Python), ``--name value`` / ``--name`` for ``True`` (shell), or ``None``."""
        if not self.cli:
            return f"{name}={value!r}"
        if self.flags is not None and name not in self.flags:
            return None
        flag = "--" + name.replace("_", "-")
        return flag if value is True else f"{flag} {value}"

    def name(self, option: str) -> str:
        """An option named without a value: ``option=`` (Python), ``--option`` (shell)."""
        return "--" + option.replace("_", "-") if self.cli else f"{option}="

    def either(self, python: str, shell: str) -> str:
        """``python`` or ``shell``, for advice worded differently as a whole (a call vs a command)."""
        return shell if self.cli else python


class RestoreKitError(Exception):
    """Base class of every error restorekit raises."""

    _words: Callable[[Wording], str] | None = None

    @classmethod
    def worded(cls, words: Callable[[Wording], str], *args, **fields):
        """The error with the message ``words(Wording())``, which :meth:`for_cli` re-words for the shell."""
        error = cls(words(Wording()), *args, **fields)
        error._words = words
        return error

    def for_cli(self, flags: Iterable[str] | None = None) -> "RestoreKitError":
        """The same error, its advice worded as the shell's flags and commands (``flags``: the command's)."""
        if self._words is None:
            return self
        error = type(self).__new__(type(self))  # the same fields, not re-built from the text (no __init__)
        error.__dict__.update(self.__dict__)
        error.args = (self._words(Wording(cli=True, flags=flags)),) + tuple(self.args[1:])
        return error


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


class ExternalDataError(CorruptCheckpointError):
    """A checkpoint file that would make a reader read another file (HDF5 external storage, external links,
    virtual datasets): refused before anything is read from it."""


class UnknownFormatError(CorruptCheckpointError):
    """A file exists at the path, but in no format restorekit reads: not a ``FileNotFoundError``.

    ``path`` is the file; ``looks_like`` what its first bytes say it is (``'a Python pickle
    (protocol 4)'``), None when they say nothing; ``formats`` the names of the formats restorekit
    reads. Nothing past the file's first bytes was read.
    """

    def __init__(self, path, *, looks_like: str | None = None, formats: Iterable[str] = ()):
        self.path = str(path)
        self.looks_like = looks_like
        self.formats = tuple(formats)
        what = f"it looks like {looks_like}" if looks_like else "its first bytes are those of no format restorekit knows"
        readable = f" restorekit reads {', '.join(self.formats)}." if self.formats else ""
        super().__init__(f"{self.path!r} is a file, but not a checkpoint restorekit can read: {what}.{readable}")


class CheckpointChangedError(CorruptCheckpointError):
    """A checkpoint file was replaced or rewritten after it was opened: reading on would mix two versions."""


class InvalidArgumentError(RestoreKitError, ValueError):
    """An argument that cannot work, rejected before anything is built or written."""


class OutputNameError(InvalidArgumentError):
    """An output name that contradicts ``to``, or that names a file restorekit does not write.

    ``path`` is the output. ``words`` builds the message from a :class:`Wording`: the
    Python way (``to='tf'``) by default, and :meth:`for_cli` words the same facts for the
    shell (``--to tf``, or nothing where the command has no ``--to``).
    """

    def __init__(self, path: str, words: Callable[[Wording], str]):
        self.path = path
        self._words = words
        super().__init__(words(Wording()))


class OptionNotApplicableError(InvalidArgumentError):
    """An option given for a format it does not apply to; nothing was read or written.

    ``option`` is the keyword (``'num_shards'``), ``value`` what was passed, ``format`` the
    output format that refuses it (``'npz'``, ``'tf'``, ``'keras'``), ``source`` the source
    format where the option could apply to either side (``layout``), ``applies_to`` the
    formats it does apply to (``restorekit.export._request.OPTIONS``) and ``hint`` what to
    do instead (an option in it written ``{option}``, worded for Python or the shell).
    """

    def __init__(self, option: str, format: str, applies_to: Iterable[str] = (), *, value: object = None,
                 source: str | None = None, hint: str = ""):
        self.option = option
        self.format = format
        self.applies_to = tuple(applies_to)
        self.value = value
        self.source = source
        self.hint = hint
        self._words = self._option_words
        super().__init__(self._option_words(Wording()))

    def _option_words(self, w: Wording) -> str:
        option, value = self.option, self.value
        if w.cli:
            given = w.option(option, True if value is None else value) or option
        else:
            given = f"{option}={value!r}" if value is not None and value is not True else f"{option}="
        if self.source is not None:
            text = f"{given} applies to neither {self.source} nor {self.format} files"
        else:
            text = f"{given} does not apply to {self.format} outputs"
        if self.applies_to:
            text += f" (it applies to {', '.join(self.applies_to)})"
        hint = self.hint.format_map(_OptionNames(w)) if self.hint else ""
        return f"{text}; nothing was written." + (f" {hint}" if hint else "")


class _OptionNames(dict):
    """``{option}`` in a hint, worded by a :class:`Wording` (``option=`` or ``--option``)."""

    def __init__(self, wording: Wording):
        super().__init__()
        self.wording = wording

    def __missing__(self, option: str) -> str:
        return self.wording.name(option)


class NoMatchError(InvalidArgumentError):
    """A name, pattern or rule matched nothing. ``closest`` lists near misses.

    Pass ``name`` and ``candidates`` and the error finds the near misses itself and
    appends them to the message (``label``: ``'Closest: ...'`` by default)::

        raise NoMatchError(f"no entry {name!r} in {prefix!r}.", name=name, candidates=entries)
    """

    def __init__(
        self,
        message: str,
        closest: tuple[str, ...] = (),
        *,
        name: str | None = None,
        candidates: Iterable[str] | None = None,
        label: str = "Closest",
    ):
        if candidates is not None and name is not None:
            closest = closest_names(str(name), candidates)
            if closest:
                message = f"{message} {label}: {format_names(closest)}."
        super().__init__(message)
        self.name = name
        self.closest = tuple(closest)


class EntryNotFoundError(NoMatchError, KeyError):
    """A checkpoint (any Source) has no entry of that name: a ``NoMatchError`` with the closest
    names, and a ``KeyError``, so a checkpoint keeps the ``Mapping`` contract
    (``ckpt.get(name, default)``, ``except KeyError``)."""

    def __str__(self) -> str:
        # KeyError words itself as the repr of its argument; the message is already a sentence.
        return str(self.args[0]) if self.args else ""


class NameCollisionError(InvalidArgumentError):
    """Two or more names would end up under one name."""


class AssignmentMapError(InvalidArgumentError):
    """An ``assignment_map`` entry that cannot be applied."""


class EditError(InvalidArgumentError):
    """A checkpoint edit whose value does not fit (shape, dtype, index)."""


class GroupError(InvalidArgumentError):
    """Variable groups built wrongly or used with another graph."""


class UnknownVariableError(GroupError, NoMatchError):
    """A variable these groups do not hold: a ``GroupError`` that lists the closest names."""

    def __init__(self, message: str, *, name: str, candidates):
        NoMatchError.__init__(self, message, name=name, candidates=candidates, label="Closest names")


class VocabularyError(InvalidArgumentError):
    """A vocabulary file or size that does not fit a remap."""


class SourceMismatchError(InvalidArgumentError):
    """Sources that must agree do not: names, shapes or dtypes, or non-float values (``restorekit.average``).

    ``problems`` is every ``(entry name, what differs)``, all of them in the message;
    ``hint`` says which option gets past them (a function of a :class:`Wording` where it
    names one). Nothing was written.
    """

    def __init__(self, what: str, problems, hint: "str | Callable[[Wording], str]" = ""):
        self.problems = tuple(problems)
        self.names = tuple(name for name, _ in self.problems)
        lines = "".join(f"\n  {text}" for _, text in self.problems)
        words = hint if callable(hint) else (lambda w: hint)
        self._words = lambda w: f"{what} ({len(self.problems)}):{lines}" + (f"\n{words(w)}" if words(w) else "")
        super().__init__(self._words(Wording()))


class IncompleteRestoreError(RestoreKitError, ValueError):
    """A strict restore found variables it cannot restore. ``report`` has the details."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class RunDirectoryError(RestoreKitError, ValueError):
    """A run directory holds checkpoints, but none that a restart may resume from.

    ``directory`` is the run directory; ``skipped`` pairs each prefix considered with
    why it was passed over (missing, damaged, outside the directory).
    """

    def __init__(self, message: str, directory: str = "", skipped: tuple = ()):
        super().__init__(message)
        self.directory = directory
        self.skipped = tuple(skipped)


class OutputError(RestoreKitError, OSError):
    """An output that cannot be written safely."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OutputExistsError(OutputError, FileExistsError):
    """The output would overwrite its own source (use save_in_place) or an existing file.

    ``path`` is the output; ``is_source`` says it is the checkpoint being read. Given
    no message, the error words one from those fields.
    """

    def __init__(self, message: str | None = None, *, path=None, is_source: bool = False):
        self.path = None if path is None else str(path)
        self.is_source = bool(is_source)
        if message is None:
            self._words = self._default_words
            message = self._default_words(Wording())
        Exception.__init__(self, message)

    def _default_words(self, w: Wording) -> str:
        if self.is_source:
            return f"{self.path!r} is the source checkpoint; " + w.either(
                "save under a new name or use save_in_place()", "name another output")
        overwrite = w.option("overwrite")
        return f"{self.path!r} exists; " + (f"pass {overwrite} to replace it" if overwrite else "remove it first")


class InsufficientSpaceError(OutputError):
    """Not enough free disk space for the output."""


class WriteFailedError(OutputError):
    """Writing an output failed part-way (disk full, file too large, read-only, permission, a library's
    error); what was staged is gone and the source is untouched.

    ``path`` is the output; ``cause`` says what failed (an ``OSError``'s ``strerror``, or
    the library's message); ``errno`` is the ``OSError``'s, when there was one.
    """

    def __init__(self, message: str | None = None, *, path=None, cause: str = ""):
        self.path = None if path is None else str(path)
        self.cause = cause
        if message is None:
            message = f"could not write {self.path!r}: {cause or 'the write failed'}; nothing was left behind"
        Exception.__init__(self, message)


class RankFailedError(WriteFailedError):
    """A rank of a distributed write (``convert(..., distributed=True)``) raised, was killed or stopped
    answering; nothing was published, and the next run sweeps what was staged.

    ``rank`` is the rank that failed (None when a rank stopped answering and which one cannot be
    told: it runs on another host), ``stage`` the step the ranks were at (``'staging'``, ``'writing'``,
    ``'publishing'``), ``cause`` what that rank reported, ``path`` the output. ``published`` is False
    (nothing was published), True (rank 0 had published the whole output when another rank was killed)
    or None (rank 0 was killed while it published: the output is complete or absent, never a mix).
    """

    def __init__(self, message: str | None = None, *, path=None, rank: int | None = None, stage: str = "",
                 cause: str = "", published: bool | None = False):
        self.rank = rank
        self.stage = stage
        self.published = published
        who = f"rank {rank}" if rank is not None else "a rank"
        if message is None:
            outcome = ("nothing was published (the next run sweeps what was staged)" if published is False else
                       "the output had been published whole before" if published else
                       "rank 0 was publishing the output: it is complete or absent, never a mix (the next run "
                       "sweeps what was staged)")
            message = f"{who} failed while {stage or 'writing'} {str(path)!r}: {cause or 'it stopped answering'}; {outcome}"
        super().__init__(message, path=path, cause=cause)


class GraphError(RestoreKitError, ValueError):
    """A file that is not a usable graph (GraphDef, MetaGraph or SavedModel)."""


class GraphTooLargeError(GraphError):
    """A graph over protobuf's 2 GB limit."""


class CompressionError(GraphError):
    """A model the converter refuses (``ops`` names the ops it has no kernel for), or whose
    compressed outputs moved further than ``max_error`` (``result`` has the numbers).

    Given ``ops``, the error lists them after the message itself.
    """

    def __init__(self, message: str, *, ops=(), result=None):
        self.ops = tuple(ops)
        self.result = result
        if self.ops:
            message = f"{message} Unsupported ops: {format_names(self.ops)}."
        super().__init__(message)


class MissingDependencyError(RestoreKitError, ImportError):
    """An optional dependency is missing; the message names the pip extra."""


def format_names(names, limit: int = 8, sep: str = ", ") -> str:
    """Join names quoted with repr, cut long lists with '... and N more'."""
    names = list(names)
    shown = sep.join(repr(n) for n in names[:limit])
    if len(names) > limit:
        shown += f"{sep}... and {len(names) - limit} more"
    return shown


def closest_names(name: str, candidates: Iterable[str], n: int = 5) -> tuple[str, ...]:
    """Near misses for ``name``: by similarity of the whole name and of its last part."""
    candidates = [str(c) for c in candidates]
    found = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5)
    if len(found) < n:
        leaf = name.rstrip("/").rsplit("/", 1)[-1]
        for c in candidates:
            if c not in found and leaf and leaf in c:
                found.append(c)
                if len(found) >= n:
                    break
    return tuple(found)


class RestoreKitWarning(UserWarning):
    """restorekit did what was asked, but something deserves a look (a fallback, a loss).

    Messages carry no ``restorekit:`` prefix: the category names the source.
    """
