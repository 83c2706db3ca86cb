"""Make old graphs load in today's TensorFlow: each repair is one named step that records what it changed."""

from __future__ import annotations

import os
import re
from collections import Counter

from restorekit._bundle.staging import write_bytes
from restorekit.errors import GraphError, format_names
from restorekit.graph._common import _all_node_lists, _check_output, _op_def, _protos, _serialize, _tf
from restorekit.graph._loading import _load, _Loaded

__all__ = ["import_meta_graph", "repair_graph"]

_STALE_SHAPES = re.compile(r"Node '([^']+)' has an _output_shapes attribute inconsistent")
# Strip stale shape hints node by node this many times, then all at once.
_MAX_STALE_SHAPE_RETRIES = 10


def repair_graph(source, out=None, *, overwrite: bool = False):
    """The graph of ``source``, repaired so it loads in this TensorFlow (what inspect_graph and freeze load).

        meta = restorekit.graph.repair_graph('old/model.ckpt-1000.meta', out='fixed.meta')

    Repairs: attrs this TensorFlow's op registry does not define are dropped, colocation
    with nodes not in the graph is dropped, and stale '_output_shapes' hints that import
    rejects are stripped. ``inspect_graph(source).repaired`` says which applied.

    Args:
        source: a ``.pb`` / ``.pbtxt`` / ``.meta`` path, a SavedModel directory (its
            'serve' MetaGraph, else its first), or a GraphDef, MetaGraphDef, SavedModel
            proto or ``tf.Graph``. The caller's file or protos are never changed.
        out: where to write the repaired graph, atomically (text for .pbtxt, .txt and
            .metatxt, else binary). ``None`` writes nothing.
        overwrite: replace an existing ``out`` (never the source file itself).

    Returns:
        A MetaGraphDef when ``source`` has one (a .meta or a SavedModel), else a GraphDef.

    Raises:
        GraphError: not a graph, truncated, ops this TensorFlow does not register, or
            a graph no repair makes load.
        OutputExistsError: ``out`` exists and ``overwrite`` is False, or ``out`` is the
            source file (``is_source``); nothing is written.
    """
    _check_output(out, overwrite=overwrite, source=source, what="graph being repaired")
    loaded = _repair(_load(source))
    _require_loadable(loaded)
    repaired = loaded.meta_graph if loaded.meta_graph is not None else loaded.graph_def
    if out is not None:
        out = os.fspath(out)
        write_bytes(out, _serialize(repaired, out))
    return repaired


def import_meta_graph(path, **kwargs):
    """``tf.compat.v1.train.import_meta_graph`` of the repaired graph: what it returns (a Saver, or None).

        with tf.Graph().as_default():
            saver = restorekit.graph.import_meta_graph('old/model.ckpt-1000.meta')
            with tf.compat.v1.Session() as sess:
                saver.restore(sess, 'old/model.ckpt-1000')

    Args:
        path: anything ``repair_graph`` takes; a GraphDef becomes a MetaGraphDef holding it.
        **kwargs: passed to ``import_meta_graph`` (``clear_devices``, ``import_scope``, ...).

    Raises:
        GraphError: as ``repair_graph``.
    """
    tf = _tf()
    repaired = repair_graph(path)
    _, meta_graph_pb2, _ = _protos()
    if not isinstance(repaired, meta_graph_pb2.MetaGraphDef):
        meta = meta_graph_pb2.MetaGraphDef()
        meta.graph_def.CopyFrom(repaired)
        repaired = meta
    return tf.compat.v1.train.import_meta_graph(repaired, **kwargs)


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
    # Compared as bytes: a damaged reference need not be UTF-8.
    names = {n.name.encode("utf-8") for n in gd.node}
    changed = 0
    for node in gd.node:
        if "_class" in node.attr:
            refs = list(node.attr["_class"].list.s)
            keep = [s for s in refs if not s.startswith(b"loc:@") or s[5:] in names]
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
        except (ValueError, TypeError, tf.errors.OpError) as e:  # TypeError: an attr of the wrong kind
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
