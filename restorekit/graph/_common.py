"""Shared by the graph verbs: TensorFlow and proto access, node-name and op helpers, the 2 GB limit."""

from __future__ import annotations

import contextlib
import os
from typing import Iterable

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import GraphError, GraphTooLargeError, OutputExistsError

# Protobuf cannot parse or serialize a message of 2 GB or more. Module-level so tests
# can lower it instead of writing 2 GB; every reader looks it up here at call time
# (``common.MAX_PROTO_BYTES``), and setting ``restorekit.graph.MAX_PROTO_BYTES`` sets it here.
MAX_PROTO_BYTES = 2**31 - 1

_VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp"})
_PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})

# Text protobuf when the output name says so; binary otherwise.
_TEXT_SUFFIXES = (".pbtxt", ".txt", ".metatxt")


def _tf():
    return import_tensorflow()


def _protos():
    _tf()  # TensorFlow's first import goes through import_tensorflow, which keeps its native log lines off the CLI
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    return graph_pb2, meta_graph_pb2, saved_model_pb2


def _op_def(op_type: str):
    # No public API exposes the op registry's OpDefs (attrs and their defaults);
    # tf.raw_ops only has the Python wrappers.
    from tensorflow.python.framework import op_def_registry

    return op_def_registry.get(op_type)


def _all_node_lists(graph_def):
    yield graph_def.node
    for function in graph_def.library.function:
        yield function.node_def


def _node_of(input_name: str) -> str:
    return input_name.lstrip("^").split(":")[0]


def _as_dtype(enum):
    """The tf.DType of a dtype enum from a graph; GraphError for a number no TensorFlow dtype has."""
    try:
        return _tf().dtypes.as_dtype(enum)
    except TypeError:
        raise GraphError(f"the graph names dtype {enum}, which is not a TensorFlow dtype: the graph is corrupt.") from None


def _dtype_name(enum) -> str:
    return _as_dtype(enum).base_dtype.name


def _shape_of(proto) -> tuple | None:
    if proto.unknown_rank:
        return None
    return tuple(d.size if d.size >= 0 else None for d in proto.dim)


def _open_checkpoint(checkpoint):
    from restorekit._checkpoint import Checkpoint

    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    return Checkpoint(checkpoint)


def _serialize(message, path: str) -> bytes:
    """A GraphDef or MetaGraphDef as the bytes of ``path``: text for .pbtxt/.txt/.metatxt, else binary."""
    if message.ByteSize() > MAX_PROTO_BYTES:
        raise GraphTooLargeError(
            f"the graph for {path!r} would be {message.ByteSize() / 2**30:.2f} GiB, over protobuf's 2 GB limit. "
            f"Keep the weights in the checkpoint instead of freezing them into the graph."
        )
    if path.endswith(_TEXT_SUFFIXES):
        from google.protobuf import text_format

        return text_format.MessageToString(message).encode("utf-8")
    return message.SerializeToString()


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


def _check_output(out, *, overwrite: bool, source=None, what: str = "source") -> None:
    """Refuse ``out`` when it exists and ``overwrite`` is False, and always when it is the ``source`` file.

    ``what`` names the source in the message ('graph being frozen').
    """
    if out is None:
        return
    out = os.fspath(out)
    if not os.path.lexists(out):
        return
    if isinstance(source, (str, os.PathLike)) and os.path.exists(os.fspath(source)):
        if os.path.samefile(out, os.fspath(source)):
            raise OutputExistsError(f"out {out!r} is the {what}; pick another path.", path=out, is_source=True)
    if not overwrite:
        raise OutputExistsError(path=out)
