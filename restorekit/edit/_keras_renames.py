"""Renames in a Keras 3 file by readable path: a layer is renamed whole, by the ``name`` attribute of its ``vars`` group.

A Keras 3 file keys variables by position (``layers/dense/vars/0``); the readable path
(``enc1/kernel``) is the owning layers' ``name`` attributes plus a variable name guessed
from the layer's class. ``model.load_weights`` finds groups by class and position, never
by name, so a layer rename changes only that attribute; the keys stay. A rename that
would move one variable out of its layer, rename a variable inside a layer, or land two
layers on one name has no such attribute to change and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from restorekit.edit._plan import Item
from restorekit.errors import EditError, NoMatchError, format_names
from restorekit.keras_files._layouts import Keras3Walk, config_index, text
from restorekit.keras_files._memtree import Group, node, sorted_tree, tree_types
from restorekit._names import apply_renames, rename_rule


class _Stub:
    """What the walk reads of a dataset, from an entry (no file open)."""

    def __init__(self, entry):
        self.shape = tuple(entry.shape)
        bfloat16 = entry.dtype == "bfloat16"
        self.dtype = np.dtype(object) if entry.dtype == "string" else np.dtype(np.uint16 if bfloat16 else entry.dtype)
        self.attrs = {"dtype": "bfloat16"} if bfloat16 else {}


_TREE = tree_types(_Stub)


def readable_paths(ckpt, names: dict) -> tuple[dict, dict]:
    """``({key: readable path}, {'<group>/vars': owner path})`` of a Keras 3 file whose ``vars`` groups
    in ``names`` (``{'layers/dense/vars': 'enc9'}``) carry those layer names."""
    attrs = ckpt.group_attrs()
    root = Group()
    for group, values in attrs.items():
        node(root, group).attrs = {**values, **({"name": names[group]} if group in names else {})}
    for group, new in names.items():
        node(root, group).attrs.setdefault("name", new)
    for key, entry in ckpt.entries.items():
        parent, _, last = key.rpartition("/")
        node(root, parent)[last] = _Stub(entry)
    index = config_index(ckpt.config)
    for group, new in names.items():  # a renamed layer keeps its class and config (its variables' names)
        old = text(attrs.get(group, {}).get("name"))
        if old in index:
            index.setdefault(new, index[old])
    walker = Keras3Walk(ckpt.prefix, _TREE, index)
    walker.visit(sorted_tree(root), "", "", root=True)
    return walker.readable, walker.owners


def prefix_rule(old: str, new: str):
    """``rename(old, new)`` on readable paths: ``old`` itself, or everything under it (a layer)."""
    return lambda path: new + path[len(old):] if path == old or path.startswith(old + "/") else path


def layer_renames(ckpt, plan: dict[str, Item], names: dict, rule, *, asked: str,
                  name: str | None = None) -> tuple[dict, dict]:
    """``(new {vars group: layer name}, {old path: new path})`` after ``rule`` renames the readable paths.

    Raises:
        NoMatchError: the rule changes no readable path.
        EditError: the rule does not rename whole layers (see the module docstring); nothing changes.
    """
    paths, owners = readable_paths(ckpt, names)
    keys = [k for k, it in plan.items() if it.origin == k and k in paths]  # entries still under their own key
    current = {k: paths[k] for k in keys}
    mapping = apply_renames(list(current.values()), rename_rule(rule))
    target = {k: mapping[current[k]] for k in keys}
    changed = {k: (current[k], target[k]) for k in keys if current[k] != target[k]}
    if not changed:
        raise NoMatchError(f"{asked} changes no readable path of {ckpt.prefix!r}.", name=name or asked,
                           candidates=sorted(set(current.values()) | {o for o in owners.values() if o}))
    by_owner: dict = {}
    for group, owner in owners.items():
        if owner and not group.startswith("optimizer"):
            by_owner.setdefault(owner, []).append(group)
    renamed_at: dict = {}
    bad = []
    for key, (old, new) in changed.items():
        o, n = old.split("/"), new.split("/")
        if key.startswith("optimizer/") or len(o) != len(n) or o[-1] != n[-1]:
            bad.append(key)
            continue
        for i in range(len(o) - 1):
            if o[i] != n[i] and renamed_at.setdefault("/".join(o[: i + 1]), n[i]) != n[i]:
                bad.append(key)
    new_names = dict(names)
    for owner, name in renamed_at.items():
        bad += [] if owner in by_owner else [k for k, (old, _) in changed.items() if old.startswith(owner + "/")]
        new_names.update({group: name for group in by_owner.get(owner, ())})
    if not bad:
        after, _ = readable_paths(ckpt, new_names)
        bad = [k for k in keys if after[k] != target[k]]
    if bad:
        moves = [f"{old} -> {new}" for old, new in changed.values()]
        left = [current[k] for k in dict.fromkeys(bad) if k not in changed]
        behind = f" (leaving {format_names(left, 4)} behind)" if left else ""
        raise EditError(
            f"{asked}: {format_names(moves, 4)}{behind} cannot be saved in a Keras file. Keras files name variables by "
            f"position inside their layer ('layers/dense/vars/0'), so only whole layers can be renamed, by the "
            f"layer's name (rename('enc1', 'enc9')); renaming one variable, splitting a layer's variables or giving "
            f"two layers one name is refused. Nothing was changed"
        )
    return new_names, {current[k]: target[k] for k in changed}


def changes_keys(plan: dict[str, Item], rule) -> bool:
    """True when ``rule`` names or changes a key of the file (``layers/dense/vars/0``): a rename of keys, as in
    any checkpoint. A rule that cannot be applied counts too, so the ordinary path reports it."""
    if isinstance(rule, Mapping):
        return any(k in plan for k in rule)
    try:
        fn = rename_rule(rule)
        return any(fn(k) != k for k in plan)
    except Exception:  # noqa: BLE001 - the key path raises the right error for a broken rule
        return True


def rename_all(ckpt, plan: dict[str, Item], names: dict, rule) -> tuple[dict, dict]:
    """``rename_all`` on a Keras 3 file by readable paths: a mapping's keys are layers or paths (as in ``rename``),
    a list of ``(regex, replacement)`` or a callable applies to every readable path."""
    paths = readable_paths(ckpt, names)[0]
    current = [paths[k] for k, it in plan.items() if it.origin == k and k in paths]
    if isinstance(rule, Mapping):
        layers = {"/".join(p.split("/")[:i]) for p in current for i in range(1, p.count("/") + 1)}
        missing = [k for k in rule if k not in current and k not in layers]
        if missing:
            raise NoMatchError(f"rename mapping names {format_names(missing)}, not a layer or path of {ckpt.prefix!r}.",
                               name=str(missing[0]), candidates=sorted(set(current) | layers))
        table = dict(rule)

        def by_prefix(path: str) -> str:
            parts = path.split("/")
            for i in range(len(parts), 0, -1):  # the longest layer or path the mapping names
                head = "/".join(parts[:i])
                if head in table:
                    return table[head] + path[len(head):]
            return path

        return layer_renames(ckpt, plan, names, by_prefix, asked="rename_all mapping")
    if isinstance(rule, Sequence) and not isinstance(rule, str):
        from restorekit.edit._renames import check_regex_rules

        check_regex_rules(current, rule, ckpt.prefix)
    return layer_renames(ckpt, plan, names, rename_rule(rule), asked="rename_all rule")
