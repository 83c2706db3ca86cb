"""Name rules shared by every module: ':0' and '/part_N' suffixes, patterns, rename rules.

Two kinds of names never mix: a *checkpoint name* is a key in a checkpoint
(``dense/kernel``); a *variable name* is the graph name without its output index
(``dense/kernel``, from ``dense/kernel:0``).

Patterns (``include``, ``exclude``, group rules, ``delete``) all follow one rule,
``matches(pattern, name)``:

* a string is a regular expression matched from the *start* of the name, as tf-slim's
  ``get_variables_to_restore(include=[scope])`` does, and the match must end at a scope
  boundary (``/`` or the end of the name): ``'block1'`` takes ``block1/conv/weights``
  but not ``block10/conv/weights``. Plain scope prefixes are therefore patterns too.
  Start a pattern with ``'.*'`` to match anywhere (``'.*BatchNorm'``).
* a compiled ``re.Pattern`` is used as given, with ``search``.
"""

from __future__ import annotations

import enum
import re
from typing import Callable, Iterable, Mapping, Sequence

from restorekit.errors import InvalidArgumentError, NameCollisionError, NoMatchError, closest_names

__all__ = [
    "Kind",
    "invert_pair",
    "closest_names",
    "counter_kind",
    "entry_kind",
    "is_weight",
    "global_step_name",
    "is_global_step",
    "matches",
    "pattern_hint",
    "optimizer_slot_kind",
    "rename_rule",
    "strip_output_index",
    "strip_partition",
    "suggest_pattern",
]

_OUTPUT_INDEX = re.compile(r":\d+$")
_PARTITION = re.compile(r"/part_\d+$")


def strip_output_index(name: str) -> str:
    """'dense/kernel:0' -> 'dense/kernel'."""
    return _OUTPUT_INDEX.sub("", name)


def strip_partition(name: str) -> str:
    """'emb/part_3' -> 'emb' (the full name of a partitioned variable)."""
    return _PARTITION.sub("", name)


def _compile(pattern) -> Callable[[str], bool]:
    if isinstance(pattern, re.Pattern):
        return lambda name: pattern.search(name) is not None
    if not isinstance(pattern, str):
        raise InvalidArgumentError(
            f"a pattern must be a str or a compiled re.Pattern, got {type(pattern).__name__}: {pattern!r}"
        )
    try:
        if pattern.endswith("/"):
            compiled = re.compile(pattern)
        else:
            compiled = re.compile(f"(?:{pattern})(?=/|$)")
    except re.error as e:
        raise InvalidArgumentError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None
    return lambda name: compiled.match(name) is not None


def suggest_pattern(pattern: str, names: Iterable[str]) -> str | None:
    """The pattern a user probably meant when ``pattern`` matches none of ``names``.

    Patterns match from the start of a name and end at a scope boundary, so ``'Adam'``
    misses ``dense/kernel/Adam`` (``'.*Adam'`` takes it) and ``'net/conv'`` misses
    ``net/conv1/weights`` (``'net/conv.*'`` takes it).
    """
    names = list(names)
    for candidate in (f".*{pattern}", f"{pattern}.*", f".*{pattern}.*"):
        try:
            test = _compile(candidate)
        except InvalidArgumentError:
            return None
        if any(test(n) for n in names):
            return candidate
    return None


def pattern_hint(pattern: str, names: Iterable[str]) -> str:
    """' Did you mean ...?' for a pattern that matches nothing, or '' when no variant would match."""
    meant = suggest_pattern(pattern, names)
    return f" Did you mean {meant!r}? (a pattern matches from the start of the name)" if meant else ""


def matches(pattern, name: str) -> bool:
    """True when ``pattern`` (see module docstring) takes ``name``."""
    return _compile(pattern)(name)


