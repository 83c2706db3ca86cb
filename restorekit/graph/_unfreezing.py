"""unfreeze: turn the weight constants of a frozen graph back into a checkpoint (and a trainable graph)."""

from __future__ import annotations

import dataclasses
import glob
import os
import re

from restorekit._bundle import files
from restorekit._bundle.staging import Staging
from restorekit._bundle.format import dtype_name, encode_slice_key
from restorekit._bundle.writer import BundleWriter, partitioned_entry
from restorekit.errors import (
    GraphError,
    InsufficientSpaceError,
    InvalidArgumentError,
    NoMatchError,
    OutputError,
    OutputExistsError,
    format_names,
)
from restorekit.graph._common import _VARIABLE_OPS, _check_output, _dtype_name, _open_checkpoint, _protos, _tf
from restorekit.graph._constants import const_chunks, const_layout
from restorekit.graph._inspect import _const_nbytes, _graph_variables
from restorekit.graph._loading import _load
from restorekit.graph._repairs import _repair, _require_loadable
from restorekit.graph._results import _UNKNOWN_RANK, Alignment, ConvertedConstant, UnfreezeResult
from restorekit.graph._trainable import _trainable_meta_graph
from restorekit._names import is_weight, strip_output_index
from restorekit._report import format_bytes, format_shape

# unfreeze(weights='large') takes floating constants of at least this many bytes.
LARGE_CONSTANT_BYTES = 1024
# unfreeze(max_output_bytes=None) allows at least this much (see _default_max_output_bytes).
DEFAULT_MAX_OUTPUT_BYTES = 1 << 30
# Room for the .index beside the data, in the free-space check.
_INDEX_SLACK = files.INDEX_SLACK

# The TF1 resource-variable read that convert_variables_to_constants turns into Identity.
_READ_VARIABLE_LEAF = re.compile(r"(^|/)ReadVariableOp(_\d+)?$")


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
                raise NoMatchError(
                    f"weight {name!r} is not a node of the frozen graph.",
                    name=name,
                    candidates=[n.name for n in consts],
                    label="Closest constants",
                )
            node = by_name[name]
            if node.op != "Const" or tf.dtypes.as_dtype(node.attr["dtype"].type) == tf.string:
                raise InvalidArgumentError(f"weight {name!r} is a {node.op} node; only numeric Const nodes convert.")
            result.append((node, _weight_pattern(node, consumers) or "chosen"))
        return result
    raise InvalidArgumentError(
        f"weights is 'auto', 'large', a list of node names, or a callable on a NodeDef; got {weights!r}"
    )


def _reference_entries(reference) -> dict[str, tuple[tuple | None, str]]:
    """name -> (shape, dtype) of a reference checkpoint or graph (shape None: a graph variable of unknown rank)."""
    from restorekit._checkpoint import Checkpoint

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
    if ckpt.is_object_based:
        # A TF2 checkpoint's keys ('model/layer_with_weights-0/kernel/.ATTRIBUTES/...') mean
        # something only beside its object graph, which an unfrozen checkpoint cannot carry:
        # align to the model variables' readable paths, the names scan and Keras match by.
        return {t.path: (tuple(ckpt.entries[t.key].shape), ckpt.entries[t.key].dtype)
                for t in ckpt.object_graph.variables if t.kind == "variable" and t.key in ckpt.entries}
    return {name: (tuple(e.shape), e.dtype) for name, e in ckpt.entries.items()}


def _align(units: list[tuple], reference: dict) -> list[Alignment]:
    """New names for ``(name, shape, dtype)`` units: the same name and shape, else a unique shape and dtype match."""
    new: list[str | None] = [None] * len(units)
    reasons = [""] * len(units)
    taken = set()
    for i, (name, shape, _) in enumerate(units):
        if name in reference and tuple(reference[name][0] or ()) == shape:
            new[i], reasons[i] = name, "same name and shape"
            taken.add(name)
    own_names = {u[0] for u in units}
    open_refs: dict = {}
    for name, (shape, dtype) in reference.items():
        if name in taken or name in own_names or not is_weight(name):
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
    for i, n in enumerate(new):
        if n is None:
            reasons[i] = "no same-name or unique-shape match in the reference; kept its name"
    return [Alignment(u[0], u[0] if n is None else n, r) for u, n, r in zip(units, new, reasons)]


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


