"""inspect_graph: a graph's inputs, likely outputs, variables, op counts and constant size."""

from __future__ import annotations

import math
import re
from collections import Counter


from restorekit.graph._common import (
    _PLACEHOLDER_OPS,
    _VARIABLE_OPS,
    _all_node_lists,
    _as_dtype,
    _dtype_name,
    _node_of,
    _shape_of,
    _tf,
)
from restorekit.graph._loading import _load
from restorekit.graph._repairs import _repair
from restorekit.graph._results import GraphSummary, TensorSummary, VariableSummary
from restorekit._ema import is_shadow_name
from restorekit.errors import GraphError
from restorekit._names import optimizer_slot_kind, strip_output_index

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


def _tf_shape(shape) -> tuple | None:
    if shape.rank is None:
        return None
    return tuple(shape.as_list())


def _const_nbytes(tensor) -> int:
    tf = _tf()
    dtype = _as_dtype(tensor.dtype)
    if dtype == tf.string:
        return sum(len(s) for s in tensor.string_val)
    # Exact integers: a crafted shape can overflow int64.
    return math.prod(d.size for d in tensor.tensor_shape.dim) * dtype.size


def _is_machinery(node) -> bool:
    return bool(
        node.op in _MACHINERY_OPS
        or _MACHINERY_OP_PATTERN.search(node.op)
        or _MACHINERY_SCOPE.match(node.name)
        or _MACHINERY_NAME.search(node.name)
    )


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
            if not 0 <= child.node_id < len(nodes):
                raise GraphError(
                    f"the SavedModel's object graph names node {child.node_id} as a child of node {i}, "
                    f"but it has {len(nodes)} nodes: the file is corrupt."
                )
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
                ema_shadow=is_shadow_name(var.name or paths.get(i, "")),
            )
        )
    return result


def _variable_def(raw: bytes, collection: str):
    """One VariableDef record of a MetaGraph collection; GraphError when it does not parse."""
    from google.protobuf import message
    from tensorflow.core.framework import variable_pb2

    try:
        return variable_pb2.VariableDef.FromString(raw)
    except message.DecodeError:
        raise GraphError(
            f"the MetaGraph's {collection!r} collection holds a record that is not a VariableDef: the file is corrupt."
        ) from None


def _variable_defs(meta_graph) -> dict:
    """variable name -> VariableDef, from a MetaGraph's variable collections."""
    result: dict = {}
    if meta_graph is None:
        return result
    for key in ("variables", "trainable_variables", "local_variables", "model_variables"):
        if key not in meta_graph.collection_def:
            continue
        for raw in meta_graph.collection_def[key].bytes_list.value:
            vdef = _variable_def(raw, key)
            result.setdefault(strip_output_index(vdef.variable_name), vdef)
    return result


def _graph_variables(gd, meta_graph) -> list[VariableSummary]:
    vdefs = _variable_defs(meta_graph)
    trainable = set()
    if meta_graph is not None and "trainable_variables" in meta_graph.collection_def:
        for raw in meta_graph.collection_def["trainable_variables"].bytes_list.value:
            trainable.add(strip_output_index(_variable_def(raw, "trainable_variables").variable_name))
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
                ema_shadow=is_shadow_name(node.name),
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
        output_nodes = sorted((n for n in gd.node if n.name not in consumed and not _is_machinery(n)),
                              key=_output_rank)
        output_nodes = [n.name for n in output_nodes]
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


# Dangling control-flow ends (an unused cond branch's Switch output, a while loop's
# Exit) are rarely what a user means by "the outputs": they go after the real ones.
_CONTROL_FLOW_OPS = frozenset({"Switch", "RefSwitch", "Exit", "RefExit", "Merge", "NextIteration", "LoopCond"})
_CONTROL_FLOW_NAME = re.compile(r"(^|/)(switch_[tf]|Switch(_\d+)?|Exit(_\d+)?)$")


def _output_rank(node) -> int:
    """0 for a likely output, 1 for a dangling control-flow end; a stable sort keeps graph order."""
    return 1 if node.op in _CONTROL_FLOW_OPS or _CONTROL_FLOW_NAME.search(node.name) else 0


def _op_type(gd, tensor_name: str) -> str:
    node = _node_of(tensor_name)
    for n in gd.node:
        if n.name == node:
            return n.op
    return "?"

