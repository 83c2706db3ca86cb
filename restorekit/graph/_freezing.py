"""freeze: restore a checkpoint into a graph and turn the variables its outputs need into constants."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from restorekit._bundle.staging import write_bytes
from restorekit.errors import (
    GraphError,
    GraphTooLargeError,
    IncompleteRestoreError,
    InvalidArgumentError,
    NoMatchError,
    format_names,
)
from restorekit.graph import _common as common
from restorekit.graph._common import (
    _VARIABLE_OPS,
    _ancestors,
    _check_output,
    _node_of,
    _op_def,
    _open_checkpoint,
    _quiet_tf_logs,
    _serialize,
    _shape_of,
    _tf,
)
from restorekit.graph._inspect import _variable_defs
from restorekit.graph._loading import _load
from restorekit.graph._repairs import _drop_stale_colocation, _repair, _require_loadable
from restorekit._names import strip_output_index

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


@dataclass(frozen=True)
class _GraphVariable:
    """A variable node of an imported GraphDef, shaped like a tf.Variable for ``scan``."""

    name: str
    shape: object
    dtype: object
    _save_slice_info: object = None


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
            raise NoMatchError(
                f"output {name!r} is not a node of the graph ({len(names)} nodes).", name=name, candidates=names
            )
    return outputs


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


def freeze(checkpoint, graph, outputs, out=None, *, overwrite: bool = False):
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
        overwrite: replace an existing ``out``; without it an existing ``out`` is
            refused before anything is read. ``out`` is never the graph being frozen.

    Returns:
        The frozen GraphDef.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``checkpoint``.
        OutputExistsError: ``out`` exists and ``overwrite`` is False, or ``out`` is the
            graph file itself (``is_source``).
        GraphError: the graph is missing, not a graph, truncated, or does not load; an
            output uses a value a variable update wrote; or the frozen graph does not
            import (the message names the nodes that still take a variable).
        GraphTooLargeError: the graph, or the frozen graph, is over 2 GB.
        NoMatchError: an output is not in the graph (``closest`` has near misses).
        IncompleteRestoreError: the checkpoint lacks, or has other shapes for, variables
            the outputs need (``report`` is the RestoreReport of ``restorekit.scan``).
    """
    _check_output(out, overwrite=overwrite, source=graph, what="graph being frozen")
    ckpt = _open_checkpoint(checkpoint)
    loaded = _repair(_load(graph))
    _require_loadable(loaded)
    if loaded.kind == "SavedModel" and loaded.meta_graph is not None and loaded.meta_graph.object_graph_def.nodes:
        raise GraphError(
            f"{loaded.source!r} is a TF2 SavedModel: its computation lives in tf.functions whose variables "
            f"are captured, which freezing a TF1 graph cannot reach. Load it and use "
            f"convert_variables_to_constants_v2 on a concrete function instead."
        )
    gd = loaded.graph_def
    output_names = _output_nodes(gd, outputs)
    for node in gd.node:
        node.device = ""

    inference = _without_writers(gd, output_names)
    upstream = _ancestors(inference, output_names)
    needed = [n for n in gd.node if n.op in _VARIABLE_OPS and n.name in upstream]
    plan, targets = _restore_plan(needed, _variable_defs(loaded.meta_graph))
    _require_restorable(ckpt, targets)
    estimate = gd.ByteSize() + sum(ckpt.entries[key].nbytes for _, key, _ in plan)
    if estimate > common.MAX_PROTO_BYTES:
        raise GraphTooLargeError(
            f"freezing {len(plan)} variables into the graph would make it about {estimate / 2**30:.2f} GiB, over "
            f"protobuf's 2 GB limit. Keep the weights in the checkpoint instead."
        )
    frozen = _convert(gd, inference, output_names, ckpt, plan)
    _drop_stale_colocation(frozen)
    _check_imports(frozen, output_names)
    if out is not None:
        out = os.fspath(out)
        write_bytes(out, _serialize(frozen, out))
    return frozen


def _restore_plan(needed: list, vdefs: dict) -> tuple[list, dict]:
    """What to restore into each variable node: ``(node, checkpoint name, index or None)``, and scan targets."""
    tf = _tf()
    plan: list[tuple[object, str, tuple[slice, ...] | None]] = []
    targets: dict = {}
    for node in needed:
        shape = tf.TensorShape(_shape_of(node.attr["shape"].shape))
        dtype = tf.as_dtype(node.attr["dtype"].type)
        vdef = vdefs.get(node.name)
        info = vdef.save_slice_info_def if vdef is not None and vdef.HasField("save_slice_info_def") else None
        if info is not None and info.full_name:
            # A partition reads its slice of the full variable the checkpoint holds.
            index = tuple(slice(o, o + s) for o, s in zip(info.var_offset, info.var_shape))
            plan.append((node, info.full_name, index))
            targets.setdefault(info.full_name, []).append(_GraphVariable(f"{node.name}:0", shape, dtype, info))
        else:
            plan.append((node, node.name, None))
            targets[node.name] = _GraphVariable(f"{node.name}:0", shape, dtype)
    return plan, targets


def _require_restorable(ckpt, targets: dict) -> None:
    """Raise IncompleteRestoreError unless the checkpoint covers every target."""
    from restorekit._scan import scan

    report = scan(ckpt, targets, skip_optimizer_slots=False, include_global_step=True)
    if not report.is_complete:
        # The report's own advice (strict=False) does not apply to freezing.
        problems = report.incomplete_message().rsplit("\n", 1)[0]
        raise IncompleteRestoreError(
            f"{problems}\nFreezing needs every variable the outputs depend on; pass the checkpoint written "
            f"for this graph.",
            report,
        )


def _convert(gd, inference, output_names: list[str], ckpt, plan: list):
    """Assign the checkpoint's values to the variables of ``gd``; return ``inference`` with them as constants."""
    tf = _tf()
    tf1 = tf.compat.v1
    with tf.Graph().as_default() as g:
        tf.import_graph_def(gd, name="")
        feeds, assigns = {}, []
        with tf1.name_scope("restorekit_restore"):
            for node, key, index in plan:
                value = ckpt.read(key)
                if index is not None:
                    value = value[index]
                target = g.get_tensor_by_name(f"{node.name}:0")
                # Placeholders keep the values out of the graph (no 2 GB GraphDef limit).
                holder = tf1.placeholder(tf.as_dtype(node.attr["dtype"].type), value.shape)
                if node.op == "VarHandleOp":
                    assigns.append(tf.raw_ops.AssignVariableOp(resource=target, value=holder))
                else:
                    assigns.append(tf.raw_ops.Assign(ref=target, value=holder))
                feeds[holder] = value
        with tf1.Session(graph=g) as sess:
            sess.run(assigns, feeds)
            with _quiet_tf_logs():
                return tf1.graph_util.convert_variables_to_constants(sess, inference, output_names)
