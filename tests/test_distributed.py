"""restorekit._bundle.ranks and convert / average / merge(..., distributed=True): HF shards written across gloo ranks
on localhost, byte-identical to one process, with nothing published when a rank raises or is killed."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import requires_torch, write_bundle
from restorekit._bundle.ranks import assign, first_host, launched_size
from restorekit import average, interpolate
from restorekit._merging import merge
from restorekit.errors import OptionNotApplicableError
from restorekit.export import convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD = 600_000  # bytes: the checkpoint below makes 11 shards of it


@pytest.fixture
def source(tmp_path):
    rng = np.random.RandomState(0)
    values = {f"layer{i}/kernel": rng.randn(256, 256 + 16 * i).astype(np.float32) for i in range(12)}
    values["global_step"] = np.int64(7)
    return write_bundle(tmp_path / "src" / "model.ckpt", values)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT, RESTOREKIT_DISTRIBUTED_TIMEOUT="60")
    for key in ("RESTOREKIT_CRASH_HOOK", "RESTOREKIT_CRASH_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                *(k for k in os.environ if k.startswith("SLURM_"))):
        env.pop(key, None)
    env.update(extra)
    return env


def _ranks(args, n=2, *, script=None, **extra) -> list[subprocess.Popen]:
    """``python -m restorekit ARGS`` (or ``python SCRIPT ARGS``) as ``n`` ranks, with the variables torchrun gives each."""
    port = _port()
    command = [str(script)] if script is not None else ["-m", "restorekit"]
    return [subprocess.Popen([sys.executable, *command, *args], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port), **extra))
            for r in range(n)]


def _wait(procs, timeout=180) -> list[tuple[int, str]]:
    return [(p.returncode, p.communicate(timeout=timeout)[1]) for p in procs for _ in [p.wait(timeout=timeout)]]


def _files(directory) -> dict:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def _convert_args(src, out):
    return ["convert", str(src), str(out), "--max-shard-size", str(SHARD), "-q"]


def test_shards_are_assigned_to_ranks_balanced_by_bytes_largest_first():
    assert assign([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40+10 and 30+20
    assert assign([5, 5, 5], 4) == [0, 1, 2]
    assert assign([], 3) == []


def test_distributed_refuses_an_output_that_is_not_sharded_safetensors_before_anything_is_written(source, tmp_path):
    with pytest.raises(OptionNotApplicableError, match="distributed"):
        convert(source, tmp_path / "model.safetensors", distributed=True)
    assert not os.path.exists(tmp_path / "model.safetensors")


@requires_torch
def test_distributed_outside_any_group_writes_as_one_process(source, tmp_path):
    convert(source, tmp_path / "one", max_shard_size=SHARD)
    convert(source, tmp_path / "alone", max_shard_size=SHARD, distributed=True)
    assert _files(tmp_path / "alone") == _files(tmp_path / "one")


@requires_torch
def test_torchrun_two_ranks_write_the_bytes_one_process_writes(source, tmp_path):
    convert(source, tmp_path / "one", max_shard_size=SHARD)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(_port()), "-m", "restorekit",
                          *_convert_args(source, tmp_path / "two")], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one = _files(tmp_path / "one")
    assert len(one) == 12 and _files(tmp_path / "two") == one


@requires_torch
@pytest.mark.slow  # the torchrun case above keeps two ranks in the fast set
def test_two_ranks_convert_a_safetensors_shard_set_to_the_bytes_one_process_writes(source, tmp_path):
    convert(source, tmp_path / "set", max_shard_size=3 * SHARD)
    convert(tmp_path / "set", tmp_path / "one", max_shard_size=SHARD)
    results = _wait(_ranks(_convert_args(tmp_path / "set", tmp_path / "two")))
    assert [code for code, _ in results] == [0, 0], results
    assert _files(tmp_path / "two") == _files(tmp_path / "one")


@requires_torch
@pytest.mark.parametrize("rank, point", [(1, "shard-3-staged"), pytest.param(0, "index-json-written", marks=pytest.mark.slow),
                                         pytest.param(1, "rank-shards-staged", marks=pytest.mark.slow)],
                         ids=["rank 1 raises writing a shard", "rank 0 raises after the index",
                              "rank 1 raises after its shards"])
def test_a_rank_that_raises_stops_every_rank_naming_it_and_nothing_is_published(source, tmp_path, rank, point):
    out = tmp_path / "out"
    results = _wait(_ranks(_convert_args(source, out), RESTOREKIT_CRASH_HOOK=f"{point}:raise",
                           RESTOREKIT_CRASH_RANK=str(rank)))
    for code, err in results:
        assert code != 0 and f"rank {rank} failed" in err and "nothing was published" in err, err[-2000:]
    assert not os.path.exists(out) or [n for n in os.listdir(out) if not n.startswith(".")] == []
    # the rerun completes and leaves nothing else behind
    results = _wait(_ranks(_convert_args(source, out)))
    assert [code for code, _ in results] == [0, 0], results
    convert(source, tmp_path / "one", max_shard_size=SHARD)
    assert _files(out) == _files(tmp_path / "one")


COMMIT_POINTS = [(0, "staging-made"), (1, "tensor-0"), (1, "before-replace"), (1, "shard-2-staged"),
                 (1, "rank-shards-staged"), (0, "ranks-gathered"), (0, "index-json-written"), (0, "commit-start"),
                 (0, "rename-model-00005-of-00011.safetensors"), (0, "before-index-rename")]


@requires_torch
@pytest.mark.slow
@pytest.mark.parametrize("rank, point", COMMIT_POINTS, ids=[f"rank {r} killed at {p}" for r, p in COMMIT_POINTS])
def test_a_rank_killed_at_each_commit_point_publishes_nothing_and_the_rerun_leaves_no_leftovers(source, tmp_path,
                                                                                               rank, point):
    out, marker = tmp_path / "out", tmp_path / "marker"
    procs = _ranks(_convert_args(source, out), RESTOREKIT_CRASH_HOOK=f"{point}:{marker}", RESTOREKIT_CRASH_RANK=str(rank))
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the point was never reached"
        time.sleep(0.05)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    results = _wait(procs)
    survivors = [err for r, (code, err) in enumerate(results) if r != rank]
    assert results[rank][0] == -signal.SIGKILL
    for err in survivors:
        assert f"rank {rank} failed" in err, err[-2000:]
        # rank 0 killed while it publishes: the others cannot tell whether its renames had ended
        publishing = rank == 0 and point != "staging-made"
        assert ("complete or absent" if publishing else "nothing was published") in err, err[-2000:]
    index = out / "model.safetensors.index.json"
    assert not index.exists()  # the index is the last rename: without it, no output
    results = _wait(_ranks(_convert_args(source, out)))
    assert [code for code, _ in results] == [0, 0], results
    convert(source, tmp_path / "one", max_shard_size=SHARD)
    assert _files(out) == _files(tmp_path / "one")  # every file, no hidden temporaries, locks or orphans


def _killed_at(point: str, rank: int, args, marker, script=None) -> list:
    """Every rank's (exit code, stderr) after ``rank`` was killed with SIGKILL at ``point``."""
    procs = _ranks(args, script=script, RESTOREKIT_CRASH_HOOK=f"{point}:{marker}", RESTOREKIT_CRASH_RANK=str(rank))
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the point was never reached"
        time.sleep(0.05)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    return _wait(procs)


