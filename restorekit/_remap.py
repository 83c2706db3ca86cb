"""Values of a policy restore as TF ops: slice-or-pad, casts, shape adapters and vocabulary remaps, eager or TF1 initializers.

``scan`` decides which records need a policy (``restorekit._policies``); this module
computes their values, in eager mode for ``restorekit.restore`` and as graph
initializers for ``warm_start`` and the Scaffold.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from restorekit._tensorflow import import_tensorflow
from restorekit._checkpoint import Checkpoint
from restorekit.errors import InvalidArgumentError
from restorekit.formats import detect, open_source
from restorekit._policies import (  # noqa: F401  (the names remap.* offered before policies.py)
    CAST,
    SKIP,
    SLICE_OR_PAD,
    ShapeAdapter,
    ShapePolicies,
    VocabRemap,
    check_dtype_policy,
    check_vocab,
    dtype_cast_applies,
    has_policy,
    policy_applies,
    policy_name,
    policy_reason,
    resolve_shape_policy,
)
from restorekit._report import format_shape, live_handles, policy_of
from restorekit._targets import slice_info

__all__ = ["eager_value", "tf1_copy_initializer", "tf1_initializer"]


def _overlap_mask(tf, checkpoint_shape, shape):
    """Bool tensor of ``shape``: True inside the block the checkpoint covers."""
    mask = None
    for d, (c, v) in enumerate(zip(checkpoint_shape, shape)):
        inside = tf.range(v) < c
        dims = [1] * len(shape)
        dims[d] = v
        inside = tf.reshape(inside, dims)
        mask = inside if mask is None else tf.logical_and(mask, inside)
    if mask is None:  # scalar
        return tf.constant(True)
    return tf.broadcast_to(mask, shape)


def _slice_or_pad(tf, value, checkpoint_shape, shape):
    overlap = [min(c, v) for c, v in zip(checkpoint_shape, shape)]
    block = tf.slice(value, [0] * len(shape), overlap)
    padded = tf.pad(block, [[0, v - o] for v, o in zip(shape, overlap)])
    return padded, _overlap_mask(tf, checkpoint_shape, shape)


def _backup(tf, remap: VocabRemap, shape, dtype):
    if remap.backup_initializer is None:
        return tf.zeros(shape, dtype)
    value = tf.convert_to_tensor(remap.backup_initializer(list(shape), dtype=dtype))
    return tf.cast(value, dtype)


def _vocab(tf, remap: VocabRemap, value, shape, dtype):
    index = remap.index()
    found = index >= 0
    gathered = tf.gather(value, np.maximum(index, 0) if len(index) else index, axis=remap.axis)
    dims = [1] * len(shape)
    dims[remap.axis] = len(index)
    found = tf.reshape(tf.constant(found), dims)
    return tf.where(found, gathered, _backup(tf, remap, shape, dtype))


def _check_shape(value_shape, shape, policy, variable_name) -> None:
    if tuple(value_shape) != tuple(shape):
        raise InvalidArgumentError(
            f"shape policy {policy_name(policy)!r} returned a {format_shape(value_shape)} value for {variable_name!r}, "
            f"which is {format_shape(shape)}"
        )


def eager_value(policy, record, checkpoint_value, handle):
    """The value ``restorekit.restore`` assigns to ``record``'s variable under ``policy`` (eager).

    ``slice_or_pad`` keeps the variable's current value (for a new model: its
    initializer's) outside the block the checkpoint covers.

    Raises:
        InvalidArgumentError: a callable policy returned a value of the wrong shape.
    """
    tf = import_tensorflow()

    shape = tuple(record.shape)
    dtype = tf.as_dtype(record.dtype)
    if isinstance(policy, VocabRemap):
        return _vocab(tf, policy, checkpoint_value, shape, dtype)
    components = getattr(handle, "values", None)
    primary = components[0] if isinstance(components, tuple) and components else handle
    if policy == CAST:
        return tf.cast(checkpoint_value, dtype)
    if isinstance(policy, ShapeAdapter):
        return tf.constant(policy.adapt(checkpoint_value.numpy(), shape), dtype=dtype)
    if policy == SLICE_OR_PAD:
        value, mask = _slice_or_pad(tf, checkpoint_value, record.checkpoint_shape, shape)
        # convert_to_tensor, not read_value(): a ShardedVariable reads whole only this way
        return tf.where(mask, value, tf.convert_to_tensor(primary))
    value = policy(checkpoint_value.numpy(), handle)
    value = tf.cast(tf.convert_to_tensor(value), dtype)
    _check_shape(value.shape, shape, policy, record.variable_name)
    return value


def _part_slices(part, full_shape):
    # A partition's place in the full variable lives only in its save-slice info.
    info = slice_info(part)
    if info is None:
        return [0] * len(full_shape), list(full_shape)
    return list(info.var_offset), list(info.var_shape)


def _is_resource(tf, variable) -> bool:
    try:
        return variable.handle.dtype == tf.resource
    except (AttributeError, ValueError):  # a RefVariable has no resource handle
        return False


def _set_initial_value(tf, variable, value) -> None:
    value = tf.cast(value, variable.dtype.base_dtype)
    with tf.device(variable.device):
        if _is_resource(tf, variable):
            op = tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value)
        else:
            op = tf.compat.v1.assign(variable, value).op
    # No public API replaces a variable's initializer; init_from_checkpoint sets
    # these same two attributes.
    variable._initializer_op = op
    variable._initial_value = value


def tf1_initializer(report, record) -> None:
    """Make ``record``'s variable initialize from the checkpoint through its policy (TF1 graph mode).

    The TF1 half of shape policies and ``VocabRemap``: after this, the variable's
    initializer (``global_variables_initializer``, a Scaffold's init op) computes
    the remapped value. ``slice_or_pad`` and vocabularies are computed by ops from a
    ``RestoreV2`` read; a callable policy runs now on the numpy value and its result
    is embedded as a constant. Partitioned variables get their slice of the value.

    Raises:
        InvalidArgumentError: ``record`` has no policy in ``report``, or a callable
            policy returned a value of the wrong shape.
    """
    tf = import_tensorflow()

    if not has_policy(report, record):
        raise InvalidArgumentError(f"{record.variable_name!r} has no shape policy or vocabulary in this report")
    _check_graph_mode(tf)
    policy = policy_of(report, record.variable_name)
    handle = live_handles(report)[record.variable_name]
    shape = tuple(record.shape)
    dtype = tf.as_dtype(record.dtype)
    with tf.compat.v1.name_scope("restorekit_remap"):
        mask = None
        if isinstance(policy, ShapeAdapter):
            # computed in numpy, like a callable policy's value, and embedded as a constant
            raw = policy.adapt(Checkpoint(report.source_of(record)).read(record.checkpoint_name), shape)
            value = tf.constant(raw.astype(dtype.as_numpy_dtype))
        elif callable(policy) and not isinstance(policy, VocabRemap):
            raw = policy(Checkpoint(report.source_of(record)).read(record.checkpoint_name), handle)
            raw = np.asarray(raw)
            _check_shape(raw.shape, shape, policy, record.variable_name)
            value = tf.constant(raw.astype(dtype.as_numpy_dtype))
        else:
            stored = _read_op(tf, report.source_of(record), record)
            if isinstance(policy, VocabRemap):
                value = _vocab(tf, policy, stored, shape, dtype)
            elif policy == CAST:
                value = tf.cast(stored, dtype)
            else:
                value, mask = _slice_or_pad(tf, stored, record.checkpoint_shape, shape)
        _initialize_parts(tf, handle, shape, value, mask)


def tf1_copy_initializer(report, record) -> None:
    """Make a plainly matched variable initialize from its checkpoint entry, read by ``RestoreV2``.

    ``init_from_checkpoint`` does the same but takes a path that is also a directory
    (``saver.save(sess, some_dir)``) for a directory and looks for a ``checkpoint``
    file there; ``RestoreV2`` takes the prefix as it is.
    """
    tf = import_tensorflow()

    _check_graph_mode(tf)
    handle = live_handles(report)[record.variable_name]
    with tf.compat.v1.name_scope("restorekit_restore"):
        _initialize_parts(tf, handle, tuple(record.shape), _read_op(tf, report.source_of(record), record), None)


def _check_graph_mode(tf) -> None:
    if tf.executing_eagerly():
        raise InvalidArgumentError("TF1 initializers are graph ops; in eager mode use restorekit.restore")


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=4)
def _opened(path: str, stamp: tuple):
    """One open Source per file while a graph's initializers are built (each record would reopen it otherwise);
    ``stamp`` (mtime, size) keeps a rewritten file from being read through a stale view."""
    return open_source(path)


def _read_op(tf, prefix: str, record):
    """The op that reads ``record``'s checkpoint tensor: ``RestoreV2`` from a TF bundle; from any other format
    (Keras, safetensors, .pt, .npz) its reader, called when the op runs (the graph holds no copy of the value)."""
    if detect(prefix) != "tf":
        source = _opened(prefix, _stamp(prefix))
        name = record.checkpoint_name

        def read():
            return np.asarray(source.read(name))

        with tf.device("/cpu:0"):
            stored = tf.numpy_function(read, [], tf.as_dtype(record.checkpoint_dtype), stateful=False,
                                       name="restorekit_read")
        stored.set_shape(record.checkpoint_shape)
        return stored
    with tf.device("/cpu:0"):
        stored = tf.raw_ops.RestoreV2(
            prefix=prefix,
            tensor_names=[record.checkpoint_name],
            shape_and_slices=[""],
            dtypes=[tf.as_dtype(record.checkpoint_dtype)],
        )[0]
    stored.set_shape(record.checkpoint_shape)
    return stored


def _initialize_parts(tf, handle, shape, value, mask) -> None:
    """Set each partition's initial value to its slice of ``value`` (``mask``: where the checkpoint counts)."""
    parts = list(handle) if isinstance(handle, (list, tuple)) else [handle]
    for part in parts:
        begin, size = _part_slices(part, shape)
        piece = tf.slice(value, begin, size) if len(parts) > 1 else value
        if mask is not None:
            piece_mask = tf.slice(mask, begin, size) if len(parts) > 1 else mask
            piece = tf.where(piece_mask, piece, part.initial_value)
        _set_initial_value(tf, part, piece)
