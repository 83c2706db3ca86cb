"""Tests for restorekit/graph/_constants.py: Const sizes from dtype and shape, and their bytes in chunks."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2, types_pb2

from restorekit.errors import GraphError
from restorekit.graph._constants import const_chunks, const_layout


def _node(tensor, name="c"):
    node = node_def_pb2.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = tensor.dtype
    node.attr["value"].tensor.CopyFrom(tensor)
    return node


def _splat(listed, dtype, shape):
    return tf.make_tensor_proto(listed, dtype=dtype, shape=shape, verify_shape=False)


CASES = {
    "float32-content": tf.make_tensor_proto(np.arange(100, dtype=np.float32).reshape(10, 10)),
    "float32-splat": _splat([0.5], tf.float32, [37, 11]),
    "int64-padded": _splat([1, 2, 3], tf.int64, [1000]),
    "float16-splat": _splat([1.5], tf.float16, [99]),
    "bfloat16-padded": _splat([1.0, -2.0], tf.bfloat16, [3, 33]),
    "bool-splat": _splat([True], tf.bool, [70]),
    "complex64-padded": _splat([1 + 2j, 3 - 4j], tf.complex64, [50]),
    "int32-none-listed": _splat([], tf.int32, [40]),
    "scalar": tf.make_tensor_proto(np.float64(2.5)),
}


@pytest.mark.parametrize("tensor", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("chunk_size", [7, 1 << 20], ids=["small-chunks", "one-chunk"])
def test_chunks_are_the_bytes_tensorflow_reads(tensor, chunk_size):
    node = _node(tensor)
    expected = tf.make_ndarray(tensor)

    layout = const_layout(node)
    chunks = [bytes(c) for c in const_chunks(node, layout, chunk_size)]

    assert (layout.shape, layout.count, layout.nbytes) == (expected.shape, expected.size, expected.nbytes)
    assert b"".join(chunks) == expected.tobytes()
    assert max(len(c) for c in chunks) <= max(chunk_size, expected.itemsize)


def test_layout_of_a_splat_claiming_gigabytes_reads_no_values():
    layout = const_layout(_node(_splat([1.0], tf.float32, [2**31, 4]), name="big"))

    assert (layout.name, layout.count, layout.nbytes) == ("big", 2**33, 2**35)


def _bad_content():
    tensor = tf.make_tensor_proto(np.zeros(4, np.float32))
    tensor.tensor_content = tensor.tensor_content[:-1]
    return tensor


def _negative_dim():
    tensor = _splat([1.0], tf.float32, [2])
    tensor.tensor_shape.dim[0].size = -1
    return tensor


def _too_many_values():
    tensor = _splat([1.0], tf.float32, [2])
    tensor.float_val[:] = [1.0, 2.0, 3.0]
    return tensor


def _variant():
    tensor = _splat([], tf.float32, [1])
    tensor.dtype = types_pb2.DT_VARIANT
    return tensor


@pytest.mark.parametrize(
    "make, match",
    [
        (_bad_content, "stores 15 bytes.*needs 16"),
        (_negative_dim, "negative dimension"),
        (_too_many_values, "lists 3 values"),
        (_variant, "variant"),
    ],
    ids=["content-of-the-wrong-size", "negative-dimension", "more-values-than-elements", "variant-dtype"],
)
def test_corrupt_constants_are_graph_errors_naming_the_constant(make, match):
    with pytest.raises(GraphError, match=match) as info:
        const_layout(_node(make(), name="bad/const"))
    assert "'bad/const'" in str(info.value)
