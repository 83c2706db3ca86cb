"""Renames by readable path in Keras 3 files (restorekit/edit/_keras_renames.py): a layer is renamed whole (its name
attribute), the saved file loads into a model whose layer has the new name, and renames Keras files cannot hold
(one variable, a split layer) are refused with nothing written."""

import os

import keras
import numpy as np
import pytest

import restorekit
from restorekit.edit import CheckpointEditor
from restorekit.errors import EditError, NoMatchError


def model(enc="enc1", *, nested=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(3, name=enc)(inputs)
    if nested:
        inner_in = keras.Input((3,))
        inner = keras.Model(inner_in, keras.layers.Dense(3, name="a")(inner_in), name="block")
        x = inner(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(x), name="net")


@pytest.fixture
def saved(tmp_path):
    m = model()
    m.save_weights(tmp_path / "m.weights.h5")
    m.save(tmp_path / "m.keras")
    return m, tmp_path


@pytest.mark.parametrize("rename", [
    lambda ed: ed.rename("enc1", "enc9"),
    lambda ed: ed.rename_all([(r"^enc1/", "enc9/")]),
    lambda ed: ed.rename_all({"enc1": "enc9"}),
    lambda ed: ed.rename_all(lambda p: p.replace("enc1/", "enc9/")),
], ids=["rename-layer", "rename-all-regex", "rename-all-mapping", "rename-all-callable"])
def test_a_renamed_layer_loads_into_a_model_with_the_new_name(saved, rename):
    original, tmp = saved
    editor = CheckpointEditor(tmp / "m.weights.h5")
    rename(editor)
    np.testing.assert_array_equal(editor.get("enc9/kernel"), original.get_layer("enc1").kernel.numpy())
    editor.save(tmp / "out.weights.h5")
    ckpt = restorekit.Checkpoint(tmp / "out.weights.h5")
    assert {"enc9/kernel", "enc9/bias", "head/kernel"} <= set(ckpt.object_paths)
    assert "enc1/kernel" not in set(ckpt.object_paths)
    assert list(ckpt.entries) == list(restorekit.Checkpoint(tmp / "m.weights.h5").entries)  # the keys stay
    renamed = model("enc9")
    renamed.load_weights(tmp / "out.weights.h5")
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(getattr(renamed.get_layer("enc9"), name).numpy(),
                                      getattr(original.get_layer("enc1"), name).numpy())
    # restorekit pairs by name: the renamed layer is found under its new name
    report = restorekit.scan(tmp / "out.weights.h5", renamed.weights)
    assert not report.missing


def test_a_renamed_layer_in_a_keras_archive_saved_in_place(saved):
    original, tmp = saved
    editor = CheckpointEditor(tmp / "m.keras")
    editor.rename("head", "classifier")
    editor.save_in_place()
    assert "classifier/kernel" in restorekit.Checkpoint(tmp / "m.keras").object_paths
    np.testing.assert_array_equal(restorekit.Checkpoint(tmp / "m.keras").read("classifier/kernel"),
                                  original.get_layer("head").kernel.numpy())


def test_a_parent_layer_rename_moves_its_sub_layers(tmp_path):
    original = model(nested=True)
    original.save_weights(tmp_path / "m.weights.h5")
    paths = set(restorekit.Checkpoint(tmp_path / "m.weights.h5").object_paths)
    editor = CheckpointEditor(tmp_path / "m.weights.h5")
    editor.rename("enc1", "enc9")
    editor.save(tmp_path / "out.weights.h5")
    after = set(restorekit.Checkpoint(tmp_path / "out.weights.h5").object_paths)
    assert after == {p.replace("enc1/", "enc9/") for p in paths}
    m = model("enc9", nested=True)
    m.load_weights(tmp_path / "out.weights.h5")
    probe = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(np.asarray(m(probe)), np.asarray(original(probe)), atol=1e-6)


@pytest.mark.parametrize("rename, error, match", [
    (lambda ed: ed.rename("enc1/kernel", "enc9/kernel"), EditError, "leaving 'enc1/bias' behind"),
    (lambda ed: ed.rename("enc1/kernel", "enc1/w"), EditError, "by position"),
    (lambda ed: ed.rename_all([(r"^enc1/bias", "head/bias2")]), EditError, "by position"),
    (lambda ed: ed.rename_all([(r"^(enc1|head)/", "same/")]), restorekit.errors.NameCollisionError, "same/"),
    (lambda ed: ed.rename("enc7", "enc9"), NoMatchError, "enc1"),
], ids=["one-variable-of-a-layer", "a-variable-inside-a-layer", "a-variable-to-another-layer", "two-layers-one-name",
        "no-such-layer"])
def test_renames_a_keras_file_cannot_hold_are_refused_and_nothing_written(saved, rename, error, match):
    original, tmp = saved
    listing = sorted(os.listdir(tmp))
    editor = CheckpointEditor(tmp / "m.weights.h5")
    with pytest.raises(error, match=match):
        rename(editor)
    assert sorted(os.listdir(tmp)) == listing
    editor.save(tmp / "out.weights.h5")  # the refused rename left nothing queued
    assert set(restorekit.Checkpoint(tmp / "out.weights.h5").object_paths) == set(
        restorekit.Checkpoint(tmp / "m.weights.h5").object_paths)
