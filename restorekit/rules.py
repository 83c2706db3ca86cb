"""Naming rule sets: variable name -> checkpoint name, aware of the checkpoint (``Rules``, ``KERAS_FROM_TF1``).

Pure Python: used by ``scan(rules=...)``, ``assignment_map=`` and the exporters.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

from restorekit.errors import InvalidArgumentError, NoMatchError, format_names
from restorekit._hints import level_index, one_level_away, shapes_fit
from restorekit._names import compile_pairs, invert_pair, optimizer_slot_kind

__all__ = ["FLAX_FROM_TF", "KERAS_FROM_KERAS2", "KERAS_FROM_TF1", "Rules", "as_rules", "keras_layer_pairs"]

_SUFFIX = re.compile(r"(?P<base>.*?)(?:_(?P<n>\d+))?", re.DOTALL)


def _split_suffix(component: str) -> tuple[str, int]:
    m = _SUFFIX.fullmatch(component)
    assert m is not None  # every string matches: the number is optional
    return m.group("base"), int(m.group("n") or 0)


class Rules:
    """An ordered naming rule set: variable name -> checkpoint name, aware of the checkpoint.

    ``pairs`` are ``(regex, replacement)`` applied in order with ``re.sub``; each must
    match some variable name. ``synonyms`` maps a last name part to alternatives
    tried when the name itself is not in the checkpoint (``kernel`` -> ``weights``).
    ``renumber`` pairs layer-uniquification suffixes in order (model ``dense_3``,
    ``dense_4`` onto checkpoint ``dense``, ``dense_1``) when the model's suffixes are
    not all present in the checkpoint. ``scope_levels`` then looks a name still not in
    the checkpoint up with one scope level dropped or inserted (``rnn/lstm_cell/kernel``
    as ``rnn/kernel``, when one entry is that). Rule sets add:
    ``Rules([(r'^net/', '')]) + KERAS_FROM_TF1``.

    Use as ``scan(..., rules=...)`` or ``scan(..., assignment_map=rules)``. Against a
    checkpoint, a scope shared by every variable (a Sequential's name) that no
    checkpoint entry has is dropped before the rules apply.
    """

    def __init__(self, pairs=(), *, synonyms=None, renumber: bool = False, scope_levels: bool = False,
                 name: str | None = None):
        self.pairs = compile_pairs(pairs)
        self.scope_levels = scope_levels
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
        combined.scope_levels = self.scope_levels or other.scope_levels
        return combined

    def _rewrite(self, name: str) -> str:
        for pattern, repl in self.pairs:
            name = pattern.sub(repl, name)
        return name

    def __call__(self, name: str) -> str:
        """Rewrite one name without seeing the checkpoint (the pairs only)."""
        return self._rewrite(name)

    def inverse(self) -> "Rules":
        """The rules that give back the names these rewrite: each pair undone, the last pair first.

        A pair can be undone when its pattern is literal text and capturing groups and its
        replacement writes every group back: ``(r'^net/(\\w+)/', r'\\1.')`` becomes
        ``(r'^(\\w+)\\.', r'net/\\1/')``. A pair rewrites wherever it matches (``re.sub``),
        so a name comes back only if what the pairs left alone does not look like what they
        wrote; :meth:`check_inverse` checks a list of names.

        Raises:
            InvalidArgumentError: ``synonyms``, ``renumber`` or ``scope_levels`` (each picks a
                checkpoint name by what the checkpoint holds, which no rule undoes), or a pair
                that loses what it matched (a dropped group, a lookahead, text matched outside
                a group, a function as replacement); the message names the pair and why.
        """
        chosen = [option for option, on in (("synonyms", bool(self.synonyms)), ("renumber", self.renumber),
                                            ("scope_levels", self.scope_levels)) if on]
        if chosen:
            raise InvalidArgumentError(
                f"rules {self!r} cannot be inverted: {' and '.join(chosen)} pick a checkpoint name by what the "
                f"checkpoint holds, which no rule undoes; invert Rules of (regex, replacement) pairs alone"
            )
        pairs = []
        for pattern, replacement in reversed(self.pairs):
            try:
                pairs.append(invert_pair(pattern, replacement))
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"rules {self!r}: {e}") from None
        return Rules(pairs, name=f"{self.name}.inverse()" if self.name else None)

    def check_inverse(self, names, inverse: "Rules | None" = None) -> None:
        """Check that every one of ``names`` comes back through these rules and then ``inverse``.

        ``inverse`` is :meth:`inverse` by default; then the pair that lost a name is named.

        Raises:
            InvalidArgumentError: names that come back as others, each with the pair that lost it.
        """
        own = inverse is None
        inverse = self.inverse() if inverse is None else inverse
        lost = []
        for name in names:
            steps = [name]
            for pattern, replacement in self.pairs:
                steps.append(pattern.sub(replacement, steps[-1]))
            back = inverse(steps[-1])
            if back == name:
                continue
            text = f"{name!r} -> {steps[-1]!r} -> {back!r}"
            if own:
                current = steps[-1]
                for j, (pattern, replacement) in enumerate(inverse.pairs):
                    current = pattern.sub(replacement, current)
                    if current != steps[-2 - j]:
                        lost_by = self.pairs[len(self.pairs) - 1 - j]
                        text += f" (pair {lost_by[0].pattern!r} -> {lost_by[1]!r})"
                        break
            lost.append(text)
        if lost:
            shown = "; ".join(lost[:5]) + (f"; ... and {len(lost) - 5} more" if len(lost) > 5 else "")
            raise InvalidArgumentError(f"rules {inverse!r} do not give back {len(lost)} name(s) of {self!r}: {shown}")

    def bind(self, variable_names, checkpoint_names) -> Callable[[str], str | None]:
        """A function variable_name -> checkpoint name or None, for these names.

        Raises:
            NoMatchError: a pair matches no variable name, or the rules map no
                variable onto a checkpoint entry.
        """
        variable_names = list(variable_names)
        for pattern, _ in self.pairs:
            if not any(pattern.search(n) for n in variable_names):
                raise NoMatchError(
                    f"rule {pattern.pattern!r} of {self!r} matches none of the {len(variable_names)} variable names "
                    f"({format_names(variable_names, 4)})"
                )
        mapping = self.mapping(variable_names, checkpoint_names)
        known = set(checkpoint_names)
        if not any(target in known for target in mapping.values()):
            raise NoMatchError(
                f"rules {self!r} map none of the {len(variable_names)} variables onto a checkpoint entry "
                f"(for example {variable_names[0]!r} -> {mapping[variable_names[0]]!r})" if variable_names else
                f"rules {self!r} have no variables to map"
            )
        return mapping.get

    def mapping(self, variable_names, checkpoint_names) -> dict:
        """``{variable name: checkpoint name}`` for these names (checkpoint names that may not exist); never raises."""
        variable_names = list(variable_names)
        known = set(checkpoint_names)
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
        if self.scope_levels:
            index = level_index(known)
            for original, name in mapping.items():
                if name not in known:
                    mapping[original] = one_level_away(name, known, index) or name
        return mapping

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


def _layer_scope(name: str) -> tuple[str, str]:
    scope, _, leaf = name.rpartition("/")
    return scope, leaf


def _file_scope(scope: str, scopes: Mapping, index: dict, leaves: set, suffixes: dict) -> tuple[str | None, str]:
    """(the file's layer scope for a model layer ``scope``, how it was found) or (None, '')."""
    if scope in scopes:
        return scope, ""
    parts = scope.split("/")
    for i in range(1, len(parts)):  # the model has scopes before the layer that the file lacks
        if "/".join(parts[i:]) in scopes:
            return "/".join(parts[i:]), ""
    ending = suffixes.get(scope, ())  # the file has scopes the model lacks
    if len(ending) == 1:
        return ending[0], ""
    level = one_level_away(scope + "/_", leaves, index)
    return (level[:-2], "one scope level apart") if level else (None, "")


def keras_layer_pairs(targets, by_name, layers: Mapping) -> dict:
    """Pair variables whose path names no entry of a Keras file inside their layer, as Keras loads weights.

    ``targets``: ``(variable name, shape, dtype)`` in the model's order; ``by_name``: variable
    name -> the key its path names, or None; ``layers``: the file's layer scope -> ``[(key,
    leaf, shape, dtype)]`` in the order the layer created its variables. A model layer is
    found in the file under its own scope, with model or file scopes before it, or one
    scope level apart (``rnn/lstm_cell`` in Keras 3, ``rnn`` in a Keras 2 file). Inside it
    variables pair by leaf when both sides name the same leaves, else by position when both
    hold as many variables of fitting shapes and dtypes in order (a custom layer's
    ``attention/0``, ``attention/1``). Keys a name already finds are never given away.

    Returns:
        ``{variable name: (key, reason)}`` for the variables paired so.
    """
    by_scope: dict = {}
    for name, shape, dtype in targets:
        scope, leaf = _layer_scope(name)
        by_scope.setdefault(scope, []).append((name, leaf, shape, dtype))
    named = {by_name(name) for name, _, _ in targets} - {None}
    leaves_of = {s + "/_" for s in layers}  # scopes as names of one placeholder leaf, for one_level_away
    index = level_index(leaves_of)
    suffixes: dict = {}
    for s in layers:
        parts = s.split("/")
        for i in range(1, len(parts)):
            suffixes.setdefault("/".join(parts[i:]), []).append(s)
    out: dict = {}
    for scope, own in by_scope.items():
        if not scope or all(by_name(name) for name, *_ in own):
            continue
        found, how = _file_scope(scope, layers, index, leaves_of, suffixes)
        if found is None:
            continue
        entries = layers[found]
        leaves = {leaf: key for key, leaf, _, _ in entries}
        if len(leaves) == len(entries) == len(own) and leaves.keys() == {leaf for _, leaf, _, _ in own}:
            pairs = [(name, leaves[leaf]) for name, leaf, _, _ in own]
            why = f"layer {found!r} in the file, {how}" if how else None
        elif len(entries) == len(own) and all(
                dtype == e_dtype and shapes_fit(shape, e_shape)
                for (_, _, shape, dtype), (_, _, e_shape, e_dtype) in zip(own, entries)):
            pairs = [(name, entry[0]) for (name, *_), entry in zip(own, entries)]
            why = f"by position in layer {found!r}" + (f", {how}" if how else "")
        else:
            continue
        for name, key in pairs:
            if by_name(name) is None and key not in named and why is not None:
                out[name] = (key, why)
    return out


KERAS_FROM_KERAS2 = Rules(renumber=True, scope_levels=True, name="KERAS_FROM_KERAS2")
"""Keras 3 variable paths onto a legacy Keras 2 HDF5 file's names: Keras 2's layer numbering
(``dense_1``, ``dense_2``) paired in order with Keras 3's (``dense``, ``dense_1``), and one scope
level dropped or inserted where Keras 2 named it otherwise (``rnn/lstm_cell/kernel`` saved as
``rnn/kernel``). ``scan`` applies it by itself to a legacy Keras file whose names match none of
the model's."""

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

FLAX_FROM_TF = Rules(
    synonyms={
        "kernel": ("weights", "W", "w"),
        "bias": ("biases", "b", "beta"),
        "scale": ("gamma",),
        "mean": ("moving_mean",),
        "var": ("moving_variance",),
        "embedding": ("embeddings", "weights"),
    },
    name="FLAX_FROM_TF",
)
"""Flax NNX variable paths (``bn/scale``, ``layers/0/kernel``) onto TF1 / tf-slim / Keras checkpoint names:
``scale`` -> ``gamma``, a norm's ``bias`` -> ``beta``, ``mean`` / ``var`` -> ``moving_mean`` / ``moving_variance``,
``kernel`` -> ``weights``; each alternative only where the name itself is not in the checkpoint. Flax keeps TF's
kernel layouts (Dense [in, out], Conv HWIO), so names are all that differ."""