def _write_outputs(prefix: str, gd, converted: list[ConvertedConstant], layouts: dict, meta_bytes) -> None:
    """Write the checkpoint at ``prefix`` (and ``prefix.meta``) atomically, one constant at a time.

    Parts of a partitioned variable are written as a Saver writes them: each under its
    slice key, and the full name as an entry listing the slices. Tensors go in order of
    checkpoint name, then offset, as TF's SaveV2 wrote them before.
    """
    directory = os.path.dirname(os.path.abspath(prefix))
    by_node = {n.name: n for n in gd.node}
    # Shards of a checkpoint being replaced that the new index no longer names.
    stale = [f for f in glob.glob(glob.escape(os.path.abspath(prefix)) + ".data-*") if not f.endswith("-of-00001")]
    parts: dict[str, list] = {}
    with Staging(directory, output=prefix) as staging:
        with BundleWriter(prefix, staging=staging) as writer:
            for c in sorted(converted, key=lambda c: (c.checkpoint_name, c.offset or ())):
                layout = layouts[c.node]
                chunks = const_chunks(by_node[c.node], layout)
                if c.full_name is None:
                    writer.add_stream(c.name, layout.dtype, layout.shape, chunks)
                    continue
                assert c.offset is not None  # a partition has both its full name and its offset
                extents = tuple(zip(c.offset, c.shape))
                writer.add_stream(encode_slice_key(c.full_name, extents), layout.dtype, layout.shape, chunks)
                parts.setdefault(c.full_name, []).append((layout.dtype, c.full_shape, extents))
            for name, slices in parts.items():
                dtype, full_shape, _ = slices[0]
                writer.add_entry_only(name, partitioned_entry(dtype, full_shape, [e for _, _, e in slices]))
        if meta_bytes is not None:
            with open(staging.path(prefix + ".meta"), "wb") as f:
                f.write(meta_bytes)
        # Data shard and .meta first, the index last: a reader never sees an index without its data.
        staging.commit(remove_after=stale)


def _default_max_output_bytes(input_bytes: int) -> int:
    """1 GiB, or 64 times the input graph when that is more.

    A frozen graph stores each weight's bytes, so its checkpoint is about the graph's
    size; only splat constants (one value standing for a whole tensor) make it larger.
    64x leaves room for zero-filled buffers while refusing a tiny file that claims GBs.
    """
    return max(DEFAULT_MAX_OUTPUT_BYTES, 64 * input_bytes)


def _check_output_size(layouts: dict, prefix: str, extra: int, max_output_bytes: int, input_bytes: int) -> None:
    """Refuse, before anything is written, an output over ``max_output_bytes`` or over the free disk."""
    total = sum(layout.nbytes for layout in layouts.values()) + extra
    largest = max(layouts.values(), key=lambda layout: layout.nbytes)
    largest_text = (
        f"constant {largest.name!r} alone claims {format_bytes(largest.nbytes)} "
        f"({dtype_name(largest.dtype)} of shape {format_shape(largest.shape)})"
    )
    if total > max_output_bytes:
        raise OutputError(
            f"unfreezing would write {format_bytes(total)} for {len(layouts)} constants, over "
            f"max_output_bytes={max_output_bytes} ({format_bytes(max_output_bytes)}; the default is the larger of "
            f"1 GiB and 64 times the {input_bytes}-byte graph): {largest_text}. Nothing was written; pass a larger "
            f"max_output_bytes if the graph is trusted."
        )
    free = files.free_space(os.path.dirname(os.path.abspath(prefix)))
    if total + _INDEX_SLACK > free:
        raise InsufficientSpaceError(
            f"unfreezing to {prefix!r} needs about {format_bytes(total + _INDEX_SLACK)} but only "
            f"{format_bytes(free)} are free ({largest_text}); nothing was written."
        )


