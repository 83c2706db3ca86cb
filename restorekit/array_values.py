"""Values of a restore computed in numpy: read, passed through their policy, checked, for any framework.

The Keras 3 (JAX, PyTorch backends) and ``torch.nn.Module`` restore paths assign
numpy arrays; this module computes them, with the same policies ``scan`` chose
(``slice_or_pad``, casts, shape adapters, vocabulary remaps, callables) that
``restorekit.remap`` computes as TF ops on the TensorFlow paths.
"""

from __future__ import annotations

import numpy as np

from restorekit.bundle.format import dtype_enum, numpy_dtype
from restorekit.checkpoint import Checkpoint
from restorekit.errors import InvalidArgumentError
from restorekit.policies import CAST, SLICE_OR_PAD, ShapeAdapter, VocabRemap, policy_name
from restorekit.report import format_shape, policy_of

__all__ = ["matched_values", "policy_value", "report_source"]


def _dtype(name: str) -> np.dtype:
    return numpy_dtype(dtype_enum(name))


def _vocab(remap: VocabRemap, value: np.ndarray, shape, dtype) -> np.ndarray:
    index = remap.index()
    found = index >= 0
    gathered = np.take(value, np.maximum(index, 0), axis=remap.axis) if len(index) else value[:0]
    dims = [1] * len(shape)
    dims[remap.axis] = len(index)
    if remap.backup_initializer is None:
        backup = np.zeros(shape, dtype)
    else:
        backup = np.asarray(remap.backup_initializer(list(shape), dtype=dtype)).astype(dtype)
    return np.where(found.reshape(dims), gathered, backup)


def _slice_or_pad(value: np.ndarray, current: np.ndarray) -> np.ndarray:
    """``current`` with the block the checkpoint covers replaced by the checkpoint's values."""
    out = np.array(current, copy=True)
    block = tuple(slice(0, min(c, v)) for c, v in zip(value.shape, out.shape))
    out[block] = value[block]
    return out


def policy_value(policy, record, value: np.ndarray, handle, current) -> np.ndarray:
    """The numpy value restored into ``record``'s variable under ``policy`` (None: a plain copy).

    ``current`` is a function handle -> numpy array, called only for ``slice_or_pad``
    (which keeps the variable's own value outside the checkpoint's block).
    """
    shape, dtype = tuple(record.shape), _dtype(record.dtype)
    if policy is None or policy == CAST:
        return np.asarray(value).astype(dtype, copy=False)
    if isinstance(policy, VocabRemap):
        return _vocab(policy, value, shape, dtype)
    if isinstance(policy, ShapeAdapter):
        return np.asarray(policy.adapt(value, shape)).astype(dtype, copy=False)
    if policy == SLICE_OR_PAD:
        return _slice_or_pad(value, current(handle)).astype(dtype, copy=False)
    return np.asarray(policy(value, handle)).astype(dtype, copy=False)


def _read(source, keys: list) -> dict:
    """checkpoint key -> numpy array, each read once (a Keras file opened once for all)."""
    if hasattr(source, "read_many"):
        return dict(zip(keys, source.read_many(keys)))
    return {k: source.read(k) for k in keys}


def report_source(report):
    """The source ``report`` was scanned from, as scan saw it (a layout or rule set view), reopened if it was not kept."""
    return report._source if report._source is not None else Checkpoint(report.checkpoint)


def matched_values(report, handles: dict, current, records=None) -> list:
    """(handle, numpy value) for every matched record of ``report``, all computed and checked before any is assigned.

    Args:
        report: a RestoreReport made by ``scan`` in this process.
        handles: its live handles (``report.live_handles``).
        current: handle -> the variable's value as numpy (for ``slice_or_pad``).
        records: only these of its matched records (default: all).

    Raises:
        InvalidArgumentError: a policy returned a value of another shape than its variable.
    """
    source = report_source(report)
    records = list(report.matched if records is None else records)
    arrays = _read(source, sorted({r.checkpoint_name for r in records}))
    values = []
    for r in records:
        handle = handles[r.variable_name]
        policy = policy_of(report, r.variable_name)
        value = policy_value(policy, r, arrays[r.checkpoint_name], handle, current)
        if tuple(value.shape) != tuple(r.shape):
            what = f"shape policy {policy_name(policy)!r} returned" if policy is not None else "the checkpoint holds"
            raise InvalidArgumentError(
                f"{what} a {format_shape(value.shape)} value for {r.variable_name!r}, which is {format_shape(r.shape)}"
            )
        values.append((handle, value))
    return values
