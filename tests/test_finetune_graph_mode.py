"""Tests for restorekit/finetune/_graph_mode.py: GroupedOptimizer trains TF1 graphs group by group."""

import numpy as np
import pytest
import tensorflow as tf
from test_finetune import _model_vars

from restorekit.errors import GroupError, InvalidArgumentError
from restorekit.finetune import GroupedOptimizer, group_variables, scale_gradients

tf1 = tf.compat.v1


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