@requires_torch
@pytest.mark.slow
def test_rank_0_killed_after_the_index_rename_leaves_the_whole_output_and_the_others_say_it_may_be(source, tmp_path):
    out = tmp_path / "out"
    results = _killed_at("after-index-rename", 0, _convert_args(source, out), tmp_path / "marker")
    assert results[0][0] == -signal.SIGKILL
    assert results[1][0] != 0 and "rank 0 failed" in results[1][1] and "complete or absent" in results[1][1]
    convert(source, tmp_path / "one", max_shard_size=SHARD)
    one = _files(tmp_path / "one")
    published = {name: (out / name).read_bytes() for name in os.listdir(out) if not name.startswith(".")}
    assert published == one  # the commit had ended: every file of the output, whole
    results = _wait(_ranks([*_convert_args(source, out), "--overwrite"]))
    assert [code for code, _ in results] == [0, 0], results
    assert _files(out) == one  # the staging directory rank 0 left is swept


# ------------------------------------------------------------------ SLURM without torchrun
BATCH_SCRIPT = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_NODELIST": "node[07-10]"}
SRUN_TASK = {**BATCH_SCRIPT, "SLURM_PROCID": "2", "SLURM_LOCALID": "2", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_STEP_NODELIST": "node[07-10]"}


@pytest.mark.parametrize("env, size", [
    ({}, 1),
    (BATCH_SCRIPT, 1),
    (SRUN_TASK, 4),
    ({**BATCH_SCRIPT, "MASTER_ADDR": "node07"}, 4),
    ({**SRUN_TASK, "RANK": "0", "WORLD_SIZE": "8"}, 8),
], ids=["no launcher", "a batch script itself runs alone", "a task srun started", "MASTER_ADDR set by hand",
        "torchrun under srun: torchrun's ranks"])
def test_the_ranks_a_launcher_started_are_read_from_torchrun_then_slurm(monkeypatch, env, size):
    for key in [k for k in os.environ if k.startswith("SLURM_")] + ["RANK", "WORLD_SIZE", "MASTER_ADDR"]:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launched_size() == size


@pytest.mark.parametrize("nodelist, host", [("node[003-010,020],gpu5", "node003"), ("rack[1-2]-n[07,09]", "rack1-n07"),
                                            ("localhost", "localhost"), ("a01,b02", "a01"), ("", None)])
def test_rank_0s_host_is_the_first_host_of_the_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def _slurm_port() -> tuple[str, int]:
    """A SLURM_JOB_ID whose derived port (15000 + id % 20000) is free here, and that port."""
    for job in range(int(time.time()) % 20000, 20000 * 2, 7):
        port = 15000 + job % 20000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(job), port
    raise AssertionError("no free port")


@requires_torch
@pytest.mark.slow  # two ranks started by hand: each imports torch and forms the group
@pytest.mark.parametrize("master", [False, True], ids=["rank 0 from the node list and the job id",
                                                       "MASTER_ADDR and MASTER_PORT given"])
def test_tasks_started_as_srun_starts_them_form_the_group_and_write_what_one_process_writes(source, tmp_path, master):
    job, _ = _slurm_port()
    common = {"SLURM_JOB_ID": job, "SLURM_NTASKS": "2"}
    common.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())} if master else
                  {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_NODELIST": "localhost"})
    procs = [subprocess.Popen([sys.executable, "-m", "restorekit", *_convert_args(source, tmp_path / "two")], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(**common, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)))
             for rank in range(2)]
    results = _wait(procs)
    assert [code for code, _ in results] == [0, 0], results
    convert(source, tmp_path / "one", max_shard_size=SHARD)
    one = _files(tmp_path / "one")
    assert len(one) == 12 and _files(tmp_path / "two") == one


