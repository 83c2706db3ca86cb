"""Tests for restorekit/finetune/_groups.py and the package: variable groups, group_of, layerwise_decay."""

import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from restorekit.errors import GroupError, InvalidArgumentError, NoMatchError
from restorekit.finetune import VariableGroups, group_variables, layerwise_decay

tf1 = tf.compat.v1


def _var(name, shape=(2, 3), value=None):
    init = tf.constant(value, tf.float32) if value is not None else tf1.ones_initializer()
    return tf1.get_variable(name, shape=None if value is not None else shape, initializer=init)


def _model_vars():
    """A small TF1 model: backbone, neck, head (call inside a graph)."""
    return [
        _var("backbone/conv1/weights", (3, 4)),
        _var("backbone/conv1/biases", (4,)),
        _var("backbone/conv10/weights", (4, 4)),
        _var("neck/weights", (4, 2)),
        _var("logits/weights", (2, 5)),
        _var("logits/biases", (5,)),
    ]


# ---------------------------------------------------------------- group_variables


def test_groups_first_rule_wins_and_report_shows_rules():
    with tf.Graph().as_default():
        variables = _model_vars()
        groups = group_variables({"backbone/conv1": 0, "backbone": 0.5, "logits": 10}, variables)
    assert isinstance(groups, VariableGroups) and len(groups) == 4
    assert [g.rule for g in groups] == ["backbone/conv1", "backbone", "logits", None]
    assert [g.multiplier for g in groups] == [0.0, 0.5, 10.0, 1.0]
    # 'backbone' also takes conv1, but the earlier rule took it first.
    assert groups.rule_for("backbone/conv1/weights") == "backbone/conv1"
    assert groups.rule_for("backbone/conv1/weights:0") == "backbone/conv1"
    # A scope boundary: 'backbone/conv1' does not take conv10.
    assert groups.rule_for("backbone/conv10/weights") == "backbone"
    assert groups.rule_for("neck/weights") is None
    assert groups.assignments == {
        "backbone/conv1/weights": "backbone/conv1", "backbone/conv1/biases": "backbone/conv1",
        "backbone/conv10/weights": "backbone", "neck/weights": None,
        "logits/weights": "logits", "logits/biases": "logits",
    }
    assert [v.name for v in groups.frozen] == ["backbone/conv1/weights:0", "backbone/conv1/biases:0"]
    assert [v.name for v in groups.trainable] == [
        "backbone/conv10/weights:0", "neck/weights:0", "logits/weights:0", "logits/biases:0"
    ]
    assert groups.multiplier(variables[4]) == 10.0
    assert groups.multiplier("backbone/conv10/weights") == 0.5
    assert [g.parameters for g in groups] == [16, 16, 15, 8]

    table = str(groups)
    assert table.splitlines()[0] == "restorekit: 6 variables in 4 groups (3 trainable, 1 frozen)"
    assert re.search(r"'backbone/conv1'\s+0 \(frozen\)\s+2\s+16\s+'backbone/conv1/weights'", table)
    assert re.search(r"'logits'\s+10\s+2\s+15\s+'logits/weights', 'logits/biases'", table)
    assert re.search(r"\(default\)\s+1\s+1\s+8\s+'neck/weights'", table)

    d = groups.to_dict()
    assert d["default"] == 1.0
    assert d["groups"][1] == {
        "rule": "backbone", "multiplier": 0.5, "frozen": False,
        "variables": ["backbone/conv10/weights"], "parameters": 16,
    }


def test_groups_are_values_that_pickle_without_live_variables():
    with tf.Graph().as_default():
        groups = group_variables({"logits": 2}, _model_vars())
    with tf.Graph().as_default():
        again = group_variables({"logits": 2}, _model_vars())
    assert groups == again  # names and multipliers, not the live variables
    restored = pickle.loads(pickle.dumps(groups))
    assert restored == groups
    assert restored.rule_for("logits/biases") == "logits"
    with pytest.raises(GroupError, match="unpickled"):
        restored.trainable


