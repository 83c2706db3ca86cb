"""Naming rule sets: variable name -> checkpoint name, aware of the checkpoint (``Rules``, ``KERAS_FROM_TF1``).

Pure Python: used by ``scan(rules=...)``, ``assignment_map=`` and the exporters.
"""

from __future__ import annotations

import re
from typing import Mapping

from restorekit.errors import InvalidArgumentError, NoMatchError, format_names
from restorekit.names import compile_pairs, optimizer_slot_kind

__all__ = ["KERAS_FROM_TF1", "Rules", "as_rules"]

_SUFFIX = re.compile(r"^(?P<base>.*?)(?:_(?P<n>\d+))?$")


def _split_suffix(component: str) -> tuple[str, int]:
    m = _SUFFIX.match(component)
    return m.group("base"), int(m.group("n") or 0)


class Rules:
    """An ordered naming rule set: variable name -> checkpoint name, aware of the checkpoint.

    ``pairs`` are ``(regex, replacement)`` applied in order with ``re.sub``; each must
    match some variable name. ``synonyms`` maps a last name part to alternatives
    tried when the name itself is not in the checkpoint (``kernel`` -> ``weights``).
    ``renumber`` pairs layer-uniquification suffixes in order (model ``dense_3``,
    ``dense_4`` onto checkpoint ``dense``, ``dense_1``) when the model's suffixes are
    not all present in the checkpoint. Rule sets add: ``Rules([(r'^net/', '')]) + KERAS_FROM_TF1``.

    Use as ``scan(..., rules=...)`` or ``scan(..., assignment_map=rules)``. Against a
    checkpoint, a scope shared by every variable (a Sequential's name) that no
    checkpoint entry has is dropped before the rules apply.
    """

    def __init__(self, pairs=(), *, synonyms=None, renumber: bool = False, name: str | None = None):
        self.pairs = compile_pairs(pairs)
        if synonyms is not None and not isinstance(synonyms, Mapping):
            raise InvalidArgumentError(
                f"synonyms is a mapping from a last name part to its alternatives, got {synonyms!r}"
            )
        self.synonyms = {}
        for leaf, alternatives in (synonyms or {}).items():
            alternatives = (alternatives,) if isinstance(alternatives, str) else alternatives
            if (
                not isinstance(leaf, str)
                or not isinstance(alternatives, (list, tuple))
                or not all(isinstance(a, str) for a in alternatives)
            ):
                raise InvalidArgumentError(f"synonyms map a str to strs, got {leaf!r}: {alternatives!r}")
            self.synonyms[leaf] = tuple(alternatives)
        self.renumber = renumber
        self.name = name

    def __repr__(self) -> str:
        return self.name or f"Rules({[(p.pattern, r) for p, r in self.pairs]!r})"

    def __add__(self, other) -> "Rules":
        other = as_rules(other)
        combined = Rules(name=f"{self!r} + {other!r}")
        combined.pairs = self.pairs + other.pairs
        combined.synonyms = {**other.synonyms, **self.synonyms}
        combined.renumber = self.renumber or other.renumber
        return combined

    def _rewrite(self, name: str) -> str:
        for pattern, repl in self.pairs:
            name = pattern.sub(repl, name)
        return name

    def __call__(self, name: str) -> str:
        """Rewrite one name without seeing the checkpoint (the pairs only)."""
        return self._rewrite(name)

    def bind(self, variable_names, checkpoint_names) -> "callable":
        """A function variable_name -> checkpoint name or None, for these names.

        Raises:
            NoMatchError: a pair matches no variable name, or the rules map no
                variable onto a checkpoint entry.
        """
        variable_names = list(variable_names)
        known = set(checkpoint_names)
        for pattern, _ in self.pairs:
            if not any(pattern.search(n) for n in variable_names):
                raise NoMatchError(
                    f"rule {pattern.pattern!r} of {self!r} matches none of the {len(variable_names)} variable names "
                    f"({format_names(variable_names, 4)})"
                )
        # A Sequential's or subclassed model's own name prefixes every Keras path
        # ('sequential/dense/kernel'); a checkpoint without that scope never had it.
        root = _shared_root(variable_names, known)
        rewritten = {n: self._rewrite(n[len(root):]) for n in variable_names}
        scopes = self._renumbering(list(rewritten.values()), known) if self.renumber else {}
        mapping = {}
        for original, name in rewritten.items():
            parts = name.split("/")
            for i in range(len(parts) - 1, 0, -1):
                prefix = "/".join(parts[:i])
                if prefix in scopes:
                    name = scopes[prefix] + "/" + "/".join(parts[i:])
                    break
            mapping[original] = self._synonym(name, known)
        if not any(target in known for target in mapping.values()):
            raise NoMatchError(
                f"rules {self!r} map none of the {len(variable_names)} variables onto a checkpoint entry "
                f"(for example {variable_names[0]!r} -> {mapping[variable_names[0]]!r})" if variable_names else
                f"rules {self!r} have no variables to map"
            )
        return mapping.get

    def _synonym(self, name: str, known: set) -> str:
        if name in known or "/" not in name and name not in self.synonyms:
            return name
        scope, _, leaf = name.rpartition("/")
        for alternative in self.synonyms.get(leaf, ()):
            candidate = f"{scope}/{alternative}" if scope else alternative
            if candidate in known:
                return candidate
        return name

    @staticmethod
    def _renumbering(names: list[str], known: set) -> dict[str, str]:
        """Model scope -> checkpoint scope, pairing uniquified layer names in order."""
        ckpt_children: dict[str, set] = {}
        for n in known:
            if optimizer_slot_kind(n):
                continue
            parts = n.split("/")
            for i in range(len(parts) - 1):
                ckpt_children.setdefault("/".join(parts[:i]), set()).add(parts[i])
        result: dict[str, str] = {}
        depth = max((n.count("/") for n in names), default=0)
        for level in range(depth):
            groups: dict[tuple, list[str]] = {}
            for n in names:
                parts = n.split("/")
                if len(parts) - 1 <= level:
                    continue
                parent = "/".join(parts[:level])
                mapped_parent = result.get(parent, parent) if parent else ""
                component = parts[level]
                key = (parent, mapped_parent, _split_suffix(component)[0])
                if component not in groups.setdefault(key, []):
                    groups[key].append(component)
            for (parent, mapped_parent, base), components in groups.items():
                available = sorted(
                    (c for c in ckpt_children.get(mapped_parent, ()) if _split_suffix(c)[0] == base),
                    key=lambda c: _split_suffix(c)[1],
                )
                ordered = sorted(components, key=lambda c: _split_suffix(c)[1])
                same = set(components) <= set(available)
                for i, component in enumerate(ordered):
                    target = component if same or i >= len(available) else available[i]
                    here = f"{parent}/{component}" if parent else component
                    result[here] = f"{mapped_parent}/{target}" if mapped_parent else target
        return result


