"""restorekit/_names.py: the one pattern rule, slot and global_step names, rename rules."""

import re

import pytest

from restorekit.errors import InvalidArgumentError, NameCollisionError, NoMatchError
from restorekit._names import (
    PatternSet,
    apply_renames,
    is_global_step,
    matches,
    optimizer_slot_kind,
    strip_output_index,
    strip_partition,
    suggest_pattern,
)

# (pattern, name, matches?) — the rule: a string matches from the start and ends at a
# scope boundary; a compiled pattern is used with search.
PATTERN_TABLE = [
    ("block1", "block1/conv/weights", True),
    ("block1", "block10/conv/weights", False),
    ("block1/", "block1/conv/weights", True),
    ("block1/", "block10/conv/weights", False),
    ("block1", "block1", True),
    ("conv", "block1/conv/weights", False),
    (".*conv", "block1/conv/weights", True),
    (".*Adam", "dense/kernel/Adam", True),
    (".*Adam", "dense/kernel/Adam_1", False),
    (".*Adam.*", "dense/kernel/Adam_1", True),
    ("net/conv.*", "net/conv1/weights", True),
    ("net/conv", "net/conv1/weights", False),
    ("logits|fc8", "fc8/biases", True),
    ("(logits|fc8)", "logits/biases", True),
    (re.compile("Adam"), "dense/kernel/Adam_1", True),
    (re.compile("^Adam"), "dense/kernel/Adam", False),
]


@pytest.mark.parametrize("pattern,name,expected", PATTERN_TABLE,
                         ids=[f"{getattr(p, 'pattern', p)!s} {'takes' if e else 'misses'} {n}" for p, n, e in PATTERN_TABLE])
def test_pattern_rule(pattern, name, expected):
    assert matches(pattern, name) is expected


@pytest.mark.parametrize("bad, match", [(3, "must be a str or a compiled re.Pattern, got int"),
                                        ("(", r"pattern '\(' is not a valid regular expression"),
                                        (None, "must be a str or a compiled re.Pattern, got NoneType")],
                         ids=["int", "unbalanced-paren", "none"])
def test_bad_patterns_are_invalid_arguments(bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        matches(bad, "x")


@pytest.mark.parametrize("pattern,meant", [("Adam", ".*Adam"), ("net/conv", "net/conv.*"), ("kern", ".*kern.*"),
                                           ("zzz", None)],
                         ids=["slot-anywhere", "scope-prefix", "infix", "nothing-close"])
def test_suggest_pattern(pattern, meant):
    names = ["net/conv1/weights", "net/conv1/weights/Adam", "dense/kernel"]
    assert suggest_pattern(pattern, names) == meant


def test_unused_pattern_error_suggests_the_pattern_meant_and_close_names():
    patterns = PatternSet(["net/conv"], what="exclude pattern")
    names = ["net/conv1/weights", "net/fc/weights"]
    for n in names:
        patterns.first_match(n)
    with pytest.raises(NoMatchError) as info:
        patterns.check_all_used(names)
    assert "Did you mean 'net/conv.*'?" in str(info.value)
    assert "exclude pattern 'net/conv' matches no name among 2." in str(info.value)


@pytest.mark.parametrize("name,kind", [
    ("dense/kernel/Momentum", "Momentum"), ("dense/kernel/Adam_1", "Adam"), ("beta1_power", "Adam"),
    ("dense/kernel", None), ("optimizer/adam_m", "optimizer (TF2)"),
], ids=["momentum", "adam-second-moment", "adam-beta-power", "weight", "tf2-optimizer-state"])
def test_optimizer_slot_kind(name, kind):
    found = optimizer_slot_kind(name)
    assert (found is None) if kind is None else (found is not None and kind in found)


@pytest.mark.parametrize("name,expected", [("global_step", True), ("net/global_step", True), ("step", False)],
                         ids=["plain", "scoped", "other"])
def test_is_global_step(name, expected):
    assert is_global_step(name) is expected


def test_strip_suffixes():
    assert strip_output_index("dense/kernel:0") == "dense/kernel"
    assert strip_partition("emb/part_3") == "emb"


@pytest.mark.parametrize("rule", [{"a": "x"}, [("^a$", "x")], lambda n: "x" if n == "a" else n],
                         ids=["mapping", "regex-pairs", "callable"])
def test_rename_rules_agree(rule):
    assert apply_renames(["a", "b"], rule) == {"a": "x", "b": "b"}


def test_rename_collision_names_both():
    with pytest.raises(NameCollisionError, match="'a' and 'b' both become 'x'"):
        apply_renames(["a", "b"], lambda n: "x")


# ---------------------------------------------------------------- entry_kind: the one rule for "is this a weight"

from restorekit._names import Kind, entry_kind, is_weight  # noqa: E402


@pytest.mark.parametrize("name, path, tracked, kind", [
    ("conv1/weights", None, None, Kind.WEIGHT),
    ("conv1/weights/Momentum", None, None, Kind.OPTIMIZER),
    ("bert/encoder/dense/kernel/adam_m", None, None, Kind.OPTIMIZER),
    ("beta1_power", None, None, Kind.OPTIMIZER),
    ("dense/kernel/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE", None, None, Kind.OPTIMIZER),
    ("optimizer/vars/3", None, None, Kind.OPTIMIZER),
    ("optimizer_weights/adam/sequential_d1_kernel_momentum", None, None, Kind.OPTIMIZER),
    ("optimizer_weights/training/Adam/dense/kernel/m:0", None, None, Kind.OPTIMIZER),
    ("layers/dense/vars/0", "optimizer/adam/iteration", None, Kind.OPTIMIZER),
    ("optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE", "dense/kernel", "variable", Kind.WEIGHT),
    ("optimizer/iter/.ATTRIBUTES/VARIABLE_VALUE", None, "optimizer", Kind.OPTIMIZER),
    ("global_step", None, None, Kind.COUNTER),
    ("save_counter/.ATTRIBUTES/VARIABLE_VALUE", None, "save_counter", Kind.COUNTER),
    ("seed_generator_2/seed_generator_state", None, None, Kind.RNG),
    ("model/layer-2/seed_generator/state/.ATTRIBUTES/VARIABLE_VALUE", None, None, Kind.RNG),
    ("dense/kernel/ExponentialMovingAverage", None, None, Kind.EMA),
], ids=["weight", "tf1_slot", "bert_adam", "beta_power", "tf2_slot", "keras3_optimizer", "keras3_legacy_h5_optimizer",
        "keras2_h5_optimizer", "readable_path_says_optimizer", "tracked_weight_spelled_optimizer", "tracked_optimizer",
        "global_step", "save_counter", "seed_generator_path", "seed_generator_tf2_key", "ema_shadow"])
def test_entry_kind_says_what_an_entry_holds(name, path, tracked, kind):
    assert entry_kind(name, path=path, tracked=tracked) is kind
    assert is_weight(name, path=path, tracked=tracked) == (kind in (Kind.WEIGHT, Kind.EMA))
