"""Value edits as new plan items: set (whole or indexed), copy_rows, add, concat, cast; values checked at the call."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from restorekit._bundle.format import dtype_enum, dtype_name, numpy_dtype
from restorekit.edit._plan import BOOL, COMPLEX, FLOATS, STRING, Concat, Item
from restorekit.edit._source import cast_array
from restorekit.errors import CorruptCheckpointError, EditError, format_names
from restorekit._report import format_shape


def set_whole(name: str, item: Item, value, *, allow_dtype_change: bool, allow_shape_change: bool) -> Item:
    """``item`` replaced by ``value`` (copied)."""
    array = coerce(name, value, item.dtype, allow_dtype_change=allow_dtype_change)
    if array.shape != tuple(item.shape) and not allow_shape_change:
        raise EditError(
            f"{name!r} has shape {format_shape(item.shape)}; got {format_shape(array.shape)}. "
            "Pass allow_shape_change=True to store the new shape."
        )
    return Item(item.origin, dtype_enum(array.dtype), array.shape, base=array)


def set_indexed(name: str, item: Item, value, index) -> Item:
    """``item`` with ``tensor[index] = value`` queued."""
    region = region_shape(name, item.shape, index)
    array = coerce(name, value, item.dtype, allow_dtype_change=False)
    try:
        if np.broadcast_shapes(array.shape, region) != region:
            raise ValueError
    except ValueError:
        raise EditError(
            f"{name!r}[{index!r}] has shape {format_shape(region)}; got a value of shape {format_shape(array.shape)}"
        ) from None
    if isinstance(index, list):
        index = np.asarray(index)

    def assign(a, index=index, array=array):
        a[index] = array
        return a

    return with_op(item, assign)


def copy_rows(name: str, item: Item, src_rows, dst_rows) -> Item:
    """``item`` with ``t[dst_rows] = t[src_rows]`` queued."""
    if not item.shape:
        raise EditError(f"{name!r} is a scalar; it has no rows")
    src = np.asarray(src_rows).reshape(-1)
    dst = np.asarray(dst_rows).reshape(-1)
    if src.size != dst.size:
        raise EditError(f"copy_rows({name!r}): {src.size} source rows but {dst.size} destination rows")
    n = item.shape[0]
    for rows in (src, dst):
        if rows.dtype.kind not in "iu" or (rows.size and (rows.min() < -n or rows.max() >= n)):
            raise EditError(f"copy_rows({name!r}): rows {rows.tolist()} must be integers from {-n} to {n - 1} "
                            f"(negative counts from the end, as in numpy) for {n} rows")

    def copy(a, src=src, dst=dst):
        a[dst] = a[src]
        return a

    return with_op(item, copy)


def new_item(name: str, value) -> Item:
    """An added tensor holding a copy of ``value``."""
    array = np.asarray(value)
    if array.dtype.kind in "SUO":
        array = string_array(name, value)
    else:
        try:
            dtype_enum(array.dtype)
        except ValueError:
            raise EditError(f"{name!r}: dtype {array.dtype} has no TensorFlow checkpoint equivalent") from None
        array = np.array(array, copy=True)
    return Item(None, dtype_enum(array.dtype), array.shape, base=array)


def concat_item(names: list[str], items: list[Item], axis: int) -> Item:
    """The item of ``items`` concatenated along ``axis`` (checked now, built on save)."""
    dtypes = {it.dtype for it in items}
    if len(dtypes) > 1:
        raise EditError(f"concat of {format_names(names)}: mixed dtypes {sorted(dtype_name(d) for d in dtypes)}")
    ranks = {len(it.shape) for it in items}
    rank = ranks.pop()
    if ranks or rank == 0:
        raise EditError(f"concat of {format_names(names)}: ranks differ or are 0")
    if not -rank <= axis < rank:
        raise EditError(f"concat axis {axis} is out of range for rank {rank}")
    axis %= rank
    others = {tuple(d for i, d in enumerate(it.shape) if i != axis) for it in items}
    if len(others) > 1:
        shapes = ", ".join(format_shape(it.shape) for it in items)
        raise EditError(f"concat of {format_names(names)} along axis {axis}: shapes {shapes} do not fit")
    shape = list(items[0].shape)
    shape[axis] = sum(it.shape[axis] for it in items)
    return Item(None, items[0].dtype, tuple(shape), base=Concat(tuple(items), axis))


def cast_code(dtype) -> int:
    """The dtype code a cast goes to, or EditError."""
    try:
        code = dtype_enum(dtype)
        numpy_dtype(code)
    except (ValueError, CorruptCheckpointError):
        raise EditError(f"cannot cast to {dtype!r}: not a checkpoint dtype") from None
    if code == STRING:
        raise EditError("cannot cast to strings")
    return code


def check_cast(name: str, source: int, code: int, *, exact: bool) -> None:
    """Refuse casts that lose a value's kind (complex to real, float to integer)."""
    if exact and source in (STRING, BOOL):
        raise EditError(f"cannot cast {name!r} ({dtype_name(source)}) to {dtype_name(code)}")
    if (source in COMPLEX and code not in COMPLEX) or (source in FLOATS and code not in FLOATS | COMPLEX):
        raise EditError(
            f"casting {name!r} from {dtype_name(source)} to {dtype_name(code)} would truncate its values; "
            f"if that is meant, set() it to value.astype({dtype_name(code)!r}) with allow_dtype_change=True"
        )


