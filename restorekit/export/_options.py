"""What an export keeps (``weights_only``) and where each weight's value comes from (``ema``).

Both work on names alone (and, for object-based checkpoints, the object graph), before
anything is read, so a bad request fails before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

from restorekit._ema import is_shadow_name, keras_averages, scoped_shadows, shadow_suffix
from restorekit.errors import InvalidArgumentError
from restorekit._names import is_weight

__all__ = ["Selection", "select"]

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


@dataclass(frozen=True)
class Selection:
    """``names``: {output name: source name} in source order; ``dropped``: source names left out;
    ``fallback``: weights exported raw because ``ema`` found no shadow for them."""

    names: dict
    dropped: tuple = ()
    fallback: tuple = ()

    @property
    def identity(self) -> bool:
        return all(k == v for k, v in self.names.items())


def _state_names(names, graph) -> set:
    """What is not a weight among ``names`` (``names.entry_kind``): optimizer state, counters, RNG state."""
    by_key = graph.by_key if graph is not None else {}
    return {name for name in names if name != OBJECT_GRAPH_KEY
            and not is_weight(name, tracked=getattr(by_key.get(name), "kind", None))}


def select(names, *, graph=None, weights_only: bool = False, ema=None) -> Selection:
    """Which of ``names`` (source names, in order) an export writes, under which names.

    ``weights_only`` drops optimizer state (slots, Adam's beta powers, TF2 optimizer
    objects), ``global_step`` and ``save_counter``. ``ema`` (True, a shadow suffix, or an
    ``ExponentialMovingAverage``) writes each weight's moving average under the weight's
    own name and leaves the shadows out: TF1 shadows ``w/ExponentialMovingAverage``
    (also when saved under an extra scope, ``scope/w/ExponentialMovingAverage``), and
    Keras 3 ``use_ema`` averages (the optimizer's ``<path with _>_average`` variables).
    Weights without a shadow keep their raw values and are listed in ``fallback``.
    ``graph`` is the object graph of an object-based checkpoint (it says what each key is).

    Raises:
        InvalidArgumentError: ``ema`` given and the checkpoint holds no shadow at all.
    """
    names = list(names)
    state = _state_names(names, graph)
    mapping = {n: n for n in names}
    dropped: list[str] = []
    fallback: tuple = ()
    if ema is not None and ema is not False:
        shadows = _shadows(names, graph, state, ema)
        if not shadows:
            raise InvalidArgumentError(
                f"ema={ema!r}: the checkpoint holds no moving-average shadow (no '.../{shadow_suffix(ema)}' entry, "
                "no Keras 'use_ema' '_average' optimizer variable); export without ema"
            )
        used = set(shadows.values())
        for weight, shadow in shadows.items():
            mapping[weight] = shadow
        dropped += [n for n in names if n in used]
        is_weight = [n for n in names if n not in state and n not in used and n != OBJECT_GRAPH_KEY]
        fallback = tuple(n for n in is_weight if n not in shadows)
    if weights_only:
        dropped += [n for n in names if n in state and n not in dropped]
    gone = set(dropped)
    return Selection({k: v for k, v in mapping.items() if k not in gone}, tuple(n for n in names if n in gone), fallback)


def _shadows(names: list, graph, state: set, ema) -> dict:
    """{weight: its shadow entry}."""
    suffix = shadow_suffix(ema)
    present = set(names)
    found = {name[: -len(suffix) - 1]: name for name in names
             if is_shadow_name(name, suffix) and name[: -len(suffix) - 1] in present}
    for base, shadow in scoped_shadows(names, suffix).items():
        if base in present and base not in found and base not in state:
            found[base] = shadow
    found.update(keras_averages(names, graph))
    return found


@dataclass(frozen=True)
class OutputPlan:
    """Every tensor an export writes: ``names`` {output name: source name} in source order,
    ``transforms`` {output name: axis transform of ``restorekit.export._hf``}, what was left
    out and why, and the TF2 object graph's fate: ``graph`` is None when it is written as it
    was (or there is none), else the re-encoded graph (its keys renamed, dropped ones removed)."""

    names: dict
    transforms: dict
    dropped: tuple = ()
    fallback: tuple = ()
    renamed: str | None = None
    graph: bytes | None = None

    @property
    def identity(self) -> bool:
        """True when the output is the source, name for name, unchanged."""
        return not self.transforms and not self.dropped and all(k == v for k, v in self.names.items())

    def apply(self, name: str, array):
        """The source array of output ``name``, in the output's axes."""
        from restorekit.export._hf import TRANSFORMS

        transform = self.transforms.get(name)
        return array if transform is None else TRANSFORMS[transform][1](array)


def plan_output(shapes: dict, *, graph=None, graph_bytes=None, rules=None, weights_only: bool = False,
                ema=None) -> OutputPlan:
    """Plan an export of the tensors ``{source name: shape}`` (string tensors: any shape).

    ``graph`` is the source's decoded object graph, ``graph_bytes`` a function returning
    its raw bytes (read only when the graph must be re-encoded). ``rules``: a rule set
    (``restorekit.export._hf``, by name or object), or a rename rule (``(regex,
    replacement)`` pairs, a mapping or a callable, as ``CheckpointEditor.rename_all``).

    Raises:
        InvalidArgumentError, NameCollisionError: before anything is read.
    """
    selection = select(list(shapes), graph=graph, weights_only=weights_only, ema=ema)
    chosen = {out: src for out, src in selection.names.items() if out != OBJECT_GRAPH_KEY}
    final, transforms, dropped, renamed = _renamed(chosen, shapes, rules)
    names = {final[out]: src for out, src in chosen.items() if out in final}
    graph_out = None
    if OBJECT_GRAPH_KEY in shapes:
        key_map = {out: final[out] for out in chosen if out in final}
        gone = [k for k in shapes if k != OBJECT_GRAPH_KEY and k not in key_map]
        lost = [f"{k!r} -> {v!r}" for k, v in key_map.items() if "/.ATTRIBUTES/" in k and "/.ATTRIBUTES/" not in v]
        if rules is not None and not _is_pairs(rules):
            dropped[OBJECT_GRAPH_KEY] = "a rule set's names are not TF2 object keys"
        elif lost:
            dropped[OBJECT_GRAPH_KEY] = f"renames {', '.join(lost[:3])} drop the '/.ATTRIBUTES/' part TF2 keys need"
        else:
            if gone or any(k != v for k, v in key_map.items()):
                from restorekit._bundle.objectgraph import rewrite_keys

                graph_out = rewrite_keys(graph_bytes(), key_map, gone)
            names[OBJECT_GRAPH_KEY] = OBJECT_GRAPH_KEY
    left_out = tuple(selection.dropped) + tuple(n for n in dropped if n not in selection.dropped)
    return OutputPlan(names, {final[o]: t for o, t in transforms.items()}, left_out, selection.fallback, renamed,
                      graph_out)


def _is_pairs(rules) -> bool:
    from restorekit.export._hf import RuleSet

    return not isinstance(rules, (str, RuleSet))


def _renamed(chosen: dict, shapes: dict, rules) -> tuple[dict, dict, dict, str | None]:
    """({name: new name}, {name: transform}, {name: why dropped}, label) for the chosen names under ``rules``."""
    if rules is None:
        return {n: n for n in chosen}, {}, {}, None
    if _is_pairs(rules):
        from restorekit._names import apply_renames

        mapping = apply_renames(list(chosen), rules)
        return mapping, {}, {}, "rename rule"
    from restorekit.export._hf import rule_set

    ruleset = rule_set(rules)
    plan = ruleset.plan({out: shapes[src] for out, src in chosen.items()})
    return plan.names, plan.transforms, dict(plan.dropped), ruleset.name


def out_shape(plan: "OutputPlan", out: str, shape) -> tuple:
    from restorekit.export._hf import TRANSFORMS

    transform = plan.transforms.get(out)
    return tuple(shape) if transform is None else TRANSFORMS[transform][0](tuple(shape))
