"""scan through a view (layout='torch', a rule set): what each record read as the file stores it, and what it is.

A view shows entries under the target's names and axes; every record also names the
entry it reads as stored (``stored_name``/``stored_shape``), in ``str(report)`` and
``to_dict()``, and an optimizer slot seen through the view is still skipped as one.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from conftest import import_torch, requires_torch

tf1 = tf.compat.v1


@pytest.fixture
def tf1_momentum(tmp_path):
    """A TF1 checkpoint of one Dense layer trained a step with Momentum (slots and global_step beside it)."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 3])
        kernel = tf1.get_variable("fc/kernel", [3, 2])
        bias = tf1.get_variable("fc/bias", [2])
        loss = tf.reduce_sum(tf.matmul(x, kernel) + bias)
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train, {x: np.ones((1, 3), np.float32)})
            values = sess.run({"kernel": kernel, "bias": bias})
            return tf1.train.Saver().save(sess, str(tmp_path / "tf1" / "model.ckpt")), values


@requires_torch
def test_tf1_optimizer_slots_through_layout_torch_are_skipped_as_slots(tf1_momentum):
    torch = import_torch()
    prefix, _ = tf1_momentum
    module = torch.nn.Module()
    module.fc = torch.nn.Linear(3, 2)
    report = restorekit.scan(prefix, module, layout="torch")
    assert not report.unused
    slots = [r for r in report.skipped if "optimizer" in r.how]
    assert sorted(r.stored_name for r in slots) == ["fc/bias/Momentum", "fc/kernel/Momentum"]
    assert "optimizer slot (Momentum) (2)" in str(report)


@requires_torch
def test_records_through_layout_torch_name_the_stored_entry(tf1_momentum):
    torch = import_torch()
    prefix, values = tf1_momentum
    module = torch.nn.Module()
    module.fc = torch.nn.Linear(3, 2)
    report = restorekit.scan(prefix, module, layout="torch")
    weight = next(r for r in report.matched if r.variable_name == "fc.weight")
    assert (weight.checkpoint_name, weight.checkpoint_shape) == ("fc.weight", (2, 3))
    assert (weight.stored_name, weight.stored_shape) == ("fc/kernel", (3, 2))
    assert "fc.weight [2, 3] <- fc/kernel [3, 2]" in str(report)
    as_json = json.loads(json.dumps(report.to_dict()))
    entry = next(r for r in as_json["matched"] if r["variable_name"] == "fc.weight")
    assert entry["stored_name"] == "fc/kernel" and entry["stored_shape"] == [3, 2]
    restorekit.restore(report)
    np.testing.assert_array_equal(module.fc.weight.detach().numpy(), values["kernel"].T)


def test_records_without_a_view_carry_no_stored_name(tf1_momentum):
    prefix, _ = tf1_momentum
    with tf.Graph().as_default():
        tf1.get_variable("fc/kernel", [3, 2])
        report = restorekit.scan(prefix)
    assert report.matched and all(r.stored_name is None and r.stored_shape is None for r in report.matched)
    assert "stored as" not in str(report)


@requires_torch
def test_a_bert_checkpoint_through_its_rule_set_names_the_tf_entries(tmp_path):
    torch = import_torch()
    transformers = pytest.importorskip("transformers")  # the test extra installs it
    from conftest import save_variables
    from test_export_hf import HIDDEN, INNER, LAYERS, POSITIONS, VOCAB, bert_values

    prefix = save_variables(tmp_path / "bert" / "bert_model.ckpt", bert_values())
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=2, intermediate_size=INNER,
                                     max_position_embeddings=POSITIONS, num_labels=3)
    torch.manual_seed(0)
    report = restorekit.scan(prefix, transformers.BertForSequenceClassification(config), rules="bert-tf-to-hf")
    query = next(r for r in report.matched if r.variable_name == "bert.encoder.layer.0.attention.self.query.weight")
    assert query.stored_name == "bert/encoder/layer_0/attention/self/query/kernel"
    assert query.stored_shape == (HIDDEN, HIDDEN) and query.checkpoint_shape == (HIDDEN, HIDDEN)
    assert all(r.stored_name is not None and r.stored_name.startswith("bert/") for r in report.matched)
    assert "<- bert/" in str(report)


@requires_torch
def test_layout_torch_reports_the_tensors_it_adds_for_pytorch(tmp_path):
    import_torch()
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d"), keras.layers.BatchNormalization(name="bn")])
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ck" / "m"))
    plain = restorekit.convert(prefix, str(tmp_path / "a.safetensors"))
    torch_layout = restorekit.convert(prefix, str(tmp_path / "b.safetensors"), layout="torch")
    assert torch_layout.count == plain.count + 1
    assert len(torch_layout.added) == 1 and torch_layout.added[0].endswith("bn.num_batches_tracked")
    assert "1 added for PyTorch with no TF tensor" in str(torch_layout) and not plain.added
