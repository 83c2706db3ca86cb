"""Keras files as checkpoints: files written by Keras 3 itself (and a Keras 2 layout by h5py), read, scanned, restored."""

import os
import zipfile

import h5py
import keras
import numpy as np
import pytest

import restorekit
from restorekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MissingDependencyError,
    NoMatchError,
)
from restorekit.keras_files import KerasCheckpoint, is_keras_path


def functional(names=("enc1", "enc2", "head"), units=(3, 3, 2), *, bn=False, seed=0, dtype=None):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    x = inputs
    for name, n in zip(names, units):
        x = keras.layers.Dense(n, name=name, dtype=dtype)(x)
        if bn and name == names[0]:
            x = keras.layers.BatchNormalization(name="bn")(x)
    return keras.Model(inputs, x, name="net")


def sequential(names=("enc1", "head"), *, seed=0, name="seq"):
    # Named: Keras numbers auto names per process, and other test files expect the first 'sequential'.
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(3, name=n) for n in names], name=name)


def trained(model):
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, model.output_shape[-1]), "float32"), verbose=0)
    return model


def values(model) -> dict:
    return {v.path: np.array(v.numpy()) for v in model.weights}


@pytest.fixture
def saved(tmp_path):
    """A trained Functional model (with batch norm and Adam state) saved as .weights.h5 and .keras."""
    model = trained(functional(bn=True))
    model.save_weights(tmp_path / "m.weights.h5")
    model.save(tmp_path / "m.keras")
    return model, tmp_path


# ---------------------------------------------------------------- reading

@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_keras3_files_list_keys_readable_paths_and_read_numpy(saved, name):
    model, tmp = saved
    ckpt = restorekit.Checkpoint(tmp / name)
    assert isinstance(ckpt, KerasCheckpoint) and isinstance(ckpt, restorekit.Checkpoint)
    paths = {ckpt.readable_name(k): k for k in ckpt}
    assert paths["enc1/kernel"] == "layers/dense/vars/0"
    expected = values(model)
    for path in ("enc1/kernel", "enc1/bias", "bn/gamma", "bn/beta", "bn/moving_mean", "bn/moving_variance", "head/kernel"):
        entry = ckpt.entries[paths[path]]
        assert entry.shape == expected[path].shape and entry.dtype == "float32" and entry.path == path
        np.testing.assert_array_equal(ckpt.read(path), expected[path])
        np.testing.assert_array_equal(ckpt.read(paths[path]), expected[path])
    assert any(k.startswith("optimizer/vars/") for k in ckpt)
    assert ckpt.layer_names and set(ckpt.layer_names) == {"enc1", "enc2", "bn", "head"}


@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_keras_files_keep_the_mapping_contract(saved, name):
    _, tmp_path = saved
    ckpt = restorekit.Checkpoint(tmp_path / name)
    key = next(iter(ckpt))
    assert ckpt.get("missing", None) is None
    assert ckpt.get(key) is ckpt.entries[key] and key in ckpt and "missing" not in ckpt
    with pytest.raises(KeyError) as info:
        ckpt["enc1/kernal"]
    assert isinstance(info.value, restorekit.EntryNotFoundError)
    assert "has no entry 'enc1/kernal'." in str(info.value) and not str(info.value).startswith('"')
    assert "enc1/kernel" in info.value.closest


def test_keras_archive_keeps_its_config_as_data(saved):
    _, tmp = saved
    ckpt = restorekit.Checkpoint(str(tmp / "m.keras"))
    assert ckpt.config["class_name"] == "Functional" and "keras_version" in ckpt.metadata
    assert "archive" in ckpt.kind


def test_nested_sequential_and_lstm_get_keras_paths(tmp_path):
    keras.utils.set_random_seed(0)
    block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a")], name="block")
    inputs = keras.Input((5, 4))
    x = keras.layers.TimeDistributed(block, name="td")(inputs)
    model = keras.Model(inputs, keras.layers.LSTM(2, name="rnn")(x))
    model.save_weights(tmp_path / "n.weights.h5")
    ckpt = restorekit.Checkpoint(tmp_path / "n.weights.h5")
    readable = sorted(ckpt.readable_name(k) for k in ckpt)
    assert readable == ["rnn/lstm_cell/bias", "rnn/lstm_cell/kernel", "rnn/lstm_cell/recurrent_kernel",
                        "td/block/a/bias", "td/block/a/kernel"]
    # The wrapper's scope is in the file but not in the paths Keras gave (block was built alone):
    # a lookup by the Keras path still finds the entry, by its layer and variable names.
    for v in model.weights:
        np.testing.assert_array_equal(ckpt.read(ckpt.object_paths[v.path]), v.numpy())
    assert "other/a/kernel" not in ckpt.object_paths and "a/bias/x" not in ckpt.object_paths


