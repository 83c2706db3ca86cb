"""Read a graph from anywhere (.pb, .pbtxt, .meta, SavedModel, protos, tf.Graph) into protos we may change."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from restorekit._bundle.varint import read_varint
from restorekit.errors import (
    CorruptCheckpointError,
    GraphError,
    GraphTooLargeError,
    InvalidArgumentError,
    closest_names,
    format_names,
)
from restorekit.graph import _common as common
from restorekit.graph._common import _protos, _tf

if TYPE_CHECKING:  # TensorFlow's protos, imported when a graph is loaded (untyped: mypy sees Any)
    from tensorflow.core.framework.graph_pb2 import GraphDef
    from tensorflow.core.protobuf.meta_graph_pb2 import MetaGraphDef

_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_>.]*$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-/>]*$")



@dataclass
class _Loaded:
    """A graph read from anywhere, before and after repairs (internal, mutable)."""

    source: str
    kind: str  # 'GraphDef', 'MetaGraph', 'SavedModel'
    graph_def: GraphDef
    meta_graph: MetaGraphDef | None = None
    repaired: list = dataclasses.field(default_factory=list)
    unknown_ops: tuple = ()


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
    if size > common.MAX_PROTO_BYTES:
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
    if loaded.graph_def.ByteSize() > common.MAX_PROTO_BYTES:
        _check_size(loaded.source, loaded.graph_def.ByteSize())
    _refuse_recursive_functions(loaded)
    return loaded


def _callees(node, functions: set):
    """Names of the library functions ``node`` calls: as its op, or through a function-valued attr."""
    if node.op in functions:
        yield node.op
    for value in node.attr.values():
        kind = value.WhichOneof("value")
        if kind == "func":
            yield value.func.name
        elif kind == "list":
            yield from (f.name for f in value.list.func)


def _refuse_recursive_functions(loaded: _Loaded) -> None:
    """GraphError when a library function calls itself, directly or through others.

    TensorFlow has no recursive functions, and its importer recurses through such a
    cycle until the process dies (a segfault no caller can catch), so it never sees one.
    """
    library = loaded.graph_def.library.function
    functions = {f.signature.name for f in library}
    calls = {f.signature.name: [c for n in f.node_def for c in _callees(n, functions) if c in functions] for f in library}
    done: set = set()
    for root in calls:
        path, stack = [root], [iter(calls[root])]
        while stack:
            callee = next(stack[-1], None)
            if callee is None:
                done.add(path.pop())
                stack.pop()
            elif callee in path:
                cycle = " -> ".join(path[path.index(callee):] + [callee])
                raise GraphError(f"{loaded.source!r} has functions that call themselves ({cycle}), "
                                 f"which TensorFlow cannot load: the graph is corrupt.")
            elif callee not in done:
                path.append(callee)
                stack.append(iter(calls[callee]))

