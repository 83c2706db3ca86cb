"""Keras sharded sets written by restorekit (restorekit/keras_files/_writer.py write_sharded, via CheckpointEditor.save
and save_in_place): Keras' model.load_weights loads them with the edited values; the shard count follows
max_shard_size; refused saves write nothing."""

import json
import os

import keras
import numpy as np
import pytest

import restorekit
from restorekit.edit import CheckpointEditor
from restorekit.errors import EditError, InvalidArgumentError

SHARD = 20_000  # bytes


def model(enc="enc1"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(50, 16, name="emb")(inputs))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(32, name=enc)(x))
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x), name="net")


def values(m) -> dict:
    return {v.path: np.array(v.numpy()) for v in m.weights}


def loaded(path, **kwargs) -> dict:
    m = model(**kwargs)
    m.load_weights(path)
    return values(m)


@pytest.fixture
def saved(tmp_path):
    m = model()
    m.save_weights(tmp_path / "m.weights.h5")
    m.save_weights(tmp_path / "k.weights.json", max_shard_size=SHARD / 1024**3)
    return values(m), tmp_path


def shards(folder, stem):
    return sorted(n for n in os.listdir(folder) if n.startswith(stem + "_") and n.endswith(".weights.h5"))


def test_an_edited_file_saved_as_a_set_loads_with_the_edit_and_nothing_else_changed(saved):
    before, tmp = saved
    editor = CheckpointEditor(tmp / "m.weights.h5")
    editor.set("head/bias", np.arange(10, dtype=np.float32))
    assert editor.save(tmp / "out.weights.json", max_shard_size=SHARD) == str(tmp / "out.weights.json")
    assert shards(tmp, "out") == ["out_00000.weights.h5", "out_00001.weights.h5"]
    after = loaded(tmp / "out.weights.json")
    np.testing.assert_array_equal(after.pop("head/bias"), np.arange(10))
    for path, value in after.items():
        np.testing.assert_array_equal(value, before[path], err_msg=path)
    ours, keras_own = (json.loads((tmp / f"{n}.weights.json").read_text()) for n in ("out", "k"))
    assert ours["metadata"] == keras_own["metadata"]  # Keras' own count of the bytes
    assert set(ours["weight_map"]) == set(keras_own["weight_map"])
    assert restorekit.Checkpoint(tmp / "out.weights.json").group_attrs() == restorekit.Checkpoint(
        tmp / "m.weights.h5").group_attrs()
    assert not [n for n in os.listdir(tmp) if n.startswith(".restorekit-tmp")]


@pytest.mark.parametrize("limit, count", [(200_000, 1), (17_000, 2), (16_600, 3)], ids=["one", "two", "three"])
def test_the_number_of_shards_follows_max_shard_size(saved, limit, count):
    before, tmp = saved
    CheckpointEditor(tmp / "m.weights.h5").save(tmp / "out.weights.json", max_shard_size=limit)
    assert len(shards(tmp, "out")) == count
    index = json.loads((tmp / "out.weights.json").read_text())
    assert {n for v in index["weight_map"].values() for n in ([v] if isinstance(v, str) else v)} == set(
        shards(tmp, "out"))
    for path, value in loaded(tmp / "out.weights.json").items():
        np.testing.assert_array_equal(value, before[path], err_msg=path)


def test_a_layer_running_over_two_shards_loads(saved):
    before, tmp = saved
    CheckpointEditor(tmp / "m.weights.h5").save(tmp / "out.weights.json", max_shard_size=17_000)
    index = json.loads((tmp / "out.weights.json").read_text())
    assert any(isinstance(v, list) and len(v) > 1 for v in index["weight_map"].values())
    for path, value in loaded(tmp / "out.weights.json").items():
        np.testing.assert_array_equal(value, before[path], err_msg=path)


def test_save_in_place_replaces_the_set_whole(saved):
    before, tmp = saved
    editor = CheckpointEditor(tmp / "k.weights.json")
    old = shards(tmp, "k")
    editor.set("enc1/bias", np.ones(32, np.float32))
    assert editor.save_in_place() == str(tmp / "k.weights.json")
    assert shards(tmp, "k") == old  # the default limit is the old set's largest shard: the same cut
    after = loaded(tmp / "k.weights.json")
    np.testing.assert_array_equal(after.pop("enc1/bias"), np.ones(32))
    for path, value in after.items():
        np.testing.assert_array_equal(value, before[path], err_msg=path)
    editor = CheckpointEditor(tmp / "k.weights.json")
    editor.save_in_place(max_shard_size=10**6)  # fewer shards: the old ones the index no longer names go
    assert shards(tmp, "k") == ["k_00000.weights.h5"]
    assert loaded(tmp / "k.weights.json").keys() == before.keys()
    assert not [n for n in os.listdir(tmp) if n.startswith(".restorekit-tmp")]