# ------------------------------------------------------------------ average / interpolate / merge
def load_names(path) -> list:
    from restorekit import Checkpoint

    return list(Checkpoint(path).entries)


MERGE_SHARD = 40_000  # bytes: the models below make 4 shards of it


@pytest.fixture
def models(tmp_path):
    """Three small safetensors shard sets (a base and two fine-tunes) and a TIES recipe over them."""
    rng = np.random.RandomState(1)
    base = {f"layer{i}/kernel": rng.randn(48, 48 + 8 * i).astype(np.float32) for i in range(8)}
    base["global_step"] = np.int64(7)
    paths = []
    for k in range(3):
        values = {n: (v + 0.1 * k * rng.randn(*v.shape).astype(np.float32)) if v.dtype == np.float32 else v
                  for n, v in base.items()}
        prefix = write_bundle(tmp_path / f"tf{k}" / "model.ckpt", values)
        convert(prefix, tmp_path / f"m{k}", max_shard_size=3 * MERGE_SHARD)
        paths.append(str(tmp_path / f"m{k}"))
    recipe = {"merge_method": "ties", "base_model": paths[0], "dtype": "float32",
              "models": [{"model": paths[1], "parameters": {"weight": 0.6, "density": 0.5}},
                         {"model": paths[2], "parameters": {"weight": [0.2, 0.8], "density": 0.7}}]}
    return paths, recipe


