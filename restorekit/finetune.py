"""Variable groups for fine-tuning: frozen scopes and per-group learning-rate multipliers.

``group_variables(rules, variables)`` puts every variable in exactly one group: the
first rule whose pattern takes its name (patterns as in ``restorekit.names``, the same
ones ``scan``'s include/exclude use), else the default group. A multiplier of ``0``
freezes a group. The same groups then drive every training style:

* TF1 graph mode, one optimizer: ``scale_gradients(grads_and_vars, groups)`` scales
  each gradient by its multiplier and drops frozen ones (tf-slim's
  ``multiply_gradients`` plus freezing). Note that for Adam-like optimizers a gradient
  multiplier is *not* a learning-rate multiplier: Adam divides it out again.
* TF1 graph mode, one optimizer per multiplier: ``GroupedOptimizer(factory, groups)``,
  where ``factory(multiplier)`` returns a ``tf.compat.v1.train.Optimizer`` already at
  that group's learning rate. This is a true learning-rate multiplier for any
  optimizer.
* Keras 3 (``model.fit`` or a custom train step): ``grouped_keras_optimizer(factory,
  groups)``, the same idea as a Keras optimizer whose state saves and restores with
  ``tf.train.Checkpoint``.

What Keras 3 offers natively, and why this module still exists: a Keras 3 optimizer
has one learning rate for all its variables; there is no per-variable multiplier.
``exclude_from_weight_decay`` only exempts variables from weight decay, and
``layer.trainable = False`` freezes whole layers but cannot slow them down.
``keras.optimizers.MultiOptimizer`` (in recent Keras 3 releases such as 3.15, absent
from older ones) maps variables to sub-optimizers, but its ``OptimizerMap`` patterns are full-match regexes on
``variable.path`` where two matching patterns are an error rather than an order, a
pattern that matches nothing passes silently (the backbone trains anyway), there is
no frozen group, and the Keras 3 that older TF 2.16+ installs bring lacks it. The
wrapper here uses the same groups as the TF1 path, so one set of rules and one
report serve both.

How a Keras 3 optimizer saves under ``tf.train.Checkpoint`` (TF 2.21, Keras 3.15,
checked by experiment): its state is tracked by position, ``optimizer/_variables/N``,
in the order of the variables it was built with, and the model variables it was
built with are saved again under ``optimizer/_trainable_variables/N``. Restoring
into an optimizer that is not built yet is deferred: the values land when ``build``
creates the variables. The wrapper therefore tracks each group's optimizer under a
stable attribute (``group_0``, ``group_1``, ... in group order) and builds it with its
group's variables in the model's order, so a rebuilt model restores into the same
slots.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import (
    GroupError,
    InvalidArgumentError,
    MissingDependencyError,
    NoMatchError,
    format_names,
)
from restorekit.names import PatternSet, closest_names, matches, strip_output_index, strip_partition
from restorekit.targets import is_keras_variable, is_partitioned, tf_variable, variable_name

__all__ = [
    "GroupedOptimizer",
    "VariableGroup",
    "VariableGroups",
    "group_variables",
    "grouped_keras_optimizer",
    "layerwise_decay",
    "scale_gradients",
]

DEFAULT_LAYER_PATTERN = r"(?:^|/)(?:layer_|block)(\d+)(?=[/_]|$)"
DEFAULT_EMBEDDINGS = (r".*embeddings",)


# ---------------------------------------------------------------- the groups


@dataclass(frozen=True)
class VariableGroup:
    """One group: the rule that formed it, its multiplier and its variables.

    ``rule`` is the pattern as given (a str or a compiled ``re.Pattern``), or None for
    the default group. ``parameters`` is None when a variable's shape is not fully known.
    """

    rule: object
    multiplier: float
    variables: tuple[str, ...]
    parameters: int | None

    @property
    def frozen(self) -> bool:
        return self.multiplier == 0

    @property
    def label(self) -> str:
        if self.rule is None:
            return "(default)"
        return repr(_rule_text(self.rule))


@dataclass(frozen=True)
class _Member:
    """A live variable in a group (never compared, printed or pickled)."""

    name: str
    variable: object  # the tf.Variable
    keras_variable: object  # the Keras variable it came from, or None
    group: int


@dataclass(frozen=True)
class VariableGroups:
    """Every variable in exactly one group. Build it with ``group_variables``.

    ``groups`` holds one group per rule, in rule order, then the default group when
    any variable fell through. The value part (names, multipliers, counts) compares,
    prints and pickles; the live variables behind ``trainable`` / ``frozen`` do not
    survive pickling.
    """

    groups: tuple[VariableGroup, ...]
    default: float
    _members: tuple[_Member, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        by_id = {}
        for m in self._members:
            by_id[id(m.variable)] = m
            if m.keras_variable is not None:
                by_id[id(m.keras_variable)] = m
        object.__setattr__(self, "_by_id", by_id)
        object.__setattr__(self, "_by_name", {m.name: m for m in self._members})
        object.__setattr__(
            self, "_group_of_name", {n: i for i, g in enumerate(self.groups) for n in g.variables}
        )

    def __getstate__(self):
        return {"groups": self.groups, "default": self.default}

    def __setstate__(self, state):
        object.__setattr__(self, "groups", state["groups"])
        object.__setattr__(self, "default", state["default"])
        object.__setattr__(self, "_members", ())
        self.__post_init__()

    def __iter__(self):
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def names(self) -> tuple[str, ...]:
        """Every variable name, in the order the variables were given."""
        return tuple(m.name for m in self._members) or tuple(
            n for g in self.groups for n in g.variables
        )

    @property
    def trainable(self) -> list:
        """The tf.Variables with a multiplier above 0, for ``minimize(var_list=...)``."""
        return self._live(frozen=False)

    @property
    def frozen(self) -> list:
        """The tf.Variables of frozen (multiplier 0) groups."""
        return self._live(frozen=True)

    @property
    def multipliers(self) -> tuple[float, ...]:
        """The distinct multipliers above 0, in group order (one optimizer each)."""
        seen = []
        for g in self.groups:
            if not g.frozen and g.multiplier not in seen:
                seen.append(g.multiplier)
        return tuple(seen)

    def multiplier(self, variable) -> float:
        """The learning-rate multiplier of ``variable`` (a variable or its name).

        Raises:
            GroupError: the variable is not in these groups.
        """
        if isinstance(variable, str):
            return self.groups[self._group_index_of_name(variable)].multiplier
        return self.groups[self._member(variable).group].multiplier

    @property
    def assignments(self) -> dict:
        """variable name -> the rule that took it (None: the default group), in input order."""
        return {name: self.rule_for(name) for name in self.names}

    def rule_for(self, variable_name: str):
        """The rule that took ``variable_name`` (None for the default group).

        Raises:
            GroupError: no variable of that name is in these groups.
        """
        return self.groups[self._group_index_of_name(variable_name)].rule

    def to_dict(self) -> dict:
        """A JSON-ready dict: the default multiplier and each group with its variables."""
        return {
            "default": self.default,
            "groups": [
                {
                    "rule": None if g.rule is None else _rule_text(g.rule),
                    "multiplier": g.multiplier,
                    "frozen": g.frozen,
                    "variables": list(g.variables),
                    "parameters": g.parameters,
                }
                for g in self.groups
            ],
        }

    def __str__(self) -> str:
        count = sum(len(g.variables) for g in self.groups)
        frozen = sum(g.frozen for g in self.groups)
        head = (
            f"restorekit: {count} variables in {len(self.groups)} groups "
            f"({len(self.groups) - frozen} trainable, {frozen} frozen)"
        )
        rows = [("group", "multiplier", "variables", "parameters", "names")]
        for g in self.groups:
            mult = "0 (frozen)" if g.frozen else f"{g.multiplier:g}"
            params = "?" if g.parameters is None else f"{g.parameters:,}"
            rows.append((g.label, mult, str(len(g.variables)), params, format_names(g.variables, limit=3)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head]
        for r in rows:
            lines.append(
                f"  {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}".rstrip()
            )
        return "\n".join(lines)

    # -- lookups used by the optimizers

    def _live(self, *, frozen: bool) -> list:
        if not self._members and self.groups:
            raise GroupError("these groups hold no live variables (they were unpickled); build them again")
        return [m.variable for m in self._members if self.groups[m.group].frozen == frozen]

    def _group_index_of_name(self, name: str) -> int:
        name = strip_output_index(name)
        if name in self._group_of_name:
            return self._group_of_name[name]
        for g_index, g in enumerate(self.groups):
            if any(strip_partition(n) == name for n in g.variables):
                return g_index
        near = closest_names(name, self._group_of_name)
        hint = f" Closest names: {format_names(near)}." if near else ""
        raise GroupError(f"variable {name!r} is not in these groups.{hint}")

    def _member(self, variable) -> _Member:
        member = self._by_id.get(id(variable))
        if member is not None:
            return member
        if not self._members and self.groups:
            raise GroupError("these groups hold no live variables (they were unpickled); build them again")
        name = _variable_name(variable)[0]
        known = self._by_name.get(name)
        if known is not None:
            raise GroupError(
                f"variable {name!r} is not the variable these groups were built with "
                f"(same name, another object{_graph_hint(known.variable, variable)}); "
                "build the groups from the variables you train"
            )
        near = closest_names(name, self._by_name)
        hint = f" Closest names: {format_names(near)}." if near else ""
        raise GroupError(f"variable {name!r} is not in these groups ({len(self._by_name)} variables).{hint}")


def _rule_text(rule) -> str:
    return rule.pattern if isinstance(rule, re.Pattern) else rule


def _graph_of(variable):
    try:
        return variable.graph
    except (AttributeError, RuntimeError):
        return None


def _graph_hint(known, given) -> str:
    a, b = _graph_of(known), _graph_of(given)
    if a is not None and b is not None and a is not b:
        return ", in another graph"
    return ""


def _check_multiplier(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what} must be a number >= 0 (0 freezes), got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"{what} must be a finite number >= 0 (0 freezes), got {value!r}")
    return value


def _variable_name(variable) -> tuple[str, object, object]:
    """(name, tf.Variable, Keras variable or None) of a TF1, TF2 or Keras 3 variable."""
    tf = import_tensorflow()

    if isinstance(variable, tf.Variable):
        return strip_output_index(variable.name), variable, None
    if is_keras_variable(variable) and isinstance(tf_variable(variable), tf.Variable):
        return variable_name(variable), tf_variable(variable), variable
    raise GroupError(
        f"cannot group {type(variable).__name__} {variable!r}: pass tf.Variables, "
        "PartitionedVariables, Keras variables, a Keras model or a tf.Module"
    )


def _collect(variables) -> list[tuple[str, str, object, object]]:
    """(name, name to match, tf.Variable, Keras variable) for every variable given."""
    tf = import_tensorflow()

    if variables is None:
        variables = tf.compat.v1.trainable_variables()
        if not variables:
            raise GroupError(
                "variables=None reads the default graph's trainable variables, and it has none; "
                "in TF2 pass a Keras model, a tf.Module or a list of variables"
            )
    elif hasattr(variables, "trainable_variables") and not isinstance(variables, (list, tuple)):
        variables = variables.trainable_variables
    elif is_partitioned(variables) or isinstance(variables, tf.Variable):
        variables = [variables]
    elif isinstance(variables, (str, bytes)) or not isinstance(variables, Iterable):
        raise GroupError(
            f"cannot group {type(variables).__name__} {variables!r}: pass a list of variables, "
            "a Keras model or a tf.Module"
        )

    found = []
    for v in variables:
        if is_partitioned(v):
            # Rules see the full name: every part of one variable must share a group.
            for part in v:
                name, tf_var, _ = _variable_name(part)
                found.append((name, v.name, tf_var, None))
        else:
            name, tf_var, keras_var = _variable_name(v)
            found.append((name, strip_partition(name) if keras_var is None else name, tf_var, keras_var))

    unique, seen, names = [], set(), {}
    for item in found:
        if id(item[2]) in seen:
            continue
        seen.add(id(item[2]))
        if item[0] in names:
            raise GroupError(
                f"two different variables are named {item[0]!r} (from two graphs or two models?); "
                "group the variables of one model at a time"
            )
        names[item[0]] = item
        unique.append(item)
    if not unique:
        raise GroupError("no variables to group")
    return unique


def _rule_pairs(rules) -> list[tuple[object, float]]:
    if rules is None:
        return []
    if isinstance(rules, Mapping):
        pairs = list(rules.items())
    elif isinstance(rules, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in rules):
        pairs = [tuple(p) for p in rules]
    else:
        raise InvalidArgumentError(
            f"rules must be a mapping (or list of pairs) from pattern to multiplier, got {rules!r}"
        )
    seen = set()
    checked = []
    for pattern, mult in pairs:
        if pattern in seen:
            raise InvalidArgumentError(f"group rule {_rule_text(pattern)!r} is given twice")
        seen.add(pattern)
        checked.append((pattern, _check_multiplier(mult, f"multiplier of rule {_rule_text(pattern)!r}")))
    return checked


def _num_parameters(variable) -> int | None:
    return variable.shape.num_elements()


def group_variables(rules, variables=None, *, default: float = 1.0) -> VariableGroups:
    """Put every variable in exactly one group by ordered rules.

    The first rule whose pattern takes a variable's name wins; overlapping rules are
    allowed and ``rule_for`` / the printed table show which one took each variable.
    Variables no rule takes go to the default group. Partitioned variables are matched
    by their full name, so all their parts share a group.

    Args:
        rules: ordered mapping (or list of pairs) from pattern to learning-rate
            multiplier; patterns follow ``restorekit.names.matches`` (a scope prefix or
            a regex from the start of the name; a compiled ``re.Pattern`` searches).
            ``0`` freezes.
        variables: None for the default graph's trainable variables (TF1); or a list
            of tf.Variables / PartitionedVariables / Keras variables, a Keras model or
            a tf.Module (their ``trainable_variables``). Keras variables are named by
            ``variable.path``.
        default: the multiplier of variables no rule takes.

    Returns:
        VariableGroups; ``print`` it for the table.

    Raises:
        NoMatchError: a rule takes no variable (lists the closest names).
        InvalidArgumentError: a multiplier is negative, not finite or not a number.
        GroupError: no variables, or two different variables share a name.

    Example:
        >>> groups = group_variables({"backbone": 0, "logits": 10.0})
        >>> train_op = opt.minimize(loss, var_list=groups.trainable)
    """
    pairs = _rule_pairs(rules)
    default = _check_multiplier(default, "default")
    found = _collect(variables)
    patterns = PatternSet([p for p, _ in pairs], what="group rule")
    index = {p: i for i, (p, _) in enumerate(pairs)}
    members_of = [[] for _ in range(len(pairs) + 1)]
    for name, match_name, tf_var, keras_var in found:
        pattern = patterns.first_match(match_name)
        members_of[len(pairs) if pattern is None else index[pattern]].append((name, tf_var, keras_var))
    for (pattern, _), used in zip(pairs, patterns.used):
        shadowed = [f[1] for f in found if not used and matches(pattern, f[1])]
        if shadowed:
            taker = patterns.first_match(shadowed[0])
            raise NoMatchError(
                f"group rule {_rule_text(pattern)!r} takes no variable: earlier rules took every name "
                f"it matches ({shadowed[0]!r} went to rule {_rule_text(taker)!r}); reorder or drop it",
                tuple(shadowed[:5]),
            )
    patterns.check_all_used(sorted({f[1] for f in found}))

    groups, members = [], []
    specs = [(p, m) for p, m in pairs] + [(None, default)]
    for (rule, mult), group_members in zip(specs, members_of):
        if not group_members:
            continue
        sizes = [_num_parameters(v) for _, v, _ in group_members]
        params = None if any(s is None for s in sizes) else sum(sizes)
        g_index = len(groups)
        groups.append(VariableGroup(rule, mult, tuple(n for n, _, _ in group_members), params))
        members.extend(_Member(n, v, k, g_index) for n, v, k in group_members)
    order = {id(f[2]): i for i, f in enumerate(found)}
    members.sort(key=lambda m: order[id(m.variable)])
    return VariableGroups(tuple(groups), default, tuple(members))


def layerwise_decay(
    variables,
    decay: float,
    *,
    num_layers: int | None = None,
    pattern: str = DEFAULT_LAYER_PATTERN,
    embeddings: Iterable = DEFAULT_EMBEDDINGS,
) -> dict:
    """Rules for layer-wise learning-rate decay (the BERT / ELECTRA fine-tuning recipe).

    A variable whose name carries a layer number ``i`` (``pattern``'s group; by default
    ``layer_3/`` or ``block3/`` / ``block3_conv1``) gets ``decay ** (num_layers - i)``:
    the top layer ``num_layers - 1`` gets ``decay``, lower layers less. Names without a
    layer number: those matching ``embeddings`` sit below the first layer and get
    ``decay ** (num_layers + 1)``; everything else (pooler, head) is left to the
    default group of ``group_variables`` (1.0 unless you say otherwise). Rules for
    layers come first, so ``layer_3/embeddings`` counts as layer 3.

    Args:
        variables: what ``group_variables`` accepts (None: the default graph's).
        decay: the per-layer factor, in (0, 1].
        num_layers: layers in the model; defaults to the highest layer number + 1.
        pattern: a regex searched in each name; its first ``(\\d+)`` group is the layer
            number.
        embeddings: patterns (``restorekit.names`` semantics) of the names below the
            first layer; default ones that match nothing are left out.

    Returns:
        An ordered dict of rules (compiled patterns for layers) for ``group_variables``.
        Put freeze rules before it, and leave frozen names out of ``embeddings`` (a
        shadowed rule is an error): ``group_variables({"bert/embeddings": 0,
        **layerwise_decay(v, 0.9, embeddings=())}, v)``.

    Raises:
        InvalidArgumentError: bad ``decay``, ``num_layers`` or ``pattern``, or a layer
            number at or above ``num_layers``.
        NoMatchError: no name carries a layer number, or an ``embeddings`` pattern you
            gave matches nothing.
    """
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 < float(decay) <= 1:
        raise InvalidArgumentError(f"decay must be a number in (0, 1], got {decay!r}")
    decay = float(decay)
    if not isinstance(pattern, str):
        raise InvalidArgumentError(f"pattern must be a str regex with one '(\\d+)' group, got {pattern!r}")
    if "(\\d+)" not in pattern:
        raise InvalidArgumentError(f"pattern {pattern!r} must hold one '(\\d+)' group: the layer number")
    try:
        layer_re = re.compile(pattern.replace("(\\d+)", "(?P<restorekit_layer>\\d+)", 1))
    except re.error as e:
        raise InvalidArgumentError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None

    names = [f[1] for f in _collect(variables)]
    layers = sorted({int(m.group("restorekit_layer")) for m in map(layer_re.search, names) if m})
    if not layers:
        near = closest_names("layer_0", names)
        raise NoMatchError(
            f"no variable name carries a layer number matching {pattern!r} among {len(names)} names"
            + (f". Closest names: {format_names(near)}." if near else "."),
            near,
        )
    if num_layers is None:
        num_layers = layers[-1] + 1
    elif isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or num_layers < 1:
        raise InvalidArgumentError(f"num_layers must be a positive int, got {num_layers!r}")
    num_layers = int(num_layers)
    if layers[-1] >= num_layers:
        raise InvalidArgumentError(
            f"layer number {layers[-1]} is not below num_layers={num_layers}; layers count from 0"
        )

    rules = {}
    for i in layers:
        # Digits are literal in a regex, so the number can stand in for its group.
        rules[re.compile(pattern.replace("(\\d+)", str(i), 1))] = decay ** (num_layers - i)
    given = embeddings is not DEFAULT_EMBEDDINGS
    if isinstance(embeddings, (str, re.Pattern)):
        embeddings = [embeddings]
    elif embeddings is not None and not isinstance(embeddings, Iterable):
        raise InvalidArgumentError(f"embeddings is a pattern or a list of patterns, got {embeddings!r}")
    embeddings = list(embeddings or ())
    for emb in embeddings:
        patterns = PatternSet([emb], what="embeddings pattern")
        if any(patterns.first_match(n) for n in names):
            rules[emb] = decay ** (num_layers + 1)
        elif given:
            patterns.check_all_used(names)
    return rules


# ---------------------------------------------------------------- TF1 graph mode


def scale_gradients(grads_and_vars, groups: VariableGroups) -> list:
    """Scale each gradient by its group's multiplier; drop frozen ones.

    ``IndexedSlices`` stay sparse (only their values are scaled). A multiplier of 1 is
    left as is. ``None`` gradients are handled as tf-slim's ``multiply_gradients``
    does: an error where a multiplier was asked for (a variable a rule took, or the
    default group when ``default`` is not 1), passed through otherwise; frozen
    variables are dropped whatever their gradient.

    Args:
        grads_and_vars: (gradient, variable) pairs, e.g. from ``compute_gradients``.
        groups: from ``group_variables`` over these variables.

    Returns:
        A list of (gradient, variable) pairs for ``apply_gradients``.

    Raises:
        GroupError: a variable the groups do not know (or from another graph).
        InvalidArgumentError: a ``None`` gradient where a multiplier was asked for.
    """
    tf = import_tensorflow()

    if not isinstance(groups, VariableGroups):
        raise GroupError(f"groups must come from group_variables, got {type(groups).__name__}")
    pairs = list(grads_and_vars)
    resolved = [(grad, var, groups.groups[groups._member(var).group]) for grad, var in pairs]
    scaled = []
    for grad, var, group in resolved:
        if group.frozen:
            continue
        asked = group.rule is not None or group.multiplier != 1.0
        if grad is None:
            if asked:
                raise InvalidArgumentError(
                    f"variable {_variable_name(var)[0]!r} has no gradient, but group {group.label} "
                    f"asks for multiplier {group.multiplier:g}; is it connected to the loss?"
                )
            scaled.append((grad, var))
            continue
        if group.multiplier != 1.0:
            if isinstance(grad, tf.IndexedSlices):
                values = grad.values * tf.constant(group.multiplier, dtype=grad.values.dtype)
                grad = tf.IndexedSlices(values, grad.indices, grad.dense_shape)
            else:
                grad = grad * tf.constant(group.multiplier, dtype=grad.dtype)
        scaled.append((grad, var))
    return scaled


def _make_grouped_optimizer_class():
    tf = import_tensorflow()

    class GroupedOptimizer(tf.compat.v1.train.Optimizer):
        """One TF1 optimizer per multiplier; one train op for all of them.

        ``optimizer_factory(multiplier)`` returns a ``tf.compat.v1.train.Optimizer``
        already at that group's learning rate (gradients are not scaled again). Groups
        with the same multiplier share one optimizer; frozen groups get none. Each
        optimizer keeps the name the factory gave it, so slot variables are named as a
        single optimizer would name them (``dense/kernel/Momentum``): a variable is in
        one group only, so the names cannot collide, a rebuilt graph gets the same
        names, and checkpoints move between grouped and ungrouped training. Non-slot
        state (Adam's ``beta1_power``) gets ``_1``, ``_2``... in multiplier order.

        ``apply_gradients`` increments ``global_step`` once, after every update.

        Args:
            optimizer_factory: ``multiplier -> tf.compat.v1.train.Optimizer``.
            groups: from ``group_variables``.
            name: the name of the final ops.

        Raises:
            InvalidArgumentError: the factory returns no TF1 optimizer, or the same
                one for two multipliers.
            GroupError: ``groups`` is not from ``group_variables``, or was built for
                another graph than the default one.

        Example:
            >>> opt = GroupedOptimizer(lambda m: tf1.train.MomentumOptimizer(0.01 * m, 0.9), groups)
            >>> train_op = opt.minimize(loss, global_step=tf1.train.get_or_create_global_step())
        """

        def __init__(self, optimizer_factory: Callable, groups: VariableGroups, *, name: str = "GroupedOptimizer"):
            if not isinstance(groups, VariableGroups):
                raise GroupError(f"groups must come from group_variables, got {type(groups).__name__}")
            if not tf.executing_eagerly() and groups._members:
                graph = _graph_of(groups._members[0].variable)
                if graph is not None and graph is not tf.compat.v1.get_default_graph():
                    raise GroupError(
                        "these groups were built from the variables of another graph; "
                        "build the groups after building this graph"
                    )
            super().__init__(use_locking=False, name=name)
            self.groups = groups
            self.optimizers = _build_optimizers(
                optimizer_factory, groups, tf.compat.v1.train.Optimizer, "tf.compat.v1.train.Optimizer"
            )

        def compute_gradients(self, loss, var_list=None, **kwargs):
            """Gradients of ``loss`` for ``var_list``, by default the groups' trainable variables."""
            if var_list is None:
                var_list = self.groups.trainable
            return super().compute_gradients(loss, var_list=var_list, **kwargs)

        def apply_gradients(self, grads_and_vars, global_step=None, name=None):
            """Apply each gradient with its group's optimizer; one op, one global_step increment.

            Raises:
                GroupError: a variable the groups do not know (or from another graph).
                InvalidArgumentError: no gradient for any trainable variable.
            """
            pairs = list(grads_and_vars)
            buckets = {m: [] for m in self.optimizers}
            seen = []
            for grad, var in pairs:
                mult = self.groups.groups[self.groups._member(var).group].multiplier
                seen.append(_variable_name(var)[0])
                if mult != 0 and grad is not None:
                    buckets[mult].append((grad, var))
            if not any(buckets.values()):
                raise InvalidArgumentError(
                    f"no gradients for any trainable variable among {format_names(seen)}; "
                    "is the loss connected to them?"
                )
            updates = [
                self.optimizers[m].apply_gradients(bucket) for m, bucket in buckets.items() if bucket
            ]
            if global_step is None:
                op = tf.group(*updates, name=name or self.get_name())
            else:
                # assign_add lands on global_step's device by itself (ref ops and
                # resource ops are placed with their variable).
                with tf.control_dependencies(updates):
                    op = tf.compat.v1.assign_add(global_step, 1, name=name or self.get_name()).op
            if not tf.executing_eagerly():
                train_ops = tf.compat.v1.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
                if op not in train_ops:
                    train_ops.append(op)
            return op

        def get_slot(self, var, name):
            """The slot ``name`` of ``var`` from its group's optimizer (None when frozen)."""
            mult = self.groups.groups[self.groups._member(var).group].multiplier
            return None if mult == 0 else self.optimizers[mult].get_slot(var, name)

        def get_slot_names(self):
            return sorted({n for opt in self.optimizers.values() for n in opt.get_slot_names()})

        def variables(self):
            """Every optimizer's variables (slots and non-slot state), in multiplier order."""
            return [v for opt in self.optimizers.values() for v in opt.variables()]

    GroupedOptimizer.__module__ = __name__
    return GroupedOptimizer


def _build_optimizers(factory, groups: VariableGroups, base, what: str) -> dict:
    if not callable(factory):
        raise InvalidArgumentError(f"optimizer_factory must be callable (multiplier -> optimizer), got {factory!r}")
    if not groups.multipliers:
        raise GroupError(f"every group is frozen, so there is nothing to optimize:\n{groups}")
    optimizers = {}
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


# ---------------------------------------------------------------- Keras 3


def _make_keras_optimizer_class():
    import keras

    if int(keras.__version__.split(".")[0]) < 3:
        raise MissingDependencyError(
            f"grouped_keras_optimizer needs Keras 3 (found {keras.__version__}); "
            "TensorFlow 2.16+ brings it: pip install 'restorekit[tf]'"
        )

    class KerasGroupedOptimizer(keras.optimizers.Optimizer):
        """A Keras 3 optimizer holding one optimizer per multiplier; see ``grouped_keras_optimizer``."""

        def __init__(self, optimizer_factory, groups: VariableGroups, *, name: str | None = None):
            if not isinstance(groups, VariableGroups):
                raise GroupError(f"groups must come from group_variables, got {type(groups).__name__}")
            super().__init__(learning_rate=0.0, name=name)
            optimizers = _build_optimizers(optimizer_factory, groups, keras.optimizers.Optimizer, "Keras optimizer")
            factors = {opt.loss_scale_factor for opt in optimizers.values()}
            if len(factors) > 1:
                raise InvalidArgumentError(
                    f"the group optimizers have different loss_scale_factor values {sorted(factors)}; "
                    "give them one"
                )
            self.loss_scale_factor = factors.pop() if factors else None
            self._groups = groups
            self._multiplier_list = list(optimizers)
            for i, opt in enumerate(optimizers.values()):
                # A stable attribute per optimizer is its stable checkpoint key.
                setattr(self, f"group_{i}", opt)

        @property
        def group_optimizers(self) -> dict:
            """multiplier -> the optimizer that applies it."""
            # Not named ``optimizers``: Keras callbacks (LearningRateScheduler,
            # ReduceLROnPlateau) take any optimizer with that attribute for a
            # MultiOptimizer and set each sub-optimizer's rate on its own, which would
            # give every group the schedule's value and erase the multipliers.
            return {m: getattr(self, f"group_{i}") for i, m in enumerate(self._multiplier_list)}

        @property
        def learning_rates(self) -> dict:
            """multiplier -> that optimizer's current learning rate (a float)."""
            return {
                m: float(keras.ops.convert_to_numpy(opt.learning_rate)) for m, opt in self.group_optimizers.items()
            }

        @property
        def learning_rate(self):
            """The base rate (a scalar tensor): the 1x group's rate, else the first group's rate / its multiplier."""
            mult = 1.0 if 1.0 in self._multiplier_list else self._multiplier_list[0]
            return keras.ops.divide(self.group_optimizers[mult].learning_rate, mult)

        @learning_rate.setter
        def learning_rate(self, value):
            if isinstance(value, bool) or not (
                isinstance(value, numbers.Real) or isinstance(value, keras.Variable) or keras.ops.is_tensor(value)
            ):
                raise InvalidArgumentError(
                    f"learning_rate must be a number or a scalar tensor (the base rate), got {value!r}; "
                    "to schedule it, give each group's optimizer a schedule in optimizer_factory"
                )
            if isinstance(value, numbers.Real) and not (math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"learning_rate must be a finite number >= 0, got {value!r}")
            optimizers = self.group_optimizers
            # Check every group before setting any, so a refusal changes nothing.
            scheduled = [m for m, opt in optimizers.items() if not isinstance(opt.learning_rate, keras.Variable)]
            if scheduled:
                which = ", ".join(f"{m:g}x" for m in scheduled)
                raise InvalidArgumentError(
                    f"cannot set learning_rate: the optimizer of the {which} group"
                    f"{' has' if len(scheduled) == 1 else 's have'} a learning-rate schedule (or callable), "
                    "whose rate cannot be set, as Keras refuses for one optimizer. Nothing was changed; "
                    "give every group a float rate in optimizer_factory to make it settable"
                )
            for mult, opt in optimizers.items():
                if isinstance(value, numbers.Real):
                    opt.learning_rate = float(value) * mult
                else:
                    opt.learning_rate = keras.ops.multiply(keras.ops.cast(value, opt.learning_rate.dtype), mult)

        @property
        def variables(self):
            return self._variables[:] + [v for opt in self.group_optimizers.values() for v in opt.variables]

        def _split(self, variables) -> dict:
            split = {m: [] for m in self._multiplier_list}
            for v in variables:
                mult = self._groups.groups[self._groups._member(v).group].multiplier
                if mult != 0:
                    split[mult].append(v)
            return split

        def build(self, variables):
            if self.built:
                return
            variables = list(variables)
            for mult, group_vars in self._split(variables).items():
                if group_vars:
                    self.group_optimizers[mult].build(group_vars)
            super().build(variables)

        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            if not grads:
                return
            if trainable_variables is None:
                if not self.built:
                    raise InvalidArgumentError("pass trainable_variables on the first apply (or call build first)")
                trainable_variables = self._trainable_variables
            trainable_variables = list(trainable_variables)
            if not self.built:
                self.build(trainable_variables)
            by_mult = {m: ([], []) for m in self._multiplier_list}
            for grad, var in zip(grads, trainable_variables):
                mult = self._groups.groups[self._groups._member(var).group].multiplier
                if mult != 0:
                    by_mult[mult][0].append(grad)
                    by_mult[mult][1].append(var)
            optimizers = self.group_optimizers
            for mult, (g, v) in by_mult.items():
                if v:
                    optimizers[mult].apply(g, v)
            self._iterations.assign_add(1)

        def finalize_variable_values(self, var_list):
            for mult, group_vars in self._split(var_list).items():
                if group_vars:
                    self.group_optimizers[mult].finalize_variable_values(group_vars)

        def get_config(self):
            raise NotImplementedError(
                "a grouped optimizer holds live variable groups and cannot be serialized to a config; "
                "save its state with tf.train.Checkpoint and rebuild it in code"
            )

    KerasGroupedOptimizer.__module__ = __name__
    return KerasGroupedOptimizer


_CLASSES: dict[str, type] = {}
_MAKERS = {"GroupedOptimizer": _make_grouped_optimizer_class, "KerasGroupedOptimizer": _make_keras_optimizer_class}


def __getattr__(name: str):
    # The optimizer classes subclass TF and Keras classes; build them on first use so
    # that importing restorekit imports neither.
    if name in _MAKERS:
        if name not in _CLASSES:
            _CLASSES[name] = _MAKERS[name]()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def grouped_keras_optimizer(optimizer_factory, groups: VariableGroups, *, name: str | None = None):
    """A Keras 3 optimizer applying each group's own optimizer; drop it into ``compile``.

    ``optimizer_factory(multiplier)`` returns a Keras optimizer already at that group's
    learning rate; groups with one multiplier share it, frozen groups get none (their
    gradients are dropped). Works with ``model.fit`` and in a custom train step
    (``opt.apply(grads, model.trainable_variables)``). Its state, each group's slots
    included, saves and restores with ``tf.train.Checkpoint(optimizer=opt)``; restoring
    before the first step is fine (Keras defers it to ``build``). Clipping options
    (``global_clipnorm``...) act per group.

    ``learning_rate`` is one base rate, so ``LearningRateScheduler`` and
    ``ReduceLROnPlateau`` work and keep the ratios between groups. Reading it gives the
    rate of the 1x group, or with no 1x group the first group's rate divided by its
    multiplier (a scalar tensor, as Keras gives). Assigning a number sets every group to
    number × multiplier, so a factory whose rates do not follow the multipliers loses
    its own ratios at the first assignment; ``ReduceLROnPlateau``'s ``min_lr`` bounds the
    base rate. If any group's optimizer has a ``LearningRateSchedule``, assigning
    raises and changes nothing, as Keras raises for one optimizer with a schedule.
    ``learning_rates`` reads each group's rate and ``group_optimizers`` holds the
    optimizers by multiplier (not named ``optimizers``: Keras callbacks would take that
    for a ``MultiOptimizer`` and set each group on its own). Under ``tf.distribute`` (tested
    with MirroredStrategy), create it inside ``strategy.scope()`` as any Keras optimizer,
    and in a custom ``strategy.run`` step call ``opt.build(model.trainable_variables)``
    in the scope first.

    Args:
        optimizer_factory: ``multiplier -> keras.optimizers.Optimizer``.
        groups: from ``group_variables(rules, model)``.
        name: the optimizer's name.

    Returns:
        A ``restorekit.finetune.KerasGroupedOptimizer`` (a ``keras.optimizers.Optimizer``).

    Raises:
        InvalidArgumentError: the factory returns no Keras optimizer, or one twice; on
            assigning ``learning_rate``, a value that is not a number >= 0 or a scalar
            tensor, or a group whose optimizer has a schedule.
        GroupError: at build or apply, a variable the groups do not know.
        MissingDependencyError: Keras 2 is installed instead of Keras 3.

    Example:
        >>> groups = group_variables({"net/backbone": 0, "net/head": 10.0}, model)
        >>> model.compile(grouped_keras_optimizer(lambda m: keras.optimizers.Adam(1e-4 * m), groups), "mse")
    """
    return __getattr__("KerasGroupedOptimizer")(optimizer_factory, groups, name=name)
