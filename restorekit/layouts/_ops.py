"""The array steps a layout applies to one stored tensor, forwards (export) and backwards (import).

A stored tensor's note may carry ``ops``, applied in this fixed order on export:

``take``   ``[axis, index]`` picks one row (the axis goes away: a GRU bias row) or
           ``[axis, start, stop]`` a slice (a TF1 LSTMCell kernel's input or state rows);
``split``  ``[shape before, shape after]`` a reshape that gives gates an axis of their own
           (a Keras 2 CuDNNLSTM kernel [in, 4u] read as [in, 4, u]);
``gates``  ``[axis, order]`` cuts the axis into ``len(order)`` equal gate blocks and puts
           block ``order[k]`` at place ``k`` (Keras GRU z,r,h -> torch r,z,n);
``perm``   an axes permutation;
``view``   ``[shape before, shape after]`` a final reshape (MultiHeadAttention
           [d, heads, dim] kernels become [heads*dim, d] Linear weights).

A note with ``sum`` (a list of constants, one per gate block of axis 0) marks a stored
tensor that PyTorch adds to another one (``bias_hh_l0`` beside ``bias_ih_l0``): the export
writes the constants, the import adds ``stored - constants`` back. A note with ``drop``
holds a tensor PyTorch needs and TF has no variable for (``num_batches_tracked``, a
BatchNorm ``weight`` for a TF BatchNorm without ``gamma``); the import leaves it out.
"""

from __future__ import annotations

import numpy as np

from restorekit.errors import CorruptCheckpointError
from restorekit.layouts._names import invert


def forward(ops: dict, array: np.ndarray) -> np.ndarray:
    """TF array -> stored array."""
    take = ops.get("take")
    if take is not None:
        axis = take[0]
        array = np.take(array, take[1], axis=axis) if len(take) == 2 else _slice(array, axis, take[1], take[2])
    if "split" in ops:
        array = array.reshape(tuple(ops["split"][1]))
    if "gates" in ops:
        array = _gates(array, *ops["gates"])
    if "perm" in ops:
        array = np.transpose(array, ops["perm"])
    if "view" in ops:
        array = np.ascontiguousarray(array).reshape(tuple(ops["view"][1]))
    return np.ascontiguousarray(array)


def stored_shape(ops: dict, shape: tuple) -> tuple:
    """The stored shape of a TF tensor of ``shape`` after ``ops``."""
    shape = tuple(shape)
    take = ops.get("take")
    if take is not None:
        axis = take[0]
        shape = shape[:axis] + shape[axis + 1:] if len(take) == 2 else shape[:axis] + (take[2] - take[1],) + shape[axis + 1:]
    if "split" in ops:
        shape = tuple(int(d) for d in ops["split"][1])
    if "perm" in ops:
        shape = tuple(shape[i] for i in ops["perm"])
    if "view" in ops:
        shape = tuple(int(d) for d in ops["view"][1])
    return shape


def backward(ops: dict, array: np.ndarray, where: str) -> np.ndarray:
    """Stored array -> the TF array (or, with ``take``, the TF piece it was taken from)."""
    try:
        if "view" in ops:
            array = array.reshape(tuple(ops["view"][0]))
        if "perm" in ops:
            array = np.transpose(array, invert(ops["perm"]))
        if "gates" in ops:
            axis, order = ops["gates"]
            array = _gates(array, axis, invert(order))
        if "split" in ops:
            array = array.reshape(tuple(ops["split"][0]))
    except (ValueError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(f"{where}: cannot undo the layout of a tensor of shape {list(array.shape)} ({e})") from None
    return np.ascontiguousarray(array)


def constants(values: list, array: np.ndarray) -> np.ndarray:
    """The array of ``values`` repeated over the equal gate blocks of axis 0 of ``array``'s shape."""
    n = array.shape[0] // len(values) if array.ndim else 1
    out = np.repeat(np.asarray(values, dtype=np.float64), n).astype(array.dtype)
    return out.reshape(array.shape)


def add_residual(main: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """``main + residual`` where ``residual`` is not zero: an unchanged export adds nothing,
    not even the sign of a zero, so a round trip stays bit-exact."""
    if not np.any(residual):
        return main
    return np.where(residual != 0, main + residual, main).astype(main.dtype)


def assemble(pieces: list, where: str) -> np.ndarray:
    """Join ``(take, array)`` pieces of one TF tensor back together (``take`` None: the whole)."""
    if len(pieces) == 1 and pieces[0][0] is None:
        return pieces[0][1]
    if any(take is None for take, _ in pieces):
        raise CorruptCheckpointError(f"{where}: a tensor stored both whole and in pieces")
    pieces = sorted(pieces, key=lambda p: p[0][1])
    axis = pieces[0][0][0]
    if len(pieces[0][0]) == 2:
        return np.stack([a for _, a in pieces], axis=axis)
    return np.concatenate([a for _, a in pieces], axis=axis)


def _slice(array: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * array.ndim
    index[axis] = slice(start, stop)
    return array[tuple(index)]


def _gates(array: np.ndarray, axis: int, order) -> np.ndarray:
    blocks = np.split(array, len(order), axis=axis)
    return np.concatenate([blocks[i] for i in order], axis=axis)