@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_a_keras_path_two_nested_blocks_share_reads_through_the_block_names(tmp_path, name):
    # block_a and block_b each hold 'pre' and 'fc', built outside their scopes: Keras paths 'fc/kernel' twice
    from test_export_layouts_live import nested_model

    model = nested_model()
    model.save(tmp_path / name) if name.endswith(".keras") else model.save_weights(tmp_path / name)
    ckpt = restorekit.Checkpoint(tmp_path / name)
    by_key = {k: ckpt.readable_name(k) for k in ckpt}
    assert sorted(by_key.values()) == sorted(
        [f"{b}/{layer}/{leaf}" for b in ("block_a", "block_b") for layer in ("pre", "fc") for leaf in ("kernel", "bias")]
        + ["block_c/fc/kernel", "block_c/fc/bias", "block_c/bn/gamma", "block_c/bn/beta", "block_c/bn/moving_mean",
           "block_c/bn/moving_variance", "head/kernel", "head/bias"])
    assert by_key["layers/functional_1/layers/dense_1/vars/0"] == "block_b/fc/kernel"
    paths = {v.path for v in model.weights}
    assert "fc/kernel" in paths and "fc/kernel" not in ckpt.object_paths  # given to neither block by a guess
    for tree, v in zip(sorted(ckpt.object_paths), sorted(model.weights, key=lambda v: _tree_path(model, v))):
        np.testing.assert_array_equal(ckpt.read(tree), v.numpy(), err_msg=tree)


def _tree_path(model, variable) -> str:
    from restorekit._trackables import layer_paths

    return layer_paths(model)[id(variable)]


def test_unknown_count_keeps_the_index(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(center=False, name="bn")],
                             name="bn_model")
    model.save_weights(tmp_path / "b.weights.h5")
    weights = restorekit.Checkpoint(tmp_path / "b.weights.h5")
    # 3 variables of a 4-variable layer: which one is gone cannot be told from the file alone
    assert sorted(weights.readable_name(k) for k in weights) == ["bn/0", "bn/1", "bn/2"]
    model.save(tmp_path / "b.keras")
    archive = restorekit.Checkpoint(tmp_path / "b.keras")  # the config says center=False
    assert sorted(archive.readable_name(k) for k in archive) == ["bn/gamma", "bn/moving_mean", "bn/moving_variance"]


def write_legacy(path, model, *, full=False):
    """A Keras 2 layout written with h5py: layer_names / weight_names ('dense_1/kernel:0')."""
    with h5py.File(path, "w") as f:
        root = f.create_group("model_weights") if full else f
        layers = [layer for layer in model.layers if layer.weights]
        root.attrs["layer_names"] = np.array([layer.name.encode() for layer in layers])
        for layer in layers:
            group = root.create_group(layer.name)
            names = [f"{layer.name}/{w.name}:0" for w in layer.weights]
            group.attrs["weight_names"] = np.array([n.encode() for n in names])
            for name, w in zip(names, layer.weights):
                group.create_dataset(name, data=np.array(w.numpy()))
        if full:
            f.attrs["model_config"] = b'{"class_name": "Sequential", "config": {"name": "old"}}'
            opt = f.create_group("optimizer_weights")
            opt.attrs["weight_names"] = np.array([b"Adam/iter:0"])
            opt.create_dataset("Adam/iter:0", data=np.int64(5))
    return path


