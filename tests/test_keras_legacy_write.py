"""Legacy Keras 2 ``.h5`` as an output (``restorekit.keras_files._legacy_writer``): from a tf-keras file, the editor,
``strip`` and ``convert`` write a file tf-keras loads into the same model with the same outputs; other sources, edits the
layout cannot hold and existing outputs are refused with nothing written. The oracle is tf-keras itself."""

from __future__ import annotations

import errno
import os
import shutil
import types
import warnings

import h5py
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
k2 = pytest.importorskip("tf_keras")

import restorekit  # noqa: E402
from restorekit._bundle import crashpoints  # noqa: E402
from restorekit.cli import main  # noqa: E402
from restorekit.edit import CheckpointEditor  # noqa: E402
from restorekit.errors import (  # noqa: E402
    InvalidArgumentError,
    OptionNotApplicableError,
    OutputExistsError,
    OutputNameError,
    WriteFailedError,
)
from conftest import write_bundle  # noqa: E402

L2 = k2.layers


def _model():
    """Conv2D -> BatchNormalization -> Flatten -> Dense, compiled with Adam and trained one step."""
    k2.utils.set_random_seed(0)
    inp = L2.Input((6, 6, 2), name="inp")  # named: an automatic name depends on what ran before
    x = L2.Conv2D(3, 3, name="conv")(inp)
    x = L2.BatchNormalization(name="bn")(x)
    x = L2.Flatten(name="flat")(x)
    model = k2.Model(inp, L2.Dense(2, name="head")(x))
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(4, 6, 6, 2)).astype("float32"), rng.normal(size=(4, 2)).astype("float32"),
              batch_size=4, epochs=1, verbose=0)
    return model


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("legacy")
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf-keras calls .h5 a legacy format: the one under test
        model.save(tmp / "full.h5")
    model.save_weights(tmp / "w.h5")
    x = np.random.default_rng(1).normal(size=(3, 6, 6, 2)).astype("float32")
    return types.SimpleNamespace(dir=tmp, model=model, full=tmp / "full.h5", weights=tmp / "w.h5", x=x,
                                 y=model.predict(x, verbose=0))


def _copy(src, tmp_path, name: str = "src.h5"):
    shutil.copy(src, tmp_path / name)
    return tmp_path / name


def _attrs(path, group: str = "/") -> dict:
    with h5py.File(path, "r") as f:
        return {k: np.asarray(v).tolist() for k, v in f[group].attrs.items()}


