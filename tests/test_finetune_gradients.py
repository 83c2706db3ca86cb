"""Tests for restorekit/finetune/_gradients.py: scale_gradients and the (gradient, variable) pairs it takes."""

import re

import numpy as np
import pytest
import tensorflow as tf
from test_finetune import _model_vars, _var

from restorekit.errors import GroupError, InvalidArgumentError
from restorekit.finetune import GroupedOptimizer, group_variables, scale_gradients

tf1 = tf.compat.v1


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


# ---------------------------------------------------------------- what is not a list of pairs


def _bad_grads_and_vars(case, grad, a):
    """(what is given, words the error must hold) for each shape of mistake."""
    return {
        "bare-pair": ((grad, a), "got one pair (<tf.Tensor 'ones:0'"),
        "bare-pair-none-gradient": ((None, a), "got one pair (None, "),
        "list-of-none": ([None], "grads_and_vars[0] is None, not a (gradient, variable) pair"),
        "one-tuple": ([(grad,)], "grads_and_vars[0] is a tuple of 1 item, not a (gradient, variable) pair"),
        "three-tuple": ([(grad, a, 1.0)], "grads_and_vars[0] is a tuple of 3 items, not"),
        "second-item-not-a-pair": ([(grad, a), grad], "grads_and_vars[1] is <tf.Tensor 'ones:0'"),
        "swapped-pair": ([(a, grad)], "grads_and_vars[0] holds <tf.Tensor 'ones:0'"),
        "not-iterable": (5, "got int 5"),
        "a-string": ("a", "got str 'a'"),
        "a-tensor": (grad, "got <tf.Tensor 'ones:0'"),
        "a-dict": ({a: grad}, "got dict"),
    }[case]


BAD_CASES = [
    "bare-pair", "bare-pair-none-gradient", "list-of-none", "one-tuple", "three-tuple",
    "second-item-not-a-pair", "swapped-pair", "not-iterable", "a-string", "a-tensor", "a-dict",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_scale_gradients_rejects_what_is_not_a_list_of_pairs(case):
    with tf.Graph().as_default() as graph:
        grad = tf.ones([2, 3])
        a = _var("a")
        groups = group_variables({"a": 2.0}, [a])
        given, words = _bad_grads_and_vars(case, grad, a)
        ops_before = len(graph.get_operations())
        with pytest.raises(InvalidArgumentError) as info:
            scale_gradients(given, groups)
        assert len(graph.get_operations()) == ops_before  # nothing built
    # restorekit's own error, not TF's or Python's TypeError, and not a GroupError: the
    # groups are fine, the pairs are not.
    assert type(info.value) is InvalidArgumentError
    assert words in str(info.value)
    assert "(gradient, variable)" in str(info.value)


@pytest.mark.parametrize("case", ["bare-pair", "three-tuple", "swapped-pair"])
def test_grouped_optimizer_apply_gradients_rejects_what_is_not_a_list_of_pairs(case):
    with tf.Graph().as_default() as graph:
        grad = tf.ones([2, 3])
        a = _var("a")
        opt = GroupedOptimizer(lambda m: tf1.train.GradientDescentOptimizer(0.1 * m), group_variables({"a": 2.0}, [a]))
        given, words = _bad_grads_and_vars(case, grad, a)
        ops_before = len(graph.get_operations())
        with pytest.raises(InvalidArgumentError, match=re.escape(words)) as info:
            opt.apply_gradients(given)
        assert len(graph.get_operations()) == ops_before
    assert type(info.value) is InvalidArgumentError


def test_scale_gradients_takes_any_iterable_of_pairs():
    with tf.Graph().as_default():
        a, b = _var("a"), _var("b")
        groups = group_variables({"a": 0}, [a, b])
        grad = tf.ones([2, 3])
        assert scale_gradients(((grad, a), (grad, b)), groups) == [(grad, b)]  # a tuple of pairs
        assert scale_gradients(iter([[grad, a], [None, b]]), groups) == [(None, b)]  # pairs as lists
        assert scale_gradients([], groups) == []


def test_scale_gradients_rejects_a_bare_pair_and_a_tensor_eagerly():
    w = tf.Variable(tf.ones([3]), name="w")
    groups = group_variables({"w": 2.0}, [w])
    grad = tf.constant([1.0, 2.0, 3.0])
    with pytest.raises(InvalidArgumentError, match=r"got one pair \(<tf.Tensor: shape=\(3,\)") as info:
        scale_gradients((grad, w), groups)
    assert type(info.value) is InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="got <tf.Tensor: shape=") as info:
        scale_gradients(grad, groups)  # an eager tensor iterates, but is no list of pairs
    assert type(info.value) is InvalidArgumentError
    (scaled, var), = scale_gradients([(grad, w)], groups)
    assert var is w
    np.testing.assert_allclose(scaled.numpy(), [2.0, 4.0, 6.0])
