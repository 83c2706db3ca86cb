"""Const tensors of a GraphDef: their size from dtype and shape alone, and their bytes as a stream of chunks.

A TensorProto may list fewer values than its shape holds (a "splat": one value stands
for all), so a 100-byte .pb can claim gigabytes. Sizes are computed before any value is
materialized, and values are streamed chunk by chunk so memory stays about one chunk
for a splat and one tensor otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from restorekit._bundle.format import dtype_name, numpy_dtype
from restorekit._bundle.writer import CHUNK_SIZE, array_chunks
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, GraphError
from restorekit.graph._common import _tf

# TensorProto fields listing values; complex ones hold (real, imaginary) pairs.
_PAIR_FIELDS = frozenset({"scomplex_val", "dcomplex_val"})


@dataclass(frozen=True)
class ConstLayout:
    """What a Const holds, known without reading its values: dtype code, shape, element count, bytes."""

    name: str
    dtype: int
    shape: tuple
    count: int
    nbytes: int


def const_layout(node) -> ConstLayout:
    """The layout of the Const ``node``'s value, checked against what the proto actually holds.

    Raises:
        GraphError: a negative dimension, a dtype a checkpoint cannot hold, or a value
            whose stored bytes or listed values do not fit its dtype and shape.
    """
    tensor = node.attr["value"].tensor
    shape = tuple(d.size for d in tensor.tensor_shape.dim)
    if any(d < 0 for d in shape):
        raise GraphError(f"constant {node.name!r} has a negative dimension in its shape {list(shape)}.")
    try:
        itemsize = numpy_dtype(tensor.dtype).itemsize
    except (CorruptCheckpointError, InvalidArgumentError):  # unknown, or no numpy form (variant, resource)
        raise GraphError(
            f"constant {node.name!r} has dtype {dtype_name(tensor.dtype)!r}, which a checkpoint cannot hold."
        ) from None
    count = math.prod(shape)
    layout = ConstLayout(node.name, int(tensor.dtype), shape, count, count * itemsize)
    content = len(tensor.tensor_content)
    if content and content != layout.nbytes:
        raise GraphError(
            f"constant {node.name!r} stores {content} bytes, but {dtype_name(layout.dtype)} of shape "
            f"{list(shape)} needs {layout.nbytes}: the graph is corrupt."
        )
    if not content and _listed_count(tensor) > count:
        raise GraphError(
            f"constant {node.name!r} lists {_listed_count(tensor)} values for a shape of {count} elements: "
            f"the graph is corrupt."
        )
    return layout


def _listed_count(tensor) -> int:
    """How many values the proto's typed value field lists (0 for none)."""
    for field, values in tensor.ListFields():
        if field.name.endswith("_val"):
            return len(values) // 2 if field.name in _PAIR_FIELDS else len(values)
    return 0


def const_chunks(node, layout: ConstLayout, chunk_size: int = CHUNK_SIZE):
    """The little-endian bytes of the Const ``node``'s value, in chunks of at most about ``chunk_size``.

    Byte for byte what ``tf.make_ndarray`` gives: stored bytes as they are; listed values
    followed by the last one repeated (zeros when none is listed) up to the shape.
    """
    tensor = node.attr["value"].tensor
    content = tensor.tensor_content
    if content:
        view = memoryview(content)
        for start in range(0, len(content), chunk_size):
            yield view[start : start + chunk_size]
        return
    listed = _listed_count(tensor)
    if listed == layout.count:
        # Flat: the bytes are the same, and TF's ranks go past numpy's 64 dimensions.
        yield from array_chunks(_listed_values(tensor, listed), chunk_size)
        return
    if listed:
        head = _listed_values(tensor, listed)
        yield from array_chunks(head, chunk_size)
        last = head.reshape(-1)[-1:]
    else:
        last = np.zeros(1, numpy_dtype(layout.dtype))
    remaining = layout.count - listed
    per_chunk = max(1, chunk_size // max(1, last.itemsize))
    block = np.repeat(last, min(per_chunk, remaining))
    while remaining > 0:
        n = min(len(block), remaining)
        yield from array_chunks(block[:n], chunk_size)
        remaining -= n


def _listed_values(tensor, listed: int) -> np.ndarray:
    """Only the values the proto lists (no padding), converted exactly as ``tf.make_ndarray`` converts them."""
    tf = _tf()
    head = type(tensor)()
    head.CopyFrom(tensor)
    del head.tensor_shape.dim[:]
    head.tensor_shape.dim.add().size = listed
    return tf.make_ndarray(head)