def _names(values) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def _load(path):
    """``tf_keras.models.load_model``; its warning that an uncompiled model was loaded is checked by the tests."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return k2.models.load_model(path)


# ---------------------------------------------------------------- strip, edits, weights files

def test_strip_of_a_full_model_h5_loads_in_tf_keras_with_the_same_outputs_and_no_optimizer(legacy, tmp_path):
    editor = CheckpointEditor(legacy.full)
    dropped = editor.strip_optimizer_slots()
    assert len(dropped) == 13 and all(n.startswith("optimizer_weights/") for n in dropped)
    out = tmp_path / "stripped.h5"
    assert editor.save(out) == str(out)
    with h5py.File(out, "r") as f:
        assert sorted(f) == ["model_weights"]
        assert "training_config" not in f.attrs  # as model.save(include_optimizer=False) writes it
    source_root, root = _attrs(legacy.full), _attrs(out)
    assert {k: root[k] for k in ("backend", "keras_version", "model_config")} == {
        k: source_root[k] for k in ("backend", "keras_version", "model_config")}
    assert _attrs(out, "model_weights") == _attrs(legacy.full, "model_weights")
    for layer in ("conv", "bn", "flat", "head", "inp", "top_level_model_weights"):
        assert _attrs(out, f"model_weights/{layer}") == _attrs(legacy.full, f"model_weights/{layer}"), layer
    model = _load(out)
    assert model.optimizer is None  # not compiled: no training_config, as tf-keras' own include_optimizer=False
    np.testing.assert_array_equal(model.predict(legacy.x, verbose=0), legacy.y)


def test_an_unedited_save_keeps_the_optimizer_and_training_config(legacy, tmp_path):
    out = CheckpointEditor(legacy.full).save(tmp_path / "copy.hdf5")
    with h5py.File(legacy.full, "r") as a, h5py.File(out, "r") as b:
        assert _names(b["optimizer_weights"].attrs["weight_names"]) == _names(a["optimizer_weights"].attrs["weight_names"])
        for name in _names(a["optimizer_weights"].attrs["weight_names"]):
            np.testing.assert_array_equal(b["optimizer_weights"][name][()], a["optimizer_weights"][name][()])
        assert b.attrs["training_config"] == a.attrs["training_config"]
    model = _load(out)
    assert int(model.optimizer.iterations.numpy()) == 1
    np.testing.assert_array_equal(model.predict(legacy.x, verbose=0), legacy.y)


def test_set_and_cast_to_float16_land_in_the_right_datasets_and_tf_keras_loads_them(legacy, tmp_path):
    editor = CheckpointEditor(legacy.full)
    cast = editor.cast(".*", "float16")
    assert "model_weights/conv/conv/kernel:0" in cast and "optimizer_weights/iteration:0" not in cast
    editor.set("head/bias", np.array([5.0, -6.0], np.float16))  # a readable path, as scan names it
    out = editor.save(tmp_path / "half.h5")
    with h5py.File(out, "r") as f:
        assert f["model_weights/conv/conv/kernel:0"].dtype == np.float16
        assert f["optimizer_weights/iteration:0"].dtype == np.int64
    model = _load(out)
    np.testing.assert_array_equal(model.get_layer("head").bias.numpy(), [5.0, -6.0])
    for layer in ("conv", "bn"):
        for got, want in zip(model.get_layer(layer).weights, legacy.model.get_layer(layer).weights, strict=True):
            np.testing.assert_array_equal(got.numpy(), want.numpy().astype(np.float16).astype(np.float32))
    assert int(model.optimizer.iterations.numpy()) == 1


def test_a_rename_within_the_layer_is_written_to_weight_names_and_saved_in_place(legacy, tmp_path):
    src = _copy(legacy.full, tmp_path)
    editor = CheckpointEditor(src)
    editor.rename("model_weights/head/head/bias:0", "model_weights/head/head/b:0")
    editor.set("head/kernel", np.ones((48, 2), np.float32))
    editor.save_in_place()
    with h5py.File(src, "r") as f:
        assert _names(f["model_weights/head"].attrs["weight_names"]) == ["head/kernel:0", "head/b:0"]
        assert "bias:0" not in f["model_weights/head/head"]
    model = _load(src)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), np.ones((48, 2)))
    np.testing.assert_array_equal(model.get_layer("head").bias.numpy(), legacy.model.get_layer("head").bias.numpy())
    assert os.listdir(tmp_path) == ["src.h5"]


def test_a_weights_only_h5_round_trips_through_the_editor(legacy, tmp_path):
    out = CheckpointEditor(legacy.weights).save(tmp_path / "w2.h5")
    assert _attrs(out) == _attrs(legacy.weights)  # layer_names, backend, keras_version
    model = _model()
    model.load_weights(out)
    for got, want in zip(model.weights, legacy.model.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    # and an edit of it reaches the model
    editor = CheckpointEditor(legacy.weights)
    editor.set("conv/bias", np.array([1.0, 2.0, 3.0], np.float32))
    model.load_weights(editor.save(tmp_path / "w3.h5"))
    np.testing.assert_array_equal(model.get_layer("conv").bias.numpy(), [1.0, 2.0, 3.0])


def test_convert_weights_only_writes_the_model_without_its_optimizer(legacy, tmp_path):
    result = restorekit.convert(legacy.full, tmp_path / "w.h5", weights_only=True)
    assert result.format == "keras-h5" and result.count == 8 and len(result.dropped) == 13
    with h5py.File(tmp_path / "w.h5", "r") as f:
        assert "optimizer_weights" not in f and "training_config" not in f.attrs
    np.testing.assert_array_equal(_load(tmp_path / "w.h5").predict(legacy.x, verbose=0), legacy.y)


# ---------------------------------------------------------------- the CLI

def test_cli_strip_cast_and_convert_weights_only_write_legacy_h5(legacy, tmp_path, capsys):
    assert main(["strip", str(legacy.full), str(tmp_path / "s.h5")]) == 0
    assert main(["cast", str(legacy.full), str(tmp_path / "c.h5"), "--dtype", "float16"]) == 0
    assert main(["convert", str(legacy.full), str(tmp_path / "w.h5"), "--weights-only"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "keras-h5" in out
    for name in ("s.h5", "w.h5"):
        with h5py.File(tmp_path / name, "r") as f:
            assert "optimizer_weights" not in f, name
        np.testing.assert_array_equal(_load(tmp_path / name).predict(legacy.x, verbose=0), legacy.y)
    half = _load(tmp_path / "c.h5")
    np.testing.assert_array_equal(half.get_layer("head").kernel.numpy(),
                                  legacy.model.get_layer("head").kernel.numpy().astype(np.float16).astype(np.float32))


def test_cli_words_legacy_h5_refusals_with_its_flags(legacy, tmp_path, capsys):
    listing = sorted(os.listdir(tmp_path))
    assert main(["convert", str(legacy.full), str(tmp_path / "t.h5"), "--layout", "torch"]) == 3
    err = capsys.readouterr().err
    assert "--weights-only" in err and "weights_only=" not in err and "Traceback" not in err
    (tmp_path / "exists.h5").write_bytes(b"old")
    assert main(["strip", str(legacy.full), str(tmp_path / "exists.h5")]) == 3
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    assert (tmp_path / "exists.h5").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == sorted([*listing, "exists.h5"])


# ---------------------------------------------------------------- refusals: nothing written

@pytest.fixture(scope="module")
def others(tmp_path_factory):
    """A TF checkpoint and a Keras 3 .weights.h5: sources with no legacy layout to keep."""
    tmp = tmp_path_factory.mktemp("others")
    prefix = write_bundle(tmp / "model.ckpt", {"dense/kernel": np.ones((2, 3), np.float32)})
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="dense")])
    model.save_weights(tmp / "m.weights.h5")
    return {"tf": prefix, "keras3": str(tmp / "m.weights.h5")}


@pytest.mark.parametrize("source", ["tf", "keras3"], ids=["tf-checkpoint", "keras3-weights-h5"])
@pytest.mark.parametrize("how", ["editor", "convert"])
def test_a_source_without_the_legacy_layout_is_refused_as_h5(others, tmp_path, source, how):
    out = tmp_path / "out" / "model.h5"
    with pytest.raises(OutputNameError, match="only from a legacy Keras 2 .h5") as info:
        if how == "editor":
            CheckpointEditor(others[source]).save(out)
        else:
            restorekit.convert(others[source], out)
    assert "'*.weights.h5'" in str(info.value) and "to='tf'" in str(info.value)
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []


def _add(editor):
    editor.add("model_weights/head/head/extra:0", np.zeros(2, np.float32))


def _delete_one_of_a_layer(editor):
    editor.delete("model_weights/bn/bn/gamma:0")


def _move_to_another_layer(editor):
    editor.rename("model_weights/head/head/bias:0", "model_weights/conv/conv/bias_2:0")


def _bfloat16(editor):
    editor.cast("head/kernel", "bfloat16")


@pytest.mark.parametrize("edit, match", [
    (_add, "is new"), (_delete_one_of_a_layer, "had 4 weights and would hold 3"),
    (_move_to_another_layer, "comes from 'model_weights/head'"), (_bfloat16, "bfloat16"),
], ids=["added-tensor", "one-weight-of-a-layer-deleted", "weight-moved-to-another-layer", "bfloat16"])
def test_an_edit_the_legacy_layout_cannot_hold_is_refused_before_writing(legacy, tmp_path, edit, match):
    editor = CheckpointEditor(legacy.full)
    edit(editor)
    with pytest.raises(InvalidArgumentError, match=match):
        editor.save(tmp_path / "out.h5")
    assert os.listdir(tmp_path) == []


def test_an_existing_output_or_the_source_is_refused_and_overwrite_replaces(legacy, tmp_path):
    out = tmp_path / "out.h5"
    out.write_bytes(b"old")
    with pytest.raises(OutputExistsError) as info:
        CheckpointEditor(legacy.full).save(out)
    assert not info.value.is_source and out.read_bytes() == b"old"
    with pytest.raises(OutputExistsError):
        restorekit.convert(legacy.full, out)
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.h5"]
    src = _copy(legacy.full, tmp_path)
    with pytest.raises(OutputExistsError) as info:
        CheckpointEditor(src).save(src, overwrite=True)
    assert info.value.is_source
    with pytest.raises(OutputExistsError) as info:
        restorekit.convert(src, src, overwrite=True)
    assert info.value.is_source and src.read_bytes() == legacy.full.read_bytes()
    CheckpointEditor(legacy.full).save(out, overwrite=True, weights_only=True)
    np.testing.assert_array_equal(_load(out).predict(legacy.x, verbose=0), legacy.y)
    assert sorted(os.listdir(tmp_path)) == ["out.h5", "src.h5"]


def test_options_a_legacy_h5_does_not_take_are_refused(legacy, tmp_path):
    with pytest.raises(OptionNotApplicableError, match="weights_only"):
        restorekit.convert(legacy.full, tmp_path / "out.h5", layout="torch")
    with pytest.raises(OptionNotApplicableError):
        CheckpointEditor(legacy.full).save(tmp_path / "out.h5", max_shard_size="1MB")
    assert os.listdir(tmp_path) == []


def test_a_write_that_fails_midway_leaves_nothing(legacy, tmp_path, monkeypatch):
    def fail(point):
        if point == "tensor-3":
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(crashpoints, "crash_point", fail)
    with pytest.raises(WriteFailedError):
        CheckpointEditor(legacy.full).save(tmp_path / "out.h5")
    assert os.listdir(tmp_path) == []
