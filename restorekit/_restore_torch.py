"""torch.nn.Module restore: a report's matches checked, then copied into the module's tensors in place.

``scan(checkpoint, module, layout='torch')`` plans it; ``restorekit.restore(report)``
comes here. Unlike ``load_state_dict(strict=False)``, a tensor of another shape was
reported by scan and is skipped (or went through its shape policy); every value is
read and checked before the first copy.

A tensor restored as a TF checkpoint stores it (or its 2-D transpose, a Dense kernel under
a rule set) is checked by its crc32c in small chunks first, then read straight into the
parameter's memory (the transposed ones through one reused buffer): no array of the
model's size is allocated, which in a fresh process costs a page fault per 4 KiB. The
other values (layouts' axes, policies, Keras files) are computed in numpy first.
"""

from __future__ import annotations

import warnings

import numpy as np

from restorekit._array_values import checked_plan, reading_checked
from restorekit._optim import _torch as optimizer_torch
from restorekit.errors import IncompleteRestoreError, MissingDependencyError
from restorekit._report import live_handles, nothing_matched
from restorekit._torch_target import is_torch_tensor

__all__ = ["is_torch_report", "restore"]


def is_torch_report(handles: dict) -> bool:
    """True when a report's live handles are torch tensors (scanned from an ``nn.Module``)."""
    return any(is_torch_tensor(h) for h in handles.values())


def _current(tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def _as_tensor(torch, value: np.ndarray):
    """A tensor sharing ``value``'s memory (strided: a transposed kernel is not copied first)."""
    with warnings.catch_warnings():
        # A decoded shard buffer is read-only; the tensor is only read (copied from), never written.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(value)


def restore(report, *, strict: bool = False):
    """Copy a report's matched values into its torch module's parameters and buffers, under ``torch.no_grad()``;
    with ``scan(..., optimizer=opt)``, then the carried optimizer state into ``opt`` (``report.optimizer``).

    Raises:
        IncompleteRestoreError: ``strict`` and the report is incomplete.
        NoMatchError: nothing matched.
        InvalidArgumentError: a policy returned a value of the wrong shape.
    """
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("restoring into a torch module needs torch: pip install 'restorekit[torch]'") from None
    handles = live_handles(report)
    if strict and not report.is_complete:
        raise IncompleteRestoreError(report.incomplete_message(), report)
    if not report.matched:
        raise nothing_matched(report)
    stored, values = checked_plan(report, handles, _current, _in_place)
    values = [(t, _as_tensor(torch, v)) for t, v in values]
    optimizer_state = optimizer_torch.read(report._optimizer)  # scan(..., optimizer=): read before any copy
    with torch.no_grad():
        _copy_stored(torch, stored)
        for tensor, value in values:
            tensor.copy_(value)
    optimizer_torch.load(report._optimizer, optimizer_state)
    return report


def _in_place(stored) -> bool:
    """A tensor that can be read into: on the CPU, contiguous, of a dtype numpy has (bfloat16 has none)."""
    tensor = stored.handle
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    try:
        return tensor.detach().numpy().dtype == stored.dtype
    except (TypeError, RuntimeError):
        return False


def _written(torch, tensor) -> None:
    # Written through numpy, which autograd does not see: bump the version as copy_ would, so a graph
    # that saved the old value refuses to backpropagate through it (torch >= 2.1 has the public call).
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(tensor)


def _copy_stored(torch, stored: list) -> None:
    """Read each stored value into its tensor: as stored straight into its memory, transposed through one buffer."""
    buffer = np.empty(max((s.entry.nbytes for s in stored if s.transposed), default=0), np.uint8)
    for s in stored:
        tensor, entry = s.handle, s.entry
        with reading_checked(s):
            if s.transposed:
                value = buffer[: entry.nbytes].view(s.dtype).reshape(entry.shape)
                s.checkpoint.read_into(s.key, value)
                tensor.copy_(torch.from_numpy(value).T)
            else:
                s.checkpoint.read_into(s.key, tensor.detach().numpy().reshape(entry.shape))
                _written(torch, tensor)