# Every rank of one torchrun launch runs this with the caller's own gloo group: the average, the TIES merge, then
# the merge again with rank 1's TIES raising (every rank must name it, nothing published), then its rerun.
DRIVER = """
import json, os, sys
import torch.distributed as dist
from restorekit import average
from restorekit._merging import METHODS, merge
from restorekit.errors import RankFailedError

work, shard, recipe = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
average(recipe["sources"], os.path.join(work, "avg-two"), max_shard_size=shard, distributed=True)
del recipe["sources"]
ties = type(METHODS["ties"])
original, merged = ties.prepare, []  # asked once per tensor, before its chunks are merged

def counted(self, streams, base, params):
    merged.append(params.name)
    return original(self, streams, base, params)

ties.prepare = counted
merge(recipe, os.path.join(work, "ties-two"), max_shard_size=shard, distributed=True)
mine = list(merged)
if rank == 1:
    def failing(self, streams, base, params):
        raise RuntimeError("injected while merging " + params.name)
    ties.prepare = failing
try:
    merge(recipe, os.path.join(work, "failed"), max_shard_size=shard, distributed=True)
    failure = None
except RankFailedError as e:
    failure = {"rank": e.rank, "message": str(e), "published": sorted(os.listdir(os.path.join(work, "failed")))
               if os.path.isdir(os.path.join(work, "failed")) else []}
ties.prepare = original
dist.barrier()
with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
    json.dump({"merged": mine, "failure": failure}, f)
merge(recipe, os.path.join(work, "failed"), max_shard_size=shard, distributed=True)
dist.destroy_process_group()
"""


def test_distributed_average_and_merge_refuse_an_output_that_is_not_sharded_safetensors(models, tmp_path):
    paths, recipe = models
    with pytest.raises(OptionNotApplicableError, match="distributed"):
        average(paths, tmp_path / "mean.safetensors", distributed=True)
    with pytest.raises(OptionNotApplicableError, match="distributed"):
        interpolate(paths[0], paths[1], 0.5, tmp_path / "tf" / "model.ckpt", distributed=True)
    with pytest.raises(OptionNotApplicableError, match="distributed"):
        merge(recipe, tmp_path / "merged.npz", distributed=True)
    assert sorted(os.listdir(tmp_path)) == ["m0", "m1", "m2", "tf0", "tf1", "tf2"]


@requires_torch
def test_two_ranks_average_and_ties_merge_to_the_bytes_one_process_writes_and_a_raising_rank_is_named(models,
                                                                                                      tmp_path):
    paths, recipe = models
    average(paths, tmp_path / "avg-one", max_shard_size=MERGE_SHARD)
    merge(recipe, tmp_path / "ties-one", max_shard_size=MERGE_SHARD)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(_port()), str(driver), str(tmp_path), str(MERGE_SHARD),
                          json.dumps({**recipe, "sources": paths})], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one = _files(tmp_path / "avg-one")
    assert len(one) == 5 and _files(tmp_path / "avg-two") == one
    assert _files(tmp_path / "ties-two") == _files(tmp_path / "ties-one")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    merged = [report["merged"] for report in reports]
    assert all(merged)  # the work is split: each rank merges its own shards' tensors
    assert sorted(merged[0] + merged[1]) == sorted(n for n in load_names(paths[0]) if n != "global_step")
    for failure in (report["failure"] for report in reports):
        assert failure["rank"] == 1 and "rank 1 failed" in failure["message"], failure
        assert "injected while merging" in failure["message"] and "nothing was published" in failure["message"]
        assert [n for n in failure["published"] if not n.startswith(".")] == []
    assert _files(tmp_path / "failed") == _files(tmp_path / "ties-one")  # the rerun: no leftovers


