"""Make old graphs load in today's TensorFlow: each repair is one named step that records what it changed."""

from __future__ import annotations

import re
from collections import Counter

from restorekit.errors import GraphError, format_names
from restorekit.graph.common import _all_node_lists, _op_def, _tf
from restorekit.graph.loading import _Loaded

_STALE_SHAPES = re.compile(r"Node '([^']+)' has an _output_shapes attribute inconsistent")
# Strip stale shape hints node by node this many times, then all at once.
_MAX_STALE_SHAPE_RETRIES = 10


def _repair(loaded: _Loaded) -> _Loaded:
    """Make ``loaded.graph_def`` import in this TensorFlow; record each change and why."""
    _drop_unknown_attrs(loaded)
    stale_class = _drop_stale_colocation(loaded.graph_def)
    if stale_class:
        loaded.repaired.append(f"dropped colocation ('_class') with nodes not in the graph from {stale_class} nodes")
    _require_inputs(loaded)
    if not loaded.unknown_ops:
        _strip_stale_shapes(loaded)
    return loaded


def _drop_unknown_attrs(loaded: _Loaded) -> None:
    """Drop attrs the op registry does not define (written by a newer or older TF); note unknown ops."""
    gd = loaded.graph_def
    functions = {f.signature.name for f in gd.library.function}
    unknown = set()
    dropped: Counter = Counter()
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
                    dropped[f"{key!r} of {node.op}"] += 1
    if dropped:
        loaded.repaired.append(
            "dropped attrs this TensorFlow's op registry does not define: "
            + ", ".join(f"{k} ({n} nodes)" for k, n in sorted(dropped.items()))
        )
    loaded.unknown_ops = tuple(sorted(unknown))


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


def _require_inputs(loaded: _Loaded) -> None:
    """Raise GraphError when inputs name nodes that are not in the graph (no repair can add them)."""
    gd = loaded.graph_def
    names = {n.name for n in gd.node}
    missing = [(n.name, i) for n in gd.node for i in n.input if i.lstrip("^").split(":")[0] not in names]
    if missing:
        node, inp = missing[0]
        raise GraphError(
            f"{loaded.source!r} is incomplete: {len(missing)} inputs name nodes that are not in the graph "
            f"(first: {node!r} reads {inp!r}). The file may be truncated."
        )


def _strip_stale_shapes(loaded: _Loaded) -> None:
    """Import the graph, stripping the '_output_shapes' hints import rejects until it loads.

    '_output_shapes' are hints written by the TF that saved the graph; shape functions
    changed since, and import rejects hints it disagrees with.
    """
    tf = _tf()
    gd = loaded.graph_def
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
            if len(stale) < _MAX_STALE_SHAPE_RETRIES:
                stale.append(m.group(1))
                _strip_output_shapes(gd, m.group(1))
            else:
                _strip_output_shapes(gd)
                stripped_all = True
    if stale:
        where = "every node" if stripped_all else format_names(stale)
        loaded.repaired.append(
            f"stripped stale '_output_shapes' from {where}: they disagree with the shapes this TensorFlow infers"
        )


def _strip_output_shapes(gd, name: str | None = None) -> None:
    """Delete '_output_shapes' from the node ``name`` of the graph, or from every node and function node."""
    if name is not None:
        for node in gd.node:
            if node.name == name:
                del node.attr["_output_shapes"]
        return
    for nodes in _all_node_lists(gd):
        for node in nodes:
            if "_output_shapes" in node.attr:
                del node.attr["_output_shapes"]


def _require_loadable(loaded: _Loaded) -> None:
    if loaded.unknown_ops:
        raise GraphError(
            f"{loaded.source!r} uses ops this TensorFlow does not register: {format_names(loaded.unknown_ops)}. "
            f"Import the library that defines them (e.g. tensorflow_text) before loading the graph."
        )
