"""Values of a restore computed in numpy: read, passed through their policy, checked, for any framework.

The Keras 3 (JAX, PyTorch backends) and ``torch.nn.Module`` restore paths assign
numpy arrays; this module computes them, with the same policies ``scan`` chose
(``slice_or_pad``, casts, shape adapters, vocabulary remaps, callables) that
``restorekit._remap`` computes as TF ops on the TensorFlow paths.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from restorekit._bundle.format import dtype_enum, numpy_dtype
from restorekit._checkpoint import Checkpoint
from restorekit.errors import CheckpointChangedError, CorruptCheckpointError, InvalidArgumentError
from restorekit._policies import CAST, SLICE_OR_PAD, ShapeAdapter, VocabRemap, policy_name
from restorekit._report import format_shape, plain_records, policy_of
from restorekit._torch_target import stored_tensor

__all__ = ["Stored", "checked_plan", "matched_values", "policy_value", "read_arrays", "report_source", "reading_checked"]


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


def read_arrays(source, keys: list) -> dict:
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
    arrays = read_arrays(source, sorted({r.checkpoint_name for r in records}))
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


@dataclass(frozen=True)
class Stored:
    """A matched value a restore reads as a TF checkpoint stores it (``transposed``: its 2-D transpose)."""

    checkpoint: Checkpoint  # the TF checkpoint whose shard bytes are read
    key: str
    transposed: bool
    handle: object
    variable_name: str
    shape: tuple  # the variable's
    dtype: np.dtype  # the stored one, the variable's too

    @property
    def entry(self):
        return self.checkpoint.entries[self.key]


def _stored(report, handles: dict, source, accepts) -> list:
    out = []
    for r in plain_records(report):
        found = stored_tensor(source, r.checkpoint_name)
        if found is None:
            continue
        checkpoint, key, transposed = found
        entry = checkpoint.entries[key]
        if entry.dtype == "string" or entry.dtype != r.dtype:
            continue
        stored_shape = tuple(reversed(entry.shape)) if transposed else entry.shape
        # As stored: the same shape, or one the rule set only reshaped to (squeeze0, unsqueeze0).
        if (stored_shape != tuple(r.shape)) if transposed else (np.prod(stored_shape) != np.prod(r.shape)):
            continue
        stored = Stored(checkpoint, key, transposed, handles[r.variable_name], r.variable_name, tuple(r.shape),
                        _dtype(entry.dtype))
        if accepts(stored):
            out.append(stored)
    return sorted(out, key=lambda s: s.checkpoint.stored_range(s.key)[:2])


def checked_plan(report, handles: dict, current, accepts=lambda stored: True) -> tuple[list, list]:
    """Every matched value of ``report`` checked before any is assigned, without holding them all in memory.

    Plain copies of a TF checkpoint's tensors (as stored, or transposed by a rule set) that
    ``accepts`` (a Stored -> bool) come back as ``Stored``: their bytes were checked against
    their crc32c in 1 MiB chunks, so none is held; the caller reads each one when it assigns
    it (``reading_checked``). The others come back computed, as ``matched_values`` gives them.

    Returns:
        (stored, values): the Stored in file order, and (handle, numpy value) for the rest.

    Raises:
        CorruptCheckpointError: a tensor's bytes fail their checks (nothing has been assigned).
        InvalidArgumentError: a policy returned a value of another shape than its variable.
    """
    stored = _stored(report, handles, report_source(report), accepts)
    for s in stored:
        s.checkpoint.check(s.key)
    done = {s.variable_name for s in stored}
    return stored, matched_values(report, handles, current, [r for r in report.matched if r.variable_name not in done])


@contextlib.contextmanager
def reading_checked(stored: Stored):
    """Read one value ``checked_plan`` checked: a failure now means its shard was rewritten in place meanwhile.

    Raises:
        CheckpointChangedError: what the read raised, after some variables were assigned.
    """
    try:
        yield
    except CorruptCheckpointError as e:
        raise CheckpointChangedError(
            f"{stored.checkpoint.prefix!r} changed while it was restored ({e}); the variables before "
            f"{stored.variable_name!r} were restored from it already"
        ) from None
