"""Export options: weights_only and ema (restorekit.export._options), on convert, export_checkpoint, the editor and the CLI;
CheckpointEditor.save(format=...) keeping the TF2 object graph and taking layout=."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import requires_torch, save_variables
from restorekit._checkpoint import Checkpoint
from restorekit.cli import main
from restorekit.edit import CheckpointEditor
from restorekit.errors import InvalidArgumentError, RestoreKitWarning
from restorekit.export import convert, export_checkpoint, import_checkpoint
from restorekit.formats import safetensors as st

tf1 = tf.compat.v1


def _model():
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="fc1"), keras.layers.Dense(2, name="fc2")],
                             name="net")
    return model


@pytest.fixture(scope="module")
def keras_ckpt(tmp_path_factory):
    """A TF2 object-based checkpoint of a trained Keras model with Adam (use_ema) state and save_counter."""
    import keras

    keras.utils.set_random_seed(0)
    model = _model()
    optimizer = keras.optimizers.Adam(0.1, use_ema=True, ema_momentum=0.5)
    x = np.random.RandomState(0).randn(8, 3).astype(np.float32)
    for _ in range(3):  # a custom loop: fit() would overwrite the weights with the averages at the end
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - x[:, :2]) ** 2)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path_factory.mktemp("k") / "ckpt"))
    weights = [w.numpy() for w in model.weights]
    # keyed by the averaged variable's path (the optimizer's own name, 'adam' or 'adam_3', varies by process)
    averages = {v.path.rpartition("/")[2]: v.numpy() for v in optimizer.variables if v.path.endswith("_average")}
    return prefix, weights, averages


def _restored(prefix):
    """The model weights ``tf.train.Checkpoint.read`` restores from ``prefix`` into a fresh model."""
    model = _model()
    tf.train.Checkpoint(model=model).read(prefix).assert_existing_objects_matched()
    return [w.numpy() for w in model.weights]


def test_weights_only_drops_optimizer_state_and_global_step_everywhere(small_checkpoint, tmp_path, capsys):
    prefix, values = small_checkpoint
    weights = {"dense/kernel", "dense/bias", "logits/kernel", "logits/bias"}
    result = convert(prefix, tmp_path / "a.safetensors", weights_only=True)
    assert set(st.read_shapes(tmp_path / "a.safetensors")) == weights
    assert set(result.dropped) == {"dense/kernel/Momentum", "global_step"}
    export_checkpoint(prefix, tmp_path / "b.npz", weights_only=True)
    assert set(np.load(tmp_path / "b.npz").files) == weights
    CheckpointEditor(prefix).save(tmp_path / "c" / "m.ckpt", weights_only=True)
    assert set(Checkpoint(str(tmp_path / "c" / "m.ckpt")).entries) == weights
    assert main(["convert", prefix, str(tmp_path / "e.safetensors"), "--weights-only"]) == 0
    assert "left out 2" in capsys.readouterr().out
    assert set(st.read_shapes(tmp_path / "e.safetensors")) == weights
    convert(prefix, tmp_path / "f" / "m.ckpt", weights_only=True)
    assert set(Checkpoint(str(tmp_path / "f" / "m.ckpt")).entries) == weights


@requires_torch
def test_weights_only_drops_optimizer_state_and_global_step_from_a_pt_file(small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    CheckpointEditor(prefix).save(tmp_path / "d.pt", format="torch", weights_only=True)
    import_checkpoint(tmp_path / "d.pt", tmp_path / "d" / "m.ckpt")
    assert set(Checkpoint(str(tmp_path / "d" / "m.ckpt")).entries) == {"dense/kernel", "dense/bias", "logits/kernel",
                                                                     "logits/bias"}


def test_weights_only_on_a_tf2_checkpoint_keeps_an_object_graph_that_restores(keras_ckpt, tmp_path):
    prefix, weights, _ = keras_ckpt
    result = convert(prefix, tmp_path / "m.safetensors", weights_only=True)
    assert any("save_counter" in n for n in result.dropped) and any("_variables" in n for n in result.dropped)
    names = set(st.read_shapes(tmp_path / "m.safetensors"))
    assert len(names) == 4  # the model's kernels and biases, nothing of the optimizer
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    back = str(tmp_path / "back" / "ckpt")
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" in Checkpoint(back).entries
    for got, want in zip(_restored(back), weights):
        np.testing.assert_array_equal(got, want)
    # The editor does the same.
    CheckpointEditor(prefix).save(tmp_path / "e.safetensors", format="safetensors", weights_only=True)
    assert set(st.read_shapes(tmp_path / "e.safetensors")) == names


def test_ema_exports_the_tf1_shadows_as_the_weights_and_names_the_fallbacks(tmp_path):
    with tf.Graph().as_default():
        w = tf1.get_variable("dense/kernel", initializer=tf.constant(np.ones((2, 3), np.float32)))
        b = tf1.get_variable("dense/bias", initializer=tf.constant(np.zeros(3, np.float32)))
        step = tf1.train.get_or_create_global_step()
        ema = tf1.train.ExponentialMovingAverage(0.5)
        with tf1.variable_scope("averages"):
            apply = ema.apply([w])  # the bias gets no shadow
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run([w.assign(w * 3.0), b.assign(b + 1.0)])
            sess.run(apply)
            shadow = sess.run(ema.average(w))
            raw = sess.run(w)
            prefix = tf1.train.Saver().save(sess, str(tmp_path / "c" / "model.ckpt"), write_meta_graph=False)
    del step
    assert not np.array_equal(shadow, raw)
    result = convert(prefix, tmp_path / "m.safetensors", ema=True, weights_only=True)
    assert result.fallback == ("dense/bias",)
    assert "no EMA shadow" in str(result)
    stored = dict(st.read(tmp_path / "m.safetensors"))
    assert set(stored) == {"dense/kernel", "dense/bias"}
    np.testing.assert_array_equal(stored["dense/kernel"], shadow)
    np.testing.assert_array_equal(stored["dense/bias"], np.ones(3, np.float32))
    with pytest.warns(RestoreKitWarning, match="dense/bias"):
        CheckpointEditor(prefix).save(tmp_path / "e.npz", format="npz", ema=True, weights_only=True)
    np.testing.assert_array_equal(np.load(tmp_path / "e.npz")["dense/kernel"], shadow)
    assert main(["convert", prefix, str(tmp_path / "cli.safetensors"), "--ema", "--weights-only", "-q"]) == 0
    np.testing.assert_array_equal(dict(st.read(tmp_path / "cli.safetensors"))["dense/kernel"], shadow)


def test_ema_exports_keras_use_ema_averages_and_the_graph_still_restores(keras_ckpt, tmp_path):
    prefix, weights, averages = keras_ckpt
    result = convert(prefix, tmp_path / "m.safetensors", ema=True, weights_only=True)
    assert result.fallback == ()
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    restored = _restored(str(tmp_path / "back" / "ckpt"))
    for got, path in zip(restored, ["net/fc1/kernel", "net/fc1/bias", "net/fc2/kernel", "net/fc2/bias"]):
        np.testing.assert_array_equal(got, averages[f"{path.replace('/', '_')}_average"])
    assert not np.array_equal(restored[0], weights[0])
    CheckpointEditor(prefix).save(tmp_path / "e" / "ckpt", ema=True, weights_only=True)
    for got, want in zip(_restored(str(tmp_path / "e" / "ckpt")), restored):
        np.testing.assert_array_equal(got, want)


def test_ema_without_any_shadow_is_refused_and_nothing_is_written(small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    with pytest.raises(InvalidArgumentError, match="no moving-average shadow"):
        convert(prefix, tmp_path / "m.safetensors", ema=True)
    with pytest.raises(InvalidArgumentError, match="no moving-average shadow"):
        CheckpointEditor(prefix).save(tmp_path / "e.safetensors", format="safetensors", ema=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the source only


@pytest.mark.parametrize("fmt,suffix", [pytest.param("safetensors", ".safetensors", id="safetensors"),
                                        pytest.param("torch", ".pt", id="torch", marks=requires_torch),
                                        pytest.param("npz", ".npz", id="npz")])
def test_editor_save_to_a_file_keeps_the_object_graph_so_import_restores(keras_ckpt, tmp_path, fmt, suffix):
    prefix, weights, _ = keras_ckpt
    ed = CheckpointEditor(prefix)
    ed.delete(".*OPTIMIZER_SLOT.*|optimizer/_variables/.*")  # a deletion: the graph is rewritten to match
    out = ed.save(tmp_path / f"m{suffix}", format=fmt)
    import_checkpoint(out, tmp_path / "back" / "ckpt")
    back = str(tmp_path / "back" / "ckpt")
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" in Checkpoint(back).entries
    for got, want in zip(_restored(back), weights):
        np.testing.assert_array_equal(got, want)


def test_editor_save_takes_layout_torch_and_the_import_undoes_it(keras_ckpt, tmp_path):
    prefix, weights, _ = keras_ckpt
    ed = CheckpointEditor(prefix)
    ed.strip_optimizer_slots()
    out = ed.save(tmp_path / "m.safetensors", format="safetensors", layout="torch")
    shapes = st.read_shapes(out)
    assert shapes["net.fc1.weight"] == (4, 3)  # transposed, named from the readable path
    import_checkpoint(out, tmp_path / "back" / "ckpt")
    for got, want in zip(_restored(str(tmp_path / "back" / "ckpt")), weights):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt,suffix", [pytest.param("safetensors", ".safetensors", id="safetensors"),
                                        pytest.param("torch", ".pt", id="torch", marks=requires_torch)])
def test_editor_save_of_a_value_edit_takes_layout_torch_and_the_import_undoes_it(keras_ckpt, tmp_path, fmt, suffix):
    prefix, weights, _ = keras_ckpt
    ed = CheckpointEditor(prefix)
    ed.strip_optimizer_slots()
    ed.set("net/fc2/bias", np.full(2, 7, np.float32))  # a value edit: the generic writer
    out = ed.save(tmp_path / f"n{suffix}", format=fmt, layout="torch")
    import_checkpoint(out, tmp_path / "back" / "ckpt")
    restored = _restored(str(tmp_path / "back" / "ckpt"))
    np.testing.assert_array_equal(restored[3], np.full(2, 7, np.float32))
    for got, want in zip(restored[:3], weights[:3]):
        np.testing.assert_array_equal(got, want)


def test_editor_save_refuses_a_layout_the_format_cannot_take(small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    with pytest.raises(InvalidArgumentError, match="layout"):
        CheckpointEditor(prefix).save(tmp_path / "m.npz", format="npz", layout="torch")
    with pytest.raises(InvalidArgumentError, match="layout"):
        CheckpointEditor(prefix).save(tmp_path / "m.ckpt", layout="torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the source only


def test_editor_save_of_deletions_still_copies_raw_bytes(small_checkpoint, tmp_path, monkeypatch):
    prefix, values = small_checkpoint
    monkeypatch.setattr(st, "write", lambda *a, **k: pytest.fail("the generic writer was used"))
    ed = CheckpointEditor(prefix)
    ed.strip_optimizer_slots()
    out = ed.save(tmp_path / "m.safetensors", format="safetensors", weights_only=True)
    stored = dict(st.read(out))
    assert set(stored) == {"dense/kernel", "dense/bias", "logits/kernel", "logits/bias"}
    np.testing.assert_array_equal(stored["logits/kernel"], values["logits/kernel"])


def test_a_renamed_weight_is_exported_under_the_rename_rule(tmp_path):
    prefix = save_variables(tmp_path / "c" / "m.ckpt", {"old/kernel": np.ones((2, 2), np.float32)})
    result = convert(prefix, tmp_path / "m.safetensors", rules=[(r"^old/", "new/")])
    assert result.renamed == "rename rule"
    assert list(st.read_shapes(tmp_path / "m.safetensors")) == ["new/kernel"]
