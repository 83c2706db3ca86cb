"""restorekit/edit/_save_shards.py: CheckpointEditor.save to a Hugging Face safetensors shard set, in one process and
across the ranks of a torch.distributed group (byte-identical to one process; a failing rank publishes nothing)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import requires_torch
from restorekit.edit import CheckpointEditor
from restorekit.errors import OptionNotApplicableError, OutputError
from restorekit.export import convert
from test_distributed import ROOT, _env, _files, _killed_at, _port, _ranks, _wait

SHARD = 12_000  # bytes: the checkpoint below makes six shards of it


@pytest.fixture
def tf2(tmp_path):
    """A TF2 object-based checkpoint written by TensorFlow: eight dense kernels, their biases and a step counter."""
    rng = np.random.RandomState(3)
    values = {f"d{i}_k": rng.randn(40, 40 + 4 * i).astype(np.float32) for i in range(8)}
    values.update({f"d{i}_b": rng.randn(40 + 4 * i).astype(np.float32) for i in range(8)})
    ckpt = tf.train.Checkpoint(step=tf.Variable(9, dtype=tf.int64), **{k: tf.Variable(v) for k, v in values.items()})
    return ckpt.write(str(tmp_path / "src" / "model.ckpt")), values


def key(name: str) -> str:
    return f"{name}/.ATTRIBUTES/VARIABLE_VALUE"


def edit(prefix) -> CheckpointEditor:
    """Every kind of edit at once: a rename, a cast, a new value, a deletion, an added tensor."""
    editor = CheckpointEditor(prefix)
    editor.rename(key("d1_k"), key("renamed_k"))
    editor.cast(key("d2_.*"), "float16")
    editor.set(key("d3_b"), np.arange(52, dtype=np.float32))
    editor.delete(key("d4_b"))
    editor.add("extra/table", np.full((3, 5), 7, dtype=np.int32))
    return editor


def _load(directory) -> dict:
    """Every tensor of a shard set, read by the safetensors library itself through the index's weight map."""
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        tensors = load_file(os.path.join(directory, shard))
        assert {n for n, s in weight_map.items() if s == shard} == set(tensors)
        out.update(tensors)
    return out


def test_an_edited_checkpoint_saves_as_hf_shards_holding_the_edited_values(tf2, tmp_path):
    prefix, values = tf2
    path = edit(prefix).save(tmp_path / "out", to="safetensors", max_shard_size=SHARD)
    assert path == str(tmp_path / "out" / "model.safetensors.index.json")
    shards = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    assert len(shards) > 4
    loaded = _load(tmp_path / "out")
    np.testing.assert_array_equal(loaded[key("renamed_k")], values["d1_k"])
    assert key("d1_k") not in loaded and key("d4_b") not in loaded
    assert loaded[key("d2_k")].dtype == np.float16
    np.testing.assert_array_equal(loaded[key("d2_k")], values["d2_k"].astype(np.float16))
    np.testing.assert_array_equal(loaded[key("d3_b")], np.arange(52, dtype=np.float32))
    np.testing.assert_array_equal(loaded["extra/table"], np.full((3, 5), 7, dtype=np.int32))
    np.testing.assert_array_equal(loaded[key("d5_k")], values["d5_k"])
    assert loaded[key("step")] == 9


def test_an_edited_keras_file_saves_as_hf_shards_under_its_readable_paths(tmp_path):
    import keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    model.save_weights(tmp_path / "m.weights.h5")
    editor = CheckpointEditor(tmp_path / "m.weights.h5")
    editor.set("layers/dense/vars/1", np.full(16, 0.5, dtype=np.float32))
    editor.save(tmp_path / "out", to="safetensors", max_shard_size=200)
    loaded = _load(tmp_path / "out")
    assert sorted(loaded) == ["dense/bias", "dense/kernel", "dense_1/bias", "dense_1/kernel"]
    np.testing.assert_array_equal(loaded["dense/kernel"], model.layers[0].kernel.numpy())
    np.testing.assert_array_equal(loaded["dense_1/kernel"], model.layers[1].kernel.numpy())
    np.testing.assert_array_equal(loaded["dense/bias"], np.full(16, 0.5, dtype=np.float32))


def test_an_unedited_save_writes_the_bytes_convert_writes(tf2, tmp_path):
    prefix, _ = tf2
    convert(prefix, tmp_path / "converted", max_shard_size=SHARD)
    CheckpointEditor(prefix).save(tmp_path / "saved", to="safetensors", max_shard_size=SHARD, layout=None)
    assert _files(tmp_path / "saved") == _files(tmp_path / "converted")


@pytest.mark.parametrize("out, options, error", [
    ("model.ckpt", {"distributed": True}, OptionNotApplicableError),
    ("model.safetensors", {"distributed": True}, OptionNotApplicableError),
    ("gs://bucket/out", {"to": "safetensors", "max_shard_size": SHARD}, OutputError),
], ids=["distributed for a TF checkpoint", "distributed for one safetensors file", "shards to remote storage"])
def test_a_save_that_cannot_be_split_or_sharded_is_refused_before_anything_is_written(tf2, tmp_path, out, options,
                                                                                      error):
    prefix, _ = tf2
    target = out if out.startswith("gs://") else str(tmp_path / "out" / out)
    with pytest.raises(error):
        edit(prefix).save(target, **options)
    assert not (tmp_path / "out").exists()


