"""easy_going_scaffold in MonitoredTrainingSession: one machine, restart, and a ps/worker cluster."""

import socket
import threading

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import Checkpoint, IncompleteRestoreError
from conftest import save_variables

tf1 = tf.compat.v1


@pytest.mark.slow
def test_resnet_finetune_in_monitored_session_then_restart_resumes(resnet_checkpoint, tmp_path):
    from test_scan import build_finetune_graph

    ckpt = Checkpoint(resnet_checkpoint)
    train_dir = str(tmp_path / "train")
    with tf.Graph().as_default():
        _, train = build_finetune_graph()
        scaffold = restorekit.easy_going_scaffold(resnet_checkpoint)
        report = scaffold.restore_report
        handles = {v.op.name: v for v in tf1.global_variables()}
        matched = [r.variable_name for r in report.matched]
        # The saver hook writes train_dir's checkpoint when the session ends.
        with tf1.train.MonitoredTrainingSession(
            scaffold=scaffold, checkpoint_dir=train_dir, save_checkpoint_steps=100, save_checkpoint_secs=None
        ) as sess:
            got = sess.run({n: handles[n] for n in matched})
            for name in matched:
                np.testing.assert_array_equal(got[name], ckpt.read(name), err_msg=name)
            sess.run(train)
            after = sess.run(handles["resnet_v1_50/conv1/weights"])
            step = sess.run(tf1.train.get_global_step())
    assert step == 1
    assert not np.array_equal(after, ckpt.read("resnet_v1_50/conv1/weights"))

    # Restart: the checkpoint in train_dir wins; the pretrained one is not re-read.
    with tf.Graph().as_default():
        _, train = build_finetune_graph()
        scaffold = restorekit.easy_going_scaffold(resnet_checkpoint)
        conv1 = [v for v in tf1.global_variables() if v.op.name == "resnet_v1_50/conv1/weights"][0]
        with tf1.train.MonitoredTrainingSession(
            scaffold=scaffold, checkpoint_dir=train_dir, save_checkpoint_steps=None, save_checkpoint_secs=None
        ) as sess:
            assert sess.run(tf1.train.get_global_step()) == 1
            np.testing.assert_array_equal(sess.run(conv1), after)


