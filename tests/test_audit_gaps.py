"""Audit tests: issue bullets that had no test of their own (issues 2, 4 and 5).

* issue 2: optimizer slot entries of the TF1 optimizers the issue names (RMSProp,
  Adagrad, ...) and BERT's adam_m/adam_v are recognized, not reported unused/missing;
* issue 4: shard reuse falls back to a copy across filesystems; peak memory while
  saving stays near the largest tensor, not the checkpoint size; strip_optimizer_slots
  on a real Keras 3 checkpoint (weights saved under 'optimizer/...' keys are kept);
* issue 5: unfreeze of a frozen graph holding no weight constants is a clear error.
"""

import errno
import os
import tracemalloc

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit.bundle.writer import BundleWriter
from restorekit.checkpoint import Checkpoint
from restorekit.edit import CheckpointEditor
from restorekit.errors import GraphError
from conftest import save_variables

tf1 = tf.compat.v1


# ---------------------------------------------------------------- issue 2: slot recognition


TF1_OPTIMIZERS = {
    "Momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
    "Adam": lambda: tf1.train.AdamOptimizer(0.1),
    "RMSProp": lambda: tf1.train.RMSPropOptimizer(0.1, momentum=0.5),
    "Adagrad": lambda: tf1.train.AdagradOptimizer(0.1),
    "Adadelta": lambda: tf1.train.AdadeltaOptimizer(0.1),
    "Ftrl": lambda: tf1.train.FtrlOptimizer(0.1),
}


@pytest.mark.parametrize("optimizer", list(TF1_OPTIMIZERS), ids=list(TF1_OPTIMIZERS))
def test_tf1_optimizer_state_in_a_real_checkpoint_is_skipped_as_slots(tmp_path, optimizer):
    prefix = str(tmp_path / "ckpt" / "model.ckpt")
    with tf.Graph().as_default():
        w = tf1.get_variable("net/w", [3, 2])
        b = tf1.get_variable("net/b", [2])
        loss = tf.reduce_sum(tf.square(tf.matmul(tf.ones([1, 3]), w) + b))
        step = tf1.train.get_or_create_global_step()
        train = TF1_OPTIMIZERS[optimizer]().minimize(loss, global_step=step)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train)
            tf1.train.Saver().save(sess, prefix)
    ckpt = Checkpoint(prefix)
    optimizer_entries = set(ckpt) - {"net/w", "net/b", "global_step"}
    assert optimizer_entries  # the optimizer saved state of its own
    with tf.Graph().as_default():
        tf1.get_variable("net/w", [3, 2])
        tf1.get_variable("net/b", [2])
        report = restorekit.scan(prefix)
    assert {r.variable_name for r in report.matched} == {"net/w", "net/b"}
    assert report.unused == () and report.missing == () and report.is_complete
    slots = {r.checkpoint_name for r in report.skipped if r.reason.startswith("optimizer slot")}
    assert slots == optimizer_entries


def test_bert_style_adam_m_and_adam_v_are_slots(tmp_path):
    values = {
        "bert/encoder/layer_0/kernel": np.ones([2, 2], np.float32),
        "bert/encoder/layer_0/kernel/adam_m": np.ones([2, 2], np.float32),
        "bert/encoder/layer_0/kernel/adam_v": np.ones([2, 2], np.float32),
    }
    prefix = save_variables(tmp_path / "bert" / "model.ckpt", values)
    with tf.Graph().as_default():
        tf1.get_variable("bert/encoder/layer_0/kernel", [2, 2])
        report = restorekit.scan(prefix)
    assert [r.variable_name for r in report.matched] == ["bert/encoder/layer_0/kernel"]
    assert report.unused == ()
    assert {r.checkpoint_name: r.reason for r in report.skipped} == {
        "bert/encoder/layer_0/kernel/adam_m": "optimizer slot (Adam (BERT))",
        "bert/encoder/layer_0/kernel/adam_v": "optimizer slot (Adam (BERT))",
    }


# ---------------------------------------------------------------- issue 4: shards, memory, TF2 strip


