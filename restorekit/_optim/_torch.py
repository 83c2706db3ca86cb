"""Write a planned optimizer state into a ``torch.optim`` optimizer, through its own ``load_state_dict``.

torch is imported only here, inside the functions; ``load_state_dict`` casts each state
tensor to its parameter's dtype and device as torch does for its own checkpoints.
"""

from __future__ import annotations

from restorekit._bundle.format import empty_array

__all__ = ["load", "read"]


def read(plan) -> list:
    """Every carried parameter's state as numpy values: read and checked before anything is written."""
    if plan is None:
        return []
    return [(carry.param, carry.read()) for carry in plan.carries]


def _step(torch, value: float, param, group):
    if group.get("capturable") or group.get("fused"):
        return torch.tensor(value, dtype=torch.float32, device=param.device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(value, dtype=dtype)


def _tensor(torch, np, value):
    """A contiguous tensor of ``value``: its own memory where numpy's is writable and in order, else one copy (torch's
    strided copy where the view transposed it)."""
    value = np.asarray(value)
    if value.flags.writeable and value.flags.c_contiguous:
        return torch.from_numpy(value)
    out = empty_array(value.shape, value.dtype)  # fresh memory populated at once: torch's own faults page by page
    if value.flags.writeable:
        torch.from_numpy(out).copy_(torch.from_numpy(value))  # torch's strided copy: ~3x numpy's for a transpose
    else:
        np.copyto(out, value)
    return torch.from_numpy(out)


def load(plan, values: list) -> None:
    """Put ``values`` (from :func:`read`) and the reset parameters' fresh state into the plan's optimizer."""
    if plan is None:
        return
    import numpy as np
    import torch

    optimizer = plan.optimizer
    order = [(g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]
    index = {id(p): (i, g) for i, (g, p) in enumerate(order)}
    state_dict = optimizer.state_dict()
    while values:  # taken one by one: a value read at scan is let go once its tensor is made
        param, state = values.pop()
        i, g = index[id(param)]
        group = optimizer.param_groups[g]
        tensors = {k: (_step(torch, v, param, group) if k == "step" else _tensor(torch, np, v))
                   for k, v in state.items()}
        if group.get("amsgrad") and "exp_avg_sq" in tensors and "max_exp_avg_sq" not in tensors:
            tensors["max_exp_avg_sq"] = tensors["exp_avg_sq"].clone()
        state_dict["state"][i] = tensors
    for param in plan.resets:
        i, g = index[id(param)]
        group = optimizer.param_groups[g]
        if plan.kind == "Adagrad":  # Adagrad makes its state when it is built, not at the first step
            state_dict["state"][i] = {"step": _step(torch, 0.0, param, group),
                                      "sum": torch.full_like(param, float(group["initial_accumulator_value"]))}
        else:
            state_dict["state"].pop(i, None)
    for g, settings in plan.groups.items():
        state_dict["param_groups"][g].update(settings)
    optimizer.load_state_dict(state_dict)