def test_default_graph_variables_and_regex_rules():
    with tf.Graph().as_default():
        _model_vars()
        tf1.get_variable("global_step", shape=[], dtype=tf.int64, trainable=False)
        groups = group_variables({".*biases": 0, re.compile("weights$"): 3}, default=0.1)
    assert groups.rule_for("logits/biases") == ".*biases"
    assert groups.rule_for("neck/weights").pattern == "weights$"
    assert "global_step" not in groups.names  # only trainable variables
    assert len(groups.names) == 6
    assert [g.rule for g in groups] == [".*biases", re.compile("weights$")]  # nothing for the default


def test_partitioned_variable_grouped_by_full_name():
    with tf.Graph().as_default():
        emb = tf1.get_variable("emb", shape=[10, 4], partitioner=tf1.fixed_size_partitioner(2))
        other = _var("dense/kernel")
        given = group_variables({"emb": 0.5}, [emb, other])
        from_graph = group_variables({"emb": 0.5})
        assert [v.name for v in given.trainable] == ["emb/part_0:0", "emb/part_1:0", "dense/kernel:0"]
        assert given.groups[0].variables == ("emb/part_0", "emb/part_1")
        assert given.groups[0].parameters == 40
        assert from_graph == given
        assert given.rule_for("emb") == "emb"
        with pytest.raises(NoMatchError):
            group_variables({"emb/part_0": 0.5}, [emb, other])  # rules see the full name


