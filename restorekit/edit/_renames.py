"""Edits of the plan's names: rename one or all by a rule, and drop entries (delete, strip optimizer state)."""

from __future__ import annotations

import re
from dataclasses import replace

from restorekit._checkpoint import OBJECT_GRAPH_KEY
from restorekit.edit._plan import Item
from restorekit.errors import InvalidArgumentError, NoMatchError, RestoreKitWarning, format_names
from restorekit._names import Kind, apply_renames, entry_kind


def renamed(plan: dict[str, Item], old: str, new: str) -> dict[str, Item]:
    """``plan`` with ``old`` called ``new``, in the same place."""
    return {(new if k == old else k): v for k, v in plan.items()}


def rename_all(plan: dict[str, Item], rule, prefix: str) -> tuple[dict[str, Item], dict[str, str]]:
    """(``plan`` renamed by ``rule``, {old: new} for the names that changed); see ``CheckpointEditor.rename_all``."""
    names = list(plan)
    if isinstance(rule, dict):
        missing = [k for k in rule if k not in plan]
        if missing:
            raise NoMatchError(
                f"rename mapping names {format_names(missing)}, not entries of {prefix!r}.",
                name=str(missing[0]), candidates=names,
            )
    elif isinstance(rule, (list, tuple)):
        check_regex_rules(names, rule, prefix)
    mapping = apply_renames(names, rule)
    changed = {old: new for old, new in mapping.items() if old != new}
    if not changed:
        raise NoMatchError(f"the rename rule changes no name of {prefix!r}")
    return {mapping[k]: v for k, v in plan.items()}, changed


def apply_rule_set(plan: dict[str, Item], rules) -> tuple[dict[str, Item], dict[str, str]]:
    """(``plan`` renamed and transformed by a rule set of ``restorekit.export._hf``, {old: new})."""
    import warnings

    from restorekit.edit._values import with_op
    from restorekit.export._hf import TRANSFORMS, rule_set

    ruleset = rule_set(rules)
    result = ruleset.plan({name: item.shape for name, item in plan.items()})
    if result.dropped:
        warnings.warn(f"rule set {ruleset.name!r} drops {format_names(result.dropped)}: "
                      f"{'; '.join(sorted(set(result.dropped.values())))}", RestoreKitWarning, stacklevel=3)
    out = {}
    for name, item in plan.items():
        if name not in result.names:
            continue
        new = result.names[name]
        transform = result.transforms.get(name)
        if transform is not None:
            item = replace(with_op(item, TRANSFORMS[transform][1]), shape=result.shapes[new])
        out[new] = item
    return out, {old: new for old, new in result.names.items() if old != new}


def check_regex_rules(names: list[str], rule, prefix: str) -> None:
    """Each ``(regex, replacement)`` must compile and match a name as the rules before it left them."""
    current = names
    for item in rule:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            continue
        try:
            pattern = re.compile(item[0]) if isinstance(item[0], str) else item[0]
        except re.error as e:
            raise InvalidArgumentError(f"rename pattern {item[0]!r} is not a valid regex: {e}") from None
        if not any(pattern.search(n) for n in current):
            raise NoMatchError(f"rename pattern {pattern.pattern!r} matches no entry of {prefix!r}.",
                               name=pattern.pattern, candidates=current)
        current = [pattern.sub(item[1], n) for n in current]


def without(plan: dict[str, Item], names) -> dict[str, Item]:
    names = set(names)
    return {k: v for k, v in plan.items() if k not in names}


def optimizer_state(plan: dict[str, Item], checkpoint) -> list[str]:
    """Names of the plan that hold optimizer slots or state (never the object graph)."""
    # In a TF2 checkpoint a key's spelling says nothing: Keras 3 saves the model's
    # own weights under 'optimizer/_trainable_variables/N/...' when the optimizer
    # tracked them first. The object graph says what each key really is.
    tracked = checkpoint.object_graph.by_key if checkpoint.is_object_based else {}

    def is_optimizer_state(name: str, item: Item) -> bool:
        if name == OBJECT_GRAPH_KEY:
            return False
        kind = tracked[item.origin].kind if item.origin in tracked else None
        # a Keras file's readable path says 'optimizer/...' where its key may not (legacy 'optimizer_weights/...')
        return entry_kind(name, path=checkpoint.readable_name(item.origin), tracked=kind) is Kind.OPTIMIZER

    return [n for n, item in plan.items() if is_optimizer_state(n, item)]
