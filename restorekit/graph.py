"""Graphs: inspect GraphDef / MetaGraph / SavedModel files, freeze a checkpoint into a .pb, unfreeze it back.

Three verbs, each over any accepted graph (a ``.pb`` binary or text GraphDef, a
``.meta`` MetaGraphDef, a SavedModel directory, or the protos / ``tf.Graph`` in memory):

* ``inspect_graph`` summarises inputs, likely outputs, variables, op counts and constant
  size, after repairing what makes old graphs fail to load in today's TensorFlow;
* ``freeze`` restores a checkpoint into a graph and writes the frozen ``.pb``;
* ``unfreeze`` turns the weight constants of a frozen ``.pb`` back into a checkpoint
  and, optionally, a trainable MetaGraph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from restorekit._tensorflow import import_tensorflow
from restorekit.bundle import atomic
from restorekit.bundle.varint import read_varint
from restorekit.errors import (
    CorruptCheckpointError,
    GraphError,
    GraphTooLargeError,
    IncompleteRestoreError,
    InvalidArgumentError,
    NoMatchError,
    OutputExistsError,
    format_names,
)
from restorekit.names import closest_names, is_global_step, optimizer_slot_kind, strip_output_index
from restorekit.report import format_bytes, format_shape

__all__ = [
    "Alignment",
    "ConvertedConstant",
    "GraphSummary",
    "TensorSummary",
    "UnfreezeResult",
    "VariableSummary",
    "freeze",
    "inspect_graph",
    "unfreeze",
]

# Protobuf cannot parse or serialize a message of 2 GB or more. Module-level so tests
# can lower it instead of writing 2 GB.
MAX_PROTO_BYTES = 2**31 - 1

# How summaries print a shape of unknown rank.
_UNKNOWN_RANK = "<unknown>"

# unfreeze(weights='large') takes floating constants of at least this many bytes.
LARGE_CONSTANT_BYTES = 1024

_VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp"})
_PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})
_OTHER_INPUT_OPS = frozenset(
    {
        "IteratorGetNext",
        "IteratorGetNextSync",
        "QueueDequeue",
        "QueueDequeueV2",
        "QueueDequeueMany",
        "QueueDequeueManyV2",
        "QueueDequeueUpTo",
        "QueueDequeueUpToV2",
    }
)
# Sinks of these types are training, saving or bookkeeping machinery, never model outputs.
_MACHINERY_OPS = frozenset(
    {
        "NoOp",
        "Const",
        "Assign",
        "AssignAdd",
        "AssignSub",
        "AssignVariableOp",
        "AssignAddVariableOp",
        "AssignSubVariableOp",
        "Save",
        "SaveV2",
        "SaveSlices",
        "Restore",
        "RestoreV2",
        "RestoreSlice",
        "MergeV2Checkpoints",
        "ShardedFilename",
        "StringJoin",
        "VarIsInitializedOp",
        "IsVariableInitialized",
        "Print",
        "PrintV2",
        "Assert",
        "DestroyResourceOp",
        "InitializeTableV2",
        "InitializeTableFromTextFileV2",
        "LookupTableImportV2",
        "ReportUninitializedVariables",
    }
    | _VARIABLE_OPS
    | _PLACEHOLDER_OPS
)
_MACHINERY_OP_PATTERN = re.compile(r"^(Resource)?(Sparse)?Apply|Summary(V2)?$|^Write\w*Summary$")
_MACHINERY_SCOPE = re.compile(
    r"^(save|gradients|init|init_all_tables|init_all_variables|report_uninitialized_variables|"
    r"report_uninitialized_resources|global_step|saver_filename|summaries|ExponentialMovingAverage|"
    r"GradientDescent|Momentum|Adam|AdamW|RMSProp|Adagrad|AdagradDA|Adadelta|Ftrl|ProximalAdagrad|"
    r"ProximalGradientDescent|Nadam|beta1_power|beta2_power)(_\d+)?(/|$)"
)
_MACHINERY_NAME = re.compile(r"/(Initializer|IsInitialized)(/|$)|/(Assign|read|Read/ReadVariableOp)$")
_STALE_SHAPES = re.compile(r"Node '([^']+)' has an _output_shapes attribute inconsistent")
# Strip stale shape hints node by node this many times, then all at once.
_MAX_STALE_SHAPE_RETRIES = 10
_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_>.]*$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-/>]*$")
# The TF1 resource-variable read that convert_variables_to_constants turns into Identity.
_READ_VARIABLE_LEAF = re.compile(r"(^|/)ReadVariableOp(_\d+)?$")
# Ops that take a variable (a ref or a resource handle) without writing it: reads that
# convert_variables_to_constants rewrites onto the constant, and the control-flow and
# identity ops a variable passes through on its way to its reader or writer.
_VARIABLE_READ_OPS = frozenset(
    {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp",
     "IsVariableInitialized"}
)
_PASS_THROUGH_OPS = frozenset(
    {"Identity", "RefIdentity", "Enter", "RefEnter", "Switch", "RefSwitch", "Merge", "RefMerge", "Exit", "RefExit",
     "NextIteration", "RefNextIteration"}
)
# Writers whose variable input cannot be traced to a variable node (a handle fed from
# elsewhere) are still known by their type; op_def's mutable inputs rule out pure ops
# like ScatterNd or TensorScatterUpdate.
_WRITE_OP_PATTERN = re.compile(
    r"^(Assign|(Resource)?(Sparse)?Apply|(Resource)?Scatter|(Resource)?CountUpTo$|(Resource)?StridedSliceAssign$)"
)


# ---------------------------------------------------------------- results


def _table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


@dataclass(frozen=True)
class TensorSummary:
    """One input or output tensor.

    ``name`` is the tensor name (``'x:0'``); ``shape`` is a tuple with ``None`` for an
    unknown dimension, or ``None`` for an unknown rank. For a SavedModel signature,
    ``signature`` and ``key`` say where the tensor appears.
    """

    name: str
    dtype: str
    shape: tuple | None
    op: str
    signature: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class VariableSummary:
    """One variable in a graph.

    ``name`` is the variable name (graph node); ``checkpoint_name`` the key a checkpoint
    holds it under when that differs (TF2 object paths, partitioned variables).
    ``slot`` names the optimizer for optimizer slots, else ``None``.
    """

    name: str
    shape: tuple | None
    dtype: str
    op: str
    trainable: bool | None = None
    slot: str | None = None
    checkpoint_name: str | None = None


@dataclass(frozen=True)
class GraphSummary:
    """What ``inspect_graph`` found: a value, printable as a table and convertible to JSON.

    ``op_counts`` counts node types in the graph and in its function library;
    ``const_bytes`` is the size of all ``Const`` values there. ``repaired`` says what was
    changed so that the graph loads in this TensorFlow, and why. ``unknown_ops`` lists
    op types this TensorFlow does not know (the graph cannot be loaded while they remain).
    """

    source: str
    kind: str
    node_count: int
    inputs: tuple[TensorSummary, ...]
    outputs: tuple[TensorSummary, ...]
    variables: tuple[VariableSummary, ...]
    op_counts: dict
    const_bytes: int
    repaired: tuple[str, ...] = ()
    unknown_ops: tuple[str, ...] = ()
    signatures: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """Plain JSON-ready data (lists for tuples, ``None`` for unknown dimensions)."""

        def plain(value):
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if dataclasses.is_dataclass(value):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return value

        return plain(self)

    def __str__(self) -> str:
        slots = sum(1 for v in self.variables if v.slot)
        total = sum(
            int(np.prod(v.shape))
            for v in self.variables
            if v.shape is not None and None not in v.shape and not v.slot and not is_global_step(v.name)
        )
        lines = [f"restorekit: {self.source} ({self.kind}, {self.node_count} nodes)"]

        def tensor_rows(tensors):
            return [
                (
                    t.name if t.signature is None else f"{t.signature}[{t.key!r}] {t.name}",
                    t.dtype,
                    format_shape(t.shape, _UNKNOWN_RANK),
                    t.op,
                )
                for t in tensors
            ]

        lines.append(f"inputs     {len(self.inputs)}")
        lines += _table(tensor_rows(self.inputs))
        lines.append(f"outputs    {len(self.outputs)}")
        lines += _table(tensor_rows(self.outputs))
        detail = f"   ({slots} optimizer slots)" if slots else ""
        lines.append(f"variables  {len(self.variables)}{detail}, {total} model parameters")
        lines += _table(
            [
                (v.name, v.dtype, format_shape(v.shape, _UNKNOWN_RANK), v.op + (f" slot of {v.slot}" if v.slot else ""))
                for v in self.variables
            ]
        )
        counts = ", ".join(f"{op} {n}" for op, n in list(self.op_counts.items())[:12])
        more = f", ... and {len(self.op_counts) - 12} more" if len(self.op_counts) > 12 else ""
        lines.append(f"ops        {len(self.op_counts)} types: {counts}{more}")
        lines.append(f"constants  {format_bytes(self.const_bytes)}")
        if self.unknown_ops:
            lines.append(f"unknown    {format_names(self.unknown_ops)} (not registered in this TensorFlow)")
        for note in self.repaired:
            lines.append(f"repaired   {note}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ConvertedConstant:
    """A weight constant that ``unfreeze`` wrote: frozen node -> checkpoint name."""

    node: str
    name: str
    shape: tuple
    dtype: str
    # 'variable' (VariableV2), 'resource' (TF1 VarHandleOp), 'resource (TF2)' (a captured
    # handle; the node name is not the variable's: pass a reference), 'large' or 'chosen'.
    pattern: str
    # One part of a partitioned variable ('emb/part_1'): saved, as a Saver does, as a
    # slice of ``full_name`` (shape ``full_shape``) starting at ``offset``.
    full_name: str | None = None
    full_shape: tuple | None = None
    offset: tuple | None = None

    @property
    def checkpoint_name(self) -> str:
        return self.full_name or self.name


@dataclass(frozen=True)
class Alignment:
    """How one converted constant was named against the reference."""

    old: str
    new: str
    reason: str


@dataclass(frozen=True)
class UnfreezeResult:
    """What ``unfreeze`` wrote."""

    checkpoint: str
    meta_graph: str | None
    converted: tuple[ConvertedConstant, ...]
    aligned: tuple[Alignment, ...] = ()

    def __str__(self) -> str:
        total = sum(int(np.prod(c.shape)) for c in self.converted)
        lines = [f"restorekit: {len(self.converted)} constants ({total} values) -> {self.checkpoint}"]
        lines += _table(
            [
                (
                    c.name,
                    c.dtype,
                    format_shape(c.shape, _UNKNOWN_RANK),
                    c.pattern + (f", slice of {c.full_name!r} {format_shape(c.full_shape, _UNKNOWN_RANK)}" if c.full_name else ""),
                )
                for c in self.converted
            ]
        )
        renamed = [a for a in self.aligned if a.old != a.new]
        if self.aligned:
            lines.append(f"aligned    {len(self.aligned) - len(renamed)} kept, {len(renamed)} renamed")
            lines += _table([(a.old, "->", a.new, a.reason) for a in renamed])
        if self.meta_graph:
            lines.append(f"trainable graph -> {self.meta_graph}")
        return "\n".join(lines)


# ---------------------------------------------------------------- loading


@dataclass
class _Loaded:
    """A graph read from anywhere, before and after repairs (internal, mutable)."""

    source: str
    kind: str  # 'GraphDef', 'MetaGraph', 'SavedModel'
    graph_def: object
    meta_graph: object = None
    repaired: list = dataclasses.field(default_factory=list)
    unknown_ops: tuple = ()


def _tf():
    tf = import_tensorflow()

    return tf


def _protos():
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    return graph_pb2, meta_graph_pb2, saved_model_pb2


def _looks_truncated(data: bytes) -> bool:
    """True when the top-level protobuf fields run past the end of ``data``."""
    pos, end = 0, len(data)
    while pos < end:
        try:
            tag, pos = read_varint(data, pos, end, "graph")
            wire = tag & 7
            if wire == 0:
                _, pos = read_varint(data, pos, end, "graph")
            elif wire == 1:
                pos += 8
            elif wire == 2:
                length, pos = read_varint(data, pos, end, "graph")
                pos += length
            elif wire == 5:
                pos += 4
            else:
                return False
        except CorruptCheckpointError:
            # A varint fails on its 10th continuation byte (over 64 bits: not a
            # protobuf) or at the end of the data (truncated); pos is where it began.
            return end - pos < 10
        if pos > end:
            return True
    return False


def _valid_graph_def(gd) -> bool:
    return len(gd.node) > 0 and all(_OP_NAME.match(n.op) and _NODE_NAME.match(n.name) for n in gd.node)


def _parse_as(data: bytes, cls, binary: bool):
    from google.protobuf import message, text_format

    msg = cls()
    try:
        if binary:
            msg.ParseFromString(data)
        else:
            text_format.Parse(data.decode("utf-8"), msg)
    except (message.DecodeError, text_format.ParseError, UnicodeDecodeError, ValueError, RuntimeError):
        return None
    return msg


def _check_size(path: str, size: int) -> None:
    if size > MAX_PROTO_BYTES:
        raise GraphTooLargeError(
            f"{path!r} is {size / 2**30:.2f} GiB, over protobuf's 2 GB limit: no TensorFlow can parse it "
            f"as one GraphDef. Keep the weights in a checkpoint (restorekit.unfreeze) or split the model."
        )


def _read_graph_file(path: str) -> bytes:
    if not os.path.exists(path):
        parent = os.path.dirname(path) or "."
        hint = ""
        if os.path.isdir(parent):
            near = closest_names(os.path.basename(path), os.listdir(parent))
            if near:
                hint = f" Files nearby: {format_names(near)}."
        raise GraphError(f"no graph file at {path!r}.{hint}")
    size = os.path.getsize(path)
    _check_size(path, size)
    if size == 0:
        raise GraphError(f"{path!r} is empty: it holds no graph.")
    with open(path, "rb") as f:
        return f.read()


def _load_saved_model(path: str, data: bytes, binary_first: bool) -> _Loaded:
    _, _, saved_model_pb2 = _protos()
    model = None
    for binary in (binary_first, not binary_first):
        model = _parse_as(data, saved_model_pb2.SavedModel, binary)
        if model is not None and model.meta_graphs and _valid_graph_def(model.meta_graphs[0].graph_def):
            break
        model = None
    if model is None:
        truncated = " (the file is truncated)" if _looks_truncated(data) else ""
        raise GraphError(f"{path!r} is not a readable SavedModel{truncated}.")
    chosen = model.meta_graphs[0]
    for mg in model.meta_graphs:
        if "serve" in mg.meta_info_def.tags:
            chosen = mg
            break
    return _Loaded(path, "SavedModel", chosen.graph_def, chosen)


def _load_path(path: str) -> _Loaded:
    graph_pb2, meta_graph_pb2, _ = _protos()
    if os.path.isdir(path):
        for name, binary in (("saved_model.pb", True), ("saved_model.pbtxt", False)):
            file = os.path.join(path, name)
            if os.path.exists(file):
                return _load_saved_model(path, _read_graph_file(file), binary)
        raise GraphError(f"directory {path!r} is not a SavedModel: it has no saved_model.pb or saved_model.pbtxt.")
    data = _read_graph_file(path)
    base = os.path.basename(path)
    if base.startswith("saved_model.pb"):
        return _load_saved_model(os.path.dirname(path) or ".", data, not base.endswith("txt"))
    text_first = base.endswith((".pbtxt", ".txt", ".prototxt"))
    binaries = (False, True) if text_first else (True, False)
    if base.endswith((".meta", ".metatxt")):
        kinds = [("MetaGraph", meta_graph_pb2.MetaGraphDef), ("GraphDef", graph_pb2.GraphDef)]
    else:
        kinds = [("GraphDef", graph_pb2.GraphDef), ("MetaGraph", meta_graph_pb2.MetaGraphDef)]
    for binary in binaries:
        for kind, cls in kinds:
            msg = _parse_as(data, cls, binary)
            if msg is None:
                continue
            if kind == "MetaGraph" and _valid_graph_def(msg.graph_def):
                return _Loaded(path, kind, msg.graph_def, msg)
            if kind == "GraphDef" and _valid_graph_def(msg):
                return _Loaded(path, kind, msg)
    if _looks_truncated(data):
        raise GraphError(
            f"{path!r} is truncated (or corrupt): its protobuf records run past the end of the file "
            f"({len(data)} bytes). Copy or download it again."
        )
    raise GraphError(
        f"{path!r} is not a graph: it parses as no binary or text GraphDef, MetaGraphDef or SavedModel."
    )


def _load(graph) -> _Loaded:
    """Read any accepted graph form into protos (copies; the caller's objects are never changed)."""
    graph_pb2, meta_graph_pb2, saved_model_pb2 = _protos()
    tf = None
    if isinstance(graph, (str, os.PathLike)):
        loaded = _load_path(os.fspath(graph))
    elif isinstance(graph, graph_pb2.GraphDef):
        loaded = _Loaded("<GraphDef>", "GraphDef", graph)
    elif isinstance(graph, meta_graph_pb2.MetaGraphDef):
        loaded = _Loaded("<MetaGraphDef>", "MetaGraph", graph.graph_def, graph)
    elif isinstance(graph, saved_model_pb2.SavedModel):
        if not graph.meta_graphs:
            raise GraphError("the SavedModel proto holds no MetaGraph.")
        loaded = _Loaded("<SavedModel>", "SavedModel", graph.meta_graphs[0].graph_def, graph.meta_graphs[0])
    else:
        tf = _tf()
        if isinstance(graph, tf.Graph):
            loaded = _Loaded("<tf.Graph>", "GraphDef", graph.as_graph_def())
        else:
            raise InvalidArgumentError(
                "a graph is a path (.pb, .pbtxt, .meta, SavedModel directory), a GraphDef, a MetaGraphDef "
                f"or a tf.Graph; got {type(graph).__name__}"
            )
    # Work on copies so repairs never touch the caller's protos.
    loaded.graph_def = graph_pb2.GraphDef.FromString(loaded.graph_def.SerializeToString())
    if loaded.meta_graph is not None:
        meta = meta_graph_pb2.MetaGraphDef()
        meta.CopyFrom(loaded.meta_graph)
        meta.graph_def.CopyFrom(loaded.graph_def)
        loaded.meta_graph = meta
        loaded.graph_def = meta.graph_def
    if loaded.graph_def.ByteSize() > MAX_PROTO_BYTES:
        _check_size(loaded.source, loaded.graph_def.ByteSize())
    return loaded


# ---------------------------------------------------------------- repairs


def _op_def(op_type: str):
    # No public API exposes the op registry's OpDefs (attrs and their defaults);
    # tf.raw_ops only has the Python wrappers.
    from tensorflow.python.framework import op_def_registry

    return op_def_registry.get(op_type)


def _all_node_lists(graph_def):
    yield graph_def.node
    for function in graph_def.library.function:
        yield function.node_def


def _repair(loaded: _Loaded) -> _Loaded:
    """Make ``loaded.graph_def`` import in this TensorFlow; record each change and why."""
    tf = _tf()
    gd = loaded.graph_def
    functions = {f.signature.name for f in gd.library.function}
    unknown = set()
    dropped_attrs: Counter = Counter()
    for nodes in _all_node_lists(gd):
        for node in nodes:
            if node.op in functions:
                continue
            op_def = _op_def(node.op)
            if op_def is None:
                unknown.add(node.op)
                continue
            known = {a.name for a in op_def.attr}
            for key in list(node.attr):
                if not key.startswith("_") and key not in known:
                    del node.attr[key]
                    dropped_attrs[f"{key!r} of {node.op}"] += 1
    if dropped_attrs:
        loaded.repaired.append(
            "dropped attrs this TensorFlow's op registry does not define: "
            + ", ".join(f"{k} ({n} nodes)" for k, n in sorted(dropped_attrs.items()))
        )
    names = {n.name for n in gd.node}
    stale_class = _drop_stale_colocation(gd)
    if stale_class:
        loaded.repaired.append(f"dropped colocation ('_class') with nodes not in the graph from {stale_class} nodes")
    missing_inputs = [
        (n.name, i) for n in gd.node for i in n.input if i.lstrip("^").split(":")[0] not in names
    ]
    if missing_inputs:
        node, inp = missing_inputs[0]
        raise GraphError(
            f"{loaded.source!r} is incomplete: {len(missing_inputs)} inputs name nodes that are not in the graph "
            f"(first: {node!r} reads {inp!r}). The file may be truncated."
        )
    loaded.unknown_ops = tuple(sorted(unknown))
    if unknown:
        return loaded
    stale: list[str] = []
    stripped_all = False
    while True:
        try:
            with tf.Graph().as_default():
                tf.import_graph_def(gd, name="")
            break
        except (ValueError, tf.errors.OpError) as e:
            message = str(e)
            m = _STALE_SHAPES.search(message)
            if m is None or stripped_all:
                raise GraphError(
                    f"{loaded.source!r} does not load in TensorFlow {tf.__version__}: {message}"
                ) from None
            # '_output_shapes' are hints written by the TF that saved the graph; shape
            # functions changed since, and import rejects hints it disagrees with.
            if len(stale) < _MAX_STALE_SHAPE_RETRIES:
                stale.append(m.group(1))
                for node in gd.node:
                    if node.name == m.group(1):
                        del node.attr["_output_shapes"]
            else:
                for nodes in _all_node_lists(gd):
                    for node in nodes:
                        if "_output_shapes" in node.attr:
                            del node.attr["_output_shapes"]
                stripped_all = True
    if stale:
        where = "every node" if stripped_all else format_names(stale)
        loaded.repaired.append(
            f"stripped stale '_output_shapes' from {where}: they disagree with the shapes this TensorFlow infers"
        )
    return loaded


def _drop_stale_colocation(gd) -> int:
    """Drop colocation (``_class``) with nodes not in ``gd``, which import rejects; return how many nodes changed."""
    names = {n.name for n in gd.node}
    changed = 0
    for node in gd.node:
        if "_class" in node.attr:
            refs = list(node.attr["_class"].list.s)
            keep = [s for s in refs if not s.startswith(b"loc:@") or s[5:].decode() in names]
            if len(keep) != len(refs):
                changed += 1
                if keep:
                    node.attr["_class"].list.s[:] = keep
                else:
                    del node.attr["_class"]
    return changed


def _require_loadable(loaded: _Loaded) -> None:
    if loaded.unknown_ops:
        raise GraphError(
            f"{loaded.source!r} uses ops this TensorFlow does not register: {format_names(loaded.unknown_ops)}. "
            f"Import the library that defines them (e.g. tensorflow_text) before loading the graph."
        )


# ---------------------------------------------------------------- inspect


def _dtype_name(enum) -> str:
    tf = _tf()
    return tf.dtypes.as_dtype(enum).base_dtype.name


def _shape_of(proto) -> tuple | None:
    if proto.unknown_rank:
        return None
    return tuple(d.size if d.size >= 0 else None for d in proto.dim)


def _tf_shape(shape) -> tuple | None:
    if shape.rank is None:
        return None
    return tuple(shape.as_list())


def _const_nbytes(tensor) -> int:
    tf = _tf()
    dtype = tf.dtypes.as_dtype(tensor.dtype)
    if dtype == tf.string:
        return sum(len(s) for s in tensor.string_val)
    count = int(np.prod([d.size for d in tensor.tensor_shape.dim], dtype=np.int64))
    return count * dtype.size


def _is_machinery(node) -> bool:
    return bool(
        node.op in _MACHINERY_OPS
        or _MACHINERY_OP_PATTERN.search(node.op)
        or _MACHINERY_SCOPE.match(node.name)
        or _MACHINERY_NAME.search(node.name)
    )


def _node_of(input_name: str) -> str:
    return input_name.lstrip("^").split(":")[0]


def _escape_local_name(name: str) -> str:
    # Mirrors how TF2 checkpoints escape object names in their keys.
    return name.replace(".", "..").replace("/", ".S")


def _object_graph_variables(meta_graph) -> list[VariableSummary]:
    """Variables of a TF2 SavedModel, named by their object-graph checkpoint keys."""
    nodes = meta_graph.object_graph_def.nodes
    if not nodes:
        return []
    paths = {0: ""}
    queue = [0]
    while queue:
        i = queue.pop(0)
        for child in nodes[i].children:
            if child.node_id not in paths:
                paths[child.node_id] = f"{paths[i]}/{_escape_local_name(child.local_name)}".lstrip("/")
                queue.append(child.node_id)
    slots = {}
    for i, node in enumerate(nodes):
        for ref in node.slot_variables:
            slots[ref.slot_variable_node_id] = (
                f"{paths.get(ref.original_variable_node_id, '?')}/.OPTIMIZER_SLOT/{paths.get(i, '?')}/{ref.slot_name}"
            )
    result = []
    for i, node in enumerate(nodes):
        if node.WhichOneof("kind") != "variable":
            continue
        var = node.variable
        if i in slots:
            key, slot = slots[i], "optimizer (TF2)"
        elif i in paths:
            key, slot = f"{paths[i]}/.ATTRIBUTES/VARIABLE_VALUE", None
        else:  # pragma: no cover - every variable hangs off the root
            continue
        result.append(
            VariableSummary(
                name=var.name or paths.get(i, ""),
                shape=_shape_of(var.shape),
                dtype=_dtype_name(var.dtype),
                op="VarHandleOp",
                trainable=bool(var.trainable),
                slot=slot,
                checkpoint_name=key,
            )
        )
    return result


def _variable_defs(meta_graph) -> dict:
    """variable name -> VariableDef, from a MetaGraph's variable collections."""
    from tensorflow.core.framework import variable_pb2

    result = {}
    if meta_graph is None:
        return result
    for key in ("variables", "trainable_variables", "local_variables", "model_variables"):
        if key not in meta_graph.collection_def:
            continue
        for raw in meta_graph.collection_def[key].bytes_list.value:
            vdef = variable_pb2.VariableDef.FromString(raw)
            result.setdefault(strip_output_index(vdef.variable_name), vdef)
    return result


def _graph_variables(gd, meta_graph) -> list[VariableSummary]:
    vdefs = _variable_defs(meta_graph)
    trainable = set()
    if meta_graph is not None and "trainable_variables" in meta_graph.collection_def:
        from tensorflow.core.framework import variable_pb2

        for raw in meta_graph.collection_def["trainable_variables"].bytes_list.value:
            trainable.add(strip_output_index(variable_pb2.VariableDef.FromString(raw).variable_name))
    result = []
    for node in gd.node:
        if node.op not in _VARIABLE_OPS:
            continue
        vdef = vdefs.get(node.name)
        full = vdef.save_slice_info_def.full_name if vdef is not None and vdef.HasField("save_slice_info_def") else None
        result.append(
            VariableSummary(
                name=node.name,
                shape=_shape_of(node.attr["shape"].shape),
                dtype=_dtype_name(node.attr["dtype"].type),
                op=node.op,
                trainable=(node.name in trainable) if vdefs else None,
                slot=optimizer_slot_kind(node.name),
                checkpoint_name=full if full and full != node.name else None,
            )
        )
    return result


def _tensor_summaries(gd, graph, node_names) -> list[TensorSummary]:
    by_name = {n.name: n for n in gd.node}
    result = []
    for name in node_names:
        node = by_name[name]
        if graph is not None:
            op = graph.get_operation_by_name(name)
            for t in op.outputs:
                result.append(TensorSummary(t.name, t.dtype.base_dtype.name, _tf_shape(t.shape), node.op))
            continue
        # Without a loadable graph, fall back to the attrs most ops carry.
        dtype = None
        for key in ("dtype", "T", "out_type"):
            if key in node.attr and node.attr[key].type:
                dtype = _dtype_name(node.attr[key].type)
                break
        shape = _shape_of(node.attr["shape"].shape) if "shape" in node.attr else None
        result.append(TensorSummary(f"{name}:0", dtype or "unknown", shape, node.op))
    return result


def inspect_graph(path_or_graph) -> GraphSummary:
    """Summarise a graph: inputs, likely outputs, variables, op counts, constant size.

    Old graphs are repaired so they load in this TensorFlow; ``repaired`` says how.

        summary = restorekit.inspect_graph('model.ckpt-1000.meta')
        print(summary)                       # a readable table
        json.dumps(summary.to_dict())

    Args:
        path_or_graph: a ``.pb`` (binary or text GraphDef), a ``.meta``, a SavedModel
            directory, or a GraphDef / MetaGraphDef / SavedModel proto / ``tf.Graph``.

    Returns:
        A GraphSummary.

    Raises:
        GraphError: the file is missing, not a graph, truncated, or does not load.
        GraphTooLargeError: the file is over protobuf's 2 GB limit.
    """
    tf = _tf()
    loaded = _repair(_load(path_or_graph))
    gd = loaded.graph_def
    graph = None
    if not loaded.unknown_ops:
        graph = tf.Graph()
        with graph.as_default():
            tf.import_graph_def(gd, name="")

    consumed = {_node_of(i) for n in gd.node for i in n.input}
    signatures = []
    inputs: list[TensorSummary] = []
    outputs: list[TensorSummary] = []
    if loaded.meta_graph is not None:
        for sig_name, sig in sorted(loaded.meta_graph.signature_def.items()):
            if sig_name.startswith("__") or (not sig.inputs and not sig.outputs):
                continue
            signatures.append(sig_name)
            for key, info in sorted(sig.inputs.items()):
                inputs.append(
                    TensorSummary(info.name, _dtype_name(info.dtype), _shape_of(info.tensor_shape),
                                  _op_type(gd, info.name), sig_name, key)
                )
            for key, info in sorted(sig.outputs.items()):
                outputs.append(
                    TensorSummary(info.name, _dtype_name(info.dtype), _shape_of(info.tensor_shape),
                                  _op_type(gd, info.name), sig_name, key)
                )
    if not signatures:
        input_nodes = [
            n.name
            for n in gd.node
            if (n.op in _PLACEHOLDER_OPS or n.op in _OTHER_INPUT_OPS) and not _MACHINERY_SCOPE.match(n.name)
        ]
        output_nodes = [n.name for n in gd.node if n.name not in consumed and not _is_machinery(n)]
        inputs = _tensor_summaries(gd, graph, input_nodes)
        outputs = _tensor_summaries(gd, graph, output_nodes)

    variables = _object_graph_variables(loaded.meta_graph) if loaded.meta_graph is not None else []
    if not variables:
        variables = _graph_variables(gd, loaded.meta_graph)

    counts: Counter = Counter()
    const_bytes = 0
    for nodes in _all_node_lists(gd):
        for node in nodes:
            counts[node.op] += 1
            if node.op == "Const":
                const_bytes += _const_nbytes(node.attr["value"].tensor)
    return GraphSummary(
        source=loaded.source,
        kind=loaded.kind,
        node_count=len(gd.node),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        variables=tuple(variables),
        op_counts=dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        const_bytes=const_bytes,
        repaired=tuple(loaded.repaired),
        unknown_ops=loaded.unknown_ops,
        signatures=tuple(signatures),
    )


def _op_type(gd, tensor_name: str) -> str:
    node = _node_of(tensor_name)
    for n in gd.node:
        if n.name == node:
            return n.op
    return "?"


# ---------------------------------------------------------------- shared helpers


@dataclass(frozen=True)
class _GraphVariable:
    """A variable node of an imported GraphDef, shaped like a tf.Variable for ``scan``."""

    name: str
    shape: object
    dtype: object
    _save_slice_info: object = None


def _open_checkpoint(checkpoint):
    from restorekit.checkpoint import Checkpoint

    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    return Checkpoint(checkpoint)


def _serialize(graph_def, path: str) -> bytes:
    if graph_def.ByteSize() > MAX_PROTO_BYTES:
        raise GraphTooLargeError(
            f"the graph for {path!r} would be {graph_def.ByteSize() / 2**30:.2f} GiB, over protobuf's 2 GB limit. "
            f"Keep the weights in the checkpoint instead of freezing them into the graph."
        )
    if path.endswith((".pbtxt", ".txt")):
        from google.protobuf import text_format

        return text_format.MessageToString(graph_def).encode("utf-8")
    return graph_def.SerializeToString()


@contextlib.contextmanager
def _quiet_tf_logs():
    """Hide TF's deprecation warnings for the public-but-deprecated v1 APIs used on purpose."""
    logger = _tf().get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _ancestors(gd, names: Iterable[str]) -> set[str]:
    inputs = {n.name: [_node_of(i) for i in n.input] for n in gd.node}
    seen = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(inputs.get(name, ()))
    return seen


def _output_nodes(gd, outputs) -> list[str]:
    if isinstance(outputs, str):
        outputs = [o for o in outputs.split(",")]
    outputs = [strip_output_index(o.strip()) for o in outputs if o and o.strip()]
    if not outputs:
        raise InvalidArgumentError("freeze needs at least one output name, e.g. outputs=['logits'].")
    names = [n.name for n in gd.node]
    known = set(names)
    for name in outputs:
        if name not in known:
            near = closest_names(name, names)
            hint = f" Closest: {format_names(near)}." if near else ""
            raise NoMatchError(f"output {name!r} is not a node of the graph ({len(names)} nodes).{hint}", near)
    return outputs


# ---------------------------------------------------------------- freeze


def _takes_mutable_input(op_type: str) -> bool:
    """True when the op has an input it may write: a ref (``is_ref``) or a resource handle."""
    op_def = _op_def(op_type)
    if op_def is None:
        return False
    resource = _tf().resource.as_datatype_enum
    return any(arg.is_ref or arg.type == resource for arg in op_def.input_arg)


def _variable_source(by_name: dict, input_name: str) -> str | None:
    """The variable node an input reads, followed back through identities and control flow."""
    name, seen = _node_of(input_name), set()
    while name in by_name and name not in seen:
        seen.add(name)
        node = by_name[name]
        if node.op in _VARIABLE_OPS:
            return name
        if node.op not in _PASS_THROUGH_OPS or not node.input or node.input[0].startswith("^"):
            return None
        name = _node_of(node.input[0])
    return None


def _variable_writers(gd, names: set[str]) -> list:
    """The nodes among ``names`` that write a variable (moving-average updates, optimizer
    steps, assigns, scatters), told by their op taking a mutable input that is a variable,
    or by their op type."""
    by_name = {n.name: n for n in gd.node}
    writers = []
    for node in gd.node:
        if node.name not in names or node.op in _VARIABLE_OPS | _VARIABLE_READ_OPS | _PASS_THROUGH_OPS:
            continue
        if not _takes_mutable_input(node.op):
            continue
        if _WRITE_OP_PATTERN.match(node.op) or any(
            _variable_source(by_name, i) for i in node.input if not i.startswith("^")
        ):
            writers.append(node)
    return writers


def _without_writers(gd, output_names: list[str]):
    """A copy of ``gd`` without the variable writes the outputs wait on.

    A training graph runs its updates as control dependencies of the outputs (tf-slim's
    batch_norm with ``updates_collections=None``). Once the variables are constants the
    updates cannot run, and a writer left on a constant does not even import; what the
    outputs compute from the checkpoint's values does not change without them.
    """
    writers = _variable_writers(gd, _ancestors(gd, output_names))
    dropped = {w.name for w in writers}
    updates = [f"{w.name!r} ({w.op})" for w in writers if w.name in output_names]
    if updates:
        raise GraphError(
            f"outputs {', '.join(updates)} are variable updates, which a frozen graph cannot run. "
            f"Freeze the value they compute from instead."
        )
    result = type(gd)()
    result.CopyFrom(gd)
    waited: dict[str, list[str]] = {}  # node -> the writes it had to wait for
    for node in result.node:
        edges = [i for i in node.input if i.startswith("^") and i[1:] in dropped]
        if edges:
            waited[node.name] = [e[1:] for e in edges]
            node.input[:] = [i for i in node.input if i not in edges]
    upstream = _ancestors(result, output_names)
    by_name = {n.name: n for n in result.node}
    # Values that are the result of a write: the writer's own output, or a read ordered
    # after it. Dropping the write would silently change them, so refuse instead.
    after_write = []
    for node in result.node:
        if node.name not in upstream:
            continue
        for i in node.input:
            if not i.startswith("^") and _node_of(i) in dropped:
                after_write.append((node.name, _node_of(i)))
        if node.name in waited and (
            node.op in _VARIABLE_READ_OPS or (node.op in _PASS_THROUGH_OPS and _variable_source(by_name, node.name))
        ):
            after_write += [(node.name, w) for w in waited[node.name]]
    if after_write:
        ops = {w.name: w.op for w in writers}
        reads = [f"{reader!r} reads {writer!r} ({ops[writer]})" for reader, writer in after_write]
        more = f", ... and {len(reads) - 5} more" if len(reads) > 5 else ""
        raise GraphError(
            f"outputs {format_names(output_names)} use values written by variable updates, which a frozen graph "
            f"cannot run: {', '.join(reads[:5])}{more}. Freeze an output computed before the update."
        )
    return result


def _check_imports(gd, output_names: list[str]) -> None:
    """Raise GraphError unless the frozen ``gd`` imports into a fresh graph."""
    tf = _tf()
    try:
        with tf.Graph().as_default():
            tf.compat.v1.import_graph_def(gd, name="")
    except (ValueError, tf.errors.OpError) as e:
        # With its variables gone, a node that still wants a ref or a resource handle is
        # almost surely what breaks the import.
        suspects = [f"{n.name!r} ({n.op})" for n in gd.node if _takes_mutable_input(n.op)]
        more = f", ... and {len(suspects) - 5} more" if len(suspects) > 5 else ""
        hint = f" Nodes that still take a variable: {', '.join(suspects[:5])}{more}." if suspects else ""
        raise GraphError(
            f"the graph frozen for outputs {format_names(output_names)} does not import in TensorFlow "
            f"{tf.__version__}, so nothing was written: {str(e).rstrip('.')}.{hint}"
        ) from None


def freeze(checkpoint, graph, outputs, out=None):
    """Restore ``checkpoint`` into ``graph`` and turn the variables the outputs need into constants.

        gd = restorekit.freeze('train/model.ckpt-1000', 'train/model.ckpt-1000.meta',
                               ['logits'], out='frozen.pb')

    Checkpoint names are the variable names (for partitioned variables, the full name
    from the MetaGraph's save-slice info). Device assignments are cleared. Variable
    updates the outputs wait on (batch-norm moving averages in a training graph,
    optimizer steps) are dropped with the control edges to them: the frozen graph
    computes what one run of the original graph computes from the checkpoint's values.
    The result is checked to import in a fresh graph before anything is written.

    Args:
        checkpoint: a checkpoint prefix, directory or ``restorekit.Checkpoint``.
        graph: a ``.meta`` or ``.pb`` path, a SavedModel directory, a GraphDef,
            MetaGraphDef or ``tf.Graph``.
        outputs: output node names (a list, or one comma-separated string); ``':0'``
            suffixes are ignored.
        out: where to write the frozen GraphDef (binary; text for ``.pbtxt``), written
            atomically. ``None`` writes nothing.

    Returns:
        The frozen GraphDef.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``checkpoint``.
        GraphError: the graph is missing, not a graph, truncated, or does not load; an
            output uses a value a variable update wrote; or the frozen graph does not
            import (the message names the nodes that still take a variable).
        GraphTooLargeError: the graph, or the frozen graph, is over 2 GB.
        NoMatchError: an output is not in the graph (``closest`` has near misses).
        IncompleteRestoreError: the checkpoint lacks, or has other shapes for, variables
            the outputs need (``report`` is the RestoreReport of ``restorekit.scan``).
    """
    from restorekit.scan import scan

    tf = _tf()
    tf1 = tf.compat.v1
    ckpt = _open_checkpoint(checkpoint)
    loaded = _repair(_load(graph))
    _require_loadable(loaded)
    if loaded.kind == "SavedModel" and loaded.meta_graph.object_graph_def.nodes:
        raise GraphError(
            f"{loaded.source!r} is a TF2 SavedModel: its computation lives in tf.functions whose variables "
            f"are captured, which freezing a TF1 graph cannot reach. Load it and use "
            f"convert_variables_to_constants_v2 on a concrete function instead."
        )
    gd = loaded.graph_def
    if out is not None and os.path.exists(os.fspath(out)) and isinstance(graph, (str, os.PathLike)):
        if os.path.samefile(os.fspath(out), os.fspath(graph)):
            raise OutputExistsError(f"out {os.fspath(out)!r} is the graph being frozen; pick another path.")
    output_names = _output_nodes(gd, outputs)
    for node in gd.node:
        node.device = ""

    inference = _without_writers(gd, output_names)
    upstream = _ancestors(inference, output_names)
    needed = [n for n in gd.node if n.op in _VARIABLE_OPS and n.name in upstream]
    vdefs = _variable_defs(loaded.meta_graph)
    plan = []  # (node, checkpoint name, slice of the checkpoint tensor or None)
    targets: dict = {}
    for node in needed:
        shape = tf.TensorShape(_shape_of(node.attr["shape"].shape))
        dtype = tf.as_dtype(node.attr["dtype"].type)
        vdef = vdefs.get(node.name)
        info = vdef.save_slice_info_def if vdef is not None and vdef.HasField("save_slice_info_def") else None
        if info is not None and info.full_name:
            index = tuple(slice(o, o + s) for o, s in zip(info.var_offset, info.var_shape))
            plan.append((node, info.full_name, index))
            targets.setdefault(info.full_name, []).append(_GraphVariable(f"{node.name}:0", shape, dtype, info))
        else:
            plan.append((node, node.name, None))
            targets[node.name] = _GraphVariable(f"{node.name}:0", shape, dtype)
    report = scan(ckpt, targets, skip_optimizer_slots=False, include_global_step=True)
    if not report.is_complete:
        # The report's own advice (strict=False) does not apply to freezing.
        problems = report.incomplete_message().rsplit("\n", 1)[0]
        raise IncompleteRestoreError(
            f"{problems}\nFreezing needs every variable the outputs depend on; pass the checkpoint written "
            f"for this graph.",
            report,
        )
    estimate = gd.ByteSize() + sum(ckpt.entries[key].nbytes for _, key, _ in plan)
    if estimate > MAX_PROTO_BYTES:
        raise GraphTooLargeError(
            f"freezing {len(plan)} variables into the graph would make it about {estimate / 2**30:.2f} GiB, over "
            f"protobuf's 2 GB limit. Keep the weights in the checkpoint instead."
        )

    with tf.Graph().as_default() as g:
        tf.import_graph_def(gd, name="")
        feeds, assigns = {}, []
        with tf1.name_scope("restorekit_restore"):
            for node, key, index in plan:
                value = ckpt.read(key)
                if index is not None:
                    value = value[index]
                target = g.get_tensor_by_name(f"{node.name}:0")
                holder = tf1.placeholder(tf.as_dtype(node.attr["dtype"].type), value.shape)
                if node.op == "VarHandleOp":
                    assigns.append(tf.raw_ops.AssignVariableOp(resource=target, value=holder))
                else:
                    assigns.append(tf.raw_ops.Assign(ref=target, value=holder))
                feeds[holder] = value
        with tf1.Session(graph=g) as sess:
            sess.run(assigns, feeds)
            with _quiet_tf_logs():
                frozen = tf1.graph_util.convert_variables_to_constants(sess, inference, output_names)
    _drop_stale_colocation(frozen)
    _check_imports(frozen, output_names)
    if out is not None:
        out = os.fspath(out)
        atomic.write_bytes(out, _serialize(frozen, out))
    return frozen


# ---------------------------------------------------------------- unfreeze


def _const_consumers(gd) -> dict[str, list]:
    consumers: dict[str, list] = {}
    for node in gd.node:
        for i in node.input:
            if not i.startswith("^"):
                consumers.setdefault(i.split(":")[0], []).append(node)
    return consumers


def _weight_pattern(node, consumers) -> str | None:
    readers = [c for c in consumers.get(node.name, ()) if c.op == "Identity"]
    if any(c.name == f"{node.name}/read" for c in readers):
        return "variable"
    if node.name.endswith("/resource") and any(c.name == node.name[: -len("/resource")] for c in readers):
        # TF2 (convert_variables_to_constants_v2): the captured handle became
        # '<op>/ReadVariableOp/resource'; the variable's own name is gone.
        return "resource (TF2)"
    if any(_READ_VARIABLE_LEAF.search(c.name) for c in readers):
        return "resource"
    for c in consumers.get(node.name, ()):
        # A ResourceGather becomes GatherV2 on the constant with a new '<gather>/axis' input.
        if c.op == "GatherV2" and len(c.input) == 3 and c.input[0] == node.name and c.input[2] == f"{c.name}/axis":
            return "resource"
    return None


def _find_weights(gd, weights, min_bytes: int) -> list[tuple]:
    """(Const node, pattern) pairs for the constants ``weights`` selects."""
    tf = _tf()
    consts = [n for n in gd.node if n.op == "Const"]
    consumers = _const_consumers(gd)
    numeric = [n for n in consts if tf.dtypes.as_dtype(n.attr["dtype"].type) != tf.string]
    if isinstance(weights, str) and weights == "auto":
        found = [(n, _weight_pattern(n, consumers)) for n in numeric]
        return [(n, p) for n, p in found if p]
    if isinstance(weights, str) and weights == "large":
        return [
            (n, _weight_pattern(n, consumers) or "large")
            for n in numeric
            if tf.dtypes.as_dtype(n.attr["dtype"].type).is_floating
            and _const_nbytes(n.attr["value"].tensor) >= min_bytes
        ]
    if callable(weights):
        return [(n, _weight_pattern(n, consumers) or "chosen") for n in numeric if weights(n)]
    if isinstance(weights, (list, tuple, set, frozenset)):
        by_name = {n.name: n for n in gd.node}
        result = []
        for name in weights:
            name = strip_output_index(str(name))
            if name not in by_name:
                near = closest_names(name, [n.name for n in consts])
                hint = f" Closest constants: {format_names(near)}." if near else ""
                raise NoMatchError(f"weight {name!r} is not a node of the frozen graph.{hint}", near)
            node = by_name[name]
            if node.op != "Const" or node not in numeric:
                raise InvalidArgumentError(f"weight {name!r} is a {node.op} node; only numeric Const nodes convert.")
            result.append((node, _weight_pattern(node, consumers) or "chosen"))
        return result
    raise InvalidArgumentError(
        f"weights is 'auto', 'large', a list of node names, or a callable on a NodeDef; got {weights!r}"
    )


def _reference_entries(reference) -> dict[str, tuple[tuple, str]]:
    """name -> (shape, dtype) of a reference checkpoint or graph."""
    from restorekit.checkpoint import Checkpoint

    graph_pb2, meta_graph_pb2, saved_model_pb2 = _protos()
    is_graph = isinstance(reference, (graph_pb2.GraphDef, meta_graph_pb2.MetaGraphDef, saved_model_pb2.SavedModel))
    if isinstance(reference, (str, os.PathLike)):
        path = os.fspath(reference)
        is_graph = path.endswith((".meta", ".pb", ".pbtxt")) and os.path.isfile(path)
    elif not is_graph and not isinstance(reference, Checkpoint):
        is_graph = isinstance(reference, _tf().Graph)
    if is_graph:
        loaded = _load(reference)
        variables = _graph_variables(loaded.graph_def, loaded.meta_graph)
        return {(v.checkpoint_name or v.name): (v.shape, v.dtype) for v in variables}
    ckpt = _open_checkpoint(reference)
    return {name: (tuple(e.shape), e.dtype) for name, e in ckpt.entries.items()}


def _align(units: list[tuple], reference: dict) -> list[Alignment]:
    """New names for ``(name, shape, dtype)`` units: the same name and shape, else a unique shape and dtype match."""
    new = [None] * len(units)
    reasons = [""] * len(units)
    taken = set()
    for i, (name, shape, _) in enumerate(units):
        if name in reference and tuple(reference[name][0] or ()) == shape:
            new[i], reasons[i] = name, "same name and shape"
            taken.add(name)
    own_names = {u[0] for u in units}
    open_refs: dict = {}
    for name, (shape, dtype) in reference.items():
        if name in taken or name in own_names or optimizer_slot_kind(name) or is_global_step(name):
            continue
        open_refs.setdefault((tuple(shape or ()), dtype), []).append(name)
    open_units: dict = {}
    for i, (_, shape, dtype) in enumerate(units):
        if new[i] is None:
            open_units.setdefault((shape, dtype), []).append(i)
    for key, indexes in open_units.items():
        refs = open_refs.get(key, [])
        if len(indexes) == 1 and len(refs) == 1:
            new[indexes[0]] = refs[0]
            reasons[indexes[0]] = f"unique shape match {format_shape(key[0], _UNKNOWN_RANK)}"
    for i, (name, _, _) in enumerate(units):
        if new[i] is None:
            new[i] = name
            reasons[i] = "no same-name or unique-shape match in the reference; kept its name"
    return [Alignment(u[0], n, r) for u, n, r in zip(units, new, reasons)]


_PART = re.compile(r"^(?P<base>.+)/part_(?P<index>\d+)$")


def _join_partitions(converted: list[ConvertedConstant]) -> list[ConvertedConstant]:
    """Mark complete sets of ``X/part_0..N`` constants as slices of one variable ``X``."""
    groups: dict[str, dict[int, int]] = {}
    for i, c in enumerate(converted):
        m = _PART.match(c.name)
        if m:
            groups.setdefault(m.group("base"), {})[int(m.group("index"))] = i
    names = {c.name for c in converted}
    result = list(converted)
    for base, parts in groups.items():
        if base in names or sorted(parts) != list(range(len(parts))):
            continue
        members = [converted[parts[k]] for k in range(len(parts))]
        shapes = [m.shape for m in members]
        if len({m.dtype for m in members}) != 1 or len({len(sh) for sh in shapes}) != 1 or not shapes[0]:
            continue
        differing = [d for d in range(len(shapes[0])) if len({sh[d] for sh in shapes}) > 1]
        if len(differing) > 1:
            continue
        # TF's partitioners split one axis, axis 0 unless told otherwise.
        axis = differing[0] if differing else 0
        full_shape = list(shapes[0])
        full_shape[axis] = sum(sh[axis] for sh in shapes)
        start = 0
        for k, member in enumerate(members):
            offset = [0] * len(full_shape)
            offset[axis] = start
            start += member.shape[axis]
            result[parts[k]] = dataclasses.replace(
                member, full_name=base, full_shape=tuple(full_shape), offset=tuple(offset)
            )
    return result


def _write_checkpoint(prefix: str, tensors: list[tuple[str, str, np.ndarray]]) -> None:
    """Write ``(checkpoint name, slice spec or '', value)`` as a V2 checkpoint at ``prefix``, atomically."""
    tf = _tf()
    tf1 = tf.compat.v1
    directory = os.path.dirname(os.path.abspath(prefix))
    with atomic.Staging(directory) as staging:
        tmp_prefix = os.path.join(staging.tmpdir, os.path.basename(prefix))
        with tf.Graph().as_default():
            # Placeholders keep the tensors out of the graph (no 2 GB GraphDef limit).
            holders = [tf1.placeholder(tf.as_dtype(value.dtype), value.shape) for _, _, value in tensors]
            save = tf.raw_ops.SaveV2(
                prefix=tmp_prefix,
                tensor_names=[name for name, _, _ in tensors],
                shape_and_slices=[spec for _, spec, _ in tensors],
                tensors=holders,
            )
            with tf1.Session() as sess:
                sess.run(save, dict(zip(holders, (value for _, _, value in tensors))))
        for f in os.listdir(staging.tmpdir):
            if f == f"{os.path.basename(prefix)}.index" or f.startswith(f"{os.path.basename(prefix)}.data-"):
                staging.path(os.path.join(directory, f))
        # Data shards first, the index last: a reader never sees an index without its data.
        staging.commit()


def _slice_spec(c: ConvertedConstant) -> str:
    """The Saver's slice spec of a partition: 'full dims offset,length:offset,length'."""
    if c.full_name is None:
        return ""
    full = " ".join(str(d) for d in c.full_shape)
    return f"{full} " + ":".join(f"{o},{n}" for o, n in zip(c.offset, c.shape))


def _add_slice_infos(meta, converted: list[ConvertedConstant]) -> None:
    """Give partition variables their save-slice info, so the Saver restores them as slices."""
    from tensorflow.core.framework import variable_pb2

    parts = {f"{c.name}:0": c for c in converted if c.full_name is not None}
    if not parts:
        return
    for key in ("variables", "trainable_variables"):
        if key not in meta.collection_def:
            continue
        values = meta.collection_def[key].bytes_list.value
        for i, raw in enumerate(values):
            vdef = variable_pb2.VariableDef.FromString(raw)
            c = parts.get(vdef.variable_name)
            if c is None:
                continue
            info = vdef.save_slice_info_def
            info.full_name = c.full_name
            info.full_shape[:] = c.full_shape
            info.var_offset[:] = c.offset
            info.var_shape[:] = c.shape
            values[i] = vdef.SerializeToString()


def _trainable_meta_graph(gd, converted: list[ConvertedConstant]):
    """A MetaGraphDef of ``gd`` with the converted constants as variables, plus its Saver."""
    tf = _tf()
    tf1 = tf.compat.v1
    # 1. The variables, built by TF itself in a scratch graph so their nodes and
    #    VariableDefs are exactly what tf1.get_variable makes (zeros: values come from
    #    the checkpoint, which keeps the MetaGraph small).
    with tf.Graph().as_default() as scratch:
        for c in converted:
            dtype = tf.as_dtype(c.dtype)
            var = tf1.get_variable(
                c.name,
                shape=c.shape,
                dtype=dtype,
                initializer=tf1.zeros_initializer(),
                use_resource=c.pattern != "variable",
                trainable=dtype.is_floating or dtype.is_complex,
            )
            if var.op.name != c.name:
                raise GraphError(f"cannot name a variable {c.name!r} (TensorFlow made {var.op.name!r}).")
        scratch_meta = tf1.train.export_meta_graph(graph=scratch)
    scratch_nodes = {n.name: n for n in scratch_meta.graph_def.node}

    # 2. The frozen graph, rewired: constants dropped, their readers reading the variables.
    renamed = {c.node: c for c in converted}
    merged = type(gd)()
    merged.versions.CopyFrom(gd.versions)
    merged.library.CopyFrom(gd.library)
    for node in gd.node:
        if node.name in renamed:
            continue
        sources = [renamed.get(_node_of(i)) for i in node.input]
        reads = [s for s, i in zip(sources, node.input) if s is not None and not i.startswith("^")]
        if node.name in scratch_nodes:
            # The variable's own reader (e.g. 'w/read'), rebuilt by TF in step 1.
            if reads and all(r.name == reads[0].name for r in reads) and node.op == "Identity":
                continue
            raise GraphError(f"frozen node {node.name!r} has the name of a node the variables need; rename it first.")
        new = merged.node.add()
        new.CopyFrom(node)
        if reads and node.op == "Identity" and reads[0].pattern != "variable":
            # The Identity convert_variables_to_constants left for a ReadVariableOp: a read again.
            dtype = new.attr["T"].type
            del new.attr["T"]
            new.op = "ReadVariableOp"
            new.attr["dtype"].type = dtype
            new.input[0] = reads[0].name
            continue
        for k, (inp, source) in enumerate(zip(node.input, sources)):
            if source is None:
                continue
            if inp.startswith("^"):
                new.input[k] = "^" + source.name
            elif node.op == "Identity" and source.pattern == "variable":
                new.input[k] = source.name
            else:
                new.input[k] = f"{source.name}/read" if source.pattern == "variable" else f"{source.name}/Read/ReadVariableOp"
        if "_class" in new.attr:
            refs = [bytes(s) for s in new.attr["_class"].list.s]
            new.attr["_class"].list.s[:] = [
                b"loc:@" + renamed[s[5:].decode()].name.encode() if s[5:].decode() in renamed else s for s in refs
            ]
    for node in scratch_meta.graph_def.node:
        merged.node.add().CopyFrom(node)

    meta = type(scratch_meta)()
    meta.CopyFrom(scratch_meta)
    meta.graph_def.CopyFrom(merged)
    _add_slice_infos(meta, converted)
    # 3. Load it, as a user would, and add the Saver.
    try:
        with tf.Graph().as_default() as g:
            tf1.train.import_meta_graph(meta, clear_devices=True)
            variables = tf1.global_variables()
            saver = tf1.train.Saver(variables)
            result = tf1.train.export_meta_graph(graph=g, saver_def=saver.as_saver_def(), clear_devices=True)
    except (ValueError, tf.errors.OpError) as e:
        raise GraphError(f"could not build a trainable graph from the frozen graph: {e}") from None
    return result


def unfreeze(
    frozen,
    out_prefix,
    *,
    weights="auto",
    reference=None,
    trainable_graph: bool = False,
    min_bytes: int = LARGE_CONSTANT_BYTES,
) -> UnfreezeResult:
    """Turn the weight constants of a frozen graph back into a checkpoint (and a trainable graph).

        result = restorekit.unfreeze('frozen.pb', 'restored/model.ckpt', trainable_graph=True)
        saver = tf.compat.v1.train.import_meta_graph(result.meta_graph)
        saver.restore(sess, result.checkpoint)

    ``weights='auto'`` finds the constants ``convert_variables_to_constants`` made: a
    ``Const`` read through ``<name>/read`` (VariableV2) or through an ``Identity`` named
    ``.../ReadVariableOp`` (resource variables). Each is written under its node name,
    which is the original variable name; the parts ``X/part_0..N`` of a partitioned
    variable are saved, as a Saver saves them, as slices of ``X``. Graphs frozen by TF2's
    ``convert_variables_to_constants_v2`` lose the variable names (the constants are
    ``<op>/ReadVariableOp/resource``): pass ``reference`` to get them back.

    Args:
        frozen: a frozen GraphDef (``.pb`` path, GraphDef or ``tf.Graph``).
        out_prefix: the checkpoint prefix to write (``dir/model.ckpt``).
        weights: ``'auto'``; ``'large'`` (every floating constant of at least
            ``min_bytes``); a list of Const node names; or a callable taking a Const
            NodeDef and returning True for weights.
        reference: a checkpoint or MetaGraph whose names to use: each constant takes the
            reference name with its own name and shape, else the one reference entry
            with its shape and dtype when both sides have exactly one.
        trainable_graph: also write ``out_prefix + '.meta'``, the frozen graph with the
            weights as trainable variables and a Saver for the checkpoint.
        min_bytes: the size threshold of ``weights='large'``.

    Returns:
        An UnfreezeResult.

    Raises:
        GraphError: not a graph, or no weight constants found (nothing is written).
        NoMatchError: a name in ``weights`` is not in the graph.
        CheckpointNotFoundError: ``reference`` names no checkpoint.
    """
    tf = _tf()
    loaded = _repair(_load(frozen))
    gd = loaded.graph_def
    if trainable_graph:
        _require_loadable(loaded)
    chosen = _find_weights(gd, weights, min_bytes)
    if not chosen:
        variables = [n.name for n in gd.node if n.op in _VARIABLE_OPS]
        if variables:
            hint = f" It still has {len(variables)} variables ({format_names(variables, 3)}): it is not frozen."
        elif weights == "large":
            hint = f" No floating constant reaches min_bytes={min_bytes}: lower it, or pass a list of node names."
        else:
            hint = " Pass weights='large' to take every large floating constant, or a list of names."
        raise GraphError(f"{loaded.source!r}: no weight constants found with weights={weights!r}.{hint}")
    converted = []
    for node, pattern in chosen:
        tensor = node.attr["value"].tensor
        shape = tuple(d.size for d in tensor.tensor_shape.dim)
        converted.append(ConvertedConstant(node.name, node.name, shape, _dtype_name(tensor.dtype), pattern))
    converted = _join_partitions(converted)
    aligned: list[Alignment] = []
    if reference is not None:
        # A partitioned variable aligns as one: its full name and full shape.
        units = list({(c.checkpoint_name, c.full_shape or c.shape, c.dtype): None for c in converted})
        aligned = _align(units, _reference_entries(reference))
        rename = {a.old: a.new for a in aligned}
        for i, c in enumerate(converted):
            if c.full_name:
                part = c.name[len(c.full_name) + 1 :]
                new = rename[c.full_name]
                converted[i] = dataclasses.replace(c, name=f"{new}/{part}", full_name=new)
            else:
                converted[i] = dataclasses.replace(c, name=rename[c.name])
    seen: dict = {}
    for c in converted:
        if c.name in seen:
            raise InvalidArgumentError(f"constants {seen[c.name]!r} and {c.node!r} would both be saved as {c.name!r}.")
        seen[c.name] = c.node

    out_prefix = os.fspath(out_prefix)
    meta_bytes = None
    if trainable_graph:
        meta_bytes = _trainable_meta_graph(gd, converted).SerializeToString()
    by_node = {n.name: n for n in gd.node}
    tensors = [
        (c.checkpoint_name, _slice_spec(c), tf.make_ndarray(by_node[c.node].attr["value"].tensor))
        for c in sorted(converted, key=lambda c: (c.checkpoint_name, c.offset or ()))
    ]
    _write_checkpoint(out_prefix, tensors)
    meta_path = None
    if meta_bytes is not None:
        meta_path = out_prefix + ".meta"
        atomic.write_bytes(meta_path, meta_bytes)
    return UnfreezeResult(out_prefix, meta_path, tuple(converted), tuple(aligned))
