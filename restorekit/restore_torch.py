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

from restorekit.array_values import matched_values, report_source
from restorekit.bundle.format import dtype_enum, numpy_dtype
from restorekit.errors import CheckpointChangedError, CorruptCheckpointError, IncompleteRestoreError, MissingDependencyError
from restorekit.report import live_handles, nothing_matched, plain_records
from restorekit.torch_target import is_torch_tensor, stored_tensor

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
    source = report_source(report)
    stored = _stored(source, report, handles)
    for checkpoint, key, _, _, _ in stored:
        checkpoint.check(key)
    rest = [r for r in report.matched if r.variable_name not in {s[4] for s in stored}]
    values = [(t, _as_tensor(torch, v)) for t, v in matched_values(report, handles, _current, rest)]
    with torch.no_grad():
        _copy_stored(torch, stored)
        for tensor, value in values:
            tensor.copy_(value)
    return report


def _stored(source, report, handles: dict) -> list:
    """(checkpoint, key, transposed, tensor, variable name) for each plain match a restore reads as stored, in file order."""
    out = []
    for r in plain_records(report):
        found = stored_tensor(source, r.checkpoint_name)
        tensor = handles[r.variable_name]
        if found is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        checkpoint, key, transposed = found
        entry = checkpoint.entries[key]
        shape = tuple(tensor.shape)
        if (tuple(reversed(entry.shape)) != shape) if transposed else (np.prod(entry.shape) != np.prod(shape)):
            continue  # the matched value has other axes than the stored one: computed instead
        try:
            view = tensor.detach().numpy()  # bfloat16 and other dtypes numpy lacks have none
        except (TypeError, RuntimeError):
            continue
        if entry.dtype == "string" or view.dtype != numpy_dtype(dtype_enum(entry.dtype)):
            continue
        out.append((checkpoint, key, transposed, tensor, r.variable_name))
    return sorted(out, key=lambda s: s[0].stored_range(s[1])[:2])


def _written(torch, tensor) -> None:
    # Written through numpy, which autograd does not see: bump the version as copy_ would, so a graph
    # that saved the old value refuses to backpropagate through it (torch >= 2.1 has the public call).
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(tensor)


def _copy_stored(torch, stored: list) -> None:
    """Read each stored value into its tensor: as stored straight into its memory, transposed through one buffer."""
    size = max((s[0].entries[s[1]].nbytes for s in stored if s[2]), default=0)
    buffer = np.empty(size, np.uint8)
    for checkpoint, key, transposed, tensor, _ in stored:
        entry = checkpoint.entries[key]
        view = tensor.detach().numpy()
        try:
            if transposed:
                stored_value = buffer[: entry.nbytes].view(view.dtype).reshape(entry.shape)
                checkpoint.read_into(key, stored_value)
                tensor.copy_(torch.from_numpy(stored_value).T)
            else:
                checkpoint.read_into(key, view.reshape(entry.shape))
                _written(torch, tensor)
        except CorruptCheckpointError as e:
            # check() passed a moment ago: the shard was rewritten in place while it was read.
            raise CheckpointChangedError(
                f"{checkpoint.prefix!r} changed while it was restored ({e}); the module holds a partial restore"
            ) from None