def test_strict_scaffold_raises_with_the_report(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", [4, 3])
        tf1.get_variable("brand_new", [2])
        ops_before = len(tf1.get_default_graph().get_operations())
        with pytest.raises(IncompleteRestoreError, match="brand_new") as info:
            restorekit.easy_going_scaffold(prefix, strict=True)
        assert [r.variable_name for r in info.value.report.missing] == ["brand_new"]
        assert len(tf1.get_default_graph().get_operations()) == ops_before


def test_scaffold_initializes_only_what_it_does_not_restore(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", [4, 3])
        new = tf1.get_variable("new", [2], initializer=tf1.constant_initializer(5.0))
        tf1.train.get_or_create_global_step()
        scaffold = restorekit.easy_going_scaffold(prefix)
        init_inputs = {op.name for op in scaffold.init_op.control_inputs}
        assert "dense/kernel/Assign" not in init_inputs and "new/Assign" in init_inputs
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=str(tmp_path / "t")) as sess:
            np.testing.assert_array_equal(sess.run(kernel), values["dense/kernel"])
            np.testing.assert_array_equal(sess.run(new), [5.0, 5.0])


def test_scaffold_with_one_tensor_feeding_two_variables_falls_back_to_warm_start(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        a = tf1.get_variable("a", [3])
        b = tf1.get_variable("b", [3])
        tf1.train.get_or_create_global_step()
        scaffold = restorekit.easy_going_scaffold(prefix, assignment_map={"dense/bias": ["a", "b"]})
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=str(tmp_path / "t")) as sess:
            np.testing.assert_array_equal(sess.run(a), values["dense/bias"])
            np.testing.assert_array_equal(sess.run(b), values["dense/bias"])


# ---------------------------------------------------------------- ps/worker cluster


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow
def test_cluster_of_one_ps_and_two_workers(tmp_path):
    rng = np.random.RandomState(1)
    values = {
        "emb": rng.randn(12, 4).astype(np.float32),  # saved whole, restored into 3 partitions on the ps
        "dense/kernel": rng.randn(4, 2).astype(np.float32),
        "dense/kernel/Momentum": rng.randn(4, 2).astype(np.float32),
        "global_step": np.int64(500),
    }
    prefix = save_variables(tmp_path / "pre" / "model.ckpt", values)
    ps_port, w0_port, w1_port = _free_ports(3)
    cluster = tf1.train.ClusterSpec(
        {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{w0_port}", f"127.0.0.1:{w1_port}"]}
    )
    servers = [
        tf1.train.Server(cluster, job_name="ps", task_index=0, start=True),
        tf1.train.Server(cluster, job_name="worker", task_index=0, start=True),
        tf1.train.Server(cluster, job_name="worker", task_index=1, start=True),
    ]
    seen = {}
    steps = {}
    errors = []
    barrier = threading.Barrier(2, timeout=120)
    train_dir = str(tmp_path / "train")

    def worker(index):
        try:
            with tf.Graph().as_default():
                setter = tf1.train.replica_device_setter(worker_device=f"/job:worker/task:{index}", cluster=cluster)
                with tf1.device(setter):
                    emb = tf1.get_variable("emb", [12, 4], partitioner=tf1.fixed_size_partitioner(3))
                    kernel = tf1.get_variable("dense/kernel", [4, 2])
                    extra = tf1.get_variable("extra", [2], initializer=tf1.ones_initializer())
                    step = tf1.train.get_or_create_global_step()
                    ids = tf.constant([0, 5, 11])
                    loss = tf.reduce_sum(tf.matmul(tf.nn.embedding_lookup(emb, ids), kernel) * extra)
                    train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, global_step=step)
                reads = {"emb": tf.concat(list(emb), 0), "kernel": kernel, "extra": extra, "step": step}
                scaffold = restorekit.easy_going_scaffold(prefix)
                assert [p.device for p in emb][0].startswith("/job:ps")
                with tf1.train.MonitoredTrainingSession(
                    master=servers[1 + index].target,
                    is_chief=index == 0,
                    checkpoint_dir=train_dir if index == 0 else None,
                    scaffold=scaffold,
                    save_checkpoint_steps=None,
                    save_checkpoint_secs=None,
                    config=tf1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{index}"]),
                ) as sess:
                    seen[index] = sess.run(reads)
                    barrier.wait()  # both have read the restored values before anyone trains
                    for _ in range(3):
                        sess.run(train)
                    barrier.wait()
                    steps[index] = sess.run(step)
                    barrier.wait()
        except Exception as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    for index in (0, 1):
        np.testing.assert_array_equal(seen[index]["emb"], values["emb"])
        np.testing.assert_array_equal(seen[index]["kernel"], values["dense/kernel"])
        np.testing.assert_array_equal(seen[index]["extra"], [1.0, 1.0])
        assert seen[index]["step"] == 0  # global_step is not restored by default
    assert steps[0] == steps[1] == 6  # both workers trained


def test_restart_with_checkpoint_dir_does_not_need_the_pretrained_checkpoint(small_checkpoint, tmp_path, caplog):
    import logging
    import shutil

    prefix, values = small_checkpoint
    train_dir = str(tmp_path / "train")

    def build():
        kernel = tf1.get_variable("dense/kernel", [4, 3])
        step = tf1.train.get_or_create_global_step()
        return kernel, tf1.assign_add(step, 1)

    with tf.Graph().as_default():
        kernel, train_op = build()
        bump = kernel.assign_add(tf.ones([4, 3]))
        scaffold = restorekit.easy_going_scaffold(prefix, checkpoint_dir=train_dir)
        assert scaffold.restore_report is not None
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=train_dir, save_checkpoint_steps=1,
                                                save_checkpoint_secs=None) as sess:
            sess.run(bump)
            sess.run(train_op)
    shutil.rmtree(tmp_path / "ckpt")  # the pretrained checkpoint is gone
    with tf.Graph().as_default():
        kernel, _ = build()
        with caplog.at_level(logging.INFO, logger="restorekit"):
            scaffold = restorekit.easy_going_scaffold(prefix, checkpoint_dir=train_dir)
        assert scaffold.restore_report is None
        assert caplog.text.count("resumed from") == 1 and train_dir in caplog.text
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=train_dir,
                                                save_checkpoint_secs=None) as sess:
            np.testing.assert_array_equal(sess.run(kernel), values["dense/kernel"] + 1)


def _scoped_graph():
    """The net of ``small_checkpoint`` built under an extra ``model/`` scope (nothing matches by name)."""
    with tf1.variable_scope("model"):
        for layer, shape in (("dense", [4, 3]), ("logits", [3, 5])):
            tf1.get_variable(f"{layer}/kernel", shape)
            tf1.get_variable(f"{layer}/bias", shape[-1:])
    tf1.train.get_or_create_global_step()


