"""Variable groups: every variable in exactly one group, each with a learning-rate multiplier.

``group_variables(rules, variables)`` puts every variable in exactly one group: the
first rule whose pattern takes its name (patterns as in ``restorekit._names``, the same
ones ``scan``'s include/exclude use), else the default group. A multiplier of ``0``
freezes a group. ``VariableGroups.group_of`` answers which group a variable is in;
gradient scaling and the grouped optimizers all ask it. ``layerwise_decay`` writes
the rules of layer-wise learning-rate decay.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import GroupError, InvalidArgumentError, NoMatchError, UnknownVariableError, format_names
from restorekit._names import PatternSet, matches, pattern_hint, strip_output_index, strip_partition
from restorekit._targets import is_keras_variable, is_partitioned, tf_variable, variable_name
from restorekit._flax_target import is_flax_module, is_flax_variable, module_variables
from restorekit._torch_target import is_torch_module, is_torch_tensor
from restorekit._trackables import is_trackable, keras_backend, layer_paths

__all__ = [
    "DEFAULT_EMBEDDINGS",
    "DEFAULT_LAYER_PATTERN",
    "VariableGroup",
    "VariableGroups",
    "group_variables",
    "layerwise_decay",
]

DEFAULT_LAYER_PATTERN = r"(?:^|/)(?:layer_|block)(\d+)(?=[/_]|$)"
DEFAULT_EMBEDDINGS = (r".*embeddings",)


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
    # Lookups derived from the fields above by __post_init__ (and again after unpickling).
    _by_id: dict[int, _Member] = field(init=False, repr=False, compare=False)
    _by_name: dict[str, _Member] = field(init=False, repr=False, compare=False)
    _group_of_name: dict[str, int] = field(init=False, repr=False, compare=False)

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

    def group_of(self, variable) -> VariableGroup:
        """The group ``variable`` is in: a live variable, or a variable name.

        A live variable is looked up by identity (the one these groups were built
        with), a name by name (``:0`` and partition suffixes aside), which works on
        unpickled groups too. Every other lookup asks this one.

        Raises:
            GroupError: the variable is not in these groups, or is another object of
                the same name (another graph or model).
        """
        if isinstance(variable, str):
            return self.groups[self._group_index_of_name(variable)]
        return self.groups[self._member(variable).group]

    def multiplier(self, variable) -> float:
        """The learning-rate multiplier of ``variable`` (a variable or its name).

        Raises:
            GroupError: the variable is not in these groups.
        """
        return self.group_of(variable).multiplier

    @property
    def assignments(self) -> dict:
        """variable name -> the rule that took it (None: the default group), in input order."""
        return {name: self.rule_for(name) for name in self.names}

    def rule_for(self, variable_name: str):
        """The rule that took ``variable_name`` (None for the default group).

        Raises:
            GroupError: no variable of that name is in these groups.
        """
        return self.group_of(variable_name).rule

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

    # -- the lookups behind group_of

    def _live(self, *, frozen: bool) -> list:
        self._check_live()
        return [m.variable for m in self._members if self.groups[m.group].frozen == frozen]

    def _check_live(self) -> None:
        if not self._members and self.groups:
            raise GroupError("these groups hold no live variables (they were unpickled); build them again")

    def _group_index_of_name(self, name: str) -> int:
        name = strip_output_index(name)
        if name in self._group_of_name:
            return self._group_of_name[name]
        for g_index, g in enumerate(self.groups):
            if any(strip_partition(n) == name for n in g.variables):
                return g_index
        raise UnknownVariableError(
            f"variable {name!r} is not in these groups.", name=name, candidates=self._group_of_name
        )

    def _member(self, variable) -> _Member:
        member = self._by_id.get(id(variable))
        if member is not None:
            return member
        self._check_live()
        name = _variable_name(variable)[0]
        known = self._by_name.get(name)
        if known is not None:
            raise GroupError(
                f"variable {name!r} is not the variable these groups were built with "
                f"(same name, another object{_graph_hint(known.variable, variable)}); "
                "build the groups from the variables you train"
            )
        raise UnknownVariableError(
            f"variable {name!r} is not in these groups ({len(self._by_name)} variables).",
            name=name,
            candidates=self._by_name,
        )


def check_groups(groups) -> VariableGroups:
    """``groups`` itself, or GroupError when it does not come from ``group_variables``."""
    if not isinstance(groups, VariableGroups):
        raise GroupError(f"groups must come from group_variables, got {type(groups).__name__}")
    return groups


def check_default_graph(groups: VariableGroups) -> None:
    """Raise GroupError when, in graph mode, ``groups`` holds variables of another graph than the default one."""
    tf = import_tensorflow()

    if tf.executing_eagerly() or not groups._members:
        return
    graph = _graph_of(groups._members[0].variable)
    if graph is not None and graph is not tf.compat.v1.get_default_graph():
        raise GroupError(
            "these groups were built from the variables of another graph; build the groups after building this graph"
        )


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
    if is_keras_variable(variable) and keras_backend(variable) != "tensorflow":
        return variable_name(variable), variable, variable  # JAX, torch backends: the Keras variable is the variable
    if is_torch_tensor(variable) or is_flax_variable(variable):
        raise GroupError(f"{type(variable).__name__} variables are grouped by name: pass the torch.nn.Module or Flax "
                         "nnx.Module that holds them (or the variable's name)")
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
    if is_torch_module(variables):  # a torch module's parameters, by their state_dict names (tied ones once)
        return _unique([(name, name, p, None) for name, p in variables.named_parameters()])
    if is_flax_module(variables):  # a Flax module's nnx.Params, by their paths ('layers/0/kernel'), shared ones once
        return _unique([(name, name, p, None) for name, p, _ in module_variables(variables, params_only=True)])
    if variables is None:
        variables = import_tensorflow().compat.v1.trainable_variables()
        if not variables:
            raise GroupError(
                "variables=None reads the default graph's trainable variables, and it has none; "
                "in TF2 pass a Keras model, a tf.Module or a list of variables"
            )
    elif hasattr(variables, "trainable_variables") and not isinstance(variables, (list, tuple)):
        variables = variables.trainable_variables
    elif is_partitioned(variables) or _is_one_tf_variable(variables):
        variables = [variables]
    elif isinstance(variables, (str, bytes)) or not isinstance(variables, Iterable):
        raise GroupError(
            f"cannot group {type(variables).__name__} {variables!r}: pass a list of variables, "
            "a Keras model or a tf.Module"
        )

    found: list[tuple[str, str, object, object]] = []  # (name, name rules see, tf.Variable, Keras variable or None)
    for v in variables:
        if is_partitioned(v):
            # Rules see the full name: every part of one variable must share a group.
            for part in v:
                name, tf_var, _ = _variable_name(part)
                found.append((name, v.name, tf_var, None))
        else:
            name, tf_var, keras_var = _variable_name(v)
            found.append((name, strip_partition(name) if keras_var is None else name, tf_var, keras_var))
    return _unique(found)


def _is_one_tf_variable(obj) -> bool:
    if not type(obj).__module__.startswith("tensorflow"):
        return False  # no TensorFlow import for a model or list on another backend
    return isinstance(obj, import_tensorflow().Variable)


def _unique(found: list) -> list:
    """``found`` without repeats of one variable; GroupError for two variables of one name, or none."""
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
    shape = variable.shape
    if hasattr(shape, "num_elements"):  # a TensorShape, maybe partly unknown
        return shape.num_elements()
    return math.prod(shape)  # Keras (any backend) and torch shapes are known


def _names_to_match(variables, found) -> dict:
    """id(tf.Variable) -> the names rules are matched against: its own, then its path through the model.

    Keras 3 names a variable ``d1/kernel`` even inside a nested model ``backbone``; the
    path through the model's layers (``backbone/d1/kernel``) lets a rule name the nested
    model. A tf.Module's variables get their attribute path (``encoder/w``) the same way.
    """
    if is_torch_module(variables):
        # state_dict names are dotted; patterns end at a '/' boundary, so they also see 'stem/weight'
        return {id(p): (name, name.replace(".", "/")) for _, name, p, _ in found}
    paths = layer_paths(variables) if is_trackable(variables) else {}
    names = {}
    for _, match_name, tf_var, keras_var in found:
        path = paths.get(id(keras_var)) if keras_var is not None else None
        path = path or paths.get(id(tf_var))
        names[id(tf_var)] = (match_name,) if path in (None, match_name) else (match_name, path)
    return names


def _first_rule(pairs, names) -> int | None:
    """Index of the first rule whose pattern takes any of ``names``, or None."""
    for index, (pattern, _) in enumerate(pairs):
        if any(matches(pattern, name) for name in names):
            return index
    return None


def _unused_rule(pattern, pairs, found, names_of) -> None:
    """Raise NoMatchError for a rule that took no variable: earlier rules took its names, or it matches none."""
    shadowed = [f[1] for f in found if any(matches(pattern, n) for n in names_of[id(f[2])])]
    if shadowed:
        taker = pairs[_first_rule(pairs, [shadowed[0]]) or 0][0]
        raise NoMatchError(
            f"group rule {_rule_text(pattern)!r} takes no variable: earlier rules took every name "
            f"it matches ({shadowed[0]!r} went to rule {_rule_text(taker)!r}); reorder or drop it",
            tuple(shadowed[:5]),
        )
    own = sorted({f[1] for f in found})
    paths = list(dict.fromkeys(n for f in found for n in names_of[id(f[2])][1:]))  # in model order
    kinds = "variable names" + (" and paths through the model's layers or attributes" if paths else "")
    text = _rule_text(pattern)
    message = f"group rule {text!r} matches no name among {len(own)} ({kinds})."
    if isinstance(pattern, str):
        message += pattern_hint(text, own + paths)
    if paths:
        message += f" Paths look like {paths[0]!r}."
    raise NoMatchError(message, name=text, candidates=own + paths, label="Closest names")


def group_variables(rules, variables=None, *, default: float = 1.0) -> VariableGroups:
    """Put every variable in exactly one group by ordered rules.

    The first rule whose pattern takes a variable's name wins; overlapping rules are
    allowed and ``rule_for`` / the printed table show which one took each variable.
    Variables no rule takes go to the default group. Partitioned variables are matched
    by their full name, so all their parts share a group.

    Args:
        rules: ordered mapping (or list of pairs) from pattern to learning-rate
            multiplier; patterns follow ``restorekit._names.matches`` (a scope prefix or
            a regex from the start of the name; a compiled ``re.Pattern`` searches).
            ``0`` freezes.
        variables: None for the default graph's trainable variables (TF1); or a list
            of tf.Variables / PartitionedVariables / Keras variables, a Keras model or
            a tf.Module (their ``trainable_variables``). Keras variables are named by
            ``variable.path``; given a model or module, a rule also matches each
            variable's path through its layers (``backbone/d1/kernel`` for a nested
            model ``backbone``) or attributes (``encoder/w``). A torch.nn.Module's
            parameters are named as in its ``state_dict``, a Flax ``nnx.Module``'s
            ``nnx.Param``s by their paths (``layers/0/kernel``).
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
    names_of = _names_to_match(variables, found)
    members_of: list[list[tuple[str, object, object]]] = [[] for _ in range(len(pairs) + 1)]
    taken = [False] * len(pairs)
    for item in found:
        index = _first_rule(pairs, names_of[id(item[2])])
        if index is not None:
            taken[index] = True
        members_of[len(pairs) if index is None else index].append((item[0], item[2], item[3]))
    for (pattern, _), used in zip(pairs, taken):
        if not used:
            _unused_rule(pattern, pairs, found, names_of)

    groups: list[VariableGroup] = []
    members: list[_Member] = []
    specs = [(p, m) for p, m in pairs] + [(None, default)]
    for (rule, mult), group_members in zip(specs, members_of):
        if not group_members:
            continue
        sizes = [_num_parameters(v) for _, v, _ in group_members]
        known = [s for s in sizes if s is not None]
        params = sum(known) if len(known) == len(sizes) else None
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
        embeddings: patterns (``restorekit._names`` semantics) of the names below the
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
        raise NoMatchError(
            f"no variable name carries a layer number matching {pattern!r} among {len(names)} names.",
            name="layer_0",
            candidates=names,
            label="Closest names",
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
