"""The non-TF sources of a conversion (one file of a format, or a set of safetensors shards), read back to TF names."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidArgumentError
from restorekit.export import formats, sharded
from restorekit.export.base import PlannedCheckpoint
from restorekit.export.options import OBJECT_GRAPH_KEY, OutputPlan, out_shape, plan_output
from restorekit.names import is_weight

__all__ = ["FileCheckpoint", "Reader", "file_plan", "file_sizes", "open_source", "reader", "shard_set", "source_nbytes",
           "tf_shapes", "tf_sizes", "tf_tensors"]


def shard_set(path: str):
    """The safetensors shard set at ``path``, or None (also for any directory holding a TF checkpoint)."""
    if os.path.isdir(path):
        names = os.listdir(path)
        if "checkpoint" in names or any(n.endswith(".index") for n in names):
            return None
    elif not path.endswith(".index.json"):
        return None
    return sharded.find(path)


@dataclasses.dataclass(frozen=True)
class Reader:
    """A non-TF source: one file of a format module, or a set of safetensors shards."""

    path: str
    fmt: str
    files: tuple
    source: object  # the path the verbs take (a ShardSet for shards)
    module: object

    def read(self, max_output_bytes: int | None = None):
        # Passed only when set, so a format whose read takes no limit still reads by default.
        limit = {} if max_output_bytes is None else {"max_output_bytes": max_output_bytes}
        return self.module.read(self.source, **limit)

    def read_shapes(self) -> dict:
        return self.module.read_shapes(self.source)

    def read_record(self):
        return self.module.read_record(self.source)


def reader(src: str, fmt: str) -> Reader:
    shards = shard_set(src) if fmt == "safetensors" else None
    if shards is not None:
        return Reader(src, fmt, tuple(shards.files) + ((shards.index,) if shards.index else ()), shards, sharded)
    if not os.path.isfile(src):
        raise CheckpointNotFoundError(f"no file at {src!r}", src)
    return Reader(src, fmt, (src,), src, formats.module(fmt))


def source_nbytes(reader: Reader) -> int:
    """About how many tensor bytes a non-TF source holds, from its files' sizes and zip directories
    (nothing is read or decompressed): what a conversion of it writes, for the free-space check."""
    import zipfile

    total = 0
    for path in reader.files:
        size = os.path.getsize(path)
        if zipfile.is_zipfile(path):
            try:
                with zipfile.ZipFile(path) as archive:
                    # deflated .npz members expand: count them as they will be written
                    size = max(size, sum(info.file_size for info in archive.infolist()))
            except (zipfile.BadZipFile, OSError):
                pass  # the reader reports a damaged archive with its own words
        total += size
    return total


def _tf_piece_shape(note: dict, shape: tuple) -> tuple:
    """The TF shape of one stored tensor (or of the piece of a TF tensor it holds), from its note."""
    from restorekit.export.layout import invert

    ops = note.get("ops", {})
    if "view" in ops:
        shape = tuple(int(d) for d in ops["view"][0])
    perm = ops.get("perm", note.get("perm"))
    if perm is not None:
        shape = tuple(shape[i] for i in invert(perm))
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


def open_source(reader: Reader, layout: str | None, max_output_bytes: int | None = None):
    """(iterator of (stored name, array), LayoutRecord) of a non-TF source."""
    from restorekit.export.layout import LayoutRecord, guess_tf_names

    record = reader.read_record()
    if record is None:
        record = guess_tf_names(reader.read_shapes()) if layout == "torch" else LayoutRecord()
    return reader.read(max_output_bytes), record


def file_plan(reader: Reader, record, options) -> OutputPlan | None:
    if not options.planned:
        return None
    shapes = tf_shapes(reader.read_shapes(), record)
    graph = record.object_graph() if options.weights_only or options.ema else None
    strings = dict(record.string_tensors()) if OBJECT_GRAPH_KEY in record.strings else {}
    return plan_output(shapes, graph=graph, graph_bytes=lambda: strings[OBJECT_GRAPH_KEY].item(), rules=options.rules,
                       weights_only=options.weights_only, ema=options.ema)


def tf_tensors(arrays, record, plan: OutputPlan | None = None):
    """(name, array, TF dtype name or None) for every tensor of a source, strings last; under ``plan``,
    only those it keeps, under their output names and in their output axes.

    The record is undone for the file as a whole (``layouts.tf_tensors``): the parts of a
    split tensor are joined and tensors added for PyTorch left out.
    """
    from restorekit.export.layouts import tf_tensors as restored

    if plan is None:
        yield from restored(arrays, record)
        return
    wanted = {source: out for out, source in plan.names.items()}
    for name, array, dtype in restored(arrays, record):
        if name not in wanted:
            continue
        if dtype != "string":
            array = plan.apply(wanted[name], array)
        elif name == OBJECT_GRAPH_KEY and plan.graph is not None:
            array = np.array(plan.graph, dtype=object)
        yield wanted[name], array, dtype


def file_sizes(reader: Reader, record, plan: OutputPlan | None) -> list:
    """(output name, shape, bytes) of every numeric tensor of a safetensors source, in the order
    ``tf_tensors`` yields them."""
    if reader.module is not sharded and reader.fmt != "safetensors":
        raise InvalidArgumentError(f"max_shard_size= splits TF checkpoints and safetensors files; convert this "
                                   f"{reader.fmt} file to a TF checkpoint first")
    from restorekit.export import safetensors

    files = reader.source.files if reader.module is sharded else (reader.source,)
    wanted = {source: out for out, source in plan.names.items()} if plan is not None else None
    infos = {}
    for path in files:
        infos.update(safetensors.read_header(path).tensors)
    sizes = []
    for name, shape, stored in _tf_layout(((n, info.shape) for n, info in infos.items()), record):
        if wanted is not None:
            if name not in wanted:
                continue
            name = wanted[name]
            shape = out_shape(plan, name, shape)
        sizes.append((name, shape, sum(infos[s].end - infos[s].begin for s in stored)))
    return sizes


def tf_sizes(reader: Reader, record, plan: OutputPlan | None) -> list:
    """(output name, bytes) of every tensor of a source (strings count 0), from headers and shapes only:
    what balancing an import over several TF data shards needs."""
    entries = FileCheckpoint(reader, record).entries
    if plan is None:
        return [(name, entry.nbytes) for name, entry in entries.items()]
    return [(out, entries[src].nbytes) for out, src in plan.names.items() if src in entries]


def _stored_tensors(reader: Reader) -> dict:
    """Stored name -> (shape, numpy dtype, function reading the array) of every numeric tensor of a source,
    without reading any tensor's data."""
    from restorekit.export import safetensors

    if reader.fmt == "safetensors":
        files = reader.source.files if reader.module is sharded else (reader.source,)
        out = {}
        for path in files:
            for name, array in safetensors.open_tensors(path).items():
                out[name] = (tuple(array.shape), array.dtype, lambda a=array: a)
        return out
    if reader.fmt == "torch":
        from restorekit.export.torch import load, to_numpy

        state, _ = load(reader.source)
        return {name: (tuple(t.shape), to_numpy(t.reshape(-1)[:0]).dtype, lambda t=t: to_numpy(t))
                for name, t in state.items()}
    if reader.fmt == "npz":
        return _npz_tensors(reader.source)
    raise InvalidArgumentError(f"layout='torch' cannot read {reader.fmt} files as a whole; convert to a TF checkpoint first")


