"""Imports of safetensors files at copy speed: tensors whose stored bytes are their TF bytes are kernel-copied into the TF data shard.

The mirror of the export's fast path (``rawcopy.copy_raw_run``): a run of such tensors
lying back to back in one safetensors file is copied by the kernel
(``os.copy_file_range``, in a thread) while this thread computes each tensor's crc32c
for the index from the same bytes in the page cache. Tensors a layout record
transforms (axes, splits, complex pairs), string tensors, and every tensor under an
output plan still go the decoding way (``sources.tf_tensors``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from restorekit.errors import CorruptCheckpointError
from restorekit.layouts import STORED_AS
from restorekit.formats._rawcopy import _KernelCopy, write_all  # the export's kernel copy thread, shared
from restorekit.formats.safetensors._reader import SafetensorsReader, open_tensors

__all__ = ["RawRuns", "StoredBytes", "source_arrays"]

# As in the safetensors writer: the kernel copies at ``cp`` speed when the output offset
# agrees with the source offset modulo the page cache's largest folio, so a run of at
# least ALIGN_ABOVE bytes starts at such an offset of the TF shard (a hole of under
# 2 MiB before it, which no entry covers; TF reads entries by offset).
FOLIO = 2 << 20
ALIGN_ABOVE = 64 << 20
_NOTE_KEYS = {"name", "dtype"}  # what a note may say of a tensor whose bytes are kept as they are


@dataclass(frozen=True)
class StoredBytes:
    """A tensor whose TF data-shard bytes are ``size`` bytes at ``offset`` of the safetensors file ``path``."""

    path: str
    offset: int
    size: int
    shape: tuple
    dtype: np.dtype  # the stored numpy dtype; the TF dtype comes with the tensor (a stand-in such as qint8)

    @property
    def nbytes(self) -> int:
        return self.size


def _kept_as_is(record, stored: str) -> bool:
    """True when importing ``stored`` changes nothing of its bytes: no axes, parts, or complex pairs."""
    note = record.tensors.get(stored, {})
    return set(note) <= _NOTE_KEYS and note.get("dtype") in (None, *STORED_AS)


def source_arrays(reader, record, max_output_bytes: int | None = None):
    """(stored name, array or ``StoredBytes``) of every tensor of a safetensors source, or None where the
    source cannot be copied raw (another format, a big-endian machine).

    Every header is read and checked now, before anything is written: a file shorter
    than its header says is refused here (``CorruptCheckpointError``).
    """
    if not isinstance(reader.source, SafetensorsReader) or sys.byteorder != "little":
        return None
    headers = reader.source.headers()  # one file, or every shard of a set (checked against each other)
    reader.source.check_size(headers, max_output_bytes)
    return _arrays(headers, record)


def _arrays(headers: list, record):
    for path, header in headers:
        # the format's own reading verb: decoded tensors come as memory maps, read as they are written
        arrays = open_tensors(path)
        for name, info in header.tensors.items():
            array = arrays.pop(name)
            size = info.end - info.begin
            if size and _kept_as_is(record, name):
                yield name, StoredBytes(path, header.data_start + info.begin, size, info.shape, array.dtype)
            else:
                yield name, array


class RawRuns:
    """Collects ``StoredBytes`` tensors lying back to back in one file and copies each run into a TF data shard.

    ``add`` holds a tensor until its run ends; ``flush`` copies the run held (call it
    before writing anything else to the shard, and at the end).
    """

    def __init__(self, shard, bar=None):
        self.shard, self.bar = shard, bar
        self._run: list = []
        self._handles: dict = {}

    def add(self, name: str, where: StoredBytes, dtype) -> None:
        if self._run:
            last = self._run[-1][1]
            if last.path != where.path or last.offset + last.size != where.offset:
                self.flush()
        self._run.append((name, where, dtype))

    def flush(self) -> None:
        run, self._run = self._run, []
        if run:
            _copy_run(self.shard, run, self._source(run[0][1].path), self.bar)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def _source(self, path: str) -> int:
        if path not in self._handles:
            try:
                self._handles[path] = open(path, "rb", buffering=0)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path!r} is gone") from None
        return self._handles[path].fileno()


def _copy_run(shard, run: list, src: int, bar) -> None:
    """Copy one run into ``shard``: the kernel copies the bytes while this thread computes every crc32c."""
    from restorekit._bundle.writer import copy_checked

    first, last = run[0][1], run[-1][1]
    start, size = first.offset, last.offset + last.size - first.offset
    if os.fstat(src).st_size < start + size:
        raise CorruptCheckpointError(f"{first.path!r} is truncated: its tensors need bytes up to {start + size}")
    out = shard.fileno()
    if size >= ALIGN_ABOVE:
        os.lseek(out, (start - shard.nbytes) % FOLIO, os.SEEK_CUR)
    base = os.lseek(out, 0, os.SEEK_CUR)
    copy = _KernelCopy(src, out, start, size)
    crcs = []
    try:
        for name, where, _ in run:
            crc = copy_checked(src, where.offset, where.size, lambda view: None)
            if crc is None:
                raise CorruptCheckpointError(f"{where.path!r} ended inside tensor {name!r}")
            crcs.append(crc)
            if bar is not None:
                bar.update(where.size)
        copy.wait()
    except BaseException:  # the thread must be gone before the writer closes the shard
        copy.stop()
        raise
    if copy.error is not None and not isinstance(copy.error, OSError):
        raise copy.error
    if copy.done < size:  # the kernel refused or stopped part way: the rest through a buffer
        sink = os.fdopen(out, "wb", closefd=False, buffering=0)
        if copy_checked(src, start + copy.done, size - copy.done, lambda view: write_all(sink, view)) is None:
            raise CorruptCheckpointError(f"{first.path!r} ended while its tensors were copied")
    for (name, where, dtype), crc in zip(run, crcs):
        shard.add_placed(name, dtype if dtype is not None else where.dtype, where.shape,
                         base + where.offset - start, where.size, crc)