class PatternSet:
    """An ordered list of patterns, compiled once; knows which pattern took each name."""

    def __init__(self, patterns, *, what: str = "pattern"):
        if patterns is None:
            patterns = []
        elif isinstance(patterns, (str, re.Pattern)):
            patterns = [patterns]
        try:
            self.patterns = list(patterns)
        except TypeError:
            raise InvalidArgumentError(
                f"{what}s are a str, a compiled re.Pattern or a list of them, got {type(patterns).__name__}: "
                f"{patterns!r}"
            ) from None
        self._tests = [_compile(p) for p in self.patterns]
        self.what = what
        self.used = [False] * len(self.patterns)

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def first_match(self, name: str):
        """The first pattern taking ``name``, or None. Records the use."""
        for i, test in enumerate(self._tests):
            if test(name):
                self.used[i] = True
                return self.patterns[i]
        return None

    def check_all_used(self, names: Iterable[str]) -> None:
        """Raise NoMatchError for the first pattern that took no name, suggesting the pattern meant."""
        names = list(names)
        for pattern, used in zip(self.patterns, self.used):
            if not used:
                text = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
                message = f"{self.what} {text!r} matches no name among {len(names)}."
                if isinstance(pattern, str):
                    message += pattern_hint(text, names)
                raise NoMatchError(message, name=text, candidates=names, label="Closest names")


# ---------------------------------------------------------------- optimizer slots

# Last path component of a TF1 slot variable, by optimizer. Optimizers uniquify a
# second slot with '_1' (Adam_1 is the second moment), and graphs built twice add
# further '_N' suffixes, hence the optional number.
_SLOT_LEAVES = {
    "Momentum": "Momentum",
    "Adam": "Adam",
    "AdamW": "AdamW",
    "Nadam": "Nadam",
    "RMSProp": "RMSProp",
    "Adagrad": "Adagrad",
    "AdagradDA": "AdagradDA",
    "Adadelta": "Adadelta",
    "Ftrl": "Ftrl",
    "ProximalAdagrad": "ProximalAdagrad",
    "LazyAdam": "LazyAdam",
    "Adafactor": "Adafactor",
    "LARS": "LARS",
    "LAMB": "LAMB",
    "adam_m": "Adam (BERT)",
    "adam_v": "Adam (BERT)",
    "accumulator": "Adagrad",
    "gradient_accumulator": "Adadelta",
    "update_accumulator": "Adadelta",
}
_SLOT_LEAF = re.compile(r"^(?P<leaf>[A-Za-z_]+?)(?:_\d+)?$")
# Non-slot optimizer state living beside the variables.
_OPTIMIZER_STATE = re.compile(r"(^|/)(beta1_power|beta2_power|beta_1_power|beta_2_power)(_\d+)?$")
_TF2_SLOT = re.compile(r"/\.OPTIMIZER_SLOT/|^optimizer/|/optimizer/")
# A torch optimizer's state_dict, flattened by path (a training checkpoint's 'optimizer_state.state.0.exp_avg',
# HF Trainer's optimizer.pt 'state.0.exp_avg'): per-parameter state under 'state.N.', by torch's own slot names,
# and 'param_groups.N.' (hyper-parameters, a tensor where an optimizer keeps lr as one).
_TORCH_OPTIMIZER = re.compile(
    r"(^|\.)(state\.\d+\.(exp_avg|exp_avg_sq|max_exp_avg_sq|momentum_buffer|step|square_avg|acc_delta|grad_avg"
    r"|sum|exp_inf|mu_product|eta|mu|ax|prev|step_size|exp_avg_sq_row|exp_avg_sq_col)|param_groups\.\d+\.\w+)$")


