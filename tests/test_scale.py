"""Multi-shard checkpoints (issue 15, items 3-4): editor saves into N shards, sharded safetensors both
ways, remote saves shard by shard, and the bad shard sets they refuse."""

from __future__ import annotations

import os
import tracemalloc
import uuid

import numpy as np
import pytest
import tensorflow as tf

import restorekit._bundle.files as files
import restorekit.edit._save_tf as save_tf
from restorekit._bundle.writer import BundleWriter
from restorekit._checkpoint import Checkpoint
from restorekit.edit import CheckpointEditor
from restorekit.errors import ChecksumMismatchError, CorruptCheckpointError, InvalidArgumentError
from restorekit.export import convert

tf1 = tf.compat.v1


def _values(seed=0, layers=6, rows=64):
    rng = np.random.default_rng(seed)
    values = {}
    for i in range(layers):
        kernel = rng.standard_normal((rows * (i + 1), 32)).astype(np.float32)
        values[f"layer_{i}/kernel"] = kernel
        values[f"layer_{i}/kernel/Adam"] = rng.standard_normal(kernel.shape).astype(np.float32)
        values[f"layer_{i}/kernel/Adam_1"] = rng.standard_normal(kernel.shape).astype(np.float32)
        values[f"layer_{i}/bias"] = rng.standard_normal(32).astype(np.float32)
    values["global_step"] = np.int64(42)
    return values


def _write_sharded(prefix, values, num_shards):
    """Each variable and its slots in one shard, round-robin, as TF's sharded Saver places them by device."""
    with BundleWriter(prefix, num_shards=num_shards, shard_id=None) as writer:
        for name, value in values.items():
            layer = name.split("/")[0]
            shard = int(layer.split("_")[1]) % num_shards if layer.startswith("layer_") else 0
            writer.shard(shard).add(name, value)
    return str(prefix)


@pytest.fixture
def sharded(tmp_path):
    values = _values()
    return _write_sharded(tmp_path / "src" / "model.ckpt", values, 4), values


@pytest.fixture(scope="module")
def tf_sharded(tmp_path_factory):
    """A checkpoint TF's own Saver(sharded=True) wrote across three (logical) CPUs, with Adam slots."""
    prefix = str(tmp_path_factory.mktemp("tf_sharded") / "model.ckpt")
    with tf.Graph().as_default():
        losses = []
        for i in range(3):
            with tf1.device(f"/cpu:{i}"):
                v = tf1.get_variable(f"dense_{i}/kernel", initializer=tf1.random_normal([64 * (i + 1), 16], seed=i))
                losses.append(tf1.reduce_sum(tf1.square(v)))
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.AdamOptimizer(0.1).minimize(tf1.add_n(losses), global_step=step)
        saver = tf1.train.Saver(sharded=True)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train)
            saver.save(sess, prefix, write_meta_graph=False)
    reader = tf1.train.NewCheckpointReader(prefix)
    values = {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()}
    return prefix, values


def _read(prefix):
    reader = tf1.train.NewCheckpointReader(prefix)
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()}


def _visible(directory):
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


# ------------------------------------------------------------------ N shards in, N shards out
def test_bundle_writer_fills_several_shards_that_tf_reads(sharded):
    prefix, values = sharded
    assert Checkpoint(prefix).header.num_shards == 4
    assert sorted(n for n in _visible(os.path.dirname(prefix)) if ".data-" in n) == [
        f"model.ckpt.data-{i:05d}-of-00004" for i in range(4)]
    _assert_same(_read(prefix), values)


def test_tf_sharded_checkpoint_has_one_shard_per_device(tf_sharded):
    prefix, values = tf_sharded
    assert Checkpoint(prefix).header.num_shards >= 3
    assert any(n.endswith("/Adam_1") for n in values)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7], ids=["one", "two", "three", "more-shards-than-half-the-tensors"])
