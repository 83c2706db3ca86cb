"""Any readable source opened as a checkpoint: TF, Keras, and the safetensors, PyTorch and npz files restorekit writes.

``open_checkpoint`` is what ``inspect``, ``verify`` and ``diff`` open their paths with.
A safetensors, ``.pt`` or ``.npz`` file (or a Hugging Face set of safetensors shards)
becomes a ``FileView``: its tensors under the TF names of the checkpoint it holds (a
restorekit layout record undone; a file from elsewhere keeps its stored names), each
read on demand, one at a time (an npz file is read through once on opening, one tensor
at a time, since its exact dtypes live in its reader's notes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Mapping

import numpy as np

from restorekit.bundle.verification import Problem, VerifyResult
from restorekit.errors import CorruptCheckpointError

__all__ = ["FileView", "FileVerifyResult", "open_checkpoint"]

# What verify can promise per format: safetensors carries no checksum at all; the zip
# formats carry zip's CRC-32 per record, which the readers check as they read.
_CHECKS = {
    "safetensors": "safetensors carries no checksum: verified means the header is consistent (dtypes, shapes, "
                   "byte ranges tiling the data) and every tensor reads back and decodes",
    "torch": "PyTorch files carry no per-tensor checksum: verified means every storage record matches its zip "
             "CRC-32 and every tensor reads back and decodes",
    "npz": "npz files carry no per-tensor checksum: verified means every member reads back (zip CRC-32 checked) "
           "and decodes",
}


def open_checkpoint(path):
    """A checkpoint-like view of ``path``: ``Checkpoint`` for TF and Keras, ``FileView`` for other formats.

    An object that is already open (has ``entries`` and ``read``) is returned as it is.

        ckpt = open_checkpoint('model.safetensors')
        ckpt.entries['dense/kernel'].shape, ckpt.read('dense/kernel')

    Raises:
        CheckpointNotFoundError: nothing readable at ``path``.
        CorruptCheckpointError: the file is not a readable file of the format it claims.
    """
    if hasattr(path, "entries") and hasattr(path, "read"):
        return path
    from restorekit.checkpoint import Checkpoint
    from restorekit.export.conversions import source_format
    from restorekit.keras_files import is_keras_path

    if is_keras_path(path):
        return Checkpoint(path)
    fmt = source_format(path)
    if fmt == "tf":
        return Checkpoint(path)
    return FileView(path, fmt)


class FileView:
    """A non-TF file read as the TF checkpoint it holds, with the verbs ``inspect`` and ``diff`` use.

    ``entries`` (name -> ``Entry``), ``read(name)``, ``readable_name``, ``object_paths``
    (from the object graph a TF2 checkpoint's conversion carries along), ``verify``.
    """

    def __init__(self, path, fmt: str):
        from restorekit.export import sources
        from restorekit.export.layouts import LayoutRecord

        from restorekit.export.reading import boundary

        self.prefix = os.fspath(path)
        self.format = fmt
        self._reader = sources.reader(self.prefix, fmt)
        found = self._reader.read_record()
        self.record_layout = found.layout if found is not None else None  # 'torch': undone, TF names and axes
        with boundary(self.prefix, f"{fmt} file"):
            if fmt == "npz":  # npz keeps its notes in a member of its own, which only its reader reads
                self._file = _NpzArchive(self.prefix, self._reader)
            else:
                self._file = sources.FileCheckpoint(self._reader, found if found is not None else LayoutRecord())
        self.entries: Mapping = MappingProxyType(dict(self._file.entries))

    def __repr__(self) -> str:
        return f"FileView({self.prefix!r}, {self.format!r}, {len(self.entries)} tensors)"

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` (a TF name), read from the file now."""
        from restorekit.errors import NoMatchError
        from restorekit.export.reading import boundary

        if name not in self.entries:
            raise NoMatchError(f"{self.prefix!r} has no tensor {name!r}.", name=name, candidates=list(self.entries))
        with boundary(self.prefix, f"{self.format} file"):
            return np.asarray(self._file.read(name))

    @cached_property
    def _graph(self):
        if "_CHECKPOINTABLE_OBJECT_GRAPH" not in self.entries:
            return None
        from restorekit.bundle.objectgraph import decode_object_graph

        raw = self.read("_CHECKPOINTABLE_OBJECT_GRAPH")  # from the record, or an npz member of bytes
        try:
            return decode_object_graph(bytes(raw.item())) if raw.shape == () else None
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{self.prefix!r}: {e}") from None

    @property
    def is_object_based(self) -> bool:
        return self._graph is not None

    @cached_property
    def object_paths(self) -> Mapping[str, str]:
        """Readable path -> name, when the file carries a TF2 object graph (empty otherwise)."""
        graph = self._graph
        if graph is None:
            return MappingProxyType({})
        return MappingProxyType({v.path: v.key for v in graph.variables if v.key in self.entries})

    def readable_name(self, name: str) -> str:
        graph = self._graph
        tracked = graph.by_key.get(name) if graph is not None else None
        return tracked.path if tracked is not None else name

    def verify(self, *, progress: bool = False) -> "FileVerifyResult":
        """Read every tensor back, one at a time, as stored and as decoded; list what fails.

        The format's own checks run as it reads (torch: each storage record's zip CRC-32;
        npz: each member's; safetensors has none, its header was checked on opening).

        Returns:
            A ``FileVerifyResult``: ``ok`` when every tensor read back.
        """
        from tqdm import tqdm

        from restorekit.export.reading import boundary

        problems = []
        stored = 0
        try:  # the format's reader: one stored tensor at a time, its checks on the way
            with boundary(self.prefix, f"{self.format} file"):
                for _, array in self._reader.read():
                    stored += array.nbytes
                    del array
        except CorruptCheckpointError as e:
            problems.append(Problem(os.path.basename(self.prefix), "corrupt", str(e)))
        checked = 0
        names = list(self.entries)
        for name in tqdm(names, desc="verify", disable=None if progress else True, leave=False):
            try:  # and as the TF tensor it holds: a split tensor joined, its record undone
                checked += self.read(name).nbytes
            except CorruptCheckpointError as e:
                if all(p.message != str(e) for p in problems):  # the stored pass may have said it already
                    problems.append(Problem(name, "corrupt", str(e)))
        return FileVerifyResult(self.prefix, len(names), max(stored, checked), tuple(problems),
                                checks=_CHECKS.get(self.format, ""))


class _NpzArchive:
    """An npz file's tensors as restorekit's npz reader gives them back (bfloat16 from its bits, strings exact).

    Listing reads the archive through once, one tensor at a time, since the exact dtypes
    live in the reader's notes; ``read`` then takes one member alone.
    """

    def __init__(self, path: str, reader):
        from restorekit.checkpoint import Entry
        from restorekit.export.base import tf_dtype_of

        self._path = path
        self._strings = {}
        entries = {}
        for name, array in reader.read():
            dtype = tf_dtype_of(array)
            entries[name] = Entry(name, tuple(array.shape), dtype, 0 if dtype == "string" else array.nbytes)
            if dtype == "string":  # object-graph sized: kept as the reader restored them (exact lengths)
                self._strings[name] = array
            del array
        self.entries = entries

    def read(self, name: str) -> np.ndarray:
        from restorekit.bundle.format import dtype_enum, numpy_dtype

        if name in self._strings:
            return self._strings[name]
        with np.load(self._path, allow_pickle=False) as data:
            array = data[name]
        target = numpy_dtype(dtype_enum(self.entries[name].dtype))
        return array if array.dtype == target else np.ascontiguousarray(array).view(target)


@dataclass(frozen=True)
class FileVerifyResult(VerifyResult):
    """``VerifyResult`` of a non-TF file; its ``checks`` line says what its format lets verify check."""
