"""Numpy ``.npz`` archives, written one tensor at a time (``np.savez`` needs a whole dict); the reader is ``restorekit.formats.npz``.

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
import os
import zipfile
from typing import Iterable

import numpy as np

from restorekit.errors import InvalidArgumentError
from restorekit.formats._sink import ExportResult, atomic_output, checkpoint_entries, progress_bar, refuse, tf_dtype_of
from restorekit.formats.npz._reader import FORMAT, RECORD

__all__ = ["LAYOUTS", "write", "write_checkpoint"]

LAYOUTS = (None,)  # the layout= values write and write_checkpoint accept
_MAX_MEMBER_NAME = 0xFFFF  # the zip format's 16-bit name length



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
