"""Tests for restorekit/finetune.py: variable groups, gradient scaling, grouped optimizers."""

import pickle
import re

import numpy as np
import pytest
import tensorflow as tf

from restorekit.errors import GroupError, InvalidArgumentError, NoMatchError
from restorekit.finetune import (
    GroupedOptimizer,
    VariableGroups,
    group_variables,
    grouped_keras_optimizer,
    layerwise_decay,
    scale_gradients,
)

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
    "rules",
    ["logits", [("logits", 1), ("logits", 2)], {"(": 1}],
    ids=["not-a-mapping", "pattern-twice", "bad-regex"],
)
def test_bad_rules_are_rejected(rules):
    with tf.Graph().as_default():
        variables = _model_vars()
        with pytest.raises(InvalidArgumentError):
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


# ---------------------------------------------------------------- scale_gradients


def test_frozen_gradients_dropped_and_dense_scaled():
    with tf.Graph().as_default():
        variables = _model_vars()
        x = tf.ones([1, 3])
        h = tf.matmul(tf.matmul(tf.matmul(x, variables[0]) + variables[1], variables[2]), variables[3])
        loss = tf.reduce_sum(tf.matmul(h, variables[4]) + variables[5])
        grads_and_vars = tf1.train.GradientDescentOptimizer(1.0).compute_gradients(loss, variables)
        groups = group_variables({"backbone/conv1": 0, "logits": 3.0, "neck": 1.0}, variables, default=0.5)
        scaled = scale_gradients(grads_and_vars, groups)
        assert [v.op.name for _, v in scaled] == [
            "backbone/conv10/weights", "neck/weights", "logits/weights", "logits/biases"
        ]
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            before, after = sess.run([[g for g, _ in grads_and_vars[2:]], [g for g, _ in scaled]])
    for b, a, m in zip(before, after, [0.5, 1.0, 3.0, 3.0]):
        np.testing.assert_allclose(a, m * b, rtol=1e-6)
        assert np.abs(b).sum() > 0


def test_sparse_gradients_stay_indexed_slices_and_scaled():
    with tf.Graph().as_default():
        emb = _var("emb", value=np.arange(20, dtype=np.float32).reshape(5, 4))
        dense = _var("dense/kernel", (4, 1))
        loss = tf.reduce_sum(tf.matmul(tf.nn.embedding_lookup(emb, [1, 3, 3]), dense))
        grads_and_vars = tf1.train.GradientDescentOptimizer(1.0).compute_gradients(loss, [emb, dense])
        assert isinstance(grads_and_vars[0][0], tf.IndexedSlices)
        groups = group_variables({"emb": 4.0}, [emb, dense])
        (sparse, _), (dense_grad, _) = scale_gradients(grads_and_vars, groups)
        assert isinstance(sparse, tf.IndexedSlices)
        assert dense_grad is grads_and_vars[1][0]  # multiplier 1: untouched
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            raw, values, indices = sess.run([grads_and_vars[0][0].values, sparse.values, sparse.indices])
    np.testing.assert_array_equal(indices, [1, 3, 3])
    np.testing.assert_allclose(values, 4.0 * raw)
    np.testing.assert_allclose(values, 4.0)


def test_none_gradients_rejected_only_where_a_multiplier_was_asked():
    with tf.Graph().as_default():
        a, b, c = _var("a"), _var("b"), _var("c")
        groups = group_variables({"a": 2.0, "c": 0}, [a, b, c])
        grad = tf.ones([2, 3])
        # b: default group at 1.0, nothing asked: passes through like tf-slim.
        assert scale_gradients([(None, b), (None, c)], groups) == [(None, b)]
        with pytest.raises(InvalidArgumentError, match="'a' has no gradient"):
            scale_gradients([(None, a), (grad, b)], groups)
        # The default group asks for a multiplier when default != 1.
        groups = group_variables({"a": 2.0}, [a, b, c], default=0.5)
        with pytest.raises(InvalidArgumentError, match="'b' has no gradient"):
            scale_gradients([(None, b)], groups)