AVERAGE_POINTS = [(1, "rank-shards-staged"), (0, "before-index-rename")]


@requires_torch
@pytest.mark.slow
@pytest.mark.parametrize("rank, point", AVERAGE_POINTS, ids=[f"rank {r} killed at {p}" for r, p in AVERAGE_POINTS])
def test_a_rank_killed_while_averaging_publishes_nothing_and_the_rerun_leaves_no_leftovers(models, tmp_path, rank,
                                                                                           point):
    paths, _ = models
    out = tmp_path / "out"
    args = ["average", *paths, str(out), "--max-shard-size", str(MERGE_SHARD), "-q"]
    results = _killed_at(point, rank, args, tmp_path / "marker")
    assert results[rank][0] == -signal.SIGKILL
    for err in [err for r, (_, err) in enumerate(results) if r != rank]:
        assert f"rank {rank} failed" in err, err[-2000:]
        assert ("complete or absent" if rank == 0 else "nothing was published") in err, err[-2000:]
    assert not (out / "model.safetensors.index.json").exists()
    assert [code for code, _ in _wait(_ranks(args))] == [0, 0]
    average(paths, tmp_path / "one", max_shard_size=MERGE_SHARD)
    assert _files(out) == _files(tmp_path / "one")


def test_the_cli_refuses_distributed_average_and_merge_of_an_unsharded_output(models, tmp_path, capsys):
    from restorekit.cli import main

    paths, recipe = models
    (tmp_path / "ties.yml").write_text(json.dumps(recipe))  # JSON is YAML
    assert main(["average", *paths, str(tmp_path / "mean.npz"), "--distributed"]) != 0
    assert main(["merge", str(tmp_path / "ties.yml"), str(tmp_path / "merged.safetensors"), "--distributed"]) != 0
    assert capsys.readouterr().err.count("distributed") >= 2
    assert not os.path.exists(tmp_path / "mean.npz") and not os.path.exists(tmp_path / "merged.safetensors")


@requires_torch
@pytest.mark.slow
def test_the_cli_under_a_launcher_averages_and_dare_ties_merges_across_two_ranks_as_one_process(models, tmp_path):
    paths, recipe = models
    recipe = {**recipe, "merge_method": "dare_ties"}  # random drop masks: seeded per (seed, name, model)
    (tmp_path / "dare.yml").write_text(json.dumps(recipe))
    average(paths, tmp_path / "avg-one", weights=[1, 2, 3], max_shard_size=MERGE_SHARD)
    merge(recipe, tmp_path / "dare-one", max_shard_size=MERGE_SHARD, seed=5)
    args = ["average", *paths, str(tmp_path / "avg-two"), "--weights", "1", "2", "3", "--max-shard-size",
            str(MERGE_SHARD), "-q"]
    assert [code for code, _ in _wait(_ranks(args))] == [0, 0]
    args = ["merge", str(tmp_path / "dare.yml"), str(tmp_path / "dare-two"), "--max-shard-size", str(MERGE_SHARD),
            "--seed", "5", "-q"]
    assert [code for code, _ in _wait(_ranks(args))] == [0, 0]
    assert _files(tmp_path / "avg-two") == _files(tmp_path / "avg-one")
    assert _files(tmp_path / "dare-two") == _files(tmp_path / "dare-one")
