"""The trainable graph unfreeze writes: a frozen graph with its weight constants as variables, and a Saver."""

from __future__ import annotations

import re

from restorekit._ema import is_shadow_name
from restorekit.errors import GraphError
from restorekit.graph._common import _node_of, _tf
from restorekit.graph._results import ConvertedConstant
from restorekit._names import is_global_step, optimizer_slot_kind, strip_partition

# Statistics a layer or a training loop keeps beside the weights, named by their last
# component: batch-norm (and renorm) moving statistics, the zero-debias state of
# moving averages. Gradients never update them.
_STATISTIC_LEAF = re.compile(
    r"(^|/)(moving_mean|moving_variance|moving_stddev|moving_average|moving_avg|moving_var|"
    r"renorm_mean|renorm_stddev|renorm_stddev_weight|renorm_mean_weight|biased|local_step|"
    r"num_updates)(_\d+)?$"
)
_TF2_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def _is_statistic(name: str) -> bool:
    """True for a variable a model keeps but does not train (moving statistics, EMA shadows, global_step)."""
    name = strip_partition(name.removesuffix(_TF2_VALUE))
    return bool(
        _STATISTIC_LEAF.search(name)
        or is_shadow_name(name)
        or is_global_step(name)
        or optimizer_slot_kind(name)
    )


def _trainable(c: ConvertedConstant, dtype) -> bool:
    # The node name is the frozen variable's own; the checkpoint name may come from a reference.
    statistic = _is_statistic(c.node) or _is_statistic(c.checkpoint_name)
    return (dtype.is_floating or dtype.is_complex) and not statistic


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
    scratch_meta = _scratch_variables(converted)
    merged = _rewired(gd, converted, {n.name for n in scratch_meta.graph_def.node})
    for node in scratch_meta.graph_def.node:
        merged.node.add().CopyFrom(node)
    meta = type(scratch_meta)()
    meta.CopyFrom(scratch_meta)
    meta.graph_def.CopyFrom(merged)
    _add_slice_infos(meta, converted)
    # Load it, as a user would, and add the Saver.
    try:
        with tf.Graph().as_default() as g:
            # With variables and no saver_def, import_meta_graph builds the Saver itself.
            saver = tf1.train.import_meta_graph(meta, clear_devices=True)
            # Devices are cleared here, not by export_meta_graph(clear_devices=True), which
            # takes time quadratic in the node count (9 s for 3,000 variables, 55 s for 6,000).
            result = tf1.train.export_meta_graph(graph=g, saver_def=saver.as_saver_def())
    except (ValueError, tf.errors.OpError) as e:
        raise GraphError(f"could not build a trainable graph from the frozen graph: {e}") from None
    for node in result.graph_def.node:
        node.device = ""
    return result


def _scratch_variables(converted: list[ConvertedConstant]):
    """A MetaGraphDef holding only the variables, built by TF itself.

    Their nodes and VariableDefs are exactly what tf1.get_variable makes (zeros: values
    come from the checkpoint, which keeps the MetaGraph small).
    """
    tf = _tf()
    tf1 = tf.compat.v1
    with tf.Graph().as_default() as scratch:
        for c in converted:
            dtype = tf.as_dtype(c.dtype)
            var = tf1.get_variable(
                c.name,
                shape=c.shape,
                dtype=dtype,
                initializer=tf1.zeros_initializer(),
                use_resource=c.pattern != "variable",
                trainable=_trainable(c, dtype),
            )
            if var.op.name != c.name:
                raise GraphError(f"cannot name a variable {c.name!r} (TensorFlow made {var.op.name!r}).")
        return tf1.train.export_meta_graph(graph=scratch)


def _rewired(gd, converted: list[ConvertedConstant], scratch_nodes: set):
    """The frozen graph without the converted constants, their readers reading the variables."""
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
            # The variable's own reader (e.g. 'w/read'), rebuilt by TF in the scratch graph.
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
        _read_variables(new, node, sources)
        if "_class" in new.attr:
            refs = [bytes(s) for s in new.attr["_class"].list.s]
            new.attr["_class"].list.s[:] = [
                b"loc:@" + renamed[s[5:].decode()].name.encode() if s[5:].decode() in renamed else s for s in refs
            ]
    return merged


def _read_variables(new, node, sources: list) -> None:
    """Point ``new``'s inputs that read a converted constant at its variable (or its read op)."""
    for k, (inp, source) in enumerate(zip(node.input, sources)):
        if source is None:
            continue
        if inp.startswith("^"):
            new.input[k] = "^" + source.name
        elif node.op == "Identity" and source.pattern == "variable":
            new.input[k] = source.name
        else:
            new.input[k] = f"{source.name}/read" if source.pattern == "variable" else f"{source.name}/Read/ReadVariableOp"