def test_tf2_variables_and_tf_module():
    class Net(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(tf.ones([2, 2]), name="net/w")
            self.b = tf.Variable(tf.zeros([2]), name="net/b")
            self.step = tf.Variable(0, trainable=False, name="step")

    net = Net()
    groups = group_variables({"net/b": 0}, net)
    assert sorted(groups.names) == ["net/b", "net/w"]
    assert groups.frozen[0] is net.b
    assert group_variables({"net/b": 0}, [net.w, net.b]) == groups


# ---------------------------------------------------------------- bad input


def test_rule_that_matches_nothing_lists_closest_names():
    with tf.Graph().as_default():
        variables = _model_vars()
        with pytest.raises(NoMatchError) as info:
            group_variables({"logits": 10, "backbone/conv_1": 0}, variables)
    assert "'backbone/conv_1'" in str(info.value)
    assert "backbone/conv1/weights" in info.value.closest


@pytest.mark.parametrize(
    "multiplier",
    [-1, "10", None, True, float("nan"), float("inf")],
    ids=["negative", "string", "none", "bool", "nan", "inf"],
)
def test_bad_multiplier_is_rejected(multiplier):
    with tf.Graph().as_default():
        variables = _model_vars()
        with pytest.raises(InvalidArgumentError, match="multiplier of rule 'logits'"):
            group_variables({"logits": multiplier}, variables)
        with pytest.raises(InvalidArgumentError, match="default"):
            group_variables({}, variables, default=multiplier)


@pytest.mark.parametrize("variables", [5, "logits/weights"], ids=["an-int", "a-name-not-a-variable"])
def test_variables_that_are_not_variables_are_a_group_error(variables):
    with pytest.raises(GroupError, match="cannot group"):
        group_variables({"logits": 10}, variables)


@pytest.mark.parametrize(
    "rules, match",
    [("logits", "rules must be a mapping"), ([("logits", 1), ("logits", 2)], "'logits' is given twice"),
     ({"(": 1}, r"pattern '\(' is not a valid regular expression")],
    ids=["not-a-mapping", "pattern-twice", "bad-regex"],
)
def test_bad_rules_are_rejected(rules, match):
    with tf.Graph().as_default():
        variables = _model_vars()
        with pytest.raises(InvalidArgumentError, match=match):
            group_variables(rules, variables)


def test_no_variables_is_a_group_error():
    with tf.Graph().as_default():
        with pytest.raises(GroupError, match="has none"):
            group_variables({"a": 1})
        with pytest.raises(GroupError, match="cannot group"):
            group_variables({}, [np.zeros(3)])


def test_unknown_name_lookup_is_a_group_error():
    with tf.Graph().as_default():
        groups = group_variables({}, _model_vars())
    with pytest.raises(GroupError, match="'logit/weights' is not in these groups") as info:
        groups.rule_for("logit/weights")
    assert "'logits/weights'" in str(info.value)
    # Also a NoMatchError: it carries the name and its near misses as fields.
    assert isinstance(info.value, NoMatchError)
    assert info.value.name == "logit/weights" and "logits/weights" in info.value.closest
    assert "Closest names: 'logits/weights'" in str(info.value)


def test_unknown_variable_lookup_lists_closest_names():
    with tf.Graph().as_default():
        groups = group_variables({}, _model_vars())
        stranger = _var("logits/weight")
    with pytest.raises(GroupError, match=r"'logits/weight' is not in these groups \(6 variables\)") as info:
        groups.group_of(stranger)
    assert isinstance(info.value, NoMatchError) and info.value.closest[0] == "logits/weights"


# ---------------------------------------------------------------- group_of


def test_group_of_answers_for_a_variable_and_for_its_name():
    with tf.Graph().as_default():
        variables = _model_vars()
        groups = group_variables({"backbone/conv1": 0, "logits": 10}, variables)
    head = groups.group_of(variables[4])
    assert head is groups.groups[1] and head.rule == "logits" and head.multiplier == 10.0
    assert groups.group_of("logits/weights") is head
    assert groups.group_of("logits/weights:0") is head
    assert groups.group_of(variables[0]).frozen
    assert groups.group_of("neck/weights").rule is None
    # multiplier and rule_for are group_of's answer read one way.
    assert groups.multiplier(variables[4]) == head.multiplier and groups.rule_for("logits/biases") == head.rule
    restored = pickle.loads(pickle.dumps(groups))
    assert restored.group_of("logits/biases") == head  # names work without live variables
    with pytest.raises(GroupError, match="unpickled"):
        restored.group_of(variables[4])


def test_group_of_a_partition_and_of_a_partitioned_name():
    with tf.Graph().as_default():
        emb = tf1.get_variable("emb", shape=[10, 4], partitioner=tf1.fixed_size_partitioner(2))
        groups = group_variables({"emb": 0.5}, [emb, _var("dense/kernel")])
        parts = list(emb)
    assert groups.group_of(parts[1]).multiplier == 0.5
    assert groups.group_of("emb").multiplier == 0.5
    assert groups.group_of("emb/part_0:0").multiplier == 0.5
    assert groups.group_of("dense/kernel").multiplier == 1.0


def test_optimizer_classes_load_on_first_use_from_the_package():
    import restorekit
    import restorekit.finetune as finetune
    from restorekit.finetune._graph_mode import GroupedOptimizer

    assert finetune.GroupedOptimizer is GroupedOptimizer is restorekit.GroupedOptimizer
    assert GroupedOptimizer.__module__ == "restorekit.finetune"
    assert {"GroupedOptimizer", "KerasGroupedOptimizer"} <= set(dir(finetune))
    assert set(finetune.__all__) <= set(dir(finetune))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchOptimizer'"):
        finetune.NoSuchOptimizer


def test_import_restorekit_loads_neither_tensorflow_nor_keras():
    code = (
        "import sys, restorekit, restorekit.finetune;"
        "from restorekit.finetune import group_variables, grouped_keras_optimizer, scale_gradients;"
        "bad = [m for m in ('tensorflow', 'keras') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- layerwise_decay


def test_layerwise_decay_bert_names():
    names = [
        "bert/embeddings/word_embeddings", "bert/embeddings/LayerNorm/gamma",
        "bert/encoder/layer_0/attention/kernel", "bert/encoder/layer_1/attention/kernel",
        "bert/encoder/layer_2/output/kernel", "bert/encoder/layer_2/output/bias",
        "bert/pooler/dense/kernel", "classifier/kernel",
    ]
    with tf.Graph().as_default():
        variables = [_var(n, (2,)) for n in names]
        rules = layerwise_decay(variables, 0.5)
        groups = group_variables(rules, variables)
        multipliers = {n: groups.multiplier(n) for n in names}
        assert multipliers == {
            "bert/embeddings/word_embeddings": 0.5**4, "bert/embeddings/LayerNorm/gamma": 0.5**4,
            "bert/encoder/layer_0/attention/kernel": 0.5**3, "bert/encoder/layer_1/attention/kernel": 0.5**2,
            "bert/encoder/layer_2/output/kernel": 0.5, "bert/encoder/layer_2/output/bias": 0.5,
            "bert/pooler/dense/kernel": 1.0, "classifier/kernel": 1.0,
        }
        # num_layers given (a 12-layer model, only 3 built here); freeze rules go first.
        rules = layerwise_decay(variables, 0.5, num_layers=12)
        with pytest.raises(NoMatchError, match="went to rule 'bert/embeddings'"):
            group_variables({"bert/embeddings": 0, **rules}, variables)  # the '.*embeddings' rule is shadowed
        rules = layerwise_decay(variables, 0.5, num_layers=12, embeddings=())
        groups = group_variables({"bert/embeddings": 0, **rules}, variables)
        assert groups.multiplier("bert/encoder/layer_2/output/bias") == 0.5**10
        assert groups.multiplier("bert/embeddings/word_embeddings") == 0.0
        # 'layer_1' never takes 'layer_10'-like names: each rule is one layer number.
        assert groups.rule_for("bert/encoder/layer_1/attention/kernel").search("x/layer_10/k") is None


def test_layerwise_decay_keras_block_names():
    names = ["block1_conv1/kernel", "block2_conv1/kernel", "block3_conv1/kernel", "predictions/kernel"]
    with tf.Graph().as_default():
        variables = [_var(n, (2,)) for n in names]
        groups = group_variables(layerwise_decay(variables, 0.1, num_layers=4), variables)
    assert [groups.multiplier(n) for n in names] == pytest.approx([1e-3, 1e-2, 1e-1, 1.0])
    # A custom pattern; groups before the layer number are fine.
    with tf.Graph().as_default():
        variables = [_var(n, (2,)) for n in ["enc/x/h_0/w", "enc/x/h_1/w", "head/w"]]
        rules = layerwise_decay(variables, 0.5, pattern=r"(enc|dec)/.*h_(\d+)/")
        groups = group_variables(rules, variables)
    assert [groups.multiplier(n) for n in groups.names] == [0.25, 0.5, 1.0]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"decay": 0.0}, InvalidArgumentError),
        ({"decay": "0.9"}, InvalidArgumentError),
        ({"decay": 0.9, "num_layers": 2}, InvalidArgumentError),
        ({"decay": 0.9, "num_layers": 3.0}, InvalidArgumentError),
        ({"decay": 0.9, "pattern": r"layer_\d+"}, InvalidArgumentError),
        ({"decay": 0.9, "pattern": r"stage_(\d+)"}, NoMatchError),
        ({"decay": 0.9, "embeddings": ["bert/embedding"]}, NoMatchError),
        ({"decay": 0.9, "pattern": 5}, InvalidArgumentError),
        ({"decay": 0.9, "embeddings": 5}, InvalidArgumentError),
    ],
    ids=["zero-decay", "string-decay", "layer-above-num-layers", "float-num-layers", "no-group-in-pattern",
         "no-layer-numbers", "embeddings-match-nothing", "pattern-not-a-str", "embeddings-not-patterns"],
)
def test_layerwise_decay_bad_input(kwargs, error):
    with tf.Graph().as_default():
        variables = [_var(n, (2,)) for n in ["bert/embeddings/w", "bert/layer_0/k", "bert/layer_2/k"]]
        with pytest.raises(error):
            layerwise_decay(variables, **kwargs)


def test_layerwise_decay_without_layer_numbers_lists_closest_names():
    with tf.Graph().as_default():
        variables = [_var(n, (2,)) for n in ["bert/embeddings/w", "bert/layer_0/k"]]
        with pytest.raises(NoMatchError) as info:
            layerwise_decay(variables, 0.9, pattern=r"stage_(\d+)")
    assert str(info.value) == (
        "no variable name carries a layer number matching 'stage_(\\\\d+)' among 2 names. "
        "Closest names: 'bert/layer_0/k'."
    )
    assert info.value.closest == ("bert/layer_0/k",)