def optimizer_slot_kind(name: str) -> str | None:
    """The optimizer a checkpoint or variable name belongs to, or None for model weights.

    >>> optimizer_slot_kind('conv1/weights/Momentum')
    'Momentum'
    >>> optimizer_slot_kind('bert/encoder/dense/kernel/adam_m')
    'Adam (BERT)'
    >>> optimizer_slot_kind('optimizer_state.state.0.exp_avg')
    'optimizer (torch)'
    """
    name = strip_partition(strip_output_index(name))
    if _TF2_SLOT.search(name):
        return "optimizer (TF2)"
    if _TORCH_OPTIMIZER.search(name):
        return "optimizer (torch)"
    m = _OPTIMIZER_STATE.search(name)
    if m:
        return "Adam" if m.group(2).startswith("beta") else "optimizer"
    if "/" not in name:
        return None
    leaf = name.rsplit("/", 1)[1]
    m = _SLOT_LEAF.match(leaf)
    if m and m.group("leaf") in _SLOT_LEAVES:
        return _SLOT_LEAVES[m.group("leaf")]
    if leaf in _SLOT_LEAVES:
        return _SLOT_LEAVES[leaf]
    return None


_GLOBAL_STEP = re.compile(r"(^|/)global_step$|^save_counter(/\.ATTRIBUTES/VARIABLE_VALUE)?$")


def is_global_step(name: str) -> bool:
    """True for the global_step (TF1) and save_counter (TF2) bookkeeping counters."""
    return bool(_GLOBAL_STEP.search(strip_output_index(name)))


def counter_kind(name: str) -> str | None:
    """``'global_step'`` (TF1) or ``'save counter'`` (TF2's ``save_counter``) for a bookkeeping counter, else None."""
    if not is_global_step(name):
        return None
    return "save counter" if strip_output_index(name).startswith("save_counter") else "global_step"


# Keras 3 SeedGenerator state (Dropout, noise and random-augmentation layers): 'seed_generator_2/seed_generator_state'
# as a variable path, '.../seed_generator/state' as a TF2 object path. Keras renumbers the generators in every model
# built, and restoring one only replays a random stream, so it is bookkeeping, never a weight.
_RNG_STATE = re.compile(r"(^|/)seed_generator(_\d+)?/(seed_generator_)?state(/\.ATTRIBUTES/VARIABLE_VALUE)?$")
# A legacy Keras 2 full-model HDF5 file keeps its optimizer in this group, under the optimizer's own names
# ('optimizer_weights/training/Adam/dense/kernel/m:0'), which no slot rule recognizes.
_KERAS2_OPTIMIZER = re.compile(r"^optimizer_weights(/|$)")
_EMA_SHADOW = re.compile(r"/ExponentialMovingAverage(_\d+)?$")


class Kind(str, enum.Enum):
    """What a checkpoint entry or variable holds: the one answer to "is this a weight?"."""

    WEIGHT = "weight"
    EMA = "ema"  # a moving-average shadow of a weight (w/ExponentialMovingAverage): a value of the weight
    OPTIMIZER = "optimizer"  # slots (Momentum, Adam m/v), beta powers, TF2 / Keras optimizer objects and groups
    COUNTER = "counter"  # global_step, save_counter
    RNG = "rng"  # Keras 3 SeedGenerator state

    @property
    def is_weight(self) -> bool:
        """True for what ``weights_only`` keeps: weights and their EMA shadows."""
        return self in (Kind.WEIGHT, Kind.EMA)


def entry_kind(name: str, *, path: str | None = None, tracked: str | None = None) -> Kind:
    """What the entry or variable ``name`` holds; ``strip``, ``weights_only``, ``scan``, export and the editor ask this.

    Args:
        name: a checkpoint key or variable name.
        path: its readable path, where the source has one (a Keras file's ``optimizer/...``,
            a TF2 checkpoint's ``variable.path``): either name saying "optimizer" is enough.
        tracked: the kind a TF2 object graph gives the key (``'variable'``, ``'optimizer'``,
            ``'save_counter'``). It wins over the spelling: Keras 3 saves a model's own weights
            under ``optimizer/_trainable_variables/N/...`` when the optimizer tracked them first.

    >>> entry_kind('conv1/weights/Momentum'), entry_kind('global_step'), entry_kind('conv1/weights')
    (<Kind.OPTIMIZER: 'optimizer'>, <Kind.COUNTER: 'counter'>, <Kind.WEIGHT: 'weight'>)
    """
    if tracked is not None and tracked != "variable":
        return Kind.COUNTER if tracked == "save_counter" else Kind.OPTIMIZER
    names = (name,) if path is None or path == name else (name, path)
    for n in names:
        if optimizer_slot_kind(n) is not None or _KERAS2_OPTIMIZER.search(n):
            if tracked is None:
                return Kind.OPTIMIZER
    for n in names:
        if is_global_step(n):
            return Kind.COUNTER
        if _RNG_STATE.search(strip_output_index(n)):
            return Kind.RNG
    if any(_EMA_SHADOW.search(strip_output_index(n)) for n in names):
        return Kind.EMA
    return Kind.WEIGHT


