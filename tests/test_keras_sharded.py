"""Sharded Keras 3 weights (restorekit/keras_files/_sharded.py): a .weights.json index and its shards, written by
Keras itself, read as the unsharded .weights.h5 of the same model; scanned, restored, converted, edited; bad sets
refused with nothing written."""

import json
import os
import shutil
import warnings

import h5py
import keras
import numpy as np
import pytest

import restorekit
from restorekit.cli import main
from restorekit.edit import CheckpointEditor
from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidArgumentError, OutputExistsError
from restorekit.formats import safetensors as st
from restorekit.layouts import _planned as sources
from restorekit.keras_files import KerasCheckpoint, is_keras_path
from restorekit.keras_files._sharded import ShardedKerasCheckpoint

SHARD = 20_000 / 1024**3  # Keras' max_shard_size is in GB (it multiplies by 1024**3): ~20 KB shards


def model(*, head="head", units=10, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(50, 16, name="emb")(inputs))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(32, name="enc1")(x))
    return keras.Model(inputs, keras.layers.Dense(units, name=head)(x), name="net")


def values(m) -> dict:
    return {v.path: np.array(v.numpy()) for v in m.weights}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained model (Adam state included) saved unsharded and sharded; the folder holds nothing else."""
    tmp = tmp_path_factory.mktemp("sharded")
    m = model()
    m.compile(optimizer="adam", loss="mse")
    m.fit(np.arange(32).reshape(4, 8) % 50, np.ones((4, 10), "float32"), verbose=0)
    m.save_weights(tmp / "m.weights.h5")
    (tmp / "set").mkdir()
    m.save_weights(tmp / "set" / "m.weights.json", max_shard_size=SHARD)
    return m, tmp


@pytest.fixture
def copy(saved, tmp_path):
    """A private copy of the sharded set, to damage."""
    shutil.copytree(saved[1] / "set", tmp_path / "set")
    return tmp_path / "set"


def index_of(folder) -> dict:
    return json.loads((folder / "m.weights.json").read_text())


# ---------------------------------------------------------------- reading

def test_the_set_reads_as_the_unsharded_file_of_the_same_model(saved):
    m, tmp = saved
    shards = sorted(n for n in os.listdir(tmp / "set") if n.endswith(".weights.h5"))
    assert len(shards) >= 3 and shards[0] == "m_00000.weights.h5"
    # a layer's vars group split over two shards is among them (Keras lists its shards)
    assert any(isinstance(v, list) and len(v) > 1 for v in index_of(tmp / "set")["weight_map"].values())

    assert is_keras_path(tmp / "set" / "m.weights.json")
    sharded = restorekit.Checkpoint(tmp / "set" / "m.weights.json")
    whole = restorekit.Checkpoint(tmp / "m.weights.h5")
    assert isinstance(sharded, ShardedKerasCheckpoint) and isinstance(sharded, restorekit.Checkpoint)
    assert isinstance(restorekit.formats.open(tmp / "set" / "m.weights.json"), ShardedKerasCheckpoint)
    # the single-file reader refuses an index by name, rather than switching class under its caller
    with pytest.raises(InvalidArgumentError, match="sharded Keras 3 weights set.*restorekit.Checkpoint"):
        KerasCheckpoint(tmp / "set" / "m.weights.json")
    assert list(sharded.entries) == list(whole.entries) and len(sharded) == len(whole)
    for key, entry in whole.entries.items():
        assert sharded.entries[key] == entry, key  # name, shape, dtype, size, readable path
        np.testing.assert_array_equal(sharded.read(key), whole.read(key), err_msg=key)
    assert sharded.layer_names == whole.layer_names and sharded.group_attrs() == whole.group_attrs()
    assert sharded.files == (str(tmp / "set" / "m.weights.json"), *(str(tmp / "set" / n) for n in shards))
    expected = values(m)
    for path in ("emb/embeddings", "enc1/kernel", "bn/moving_variance", "head/bias"):
        np.testing.assert_array_equal(sharded.read(path), expected[path])
    assert [a.shape for a in sharded.read_many(["head/kernel", "emb/embeddings", "head/kernel"])] == [
        (32, 10), (50, 16), (32, 10)]


def test_a_read_opens_only_the_shard_that_holds_it(saved, monkeypatch):
    _, tmp = saved
    ckpt = restorekit.Checkpoint(tmp / "set" / "m.weights.json")
    holder = ckpt.stored_range("head/kernel")[0]
    opened = []
    real = KerasCheckpoint._h5
    monkeypatch.setattr(KerasCheckpoint, "_h5", lambda self, path=None: opened.append(path) or real(self, path))
    ckpt.read("head/kernel")
    assert opened == [holder] and holder != ckpt.files[1]


def test_stored_ranges_name_the_shard_file_that_holds_the_bytes(saved):
    _, tmp = saved
    ckpt = restorekit.Checkpoint(tmp / "set" / "m.weights.json")
    used = set()
    for key in ckpt.entries:
        path, offset, size = ckpt.stored_range(key)
        used.add(path)
        assert path in ckpt.files[1:]
        value = ckpt.read(key)
        with open(path, "rb") as f:
            f.seek(offset)
            raw = np.frombuffer(f.read(size), value.dtype.newbyteorder("<"))
        np.testing.assert_array_equal(raw.reshape(value.shape), value, err_msg=key)
    assert used == set(ckpt.files[1:])


def test_cli_inspect_lists_every_shards_tensors(saved, capsys):
    _, tmp = saved
    assert main(["inspect", str(tmp / "set" / "m.weights.json"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    whole = restorekit.Checkpoint(tmp / "m.weights.h5")
    assert [(e["name"], e["path"], e["shape"]) for e in listed["entries"]] == [
        (k, e.path, list(e.shape)) for k, e in whole.entries.items()]


# ---------------------------------------------------------------- scan + restore

def test_verify_reads_back_every_tensor_of_every_shard(saved, capsys):
    ckpt = restorekit.Checkpoint(str(saved[1] / "set" / "m.weights.json"))
    result = ckpt.verify()
    assert result.ok and result.problems == ()
    assert result.nbytes == ckpt.nbytes and result.tensors == len(ckpt.entries) > 0
    assert main(["verify", str(saved[1] / "set" / "m.weights.json")]) == 0


def test_scan_restore_into_the_same_model(saved):
    source, tmp = saved
    target = model(seed=1)
    report = restorekit.restore(restorekit.scan(tmp / "set" / "m.weights.json", target), strict=True)
    assert len(report.matched) == len(target.weights)
    want, got = values(source), values(target)
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def test_scan_restore_a_new_head_leaves_it_fresh(saved):
    source, tmp = saved
    target = model(head="new_head", units=3, seed=2)
    fresh = values(target)
    report = restorekit.restore(restorekit.scan(tmp / "set" / "m.weights.json", target))
    got, want = values(target), values(source)
    for path in ("emb/embeddings", "enc1/kernel", "enc1/bias", "bn/gamma", "bn/moving_mean", "bn/moving_variance"):
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    np.testing.assert_array_equal(got["new_head/kernel"], fresh["new_head/kernel"])
    assert {r.variable_name for r in report.missing} == {"new_head/kernel", "new_head/bias"}
    assert {r.checkpoint_path for r in report.unused} == {"head/kernel", "head/bias"}
    assert report.skipped and all(r.reason.startswith("optimizer") for r in report.skipped)


# ---------------------------------------------------------------- convert and edit

def test_convert_to_safetensors_copies_each_shards_bytes(saved, tmp_path, monkeypatch):
    _, tmp = saved
    whole = restorekit.Checkpoint(tmp / "m.weights.h5")
    # Every tensor is copied as stored from its shard: none is decoded through h5py.
    monkeypatch.setattr(KerasCheckpoint, "read_many", lambda self, names: pytest.fail(f"decoded {names}"))
    restorekit.convert(tmp / "set" / "m.weights.json", tmp_path / "m.safetensors")
    monkeypatch.undo()
    from safetensors.numpy import load_file

    stored = load_file(tmp_path / "m.safetensors")
    assert set(stored) == {whole.readable_name(k) for k in whole.entries}
    for key in whole.entries:
        np.testing.assert_array_equal(stored[whole.readable_name(key)], whole.read(key), err_msg=key)
    # the same tensors and record as from the unsharded source (laid out in the order of the shards)
    restorekit.convert(tmp / "m.weights.h5", tmp_path / "whole.safetensors")
    sharded, whole = st.read_header(tmp_path / "m.safetensors"), st.read_header(tmp_path / "whole.safetensors")
    assert {n: (i.dtype, i.shape) for n, i in sharded.tensors.items()} == {
        n: (i.dtype, i.shape) for n, i in whole.tensors.items()}
    assert sharded.record == whole.record and sharded.metadata == whole.metadata


def test_convert_to_a_tf_checkpoint_and_to_a_weights_h5(saved, tmp_path):
    source, tmp = saved
    src = tmp / "set" / "m.weights.json"
    restorekit.convert(src, tmp_path / "tf" / "model", weights_only=True)
    back = restorekit.Checkpoint(tmp_path / "tf" / "model")
    for path, value in values(source).items():
        np.testing.assert_array_equal(back.read(path), value, err_msg=path)
    result = restorekit.convert(src, tmp_path / "one.weights.h5")
    assert not result.dropped
    target = model(seed=3)
    target.load_weights(tmp_path / "one.weights.h5")
    for path, value in values(source).items():
        np.testing.assert_array_equal(values(target)[path], value, err_msg=path)


def test_editor_reads_edits_and_saves_a_sharded_set(saved, tmp_path):
    source, tmp = saved
    src = tmp / "set" / "m.weights.json"
    editor = CheckpointEditor(src)
    assert "layers/dense_1/vars/0" in [e.name for e in editor.list()]
    np.testing.assert_array_equal(editor.get("bn/moving_variance"), source.get_layer("bn").moving_variance.numpy())
    editor.set("head/bias", np.arange(10, dtype=np.float32))
    out = editor.save(tmp_path / "edited.weights.h5")
    target = model(seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras skips the optimizer of an uncompiled model with a warning
        target.load_weights(out)
    np.testing.assert_array_equal(target.get_layer("head").bias.numpy(), np.arange(10))
    np.testing.assert_array_equal(target.get_layer("enc1").kernel.numpy(), source.get_layer("enc1").kernel.numpy())
    editor.save(tmp_path / "tf" / "model", weights_only=True)
    back = restorekit.Checkpoint(tmp_path / "tf" / "model")
    np.testing.assert_array_equal(back.read("head/bias"), np.arange(10))
    np.testing.assert_array_equal(back.read("emb/embeddings"), source.get_layer("emb").embeddings.numpy())


def test_the_set_is_never_overwritten_by_a_save(saved, copy):
    """save() never writes over the set it reads (save_in_place does: tests/test_keras_files_writer_sharded.py)."""
    before = {n: (copy / n).read_bytes() for n in os.listdir(copy)}
    editor = CheckpointEditor(copy / "m.weights.json")
    editor.set("head/bias", np.zeros(10, np.float32))
    with pytest.raises(OutputExistsError) as info:  # its shards would be the source's own
        editor.save(copy / "m.weights.weights.json", max_shard_size=10**6)
    assert info.value.is_source
    for name in ("m_00001.weights.h5", "m.weights.json"):
        with pytest.raises(OutputExistsError) as info:
            editor.save(copy / name, overwrite=True)
        assert info.value.is_source
    for to in (None, "safetensors"):
        with pytest.raises(OutputExistsError) as info:
            restorekit.convert(copy / "m.weights.json", copy / "m_00001.weights.h5", to=to, overwrite=True)
        assert info.value.is_source
    assert {n: (copy / n).read_bytes() for n in os.listdir(copy)} == before


# ---------------------------------------------------------------- bad sets: the restorekit error, nothing written

def damaged_index(folder, content) -> None:
    (folder / "m.weights.json").write_text(content if isinstance(content, str) else json.dumps(content))


def assert_refused(folder, error, match, tmp_path):
    with pytest.raises(error, match=match):
        restorekit.Checkpoint(folder / "m.weights.json")
    for out in (tmp_path / "out.safetensors", tmp_path / "out.weights.h5", tmp_path / "tf" / "model"):
        with pytest.raises(error, match=match):
            restorekit.convert(folder / "m.weights.json", out)
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "out.weights.h5").exists()
    assert not (tmp_path / "tf").exists() or not os.listdir(tmp_path / "tf")


def test_no_index_is_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        restorekit.Checkpoint(tmp_path / "none.weights.json")


def test_a_missing_shard_is_named(copy, tmp_path):
    os.remove(copy / "m_00002.weights.h5")
    assert_refused(copy, CorruptCheckpointError, "'m_00002.weights.h5' .* is missing", tmp_path)


@pytest.mark.parametrize("content, match", [
    ('{"weight_map": {"/layers/dense/vars": "m_00000.weights.h5"', "not valid JSON"),
    ("[1, 2]", "no 'weight_map'"),
    ({"metadata": {}, "config": {}}, "no 'weight_map'"),
    ({"weight_map": {"/layers/dense/vars": 3}}, "not a shard file name"),
    ({"weight_map": {"/layers/dense/vars": []}}, "not a shard file name"),
], ids=["truncated-json", "a-list", "no-weight-map", "a-number-for-a-shard", "no-shard-for-a-group"])
def test_an_index_that_is_not_a_keras_shard_index(copy, tmp_path, content, match):
    damaged_index(copy, content)
    assert_refused(copy, CorruptCheckpointError, match, tmp_path)


@pytest.mark.parametrize("name", ["../outside.weights.h5", "ABSOLUTE", "sub/m_00000.weights.h5", "..\\x.h5", "."],
                         ids=["dot-dot", "absolute", "subfolder", "windows-dot-dot", "the-folder"])
def test_a_shard_path_that_leaves_the_folder_is_refused_unopened(copy, tmp_path, monkeypatch, name):
    # a perfectly good shard waits at each of those places: it must not be opened
    (copy / "sub").mkdir()
    shutil.copy(copy / "m_00000.weights.h5", copy / "sub" / "m_00000.weights.h5")
    shutil.copy(copy / "m_00000.weights.h5", copy.parent / "outside.weights.h5")
    if name == "ABSOLUTE":
        name = str(copy.parent / "outside.weights.h5")
    index = index_of(copy)
    index["weight_map"]["/layers/embedding/vars"] = name
    damaged_index(copy, index)
    monkeypatch.setattr(h5py, "File", lambda *a, **k: pytest.fail(f"opened {a}"))
    assert_refused(copy, CorruptCheckpointError, "not a file beside the index", tmp_path)


@pytest.mark.parametrize("other", ["another-model", "the-unsharded-file"])
def test_a_shard_from_another_save_is_refused(saved, copy, tmp_path, other):
    if other == "another-model":
        keras.utils.set_random_seed(5)
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(600, name="a"), keras.layers.Dense(2, name="b")])
        m.save_weights(tmp_path / "o.weights.json", max_shard_size=SHARD)
        shutil.copy(tmp_path / "o_00000.weights.h5", copy / "m_00000.weights.h5")
    else:
        shutil.copy(saved[1] / "m.weights.h5", copy / "m_00001.weights.h5")
    assert_refused(copy, CorruptCheckpointError, "does not match the index", tmp_path)


def test_shards_swapped_under_each_others_names_are_refused(copy, tmp_path):
    os.rename(copy / "m_00001.weights.h5", copy / "tmp.h5")
    os.rename(copy / "m_00002.weights.h5", copy / "m_00001.weights.h5")
    os.rename(copy / "tmp.h5", copy / "m_00002.weights.h5")
    assert_refused(copy, CorruptCheckpointError, "does not match the index", tmp_path)


def test_a_dataset_in_two_shards_is_refused(copy, tmp_path):
    with h5py.File(copy / "m_00000.weights.h5", "r") as f:
        key = next(k for k in ("layers/dense/vars/0", "layers/embedding/vars/0") if k in f)
        value = f[key][()]
    with h5py.File(copy / "m_00001.weights.h5", "r+") as f:
        f.create_dataset(key, data=value)
    index = index_of(copy)
    group = "/" + key.rsplit("/", 1)[0]
    shards = index["weight_map"][group]
    index["weight_map"][group] = [*(shards if isinstance(shards, list) else [shards]), "m_00001.weights.h5"]
    damaged_index(copy, index)
    assert_refused(copy, CorruptCheckpointError, "also in 'm_00000.weights.h5'", tmp_path)


def test_a_shard_that_is_not_hdf5(copy, tmp_path):
    (copy / "m_00001.weights.h5").write_bytes(b"not hdf5 at all")
    assert_refused(copy, CorruptCheckpointError, "not valid HDF5", tmp_path)


def test_a_shard_removed_after_opening_is_named_before_a_restore(copy):
    ckpt = restorekit.Checkpoint(copy / "m.weights.json")
    os.remove(copy / "m_00003.weights.h5")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        ckpt.check_shards()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        restorekit.scan(copy / "m.weights.json", model(seed=6))


def test_a_weights_h5_file_still_reads_through_the_sources_as_before(saved):
    # the sharded reader did not change how an unsharded file names its source and ranges
    _, tmp = saved
    ckpt = restorekit.Checkpoint(tmp / "m.weights.h5")
    assert ckpt.files == (str(tmp / "m.weights.h5"),)
    assert sources.keras_source(ckpt).stored_range("enc1/kernel")[0] == str(tmp / "m.weights.h5")
