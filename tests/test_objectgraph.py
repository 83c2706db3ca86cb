"""restorekit/_bundle/objectgraph.py: the TF2 object graph, decoded and re-encoded without TensorFlow."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from restorekit import Checkpoint
from restorekit._bundle.objectgraph import OBJECT_GRAPH_KEY, decode_object_graph, rewrite_keys
from restorekit.errors import CorruptCheckpointError


@pytest.fixture
def keras_checkpoint(tmp_path):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="enc"), keras.layers.Dense(2, name="head")], name="seq")
    optimizer = keras.optimizers.Adam()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0, epochs=1)
    return tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "ckpt"))


def _tf_graph(raw):
    proto = trackable_object_graph_pb2.TrackableObjectGraph()
    proto.ParseFromString(raw)
    return proto


def test_decode_names_every_saved_key(keras_checkpoint):
    ckpt = Checkpoint(keras_checkpoint)
    graph = decode_object_graph(ckpt.read(OBJECT_GRAPH_KEY).item())
    saved = {k for k in ckpt.entries if k != OBJECT_GRAPH_KEY}
    assert {v.key for v in graph.variables} == saved
    assert {"seq/enc/kernel", "seq/head/bias"} <= set(graph.by_path)


def test_rewrite_keys_equals_tf_proto_edit(keras_checkpoint):
    raw = Checkpoint(keras_checkpoint).read(OBJECT_GRAPH_KEY).item()
    keys = [a.checkpoint_key for n in _tf_graph(raw).nodes for a in n.attributes]
    renamed, dropped = keys[0], keys[1]
    new = rewrite_keys(raw, {renamed: "renamed/.ATTRIBUTES/VARIABLE_VALUE"}, {dropped})

    expected = _tf_graph(raw)
    for node in expected.nodes:
        kept = [a for a in node.attributes if a.checkpoint_key != dropped]
        for a in kept:
            if a.checkpoint_key == renamed:
                a.checkpoint_key = "renamed/.ATTRIBUTES/VARIABLE_VALUE"
        del node.attributes[:]
        node.attributes.extend(kept)
    assert _tf_graph(new) == expected


def test_rewrite_without_changes_is_byte_identical(keras_checkpoint):
    raw = Checkpoint(keras_checkpoint).read(OBJECT_GRAPH_KEY).item()
    assert rewrite_keys(raw, {}) == raw


@pytest.mark.parametrize("raw", [b"\x0a\xff", b"\x0a\x02\x0a\x05", b"\x0a\x04\x0a\x02\x08\x09"],
                         ids=["truncated-length", "child-past-end", "child-out-of-range"])
def test_corrupt_graph_is_a_restorekit_error(raw):
    with pytest.raises(CorruptCheckpointError):
        rewrite_keys(raw, {})


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
    """TF saves each Keras 3 weight once, at its shortest path: under the optimizer's list."""
    prefix, model = _keras_checkpoint_with_its_optimizer(tmp_path)
    graph = Checkpoint(prefix).object_graph
    weights = [t for t in graph.variables if t.kind == "variable"]
    assert sorted(t.path for t in weights) == sorted(v.path for v in model.weights)
    assert all(t.key.startswith("optimizer/_trainable_variables/") for t in weights)


def test_an_unnamed_variable_reads_as_the_attribute_it_is_saved_under(tmp_path):
    prefix = tf.train.Checkpoint(step=tf.Variable(41), w=tf.Variable([1.5], name="weights")).save(
        str(tmp_path / "tf2" / "ckpt"))
    ckpt = Checkpoint(prefix)
    # 'Variable' is tf.Variable's default name and says nothing; a given name still wins
    assert dict(ckpt.object_paths) == {
        "step": "step/.ATTRIBUTES/VARIABLE_VALUE",
        "weights": "w/.ATTRIBUTES/VARIABLE_VALUE",
        "save_counter": "save_counter/.ATTRIBUTES/VARIABLE_VALUE",
    }
    assert ckpt.readable_name("step/.ATTRIBUTES/VARIABLE_VALUE") == "step"
    assert int(ckpt.read("step")) == 41