def is_weight(name: str, *, path: str | None = None, tracked: str | None = None) -> bool:
    """True when ``entry_kind`` says ``name`` is a weight or a weight's EMA shadow (what ``weights_only`` keeps)."""
    return entry_kind(name, path=path, tracked=tracked).is_weight


def global_step_name(names: Iterable[str]) -> str | None:
    for n in names:
        if is_global_step(n):
            return n
    return None


# ---------------------------------------------------------------- rename rules

RenameRule = Callable[[str], str]


def compile_pairs(pairs) -> list:
    """Validate and compile ``(regex, replacement)`` pairs for ``re.sub``.

    Raises:
        InvalidArgumentError: an item that is not a pair, or a pattern that does not compile.
    """
    compiled = []
    for item in pairs:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise InvalidArgumentError(f"a rename rule list holds (regex, replacement) pairs, got {item!r}")
        pattern, repl = item
        try:
            compiled.append((re.compile(pattern) if isinstance(pattern, str) else pattern, repl))
        except re.error as e:
            raise InvalidArgumentError(f"rename pattern {pattern!r} is not a valid regular expression: {e}") from None
    return compiled


def rename_rule(rule) -> RenameRule:
    """Turn a callable, a mapping, or a list of (regex, replacement) pairs into one function.

    * a callable is used as given (return the name unchanged to keep it);
    * a mapping renames exact names and leaves the rest;
    * a list of ``(regex, replacement)`` applies every pair in order with ``re.sub``.
    """
    if callable(rule):
        return rule
    if isinstance(rule, Mapping):
        table = dict(rule)
        return lambda name: table.get(name, name)
    if isinstance(rule, Sequence) and not isinstance(rule, str):
        pairs = compile_pairs(rule)

        def apply(name: str) -> str:
            for pattern, repl in pairs:
                name = pattern.sub(repl, name)
            return name

        return apply
    raise InvalidArgumentError(f"a rename rule is a callable, a mapping or a list of (regex, replacement); got {rule!r}")


def apply_renames(names: Sequence[str], rule) -> dict[str, str]:
    """Map each name to its new name under ``rule``; raise on collisions.

    Raises:
        NameCollisionError: two names land on one, or a new name hits a kept one.
    """
    fn = rename_rule(rule)
    result: dict[str, str] = {}
    owners: dict[str, str] = {}
    for name in names:
        new = fn(name)
        if not isinstance(new, str) or not new:
            raise InvalidArgumentError(f"rename rule turned {name!r} into {new!r}; it must return a non-empty str")
        if new in owners:
            raise NameCollisionError(f"rename collision: {owners[new]!r} and {name!r} both become {new!r}")
        owners[new] = name
        result[name] = new
    return result


# -- inverting one (regex, replacement) rewrite
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")
_QUANTIFIERS = "*+?{"


class _Group:
    """A capturing group at the top level of a pattern: its number, its regex, and the groups inside it."""

    def __init__(self, number: int, regex: str, inner: int):
        self.number, self.regex, self.inner = number, regex, inner