@requires_torch
def test_distributed_outside_any_group_saves_as_one_process(tf2, tmp_path):
    prefix, _ = tf2
    edit(prefix).save(tmp_path / "one", to="safetensors", max_shard_size=SHARD)
    edit(prefix).save(tmp_path / "alone", to="safetensors", max_shard_size=SHARD, distributed=True)
    assert _files(tmp_path / "alone") == _files(tmp_path / "one")


# Every rank of one torchrun launch: the same edits saved across the ranks; then again with rank 1 failing while it
# computes an edited value (every rank must name it, nothing published); then the rerun into that same output.
DRIVER = """
import json, os, sys
import numpy as np
import torch.distributed as dist
from restorekit.edit import CheckpointEditor, _source
from restorekit.errors import RankFailedError
sys.path.insert(0, os.path.join(sys.argv[3], "tests"))
from test_edit_save_shards import edit

prefix, work, shard = sys.argv[1], sys.argv[2], int(sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
original, computed = _source.Source.value, []

def counted(self, item):
    if item.origin != "_CHECKPOINTABLE_OBJECT_GRAPH":  # the rewritten object graph: every rank's first shard
        computed.append(str(item.origin))
    return original(self, item)

_source.Source.value = counted
edit(prefix).save(os.path.join(work, "two"), to="safetensors", max_shard_size=shard, distributed=True)
mine = sorted(set(computed))
if rank == 1:
    def failing(self, item):
        raise RuntimeError("injected while computing " + str(item.origin))
    _source.Source.value = failing
try:
    edit(prefix).save(os.path.join(work, "failed"), to="safetensors", max_shard_size=shard, distributed=True)
    failure = None
except RankFailedError as e:
    failure = {"rank": e.rank, "message": str(e), "published": sorted(os.listdir(os.path.join(work, "failed")))
               if os.path.isdir(os.path.join(work, "failed")) else []}
_source.Source.value = counted
dist.barrier()
with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
    json.dump({"computed": mine, "failure": failure}, f)
edit(prefix).save(os.path.join(work, "failed"), to="safetensors", max_shard_size=shard, distributed=True)
dist.destroy_process_group()
"""


@requires_torch
@pytest.mark.slow  # two ranks under torchrun: tens of seconds with TensorFlow imported on each
def test_two_ranks_save_an_edited_checkpoint_as_one_process_does_and_a_failing_rank_publishes_nothing(tf2, tmp_path):
    prefix, _ = tf2
    edit(prefix).save(tmp_path / "one", to="safetensors", max_shard_size=SHARD)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(_port()), str(driver), prefix, str(tmp_path), ROOT,
                          str(SHARD)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one = _files(tmp_path / "one")
    assert len(one) > 4 and _files(tmp_path / "two") == one
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    computed = [report["computed"] for report in reports]
    assert all(computed) and not set(computed[0]) & set(computed[1])  # each rank computes its own shards' values
    for failure in (report["failure"] for report in reports):
        assert failure["rank"] == 1 and "rank 1 failed" in failure["message"], failure
        assert "injected while computing" in failure["message"] and "nothing was published" in failure["message"]
        assert [n for n in failure["published"] if not n.startswith(".")] == []
    assert _files(tmp_path / "failed") == one  # the rerun completes: no leftovers


# One rank of a launch started with torchrun's variables: the edits, then the save across the ranks.
RANK_SCRIPT = """
import os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from test_edit_save_shards import edit

edit(sys.argv[2]).save(sys.argv[3], to="safetensors", max_shard_size=int(sys.argv[4]), distributed=True)
"""


@requires_torch
@pytest.mark.slow
@pytest.mark.parametrize("rank, point", [(1, "rank-shards-staged"), (0, "commit-start")],
                         ids=["rank 1 killed after its shards", "rank 0 killed as its commit starts"])
def test_a_rank_killed_during_a_distributed_save_publishes_nothing_and_the_rerun_leaves_no_leftovers(tf2, tmp_path,
                                                                                                   rank, point):
    import signal

    prefix, _ = tf2
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    args = [ROOT, prefix, str(out), str(SHARD)]
    results = _killed_at(point, rank, args, tmp_path / "marker", script=script)
    assert results[rank][0] == -signal.SIGKILL
    for err in [err for r, (_, err) in enumerate(results) if r != rank]:
        assert f"rank {rank} failed" in err, err[-2000:]
        assert ("complete or absent" if rank == 0 else "nothing was published") in err, err[-2000:]
    assert not (out / "model.safetensors.index.json").exists()
    assert [code for code, _ in _wait(_ranks(args, script=script))] == [0, 0]
    edit(prefix).save(tmp_path / "one", to="safetensors", max_shard_size=SHARD)
    assert _files(out) == _files(tmp_path / "one")
