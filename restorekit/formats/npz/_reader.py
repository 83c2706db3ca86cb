"""The numpy ``.npz`` format, read: arrays without pickle, exactly as restorekit wrote them.

Shapes come from the ``.npy`` headers without decompressing the arrays, and an archive
whose arrays would expand to more than ``max_output_bytes`` is refused. Where restorekit
stored a tensor as something a ``.npy`` header can name (bfloat16 as its bits, strings
with trailing NULs), the member ``__restorekit__.npy`` says how to read it back. The
writer is ``restorekit.formats.npz``.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from typing import Iterator

import numpy as np

from restorekit._checkpoint import Entry
from restorekit.errors import CorruptCheckpointError
from restorekit.formats._sink import tf_dtype_of
from restorekit.formats.files import FileReader, FileView, by_name
from restorekit.formats._reading import boundary, check_output_size, open_zip, reader, regular_file
from restorekit._registry import BY_BYTES, Probe, register

__all__ = ["FORMAT", "RECORD", "SUFFIXES", "NpzReader", "read", "read_record", "read_shapes", "recognizes"]

FORMAT = "npz"
SUFFIXES = (".npz",)
RECORD = "__restorekit__"  # the member holding how to read tensors back exactly
_RECORD_LIMIT = 64 << 20
_WHAT = "npz file"


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
    target = _noted_dtype(path, name, dtype)
    if array.dtype.kind != "u" or array.dtype.itemsize != target.itemsize:
        raise CorruptCheckpointError(f"{path!r}: {name!r} is {array.dtype}, not the bits of {dtype}")
    return np.ascontiguousarray(array).view(target)


def _noted_dtype(path: str, name: str, dtype) -> np.dtype:
    """The numpy dtype of the TF dtype name the record gives a tensor stored as its bits."""
    from restorekit._bundle.format import dtype_enum, numpy_dtype

    try:
        return numpy_dtype(dtype_enum(dtype))
    except (ValueError, TypeError, KeyError):
        raise CorruptCheckpointError(f"{path!r}: the record gives {name!r} the unknown dtype {dtype!r}") from None


def _strings(path: str, name: str, array: np.ndarray, lengths) -> np.ndarray:
    width = array.dtype.itemsize
    ok = array.dtype.kind == "S" and isinstance(lengths, list) and len(lengths) == array.size
    if not ok or not all(type(n) is int and 0 <= n <= width for n in lengths):
        raise CorruptCheckpointError(f"{path!r}: the record's string lengths do not fit {name!r}")
    rows = np.ascontiguousarray(array).reshape(-1).view(np.uint8).reshape(-1, width) if width else None
    out = np.empty(array.size, dtype=object)
    out[:] = [rows[i, :n].tobytes() for i, n in enumerate(lengths)] if rows is not None else [b""] * array.size
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


class NpzReader(FileReader):
    """An ``.npz`` archive: its arrays as restorekit's record says to read them (bfloat16 from its bits, strings exact)."""

    fmt = FORMAT
    checks = ("npz files carry no per-tensor checksum: verified means every member reads back (zip CRC-32 checked) "
              "and decodes")

    def read(self, max_output_bytes: int | None = None):
        return read(self.path, max_output_bytes=max_output_bytes)

    def read_shapes(self) -> dict:
        return read_shapes(self.path)

    def stored_tensors(self) -> dict:
        # as ``read`` gives them back (bfloat16 from its bits, strings exact), from the headers and the record
        with boundary(self.path, _WHAT), open_zip(self.path, _WHAT) as archive:
            members, notes = _members(self.path, archive)
        out = {}
        for name, member in members.items():
            note = notes.get(name)
            out[name] = (member.shape, _dtype_of(self.path, name, member, note),
                         lambda n=name, note=note: _member(self.path, n, note))
        return out

    def checkpoint(self, record):
        # npz keeps its notes in a member of its own, which only its reader reads
        return _NpzArchive(self.path, self)


def _member(path: str, name: str, note: dict | None) -> np.ndarray:
    """One tensor as ``read`` gives it back (``note``: what the record says of it)."""
    with boundary(path, _WHAT), open_zip(path, _WHAT) as archive:
        member = _Member(path, archive, archive.getinfo(name + ".npy"))
        return _restore(path, name, member.read(path, archive), note)


def _dtype_of(path: str, name: str, member: _Member, note: dict | None) -> np.dtype:
    """The numpy dtype ``_restore`` gives a member."""
    if note is None:
        return member.dtype
    dtype = note.get("dtype")
    return np.dtype(object) if dtype == "string" else _noted_dtype(path, name, dtype)


class _NpzArchive:
    """An npz file's tensors as restorekit's npz reader gives them back (bfloat16 from its bits, strings exact).

    Listed from the ``.npy`` headers and the record alone (``NpzReader.stored_tensors``):
    nothing is decompressed until a tensor is read, so a few KB of deflated zeros that
    claim gigabytes cost no memory to open, and are refused by size before any is read.
    """

    def __init__(self, path: str, reader: NpzReader):
        self._path = path
        self._stored = reader.stored_tensors()
        entries = {}
        for name, (shape, dtype, _) in self._stored.items():
            tf_dtype = tf_dtype_of(np.empty(0, dtype))
            nbytes = 0 if tf_dtype == "string" else math.prod(shape) * dtype.itemsize
            entries[name] = Entry(name, tuple(shape), tf_dtype, nbytes)
        self.entries = entries

    def read(self, name: str) -> np.ndarray:
        return self._stored[name][2]()


def detect(probe: Probe) -> int:
    if probe.members and all(m.endswith(".npy") for m in probe.members):
        return BY_BYTES
    return by_name(probe, SUFFIXES)


register(FORMAT, detect=detect, open=lambda path: FileView(path, NpzReader(path)), order=32)
