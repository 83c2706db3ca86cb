"""restorekit/edit/_save_tf.py: shards linked or copied, memory while saving, TF2 checkpoints stripped."""

import errno
import os
import tracemalloc

import numpy as np
import pytest
import tensorflow as tf

from restorekit._bundle.writer import BundleWriter
from restorekit._checkpoint import Checkpoint
from restorekit.edit import CheckpointEditor


def test_shards_are_copied_when_hard_links_fail_across_filesystems(small_checkpoint, tmp_path, monkeypatch):
    prefix, values = small_checkpoint

    def no_link(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link", src)

    monkeypatch.setattr(os, "link", no_link)
    ed = CheckpointEditor(prefix)
    ed.rename("dense/kernel", "encoder/kernel")
    out = ed.save(tmp_path / "out" / "m")
    src_data = os.stat(prefix + ".data-00000-of-00001")
    out_data = os.stat(out + ".data-00000-of-00001")
    assert out_data.st_ino != src_data.st_ino and out_data.st_size == src_data.st_size  # a copy, not a link
    reader = tf.train.load_checkpoint(out)
    np.testing.assert_array_equal(reader.get_tensor("encoder/kernel"), values["dense/kernel"])
    np.testing.assert_array_equal(Checkpoint(prefix).read("dense/kernel"), values["dense/kernel"])


MIB = 1 << 20
TENSOR_MIB = 4  # every tensor; the checkpoint holds 12 of them (48 MiB)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("big") / "m")
    rng = np.random.RandomState(0)
    with BundleWriter(prefix) as w:
        for i in range(12):
            w.add(f"layer_{i:02d}/kernel", rng.rand(TENSOR_MIB * MIB // 4).astype(np.float32))
    return prefix


def _peak_mib(action):
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "edit",
    ["set-one", "cast-all", "rename-all", "strip-half"],
)
def test_peak_memory_while_saving_is_near_the_largest_tensor_not_the_checkpoint(big_checkpoint, tmp_path, edit):
    """Issue 4: peak memory is at most the largest tensor plus a small constant.

    tracemalloc sees numpy and bytes allocations; the bound (3 tensors + 4 MiB = 16 MiB)
    is a third of the 48 MiB checkpoint, so reading everything at once would fail it.
    """
    ed = CheckpointEditor(big_checkpoint)
    if edit == "set-one":
        ed.set("layer_03/kernel", np.zeros(TENSOR_MIB * MIB // 4, np.float32))
    elif edit == "cast-all":
        ed.cast(".*", "bfloat16")
    elif edit == "rename-all":
        ed.rename_all([(r"^layer_", "block_")])
    else:
        ed.delete(r"layer_0[0-5]")
    for compact in (False, True):
        out = tmp_path / f"out_{compact}" / "m"
        peak = _peak_mib(lambda: ed.save(out, compact=compact))
        assert peak < 3 * TENSOR_MIB + 4, f"compact={compact}: peak {peak:.1f} MiB for a 48 MiB checkpoint"
    assert len(Checkpoint(str(out))) == (6 if edit == "strip-half" else 12)


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


def test_strip_optimizer_slots_keeps_keras_model_weights(tmp_path):
    prefix, model = _keras_checkpoint_with_its_optimizer(tmp_path)
    graph = Checkpoint(prefix).object_graph
    weight_keys = {t.key for t in graph.variables if t.kind == "variable"}
    optimizer_keys = {t.key for t in graph.variables if t.kind == "optimizer"}
    ed = CheckpointEditor(prefix)
    stripped = set(ed.strip_optimizer_slots())
    assert stripped == optimizer_keys
    out = ed.save(tmp_path / "stripped" / "ckpt")
    kept = set(tf.train.load_checkpoint(out).get_variable_to_shape_map())
    assert weight_keys <= kept
    restored = Checkpoint(out)
    for v in model.weights:
        np.testing.assert_array_equal(restored.read(restored.object_paths[v.path]), v.numpy())


# ---------------------------------------------------------------- the output's name picks or checks the format

def test_save_takes_the_format_its_extension_names_and_refuses_a_contradiction(tmp_path):
    from safetensors.numpy import load_file

    from restorekit.errors import OutputNameError

    v = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    prefix = tf.train.Checkpoint(v=v).write(str(tmp_path / "src" / "ckpt"))
    ed = CheckpointEditor(prefix)
    out = ed.save(tmp_path / "out.safetensors")
    stored = load_file(out)
    np.testing.assert_array_equal(stored["v/.ATTRIBUTES/VARIABLE_VALUE"], v.numpy())
    assert not os.path.exists(str(tmp_path / "out.safetensors") + ".index")
    for name, fmt in (("bad.safetensors", "tf"), ("bad.onnx", None), ("bad.st", None)):
        with pytest.raises(OutputNameError):
            ed.save(tmp_path / name, format=fmt)
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors", "src"]
    assert Checkpoint(ed.save(tmp_path / "model.ckpt-7")).read("v/.ATTRIBUTES/VARIABLE_VALUE").shape == (2, 3)


def test_a_staged_index_that_reads_back_other_entries_than_written_is_not_published(small_checkpoint, tmp_path,
                                                                                     monkeypatch):
    """verify() compares each record read back with the bytes written for its entry: a changed offset fails."""
    from restorekit._bundle import crashpoints
    from restorekit._bundle.protos import BundleEntry, decode_entry, encode_entry
    from restorekit._bundle.table import read_table, write_table
    from restorekit.errors import OutputError

    prefix, values = small_checkpoint
    before = {n: open(p, "rb").read() for n, p in ((n, os.path.join(os.path.dirname(prefix), n))
                                                   for n in os.listdir(os.path.dirname(prefix)))}
    out = tmp_path / "out"
    real = crashpoints.crash_point

    def tamper(point):
        if point == "before-verify":
            (index,) = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f.endswith(".index")]
            records = read_table(open(index, "rb").read())
            key, value = records[1]
            moved = decode_entry(value)
            fresh = BundleEntry(moved.dtype, moved.shape, moved.shard_id, moved.offset + 4, moved.size, moved.crc32c)
            records[1] = (key, encode_entry(fresh))  # still a well-formed table, one entry 4 bytes further on
            with open(index, "wb") as f:
                f.write(write_table(records))
        real(point)

    monkeypatch.setattr(crashpoints, "crash_point", tamper)
    editor = CheckpointEditor(prefix)
    editor.rename_all(lambda n: "renamed/" + n)
    with pytest.raises(OutputError, match="reads back other bytes than written"):
        editor.save(out / "m")
    assert not out.exists() or os.listdir(out) == []
    for name, data in before.items():
        assert open(os.path.join(os.path.dirname(prefix), name), "rb").read() == data


def test_an_entry_read_from_an_index_is_written_back_as_read_and_a_changed_one_afresh(small_checkpoint):
    from restorekit._bundle.protos import decode_entry, encode_entry

    prefix, _ = small_checkpoint
    ckpt = Checkpoint(prefix)
    for name in ckpt:
        entry = ckpt.bundle_entry(name)
        assert entry.encoded is not None and decode_entry(entry.encoded) == entry
        assert encode_entry(entry) is entry.encoded
        moved = entry.replace(offset=entry.offset + 1)
        assert moved.encoded is None and moved != entry
        assert decode_entry(encode_entry(moved)) == moved
        assert moved.encoded == encode_entry(moved)
