"""The non-TF sources of a conversion (one file of a format, or a set of safetensors shards), read back to TF names.

The readers are the formats' own (``restorekit.formats.safetensors``, ``torch``, ``npz``);
this module adds what a conversion plans with them: its output plan, sizes, tensors.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from types import ModuleType

from restorekit.errors import InvalidArgumentError
from restorekit.formats import _sinks as formats
from restorekit.export._options import OBJECT_GRAPH_KEY, OutputPlan, out_shape, plan_output
from restorekit.formats import npz, onnx, safetensors, torch
from restorekit.formats.files import FileCheckpoint, FileReader, _tf_layout, tf_shapes
from restorekit.formats.safetensors._reader import ShardedSafetensorsReader, shard_set

__all__ = ["FileCheckpoint", "Reader", "ShardedSafetensorsReader", "file_plan", "file_sizes", "of_view", "open_source", "reader",
           "shard_set", "source_nbytes", "tf_shapes", "tf_sizes", "tf_tensors"]


@dataclasses.dataclass(frozen=True)
class Reader:
    """A conversion's non-TF source: the format's reader (``restorekit.formats``) and the export module of its format."""

    source: FileReader  # one file, or a set of safetensors shards (ShardedSafetensorsReader)
    module: ModuleType | None  # the export format module (None for a format read only, such as onnx)
    known_record: tuple = ()  # (the file's layout record or None,) when the view that opened it read it already

    @property
    def path(self) -> str:
        return self.source.path

    @property
    def layouts(self) -> tuple:
        """The ``layout=`` values a conversion of the file may read it with (its export module's; None alone for a
        format restorekit only reads)."""
        return self.module.LAYOUTS if self.module is not None else (None,)

    @property
    def fmt(self) -> str:
        return self.source.fmt

    @property
    def files(self) -> tuple:
        return self.source.files

    def read(self, max_output_bytes: int | None = None):
        return self.source.read(max_output_bytes)

    def read_shapes(self) -> dict:
        return self.source.read_shapes()

    def read_record(self):
        return self.known_record[0] if self.known_record else self.source.read_record()

    def stored_tensors(self) -> dict:
        return self.source.stored_tensors()


def reader(src: str, fmt: str) -> Reader:
    """The reader of the ``fmt`` file (or safetensors shard set) at ``src``.

    Raises:
        CheckpointNotFoundError: nothing there.
        InvalidArgumentError: ``fmt`` is no file format.
    """
    if fmt not in _READERS:
        formats.module(fmt)  # InvalidArgumentError naming the file formats
    return Reader(_READERS[fmt](src), formats.modules().get(fmt))


def of_view(view) -> Reader:
    """The conversion's reader of an open ``FileView``: the reader it opened, nothing opened again."""
    return Reader(view.reader, formats.modules().get(view.format), view.file_record())


_READERS = {"safetensors": safetensors.open_reader, "torch": torch.TorchReader, "npz": npz.NpzReader,
            "onnx": onnx.OnnxReader}


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


def open_source(reader: Reader, layout: str | None, max_output_bytes: int | None = None,
                flatten_channels: dict | None = None):
    """(iterator of (stored name, array), LayoutRecord) of a non-TF source (``flatten_channels``: as
    ``guess_tf_names`` takes it, for a file without a record)."""
    from restorekit.layouts import LayoutRecord, guess_tf_names

    record = reader.read_record()
    if record is None:
        record = (guess_tf_names(reader.read_shapes(), flatten_channels=flatten_channels) if layout == "torch"
                  else LayoutRecord())
    return reader.read(max_output_bytes), record


def file_plan(reader: Reader, record, options) -> OutputPlan | None:
    if not options.planned:
        return None
    shapes = tf_shapes(reader.read_shapes(), record)
    graph = record.object_graph() if options.weights_only or options.ema else None
    strings = dict(record.string_tensors()) if OBJECT_GRAPH_KEY in record.strings else {}
    return plan_output(shapes, graph=graph, graph_bytes=lambda: strings[OBJECT_GRAPH_KEY].item(), rules=options.rules,
                       weights_only=options.weights_only, ema=options.ema)


def mapped_arrays(reader: Reader):
    """(stored name, array) of every tensor of a safetensors source as ``Reader.read`` gives them, each a private
    memory map read only when used."""
    from restorekit.formats.safetensors import open_tensors

    source = reader.source
    if not isinstance(source, safetensors.SafetensorsReader):
        raise InvalidArgumentError(f"only a safetensors source is read mapped; this one is {reader.fmt}")
    for path in source.data_files:
        yield from open_tensors(path).items()


# What tf_tensors gives for a tensor another rank writes: never read, never written.
_PLACEHOLDER = np.empty(0, dtype=np.uint8)


def tf_tensors(arrays, record, plan: OutputPlan | None = None, only: set | None = None):
    """(name, array, TF dtype name or None) for every tensor of a source, strings last; under ``plan``,
    only those it keeps, under their output names and in their output axes. A numeric tensor whose
    output name is not in ``only`` (another rank's) comes as an empty placeholder, not transformed.

    The record is undone for the file as a whole (``layouts.tf_tensors``): the parts of a
    split tensor are joined and tensors added for PyTorch left out.
    """
    from restorekit.layouts import tf_tensors as restored

    if plan is None:
        for name, array, dtype in restored(arrays, record):
            skip = only is not None and dtype != "string" and name not in only
            yield (name, _PLACEHOLDER, dtype) if skip else (name, array, dtype)
        return
    wanted = {source: out for out, source in plan.names.items()}
    for name, array, dtype in restored(arrays, record):
        if name not in wanted:
            continue
        if only is not None and dtype != "string" and wanted[name] not in only:
            yield wanted[name], _PLACEHOLDER, dtype
            continue
        if dtype != "string":
            array = plan.apply(wanted[name], array)
        elif name == OBJECT_GRAPH_KEY and plan.graph is not None:
            array = np.array(plan.graph, dtype=object)
        yield wanted[name], array, dtype


def file_sizes(reader: Reader, record, plan: OutputPlan | None) -> list:
    """(output name, shape, bytes) of every numeric tensor of a safetensors source, in the order
    ``tf_tensors`` yields them."""
    if not isinstance(reader.source, safetensors.SafetensorsReader):
        raise InvalidArgumentError(f"max_shard_size= splits TF checkpoints and safetensors files; convert this "
                                   f"{reader.fmt} file to a TF checkpoint first")
    wanted = {source: out for out, source in plan.names.items()} if plan is not None else {}
    infos = {}
    for _, header in reader.source.headers():
        infos.update(header.tensors)
    sizes = []
    for name, shape, stored in _tf_layout(((n, info.shape) for n, info in infos.items()), record):
        if plan is not None:
            if name not in wanted:
                continue
            name = wanted[name]
            shape = out_shape(plan, name, shape)
        sizes.append((name, shape, sum(infos[s].end - infos[s].begin for s in stored)))
    return sizes


def tf_sizes(reader: Reader, record, plan: OutputPlan | None) -> list:
    """(output name, bytes) of every tensor of a source (strings count 0), from headers and shapes only:
    what balancing an import over several TF data shards needs."""
    entries = FileCheckpoint(reader.source, record).entries
    if plan is None:
        return [(name, entry.nbytes) for name, entry in entries.items()]
    return [(out, entries[src].nbytes) for out, src in plan.names.items() if src in entries]