def test_groups_from_another_graph_are_a_group_error():
    with tf.Graph().as_default():
        old_variables = _model_vars()
        groups = group_variables({"logits": 10}, old_variables)
    with tf.Graph().as_default() as graph:
        variables = _model_vars()
        grads = [(tf.ones_like(v), v) for v in variables]
        with pytest.raises(GroupError, match="another graph"):
            scale_gradients(grads, groups)
        with pytest.raises(GroupError, match="another graph"):
            GroupedOptimizer(lambda m: tf1.train.GradientDescentOptimizer(m), groups)
        # Groups of this graph, given a variable of the old graph: nothing is built.
        opt = GroupedOptimizer(lambda m: tf1.train.GradientDescentOptimizer(m), group_variables({"logits": 10}, variables))
        ops_before = len(graph.get_operations())
        with pytest.raises(GroupError, match="'logits/weights' is not the variable .* another graph"):
            opt.apply_gradients(grads[:4] + [(grads[4][0], old_variables[4])])
        assert len(graph.get_operations()) == ops_before
        with pytest.raises(GroupError, match="group_variables"):
            scale_gradients(grads, {"logits": 10})
        stranger = _var("stranger")
        with pytest.raises(GroupError, match="'stranger' is not in these groups"):
            scale_gradients([(tf.ones([2, 3]), stranger)], group_variables({}, variables))


# ---------------------------------------------------------------- training, TF1


def _two_layer_problem(slow_scale=0.1):
    """loss = mean((slow * s * x + fast - y)^2): 'slow' learns slowly (its gradient is tiny)."""
    x = tf.constant(np.linspace(-1, 1, 16, dtype=np.float32).reshape(16, 1))
    y = 3.0 * x + 1.0
    slow = tf1.get_variable("slow/w", initializer=tf.zeros([1, 1]))
    fast = tf1.get_variable("fast/b", initializer=tf.zeros([1]))
    pred = tf.matmul(x * slow_scale, slow) + fast
    return tf.reduce_mean(tf.square(pred - y)), [slow, fast]


def _train(loss, train_op, steps):
    with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(steps):
            sess.run(train_op)
        return sess.run(loss)


@pytest.mark.parametrize("path", ["scale_gradients", "GroupedOptimizer"], ids=["scaled-gradients", "grouped-optimizer"])
def test_large_multiplier_on_slow_layer_reaches_lower_loss(path):
    losses = {}
    for mult in (1.0, 100.0):
        with tf.Graph().as_default():
            loss, variables = _two_layer_problem()
            groups = group_variables({"slow": mult}, variables)
            if path == "scale_gradients":
                opt = tf1.train.GradientDescentOptimizer(0.3)
                train_op = opt.apply_gradients(scale_gradients(opt.compute_gradients(loss, variables), groups))
            else:
                train_op = GroupedOptimizer(lambda m: tf1.train.GradientDescentOptimizer(0.3 * m), groups).minimize(loss)
            losses[mult] = _train(loss, train_op, 30)
    assert losses[100.0] < 0.5 * losses[1.0]


def test_training_a_subset_leaves_the_others_bit_identical():
    with tf.Graph().as_default():
        tf1.set_random_seed(1)
        variables = [tf1.get_variable(n, shape=[3, 3]) for n in ["backbone/w", "backbone/v", "head/w"]]
        loss = tf.reduce_sum(tf.square(tf.matmul(tf.matmul(variables[0], variables[1]), variables[2]) - 1.0))
        groups = group_variables({"backbone/v": 0, "backbone": 0.1}, variables)
        step = tf1.train.get_or_create_global_step()
        opt = GroupedOptimizer(lambda m: tf1.train.AdamOptimizer(0.01 * m), groups)
        train_op = opt.minimize(loss, global_step=step)
        assert len(opt.optimizers) == 2 and opt.get_slot(variables[1], "m") is None
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            before = sess.run(variables)
            for _ in range(3):
                sess.run(train_op)
            after, global_step = sess.run([variables, step])
    assert global_step == 3  # one increment per step, not one per group
    assert before[1].tobytes() == after[1].tobytes()
    assert not np.array_equal(before[0], after[0]) and not np.array_equal(before[2], after[2])


