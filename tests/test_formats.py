"""restorekit.formats: one Source protocol, one open(path) deciding by bytes, and every verb reading every format.

The files are written by TensorFlow, Keras and restorekit's own converters; a restore
from a converted file must give the values and the report a restore from the TF
checkpoint gives.
"""

import dataclasses
import os
import shutil
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import formats
from restorekit.errors import CheckpointNotFoundError, EntryNotFoundError, InvalidArgumentError, NoMatchError
from restorekit.export import export_checkpoint
from restorekit.formats import Source, detect

from conftest import requires_torch, save_variables

tf1 = tf.compat.v1


FORMATS = [
    pytest.param("safetensors", "m.safetensors", {}, id="safetensors"),
    pytest.param("safetensors", "sharded", {"max_shard_size": 60}, id="hf_sharded_safetensors"),
    pytest.param("npz", "m.npz", {}, id="npz"),
    pytest.param("torch", "m.pt", {}, id="torch", marks=requires_torch),
]


def _convert(prefix, tmp_path, fmt, name, options):
    out = tmp_path / name
    export_checkpoint(prefix, out, format=fmt, **options)
    return str(out)


# ---------------------------------------------------------------- detection by bytes

@pytest.fixture
def tf1_checkpoint(tmp_path):
    rng = np.random.RandomState(3)
    values = {
        "net/dense/kernel": rng.randn(4, 3).astype(np.float32),
        "net/dense/bias": rng.randn(3).astype(np.float32),
        "net/out/kernel": rng.randn(3, 2).astype(np.float32),
        "global_step": np.int64(11),
    }
    return save_variables(tmp_path / "tf1" / "model.ckpt", values), values


def test_open_decides_by_bytes_and_uses_the_name_only_to_break_ties(tf1_checkpoint, tmp_path):
    prefix, _ = tf1_checkpoint
    st = _convert(prefix, tmp_path, "safetensors", "m.safetensors", {})
    npz = _convert(prefix, tmp_path, "npz", "m.npz", {})
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    model.save_weights(tmp_path / "k.weights.h5")
    model.save(tmp_path / "k.keras")
    assert detect(prefix) == detect(prefix + ".index") == detect(os.path.dirname(prefix)) == "tf"
    assert detect(prefix + ".data-00000-of-00001") == "tf"
    assert (detect(st), detect(npz)) == ("safetensors", "npz")
    assert (detect(tmp_path / "k.weights.h5"), detect(tmp_path / "k.keras")) == ("keras", "keras")
    # the bytes win over a misleading name
    shutil.copy(st, tmp_path / "looks_like.pt")
    shutil.copy(tmp_path / "k.weights.h5", tmp_path / "weights.bin")
    shutil.copy(npz, tmp_path / "arrays.keras")
    assert detect(tmp_path / "looks_like.pt") == "safetensors"
    assert detect(tmp_path / "weights.bin") == "keras"
    assert detect(tmp_path / "arrays.keras") == "npz"
    np.testing.assert_array_equal(formats.open(tmp_path / "looks_like.pt").read("net/dense/bias"),
                                  restorekit.Checkpoint(prefix).read("net/dense/bias"))
    # nothing there: the TF reader's own error and hints
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        formats.open(tmp_path / "nothing")
    with pytest.raises(InvalidArgumentError, match="unknown checkpoint format 'hdf9'"):
        formats.open(st, "hdf9")


def _zip_of_text(path):
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "hello")


# (file name, how to write it, what the error says it looks like)
UNKNOWN_FILES = [
    pytest.param("pnet.lz4", lambda p: p.write_bytes(b"\x04\x22\x4d\x18\x64\x40\xa7" + bytes(40)),
                 "an LZ4 frame (joblib.dump(..., compress='lz4') writes these)", id="joblib_lz4"),
    pytest.param("notes.zip", _zip_of_text, "a zip archive (1 member: 'readme.txt')", id="zip_of_text"),
    pytest.param("w.gz", lambda p: p.write_bytes(__import__("gzip").compress(b"weights")), "gzip-compressed data",
                 id="gzip"),
    pytest.param("a.npy", lambda p: np.save(p, np.ones(3)), "one numpy .npy array", id="npy"),
    pytest.param("model.pbx", lambda p: p.write_bytes(b"\x08\x09\x12\x07pytorch" + bytes(8)),
                 "a protobuf message (an ONNX model?", id="onnx_bytes_other_name"),
    pytest.param("notes.txt", lambda p: p.write_text("hello"), None, id="text"),
]