def test_strip_into_n_shards_keeps_values_order_and_balance(sharded, tmp_path, num_shards):
    prefix, values = sharded
    ed = CheckpointEditor(prefix)
    stripped = ed.strip_optimizer_slots()
    out = ed.save(tmp_path / "out" / "model.ckpt", num_shards=num_shards)
    kept = {n: v for n, v in values.items() if n not in stripped}
    _assert_same(_read(out), kept)
    ckpt = Checkpoint(out)
    assert ckpt.header.num_shards == num_shards
    assert [n for n in _visible(tmp_path / "out") if ".data-" in n] == [
        f"model.ckpt.data-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]
    # Plan order is kept: along the source's entry order, (shard, offset) only grows.
    places = [(ckpt.bundle_entry(n).shard_id, ckpt.bundle_entry(n).offset) for n in Checkpoint(prefix) if n in kept]
    assert places == sorted(places)
    sizes = [os.path.getsize(ckpt.data_file(i)) for i in range(num_shards)]
    largest = max(v.nbytes for v in kept.values())
    assert max(sizes) <= sum(sizes) / num_shards + largest


def test_tf_sharded_checkpoint_edited_cast_and_resharded(tf_sharded, tmp_path):
    prefix, values = tf_sharded
    ed = CheckpointEditor(prefix)
    ed.rename("dense_0/kernel", "renamed/kernel")
    ed.cast("dense_1/kernel", "bfloat16")
    ed.set("dense_2/kernel", np.ones_like(values["dense_2/kernel"]))
    for kwargs in ({}, {"compact": True}, {"num_shards": 2}):
        out = tmp_path / str(len(os.listdir(tmp_path))) / "model.ckpt"
        got = _read(ed.save(out, **kwargs))
        assert np.array_equal(got["renamed/kernel"], values["dense_0/kernel"])
        assert got["dense_1/kernel"].dtype == tf.bfloat16.as_numpy_dtype
        assert np.array_equal(got["dense_1/kernel"], values["dense_1/kernel"].astype(tf.bfloat16.as_numpy_dtype))
        assert np.array_equal(got["dense_2/kernel"], np.ones_like(values["dense_2/kernel"]))
        assert np.array_equal(got["dense_0/kernel/Adam_1"], values["dense_0/kernel/Adam_1"])


@pytest.mark.parametrize("workers", [1, 2], ids=["one-thread", "two-threads"])
def test_the_shard_pool_writes_the_same_bytes(sharded, tmp_path, monkeypatch, workers):
    prefix, values = sharded
    monkeypatch.setattr(save_tf, "WORKERS", workers)
    out = CheckpointEditor(prefix).save(tmp_path / "out" / "model.ckpt", num_shards=4)
    _assert_same(_read(out), values)


def test_sharded_safetensors_both_ways_from_a_multi_shard_checkpoint(tf_sharded, tmp_path):
    prefix, values = tf_sharded
    result = convert(prefix, tmp_path / "st", max_shard_size=40_000)
    assert len([f for f in result.files if f.endswith(".safetensors")]) > 1
    back = convert(tmp_path / "st", tmp_path / "back" / "model.ckpt")
    _assert_same(_read(back.path), values)


def test_compaction_memory_stays_bounded(tmp_path):
    big = {f"layer_{i}/w": np.full((1024, 1024), i, np.float32) for i in range(12)}  # 48 MB in 4 shards
    big.update({f"layer_{i}/w/Momentum": np.zeros((1024, 1024), np.float32) for i in range(12)})
    prefix = _write_sharded(tmp_path / "src" / "model.ckpt", big, 4)
    ed = CheckpointEditor(prefix)
    ed.strip_optimizer_slots()
    tracemalloc.start()
    try:
        out = ed.save(tmp_path / "out" / "model.ckpt", num_shards=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20  # a 1 MiB copy buffer per thread and bookkeeping, not the 48 MB kept
    assert np.array_equal(_read(out)["layer_11/w"], big["layer_11/w"])


# ------------------------------------------------------------------ remote outputs, shard by shard
def _staging_of(local):
    """The local staging directory of a file being published, or None (a source shard uploaded in place)."""
    directory = os.path.dirname(local)
    return directory if os.path.basename(directory).startswith("restorekit-upload-") else None


@pytest.mark.parametrize("kwargs", [{"num_shards": 4}, {"compact": True}, {}],
                         ids=["num_shards", "compact", "reused-shards-uploaded-from-the-source"])
def test_remote_save_stages_at_most_one_shard(sharded, monkeypatch, kwargs):
    prefix, values = sharded
    remote = f"ram://restorekit-scale-{uuid.uuid4().hex[:8]}"
    published, staged = [], []
    real = files.publish

    def publish(local, path, **kw):
        published.append(path.rsplit("/", 1)[1])
        directory = _staging_of(local)
        staged.append([n for n in os.listdir(directory) if ".data-" in n] if directory else [])
        return real(local, path, **kw)

    monkeypatch.setattr(files, "publish", publish)
    ed = CheckpointEditor(prefix)
    ed.set("layer_0/bias", np.zeros(32, np.float32))
    out = ed.save(remote + "/out/model.ckpt", **kwargs)
    assert published[-1] == "model.ckpt.index" and all(".data-" in n for n in published[:-1])
    assert len(published) - 1 == Checkpoint(out).header.num_shards
    assert max(len(s) for s in staged) <= 1
    if not kwargs:  # the source's shards go up from where they are: nothing staged for them
        assert sum(len(s) for s in staged) == 1
    got = _read(out)
    assert np.array_equal(got["layer_0/bias"], np.zeros(32, np.float32))
    assert np.array_equal(got["layer_5/kernel/Adam"], values["layer_5/kernel/Adam"])
    assert not [n for n in tf.io.gfile.listdir(remote + "/out") if n.startswith(".")]


def test_failed_remote_shard_upload_removes_the_shards_already_uploaded(sharded, monkeypatch):
    from restorekit.errors import OutputError

    prefix, _ = sharded
    remote = f"ram://restorekit-scale-{uuid.uuid4().hex[:8]}"
    real = files.publish
    count, staging = [], set()

    def publish(local, path, **kw):
        count.append(path)
        staging.add(_staging_of(local))
        if len(count) == 3:
            raise OutputError(f"could not write {path!r}: simulated network error")
        return real(local, path, **kw)

    monkeypatch.setattr(files, "publish", publish)
    with pytest.raises(OutputError, match="simulated"):
        CheckpointEditor(prefix).save(remote + "/model.ckpt", num_shards=4)
    assert not tf.io.gfile.exists(remote) or tf.io.gfile.listdir(remote) == []
    assert staging and not any(os.path.exists(d) for d in staging)


# ------------------------------------------------------------------ bad input: errors, nothing written
@pytest.mark.parametrize("num_shards", [0, -2, 1.5, True, "2"], ids=["zero", "negative", "float", "bool", "str"])
def test_num_shards_that_is_not_a_count_is_refused(sharded, tmp_path, num_shards):
    prefix, _ = sharded
    with pytest.raises(InvalidArgumentError, match="num_shards"):
        CheckpointEditor(prefix).save(tmp_path / "out" / "model.ckpt", num_shards=num_shards)
    assert not (tmp_path / "out").exists()


def test_num_shards_for_another_format_is_refused(sharded, tmp_path):
    prefix, _ = sharded
    with pytest.raises(InvalidArgumentError, match="num_shards"):
        CheckpointEditor(prefix).save(tmp_path / "model.safetensors", format="safetensors", num_shards=2)
    assert os.listdir(tmp_path) == ["src"]


@pytest.mark.parametrize("kwargs", [{}, {"compact": True}, {"num_shards": 2}], ids=["reuse", "compact", "num_shards"])
def test_a_missing_shard_is_named_and_nothing_written(sharded, tmp_path, kwargs):
    prefix, _ = sharded
    os.remove(f"{prefix}.data-00002-of-00004")
    ed = CheckpointEditor(prefix)
    with pytest.raises(CorruptCheckpointError, match=r"missing 1 of its 4 data shards \(model.ckpt.data-00002-of-00004\)"):
        ed.save(tmp_path / "out" / "model.ckpt", **kwargs)
    assert not (tmp_path / "out").exists()


def test_shards_of_two_saves_mixed_in_one_directory_are_refused(sharded, tmp_path):
    prefix, values = sharded
    # Another save of the same prefix in 3 shards left its files; one of ours is gone.
    _write_sharded(tmp_path / "other" / "model.ckpt", _values(seed=1), 3)
    for i in range(3):
        os.replace(tmp_path / "other" / f"model.ckpt.data-{i:05d}-of-00003", f"{prefix}.data-{i:05d}-of-00003")
    os.remove(f"{prefix}.data-00001-of-00004")
    with pytest.raises(CorruptCheckpointError, match=r"shards of another save .*\(of 00003\)"):
        CheckpointEditor(prefix).save(tmp_path / "out" / "model.ckpt", num_shards=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs", [{}, {"num_shards": 2}], ids=["reuse", "num_shards"])
def test_a_shard_from_another_save_with_the_same_count_fails_its_crc(sharded, tmp_path, kwargs):
    prefix, _ = sharded
    other = _write_sharded(tmp_path / "other" / "model.ckpt", _values(seed=1), 4)
    os.replace(f"{other}.data-00003-of-00004", f"{prefix}.data-00003-of-00004")
    with pytest.raises(ChecksumMismatchError, match="another save"):
        CheckpointEditor(prefix).save(tmp_path / "out" / "model.ckpt", **kwargs)
    assert not (tmp_path / "out").exists()


def test_bad_safetensors_shard_sets_are_refused_on_import(tf_sharded, tmp_path):
    prefix, _ = tf_sharded
    st = tmp_path / "st"
    convert(prefix, st, max_shard_size=40_000)
    shards = sorted(n for n in os.listdir(st) if n.endswith(".safetensors"))
    index = st / "model.safetensors.index.json"
    out = tmp_path / "back"
    # An index naming a shard file that is not in the directory.
    os.rename(st / shards[-1], tmp_path / shards[-1])
    with pytest.raises(CorruptCheckpointError, match="not in"):
        convert(st, out / "model.ckpt")
    # Without the index: a shard missing from the set.
    os.rename(index, tmp_path / "index.json")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        convert(st, out / "model.ckpt")
    # Shards of two saves mixed in one directory.
    os.rename(tmp_path / shards[-1], st / shards[-1])
    other = f"model-00001-of-{len(shards) + 1:05d}.safetensors"
    os.link(st / shards[0], st / other)
    with pytest.raises(CorruptCheckpointError, match="different saves"):
        convert(st, out / "model.ckpt")
    assert not out.exists()


def test_export_of_a_checkpoint_missing_a_shard_writes_nothing(sharded, tmp_path):
    prefix, _ = sharded
    os.remove(f"{prefix}.data-00001-of-00004")
    with pytest.raises(CorruptCheckpointError, match=r"missing 1 of its 4 data shards"):
        convert(prefix, tmp_path / "st", max_shard_size=40_000)
    assert not (tmp_path / "st").exists()
