"""The safetensors (one file or a Hugging Face shard set), PyTorch and npz formats as Sources.

A ``FileView`` shows such a file's tensors under the TF names of the checkpoint it
holds (a restorekit layout record undone; a file from elsewhere keeps its stored
names), each read on demand, one at a time (an npz file is read through once on
opening, one tensor at a time, since its exact dtypes live in its reader's notes).
The readers themselves are the export format modules (``restorekit.export.safetensors``,
``torch``, ``npz``), imported only when a file is opened.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Iterator

import numpy as np

from restorekit.bundle.verification import Problem, VerifyResult
from restorekit.checkpoint import Checkpoint
from restorekit.errors import CorruptCheckpointError, EntryNotFoundError
from restorekit.formats.registry import BY_BYTES, BY_NAME, Probe, register

__all__ = ["FileView", "FileVerifyResult"]

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
_SAFETENSORS_INDEX = ".safetensors.index.json"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class FileView(Mapping):
    """A non-TF file read as the TF checkpoint it holds: a ``Source`` (see ``restorekit.formats.registry``).

    ``entries`` (name -> ``Entry``), ``read(name)``, ``readable_name``, ``object_paths``
    and ``object_graph`` (from the object graph a TF2 checkpoint's conversion carries
    along), ``verify``. ``stored_range`` is always None: the tensors are decoded from the
    file (their layout record undone), never copied as TF shard bytes.
    """

    def __init__(self, path, fmt: str, *, stored: bool = False):
        from restorekit.export import sources
        from restorekit.export.layouts import LayoutRecord

        from restorekit.export.reading import boundary

        self.prefix = os.fspath(path)
        self.format = fmt
        self._reader = sources.reader(self.prefix, fmt)
        found = None if stored else self._reader.read_record()  # stored: names and axes as in the file
        self.record_layout = found.layout if found is not None else None  # 'torch': undone, TF names and axes
        with boundary(self.prefix, f"{fmt} file"):
            if fmt == "npz":  # npz keeps its notes in a member of its own, which only its reader reads
                self._file = _NpzArchive(self.prefix, self._reader)
            else:
                self._file = sources.FileCheckpoint(self._reader, found if found is not None else LayoutRecord())
        self.entries: Mapping = MappingProxyType(dict(sorted(self._file.entries.items())))

    def __repr__(self) -> str:
        return f"FileView({self.prefix!r}, {self.format!r}, {len(self.entries)} tensors)"

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    # -- mapping protocol: name -> Entry
    def __getitem__(self, name: str):
        try:
            return self.entries[name]
        except KeyError:
            raise self._unknown(name) from None

    def __contains__(self, name) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def _unknown(self, name: str) -> EntryNotFoundError:
        return EntryNotFoundError(f"{self.prefix!r} has no tensor {name!r}.", name=name,
                                  candidates=list(self.entries) + list(self._paths()))

    def _paths(self) -> Mapping[str, str]:
        try:
            return self.object_paths
        except CorruptCheckpointError:
            return {}

    def key(self, name: str) -> str:
        """The name of ``name``: a name itself, or the one saved under a TF2 readable path."""
        if name in self.entries:
            return name
        key = self._paths().get(name)
        if key is None:
            raise self._unknown(name)
        return key

    def stored_range(self, name: str) -> None:
        """None: a file's tensors are decoded through its layout record, never copied as stored."""
        self.key(name)
        return None

    def is_partitioned(self, name: str) -> bool:
        return True  # what writers ask before a raw copy: never for a decoded file

    def check_shards(self) -> None:
        """Nothing to do: the file (each safetensors shard) was checked when it was opened."""

    def read_many(self, names) -> list:
        return [self.read(n) for n in names]

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` (a TF name, or a TF2 readable path), read from the file now.

        Raises:
            EntryNotFoundError: no such tensor (lists the closest names).
            CorruptCheckpointError: the file cannot be read.
        """
        from restorekit.export.reading import boundary

        if name not in self.entries:
            if name == "_CHECKPOINTABLE_OBJECT_GRAPH":
                raise self._unknown(name)
            name = self.key(name)
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

    @property
    def object_graph(self):
        """The TF2 object graph the file carries (a converted TF2 checkpoint), else None."""
        return self._graph

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


# -- detection and registration

def _by_name(probe: Probe, suffixes) -> int:
    """A file (or a missing path) named as this format claims it by name: its reader says what is wrong with it."""
    return BY_NAME if not probe.is_dir and probe.suffix in suffixes else 0


def _safetensors(probe: Probe) -> int:
    if probe.is_dir:
        names = probe.listing
        if "checkpoint" in names or any(n.endswith(".index") for n in names):
            return 0  # a TF checkpoint directory, even with a safetensors file beside it
        if any(n.endswith(_SAFETENSORS_INDEX) for n in names) or any(n.endswith(".safetensors") for n in names):
            return BY_BYTES
        return 0
    head = probe.head
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20):
        return BY_BYTES
    if probe.lower.endswith(".index.json") and head.lstrip()[:1] == b"{":
        return BY_BYTES
    return _by_name(probe, (".safetensors",))


def _npz(probe: Probe) -> int:
    if probe.members and all(m.endswith(".npy") for m in probe.members):
        return BY_BYTES
    return _by_name(probe, (".npz",))


def _torch(probe: Probe) -> int:
    if probe.members is not None and any(m == "data.pkl" or m.endswith("/data.pkl") for m in probe.members):
        return BY_BYTES
    if probe.members is None and probe.head[:1] == b"\x80" and probe.head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        # torch.save's legacy format: a bare pickle (PROTO opcode, protocol 2 to 5)
        return BY_BYTES
    return _by_name(probe, _TORCH_SUFFIXES)


def _opener(fmt: str):
    return lambda path: FileView(path, fmt)


register("safetensors", detect=_safetensors, open=_opener("safetensors"), order=30)
register("torch", detect=_torch, open=_opener("torch"), order=31)
register("npz", detect=_npz, open=_opener("npz"), order=32)

# isinstance(Checkpoint('model.safetensors'), Checkpoint) holds, as for Keras files.
Checkpoint.register(FileView)
