"""Variable groups as ``torch.optim`` parameter groups: per-group learning rates, frozen groups ``requires_grad=False``.

The same ``group_variables`` rules as every other training style, over a
``torch.nn.Module``'s ``named_parameters`` (matched by their ``state_dict`` names).
torch is not imported here: the groups are plain dicts ``torch.optim`` takes.
"""

from __future__ import annotations

from restorekit.errors import InvalidArgumentError
from restorekit.finetune._groups import _check_multiplier, group_variables
from restorekit._torch_target import is_torch_module

__all__ = ["param_groups"]


def param_groups(module, rules, *, lr: float, default: float = 1.0) -> list[dict]:
    """``torch.optim`` parameter groups of ``module``, one per multiplier rule that takes a parameter.

    Each group is ``{'params': [...], 'lr': lr * multiplier, 'name': the rule}``; a
    group with multiplier 0 is frozen: its parameters get ``requires_grad=False`` and
    stay out of the optimizer (other parameters are left as they are). Parameters no
    rule takes form the default group.

    Args:
        module: a ``torch.nn.Module`` (a Hugging Face model too).
        rules: ordered ``{pattern: multiplier}`` over ``state_dict`` names, as for
            ``group_variables`` (``{'bert.embeddings': 0, 'classifier': 10.0}``).
        lr: the base learning rate.
        default: the multiplier of parameters no rule takes.

    Returns:
        A list of parameter-group dicts, for ``torch.optim.AdamW(param_groups(...))``.

    Raises:
        InvalidArgumentError: ``module`` is not a torch module, or ``lr`` is not a number >= 0.
        NoMatchError: a rule takes no parameter (lists the closest names).

    Example:
        >>> opt = torch.optim.AdamW(restorekit.param_groups(model, {'bert.embeddings': 0, 'bert': 0.1}, lr=3e-5))
    """
    if not is_torch_module(module):
        raise InvalidArgumentError(f"param_groups takes a torch.nn.Module, got {type(module).__name__}")
    lr = _check_multiplier(lr, "lr")
    groups = group_variables(rules, module, default=default)
    parameters = dict(module.named_parameters())
    out = []
    for group in groups:
        params = [parameters[name] for name in group.variables]
        if group.frozen:
            for p in params:
                p.requires_grad_(False)
            continue
        out.append({"params": params, "lr": lr * group.multiplier, "name": group.label})
    return out
