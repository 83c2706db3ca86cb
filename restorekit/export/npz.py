"""Numpy ``.npz`` archives, written one tensor at a time (``np.savez`` needs a whole dict).

Each tensor is the archive member ``NAME.npy``, so ``np.load(path)[NAME]`` works with
TF names. Arrays load without pickle: bfloat16 and float8 tensors are widened to
float32 (exact values; numpy has no such dtype), string tensors become fixed-width
bytes (trailing NUL bytes are lost, as numpy strips them).
"""

from __future__ import annotations

import os
import zipfile
from typing import Iterable, Iterator

import numpy as np

from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError
from restorekit.export.base import ExportResult, atomic_output, checkpoint_entries, progress_bar, refuse, tf_dtype_of

__all__ = ["FORMAT", "SUFFIXES", "read", "read_record", "read_shapes", "recognizes", "write", "write_checkpoint"]

FORMAT = "npz"
SUFFIXES = (".npz",)
LAYOUTS = (None,)  # the layout= values write and write_checkpoint accept

_WIDENED = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _plain(array: np.ndarray) -> np.ndarray:
    dtype = tf_dtype_of(array)
    if dtype in _WIDENED:
        return array.astype(np.float32)
    if dtype == "string" and array.dtype == object:
        return np.array([v.encode() if isinstance(v, str) else bytes(v) for v in array.ravel()], dtype=bytes).reshape(
            array.shape
        )
    return array


def write(path, tensors: Iterable, *, layout: str | None = None, metadata: dict | None = None, graph=None,
          progress: bool = False) -> ExportResult:
    """Write ``(name, ndarray)`` pairs to an ``.npz`` file, holding one tensor at a time.

        write('weights.npz', ((n, ckpt.read(n)) for n in ckpt))

    ``layout`` and ``metadata`` are refused (npz keeps TF names and axes and has no
    metadata); ``graph`` only serves a layout and is ignored.

    Returns:
        An ExportResult. The file appears at ``path`` only once complete.
    """
    refuse(FORMAT, layout=layout, metadata=metadata)
    path = os.fspath(path)
    count = nbytes = 0
    with atomic_output(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        with progress_bar(None, progress, "npz") as bar:
            for name, array, *_ in tensors:
                array = _plain(np.asarray(array))
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, array, allow_pickle=False)
                count += 1
                nbytes += array.nbytes
                bar.update(array.nbytes)
    return ExportResult(path, "npz", count, nbytes)


def write_checkpoint(checkpoint, path, *, names: dict | None = None, layout: str | None = None,
                     metadata: dict | None = None, progress: bool = False) -> ExportResult:
    """Write every tensor of a TF checkpoint (or the renamed subset ``names``) to an ``.npz`` file.

    Each tensor is read (crc32c checked) and written before the next is read.
    """
    refuse(FORMAT, layout=layout, metadata=metadata)
    tensors = ((name, checkpoint.read(source)) for name, source in checkpoint_entries(checkpoint, names))
    return write(path, tensors, progress=progress)


def read_record(path) -> None:
    """npz files carry no layout record: always None."""
    return None


def recognizes(head: bytes, suffix: str) -> bool:
    """True for a zip archive named ``.npz``."""
    return head.startswith(b"PK") and suffix == ".npz"


def _open(path: str):
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"no npz file at {path!r}", path)
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise CorruptCheckpointError(f"{path!r} is not a readable npz file: {e}") from None


def read_shapes(path) -> dict:
    """Name -> shape of every array in an ``.npz`` file."""
    with _open(os.fspath(path)) as data:
        return {name: data[name].shape for name in data.files}


def read(path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, ndarray)`` for each array of an ``.npz`` file (no pickle)."""
    data = _open(os.fspath(path))

    def arrays():
        with data:
            for name in data.files:
                yield name, data[name]

    return arrays()