def _restart_graph(checkpoint_dir, steps):
    """Build the same grouped-Adam model; train ``steps`` more steps from ``checkpoint_dir``."""
    with tf.Graph().as_default():
        tf1.set_random_seed(2)
        emb = tf1.get_variable("emb", shape=[6, 3])
        w = tf1.get_variable("body/w", shape=[3, 2])
        head = tf1.get_variable("head/w", shape=[2, 1])
        frozen = tf1.get_variable("frozen/w", shape=[1])
        loss = tf.reduce_sum(tf.square(tf.matmul(tf.matmul(tf.nn.embedding_lookup(emb, [0, 2, 5]), w), head) - frozen))
        groups = group_variables({"frozen": 0, "head": 10.0}, default=0.5)
        opt = GroupedOptimizer(lambda m: tf1.train.AdamOptimizer(0.01 * m), groups)
        train_op = opt.minimize(loss, global_step=tf1.train.get_or_create_global_step())
        state = {v.op.name: v for v in opt.variables()}
        with tf1.train.MonitoredTrainingSession(checkpoint_dir=str(checkpoint_dir), save_checkpoint_steps=1000) as sess:
            restored = sess.run(state)
            for _ in range(steps):
                sess.run(train_op)
            final = sess.run(state)
    return restored, final


def test_restart_resumes_with_per_group_optimizer_state(tmp_path):
    _, first = _restart_graph(tmp_path / "run", steps=3)
    # Slot names are those one Adam would make; non-slot state is numbered per optimizer.
    assert {"emb/Adam", "emb/Adam_1", "body/w/Adam", "head/w/Adam_1", "beta1_power", "beta1_power_1"} <= set(first)
    assert not any(name.startswith("frozen/") for name in first)
    restored, _ = _restart_graph(tmp_path / "run", steps=1)
    assert restored.keys() == first.keys()
    for name in first:
        np.testing.assert_array_equal(restored[name], first[name], err_msg=name)
    assert np.abs(first["head/w/Adam"]).sum() > 0


def test_grouped_optimizer_rejects_bad_factories():
    with tf.Graph().as_default():
        groups = group_variables({"logits": 10}, _model_vars())
        with pytest.raises(InvalidArgumentError, match="not a tf.compat.v1.train.Optimizer"):
            GroupedOptimizer(lambda m: object(), groups)
        shared = tf1.train.GradientDescentOptimizer(0.1)
        with pytest.raises(InvalidArgumentError, match="already returned"):
            GroupedOptimizer(lambda m: shared, groups)
        with pytest.raises(GroupError):
            GroupedOptimizer(lambda m: tf1.train.GradientDescentOptimizer(m), {"logits": 10})
        all_frozen = group_variables({}, tf1.trainable_variables(), default=0)
        with pytest.raises(GroupError, match="every group is frozen"):
            GroupedOptimizer(lambda m: tf1.train.GradientDescentOptimizer(m), all_frozen)


# ---------------------------------------------------------------- Keras 3


def _keras_model():
    import keras

    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, name="body"), keras.layers.Dense(6, name="neck"),
         keras.layers.Dense(1, name="head")],
        name="net",
    )


def test_keras_fit_freezes_and_scales_per_group():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    assert groups.names == ("net/body/kernel", "net/body/bias", "net/neck/kernel", "net/neck/bias",
                            "net/head/kernel", "net/head/bias")
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    assert opt.learning_rates == pytest.approx({10.0: 0.1, 1.0: 0.01})
    model.compile(opt, "mse")
    before = [v.numpy() for v in model.trainable_variables]
    x = np.random.RandomState(0).rand(32, 4).astype(np.float32)
    model.fit(x, x.sum(axis=1, keepdims=True), epochs=2, batch_size=8, verbose=0)
    after = [v.numpy() for v in model.trainable_variables]
    assert before[0].tobytes() == after[0].tobytes() and before[1].tobytes() == after[1].tobytes()
    assert all(not np.array_equal(b, a) for b, a in zip(before[2:], after[2:]))
    assert int(opt.iterations.numpy()) == 8
    assert [int(o.iterations.numpy()) for o in opt.group_optimizers.values()] == [8, 8]


