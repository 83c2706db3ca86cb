"""What the file formats (safetensors, PyTorch, npz) share: a reader's verbs, and the Source over them.

Each format module (``restorekit.formats.safetensors``, ``torch``, ``npz``) defines a
``FileReader`` subclass, reading its files as stored (names and axes of the file), and
registers ``FileView(path, reader)`` as its Source. A ``FileView`` shows the file's
tensors under the TF names of the checkpoint it holds (a restorekit layout record
undone; a file from elsewhere keeps its stored names), each read on demand, one at a
time (``FileCheckpoint``; npz has its own, since its exact dtypes live in its reader's
notes). Sharding is the reader's business: a set of safetensors shards is one more
reader with the same verbs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import numpy as np

from restorekit._bundle.verification import Problem, VerifyResult
from restorekit._checkpoint import OBJECT_GRAPH_KEY, Checkpoint, Entry
from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError, EntryNotFoundError
from restorekit.formats._sink import tf_dtype_of
from restorekit.layouts import LayoutRecord, restore_dtype
from restorekit.formats._reading import boundary
from restorekit._registry import BY_NAME, EntryMapping, Probe

__all__ = ["FileCheckpoint", "FileReader", "FileVerifyResult", "FileView", "by_name", "tf_shapes"]

class FileReader:
    """One file of a format, read as stored. A format subclasses it with the verbs below.

    ``read(max_output_bytes)`` yields ``(stored name, ndarray)`` one tensor at a time;
    ``read_shapes()`` gives stored name -> shape, ``read_record()`` restorekit's layout
    record or None; ``stored_tensors()`` gives stored name -> (shape, numpy dtype, a
    function reading the array), reading no tensor data; ``checkpoint(record)`` is the
    file under TF names (``FileCheckpoint`` by default). ``files`` lists every file it
    reads (an output must be none of them).

    Raises:
        CheckpointNotFoundError: no file at ``path`` (on construction).
    """

    fmt = ""
    checks = ""  # what verify can promise of this format, in words (the formats carry different checksums)

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise CheckpointNotFoundError(f"no file at {self.path!r}", self.path)
        self.files: tuple[str, ...] = (self.path,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def read(self, max_output_bytes: int | None = None):
        raise NotImplementedError

    def read_shapes(self) -> dict:
        raise NotImplementedError

    def read_record(self) -> LayoutRecord | None:
        return None

    def stored_tensors(self) -> dict:
        raise NotImplementedError

    def checkpoint(self, record: LayoutRecord):
        return FileCheckpoint(self, record)


class FileView(EntryMapping):
    """A non-TF file read as the TF checkpoint it holds: a ``Source`` (see ``restorekit._registry``).

    ``entries`` (name -> ``Entry``), ``read(name)``, ``readable_name``, ``object_paths``
    and ``object_graph`` (from the object graph a TF2 checkpoint's conversion carries
    along), ``verify``. ``stored_range`` is always None: the tensors are decoded from the
    file (their layout record undone), never copied as TF shard bytes.
    """

    def __init__(self, path, reader: "FileReader", *, stored: bool = False, record: LayoutRecord | None = None):
        self.prefix = os.fspath(path)
        self.format = fmt = reader.fmt
        self._reader = reader
        # stored: names and axes as in the file; record: a record the file lacks (guessed from its PyTorch names)
        found = record if record is not None else None if stored else reader.read_record()
        self.record_layout = found.layout if found is not None else None  # 'torch': undone, TF names and axes
        self._record = found
        # the file's own record as read here, for a conversion of this view to reuse (not read: stored or guessed)
        self._file_record = (found,) if record is None and not stored else ()
        with boundary(self.prefix, f"{fmt} file"):
            self._file = reader.checkpoint(found if found is not None else LayoutRecord())
        self._entries: Mapping = MappingProxyType(dict(sorted(self._file.entries.items())))

    @property
    def entries(self) -> Mapping:
        return self._entries

    def stored_view(self) -> "FileView":
        """The same file read as stored: the file's own names and axes, no layout record undone
        (``self`` itself when nothing was undone)."""
        return self if self._record is None else FileView(self.prefix, self._reader, stored=True)

    def stored_names(self) -> dict[str, str]:
        """TF name -> the stored name it came from, for each entry the layout record maps one to one
        (a renaming and an axes permutation); an entry stored under its own name maps to itself."""
        if self._record is None:
            return {name: name for name in self.entries}
        out: dict[str, str] = {}
        for stored, how in self._record.tensors.items():
            name = how.get("name", stored) if isinstance(how, dict) else stored
            if name in self.entries and name not in out:
                out[name] = stored
        held = set(self.stored_view().entries)
        for name in self.entries:
            if name not in out and name in held:
                out[name] = name
        return out

    @property
    def metadata(self) -> dict:
        """The file's plain values beside its tensors, by path (a torch training checkpoint's ``step``), else {}."""
        values = getattr(self._reader, "metadata", None)
        return values() if values is not None else {}

    def file_record(self) -> tuple:
        """``(the file's layout record or None,)`` as read when this view opened, or ``()`` when it did not
        read it (a view as stored, or one given a guessed record): a conversion reads it only then."""
        return self._file_record

    @property
    def reader(self) -> "FileReader":
        """The format's reader this view reads through: what a conversion of the file streams from, so
        converting an open view opens nothing again."""
        return self._reader

    def __repr__(self) -> str:
        return f"FileView({self.prefix!r}, {self.format!r}, {len(self.entries)} tensors)"

    # -- mapping protocol: registry.EntryMapping, name -> Entry
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

    def stored_entry(self, name: str) -> tuple | None:
        """(the name as the file stores it, its stored shape) of entry ``name``, where a layout record renamed it."""
        if self.record_layout is None or name not in self.entries:
            return None
        return self._file.stored_entry(name)

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
        if name not in self.entries:
            if name == "_CHECKPOINTABLE_OBJECT_GRAPH":
                raise self._unknown(name)
            name = self.key(name)
        with boundary(self.prefix, f"{self.format} file"):
            return np.asarray(self._file.read(name))

    def like(self, name: str, array):
        """``array`` (an optimizer slot of the stored tensor behind ``name``) in ``name``'s axes, as :meth:`read`
        gives ``name``; None where ``name`` is no one stored tensor."""
        return self._file.like(name, array) if hasattr(self._file, "like") else None

    @cached_property
    def _graph(self):
        if "_CHECKPOINTABLE_OBJECT_GRAPH" not in self.entries:
            return None
        from restorekit._bundle.objectgraph import decode_object_graph

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
                                checks=self._reader.checks)


@dataclass(frozen=True)
class FileVerifyResult(VerifyResult):
    """``VerifyResult`` of a non-TF file; its ``checks`` line says what its format lets verify check."""


def _tf_piece_shape(note: dict, shape: tuple) -> tuple:
    """The TF shape of one stored tensor (or of the piece of a TF tensor it holds), from its note."""
    from restorekit.layouts import invert

    ops = note.get("ops", {})
    if "view" in ops:
        shape = tuple(int(d) for d in ops["view"][0])
    perm = ops.get("perm", note.get("perm"))
    if perm is not None:
        shape = tuple(shape[i] for i in invert(perm))
    if "split" in ops:  # undone last, as ops.backward undoes it
        shape = tuple(int(d) for d in ops["split"][0])
    return shape


def _joined_shape(pieces: list) -> tuple:
    """The shape of a TF tensor stored in pieces ``[(take, shape)]`` (``take`` as ``ops.take``)."""
    if len(pieces) == 1 and pieces[0][0] is None:
        return pieces[0][1]
    take, shape = pieces[0]
    axis = take[0]
    if len(take) == 2:  # rows taken one by one: stacked back along a new axis
        return shape[:axis] + (len(pieces),) + shape[axis:]
    return shape[:axis] + (sum(s[axis] for _, s in pieces),) + shape[axis + 1:]


def _tf_layout(stored_shapes, record) -> list:
    """[(TF name, TF shape, [stored names])] of the numeric tensors of a file, in the order
    ``LayoutRecord.restore_all`` yields them: a tensor stored in parts when its last part
    comes, added tensors (``drop``) left out."""
    parts: dict[str, int] = {}
    for stored, note in record.tensors.items():
        if "drop" not in note:
            parts[note.get("name", stored)] = parts.get(note.get("name", stored), 0) + 1
    pieces: dict[str, list] = {}
    out = []
    for stored, shape in stored_shapes:
        note = record.tensors.get(stored, {})
        if "drop" in note:
            continue
        name = note.get("name", stored)
        pieces.setdefault(name, []).append((stored, note, tuple(shape)))
        if len(pieces[name]) < parts.get(name, 1):
            continue
        group = pieces.pop(name)
        main = [(n.get("ops", {}).get("take"), _tf_piece_shape(n, s)) for _, n, s in group if "sum" not in n]
        shape = _joined_shape(main or [(None, _tf_piece_shape(group[0][1], group[0][2]))])
        if any(n.get("dtype") == "complex128" for _, n, _ in group):
            shape = shape[:-1]
        out.append((name, shape, [s for s, _, _ in group]))
    return out


def tf_shapes(shapes: dict, record) -> dict:
    """TF name -> TF shape of every tensor of a file, through its layout record (string tensors too):
    the pieces of a split tensor joined, tensors added for PyTorch left out."""
    out = {name: shape for name, shape, _ in _tf_layout(shapes.items(), record)}
    for name, item in record.strings.items():
        out[name] = tuple(item["shape"])
    return out


class FileCheckpoint:
    """A non-TF source seen as the TF checkpoint it holds: entries under TF names (the record undone),
    each read on demand (the parts of a split tensor joined). Duck-types what ``torch_view`` and the
    writers read of a ``Checkpoint``, so a file-to-file conversion to layout 'torch' maps whole layers
    as an export from the TF checkpoint does. Nothing is copied as raw bytes."""

    def __init__(self, reader: "FileReader", record):
        self.prefix = reader.path
        self._record = record
        self._stored = reader.stored_tensors()
        self._parts = {}
        entries = {}
        for name, shape, parts in _tf_layout(((n, s[0]) for n, s in self._stored.items()), record):
            notes = [record.tensors.get(p, {}) for p in parts]
            dtype = next((n["dtype"] for n in notes if "dtype" in n), None)
            if dtype is None:
                dtype = tf_dtype_of(np.empty(0, self._stored[parts[0]][1]))
            nbytes = sum(int(np.prod(self._stored[p][0], dtype=np.int64)) * self._stored[p][1].itemsize for p in parts)
            entries[name] = Entry(name, tuple(shape), dtype, nbytes)
            self._parts[name] = parts
        self._strings = dict(record.string_tensors())
        for name, array in self._strings.items():
            entries[name] = Entry(name, tuple(array.shape), "string", 0)
        self.entries = entries
        self.is_object_based = OBJECT_GRAPH_KEY in self._strings

    @property
    def object_graph(self):
        return self._record.object_graph()

    def like(self, name: str, array):
        """``array``, shaped as the stored tensor behind ``name`` (an optimizer slot of it), in ``name``'s TF axes;
        None where ``name`` is not one stored tensor."""
        parts = self._parts.get(name)
        if parts is None or len(parts) != 1:
            return None
        record = LayoutRecord(self._record.layout, {p: self._record.tensors[p] for p in parts if p in self._record.tensors})
        for _, out, _ in record.restore_all([(parts[0], array)]):
            return out
        return None

    def read(self, name: str) -> np.ndarray:
        if name in self._strings:
            return self._strings[name]
        parts = self._parts[name]
        # the notes of this tensor alone: restore_all then joins just its parts
        record = LayoutRecord(self._record.layout, {p: self._record.tensors[p] for p in parts if p in self._record.tensors})
        for _, array, dtype in record.restore_all((p, self._stored[p][2]()) for p in parts):
            return restore_dtype(array, dtype)
        raise CorruptCheckpointError(f"{self.prefix!r}: {name!r} could not be read back")  # every part was an added one

    def is_partitioned(self, name: str) -> bool:
        return True  # decoded from the file, never copied as TF shard bytes

    def readable_name(self, name: str) -> str:
        return name

    def stored_entry(self, name: str) -> tuple | None:
        """(the stored name, its stored shape) that TF tensor ``name`` is read from (the first of its parts)."""
        parts = self._parts.get(name)
        return None if not parts else (parts[0], tuple(self._stored[parts[0]][0]))


def by_name(probe: Probe, suffixes) -> int:
    """A file (or a missing path) named as this format claims it by name: its reader says what is wrong with it."""
    return BY_NAME if not probe.is_dir and probe.suffix in suffixes else 0


# isinstance(Checkpoint('model.safetensors'), Checkpoint) holds, as for Keras files.
Checkpoint.register(FileView)
