"""One source tensor read a chunk of elements at a time, in its stored dtype: what keeps a merge to a few chunks.

A merge never holds a source's tensor as float64. Where a tensor's bytes lie in a file as
stored (a TF data shard's range, crc32c checked first; or the file map a safetensors
reader hands out), each chunk is read with ``preadv`` into a small buffer, so neither the
heap nor the process's resident pages grow with the model (the page cache holds the
file, as it would for ``cp``). Any other tensor (a Keras dataset that is not contiguous,
a ``.pt`` or ``.npz`` member) is read once in its stored dtype and sliced. Each chunk is
handed to the method as a fresh float64 array it may write into.
"""

from __future__ import annotations

import mmap

import numpy as np

from restorekit.errors import CorruptCheckpointError

__all__ = ["CHUNK", "Stream", "spans"]

# Elements per chunk: 1 MiB as float64, so a method's temporaries stay a few MiB whatever the tensor.
CHUNK = 1 << 17


def spans(size: int, chunk: int = CHUNK):
    """The slices of ``range(size)`` ``chunk`` elements at a time, in order."""
    for start in range(0, size, chunk):
        yield slice(start, min(start + chunk, size))


def _mapped(array: np.ndarray) -> tuple[str, int] | None:
    """(file, byte offset) of ``array``'s bytes when it is a C-contiguous, native-order view into a file map
    (``np.memmap``, as the safetensors reader gives its tensors), else None."""
    if not (array.flags.c_contiguous and array.dtype.isnative):
        return None
    here = array.__array_interface__["data"][0]
    node: object = array
    while isinstance(node, np.ndarray):
        parent = node.base
        if isinstance(node, np.memmap) and isinstance(parent, mmap.mmap) and isinstance(node.filename, str):
            # the memmap that made the map: its first byte is the file's byte ``offset``
            return node.filename, int(node.offset) + here - node.__array_interface__["data"][0]
        node = parent
    return None


class Stream:
    """Tensor ``name`` of an open source (``_pipeline.Input.ckpt``), read by element ranges as float64."""

    def __init__(self, ckpt, name: str):
        from restorekit._merging._pipeline import numpy_dtype

        entry = ckpt.entries[name]
        self.name = name
        self.shape = tuple(entry.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        self.dtype = np.dtype(numpy_dtype(entry.dtype))
        self._array: np.ndarray | None = None
        self._file: tuple[str, int] | None = None
        stored_range = getattr(ckpt, "stored_range", None)  # a layout's or rule set's view has none
        where = stored_range(name) if stored_range is not None else None
        if where is not None and where[2] == self.size * self.dtype.itemsize:
            check = getattr(ckpt, "check", None)
            if check is not None:
                check(name)  # a TF checkpoint's crc32c, in 1 MiB chunks, before any byte is used
            self._file = (where[0], where[1])
            return
        array = np.asarray(ckpt.read(name))
        self._file = _mapped(array)
        if self._file is None:
            self._array = array.reshape(-1)
        del array

    def read(self, span: slice) -> np.ndarray:
        """Elements ``span`` of the flattened tensor, as a fresh float64 array."""
        if self._array is not None:
            return self._array[span].astype(np.float64)
        from restorekit._bundle.files import read_into

        path, offset = self._file  # type: ignore[misc]
        raw = np.empty(span.stop - span.start, self.dtype)
        if read_into(path, offset + span.start * self.dtype.itemsize, raw.view(np.uint8)) != raw.nbytes:
            raise CorruptCheckpointError(f"{path!r} is truncated: {self.name!r} needs bytes up to "
                                         f"{offset + span.stop * self.dtype.itemsize}")
        return raw.astype(np.float64)