def _assert_one_sgd_step(model, opt, base_rate, multipliers):
    """One ``opt.apply`` on a fixed batch moves each variable by ``-base_rate * multiplier * grad``."""
    x = np.ones((2, 4), np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    opt.apply(grads, model.trainable_variables)
    for v, b, g, m in zip(model.trainable_variables, before, grads, multipliers):
        np.testing.assert_allclose(v.numpy(), b - base_rate * m * g.numpy(), rtol=1e-5, atol=1e-7)


def test_keras_custom_step_applies_each_group_learning_rate():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    _assert_one_sgd_step(model, opt, 0.01, [0, 0, 1, 1, 10, 10])


def test_keras_optimizer_state_round_trips_with_tf_train_checkpoint(tmp_path):
    import keras

    def build():
        model = _keras_model()
        groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
        opt = grouped_keras_optimizer(lambda m: keras.optimizers.Adam(0.001 * m), groups)
        return model, opt

    model, opt = build()
    model.compile(opt, "mse")
    x = np.random.RandomState(1).rand(16, 4).astype(np.float32)
    model.fit(x, x[:, :1], epochs=1, batch_size=4, verbose=0)
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    keys = [k for k, _ in tf.train.list_variables(prefix)]
    assert "optimizer/group_0/_iterations/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert "optimizer/group_1/_variables/2/.ATTRIBUTES/VARIABLE_VALUE" in keys

    model2, opt2 = build()
    status = tf.train.Checkpoint(model=model2, optimizer=opt2).restore(prefix)
    opt2.build(model2.trainable_variables)  # restoring before build is deferred to it
    status.assert_existing_objects_matched()
    saved, restored = opt.variables, opt2.variables
    # Own iteration and learning rate; per Adam the same two plus m and v for its 2 variables.
    assert len(saved) == len(restored) == 2 + 2 * (2 + 2 * 2)
    for a, b in zip(saved, restored):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert int(opt2.group_optimizers[10.0].iterations.numpy()) == 4
    assert np.abs(opt2.group_optimizers[10.0].variables[2].numpy()).sum() > 0


def test_keras_unknown_variable_is_a_group_error():
    import keras

    model = _keras_model()
    groups = group_variables({"net/head": 10.0}, model)
    other = _keras_model()  # same paths, other variables
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    with pytest.raises(GroupError, match="not the variable these groups were built with"):
        opt.build(other.trainable_variables)
    with pytest.raises(InvalidArgumentError, match="not a Keras optimizer"):
        grouped_keras_optimizer(lambda m: tf1.train.GradientDescentOptimizer(m), groups)


# ---------------------------------------------------------------- Keras 3: one base learning rate


def _fit_with_callback(model, opt, callback, epochs):
    """Fit the _keras_model on a fixed problem with one callback; the History of the fit."""
    model.compile(opt, "mse")
    x = np.random.RandomState(0).rand(32, 4).astype(np.float32)
    return model.fit(x, x.sum(axis=1, keepdims=True), epochs=epochs, batch_size=8, verbose=0, callbacks=[callback])


def test_keras_learning_rate_scheduler_sets_each_group_to_the_schedule_times_its_multiplier():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    body = [v.numpy().tobytes() for v in model.get_layer("body").weights]
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5**epoch)
    history = _fit_with_callback(model, opt, schedule, epochs=2)
    # The callback logs the base rate it reads back at the end of each epoch.
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05])
    assert opt.learning_rates == pytest.approx({10.0: 0.5, 1.0: 0.05})
    assert [v.numpy().tobytes() for v in model.get_layer("body").weights] == body
    assert int(opt.iterations.numpy()) == 8


