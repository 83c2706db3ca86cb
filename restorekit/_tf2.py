"""TF2 and Keras 3 eager restore: a report's matches read with batched RestoreV2 and assigned.

The object graph codec lives in ``restorekit._bundle.objectgraph``, live-object walking
in ``restorekit._trackables`` and naming rules in ``restorekit.rules``; their names stay
importable from here.
"""

from __future__ import annotations

from restorekit import _distribute as distribute, keras_files, _remap as remap, _restore_keras as restore_keras, _restore_torch as restore_torch
from restorekit._optim import _keras as optimizer_keras
from restorekit import _restore_flax as restore_flax
from restorekit._tensorflow import import_tensorflow
from restorekit._array_values import read_arrays
from restorekit._bundle.objectgraph import ObjectGraph, TrackedVariable, decode_object_graph
from restorekit._checkpoint import Checkpoint
from restorekit.errors import IncompleteRestoreError, InvalidArgumentError
from restorekit.formats import detect, open_source
from restorekit._report import live_handles, nothing_matched, policy_of
from restorekit.rules import KERAS_FROM_TF1, Rules, as_rules
from restorekit._trackables import is_trackable, live_paths, object_graph_keys

__all__ = [
    "KERAS_FROM_TF1",
    "ObjectGraph",
    "Rules",
    "TrackedVariable",
    "as_rules",
    "decode_object_graph",
    "is_trackable",
    "live_paths",
    "object_graph_keys",
    "read_tensors",
    "restore",
]


# ------------------------------------------------------------------ eager restore

def read_tensors(prefix: str, names: list[str], dtypes: list[str], *, batch_bytes: int = 1 << 30, sizes=None):
    """Read checkpoint tensors with ``tf.raw_ops.RestoreV2``, many per call (eager).

    Batching keeps the op count low (one call for a BERT-base checkpoint) while
    ``batch_bytes`` bounds the memory held at once.
    """
    tf = import_tensorflow()

    out = []
    start = 0
    while start < len(names):
        stop, total = start, 0
        while stop < len(names) and (stop == start or total + (sizes[stop] if sizes else 0) <= batch_bytes):
            total += sizes[stop] if sizes else 0
            stop += 1
        with tf.device("/cpu:0"):
            out.extend(
                tf.raw_ops.RestoreV2(
                    prefix=prefix,
                    tensor_names=names[start:stop],
                    shape_and_slices=[""] * (stop - start),
                    dtypes=[tf.as_dtype(d) for d in dtypes[start:stop]],
                )
            )
        start = stop
    return out


def _nbytes(record) -> int:
    import numpy as np

    size = int(np.prod(record.checkpoint_shape, dtype=np.int64)) if record.checkpoint_shape else 1
    try:
        return size * np.dtype(record.checkpoint_dtype).itemsize
    except TypeError:
        return size * 4


def _read_matched(tf, source: str, records: list, opened=None) -> dict:
    """checkpoint key -> tensor for every matched record: RestoreV2 for TF bundles, numpy for other formats.

    ``opened``: the source as scan saw it, when it is a view of the file (a PyTorch file read
    under TF names): its entries exist only there, so it is read, not the path again."""
    keys = sorted({r.checkpoint_name for r in records})
    if detect(source) != "tf" or (opened is not None and not isinstance(opened, Checkpoint)):
        # RestoreV2 reads only TF bundles; any other format (a Keras file, safetensors, .pt, .npz) with its reader.
        arrays = read_arrays(opened if opened is not None else open_source(source), keys)
        with tf.device("/cpu:0"):
            return {k: tf.convert_to_tensor(a) for k, a in arrays.items()}
    dtype_of = {r.checkpoint_name: r.checkpoint_dtype for r in records}
    size_of = {r.checkpoint_name: _nbytes(r) for r in records}
    return dict(zip(keys, read_tensors(source, keys, [dtype_of[k] for k in keys], sizes=[size_of[k] for k in keys])))


def _nothing_matched(report) -> InvalidArgumentError:
    if not report.sources and keras_files.is_keras_path(report.checkpoint) and report.missing:
        ckpt = keras_files.open_keras(report.checkpoint)
        names = [r.variable_name for r in report.missing + report.shape_mismatched + report.dtype_mismatched]
        if not set(ckpt.layer_names) & {part for n in names for part in n.split("/")[:-1]}:
            return keras_files.no_shared_layers_error(ckpt, names)
    return nothing_matched(report)


def restore(report, *, strict: bool = False):
    """Assign the matched variables from the checkpoint, in eager mode (TF2, Keras 3).

    Reads every plain match with batched ``RestoreV2`` calls, computes the values of
    records restored through a shape policy or a ``VocabRemap``, checks them all,
    and only then assigns. Distributed (MirroredStrategy) variables are assigned on
    every replica, a ShardedVariable (ParameterServerStrategy) shard by shard.

    Args:
        report: from ``restorekit.scan`` over a Keras model, tf.Module or TF2 variables
            (from one source or several: each file's matches are read together).
        strict: raise IncompleteRestoreError when anything is missing or mismatched.

    Returns:
        The report, for chaining.

    Raises:
        InvalidArgumentError: not executing eagerly, nothing matched, the report lost
            its variables, or a policy returned a value of the wrong shape.
        IncompleteRestoreError: ``strict`` and the report is incomplete.

    Example:
        >>> report = restorekit.scan('ckpt/', model, shape_policy='slice_or_pad')
        >>> restorekit.restore(report)

    Keras 3 models on the JAX or PyTorch backend, ``torch.nn.Module``s and Flax NNX modules restore
    the same way without TensorFlow (``restorekit._restore_keras``, ``_restore_torch``, ``_restore_flax``).
    """
    handles = live_handles(report)
    if restore_torch.is_torch_report(handles):
        return restore_torch.restore(report, strict=strict)
    if restore_flax.is_flax_report(handles):
        return restore_flax.restore(report, strict=strict)
    if restore_keras.is_off_tensorflow(handles):
        return restore_keras.restore(report, strict=strict)
    tf = import_tensorflow()

    if not tf.executing_eagerly():
        raise InvalidArgumentError(
            "restorekit.restore assigns eagerly; in graph mode use restorekit.warm_start(report) "
            "or restorekit.partial_saver(report)"
        )
    if strict and not report.is_complete:
        raise IncompleteRestoreError(report.incomplete_message(), report)
    if not report.matched:
        raise _nothing_matched(report)
    tensors: dict[tuple[str, str], object] = {}  # (source, checkpoint key) -> tensor: each source's matches read in one go
    opened = report._source if not report.sources else None  # one source: the very view scan read
    for source, records in report.by_source().items():
        tensors.update(((source, k), v) for k, v in _read_matched(tf, source, records, opened).items())
    values = []
    for r in report.matched:
        handle = handles[r.variable_name]
        value = tensors[report.source_of(r), r.checkpoint_name]
        policy = policy_of(report, r.variable_name)
        if policy is not None:
            value = remap.eager_value(policy, r, value, handle)
        values.append((handle, value))
    optimizer_state = optimizer_keras.read(report._optimizer)  # scan(..., optimizer=): read before any assign
    for handle, value in values:
        # mirrored replicas each get the value, ShardedVariable shards their slice
        distribute.assign(handle, value)
    optimizer_keras.load(report._optimizer, optimizer_state)
    return report