@pytest.mark.parametrize("name, write, looks_like", UNKNOWN_FILES)
def test_an_existing_file_of_no_readable_format_says_what_it_is_not_that_it_is_missing(tmp_path, name, write,
                                                                                       looks_like):
    """Issue 39 finding 2: such a file was a CheckpointNotFoundError 'no checkpoint at X (looked for X.index)'."""
    from restorekit.errors import CorruptCheckpointError, UnknownFormatError

    path = tmp_path / name
    write(path)
    out = tmp_path / "out"
    out.mkdir()
    for attempt in (lambda: formats.open(path), lambda: restorekit.Checkpoint(path),
                    lambda: restorekit.convert(path, out / "m.safetensors"), lambda: restorekit.scan(path)):
        with pytest.raises(UnknownFormatError) as caught:
            attempt()
        e = caught.value
        assert not isinstance(e, FileNotFoundError) and isinstance(e, CorruptCheckpointError)
        assert e.path == str(path) and e.looks_like == (None if looks_like is None else e.looks_like)
        assert looks_like is None or looks_like in e.looks_like
        assert {"tf", "keras", "safetensors", "torch", "npz", "onnx"} <= set(e.formats)
        text = str(e)
        assert text.startswith(f"{str(path)!r} is a file, but not a checkpoint restorekit can read: ")
        assert "looked for" not in text and "restorekit reads tf, keras, safetensors" in text
    assert os.listdir(out) == []


@requires_torch
def test_torch_zip_and_legacy_pickle_are_told_from_npz_and_keras_by_their_members(tmp_path):
    import torch

    state = {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    torch.save(state, tmp_path / "zip.keras")  # zip format, a misleading name
    torch.save(state, tmp_path / "legacy.npz", _use_new_zipfile_serialization=False)
    assert detect(tmp_path / "zip.keras") == "torch"
    assert detect(tmp_path / "legacy.npz") == "torch"
    np.testing.assert_array_equal(formats.open(tmp_path / "zip.keras").read("fc.weight"), state["fc.weight"].numpy())


# ---------------------------------------------------------------- the Source protocol

@pytest.mark.parametrize("fmt, name, options", FORMATS)
def test_every_format_is_a_source_with_the_mapping_contract(tf1_checkpoint, tmp_path, fmt, name, options):
    prefix, values = tf1_checkpoint
    path = _convert(prefix, tmp_path, fmt, name, options)
    src = restorekit.Checkpoint(path)  # Checkpoint() opens through the registry too
    assert isinstance(src, Source) and isinstance(src, restorekit.Checkpoint)
    assert sorted(src) == sorted(values)  # a file restorekit wrote lists the TF names it came from
    assert src.get("missing", None) is None and "net/dense/kernel" in src and "missing" not in src
    entry = src["net/dense/kernel"]
    assert (entry.name, entry.shape, entry.dtype, entry.nbytes) == ("net/dense/kernel", (4, 3), "float32", 48)
    assert src.stored_range("net/dense/kernel") is None  # decoded, never copied as TF shard bytes
    np.testing.assert_array_equal(src.read("net/out/kernel"), values["net/out/kernel"])
    with pytest.raises(KeyError) as info:
        src["net/dense/kernal"]
    assert isinstance(info.value, EntryNotFoundError) and isinstance(info.value, NoMatchError)
    assert "net/dense/kernel" in info.value.closest
    assert str(info.value) == info.value.args[0] and "has no tensor 'net/dense/kernal'." in str(info.value)
    assert src.verify().ok


def test_tf_and_keras_sources_give_their_stored_ranges(tf1_checkpoint, tmp_path):
    prefix, values = tf1_checkpoint
    ckpt = restorekit.Checkpoint(prefix)
    assert isinstance(ckpt, Source)
    path, offset, size = ckpt.stored_range("net/dense/bias")
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(size) == values["net/dense/bias"].tobytes()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    model.save_weights(tmp_path / "k.weights.h5")
    keras_src = formats.open(tmp_path / "k.weights.h5")
    assert isinstance(keras_src, Source)
    path, offset, size = keras_src.stored_range("d/kernel")
    with open(path, "rb") as f:
        f.seek(offset)
        np.testing.assert_array_equal(np.frombuffer(f.read(size), np.float32).reshape(4, 3), model.layers[0].kernel)


# ---------------------------------------------------------------- every verb takes every source

def _keras_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(5, name="enc")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(x), name="net")


@pytest.fixture
def tf2_checkpoint(tmp_path):
    model = _keras_model(0)
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "tf2" / "ckpt"))
    return prefix, {v.path: v.numpy() for v in model.weights}


def _same_report(report, other) -> bool:
    """Equal but for the checkpoint path: every record (names, shapes, dtypes, reasons) and hint."""
    return dataclasses.replace(report, checkpoint=other.checkpoint) == other