def test_keras_reduce_lr_on_plateau_reduces_every_group_by_the_factor():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model, default=0.1)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    # No loss improves by 1e9: every epoch after the first one reduces.
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9)
    history = _fit_with_callback(model, opt, plateau, epochs=3)
    assert history.history["learning_rate"] == pytest.approx([0.01, 0.01, 0.005])
    assert opt.learning_rates == pytest.approx({10.0: 0.025, 0.1: 0.00025})


@pytest.mark.parametrize(
    "default, factory_rates, base",
    [(1.0, {10.0: 0.3, 1.0: 0.01}, 0.01), (0.1, {10.0: 0.2, 0.1: 0.05}, 0.02)],
    # The factory's rates do not follow the multipliers, so the base shows which group it comes from.
    ids=["is-the-1x-group-rate", "without-a-1x-group-is-the-first-group-rate-over-its-multiplier"],
)
def test_keras_learning_rate_base(default, factory_rates, base):
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model, default=default)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(factory_rates[m]), groups)
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == pytest.approx(base)

    opt.learning_rate = 0.02
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == pytest.approx(0.02)
    assert opt.learning_rates == pytest.approx({10.0: 0.2, default: 0.02 * default})
    # The next step uses the new rates.
    _assert_one_sgd_step(model, opt, 0.02, [0, 0, default, default, 10, 10])

    opt.learning_rate = tf.constant(0.04, tf.float64)  # a tensor is scaled as well
    assert opt.learning_rates == pytest.approx({10.0: 0.4, default: 0.04 * default})


def test_keras_learning_rate_cannot_be_set_when_a_group_has_a_schedule():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(decay if m == 10.0 else 0.01), groups)
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == pytest.approx(0.01)  # reading works
    with pytest.raises(InvalidArgumentError, match=r"the 10x group has a learning-rate schedule.*Nothing was changed"):
        opt.learning_rate = 0.5
    assert opt.learning_rates == pytest.approx({10.0: 0.1, 1.0: 0.01})
    # Keras callbacks meet the same error, before the first step.
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1)
    with pytest.raises(InvalidArgumentError, match="10x group has a learning-rate schedule"):
        _fit_with_callback(model, opt, schedule, epochs=1)
    assert opt.learning_rates == pytest.approx({10.0: 0.1, 1.0: 0.01})
    assert int(opt.iterations.numpy()) == 0


@pytest.mark.parametrize("case", ["negative", "nan", "a-schedule", "a-string"])
def test_keras_learning_rate_rejects_a_bad_value_and_changes_nothing(case):
    import keras

    value = {
        "negative": -0.1,
        "nan": float("nan"),
        "a-schedule": keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5),
        "a-string": "0.1",
    }[case]
    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    with pytest.raises(InvalidArgumentError, match="learning_rate must be"):
        opt.learning_rate = value
    assert opt.learning_rates == pytest.approx({10.0: 0.1, 1.0: 0.01})


def test_grouped_optimizer_drives_tf_slim_create_train_op():
    import tf_slim as slim

    with tf.Graph().as_default():
        loss, (slow, fast) = _two_layer_problem()
        groups = group_variables({"fast": 0}, [slow, fast])
        opt = GroupedOptimizer(lambda m: tf1.train.GradientDescentOptimizer(0.1 * m), groups)
        # create_train_op asks for gradients of every trainable variable; the frozen one is dropped.
        train_op = slim.learning.create_train_op(loss, opt, global_step=tf1.train.get_or_create_global_step())
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(2):
                sess.run(train_op)
            slow_value, fast_value, step = sess.run([slow, fast, tf1.train.get_global_step()])
    assert step == 2
    assert fast_value.tobytes() == np.zeros([1], np.float32).tobytes()
    assert slow_value[0, 0] != 0


# ---------------------------------------------------------------- Keras 3 under MirroredStrategy

# body frozen, neck in the default group (1x), head at 0.1x; in model.trainable_variables order.
MIRRORED_RULES = {"net/body": 0, "net/head": 0.1}
MIRRORED_MULTIPLIERS = [0, 0, 1, 1, 0.1, 0.1]
MIRRORED_LEARNING_RATE = 0.1