def _shared_root(variable_names: list[str], checkpoint_names: set) -> str:
    """'model/' when every variable sits under that one scope and no checkpoint entry does, else ''."""
    roots = {n.split("/", 1)[0] for n in variable_names}
    if len(roots) != 1 or not all("/" in n for n in variable_names):
        return ""
    root = roots.pop() + "/"
    return "" if any(c.startswith(root) for c in checkpoint_names) else root


def as_rules(rules) -> Rules:
    """A Rules from a Rules, a list of (regex, replacement) pairs and Rules, or one pair."""
    if isinstance(rules, Rules):
        return rules
    if isinstance(rules, (list, tuple)):
        if len(rules) == 2 and isinstance(rules[0], (str, re.Pattern)) and isinstance(rules[1], str):
            return Rules([rules])
        combined = Rules()
        for item in rules:
            combined = combined + (item if isinstance(item, Rules) else Rules([item]))
        return combined
    raise InvalidArgumentError(f"rules are a restorekit Rules or a list of (regex, replacement) pairs, got {rules!r}")


KERAS_FROM_TF1 = Rules(
    synonyms={
        "kernel": ("weights", "W", "w"),
        "bias": ("biases", "b"),
        "embeddings": ("embedding", "weights"),
        "depthwise_kernel": ("depthwise_weights",),
        "pointwise_kernel": ("pointwise_weights",),
        "gamma": ("scale",),
        "beta": ("offset",),
    },
    renumber=True,
    name="KERAS_FROM_TF1",
)
"""Keras 3 variable paths onto TF1 / tf-slim checkpoint names: ``kernel`` -> ``weights``,
``bias`` -> ``biases``, and layer uniquification suffixes paired in order."""
