"""The non-TF sources of a conversion (one file of a format, or a set of safetensors shards), read back to TF names."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from restorekit.errors import CheckpointNotFoundError, InvalidArgumentError
from restorekit.export import formats, sharded
from restorekit.export.options import OBJECT_GRAPH_KEY, OutputPlan, out_shape, plan_output

__all__ = ["Reader", "file_plan", "file_sizes", "open_source", "reader", "shard_set", "tf_shapes", "tf_tensors"]


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


def tf_shapes(shapes: dict, record) -> dict:
    """TF name -> TF shape of every tensor of a file, through its layout record (string tensors too)."""
    from restorekit.export.layout import invert

    out = {}
    for stored, shape in shapes.items():
        note = record.tensors.get(stored, {})
        shape = tuple(shape)
        if note.get("perm") is not None:
            shape = tuple(shape[i] for i in invert(note["perm"]))
        if note.get("dtype") == "complex128":
            shape = shape[:-1]
        out[note.get("name", stored)] = shape
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
    only those it keeps, under their output names and in their output axes."""
    from restorekit.export.layout import restore_dtype

    wanted = {source: out for out, source in plan.names.items()} if plan is not None else None
    for stored, array in arrays:
        name, array, dtype = record.restore(stored, array)
        if wanted is None:
            yield name, restore_dtype(array, dtype), dtype
        elif name in wanted:
            yield wanted[name], plan.apply(wanted[name], restore_dtype(array, dtype)), dtype
    for name, array in record.string_tensors():
        if wanted is None:
            yield name, array, "string"
        elif name in wanted:
            value = np.array(plan.graph, dtype=object) if name == OBJECT_GRAPH_KEY and plan.graph is not None else array
            yield wanted[name], value, "string"


def file_sizes(reader: Reader, record, plan: OutputPlan | None) -> list:
    """(output name, shape, bytes) of every numeric tensor of a safetensors source, in reading order."""
    if reader.module is not sharded and reader.fmt != "safetensors":
        raise InvalidArgumentError(f"max_shard_size= splits TF checkpoints and safetensors files; convert this "
                                   f"{reader.fmt} file to a TF checkpoint first")
    from restorekit.export import safetensors
    from restorekit.export.layout import invert

    files = reader.source.files if reader.module is sharded else (reader.source,)
    wanted = {source: out for out, source in plan.names.items()} if plan is not None else None
    sizes = []
    for path in files:
        for stored, info in safetensors.read_header(path).tensors.items():
            note = record.tensors.get(stored, {})
            name, shape = note.get("name", stored), tuple(info.shape)
            if note.get("perm") is not None:
                shape = tuple(shape[i] for i in invert(note["perm"]))
            if note.get("dtype") == "complex128":
                shape = shape[:-1]
            if wanted is not None:
                if name not in wanted:
                    continue
                name = wanted[name]
                shape = out_shape(plan, name, shape)
            sizes.append((name, shape, info.end - info.begin))
    return sizes