def test_shards_are_copied_when_hard_links_fail_across_filesystems(small_checkpoint, tmp_path, monkeypatch):
    prefix, values = small_checkpoint

    def no_link(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link", src)

    monkeypatch.setattr(os, "link", no_link)
    ed = CheckpointEditor(prefix)
    ed.rename("dense/kernel", "encoder/kernel")
    out = ed.save(tmp_path / "out" / "m")
    src_data = os.stat(prefix + ".data-00000-of-00001")
    out_data = os.stat(out + ".data-00000-of-00001")
    assert out_data.st_ino != src_data.st_ino and out_data.st_size == src_data.st_size  # a copy, not a link
    reader = tf.train.load_checkpoint(out)
    np.testing.assert_array_equal(reader.get_tensor("encoder/kernel"), values["dense/kernel"])
    np.testing.assert_array_equal(Checkpoint(prefix).read("dense/kernel"), values["dense/kernel"])


MIB = 1 << 20
TENSOR_MIB = 4  # every tensor; the checkpoint holds 12 of them (48 MiB)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("big") / "m")
    rng = np.random.RandomState(0)
    with BundleWriter(prefix) as w:
        for i in range(12):
            w.add(f"layer_{i:02d}/kernel", rng.rand(TENSOR_MIB * MIB // 4).astype(np.float32))
    return prefix


def _peak_mib(action):
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "edit",
    ["set-one", "cast-all", "rename-all", "strip-half"],
)
def test_peak_memory_while_saving_is_near_the_largest_tensor_not_the_checkpoint(big_checkpoint, tmp_path, edit):
    """Issue 4: peak memory is at most the largest tensor plus a small constant.

    tracemalloc sees numpy and bytes allocations; the bound (3 tensors + 4 MiB = 16 MiB)
    is a third of the 48 MiB checkpoint, so reading everything at once would fail it.
    """
    ed = CheckpointEditor(big_checkpoint)
    if edit == "set-one":
        ed.set("layer_03/kernel", np.zeros(TENSOR_MIB * MIB // 4, np.float32))
    elif edit == "cast-all":
        ed.cast(".*", "bfloat16")
    elif edit == "rename-all":
        ed.rename_all([(r"^layer_", "block_")])
    else:
        ed.delete(r"layer_0[0-5]")
    for compact in (False, True):
        out = tmp_path / f"out_{compact}" / "m"
        peak = _peak_mib(lambda: ed.save(out, compact=compact))
        assert peak < 3 * TENSOR_MIB + 4, f"compact={compact}: peak {peak:.1f} MiB for a 48 MiB checkpoint"
    assert len(Checkpoint(str(out))) == (6 if edit == "strip-half" else 12)


def _keras_checkpoint_with_its_optimizer(tmp_path):
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="body")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(np.ones((4, 4), np.float32), np.ones((4, 2), np.float32), verbose=0)
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "tf2" / "ckpt"))
    return prefix, model


def test_keras_checkpoint_stores_model_weights_under_optimizer_keys(tmp_path):
    """The precondition of the xfail below: TF saves each weight once, at its shortest path."""
    prefix, model = _keras_checkpoint_with_its_optimizer(tmp_path)
    graph = Checkpoint(prefix).object_graph
    weights = [t for t in graph.variables if t.kind == "variable"]
    assert sorted(t.path for t in weights) == sorted(v.path for v in model.weights)
    assert all(t.key.startswith("optimizer/_trainable_variables/") for t in weights)


def test_strip_optimizer_slots_keeps_keras_model_weights(tmp_path):
    prefix, model = _keras_checkpoint_with_its_optimizer(tmp_path)
    graph = Checkpoint(prefix).object_graph
    weight_keys = {t.key for t in graph.variables if t.kind == "variable"}
    optimizer_keys = {t.key for t in graph.variables if t.kind == "optimizer"}
    ed = CheckpointEditor(prefix)
    stripped = set(ed.strip_optimizer_slots())
    assert stripped == optimizer_keys
    out = ed.save(tmp_path / "stripped" / "ckpt")
    kept = set(tf.train.load_checkpoint(out).get_variable_to_shape_map())
    assert weight_keys <= kept
    restored = Checkpoint(out)
    for v in model.weights:
        np.testing.assert_array_equal(restored.read(restored.object_paths[v.path]), v.numpy())


# ---------------------------------------------------------------- issue 5: unfreeze without weights


@pytest.mark.parametrize("weights", ["auto", "large"])
def test_unfreeze_of_a_frozen_graph_without_weight_constants_is_an_error(tmp_path, weights):
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        tf.identity(x * 2.0 + 1.0, name="y")
        path = tmp_path / "no_weights.pb"
        path.write_bytes(graph.as_graph_def().SerializeToString())
    out = tmp_path / "out"
    with pytest.raises(GraphError, match="no weight constants found") as info:
        restorekit.unfreeze(str(path), str(out / "model.ckpt"), weights=weights, trainable_graph=True)
    assert "no_weights.pb" in str(info.value)
    hint = "lower it, or pass a list of node names" if weights == "large" else "Pass weights='large'"
    assert hint in str(info.value)
    assert not out.exists() or os.listdir(out) == []