@pytest.mark.parametrize("full", [False, True], ids=["weights", "model"])
def test_legacy_keras2_h5_reads_by_weight_names(tmp_path, full):
    model = sequential(("dense", "dense_1"), seed=3)
    ckpt = restorekit.Checkpoint(write_legacy(tmp_path / "old.h5", model, full=full))
    assert "legacy" in ckpt.kind
    np.testing.assert_array_equal(ckpt.read("dense_1/kernel"), model.get_layer("dense_1").kernel.numpy())
    if full:
        assert ckpt.readable_name("optimizer_weights/Adam/iter:0") == "optimizer/Adam/iter"
        assert ckpt.config["class_name"] == "Sequential"


def test_legacy_h5_written_by_keras3_itself(tmp_path):
    model = trained(sequential(seed=4, name="seq"))
    model.save(tmp_path / "full.h5")
    ckpt = restorekit.Checkpoint(tmp_path / "full.h5")
    np.testing.assert_array_equal(ckpt.read("head/kernel"), model.get_layer("head").kernel.numpy())


def test_is_keras_path():
    assert is_keras_path("a/m.weights.h5") and is_keras_path("m.keras") and is_keras_path("old.HDF5")
    assert not is_keras_path("model.ckpt-10") and not is_keras_path(None) and not is_keras_path("gs://b/m.h5")


# ---------------------------------------------------------------- scan + restore

@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_scan_restore_a_new_head(saved, name):
    source, tmp = saved
    target = functional(("enc1", "enc2", "new_head"), (3, 3, 5), bn=True, seed=1)
    report = restorekit.scan(tmp / name, target)
    restorekit.restore(report)
    want, got = values(source), values(target)
    for path in ("enc1/kernel", "enc1/bias", "enc2/kernel", "bn/gamma", "bn/moving_variance"):
        np.testing.assert_array_equal(got[path], want[path])
    assert {r.variable_name for r in report.missing} == {"new_head/kernel", "new_head/bias"}
    assert {r.checkpoint_path for r in report.unused} == {"head/kernel", "head/bias"}
    assert all(r.reason.startswith("optimizer") for r in report.skipped)
    assert {r.checkpoint_path for r in report.matched} >= {"enc1/kernel", "bn/moving_mean"}


def test_inserted_layer_is_not_filled_by_position(saved):
    _, tmp = saved
    target = functional(("enc1", "enc2", "extra", "new_head"), (3, 3, 3, 2), bn=True, seed=2)
    before = values(target)
    report = restorekit.restore(restorekit.scan(tmp / "m.weights.h5", target))
    after = values(target)
    np.testing.assert_array_equal(after["extra/kernel"], before["extra/kernel"])
    assert {r.variable_name for r in report.missing} == {"extra/kernel", "extra/bias", "new_head/kernel", "new_head/bias"}


def test_sequential_model_scope_is_forgiven(tmp_path):
    source = sequential(seed=5, name="first")
    source.save_weights(tmp_path / "s.weights.h5")
    target = sequential(seed=6, name="second")
    assert {v.path.split("/")[0] for v in target.weights} == {"second"}
    report = restorekit.restore(restorekit.scan(tmp_path / "s.weights.h5", target), strict=True)
    assert len(report.matched) == 4
    np.testing.assert_array_equal(target.get_layer("head").kernel.numpy(), source.get_layer("head").kernel.numpy())


def test_include_exclude_shape_and_dtype_policies(saved):
    source, tmp = saved
    target = functional(("enc1", "enc2", "head"), (3, 3, 4), bn=True, seed=7)
    report = restorekit.scan(tmp / "m.keras", target, exclude=["bn"], shape_policy="slice_or_pad")
    restorekit.restore(report)
    assert {r.variable_name for r in report.skipped if r.variable_name} >= {"bn/gamma", "bn/beta"}
    np.testing.assert_array_equal(target.get_layer("head").kernel.numpy()[:, :2], source.get_layer("head").kernel.numpy())
    np.testing.assert_array_equal(target.get_layer("bn").moving_mean.numpy(), np.zeros(3))  # excluded: initial value
    with pytest.raises(NoMatchError):
        restorekit.scan(tmp / "m.keras", target, include=["nothing_here"])

    half = functional(seed=8, dtype="float16")
    report = restorekit.scan(tmp / "m.weights.h5", half)
    assert report.dtype_mismatched and not report.matched
    report = restorekit.restore(restorekit.scan(tmp / "m.weights.h5", half, dtype_policy="cast"))
    np.testing.assert_allclose(half.get_layer("enc1").kernel.numpy(), source.get_layer("enc1").kernel.numpy(), rtol=1e-3)


