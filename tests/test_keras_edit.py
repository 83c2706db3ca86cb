"""Keras files in edit and convert (restorekit/edit/_save_keras.py, restorekit/export/_keras.py,
restorekit/keras_files/_writer.py): edited .weights.h5 files load with model.load_weights and .keras archives
edited in place with load_model; conversions go to every format under readable paths; what cannot load is
refused and nothing is written."""

import os
import signal
import subprocess
import sys
import time
import warnings
import zipfile

import keras
import numpy as np
import pytest

import restorekit
from restorekit.cli import main
from restorekit.edit import CheckpointEditor
from restorekit.errors import InvalidArgumentError, OutputError, OutputExistsError
from restorekit.formats import safetensors as st


def model(*, compiled=True, head=2):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(3, name="enc1")(inputs))
    m = keras.Model(inputs, keras.layers.Dense(head, name="head")(x), name="net")
    if compiled:
        m.compile(optimizer="adam", loss="mse")
    return m


@pytest.fixture
def saved(tmp_path):
    m = model()
    m.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
    m.save_weights(tmp_path / "m.weights.h5")
    m.save(tmp_path / "m.keras")
    return m, tmp_path


def loaded(path, **kwargs):
    m = model(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras skips an unbuilt optimizer with a warning
        m.load_weights(path)
    return m


def test_edits_save_a_file_load_weights_accepts(saved):
    original, tmp = saved
    editor = CheckpointEditor(tmp / "m.weights.h5")
    assert "layers/dense/vars/0" in [e.name for e in editor.list()]
    np.testing.assert_array_equal(editor.get("enc1/kernel"), original.get_layer("enc1").kernel.numpy())
    editor.set("head/bias", np.array([5, 6], np.float32))
    editor.cast("enc1/kernel", "float16")
    out = editor.save(tmp / "edited.weights.h5")
    assert os.path.exists(out) and not [n for n in os.listdir(tmp) if n.startswith(".restorekit-tmp")]
    m = loaded(out)
    np.testing.assert_array_equal(m.get_layer("head").bias.numpy(), [5, 6])
    np.testing.assert_array_equal(m.get_layer("enc1").kernel.numpy(),
                                  original.get_layer("enc1").kernel.numpy().astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(m.get_layer("bn").moving_mean.numpy(), original.get_layer("bn").moving_mean.numpy())


def test_save_in_place_moves_a_whole_layer_group_for_an_inserted_layer(saved):
    original, tmp = saved
    editor = CheckpointEditor(tmp / "m.weights.h5")
    editor.rename("layers/dense_1/vars/0", "layers/dense_2/vars/0")  # the head becomes the third Dense
    editor.rename("layers/dense_1/vars/1", "layers/dense_2/vars/1")
    editor.add("layers/dense_1/vars/0", np.eye(3, dtype=np.float32))  # the inserted layer: identity
    editor.add("layers/dense_1/vars/1", np.zeros(3, np.float32))
    editor.delete("optimizer/.*")
    assert editor.save_in_place() == str(tmp / "m.weights.h5")
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(3, name="enc1")(inputs)
    x = keras.layers.Dense(3, name="extra")(keras.layers.BatchNormalization(name="bn")(x))
    bigger = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    bigger.load_weights(tmp / "m.weights.h5")
    probe = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(bigger(probe)), np.asarray(original(probe)), atol=1e-6)
    assert not [e for e in CheckpointEditor(tmp / "m.weights.h5").list() if e.name.startswith("optimizer/")]


@pytest.mark.parametrize("edit, match", [
    (lambda ed: ed.rename("layers/dense/vars/0", "layers/dense/w"), "not such a key"),
    (lambda ed: ed.delete("layers/dense/vars/1"), "had 2 variables"),
    (lambda ed: ed.rename("layers/dense/vars/1", "layers/dense/vars/5"), "no gap"),
], ids=["renamed-variable", "partial-layer-delete", "index-gap"])
def test_what_load_weights_could_not_load_is_refused_and_nothing_written(saved, edit, match):
    _, tmp = saved
    editor = CheckpointEditor(tmp / "m.weights.h5")
    edit(editor)
    before = sorted(os.listdir(tmp))
    with pytest.raises(InvalidArgumentError, match=match):
        editor.save(tmp / "out.weights.h5")
    with pytest.raises(InvalidArgumentError, match=match):
        editor.save_in_place()
    assert sorted(os.listdir(tmp)) == before
    loaded(tmp / "m.weights.h5")  # the source is untouched


def test_editor_saves_other_formats_under_readable_paths(saved):
    original, tmp = saved
    editor = CheckpointEditor(tmp / "m.keras")
    editor.set("head/bias", np.zeros(2, np.float32))
    editor.save(tmp / "m.safetensors", format="safetensors", weights_only=True)
    assert set(st.read_shapes(tmp / "m.safetensors")) == {
        "enc1/kernel", "enc1/bias", "bn/gamma", "bn/beta", "bn/moving_mean", "bn/moving_variance", "head/kernel",
        "head/bias"}
    editor.save(tmp / "tf" / "model", weights_only=True)
    back = restorekit.Checkpoint(tmp / "tf" / "model")
    np.testing.assert_array_equal(back.read("enc1/kernel"), original.get_layer("enc1").kernel.numpy())
    assert not back.read("head/bias").any()
    with pytest.raises(OutputExistsError):
        editor.save(tmp / "m.keras")


@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_convert_to_every_format_and_back_to_weights_h5(saved, name):
    original, tmp = saved
    src = tmp / name
    restorekit.convert(src, tmp / "tf" / "model")
    assert restorekit.Checkpoint(tmp / "tf" / "model").read("head/kernel").shape == (3, 2)
    restorekit.convert(src, tmp / "m.npz")
    result = restorekit.convert(src, tmp / "m.safetensors", layout="torch", weights_only=True)
    assert result.unmapped == ()
    shapes = st.read_shapes(tmp / "m.safetensors")
    assert shapes["enc1.weight"] == (3, 4) and shapes["bn.num_batches_tracked"] == ()
    result = restorekit.convert(src, tmp / "copy.weights.h5", weights_only=True)
    assert result.dropped and all(d.startswith("optimizer/") for d in result.dropped)
    m = loaded(tmp / "copy.weights.h5", compiled=False)
    for a, b in zip(m.weights, original.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_convert_refuses_a_weights_h5_from_files_without_layer_groups(saved):
    _, tmp = saved
    restorekit.convert(tmp / "m.weights.h5", tmp / "m.safetensors")
    restorekit.convert(tmp / "m.weights.h5", tmp / "tf" / "model")
    before = sorted(os.listdir(tmp))
    for src in (tmp / "m.safetensors", tmp / "tf" / "model"):
        with pytest.raises(InvalidArgumentError, match="layer groups"):
            restorekit.convert(src, tmp / "x.weights.h5")
    with pytest.raises(InvalidArgumentError, match="weights_only"):
        restorekit.convert(tmp / "m.weights.h5", tmp / "x.weights.h5", layout="torch")
    with pytest.raises(OutputExistsError):
        restorekit.convert(tmp / "m.weights.h5", tmp / "m.weights.h5")
    assert sorted(os.listdir(tmp)) == before


def test_cli_convert_a_keras_file(saved, capsys):
    _, tmp = saved
    assert main(["convert", str(tmp / "m.keras"), str(tmp / "out.safetensors"), "--layout", "torch"]) == 0
    assert "enc1.weight" in st.read_shapes(tmp / "out.safetensors")


# ------------------------------------------------------------------ save_in_place on a .keras archive


def _members(path) -> dict:
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def _temporaries(directory) -> list:
    return [n for n in os.listdir(directory) if n.startswith(".restorekit-tmp")]


def test_save_in_place_rewrites_a_keras_archive_that_load_model_loads(saved):
    original, tmp = saved
    before = _members(tmp / "m.keras")
    editor = CheckpointEditor(tmp / "m.keras")
    editor.set("head/bias", np.array([5, 6], np.float32))
    editor.set("enc1/kernel", np.full((4, 3), 0.5, np.float32))
    assert editor.save_in_place() == str(tmp / "m.keras")
    after = _members(tmp / "m.keras")
    assert list(after) == list(before)  # same members, same order
    assert after["config.json"] == before["config.json"] and after["metadata.json"] == before["metadata.json"]
    assert not _temporaries(tmp)
    m = keras.models.load_model(tmp / "m.keras")
    np.testing.assert_array_equal(m.get_layer("head").bias.numpy(), [5, 6])
    np.testing.assert_array_equal(m.get_layer("enc1").kernel.numpy(), np.full((4, 3), 0.5, np.float32))
    np.testing.assert_array_equal(m.get_layer("bn").moving_mean.numpy(), original.get_layer("bn").moving_mean.numpy())
    for a, b in zip(m.optimizer.variables, original.optimizer.variables, strict=True):  # the optimizer state kept
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(CheckpointEditor(tmp / "m.keras").get("head/bias"), [5, 6])  # and reads back


def test_a_keras_archive_save_that_fails_midway_leaves_the_old_archive(saved, monkeypatch):
    from restorekit.keras_files import _writer as writer

    _, tmp = saved
    before, listing = (tmp / "m.keras").read_bytes(), sorted(os.listdir(tmp))
    editor = CheckpointEditor(tmp / "m.keras")
    editor.set("head/bias", np.array([5, 6], np.float32))
    plain = writer._add_member

    def fail_at_weights(archive, like, data, size, compress_type):
        if like.filename == writer.WEIGHTS_MEMBER:  # config.json and metadata.json are already in the new archive
            raise OSError(28, "No space left on device")
        plain(archive, like, data, size, compress_type)

    monkeypatch.setattr(writer, "_add_member", fail_at_weights)
    with pytest.raises(OSError, match="No space left"):
        editor.save_in_place()
    assert (tmp / "m.keras").read_bytes() == before and sorted(os.listdir(tmp)) == listing


def test_a_keras_archive_save_killed_before_the_rename_leaves_the_old_archive(saved):
    from restorekit._bundle import crashpoints

    _, tmp = saved
    before = (tmp / "m.keras").read_bytes()
    marker = tmp / "reached"
    script = ("import sys, numpy as np; from restorekit.edit import CheckpointEditor; "
              "ed = CheckpointEditor(sys.argv[1]); ed.set('head/bias', np.array([5, 6], np.float32)); ed.save_in_place()")
    root = os.path.dirname(os.path.dirname(os.path.abspath(restorekit.__file__)))
    env = dict(os.environ, PYTHONPATH=root, **{crashpoints.CRASH_HOOK_ENV: f"before-replace:{marker}"})
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp / "m.keras")], env=env)
    try:
        for _ in range(600):
            if marker.exists() or child.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), "the save never reached the rename"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (tmp / "m.keras").read_bytes() == before and _temporaries(tmp)  # the new archive, complete, not renamed
    keras.models.load_model(tmp / "m.keras")
    editor = CheckpointEditor(tmp / "m.keras")  # the next save sweeps what the killed one left
    editor.set("head/bias", np.array([7, 8], np.float32))
    editor.save_in_place()
    assert not _temporaries(tmp)
    np.testing.assert_array_equal(keras.models.load_model(tmp / "m.keras").get_layer("head").bias.numpy(), [7, 8])


