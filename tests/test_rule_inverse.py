"""Inverses of rename rules: RuleSet.inverse (restorekit.export._hf), Rules.inverse (restorekit.rules), invert_pair.

Property: for every shipped rule set, every name of a realistic list (each table row expanded
with layer indices 0..2, plus the names of the tiny BERT / GPT-2 checkpoints the export tests
convert) goes through the rules and comes back, name and shape. A rule that loses what it
matched is refused by name, and a set that does not give a name back fails the check.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from restorekit._names import invert_pair
from restorekit.errors import InvalidArgumentError, NameCollisionError
from restorekit.export import _hf
from restorekit.export._hf import RULE_SETS, TRANSFORMS, Rule, RuleSet, Transform
from restorekit.rules import KERAS_FROM_KERAS2, KERAS_FROM_TF1, Rules

FAMILIES = {"bert": (_hf.BERT_PARTS, _hf.BERT_TABLE), "gpt2": (_hf.GPT2_PARTS, _hf.GPT2_TABLE)}
SHAPE_FOR = {None: (7,), "transpose": (3, 5), "squeeze0": (1, 4, 6)}


def expand(template: str, parts: dict) -> list[str]:
    """Every name a table template stands for: digits 0..2, each alternative of an alternation."""
    bits = re.split(r"\{(\w+)\}", template)
    choices = [[b] if i % 2 == 0 else ["0", "1", "2"] if parts[b] == r"\d+" else parts[b].split("|")
               for i, b in enumerate(bits)]
    return ["".join(c) for c in itertools.product(*choices)]


def checkpoint_names(family: str) -> dict:
    """The weights of the tiny checkpoints tests/test_export_hf.py converts and loads with from_pretrained."""
    from test_export_hf import bert_values, gpt2_values

    if family == "gpt2":
        values = gpt2_values()
    else:
        values = bert_values(optimizer=False)
        values["output_weights"], values["output_bias"] = np.zeros((3, 16), np.float32), np.zeros(3, np.float32)
    return {name: value.shape for name, value in values.items()}


def tf_shapes(family: str) -> dict:
    parts, table = FAMILIES[family]
    shapes = {name: SHAPE_FOR[row[2] if len(row) > 2 else None] for row in table for name in expand(row[0], parts)}
    shapes.update(checkpoint_names(family))
    return shapes


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    forward, backward = RULE_SETS[f"{request.param}-tf-to-hf"], RULE_SETS[f"{request.param}-hf-to-tf"]
    return request.param, forward, backward, tf_shapes(request.param)


def test_every_tf_name_comes_back_with_its_shape_and_values(family):
    _, forward, backward, shapes = family
    forward.check_inverse(shapes, backward)
    there = forward.plan(shapes)
    back = backward.plan(there.shapes)
    assert len(there.names) == len(shapes) and not there.dropped and not back.dropped
    rng = np.random.RandomState(0)
    for name, shape in shapes.items():
        new = there.names[name]
        assert back.names[new] == name
        assert back.shapes[name] == tuple(shape), name
        array = rng.randn(*shape).astype(np.float32)
        np.testing.assert_array_equal(back.apply(new, there.apply(name, array)), array, err_msg=name)


def test_every_hf_name_comes_back_through_the_reverse_set_and_the_table(family):
    _, forward, backward, shapes = family
    hf_shapes = forward.plan(shapes).shapes
    backward.check_inverse(hf_shapes, forward)
    backward.check_inverse(hf_shapes)  # its own inverse is the table's rules again


def test_each_row_of_the_table_is_exercised_by_the_name_list(family):
    name, forward, _, shapes = family
    used = {forward._match(n)[0] for n in shapes}
    assert used == set(forward.rules), f"{name}: rows no name reaches"


def test_the_reverse_set_is_derived_from_the_table_with_each_transform_undone(family):
    _, forward, backward, _ = family
    assert len(backward.rules) == len(forward.rules)
    for rule, reverse in zip(forward.rules, backward.rules):
        assert reverse.transform == (None if rule.transform is None else TRANSFORMS[rule.transform].inverse)
        assert (reverse.pattern, reverse.replacement) == invert_pair(rule.pattern, rule.replacement, whole=True)


def test_one_directional_rows_read_other_spellings_and_drop_tied_copies_and_buffers(family):
    name, forward, backward, shapes = family
    hf_names = list(forward.plan(shapes).names.values())
    for hf in hf_names:
        other = hf.removeprefix("bert.") if name == "bert" else f"transformer.{hf}"
        assert backward.target_of(other) == backward.target_of(hf), other
    dropped = {"bert": {"cls.predictions.decoder.weight": "tied to bert.embeddings.word_embeddings.weight",
                        "cls.predictions.decoder.bias": "tied to cls.predictions.bias",
                        "bert.embeddings.position_ids": "a buffer, not a weight",
                        "embeddings.token_type_ids": "a buffer, not a weight"},
               "gpt2": {"lm_head.weight": "tied to wte.weight", "transformer.lm_head.weight": "tied to wte.weight",
                        "h.1.attn.bias": "a buffer (the causal mask), not a weight",
                        "transformer.h.0.attn.masked_bias": "a buffer (the causal mask), not a weight"}}[name]
    for hf, why in dropped.items():
        assert backward.target_of(hf) == (None, None, why)
        assert forward.target_of(hf.replace(".", "/")) == (None, None, None)  # the table has no row for them


# -- a rule set that cannot be inverted, or does not give names back

def test_two_tf_names_onto_one_hf_name_in_one_rule_is_refused_naming_the_rule():
    mine = RuleSet("mine", "test", (Rule(r"(a|b)/kernel", "x.weight", "transpose"),))
    with pytest.raises(InvalidArgumentError, match=r"rule set 'mine': rule '\(a\|b\)/kernel' -> 'x.weight' cannot be "
                                                   r"inverted: it drops group 1"):
        mine.inverse()


def test_two_rules_writing_one_hf_name_are_refused_naming_both():
    mine = RuleSet("mine", "test", (Rule("a/kernel", "x.weight"), Rule("b/kernel", "x.weight")))
    with pytest.raises(NameCollisionError, match=r"rules 'a/kernel' and 'b/kernel' both write 'x.weight'"):
        mine.inverse()


def test_a_lossy_transform_is_refused_naming_the_rule(monkeypatch):
    monkeypatch.setitem(TRANSFORMS, "sum0", Transform(lambda s: s[1:], lambda a: a.sum(0), "rank >= 1", None))
    mine = RuleSet("mine", "test", (Rule("a/w", "a.weight", "sum0"),))
    with pytest.raises(InvalidArgumentError, match="rule set 'mine': rule 'a/w' -> 'a.weight' cannot be inverted: its "
                                                   "transform 'sum0' loses data"):
        mine.inverse()


def test_a_prepare_function_cannot_be_inverted():
    mine = RuleSet("mine", "test", (Rule("a", "b"),), prepare=str.lower)
    with pytest.raises(InvalidArgumentError, match="prepare function"):
        mine.inverse()


def test_the_check_fails_on_a_name_whose_group_swallows_the_separator():
    mine = RuleSet("mine", "test", (Rule(r"(.+)/(.+)", r"\1.\2"),))
    mine.check_inverse(["a/b", "a.b/c"])
    with pytest.raises(InvalidArgumentError, match=r"'a/b\.c' -> 'a\.b\.c' -> 'a\.b/c' \(rule '\(\.\+\)/\(\.\+\)'"):
        mine.check_inverse(["a/b", "a/b.c"])


def test_the_check_fails_on_a_reverse_set_missing_a_row_or_a_transform():
    forward = RULE_SETS["bert-tf-to-hf"]
    partial = RuleSet("partial", "test", RULE_SETS["bert-hf-to-tf"].rules[:-1])
    with pytest.raises(InvalidArgumentError, match=r"'output_bias' -> 'classifier.bias' -> no rule"):
        forward.check_inverse({"output_weights": (3, 16), "output_bias": (3,)}, partial)
    kernel = RuleSet("k", "test", (Rule(r"(a)/kernel", r"\1.weight", "transpose"),))
    untransposed = RuleSet("u", "test", (Rule(r"(a)\.weight", r"\1/kernel"),))
    with pytest.raises(InvalidArgumentError, match=r"'a/kernel' -> 'a.weight' -> 'a/kernel' with shape \[5, 3\]"):
        kernel.check_inverse({"a/kernel": (3, 5)}, untransposed)
    kernel.check_inverse({"a/kernel": (3, 5)})


# -- a user's own Rules

@pytest.mark.parametrize("pairs, names", [
    ([(r"^net/", "")], ["net/dense/kernel", "net/net/x"]),
    ([(r"^net/(\w+)/", r"\1.")], ["net/dense/kernel", "net/a/b/c"]),
    ([(r"layer_(\d+)/", r"layer.\1.")], ["encoder/layer_3/kernel", "layer_1/layer_22/b"]),
    ([(r"(?P<scope>\w+)/weights$", r"\g<scope>/kernel"), (r"^tower/", "")], ["tower/fc/weights", "tower/a/b"]),
    ([(r"(\w+)/(\w+)/kernel", r"\2/\1/kernel")], ["a/b/kernel", "x/a/b/kernel"]),
    ([(re.compile(r"^m/(.*)", re.DOTALL), r"\1")], ["m/odd\nname"]),
], ids=["a stripped prefix is put back", "a scope becomes a dotted prefix and back",
        "layer numbers move between spellings", "a named group and two pairs undone last first",
        "two groups swapped are swapped back", "a DOTALL pattern keeps its flag"])
def test_rules_inverse_gives_every_name_back(pairs, names):
    rules = Rules(pairs)
    inverse = rules.inverse()
    for name in names:
        assert inverse(rules(name)) == name
    rules.check_inverse(names)
    inverse.check_inverse([rules(name) for name in names])  # and the inverse's own inverse undoes it


@pytest.mark.parametrize("pair, why", [
    ((r"(a|b)/kernel", "x/kernel"), r"drops group 1 \('a\|b'\)"),
    ((r"foo(?=bar)", "x"), "lookahead"),
    ((r"(?<=net/)foo", "x"), "lookbehind"),
    ((r"(\w+)_(\d+)", r"\1\2"), "writes groups 1 and 2 side by side"),
    ((r"dense_\d+/", "dense/"), r"'\\\\d' outside a group"),
    ((r"(a)(?:/b|/c)", r"\1"), r"'\(\?:/b\|/c\)' matches text outside a capturing group"),
    ((r"(a)+", r"\1"), "group 1 is repeated or optional"),
    ((r"(x)", r"\g<0>"), "whole match"),
    ((r"(x)", lambda m: "y"), "a function"),
    ((r"((a)b)", r"\2"), "group 2, which lies inside group 1"),
    ((r"(.*)", r"\1"), "match the empty string"),
    ((re.compile("a", re.IGNORECASE), "b"), "flags"),
    (("(?i)a", "b"), "flags"),
], ids=["a dropped group maps two names to one", "a lookahead", "a lookbehind", "groups side by side",
        "a digit class outside a group", "an alternation outside a group", "a repeated group", "the whole match",
        "a function as replacement", "a group inside a group", "an unanchored inverse matching nothing",
        "ignoring case", "ignoring case inline"])
def test_rules_inverse_refuses_a_pair_that_loses_what_it_matched_naming_it(pair, why):
    rules = Rules([(r"^keep/", "")]) + Rules([pair])
    pattern = pair[0].pattern if isinstance(pair[0], re.Pattern) else pair[0]
    with pytest.raises(InvalidArgumentError, match=f"rule {re.escape(repr(pattern))} -> .* cannot be inverted: .*{why}"):
        rules.inverse()


@pytest.mark.parametrize("rules, options", [
    (Rules(synonyms={"kernel": "weights"}), "synonyms"),
    (Rules(renumber=True), "renumber"),
    (Rules(scope_levels=True), "scope_levels"),
    (KERAS_FROM_TF1, "synonyms and renumber"),
    (KERAS_FROM_KERAS2, "renumber and scope_levels"),
    (Rules([(r"^net/", "")]) + KERAS_FROM_TF1, "synonyms and renumber"),
], ids=["synonyms", "renumber", "scope levels", "KERAS_FROM_TF1", "KERAS_FROM_KERAS2", "pairs added to synonyms"])
def test_rules_that_look_names_up_in_the_checkpoint_are_refused_by_option(rules, options):
    with pytest.raises(InvalidArgumentError, match=f"cannot be inverted: {options} pick a checkpoint name"):
        rules.inverse()


def test_rules_check_names_the_pair_that_lost_a_name():
    rules = Rules([(r"^net/", ""), (r"kernel", "weight")])
    rules.check_inverse(["net/dense/kernel"])
    with pytest.raises(InvalidArgumentError, match=r"'net/weight_kernel' -> 'weight_weight' -> 'net/kernel_kernel' "
                                                   r"\(pair 'kernel' -> 'weight'\)"):
        rules.check_inverse(["net/dense/kernel", "net/weight_kernel"])
    with pytest.raises(InvalidArgumentError, match=r"'dense/kernel' -> 'dense/weight' -> 'net/dense/kernel' "
                                                   r"\(pair '\^net/' -> ''\)"):
        rules.check_inverse(["dense/kernel"])


def test_invert_pair_turns_a_table_row_around_and_back():
    pattern, replacement = r"bert/encoder/layer_(\d+)/attention/self/(query|key|value)/kernel", \
        r"bert.encoder.layer.\1.attention.self.\2.weight"
    inverse = invert_pair(pattern, replacement, whole=True)
    assert inverse == (r"bert\.encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.weight",
                       r"bert/encoder/layer_\1/attention/self/\2/kernel")
    assert invert_pair(*inverse, whole=True) == (pattern, replacement)
    assert invert_pair(r"x_(\d+)/y", r"\1.\1") == (r"(\d+)\.(?:\1)", r"x_\1/y")  # a group written twice must agree
