"""What the grouped optimizers share: one optimizer per multiplier, and the split of variables among them."""

from __future__ import annotations

from typing import Callable, Iterable

from restorekit.errors import GroupError, InvalidArgumentError
from restorekit.finetune._groups import VariableGroups

__all__ = ["optimizers_per_multiplier", "split_by_multiplier"]


def optimizers_per_multiplier(factory, groups: VariableGroups, base: type, what: str) -> dict:
    """multiplier -> ``factory(multiplier)``, one new ``base`` instance per trainable multiplier.

    Raises:
        InvalidArgumentError: ``factory`` is not callable, returns no ``base``, or returns
            one optimizer twice.
        GroupError: every group is frozen.
    """
    if not callable(factory):
        raise InvalidArgumentError(f"optimizer_factory must be callable (multiplier -> optimizer), got {factory!r}")
    if not groups.multipliers:
        raise GroupError(f"every group is frozen, so there is nothing to optimize:\n{groups}")
    optimizers: dict[float, object] = {}
    for mult in groups.multipliers:
        opt = factory(mult)
        if not isinstance(opt, base):
            raise InvalidArgumentError(
                f"optimizer_factory({mult:g}) returned {type(opt).__name__}, not a {what}"
            )
        if any(opt is other for other in optimizers.values()):
            raise InvalidArgumentError(
                f"optimizer_factory({mult:g}) returned an optimizer it already returned; "
                "return a new optimizer per multiplier"
            )
        optimizers[mult] = opt
    return optimizers


def split_by_multiplier(groups: VariableGroups, items: Iterable, variable: Callable = lambda item: item) -> dict:
    """multiplier -> the items whose ``variable(item)`` is in a group with that multiplier.

    Keys are ``groups.multipliers`` (the optimizers' order), items keep their order,
    and items of frozen groups are dropped.

    Raises:
        GroupError: a variable the groups do not know.
    """
    split: dict[float, list] = {m: [] for m in groups.multipliers}
    for item in items:
        group = groups.group_of(variable(item))
        if not group.frozen:
            split[group.multiplier].append(item)
    return split
