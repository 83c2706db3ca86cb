"""torch.nn.Module restore: a report's matches computed in numpy and copied into the module's tensors in place.

``scan(checkpoint, module, layout='torch')`` plans it; ``restorekit.restore(report)``
comes here. Unlike ``load_state_dict(strict=False)``, a tensor of another shape was
reported by scan and is skipped (or went through its shape policy); every value is
read and checked before the first copy.
"""

from __future__ import annotations

import warnings

import numpy as np

from restorekit.array_values import matched_values
from restorekit.errors import IncompleteRestoreError, MissingDependencyError
from restorekit.report import live_handles, nothing_matched
from restorekit.torch_target import is_torch_tensor

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
    """Copy a report's matched values into its torch module's parameters and buffers, under ``torch.no_grad()``.

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
    values = [(t, _as_tensor(torch, v)) for t, v in matched_values(report, handles, _current)]
    with torch.no_grad():
        for tensor, value in values:
            tensor.copy_(value)
    return report