@pytest.mark.parametrize("edit, error, match", [
    (lambda ed, tmp: ed.rename("layers/dense/vars/0", "layers/dense/w"), InvalidArgumentError, "not such a key"),
    (lambda ed, tmp: ed.delete("layers/dense/vars/1"), InvalidArgumentError, "had 2 variables"),
    (lambda ed, tmp: (ed.set("head/bias", np.zeros(2, np.float32)), model().save(tmp / "m.keras")), OutputError,
     "changed since this editor read it"),
], ids=["renamed-variable", "partial-layer-delete", "archive-replaced-since-opened"])
def test_a_keras_archive_edit_that_could_not_load_is_refused_in_place_and_nothing_written(saved, edit, error, match):
    _, tmp = saved
    editor = CheckpointEditor(tmp / "m.keras")
    edit(editor, tmp)
    before, listing = (tmp / "m.keras").read_bytes(), sorted(os.listdir(tmp))
    with pytest.raises(error, match=match):
        editor.save_in_place()
    assert (tmp / "m.keras").read_bytes() == before and sorted(os.listdir(tmp)) == listing


# ---------------------------------------------------------------- one rule for what is a weight (names.entry_kind)

def _legacy_full_model(tmp_path):
    """A Keras 3 legacy full-model HDF5 (``model.save('x.h5')``): Keras 2's ``model_weights`` + ``optimizer_weights``."""
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d1"), keras.layers.Dense(2, name="d2")])
    m.compile(optimizer="adam", loss="mse")
    m.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"), verbose=0)
    path = tmp_path / "legacy.h5"
    m.save(path)
    return m, path