def cast_item(name: str, item: Item, code: int, *, streamable: bool) -> Item:
    """``item`` cast to ``code``: streamed from the stored bytes when ``streamable``, else an op."""
    if streamable:
        return replace(item, cast=code, dtype=code)
    target = numpy_dtype(code)
    return replace(with_op(item, lambda a, t=target, n=name: cast_array(a, t, n)), dtype=code)


def with_op(item: Item, op: Callable) -> Item:
    if isinstance(item.base, np.ndarray):
        return replace(item, base=op(item.base.copy()))
    return replace(item, ops=item.ops + (op,))


def coerce(name: str, value, dtype: int, *, allow_dtype_change: bool) -> np.ndarray:
    """``value`` as an array of ``dtype`` (or its own dtype when allowed to change). Copies."""
    if dtype == STRING and not allow_dtype_change:
        return string_array(name, value)
    given = np.asarray(value)
    if given.dtype.kind in "SUO":
        if dtype != STRING and not allow_dtype_change:
            raise EditError(f"{name!r} is {dtype_name(dtype)}; got strings. Pass allow_dtype_change=True to store strings.")
        return string_array(name, value)
    try:
        given_code = dtype_enum(given.dtype)
    except ValueError:
        raise EditError(f"{name!r}: dtype {given.dtype} has no TensorFlow checkpoint equivalent") from None
    if allow_dtype_change or given_code == dtype:
        return np.array(given, copy=True)
    target = numpy_dtype(dtype)
    if isinstance(value, (np.ndarray, np.generic)):
        raise EditError(
            f"{name!r} is {dtype_name(dtype)}; got a {dtype_name(given_code)} array. Pass "
            f"value.astype({dtype_name(dtype)!r}), or allow_dtype_change=True to store {dtype_name(given_code)}."
        )
    # Python numbers and lists take the entry's dtype unless that loses their kind.
    lossy = (target.kind in "iub" and given.dtype.kind in "fc") or (target.kind != "c" and given.dtype.kind == "c")
    if lossy or (target.kind == "b" and given.dtype.kind != "b"):
        raise EditError(f"{name!r} is {dtype_name(dtype)}; {value!r} does not convert without loss")
    return given.astype(target)


def region_shape(name: str, shape: tuple, index) -> tuple:
    """Shape of ``tensor[index]``, checked without allocating the tensor."""
    if isinstance(index, list):
        index = np.asarray(index)
    dummy = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), shape=shape, strides=(0,) * len(shape))
    try:
        return dummy[index].shape
    except (IndexError, TypeError, ValueError) as e:
        raise EditError(f"index {index!r} does not fit {name!r} of shape {format_shape(shape)}: {e}") from None


def string_array(name: str, value) -> np.ndarray:
    """``value`` as an object array of bytes/str (a string tensor), or EditError."""
    array = np.array(value, dtype=object)
    odd = next((v for v in array.reshape(-1) if not isinstance(v, (bytes, str))), None)
    if odd is not None:
        raise EditError(f"{name!r}: a string tensor holds bytes or str values, not {type(odd).__name__}")
    return array
