"""kill -9 over every writing command (issue 11): the source intact, the output absent or complete, nothing left.

Each case runs one writer in a child process (TF-free except ``unfreeze``), SIGKILLs it
where ``crashpoints.crash_point`` pauses it, or after a random delay once it has started
writing, then checks with ``benchmarks/kill_harness.py`` (the same engine sweeps every
point by hand): the source files byte-identical (an in-place save: the old checkpoint
or the new one, complete), the output absent or complete with the expected values, the
state file naming a complete checkpoint, and, after the next save in each directory, no
temporaries, lock files, or shards and ``.meta`` files that no index names.
"""

import os
import random
import sys

import pytest

from conftest import requires_torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kill_harness as kh  # noqa: E402

pytestmark = pytest.mark.slow

COMMIT = ["commit-start", "after-remove-before", "before-index-rename", "after-index-rename"]
STAGING = ["staging-made", "shards-staged", "index-written", "before-verify", "before-commit"]
LINKED = [f"rename-model.ckpt.data-0000{i}-of-00003" for i in (2, 0, 1)] + ["rename-model.ckpt.index"]
TWO = [f"rename-model.ckpt.data-0000{i}-of-00002" for i in (0, 1)]
ONE = ["rename-model.ckpt.data-00000-of-00001", "rename-model.ckpt.index"]

# The source checkpoint has two shards (TF wrote it over two devices) and 11 entries.
POINTS = {
    "save-linked": STAGING + ["tensor-1"] + COMMIT + LINKED,
    "save-compact": STAGING + ["tensor-0", "tensor-5", "tensor-10"] + COMMIT + ONE,
    "save-cast": ["tensor-2", "tensor-10", "index-written", "before-commit", *LINKED[:2], *COMMIT[2:]],
    "save-rename-all": ["shards-staged", "before-verify", *TWO, *COMMIT[2:]],
    "save-strip-slots": ["shards-staged", "before-commit", TWO[1], *COMMIT[2:]],
    "save-overwrite": ["tensor-0", "before-commit", *COMMIT, *TWO],
    "save-in-place": STAGING + ["tensor-1"] + COMMIT + LINKED,
    "save-in-place-compact": ["tensor-0", "tensor-9", "index-written", "before-commit", "commit-start",
                              ONE[0], *COMMIT[2:]],
    "save-state-file": ["rename-model.ckpt-2.data-00000-of-00003", *COMMIT[2:], "before-state-file",
                        "before-replace"],
    "save-as-safetensors": ["staging-made", "before-replace", "commit-start", "after-remove-before",
                            "rename-model.safetensors", "after-index-rename"],
    "convert-safetensors": ["before-replace"],
    "convert-npz": ["before-replace"],
    "convert-torch": ["before-replace"],
    # Hugging Face shards + index (sharded.py): per shard staged, the index written, the commit renames.
    "convert-hf-shards": ["tensor-0", "shard-2-staged", "index-json-written", "commit-start",
                          "rename-model-00002-of-00003.safetensors", "before-index-rename", *COMMIT[3:]],
    # A rule set to HF names with config.json, staged with the weights and renamed just before them.
    "convert-hf-rules": ["tensor-4", "shard-4-staged", "index-json-written", "commit-start", "rename-config.json",
                         "rename-model-00003-of-00004.safetensors", "before-index-rename", *COMMIT[3:]],
    # The same over an old output (other weights, another config.json): removed first, index first.
    "convert-hf-overwrite": ["shard-4-staged", *COMMIT[:2], "rename-config.json",
                             "rename-model-00002-of-00004.safetensors", *COMMIT[2:]],
    "convert-weights-h5": ["tensor-0", "tensor-8", "before-replace"],
    # Old shards linked aside and the old index re-pointed at them before the new shards take their names.
    "keras-sharded-in-place": ["keras-shard-1-staged", "before-aside-link", "before-aside-index", "after-aside-index",
                               "commit-start", "rename-model_00000.weights.h5", "rename-model_00002.weights.h5",
                               "before-index-rename", "after-index-rename", "before-remove-after"],
    "import-safetensors": ["tensor-0", "tensor-5", "index-written", ONE[0], *COMMIT[2:]],
    "bundle-writer": ["tensor-0", "tensor-13", "tensor-26", "tensor-39", "index-written", ONE[0], *COMMIT[2:]],
    # Imports TensorFlow in the child (~5 s each): a few points only.
    "unfreeze": ["tensor-1", "rename-model.ckpt.meta", *COMMIT[2:]],
}
CASES = [(writer, point) for writer, points in POINTS.items() for point in points]

# Random kills: a delay drawn (fixed seed) over about the time the writer takes here.
RANDOM_WINDOW = {"convert-torch": 0.4}
RANDOM_KILLS = [(writer, k) for writer in POINTS if writer != "unfreeze"
                for k in range(4 if writer in ("convert-safetensors", "convert-npz", "convert-torch") else 2)]