def test_strict_restore_raises_and_writes_nothing(saved):
    _, tmp = saved
    target = functional(("enc1", "enc2", "new_head"), bn=True, seed=9)
    before = values(target)
    with pytest.raises(restorekit.IncompleteRestoreError):
        restorekit.restore(restorekit.scan(tmp / "m.weights.h5", target), strict=True)
    assert all(np.array_equal(before[k], v) for k, v in values(target).items())


def test_keras_from_tf1_rules_on_a_legacy_file(tmp_path):
    # a Keras 2 era file whose weights carry TF1 names (weights, biases)
    with h5py.File(tmp_path / "slim.h5", "w") as f:
        f.attrs["layer_names"] = np.array([b"fc"])
        group = f.create_group("fc")
        group.attrs["weight_names"] = np.array([b"fc/weights:0", b"fc/biases:0"])
        group.create_dataset("fc/weights:0", data=np.full((4, 3), 2.0, "float32"))
        group.create_dataset("fc/biases:0", data=np.full((3,), 3.0, "float32"))
    target = sequential(("fc",), seed=1)
    report = restorekit.restore(restorekit.scan(tmp_path / "slim.h5", target, rules=restorekit.KERAS_FROM_TF1), strict=True)
    assert len(report.matched) == 2
    assert (target.get_layer("fc").kernel.numpy() == 2).all() and (target.get_layer("fc").bias.numpy() == 3).all()


def test_legacy_file_restores_into_a_keras3_model(tmp_path):
    source = sequential(("dense", "dense_1"), seed=10)
    path = write_legacy(tmp_path / "old.h5", source)
    target = sequential(("dense", "dense_1"), seed=11)
    restorekit.restore(restorekit.scan(path, target), strict=True)
    assert all(np.array_equal(a, b) for a, b in zip(values(source).values(), values(target).values()))


def test_restore_under_mirrored_strategy(saved):
    import tensorflow as tf

    source, tmp = saved
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with strategy.scope():
        target = functional(bn=True, seed=12)
    restorekit.restore(restorekit.scan(tmp / "m.keras", target), strict=True)
    kernel = target.get_layer("enc1").kernel.value
    for component in kernel.values:
        np.testing.assert_array_equal(component.numpy(), source.get_layer("enc1").kernel.numpy())


# ---------------------------------------------------------------- bad input: clear error, nothing written

def test_hdf5_that_is_not_keras(tmp_path):
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("images", data=np.zeros((2, 2)))
    with pytest.raises(CorruptCheckpointError, match="HDF5 file but not Keras weights.*'images'"):
        restorekit.Checkpoint(tmp_path / "data.h5")