def _check_unfreeze_outputs(prefix: str, frozen, trainable_graph: bool, overwrite: bool) -> None:
    """Refuse an existing checkpoint (its .index) or .meta at ``prefix`` unless ``overwrite``."""
    index = prefix + ".index"
    if os.path.lexists(index) and not overwrite:
        raise OutputExistsError.worded(
            lambda w: f"checkpoint {prefix!r} exists ({index!r}); pass {w.option('overwrite') or 'overwrite'} "
                      "to replace it", path=prefix)
    if trainable_graph:
        _check_output(prefix + ".meta", overwrite=overwrite, source=frozen, what="frozen graph")


def _no_weights_error(loaded, weights, min_bytes: int) -> GraphError:
    variables = [n.name for n in loaded.graph_def.node if n.op in _VARIABLE_OPS]
    if variables:
        hint = f" It still has {len(variables)} variables ({format_names(variables, 3)}): it is not frozen."
    elif weights == "large":
        hint = f" No floating constant reaches min_bytes={min_bytes}: lower it, or pass a list of node names."
    else:
        hint = " Pass weights='large' to take every large floating constant, or a list of names."
    return GraphError(f"{loaded.source!r}: no weight constants found with weights={weights!r}.{hint}")


def _name_constants(chosen: list[tuple], reference) -> tuple[list[ConvertedConstant], list[Alignment]]:
    """The converted constants under their checkpoint names (aligned to ``reference`` when given)."""
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
    return converted, aligned


def unfreeze(
    frozen,
    out_prefix,
    *,
    weights="auto",
    reference=None,
    trainable_graph: bool = False,
    min_bytes: int = LARGE_CONSTANT_BYTES,
    max_output_bytes: int | None = None,
    overwrite: bool = False,
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

    The checkpoint is written by restorekit's bundle writer, one constant at a time,
    and appears (with the ``.meta``) only once complete. In the trainable graph,
    statistics (batch-norm moving mean and variance, moving-average shadows,
    ``global_step``) are variables that are not trainable.

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
        max_output_bytes: refuse to write more than this many bytes. A constant may
            list one value for a whole tensor, so a tiny graph can claim gigabytes; the
            size of every constant is computed from its dtype and shape before any is
            read. ``None`` (default): the larger of 1 GiB and 64 times the input graph's
            serialized size.
        overwrite: replace an existing checkpoint at ``out_prefix`` (and ``.meta``).

    Returns:
        An UnfreezeResult.

    Raises:
        GraphError: not a graph, or no weight constants found (nothing is written).
        OutputError: the constants would take more than ``max_output_bytes``.
        InsufficientSpaceError: they would not fit on the disk.
        OutputExistsError: a checkpoint exists at ``out_prefix`` (``.index``) or, with
            ``trainable_graph``, at ``out_prefix + '.meta'``, and ``overwrite`` is False.
        NoMatchError: a name in ``weights`` is not in the graph.
        CheckpointNotFoundError: ``reference`` names no checkpoint.
    """
    out_prefix = os.fspath(out_prefix)
    if max_output_bytes is not None and (isinstance(max_output_bytes, bool) or int(max_output_bytes) < 1):
        raise InvalidArgumentError(f"max_output_bytes is a positive number of bytes; got {max_output_bytes!r}")
    _check_unfreeze_outputs(out_prefix, frozen, trainable_graph, overwrite)
    loaded = _repair(_load(frozen))
    gd = loaded.graph_def
    if trainable_graph:
        _require_loadable(loaded)
    chosen = _find_weights(gd, weights, min_bytes)
    if not chosen:
        raise _no_weights_error(loaded, weights, min_bytes)
    converted, aligned = _name_constants(chosen, reference)
    layouts = {node.name: const_layout(node) for node, _ in chosen}
    input_bytes = gd.ByteSize()
    limit = _default_max_output_bytes(input_bytes) if max_output_bytes is None else int(max_output_bytes)
    _check_output_size(layouts, out_prefix, 0, limit, input_bytes)
    meta_bytes = None
    if trainable_graph:
        meta_bytes = _trainable_meta_graph(gd, converted).SerializeToString()
        _check_output_size(layouts, out_prefix, len(meta_bytes), limit, input_bytes)
    _write_outputs(out_prefix, gd, converted, layouts, meta_bytes)
    meta_path = out_prefix + ".meta" if trainable_graph else None
    return UnfreezeResult(out_prefix, meta_path, tuple(converted), tuple(aligned))