def params(cases, sep):
    """``(writer, x)`` cases as pytest params, a writer whose child imports torch marked ``requires_torch``."""
    return [pytest.param(writer, x, id=f"{writer}{sep}{x}", marks=[requires_torch] if kh.BY_NAME[writer].needs == "torch"
                         else []) for writer, x in cases]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return kh.make_sources(str(tmp_path_factory.mktemp("kill-sources")))


def expected_output(writer: kh.Writer, point: str) -> str:
    """What a kill at ``point`` must leave: no output yet, the old one, or the new one complete."""
    landed = point in ("after-index-rename", "before-state-file", "before-remove-after") or (
        writer.state_file and point == "before-replace")
    if landed:
        return "complete"
    if writer.output in ("in-place", "keras-in-place"):
        return "old"
    if writer.old is not None:
        # An overwrite deletes the old output (its index first) just before renaming the new one in.
        removed = point == "after-remove-before" or point.startswith("rename-") or point == "before-index-rename"
        return "absent" if removed else "old"
    return "absent"


def test_the_sweep_covers_at_least_100_kill_points_over_every_writer():
    assert len(CASES) >= 100
    assert sorted(POINTS) == sorted(kh.BY_NAME)


@pytest.mark.parametrize("writer, point", params(CASES, "@"))
def test_kill_at_a_crash_point(sources, tmp_path, writer, point):
    writer = kh.BY_NAME[writer]
    result = kh.run_case(sources, writer, str(tmp_path / "case"), point=point)
    assert result.problems == []
    assert result.output == expected_output(writer, point)


# Ctrl-C (SIGINT: a KeyboardInterrupt in the writer) and SIGTERM at points inside a commit: after either the
# writer itself leaves no orphan, temporary or lock (run_case checks before the next write; SIGTERM runs the
# same cleanup while a write holds its lock, bundle/interrupts.py), and SIGTERM still ends the process by SIGTERM.
SIGNALLED = [("keras-sharded-in-place", p) for p in ("after-aside-index", "rename-model_00001.weights.h5",
                                                     "before-index-rename")]
SIGNALLED += [("convert-hf-shards", "rename-model-00002-of-00003.safetensors"), ("convert-hf-shards", "before-index-rename"),
              ("save-in-place", LINKED[1]), ("save-overwrite", TWO[1]), ("convert-hf-rules", "rename-config.json")]
SIGNAL_CASES = [(w, p, sig) for w, p in SIGNALLED for sig in ("SIGINT", "SIGTERM")]


@pytest.mark.parametrize("writer, point, sig", SIGNAL_CASES, ids=[f"{w}@{p}+{s}" for w, p, s in SIGNAL_CASES])
def test_ctrl_c_or_sigterm_inside_a_commit(sources, tmp_path, writer, point, sig):
    import signal

    writer = kh.BY_NAME[writer]
    result = kh.run_case(sources, writer, str(tmp_path / "case"), point=point, sig=getattr(signal, sig))
    assert result.problems == []
    assert result.output == expected_output(writer, point)


@pytest.mark.parametrize("writer, k", params(RANDOM_KILLS, "-"))
def test_kill_at_a_random_time(sources, tmp_path, writer, k):
    delay = random.Random(f"{writer}-{k}").uniform(0, RANDOM_WINDOW.get(writer, 0.08))
    result = kh.run_case(sources, kh.BY_NAME[writer], str(tmp_path / "case"), delay=delay)
    assert result.problems == []
    assert result.output in ("absent", "complete", "old")


def test_the_sweep_removes_only_what_a_dead_commit_left_unnamed(tmp_path):
    """The fix the kills above found: a writer killed between its shard renames and its
    index rename (or before an in-place save removed its old shards) left visible shards
    that no index names. The next writer's sweep removes exactly those, from the dead
    commit's journal; a shard a live index names, or one the journal does not list, stays."""
    import json
    import subprocess

    import numpy as np

    from restorekit._bundle import sweep
    from restorekit._bundle.sweep import sweep_stale
    from conftest import write_bundle

    write_bundle(tmp_path / "x", {"w": np.zeros(3, np.float32)})  # live: x.index names 1 shard
    stray = ["x.data-00000-of-00002", "x.data-00001-of-00002", "y.data-00000-of-00001", "y.meta",
             "z.data-00000-of-00003", "model.safetensors"]
    for name in stray:
        (tmp_path / name).write_bytes(b"bytes")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = tmp_path / f".restorekit-tmp-{child.pid}-{sweep._host_tag()}-0badf00d"
    dead.mkdir()
    (dead / "y.index").write_bytes(b"staged, never renamed")
    touched = stray[:4] + ["x.data-00000-of-00001", "x.index", "model.safetensors"]
    (dead / ".restorekit-journal").write_text(json.dumps(touched))
    sweep_stale(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "x.data-00000-of-00001", "x.index",
                                            "z.data-00000-of-00003"]
