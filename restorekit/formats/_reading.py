"""What the file readers share: one error boundary, the output-size limit, checked zip archives.

A reader is handed files from anywhere. Whatever such a file can make Python raise
(``zipfile.BadZipFile``, ``struct.error``, ``UnicodeDecodeError``, ``OverflowError``,
``MemoryError``, torch's unpickling errors, ...) leaves a reader as a
``CorruptCheckpointError`` naming the file; and a file is never allowed to expand into
more bytes than ``max_output_bytes`` (by default the larger of 1 GiB and 64 times the
file) before anything of that size is allocated.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import pickle
import stat
import struct
import tokenize
import types
import zipfile
import zlib

from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidArgumentError, OutputError, RestoreKitError
from restorekit._report import format_bytes

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "OUTPUT_RATIO",
    "boundary",
    "check_output_size",
    "open_zip",
    "output_limit",
    "reader",
    "regular_file",
]

# An import may write at least this much, and at least OUTPUT_RATIO times its input: a
# stored array is its own size, deflate cannot shrink real weights much, so only views
# of one value (stride 0) or compressed zeros come near; both are refused above this.
DEFAULT_MAX_OUTPUT_BYTES = 1 << 30
OUTPUT_RATIO = 64

# What a malformed file can make the standard library, numpy or torch raise.
_FOREIGN = (
    OSError,
    EOFError,
    ValueError,  # UnicodeDecodeError, json.JSONDecodeError included
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    AssertionError,  # torch's persistent_load checks with assert-like raises
    RuntimeError,  # RecursionError, torch's own errors
    NotImplementedError,
    OverflowError,
    MemoryError,
    struct.error,
    zlib.error,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    pickle.UnpicklingError,
    SyntaxError,  # numpy parses .npy headers with ast.literal_eval
    tokenize.TokenError,  # ... after tokenizing them
)
# Libraries that parse the files and raise their own exception types (safetensors'
# SafetensorError derives from Exception alone).
_PARSERS = ("safetensors", "torch", "numpy", "h5py", "ml_dtypes")


def regular_file(path: str, what: str) -> int:
    """The size of the regular file ``path``; refuse a missing path, a directory, FIFO or device.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        CorruptCheckpointError: something that is not a regular file (it would block or never end).
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no {what} at {path!r}", path) from None
    except OSError as e:
        raise CorruptCheckpointError(f"{what} {path!r} cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CorruptCheckpointError(f"{path!r} is not a regular file, so it cannot be a {what}")
    return info.st_size


@contextlib.contextmanager
def boundary(path: str, what: str):
    """Turn any error a malformed ``what`` at ``path`` can cause into ``CorruptCheckpointError``.

        with boundary(path, 'npz file'):
            ...parse...

    restorekit's own errors pass through unchanged.
    """
    try:
        yield
    except RestoreKitError:
        raise
    except MemoryError:
        raise CorruptCheckpointError(f"{path!r}: reading this {what} needs more memory than is available") from None
    except RecursionError:
        raise CorruptCheckpointError(f"{path!r} is not a readable {what}: it is nested too deeply") from None
    except Exception as e:
        if not isinstance(e, _FOREIGN) and not type(e).__module__.startswith(_PARSERS):
            raise  # a bug in restorekit, not a bad file
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        detail = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
        raise CorruptCheckpointError(f"{path!r} is not a readable {what} ({detail})") from None


def reader(what: str):
    """Decorator for a format's ``read*`` verbs (path first): every foreign error the
    verb, or the iterator it returns, raises becomes ``CorruptCheckpointError`` naming
    the file as a ``what``."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(path, *args, **kwargs):
            where = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else repr(path)
            with boundary(where, what):
                result = function(path, *args, **kwargs)
            if isinstance(result, types.GeneratorType):
                return _guard_iterator(where, what, result)
            return result

        return wrapper

    return decorate


def _guard_iterator(path: str, what: str, iterator):
    with contextlib.closing(iterator):
        while True:
            with boundary(path, what):
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item


def output_limit(input_bytes: int, max_output_bytes) -> int:
    """The limit in force: ``max_output_bytes``, or the larger of 1 GiB and 64 x the input.

    Raises:
        InvalidArgumentError: ``max_output_bytes`` is not a positive integer.
    """
    if max_output_bytes is None:
        return max(DEFAULT_MAX_OUTPUT_BYTES, OUTPUT_RATIO * input_bytes)
    if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int) or max_output_bytes < 1:
        raise InvalidArgumentError(f"max_output_bytes is a positive number of bytes; got {max_output_bytes!r}")
    return max_output_bytes


def check_output_size(path: str, input_bytes: int, sizes: dict, max_output_bytes, why: str = "") -> None:
    """Refuse a file whose tensors (name -> byte count) add up to more than the limit.

    Raises:
        OutputError: over the limit; names the largest tensor and how to raise the limit.
    """
    limit = output_limit(input_bytes, max_output_bytes)
    total = sum(sizes.values())
    if total <= limit:
        return
    largest = max(sizes, key=sizes.__getitem__)
    default = (
        f"; the default is the larger of {format_bytes(DEFAULT_MAX_OUTPUT_BYTES)} and {OUTPUT_RATIO} times the file"
        if max_output_bytes is None
        else ""
    )
    raise OutputError(
        f"{path!r} ({format_bytes(input_bytes)}) would expand to {format_bytes(total)} of tensors, over "
        f"max_output_bytes={limit}{default}: {largest!r} alone is {format_bytes(sizes[largest])}{why}. "
        f"Nothing was read; pass a larger max_output_bytes if the file is trusted."
    )


def open_zip(path: str, what: str) -> zipfile.ZipFile:
    """A zip archive with unique member names (two members of one name read differently in different readers).

    Raises:
        CorruptCheckpointError: not a zip archive, or a name used twice.
    """
    with boundary(path, what):
        archive = zipfile.ZipFile(path)
    names = archive.namelist()
    if len(set(names)) != len(names):
        twice = next(n for n, count in collections.Counter(names).items() if count > 1)
        archive.close()
        raise CorruptCheckpointError(f"{path!r} is not a readable {what}: the archive holds {twice!r} twice")
    return archive