def _mirrored_grouped_model(optimizer_class, **kwargs):
    """_keras_model and its grouped optimizer under a 2-replica MirroredStrategy, and a batch of 8."""
    import keras

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = _keras_model()
        groups = group_variables(MIRRORED_RULES, model)
        opt = grouped_keras_optimizer(
            lambda m: getattr(keras.optimizers, optimizer_class)(MIRRORED_LEARNING_RATE * m, **kwargs), groups
        )
    x = np.random.RandomState(0).rand(8, 4).astype(np.float32)
    return strategy, model, opt, x, x.sum(axis=1, keepdims=True)


def _one_sgd_step_without_strategy(initial, x, y):
    """w - lr * multiplier * grad, where grad is the mean-squared-error gradient over the whole batch."""
    reference = _keras_model()
    reference.set_weights(initial)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(reference(x) - y))
    grads = tape.gradient(loss, reference.trainable_variables)
    return [w - MIRRORED_LEARNING_RATE * m * g.numpy() for w, g, m in zip(initial, grads, MIRRORED_MULTIPLIERS)]


def _assert_every_replica_took_the_step(strategy, model, initial, expected):
    for v, before, want, mult in zip(model.trainable_variables, initial, expected, MIRRORED_MULTIPLIERS):
        copies = strategy.experimental_local_results(v.value)
        assert len(copies) == 2, v.path
        for copy in copies:
            if mult == 0:
                assert copy.numpy().tobytes() == before.tobytes(), f"{v.path} on {copy.device} moved"
            else:
                # The step is far larger than the tolerance: a summed (2x) or per-replica
                # gradient, or another group's multiplier, fails here.
                assert np.abs(want - before).max() > 1e-3, v.path
                np.testing.assert_allclose(
                    copy.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"{v.path} on {copy.device}"
                )


def test_keras_fit_under_mirrored_strategy_matches_one_step_on_the_global_batch():
    strategy, model, opt, x, y = _mirrored_grouped_model("SGD")
    with strategy.scope():
        model.compile(opt, "mse")
    initial = [v.numpy() for v in model.trainable_variables]
    expected = _one_sgd_step_without_strategy(initial, x, y)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_every_replica_took_the_step(strategy, model, initial, expected)
    # One step in all: not one per replica, and not one per group optimizer on the wrapper.
    assert int(opt.iterations.numpy()) == 1
    assert [int(o.iterations.numpy()) for o in opt.group_optimizers.values()] == [1, 1]


@pytest.mark.parametrize(
    "optimizer_class, kwargs",
    [("SGD", {}), ("SGD", {"momentum": 0.9})],
    # The first momentum step equals plain SGD (m = -lr * grad), and it needs mirrored slots.
    ids=["sgd", "sgd-with-momentum-slots"],
)
def test_keras_custom_step_under_mirrored_strategy_matches_one_step_on_the_global_batch(optimizer_class, kwargs):
    strategy, model, opt, x, y = _mirrored_grouped_model(optimizer_class, **kwargs)
    with strategy.scope():
        opt.build(model.trainable_variables)  # slots are created under the scope, as Keras asks
    initial = [v.numpy() for v in model.trainable_variables]
    expected = _one_sgd_step_without_strategy(initial, x, y)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    x_batch, y_batch = next(iter(dataset))
    assert [t.shape[0] for t in strategy.experimental_local_results(x_batch)] == [4, 4]

    def replica_step(x_batch, y_batch):
        with tf.GradientTape() as tape:
            per_example = tf.square(model(x_batch) - y_batch)[:, 0]
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=8)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    tf.function(lambda a, b: strategy.run(replica_step, args=(a, b)))(x_batch, y_batch)
    _assert_every_replica_took_the_step(strategy, model, initial, expected)
    assert int(opt.iterations.numpy()) == 1
    assert [int(o.iterations.numpy()) for o in opt.group_optimizers.values()] == [1, 1]