def _npz_tensors(path: str) -> dict:
    import zipfile

    out = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if not member.endswith(".npy"):
                continue
            with archive.open(member) as f:
                major, _ = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
            name = member[: -len(".npy")]
            out[name] = (tuple(shape), dtype, lambda n=name: _npz_read(path, n))
    return out


def _npz_read(path: str, name: str) -> np.ndarray:
    with np.load(path, allow_pickle=False) as data:
        return data[name]


class FileCheckpoint:
    """A non-TF source seen as the TF checkpoint it holds: entries under TF names (the record undone),
    each read on demand (the parts of a split tensor joined). Duck-types what ``torch_view`` and the
    writers read of a ``Checkpoint``, so a file-to-file conversion to layout 'torch' maps whole layers
    as an export from the TF checkpoint does. Nothing is copied as raw bytes."""

    def __init__(self, reader: Reader, record):
        from restorekit.checkpoint import Entry
        from restorekit.export.base import tf_dtype_of

        self.prefix = reader.path
        self._record = record
        self._stored = _stored_tensors(reader)
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

    def read(self, name: str) -> np.ndarray:
        from restorekit.export.layouts import LayoutRecord, restore_dtype

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


def keras_source(ckpt, *, weights_only: bool = False):
    """A Keras file (``KerasCheckpoint``) as the checkpoint it holds under readable paths (``enc1/kernel``),
    the names scan, TF checkpoints and layout 'torch' use; ``weights_only`` leaves out its optimizer group.
    Its ``stored_range`` lets the safetensors writer copy the bytes of plain datasets as they lie in the file.
    A ``.keras`` archive's weights member is checked against its zip CRC-32 first (a conversion reads it whole).

    Raises:
        ChecksumMismatchError: the ``.keras`` weights member's bytes changed.
    """
    ckpt.check_crc()
    names = {}
    for key in ckpt.entries:
        path = ckpt.readable_name(key)
        if weights_only and not is_weight(key, path=path):
            continue
        names[path if path not in names else key] = key
    return _KerasSource(ckpt, names)


class _KerasSource(PlannedCheckpoint):
    """A Keras file under readable paths, with the byte ranges of its plain datasets (``stored_range``)."""

    def __init__(self, ckpt, names: dict):
        super().__init__(ckpt, names)
        self._keras, self._keys = ckpt, dict(names)

    def stored_range(self, name: str):
        """``KerasCheckpoint.stored_range`` of the entry named ``name`` here: (path, offset, size) or None."""
        return self._keras.stored_range(self._keys[name])
