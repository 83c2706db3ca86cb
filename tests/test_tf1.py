"""restorekit._tf1 (partial_saver, warm_start, assign_from_checkpoint_fn) and uninitialized-only initializers."""

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import Checkpoint, scan
from conftest import save_variables

tf1 = tf.compat.v1


def test_partial_saver_finds_variables_outside_every_collection(small_checkpoint):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        hidden = tf1.Variable(np.zeros([4, 3], np.float32), name="dense/kernel", collections=[])
        assert hidden not in tf1.global_variables()
        report = scan(prefix, [hidden])
        saver = restorekit.partial_saver(report)
        with tf1.Session() as sess:
            saver.restore(sess, prefix)
            np.testing.assert_array_equal(sess.run(hidden), values["dense/kernel"])


def test_partial_saver_restores_only_matches_and_leaves_the_rest(small_checkpoint):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", [4, 3])
        head = tf1.get_variable("logits/kernel", [3, 10], initializer=tf1.constant_initializer(7.0))
        report = scan(prefix)
        saver = restorekit.partial_saver(report)
        assert sorted(saver._var_list) == ["dense/kernel"]
        with tf1.Session() as sess:
            sess.run(restorekit.uninitialized_initializer())
            saver.restore(sess, prefix)
            np.testing.assert_array_equal(sess.run(kernel), values["dense/kernel"])
            np.testing.assert_array_equal(sess.run(head), np.full([3, 10], 7.0))


def test_assign_from_checkpoint_fn(small_checkpoint):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        bias = tf1.get_variable("logits/bias", [5])
        restore = restorekit.assign_from_checkpoint_fn(scan(prefix))
        tf1.get_default_graph().finalize()
        with tf1.Session() as sess:
            restore(sess)
            np.testing.assert_array_equal(sess.run(bias), values["logits/bias"])


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_warm_start_overrides_initializers(small_checkpoint, use_resource):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", [4, 3], use_resource=use_resource)
        fresh = tf1.get_variable("fresh", [2], initializer=tf1.ones_initializer(), use_resource=use_resource)
        restorekit.warm_start(scan(prefix))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(kernel), values["dense/kernel"])
            np.testing.assert_array_equal(sess.run(fresh), [1.0, 1.0])


def test_uninitialized_initializer_leaves_restored_values(small_checkpoint):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", [4, 3])
        other = tf1.get_variable("other", [2], initializer=tf1.constant_initializer(2.0))
        part = tf1.get_variable("p", [6, 2], partitioner=tf1.fixed_size_partitioner(2), initializer=tf1.ones_initializer())
        init = restorekit.uninitialized_initializer()
        saver = restorekit.partial_saver(scan(prefix, [kernel]))
        with tf1.Session() as sess:
            saver.restore(sess, prefix)
            sess.run(init)
            sess.run(init)  # idempotent
            np.testing.assert_array_equal(sess.run(kernel), values["dense/kernel"])
            np.testing.assert_array_equal(sess.run(other), [2.0, 2.0])
            np.testing.assert_array_equal(sess.run(tf.concat(list(part), 0)), np.ones([6, 2]))


def test_initialize_uninitialized_returns_the_names(small_checkpoint):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", [4, 3])
        tf1.get_variable("a", [1])
        tf1.get_variable("b", [1], use_resource=False)
        saver = restorekit.partial_saver(scan(prefix))
        with tf1.Session() as sess:
            saver.restore(sess, prefix)
            assert restorekit.initialize_uninitialized(sess) == ["a", "b"]
            assert restorekit.initialize_uninitialized(sess) == []
            np.testing.assert_array_equal(sess.run(kernel), values["dense/kernel"])


@pytest.mark.slow
def test_resnet_partial_restore_values_equal_checkpoint(resnet_checkpoint):
    from test_scan import build_finetune_graph

    ckpt = Checkpoint(resnet_checkpoint)
    with tf.Graph().as_default():
        build_finetune_graph()
        report = scan(resnet_checkpoint)
        saver = restorekit.partial_saver(report)
        handles = {v.op.name: v for v in tf1.global_variables()}
        with tf1.Session() as sess:
            sess.run(restorekit.uninitialized_initializer())
            saver.restore(sess, resnet_checkpoint)
            matched = [r.variable_name for r in report.matched]
            got = sess.run({n: handles[n] for n in matched})
            head = sess.run(handles["resnet_v1_50/logits/weights"])
    assert len(matched) > 250
    for name in matched:
        np.testing.assert_array_equal(got[name], ckpt.read(name), err_msg=name)
    assert head.shape == (1, 1, 256, 10)


def test_partial_saver_with_nothing_matched_is_an_error(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("unrelated", [1])
        with pytest.raises(restorekit.InvalidArgumentError, match="nothing"):
            restorekit.partial_saver(scan(prefix))


def test_unpickled_report_cannot_build_a_saver(small_checkpoint):
    import pickle

    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", [4, 3])
        report = pickle.loads(pickle.dumps(scan(prefix)))
        with pytest.raises(restorekit.InvalidArgumentError, match="scan again"):
            restorekit.partial_saver(report)


def test_policy_matches_go_through_warm_start_and_the_scaffold_not_the_saver(tmp_path):
    rng = np.random.RandomState(3)
    values = {"head/kernel": rng.randn(4, 1000).astype(np.float32), "body/w": rng.randn(3).astype(np.float32)}
    prefix = save_variables(tmp_path / "ckpt" / "m", values)
    with tf.Graph().as_default():
        head = tf1.get_variable("head/kernel", [4, 1001], initializer=tf1.constant_initializer(9.0))
        body = tf1.get_variable("body/w", [3])
        tf1.train.get_or_create_global_step()
        report = scan(prefix, shape_policy="slice_or_pad")
        assert {r.variable_name: r.reason for r in report.matched} == {"head/kernel": "slice_or_pad", "body/w": ""}
        saver = restorekit.partial_saver(report)
        assert sorted(saver._var_list) == ["body/w"]
        scaffold = restorekit.easy_going_scaffold(prefix, shape_policy="slice_or_pad")
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=str(tmp_path / "train")) as sess:
            got_head, got_body = sess.run([head, body])
    np.testing.assert_array_equal(got_head[:, :1000], values["head/kernel"])  # the 1000 trained classes
    np.testing.assert_array_equal(got_head[:, 1000], np.full(4, 9.0))  # the new class from its initializer
    np.testing.assert_array_equal(got_body, values["body/w"])
