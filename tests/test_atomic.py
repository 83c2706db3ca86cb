"""bundle/staging, sweep and commit: temporary names that carry their pid, sweeping what killed writers left,
shards before the index, removing a checkpoint by its literal name, one writer per output."""

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import write_bundle
from restorekit._bundle import commit, crashpoints, sweep
from restorekit._bundle.locking import lock_path, output_lock
from restorekit._bundle.staging import Staging, write_bytes
from restorekit._bundle.sweep import remove_checkpoint_files, sweep_stale, temp_name
from restorekit._checkpoint import Checkpoint
from restorekit.errors import CheckpointNotFoundError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(code: str, **env) -> subprocess.Popen:
    """Start a Python child in the worktree (so it imports this restorekit)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT, **env})


def _wait_for(path, child, hang_seconds=300):
    """Wait until ``child`` creates ``path``; fail as soon as it exits without doing so.

    The deadline only guards a hung child (a live one that never gets there), not speed.
    """
    deadline = time.monotonic() + hang_seconds
    while not os.path.exists(path):
        assert child.poll() is None, f"the child exited with {child.returncode} before {path} appeared"
        assert time.monotonic() < deadline, f"the child hangs: {path} never appeared"
        time.sleep(0.05)


def _dead_pid() -> int:
    child = _run("pass")
    child.wait()
    return child.pid


# ------------------------------------------------------------------ temporary names


def test_temp_name_is_hidden_beside_its_output_and_carries_our_pid(tmp_path):
    tmp = temp_name(tmp_path / "model.pb")
    directory, name = os.path.split(tmp)
    assert directory == str(tmp_path)
    assert name.startswith(f".restorekit-tmp-{os.getpid()}-") and name.endswith(".model.pb")
    assert temp_name(tmp_path / "model.pb") != tmp
    assert len(os.path.basename(temp_name(tmp_path / ("x" * 255)))) <= 255


def test_a_killed_exporters_temporary_file_is_swept_by_the_next_write(tmp_path):
    child = _run(f"""
        import os
        from restorekit._bundle.staging import atomic_output
        with atomic_output({str(tmp_path / 'big.safetensors')!r}) as tmp:
            open(tmp, 'wb').write(b'half')
            os._exit(9)  # killed mid-export: no cleanup runs
    """)
    assert child.wait() == 9
    left = [n for n in os.listdir(tmp_path) if n.startswith(".restorekit-tmp-")]
    assert len(left) == 1 and left[0].endswith(".big.safetensors")
    write_bytes(str(tmp_path / "other.pb"), b"graph")
    assert sorted(os.listdir(tmp_path)) == ["other.pb"]


def test_temporaries_of_live_processes_and_other_hosts_are_kept(tmp_path):
    mine = temp_name(tmp_path / "a.pb")
    parent = os.path.join(tmp_path, f".restorekit-tmp-{os.getppid()}-{sweep._host_tag()}-0badf00d.b.pb")
    dead = os.path.join(tmp_path, f".restorekit-tmp-{_dead_pid()}-{sweep._host_tag()}-0badf00d.c.pb")
    other_host = os.path.join(tmp_path, f".restorekit-tmp-{_dead_pid()}-{'0' * 8}-0badf00d.d.pb")
    other_host = other_host if sweep._host_tag() != "0" * 8 else other_host.replace("-00000000-", "-00000001-")
    legacy_dir = os.path.join(tmp_path, f".restorekit-tmp-{_dead_pid()}-deadbeef")
    for path in (mine, parent, dead, other_host):
        open(path, "w").close()
    os.mkdir(legacy_dir)
    sweep_stale(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (mine, parent, other_host))


# ------------------------------------------------------------------ shards first, the index last


def test_a_writer_killed_before_its_index_lands_leaves_no_checkpoint(tmp_path):
    prefix = write_bundle(tmp_path / "m", {"w": np.zeros(1000, np.float32)})
    marker = tmp_path / "reached"
    child = _run(f"""
        import numpy as np
        from restorekit._bundle.writer import BundleWriter
        with BundleWriter({prefix!r}) as w:
            w.add("w", np.ones(1000, np.float32))
    """, RESTOREKIT_CRASH_HOOK=f"before-index-rename:{marker}")
    try:
        _wait_for(marker, child)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # The new shard replaces the old one, so Staging.commit removes the old index before any
    # rename: never the old index over the new shard (a checkpoint that fails its checksums).
    assert not os.path.exists(prefix + ".index")
    with pytest.raises(CheckpointNotFoundError):
        Checkpoint(prefix)
    write_bundle(prefix, {"w": np.full(1000, 2, np.float32)})  # the next writer sweeps the dead one's files
    assert sorted(os.listdir(tmp_path)) == ["m.data-00000-of-00001", "m.index", "reached"]
    assert Checkpoint(prefix).read("w").tolist() == [2.0] * 1000


# ------------------------------------------------------------------ removing a checkpoint


def test_remove_checkpoint_files_matches_the_prefix_literally(tmp_path):
    names = ["m[1].index", "m[1].data-00000-of-00002", "m[1].data-00001-of-00002",
             "m1.index", "m1.data-00000-of-00001", "m[1].data-00000-of-00002.bak", "m[1].data-0-of-1",
             "m[1]x.index", "checkpoint"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    removed = remove_checkpoint_files(tmp_path / "m[1]")
    assert [os.path.basename(p) for p in removed] == ["m[1].index", "m[1].data-00000-of-00002", "m[1].data-00001-of-00002"]
    assert sorted(os.listdir(tmp_path)) == sorted(names[3:])
    assert remove_checkpoint_files(tmp_path / "m[1]") == []
    assert remove_checkpoint_files(tmp_path / "no-such-dir" / "m") == []


# ------------------------------------------------------------------ one writer per output


def _hold(prefix, held, release):
    with output_lock(prefix):
        held.set()
        release.wait(60)


def _queue(prefix, got):
    with output_lock(prefix, wait=True):
        got.set()


def _die_holding(prefix, held):
    import os as _os

    with output_lock(prefix):
        held.set()
        _os._exit(3)  # killed while holding: no release runs


def test_a_second_writer_of_one_output_is_refused_or_waits(tmp_path):
    import multiprocessing

    from restorekit.errors import OutputExistsError

    ctx = multiprocessing.get_context("fork")  # the children use only restorekit._bundle's commit path
    prefix = str(tmp_path / "out" / "model.ckpt")
    held, release, got = ctx.Event(), ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(prefix, held, release))
    holder.start()
    try:
        assert held.wait(30)
        assert os.path.exists(tmp_path / "out" / ".model.ckpt.restorekit-lock")
        with pytest.raises(OutputExistsError, match=f"another restorekit process \\(pid {holder.pid}\\) is writing") as info:
            with output_lock(prefix):
                pytest.fail("two writers hold one output")
        assert info.value.path == prefix
        waiter = ctx.Process(target=_queue, args=(prefix, got))
        waiter.start()
        assert not got.wait(0.5)  # queued behind the holder
        release.set()
        assert got.wait(30)
        waiter.join(30)
        assert waiter.exitcode == 0
    finally:
        release.set()
        holder.join(30)
    assert os.listdir(tmp_path / "out") == []  # the lock file goes with its last holder
    with output_lock(prefix) as lock:
        assert open(lock).read() == f"{os.getpid()}\n"


def test_a_lock_whose_holder_was_killed_is_free_and_swept(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    prefix = str(tmp_path / "model.ckpt")
    held = ctx.Event()
    dying = ctx.Process(target=_die_holding, args=(prefix, held))
    dying.start()
    dying.join(30)
    assert dying.exitcode == 3 and held.is_set()
    assert os.listdir(tmp_path) == [".model.ckpt.restorekit-lock"]
    with output_lock(prefix):  # the kernel released the dead holder's lock
        sweep_stale(str(tmp_path))  # a held lock stays
        assert os.listdir(tmp_path) == [".model.ckpt.restorekit-lock"]
    open(lock_path(prefix), "w").write("999999999\n")  # left by a killed holder
    sweep_stale(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_lock_file_another_writer_sweeps_between_its_creation_and_its_flock_is_made_again(tmp_path, monkeypatch):
    from restorekit._bundle import locking

    real_open, swept = os.open, []

    def racing_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if str(path).endswith(locking.LOCK_SUFFIX) and not swept:
            swept.append(path)
            sweep_stale(str(tmp_path))  # another writer's sweep: the new lock file is not held yet
        return fd

    monkeypatch.setattr(locking.os, "open", racing_open)
    with output_lock(str(tmp_path / "model.safetensors")) as lock:
        assert swept == [lock] and os.path.exists(lock)
        assert os.stat(lock).st_nlink == 1
    assert os.listdir(tmp_path) == []


def test_the_sweep_removes_hugging_face_shards_a_dead_commit_left_without_their_index(tmp_path):
    import json

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = tmp_path / f".restorekit-tmp-{child.pid}-{sweep._host_tag()}-0badf00d"
    dead.mkdir()
    # 'model' lost its index (killed before renaming it); 'live' has one naming its shard; 'stale' has one that does not.
    names = ["model-00001-of-00002.safetensors", "live-00001-of-00001.safetensors", "stale-00001-of-00002.safetensors"]
    for name in names:
        (tmp_path / name).write_bytes(b"bytes")
    (tmp_path / "live.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": names[1]}}))
    (tmp_path / "stale.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "other.safetensors"}}))
    (dead / ".restorekit-journal").write_text(json.dumps(names))
    sweep_stale(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [names[1], "live.safetensors.index.json", "stale.safetensors.index.json"]


def test_a_commit_renames_a_hugging_face_index_last_and_removes_the_old_one_first(tmp_path, monkeypatch):
    order = []
    (tmp_path / "model.safetensors.index.json").write_text("old")
    (tmp_path / "model-00001-of-00001.safetensors").write_text("old")
    real_remove, real_replace = os.remove, os.replace
    def noted(what, path):  # the journal and the lock file are restorekit's own bookkeeping
        if not os.path.basename(path).startswith("."):
            order.append((what, os.path.basename(path)))

    monkeypatch.setattr(os, "remove", lambda p: noted("remove", p) or real_remove(p))
    monkeypatch.setattr(os, "replace", lambda a, b: noted("rename", b) or real_replace(a, b))
    with Staging(str(tmp_path), output=str(tmp_path / "model.safetensors")) as staging:
        for name in ("model.safetensors.index.json", "model-00001-of-00001.safetensors"):
            with open(staging.path(str(tmp_path / name)), "w") as f:
                f.write("new")
        staging.commit()
    assert order == [("remove", "model.safetensors.index.json"), ("rename", "model-00001-of-00001.safetensors"),
                     ("rename", "model.safetensors.index.json")]


@pytest.mark.parametrize("weights_visible", [False, True], ids=["weights never landed", "weights landed"])
def test_the_sweep_removes_a_dead_commits_config_json_only_when_none_of_its_weights_is_visible(tmp_path,
                                                                                                weights_visible):
    import json

    (tmp_path / "config.json").write_text("{}")
    if weights_visible:
        (tmp_path / "model.safetensors").write_bytes(b"weights")
    dead = tmp_path / f".restorekit-tmp-{_dead_pid()}-{sweep._host_tag()}-0badf00d"
    dead.mkdir()
    (dead / ".restorekit-journal").write_text(json.dumps(["config.json", "model.safetensors"]))
    sweep_stale(str(tmp_path))
    assert (tmp_path / "config.json").exists() == weights_visible
    assert not dead.exists()


def test_the_sweep_removes_keras_shards_no_weights_json_names_and_keeps_the_named_ones(tmp_path):
    """A writer killed mid-commit of a Keras sharded set: shards renamed before its index are swept
    when the set's ``.weights.json`` does not name them (a layer may list several shards)."""
    import json

    for i in range(3):
        (tmp_path / f"m_{i:05d}.weights.h5").write_bytes(b"h5")
    (tmp_path / "m.weights.json").write_text(json.dumps(
        {"metadata": {"total_size": 1.0},
         "weight_map": {"/layers/dense/vars": ["m_00000.weights.h5", "m_00001.weights.h5"]}}))
    (tmp_path / "n_00000.weights.h5").write_bytes(b"h5")  # a set whose index never landed
    dead = tmp_path / f".restorekit-tmp-{_dead_pid()}-{sweep._host_tag()}-0badf00e"
    dead.mkdir()
    (dead / ".restorekit-journal").write_text(json.dumps(
        ["m_00000.weights.h5", "m_00001.weights.h5", "m_00002.weights.h5", "n_00000.weights.h5"]))
    sweep_stale(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.weights.json", "m_00000.weights.h5", "m_00001.weights.h5"]
    assert commit.is_index(str(tmp_path / "m.weights.json"))


def test_staging_sync_makes_staged_files_durable_once_and_commit_syncs_what_changed_since(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isfile(path):
            synced.append(os.path.basename(path))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out"
    with Staging(str(out), output=str(out / "m.index")) as staging:
        a, b = staging.path(str(out / "m.data-00000-of-00001")), staging.path(str(out / "m.index"))
        with open(a, "wb") as f:
            f.write(b"shard")
        staging.sync()
        assert synced == ["m.data-00000-of-00001"]
        staging.sync()
        assert synced == ["m.data-00000-of-00001"]  # nothing changed: nothing to do
        with open(b, "wb") as f:
            f.write(b"index")
        with open(a, "ab") as f:
            f.write(b" grown")
        staging.commit()
    assert sorted(synced[1:]) == ["m.data-00000-of-00001", "m.index"]  # changed since, and staged since
    assert (out / "m.data-00000-of-00001").read_bytes() == b"shard grown" and (out / "m.index").read_bytes() == b"index"


# ------------------------------------------------------------------ crash points (the kill harness's handle)

def test_a_commit_passes_its_crash_points_in_order_through_the_name_the_kill_harness_replaces(tmp_path, monkeypatch):
    """benchmarks/kill_harness.py lists a writer's points by replacing ``crashpoints.crash_point``: the points of
    staging.py and commit.py all go through it, in the order of the commit (shards renamed before the index)."""
    seen: list[str] = []
    monkeypatch.setattr(crashpoints, "crash_point", seen.append)
    out = tmp_path / "out"
    with Staging(str(out), output=str(out / "m")) as staging:
        for name in ("m.index", "m.data-00000-of-00001"):
            with open(staging.path(str(out / name)), "wb") as f:
                f.write(name.encode())
        staging.commit()
    assert seen == ["staging-made", "commit-start", "after-remove-before", "rename-m.data-00000-of-00001",
                    "rename-m.index", "before-index-rename", "after-index-rename"]
    assert sorted(os.listdir(out)) == ["m.data-00000-of-00001", "m.index"]
    seen.clear()
    write_bytes(str(out / "frozen.pb"), b"graph")
    assert seen == ["output-locked", "before-replace"] and (out / "frozen.pb").read_bytes() == b"graph"


def test_every_crash_point_is_called_through_its_module():
    """A copy of the name (``from restorekit._bundle.crashpoints import crash_point``) would escape the harness."""
    copies = []
    for directory, _, names in os.walk(os.path.join(ROOT, "restorekit")):
        for name in names:
            path = os.path.join(directory, name)
            if not name.endswith(".py") or path.endswith(os.path.join("_bundle", "crashpoints.py")):
                continue
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                imported = isinstance(node, ast.ImportFrom) and any(a.name == "crash_point" for a in node.names)
                if imported or (isinstance(node, ast.Name) and node.id == "crash_point"):
                    copies.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert copies == []