@pytest.mark.parametrize("fmt, name, options", FORMATS)
def test_scan_and_restore_a_keras_model_from_a_converted_tf2_checkpoint(tf2_checkpoint, tmp_path, fmt, name, options):
    prefix, values = tf2_checkpoint
    path = _convert(prefix, tmp_path, fmt, name, options)
    from_tf = restorekit.scan(prefix, _keras_model(1))
    model = _keras_model(2)
    report = restorekit.scan(path, model)
    assert report.checkpoint == path
    assert _same_report(report, from_tf) and report.is_complete and len(report.matched) == 4
    restorekit.restore(report, strict=True)
    for v in model.weights:
        np.testing.assert_array_equal(v.numpy(), values[v.path])


@pytest.mark.parametrize("fmt, name, options", FORMATS)
def test_warm_start_and_scaffold_a_tf1_graph_from_a_converted_checkpoint(tf1_checkpoint, tmp_path, fmt, name, options):
    prefix, values = tf1_checkpoint
    path = _convert(prefix, tmp_path, fmt, name, options)

    def build():
        with tf1.variable_scope("net"):
            tf1.get_variable("dense/kernel", [4, 3])
            tf1.get_variable("dense/bias", [3])
            tf1.get_variable("out/kernel", [3, 2])
            tf1.get_variable("new/kernel", [2, 2])
        return {v.op.name: v for v in tf1.global_variables()}

    with tf.Graph().as_default():
        build()
        from_tf = restorekit.scan(prefix)
    with tf.Graph().as_default():
        variables = build()
        report = restorekit.scan(path)
        assert _same_report(report, from_tf) and len(report.matched) == 3
        restorekit.warm_start(report)
        with pytest.raises(InvalidArgumentError, match="a Saver restores TF checkpoints only"):
            restorekit.partial_saver(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for name in ("net/dense/kernel", "net/dense/bias", "net/out/kernel"):
                np.testing.assert_array_equal(sess.run(variables[name]), values[name])
    with tf.Graph().as_default():
        variables = build()
        scaffold = restorekit.easy_going_scaffold(path)
        assert _same_report(scaffold.restore_report, from_tf)
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold) as sess:
            for name in ("net/dense/kernel", "net/out/kernel"):
                np.testing.assert_array_equal(sess.run(variables[name]), values[name])
            assert sess.run(variables["net/new/kernel"]).shape == (2, 2)


@requires_torch
def test_a_foreign_torch_file_scans_under_its_own_names(tmp_path):
    import torch

    torch.save({"enc.kernel": torch.ones(4, 5), "enc.bias": torch.zeros(5)}, tmp_path / "foreign.pt")
    src = formats.open(tmp_path / "foreign.pt")
    assert sorted(src) == ["enc.bias", "enc.kernel"]
    model = _keras_model(4)
    report = restorekit.scan(tmp_path / "foreign.pt", model, rules=[(r"^enc/(\w+)$", r"enc.\1")])
    assert sorted(r.checkpoint_name for r in report.matched) == ["enc.bias", "enc.kernel"]
    restorekit.restore(report)
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), np.ones((4, 5)))


def test_no_foreign_framework_is_imported_to_open_a_tf_checkpoint(tf1_checkpoint):
    prefix, _ = tf1_checkpoint
    before = "torch" in sys.modules
    restorekit.Checkpoint(prefix)
    assert before or "torch" not in sys.modules


@pytest.mark.parametrize("fmt, name", [("safetensors", "m.safetensors"), ("npz", "m.npz")], ids=["safetensors", "npz"])
def test_the_editor_refuses_another_format_by_name_and_writes_nothing(tf1_checkpoint, tmp_path, fmt, name):
    from restorekit.cli import main
    from restorekit.edit import CheckpointEditor

    prefix, _ = tf1_checkpoint
    path = _convert(prefix, tmp_path, fmt, name, {})
    with pytest.raises(InvalidArgumentError, match=f"is a {fmt} file; convert it first"):
        CheckpointEditor(path)
    assert main(["strip", path, str(tmp_path / "out")]) != 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_a_tf_prefix_beside_a_file_of_its_name_opens_as_tf(tmp_path):
    import h5py

    from conftest import write_bundle

    prefix = write_bundle(tmp_path / "model.h5", {"w": np.ones(2, np.float32)})
    with h5py.File(prefix, "w") as f:  # an HDF5 file whose name is the prefix
        f["x"] = np.zeros(1)
    assert detect(prefix) == "tf"
    assert restorekit.Checkpoint(prefix).read("w").tolist() == [1.0, 1.0]
