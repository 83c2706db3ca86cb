"""TF2 and Keras 3: object-graph readable paths, trackable matching, naming rules, eager restore."""

from __future__ import annotations

import re
from collections import deque
from typing import Mapping

from restorekit._tensorflow import import_tensorflow
from restorekit.bundle.objectgraph import ObjectGraph, TrackedVariable, decode_object_graph
from restorekit.errors import (
    IncompleteRestoreError,
    InvalidArgumentError,
    NoMatchError,
    format_names,
)
from restorekit.names import compile_pairs, optimizer_slot_kind
from restorekit.targets import tf_variable

__all__ = [
    "KERAS_FROM_TF1",
    "ObjectGraph",
    "Rules",
    "TrackedVariable",
    "decode_object_graph",
    "object_graph_keys",
    "restore",
]

# ------------------------------------------------------------------ live objects

def is_trackable(obj) -> bool:
    """True for a Keras model or layer, a tf.Module or another trackable root (not a variable)."""
    return hasattr(obj, "_trackable_children") and not hasattr(obj, "assign")


def _walk_live(root, graph: ObjectGraph, start: int) -> dict[int, str]:
    """id(live variable) -> checkpoint key, walking the live object and the graph in step."""
    tf = import_tensorflow()

    found: dict[int, str] = {}
    seen = {start}
    queue = deque([(root, start)])
    while queue:
        obj, node_id = queue.popleft()
        node = graph.nodes[node_id]
        for _, _, key in node.attributes:
            if key and hasattr(obj, "assign"):
                found.setdefault(id(obj), key)
                found.setdefault(id(tf_variable(obj)), key)
        if not node.children:
            continue
        try:
            children = tf.train.TrackableView(obj).children(obj)
        except Exception:  # a trackable whose children need a save context; nothing to match there
            continue
        for child_id, local in node.children:
            if child_id in seen or local not in children:
                continue
            seen.add(child_id)
            queue.append((children[local], child_id))
    return found


def live_paths(root) -> dict[int, str]:
    """id(variable) -> attribute path from ``root`` (``encoder/w``), the shortest, as checkpoints name them."""
    tf = import_tensorflow()

    paths: dict[int, str] = {}
    seen = {id(root)}
    queue = deque([(root, "")])
    while queue:
        obj, path = queue.popleft()
        try:
            children = tf.train.TrackableView(obj).children(obj)
        except Exception:  # a trackable whose children need a save context; it holds no plain variables
            continue
        for local, child in children.items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            here = f"{path}/{local}" if path else local
            if hasattr(child, "assign"):
                paths[id(child)] = here
                paths.setdefault(id(tf_variable(child)), here)
            else:
                queue.append((child, here))
    return paths


def object_graph_keys(root, graph: ObjectGraph, variables) -> dict[int, str]:
    """Match a live trackable to a checkpoint's object graph, as ``tf.train.Checkpoint`` does.

    The checkpoint's root, and each of its children (``model`` in
    ``tf.train.Checkpoint(model=...)``), is tried as the counterpart of ``root``;
    the one that reaches the most of ``variables`` wins.

    Returns:
        ``id(variable) -> checkpoint key`` for the variables matched.
    """
    wanted = {id(v) for v in variables} | {id(tf_variable(v)) for v in variables}
    best: dict[int, str] = {}
    for start in [0] + [child for child, _ in graph.nodes[0].children]:
        found = _walk_live(root, graph, start)
        hits = {k: v for k, v in found.items() if k in wanted}
        if len(hits) > len(best):
            best = hits
    return best


# ------------------------------------------------------------------ naming rules

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


# ------------------------------------------------------------------ eager restore

def _components(handle) -> list:
    """Every copy of a variable: the replicas of a distributed variable, else itself."""
    values = getattr(handle, "values", None)
    if isinstance(values, tuple) and values:
        return list(values)
    return [handle]


def read_tensors(prefix: str, names: list[str], dtypes: list[str], *, batch_bytes: int = 1 << 30, sizes=None):
    """Read checkpoint tensors with ``tf.raw_ops.RestoreV2``, many per call (eager).

    Batching keeps the op count low (one call for a BERT-base checkpoint) while
    ``batch_bytes`` bounds the memory held at once.
    """
    tf = import_tensorflow()

    out = []
    start = 0
    while start < len(names):
        stop, total = start, 0
        while stop < len(names) and (stop == start or total + (sizes[stop] if sizes else 0) <= batch_bytes):
            total += sizes[stop] if sizes else 0
            stop += 1
        with tf.device("/cpu:0"):
            out.extend(
                tf.raw_ops.RestoreV2(
                    prefix=prefix,
                    tensor_names=names[start:stop],
                    shape_and_slices=[""] * (stop - start),
                    dtypes=[tf.as_dtype(d) for d in dtypes[start:stop]],
                )
            )
        start = stop
    return out


def _nbytes(record) -> int:
    import numpy as np

    size = int(np.prod(record.checkpoint_shape, dtype=np.int64)) if record.checkpoint_shape else 1
    try:
        return size * np.dtype(record.checkpoint_dtype).itemsize
    except TypeError:
        return size * 4


def restore(report, *, strict: bool = False):
    """Assign the matched variables from the checkpoint, in eager mode (TF2, Keras 3).

    Reads every plain match with batched ``RestoreV2`` calls, computes the values of
    records restored through a shape policy or a ``VocabRemap``, checks them all,
    and only then assigns. Distributed (MirroredStrategy) variables are assigned on
    every replica.

    Args:
        report: from ``restorekit.scan`` over a Keras model, tf.Module or TF2 variables.
        strict: raise IncompleteRestoreError when anything is missing or mismatched.

    Returns:
        The report, for chaining.

    Raises:
        InvalidArgumentError: not executing eagerly, nothing matched, the report lost
            its variables, or a policy returned a value of the wrong shape.
        IncompleteRestoreError: ``strict`` and the report is incomplete.

    Example:
        >>> report = restorekit.scan('ckpt/', model, shape_policy='slice_or_pad')
        >>> restorekit.restore(report)
    """
    tf = import_tensorflow()

    from restorekit import remap
    from restorekit.report import live_handles

    if not tf.executing_eagerly():
        raise InvalidArgumentError(
            "restorekit.restore assigns eagerly; in graph mode use restorekit.warm_start(report) "
            "or restorekit.partial_saver(report)"
        )
    live_handles(report)
    if strict and not report.is_complete:
        raise IncompleteRestoreError(report.incomplete_message(), report)
    if not report.matched:
        raise InvalidArgumentError(f"nothing in {report.checkpoint!r} matched; there is nothing to restore\n{report}")
    handles = report._handles
    policies = report._policies or {}
    records = list(report.matched)
    keys = sorted({r.checkpoint_name for r in records})
    dtype_of = {r.checkpoint_name: r.checkpoint_dtype for r in records}
    size_of = {r.checkpoint_name: _nbytes(r) for r in records}
    tensors = dict(
        zip(keys, read_tensors(report.checkpoint, keys, [dtype_of[k] for k in keys], sizes=[size_of[k] for k in keys]))
    )
    values = []
    for r in records:
        handle = handles[r.variable_name]
        value = tensors[r.checkpoint_name]
        if r.variable_name in policies:
            value = remap.eager_value(policies[r.variable_name], r, value, handle)
        values.append((handle, value))
    for handle, value in values:
        for component in _components(handle):
            component.assign(value, read_value=False)
    return report