def test_scaffold_that_matches_nothing_raises_with_the_scope_hint(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        _scoped_graph()
        with pytest.raises(restorekit.NoMatchError, match="nothing in .* matched") as info:
            restorekit.easy_going_scaffold(prefix)
    text = str(info.value)
    assert "missing        4" in text and "unused         4" in text
    assert "4 of the 4 missing variables are in the checkpoint under another scope" in text
    assert "assignment_map={'/': 'model/'}" in text


def test_scaffold_following_the_scope_hint_restores_every_value(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        _scoped_graph()
        scaffold = restorekit.easy_going_scaffold(prefix, assignment_map={"/": "model/"})
        assert len(scaffold.restore_report.matched) == 4
        handles = {v.op.name: v for v in tf1.global_variables()}
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=str(tmp_path / "t")) as sess:
            for name in ("dense/kernel", "dense/bias", "logits/kernel", "logits/bias"):
                np.testing.assert_array_equal(sess.run(handles["model/" + name]), values[name])


def test_scaffold_that_matches_nothing_still_resumes_from_checkpoint_dir(small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    train_dir = str(tmp_path / "train")
    with tf.Graph().as_default():
        _scoped_graph()
        kernel = [v for v in tf1.global_variables() if v.op.name == "model/dense/kernel"][0]
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(kernel.assign(np.full((4, 3), 2.5, np.float32)))
            sess.run(tf1.train.get_global_step().assign(3))
            tf1.train.Saver().save(sess, train_dir + "/model.ckpt", global_step=3)
    with tf.Graph().as_default():
        _scoped_graph()
        kernel = [v for v in tf1.global_variables() if v.op.name == "model/dense/kernel"][0]
        scaffold = restorekit.easy_going_scaffold(prefix, checkpoint_dir=train_dir)
        assert scaffold.restore_report is None
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=train_dir,
                                                save_checkpoint_secs=None, save_checkpoint_steps=None) as sess:
            np.testing.assert_array_equal(sess.run(kernel), np.full((4, 3), 2.5, np.float32))
            assert sess.run(tf1.train.get_global_step()) == 3


def test_scaffold_that_matches_some_still_restores_them(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", [4, 3])
        tf1.get_variable("model/other", [2])
        tf1.train.get_or_create_global_step()
        scaffold = restorekit.easy_going_scaffold(prefix)
        assert [r.variable_name for r in scaffold.restore_report.matched] == ["dense/kernel"]
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=str(tmp_path / "t")) as sess:
            np.testing.assert_array_equal(sess.run(kernel), values["dense/kernel"])


# ---------------------------------------------------------------- which checkpoint a restart resumes from

def saver_run(train_dir: str) -> None:
    """A TF1 Saver run: model.ckpt-10, -20, -30, dense/kernel filled with the step at each."""
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", [4, 3])
        step = tf1.train.get_or_create_global_step()
        saver = tf1.train.Saver(max_to_keep=5)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for n in (10, 20, 30):
                sess.run([kernel.assign(np.full((4, 3), n, np.float32)), step.assign(n)])
                saver.save(sess, train_dir + "/model.ckpt", global_step=n)


def resumed_kernel_and_step(prefix: str, train_dir: str):
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", [4, 3])
        tf1.train.get_or_create_global_step()
        scaffold = restorekit.easy_going_scaffold(prefix, checkpoint_dir=train_dir)
        assert scaffold.restore_report is None
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=train_dir,
                                                save_checkpoint_secs=None, save_checkpoint_steps=None) as sess:
            return sess.run(kernel), sess.run(tf1.train.get_global_step())


@pytest.mark.parametrize("damage", ["vanished", "truncated-index"], ids=["latest-vanished", "latest-index-truncated"])
def test_restart_resumes_from_the_newest_readable_checkpoint_not_the_state_files_latest(small_checkpoint, tmp_path,
                                                                                        damage):
    import os

    prefix, _ = small_checkpoint
    train_dir = str(tmp_path / "train")
    saver_run(train_dir)
    latest = os.path.join(train_dir, "model.ckpt-30")
    if damage == "vanished":
        for name in os.listdir(train_dir):
            if name.startswith("model.ckpt-30."):
                os.remove(os.path.join(train_dir, name))
    else:
        with open(latest + ".index", "r+b") as f:
            f.truncate(40)
    with pytest.warns(restorekit.RestoreKitWarning, match=r"(?s)from '.*model.ckpt-20'.*model.ckpt-30'"):
        kernel, step = resumed_kernel_and_step(prefix, train_dir)
    np.testing.assert_array_equal(kernel, np.full((4, 3), 20, np.float32))
    assert step == 20
    # the session restored what the state file names: it now names model.ckpt-20
    assert tf.train.get_checkpoint_state(train_dir).model_checkpoint_path == os.path.join(train_dir, "model.ckpt-20")


def test_restart_in_a_copied_run_directory_is_refused_not_resumed_from_the_original(small_checkpoint, tmp_path):
    import os
    import shutil

    prefix, _ = small_checkpoint
    train_dir, fork = str(tmp_path / "train"), str(tmp_path / "fork")
    saver_run(train_dir)
    shutil.copytree(train_dir, fork)  # the Saver's state file names absolute paths: the copy names the original
    before = {name: open(os.path.join(fork, name), "rb").read() for name in os.listdir(fork)}
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", [4, 3])
        tf1.train.get_or_create_global_step()
        with pytest.raises(restorekit.RunDirectoryError, match=r"names '.*train/model.ckpt-30'.*outside"):
            restorekit.easy_going_scaffold(prefix, checkpoint_dir=fork)
    assert {name: open(os.path.join(fork, name), "rb").read() for name in os.listdir(fork)} == before