@pytest.mark.parametrize("edit, save, error", [
    (lambda ed: ed.delete("layers/dense/vars/1"), {}, InvalidArgumentError),
    (lambda ed: None, {"max_shard_size": 100}, InvalidArgumentError),
    (lambda ed: None, {"max_shard_size": 0.5}, InvalidArgumentError),
], ids=["partial-layer-delete", "a-tensor-over-the-limit", "a-float-limit"])
def test_a_refused_save_writes_nothing(saved, edit, save, error):
    _, tmp = saved
    listing = sorted(os.listdir(tmp))
    contents = {n: (tmp / n).read_bytes() for n in listing}
    editor = CheckpointEditor(tmp / "k.weights.json")
    edit(editor)
    with pytest.raises(error):
        editor.save(tmp / "out.weights.json", **({"max_shard_size": SHARD} | save))
    with pytest.raises(error):
        editor.save_in_place(**save)
    assert sorted(os.listdir(tmp)) == listing and {n: (tmp / n).read_bytes() for n in listing} == contents


def test_a_set_from_one_file_needs_a_shard_size(saved):
    _, tmp = saved
    with pytest.raises(InvalidArgumentError, match="max_shard_size"):
        CheckpointEditor(tmp / "m.weights.h5").save(tmp / "out.weights.json")
    with pytest.raises(InvalidArgumentError, match="weights.json"):
        CheckpointEditor(tmp / "m.weights.h5").save(tmp / "out.weights.h5", max_shard_size=SHARD)
    assert not (tmp / "out.weights.json").exists() and not (tmp / "out.weights.h5").exists()


def test_a_renamed_layer_in_a_set(saved):
    before, tmp = saved
    editor = CheckpointEditor(tmp / "k.weights.json")
    editor.rename("enc1", "enc9")
    editor.save_in_place()
    assert "enc9/kernel" in restorekit.Checkpoint(tmp / "k.weights.json").object_paths
    after = loaded(tmp / "k.weights.json", enc="enc9")
    np.testing.assert_array_equal(after["enc9/kernel"], before["enc1/kernel"])
    with pytest.raises(EditError):
        CheckpointEditor(tmp / "k.weights.json").rename("enc9/kernel", "enc1/kernel")


@pytest.mark.parametrize("point", ["after-aside-index", "rename-k_00000.weights.h5", "before-index-rename"])
def test_keras_loads_the_old_set_after_a_kill_inside_save_in_place(saved, point):
    """issue 22: the new shards take the old names (Keras opens NAME_00000 first), so the old set is re-published
    under free names before they land; killed at any point until the new index lands, Keras loads the old weights,
    and the next write sweeps the asides."""
    import signal
    import subprocess
    import sys
    import time

    before, tmp = saved
    marker = tmp / "reached"
    code = ("import numpy as np\nfrom restorekit.edit import CheckpointEditor\n"
            f"ed = CheckpointEditor({str(tmp / 'k.weights.json')!r})\n"
            "ed.set('enc1/bias', np.ones(32, np.float32))\ned.save_in_place()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", code],
                             env={**os.environ, "PYTHONPATH": root, "RESTOREKIT_CRASH_HOOK": f"{point}:{marker}"})
    deadline = time.monotonic() + 300  # guards a hung child only
    while not marker.exists():
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    marker.unlink()
    for path, value in loaded(tmp / "k.weights.json").items():
        np.testing.assert_array_equal(value, before[path], err_msg=path)
    CheckpointEditor(tmp / "m.weights.h5").save(tmp / "next.weights.h5")  # the next write in the folder sweeps
    index = json.loads((tmp / "k.weights.json").read_text())["weight_map"]
    named = {n for v in index.values() for n in ([v] if isinstance(v, str) else v)}
    assert set(shards(tmp, "k")) == named | {"k_00000.weights.h5"}  # the old set (maybe under its aside names)
    assert not [n for n in os.listdir(tmp) if n.startswith(".")]
    CheckpointEditor(tmp / "k.weights.json").save_in_place()  # and the next in-place save gives Keras' names back
    assert shards(tmp, "k") == ["k_00000.weights.h5", "k_00001.weights.h5"]
    for path, value in loaded(tmp / "k.weights.json").items():
        np.testing.assert_array_equal(value, before[path], err_msg=path)
