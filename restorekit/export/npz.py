"""Numpy ``.npz`` archives, written one tensor at a time (``np.savez`` needs a whole dict).

Each tensor is the archive member ``NAME.npy``, so ``np.load(path)[NAME]`` works with
TF names, and arrays load without pickle. Where a ``.npy`` header cannot say exactly
what the tensor is, it is stored exactly and the member ``__restorekit__.npy`` (a JSON
string) says how to read it back, so a round trip is bit-exact:

- bfloat16, float8 and the other ml_dtypes types (numpy cannot name them in a header)
  are stored as their bits, unsigned integers of the same width: with ml_dtypes,
  ``np.load(path)[NAME].view(ml_dtypes.bfloat16)`` gives the values;
- string tensors are fixed-width bytes; numpy drops trailing NUL bytes of each
  element, so when an element ends in one, the exact lengths are recorded.

Reading takes shapes from the ``.npy`` headers without decompressing the arrays, and
refuses an archive whose arrays would expand to more than ``max_output_bytes``.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from typing import Iterable, Iterator

import numpy as np

from restorekit.errors import CorruptCheckpointError, InvalidArgumentError
from restorekit.export.base import ExportResult, atomic_output, checkpoint_entries, progress_bar, refuse, tf_dtype_of
from restorekit.export.reading import boundary, check_output_size, open_zip, reader, regular_file

__all__ = ["FORMAT", "SUFFIXES", "RECORD", "read", "read_record", "read_shapes", "recognizes", "write",
           "write_checkpoint"]

FORMAT = "npz"
SUFFIXES = (".npz",)
LAYOUTS = (None,)  # the layout= values write and write_checkpoint accept
RECORD = "__restorekit__"  # the member holding how to read tensors back exactly
_RECORD_LIMIT = 64 << 20
_MAX_MEMBER_NAME = 0xFFFF  # the zip format's 16-bit name length
_WHAT = "npz file"


def _named_by_header(dtype: np.dtype) -> bool:
    """Whether a .npy header names ``dtype`` exactly (ml_dtypes types come back as void)."""
    try:
        return np.lib.format.descr_to_dtype(np.lib.format.dtype_to_descr(dtype)) == dtype
    except (ValueError, TypeError):
        return False


def _stored(name: str, array: np.ndarray) -> tuple[np.ndarray, dict | None]:
    """(the array to store, the note that reads it back exactly, or None)."""
    dtype = tf_dtype_of(array)
    if dtype == "string":
        if array.dtype != object:
            return array, None  # numpy bytes already: nothing more to keep
        values = [v.encode() if isinstance(v, str) else bytes(v) for v in array.ravel()]
        stored = np.array(values, dtype=bytes).reshape(array.shape) if values else np.zeros(array.shape, "S1")
        if any(v.endswith(b"\x00") for v in values):
            return stored, {"dtype": "string", "lengths": [len(v) for v in values]}
        return stored, None
    if not _named_by_header(array.dtype):
        bits = np.dtype(f"<u{array.dtype.itemsize}")
        return np.ascontiguousarray(array).view(bits), {"dtype": dtype}
    return array, None


def write(path, tensors: Iterable, *, layout: str | None = None, metadata: dict | None = None, graph=None,
          progress: bool = False) -> ExportResult:
    """Write ``(name, ndarray)`` pairs to an ``.npz`` file, holding one tensor at a time.

        write('weights.npz', ((n, ckpt.read(n)) for n in ckpt))

    ``layout`` and ``metadata`` are refused (npz keeps TF names and axes and has no
    metadata); ``graph`` only serves a layout and is ignored.

    Returns:
        An ExportResult. The file appears at ``path`` only once complete.

    Raises:
        InvalidArgumentError: a tensor named ``__restorekit__`` (that member is ours).
    """
    refuse(FORMAT, layout=layout, metadata=metadata)
    path = os.fspath(path)
    count = nbytes = 0
    notes = {}
    with atomic_output(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        with progress_bar(None, progress, "npz") as bar:
            for name, array, *_ in tensors:
                _check_name(name)
                array, note = _stored(name, np.asarray(array))
                if note is not None:
                    notes[name] = note
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, array, allow_pickle=False)
                count += 1
                nbytes += array.nbytes
                bar.update(array.nbytes)
        if notes:
            text = json.dumps({"version": 1, "tensors": notes}, separators=(",", ":"), sort_keys=True)
            with archive.open(f"{RECORD}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.array(text), allow_pickle=False)
    return ExportResult(path, "npz", count, nbytes)


def write_checkpoint(checkpoint, path, *, names: dict | None = None, layout: str | None = None,
                     metadata: dict | None = None, progress: bool = False) -> ExportResult:
    """Write every tensor of a TF checkpoint (or the renamed subset ``names``) to an ``.npz`` file.

    Each tensor is read (crc32c checked) and written before the next is read.
    """
    refuse(FORMAT, layout=layout, metadata=metadata)
    for name, _ in checkpoint_entries(checkpoint, names):  # refused before anything is read or written
        _check_name(name)
    tensors = ((name, checkpoint.read(source)) for name, source in checkpoint_entries(checkpoint, names))
    return write(path, tensors, progress=progress)


def _check_name(name: str) -> None:
    """Refuse a name npz cannot hold: ours (the record), or one longer than a zip member name can be."""
    if name == RECORD:
        raise InvalidArgumentError(f"npz files cannot hold a tensor named {RECORD!r}; rename it first")
    size = len(f"{name}.npy".encode("utf-8", "surrogatepass"))
    if size > _MAX_MEMBER_NAME:
        raise InvalidArgumentError(
            f"npz cannot hold tensor {name[:60]!r}... ({len(name)} characters): a zip member name is at most "
            f"{_MAX_MEMBER_NAME} bytes; rename it first, or write safetensors"
        )


def read_record(path) -> None:
    """npz files carry no layout record: always None."""
    return None


def recognizes(head: bytes, suffix: str) -> bool:
    """True for a zip archive named ``.npz``."""
    return head.startswith(b"PK") and suffix == ".npz"


class _Member:
    """One ``.npy`` member, from its header alone."""

    def __init__(self, path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo):
        if not info.filename.endswith(".npy"):
            raise CorruptCheckpointError(f"{path!r}: member {info.filename!r} is not an .npy array")
        self.info = info
        self.name = info.filename[: -len(".npy")]
        with archive.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise CorruptCheckpointError(f"{path!r}: member {info.filename!r} is .npy version {version}, unsupported")
            start = f.tell()
        if dtype.hasobject:
            raise CorruptCheckpointError(f"{path!r}: array {self.name!r} holds Python objects (it needs pickle)")
        self.shape, self.fortran, self.dtype = tuple(shape), fortran, dtype
        self.nbytes = math.prod(self.shape) * dtype.itemsize
        if info.file_size != start + self.nbytes:
            raise CorruptCheckpointError(
                f"{path!r}: array {self.name!r} ({dtype} {list(self.shape)}) needs {start + self.nbytes} bytes "
                f"in its member, which holds {info.file_size}"
            )

    def read(self, path: str, archive: zipfile.ZipFile) -> np.ndarray:
        with archive.open(self.info) as f:
            array = np.lib.format.read_array(f, allow_pickle=False)
            if f.read(1):  # also makes zipfile check the member's CRC-32 at its end
                raise CorruptCheckpointError(f"{path!r}: member {self.info.filename!r} holds bytes after its array")
        return array


def _members(path: str, archive: zipfile.ZipFile) -> tuple[dict, dict]:
    """(name -> _Member for every tensor, the notes of the record member)."""
    members = {}
    notes = {}
    for info in archive.infolist():
        member = _Member(path, archive, info)
        if member.name == RECORD:
            notes = _notes(path, archive, member)
        else:
            members[member.name] = member
    for name in notes:
        if name not in members:
            raise CorruptCheckpointError(f"{path!r}: {RECORD!r} describes {name!r}, which the archive lacks")
    return members, notes


def _notes(path: str, archive: zipfile.ZipFile, member: _Member) -> dict:
    if member.dtype.kind != "U" or member.shape or member.nbytes > _RECORD_LIMIT:
        raise CorruptCheckpointError(f"{path!r}: member {RECORD!r} is not restorekit's record")
    data = json.loads(str(member.read(path, archive)))
    tensors = data.get("tensors") if isinstance(data, dict) and data.get("version") == 1 else None
    if not isinstance(tensors, dict) or not all(isinstance(n, dict) for n in tensors.values()):
        raise CorruptCheckpointError(f"{path!r}: member {RECORD!r} is not restorekit's record")
    return tensors


def _restore(path: str, name: str, array: np.ndarray, note: dict | None) -> np.ndarray:
    """Undo what ``_stored`` did to one tensor, exactly."""
    if note is None:
        return array
    dtype = note.get("dtype")
    if dtype == "string":
        return _strings(path, name, array, note.get("lengths"))
    from restorekit.bundle.format import dtype_enum, numpy_dtype

    try:
        target = numpy_dtype(dtype_enum(dtype))
    except (ValueError, TypeError, KeyError):
        raise CorruptCheckpointError(f"{path!r}: the record gives {name!r} the unknown dtype {dtype!r}") from None
    if array.dtype.kind != "u" or array.dtype.itemsize != target.itemsize:
        raise CorruptCheckpointError(f"{path!r}: {name!r} is {array.dtype}, not the bits of {dtype}")
    return np.ascontiguousarray(array).view(target)


def _strings(path: str, name: str, array: np.ndarray, lengths) -> np.ndarray:
    width = array.dtype.itemsize
    ok = array.dtype.kind == "S" and isinstance(lengths, list) and len(lengths) == array.size
    if not ok or not all(type(n) is int and 0 <= n <= width for n in lengths):
        raise CorruptCheckpointError(f"{path!r}: the record's string lengths do not fit {name!r}")
    rows = np.ascontiguousarray(array).reshape(-1).view(np.uint8).reshape(-1, width) if width else None
    out = np.empty(array.size, dtype=object)
    out[:] = [rows[i, :n].tobytes() if width else b"" for i, n in enumerate(lengths)]
    return out.reshape(array.shape)


@reader(_WHAT)
def read_shapes(path) -> dict:
    """Name -> shape of every array in an ``.npz`` file (from the ``.npy`` headers: nothing is decompressed)."""
    path = os.fspath(path)
    regular_file(path, _WHAT)
    with open_zip(path, _WHAT) as archive:
        members, _ = _members(path, archive)
    return {name: member.shape for name, member in members.items()}


@reader(_WHAT)
def read(path, *, max_output_bytes: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, ndarray)`` for each array of an ``.npz`` file (no pickle), exactly as exported.

    Args:
        max_output_bytes: refuse an archive whose arrays add up to more bytes than this
            (default: the larger of 1 GiB and 64 times the file), before decompressing
            any: a few MB of deflated zeros can claim gigabytes.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        CorruptCheckpointError: not a readable npz (bad zip, header, CRC-32 or record).
        OutputError: over ``max_output_bytes``.
    """
    path = os.fspath(path)
    size = regular_file(path, _WHAT)
    archive = open_zip(path, _WHAT)
    try:
        members, notes = _members(path, archive)
        check_output_size(path, size, {n: m.nbytes for n, m in members.items()}, max_output_bytes,
                          why=" (compressed archives are sized by what they decompress to)")
    except BaseException:
        archive.close()
        raise
    return _arrays(path, archive, members, notes)


def _arrays(path: str, archive: zipfile.ZipFile, members: dict, notes: dict):
    with archive:
        for name, member in members.items():
            with boundary(path, _WHAT):
                array = _restore(path, name, member.read(path, archive), notes.get(name))
            yield name, array