def _class_end(pattern: str, i: int) -> int:
    """The index just past the character class opening at ``pattern[i] == '['``."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _group_end(pattern: str, i: int, why: Callable[[str], Exception]) -> tuple[int, int]:
    """(index just past the group opening at ``pattern[i] == '('``, capturing groups inside it)."""
    depth, inner, j = 0, 0, i
    while j < len(pattern):
        c = pattern[j]
        if c == "\\":
            if j + 1 < len(pattern) and pattern[j + 1].isdigit():
                raise why("it refers back to a group (\\" + pattern[j + 1] + ")")
            j += 2
            continue
        if c == "[":
            j = _class_end(pattern, j)
            continue
        if c == "(":
            if pattern.startswith(_LOOKAROUND, j):
                raise why("it has a lookahead or lookbehind, which matches text it does not keep")
            if pattern.startswith(("(?P=", "(?("), j):
                raise why("it refers back to a group")
            if j > i and (pattern[j + 1:j + 2] != "?" or pattern.startswith("(?P<", j)):
                inner += 1
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return j + 1, inner
        j += 1
    raise why("its parentheses do not balance")


def _pattern_parts(pattern: str, why: Callable[[str], Exception]) -> tuple[list, bool, bool]:
    """(parts: literal strs and top-level _Groups, anchored at the start, anchored at the end) of a pattern
    that matches literal text and capturing groups only."""
    parts: list = []
    start = end = False
    number, i, first = 0, 0, 0  # first: where the pattern starts, past leading inline flags
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in "AZ" and (i == first if nxt == "A" else i + 2 == len(pattern)):
                start, end = start or nxt == "A", end or nxt == "Z"
            elif nxt.isalnum() or nxt == "_":
                raise why(f"{chr(92) + nxt!r} outside a group matches text the replacement does not keep")
            else:
                parts.append(nxt)
            i += 2
        elif c == "^" and i == first or c == "$" and i + 1 == len(pattern):
            start, end = start or c == "^", end or c == "$"
            i += 1
        elif c == "(":
            flags = re.match(r"\(\?[aiLmsux]+\)", pattern[i:]) if i == 0 else None
            if flags:  # leading inline flags: the compiled pattern's flags say which, and are checked there
                i = first = flags.end()
                continue
            close, inner = _group_end(pattern, i, why)
            if pattern.startswith("(?#", i):
                i = close
                continue
            if pattern[i + 1:i + 2] == "?" and not pattern.startswith("(?P<", i):
                raise why(f"{pattern[i:close]!r} matches text outside a capturing group, which the replacement "
                          "cannot keep")
            number += 1
            if close < len(pattern) and pattern[close] in _QUANTIFIERS:
                raise why(f"group {number} is repeated or optional, so what it matched is not all kept")
            body = i + (pattern.index(">", i) + 1 - i if pattern.startswith("(?P<", i) else 1)
            parts.append(_Group(number, pattern[body:close - 1], inner))
            number += inner
            i = close
        elif c in ".[|^$)" or c in _QUANTIFIERS:
            raise why(f"{c!r} outside a group matches text the replacement does not keep")
        else:
            parts.append(c)
            i += 1
        if i < len(pattern) and pattern[i] in _QUANTIFIERS and parts and isinstance(parts[-1], str):
            raise why(f"{pattern[i]!r} repeats text outside a group, so what it matched is not kept")
    return parts, start, end


def _template_parts(replacement: str, groups: dict, names: Mapping, why: Callable[[str], Exception]) -> list:
    """The replacement as literal strs and references (ints) to groups of the pattern."""
    out: list = []
    i = 0
    while i < len(replacement):
        c = replacement[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = replacement[i + 1:i + 2]
        if nxt == "\\":
            out.append("\\")
            i += 2
            continue
        if nxt == "g" and replacement[i + 2:i + 3] == "<":
            close = replacement.find(">", i)
            ref = replacement[i + 3:close]
            i = close + 1
        elif nxt.isdigit() and nxt != "0":
            ref = replacement[i + 1:i + 3] if replacement[i + 2:i + 3].isdigit() else nxt
            i += 1 + len(ref)
        else:
            raise why(f"its replacement has the escape '\\{nxt}'; only group references can be undone")
        number = int(ref) if ref.isdigit() else names.get(ref, -1)
        if number == 0:
            raise why("its replacement writes the whole match (\\g<0>), which the inverse cannot take apart")
        if number not in groups:
            outer = next((g for g in groups.values() if g.number < number <= g.number + g.inner), None)
            raise why(f"its replacement writes group {ref}, which lies inside group {outer.number}" if outer
                      else f"its replacement refers to a group {ref!r} the pattern lacks")
        out.append(number)
    return out


def invert_pair(pattern, replacement, *, whole: bool = False) -> tuple[str, str]:
    """The ``(regex, replacement)`` that undoes one rewrite ``(pattern, replacement)``.

    A rewrite can be undone when its pattern is literal text and capturing groups (each
    written once or more by the replacement, never two side by side), and its replacement is
    literal text and group references. The inverse matches what the replacement wrote and
    writes the pattern's text back around the groups: ``('layer_(\\d+)/kernel', 'layer.\\1.weight')``
    becomes ``('layer\\.(\\d+)\\.weight', 'layer_\\1/kernel')``. ``whole``: the rewrite matches
    whole names (``re.fullmatch``), not parts (``re.sub``), so an inverse that could match an
    empty string is no ambiguity.

    Raises:
        InvalidArgumentError: the rewrite loses something (a dropped group, text matched outside
            a group, a lookahead, a function as replacement); the message names the pair and why.
    """
    source = pattern.pattern if isinstance(pattern, re.Pattern) else pattern

    def why(reason: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"rule {source!r} -> {replacement!r} cannot be inverted: {reason}")

    if not isinstance(replacement, str):
        raise why("its replacement is a function")
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise InvalidArgumentError(f"rename pattern {source!r} is not a valid regular expression: {e}") from None
    if compiled.flags & ~(re.UNICODE | re.DOTALL):
        raise why("it has flags other than DOTALL (ignoring case or spaces loses the text it matched)")
    parts, start, end = _pattern_parts(source, why)
    groups = {p.number: p for p in parts if isinstance(p, _Group)}
    template = _template_parts(replacement, groups, compiled.groupindex, why)
    for number, group in groups.items():
        if number not in template:
            raise why(f"it drops group {number} ({group.regex!r}), so names that differ there become one")
    for a, b in zip(template, template[1:]):
        if isinstance(a, int) and isinstance(b, int):
            both = f"group {a} twice" if a == b else f"groups {a} and {b}"
            raise why(f"its replacement writes {both} side by side, so the inverse cannot tell where one ends")
    regex, numbers = _inverse_pattern(template, groups)
    regex = ("(?s)" if compiled.flags & re.DOTALL else "") + ("^" if start else "") + regex + ("$" if end else "")
    if not whole and not start and re.compile(regex).fullmatch("") is not None:
        raise why("its inverse would match the empty string everywhere; anchor the pattern with '^'")
    back = ""
    for j, item in enumerate(parts):
        if isinstance(item, str):
            back += item.replace("\\", "\\\\")
        else:
            following = parts[j + 1] if j + 1 < len(parts) else ""
            ref = numbers[item.number]
            back += f"\\g<{ref}>" if isinstance(following, str) and following[:1].isdigit() else f"\\{ref}"
    return regex, back


def _inverse_pattern(template: list, groups: dict) -> tuple[str, dict[int, int]]:
    """(the regex matching what ``template`` writes, {group of the pattern: its number in that regex})."""
    regex, count = "", 0
    numbers: dict[int, int] = {}
    for item in template:
        if isinstance(item, str):
            regex += re.escape(item)
        elif item in numbers:
            regex += f"(?:\\{numbers[item]})"  # a back-reference: the forward wrote the group twice
        else:
            numbers[item] = count + 1
            count += 1 + groups[item].inner
            regex += f"({groups[item].regex})"
    return regex, numbers