def test_strip_weights_only_and_scan_agree_on_a_legacy_h5s_optimizer(capsys, tmp_path):
    m, path = _legacy_full_model(tmp_path)
    src = restorekit.Checkpoint(path)
    optimizer = sorted(k for k in src if k.startswith("optimizer_weights/"))
    weights = sorted(k for k in src if k.startswith("model_weights/"))
    assert len(optimizer) == 10 and len(weights) == 4
    # strip (the editor and the CLI)
    assert sorted(CheckpointEditor(path).strip_optimizer_slots()) == optimizer
    assert main(["strip", str(path), str(tmp_path / "stripped")]) == 0
    capsys.readouterr()
    stripped = restorekit.Checkpoint(tmp_path / "stripped")
    # convert --weights-only
    assert main(["convert", str(path), str(tmp_path / "w.safetensors"), "--weights-only"]) == 0
    capsys.readouterr()
    converted = restorekit.formats.open(tmp_path / "w.safetensors")
    # the editor's save with weights_only
    editor = CheckpointEditor(path)
    editor.save(tmp_path / "wo", weights_only=True)
    saved = restorekit.Checkpoint(tmp_path / "wo")
    kept = ["d1/bias", "d1/kernel", "d2/bias", "d2/kernel"]
    assert sorted(stripped.readable_name(k) for k in stripped) == kept
    assert sorted(converted) == kept
    assert sorted(saved.readable_name(k) for k in saved) == kept
    np.testing.assert_array_equal(converted.read("d1/kernel"), m.get_layer("d1").kernel.numpy())
    # and scan calls the same ten entries optimizer state
    report = restorekit.scan(path, m)
    assert report.is_complete and len(report.matched) == 4
    assert sorted(r.checkpoint_name for r in report.skipped if r.reason.startswith("optimizer slot")) == optimizer