@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_truncated_files(saved, name):
    _, tmp = saved
    data = (tmp / name).read_bytes()
    (tmp / ("cut_" + name)).write_bytes(data[: len(data) // 2])
    before = sorted(os.listdir(tmp))
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt|is truncated") as info:
        restorekit.Checkpoint(tmp / ("cut_" + name))
    assert "save" in str(info.value).lower()
    assert sorted(os.listdir(tmp)) == before


def test_garbage_with_a_keras_suffix(tmp_path):
    (tmp_path / "x.keras").write_bytes(b"not a zip at all")
    (tmp_path / "x.weights.h5").write_bytes(b"\x89HDF\r\n" + b"\x00" * 100)
    for name in ("x.keras", "x.weights.h5"):
        with pytest.raises(CorruptCheckpointError):
            restorekit.Checkpoint(tmp_path / name)


def test_keras_archive_with_escaping_member(saved):
    _, tmp = saved
    with zipfile.ZipFile(tmp / "m.keras") as src, zipfile.ZipFile(tmp / "evil.keras", "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        dst.writestr("../../outside.txt", b"x")
    before = sorted(os.listdir(tmp))
    with pytest.raises(CorruptCheckpointError, match="outside the folder"):
        restorekit.Checkpoint(tmp / "evil.keras")
    assert sorted(os.listdir(tmp)) == before and not (tmp.parent.parent / "outside.txt").exists()


def test_zip_without_weights(tmp_path):
    with zipfile.ZipFile(tmp_path / "other.keras", "w") as z:
        z.writestr("readme.txt", "hi")
    with pytest.raises(CorruptCheckpointError, match="not a Keras 3 .keras file"):
        restorekit.Checkpoint(tmp_path / "other.keras")


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no Keras file"):
        restorekit.Checkpoint(tmp_path / "gone.weights.h5")


def test_no_shared_layer_names_is_an_error_that_says_what_to_do(saved):
    _, tmp = saved
    target = functional(("a", "b", "c"), seed=13)
    before = values(target)
    with pytest.raises(NoMatchError, match="pairs Keras layers by name") as info:
        restorekit.restore(restorekit.scan(tmp / "m.weights.h5", target))
    assert "'enc1'" in str(info.value) and "rules=" in str(info.value)
    assert isinstance(info.value, InvalidArgumentError)
    assert all(np.array_equal(before[k], v) for k, v in values(target).items())


def test_without_h5py_the_error_names_the_extra(saved, monkeypatch):
    import sys

    _, tmp = saved
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(MissingDependencyError, match=r"restorekit\[keras\]"):
        restorekit.Checkpoint(tmp / "m.weights.h5")


def test_bfloat16_weights_keep_their_dtype(tmp_path):
    source = functional(("d",), (3,), seed=14, dtype="bfloat16")
    source.save_weights(tmp_path / "bf.weights.h5")
    ckpt = restorekit.Checkpoint(tmp_path / "bf.weights.h5")
    assert ckpt.entries["layers/dense/vars/0"].dtype == "bfloat16" and ckpt.entries["layers/dense/vars/0"].nbytes == 24
    target = functional(("d",), (3,), seed=15, dtype="bfloat16")
    restorekit.restore(restorekit.scan(ckpt, target), strict=True)
    np.testing.assert_array_equal(target.get_layer("d").kernel.numpy().astype("float32"),
                                  source.get_layer("d").kernel.numpy().astype("float32"))


# ---------------------------------------------------------------- RNG state is not a weight (issue 23, item 4)

def _lstm_dropout(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 3))
    x = keras.layers.LSTM(4, dropout=0.1, name="rnn")(inputs)
    x = keras.layers.Dropout(0.2, name="drop")(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(x), name="net")


@pytest.mark.parametrize("kind", ["weights_h5", "keras_archive", "tf2_checkpoint"])
def test_seed_generator_state_is_skipped_with_a_reason_like_counters(tmp_path, kind):
    import tensorflow as tf

    model = _lstm_dropout(0)
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((4, 5, 3), "float32"), np.ones((4, 2), "float32"), verbose=0)
    if kind == "weights_h5":
        path = str(tmp_path / "m.weights.h5")
        model.save_weights(path)
    elif kind == "keras_archive":
        path = str(tmp_path / "m.keras")
        model.save(path)
    else:
        path = tf.train.Checkpoint(model=model).write(str(tmp_path / "tf2" / "ckpt"))
    target = _lstm_dropout(1)  # its seed generators are numbered anew (seed_generator_2, ...)
    rng = [v.path for v in target.variables if "seed_generator" in v.path]
    assert len(rng) == 2
    report = restorekit.scan(path, target).assert_complete()
    assert report.is_complete and not report.missing and len(report.matched) == 5
    assert sorted(r.variable_name for r in report.skipped if r.reason == "RNG state (seed generator)") == sorted(rng)
    assert "RNG state (seed generator) (2)" in str(report)
    restorekit.restore(report, strict=True)
    for v, w in zip(target.trainable_weights, model.trainable_weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy())


def test_rng_state_does_not_hide_a_renumbered_sequential_scope(tmp_path):
    import tensorflow as tf

    def build(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="enc"), keras.layers.Dropout(0.3),
                                 keras.layers.Dense(2, name="head")])

    saved = build(0)
    prefix = tf.train.Checkpoint(model=saved).write(str(tmp_path / "tf2" / "ckpt"))
    target = build(1)  # 'sequential_N/enc/kernel' and a 'seed_generator_N/seed_generator_state' outside that scope
    report = restorekit.scan(prefix, list(target.variables))  # plain variables: paired by readable path
    assert len(report.matched) == 4 and report.is_complete
    restorekit.restore(report, strict=True)
    for v, w in zip(target.trainable_weights, saved.trainable_weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy())
