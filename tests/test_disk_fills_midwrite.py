"""Another program fills the disk while restorekit writes (issue 22, write failures): a real ENOSPC on a small
tmpfs, after the room check passed, is one WriteFailedError naming the output, never a crash, with nothing left.

The writer runs in its own process and pauses at a crash point (``restorekit._bundle.crashpoints.crash_point``);
this process then fills the tmpfs to the last byte, as another program would, and lets it go on. HDF5 is
the case that matters most: h5py crashes the process (SIGSEGV) closing a file whose write failed, so a
``.weights.h5`` written straight to disk cannot take a full disk after its room check.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import restorekit
from conftest import fill_disk, requires_torch
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD = 140_000  # bytes: the sharded set and the Hugging Face directory get several shards (dense_1 takes 128 KiB)

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["ROOT"])
op, src, out, point, marker = sys.argv[1:6]
import restorekit
from restorekit._bundle import crashpoints
from restorekit.edit import CheckpointEditor
from restorekit.errors import WriteFailedError

real, reached = crashpoints.crash_point, []


def pause(name):  # the first time at `point`: say so, then wait while the other process fills the disk
    if name == point and not reached:
        reached.append(name)
        with open(marker + ".new", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".new", marker)
        deadline = time.monotonic() + 120
        while os.path.exists(marker):
            if time.monotonic() > deadline:
                sys.exit(97)
            time.sleep(0.01)
    real(name)


crashpoints.crash_point = pause
try:
    if op == "convert":
        restorekit.convert(src, out)
    elif op == "hf-shards":
        restorekit.convert(src, out, max_shard_size=SHARD)
    elif op == "sharded":
        CheckpointEditor(src).save(out, max_shard_size=SHARD)
    else:  # "in-place": a .keras archive edited in place, every tensor doubled
        editor = CheckpointEditor(src)
        for name in list(editor.checkpoint):
            editor.set(name, editor.checkpoint.read(name) * 2)
        editor.save_in_place()
    result = {"result": "ok"}
except WriteFailedError as e:
    result = {"result": "failed", "path": e.path, "cause": e.cause, "errno": e.errno}
result["reached"] = reached
print(json.dumps(result))
""".replace("SHARD", str(SHARD))


def keras_model():
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(n, name=f"dense_{i}") for i, n in enumerate([256, 128, 64, 10])]
    model = keras.Sequential([keras.Input((64,)), *layers], name="net")
    model(np.zeros((1, 64), np.float32))
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A real Keras 3 model's ``.weights.h5`` (8 tensors, ~180 KB) and ``.keras`` archive, written by Keras."""
    root = tmp_path_factory.mktemp("sources")
    model = keras_model()
    model.save_weights(root / "net.weights.h5")
    model.save(root / "net.keras")
    return root


def tree(directory) -> dict:
    """Every file and directory under ``directory`` (hidden ones too) with the files' bytes."""
    out = {}
    for base, dirs, files in os.walk(directory):
        rel = os.path.relpath(base, directory)
        out.update({os.path.join(rel, d) + "/": None for d in dirs})
        for name in files:
            with open(os.path.join(base, name), "rb") as f:
                out[os.path.join(rel, name)] = f.read()
    return out


def run_while_the_disk_fills(op: str, src, out, point: str, disk, work) -> dict:
    """Run ``op`` in its own process; when it reaches ``point``, fill ``disk`` and let it go on. The filler
    is removed again before this returns."""
    marker, log = work / "paused", work / "child.log"
    env = {**os.environ, "ROOT": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, op, str(src), str(out), point, str(marker)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    filler = None
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, f"{op} never reached {point!r}"
            time.sleep(0.01)
        if marker.exists():
            filler = fill_disk(disk)
            marker.unlink()
        stdout, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if filler is not None:
            os.remove(filler)
    assert proc.returncode == 0, f"{op} at {point}: exit {proc.returncode} (-11 is SIGSEGV)\n{log.read_text()[-3000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


def check_failed(report: dict, out, point: str, before: dict, after: dict) -> None:
    assert report["reached"] == [point], report  # the disk filled while the write was under way
    assert report["result"] == "failed", report
    assert report["path"] == os.fspath(out), report
    assert report["cause"] == "No space left on device" and report["errno"] == 28, report
    assert after == before, f"left behind: {sorted(set(after) - set(before))}, changed: " \
                            f"{sorted(k for k in before if after.get(k) != before[k])}"


def weights_of(path) -> list:
    """The model's weights, in order, after ``model.load_weights(path)`` into a zeroed model."""
    model = keras_model()
    for variable in model.weights:
        variable.assign(np.zeros(variable.shape, variable.dtype))
    model.load_weights(path)
    return [np.array(v) for v in model.weights]


def arrays(path) -> list:
    """The tensors a file holds, as restorekit reads them, in an order that does not depend on their names."""
    ckpt = restorekit.Checkpoint(str(path))
    return sorted(((a.shape, a.tobytes()) for a in map(ckpt.read, ckpt)), key=lambda t: (len(t[0]), t[0], t[1]))


# Every point comes after the .weights.h5 room check (h5-room-checked is right after it): the disk was big
# enough when the write began. tensor-7 is after the last dataset: only HDF5's metadata, written at close, fails.
H5_CASES = {
    "weights-h5": ("convert", "net.weights.h5", "out/copy.weights.h5",
                   ["h5-room-checked", "tensor-0", "tensor-3", "tensor-7"]),
    "sharded-set": ("sharded", "net.weights.h5", "out/copy.weights.json",
                    ["h5-room-checked", "tensor-1", "keras-shard-0-staged", "keras-shard-1-staged"]),
    "keras-in-place": ("in-place", "net.keras", None, ["h5-room-checked", "tensor-2", "tensor-7",
                                                       "keras-member-written"]),
}


@pytest.mark.parametrize("case, point", [(c, p) for c, (*_, points) in H5_CASES.items() for p in points],
                         ids=[f"{c}-filled-at-{p}" for c, (*_, points) in H5_CASES.items() for p in points])
def test_a_disk_filled_during_a_keras_write_is_write_failed_with_nothing_left(sources, small_tmpfs, tmp_path,
                                                                               case, point):
    op, name, out_name, _ = H5_CASES[case]
    outdir = small_tmpfs / "out"
    outdir.mkdir()
    (outdir / "notes.txt").write_text("another program's file\n")
    if out_name is None:  # in place: the source is the output, on the small disk
        src = out = outdir / name
        src.write_bytes((sources / name).read_bytes())
    else:
        src, out = sources / name, small_tmpfs / out_name
    source_bytes = src.read_bytes()
    before = tree(small_tmpfs)
    report = run_while_the_disk_fills(op, src, out, point, small_tmpfs, tmp_path)
    check_failed(report, out, point, before, tree(small_tmpfs))
    assert src.read_bytes() == source_bytes


@pytest.mark.parametrize("case", list(H5_CASES))
def test_with_room_to_spare_the_same_keras_writes_load_into_keras(sources, small_tmpfs, tmp_path, case):
    op, name, out_name, _ = H5_CASES[case]
    outdir = small_tmpfs / "out"
    outdir.mkdir()
    if out_name is None:
        src = out = outdir / name
        src.write_bytes((sources / name).read_bytes())
    else:
        src, out = sources / name, small_tmpfs / out_name
    report = run_while_the_disk_fills(op, src, out, "never", small_tmpfs, tmp_path)
    assert report == {"result": "ok", "reached": []}
    want = weights_of(sources / "net.weights.h5")
    if case == "keras-in-place":  # every tensor doubled
        got = [np.array(v) / 2 for v in keras.saving.load_model(out).weights]
    else:
        got = weights_of(out)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    if case == "sharded-set":
        assert len([n for n in os.listdir(outdir) if n.endswith(".weights.h5")]) > 2


OTHER_CASES = {
    "hugging-face-shards": ("hf-shards", "out/hf/", ["staging-made", "tensor-0", "shard-1-staged",
                                                    "index-json-written"]),
    "torch": ("convert", "out/model.pt", ["output-locked"]),
}


def other_case(case, point):
    return pytest.param(case, point, id=f"{case}-filled-at-{point}",
                        marks=[requires_torch] if case == "torch" else [])


@pytest.mark.parametrize("case, point", [other_case(c, p) for c, (_, _, points) in OTHER_CASES.items() for p in points])
def test_a_disk_filled_during_a_conversion_is_write_failed_with_nothing_left(sources, small_tmpfs, tmp_path,
                                                                             case, point):
    op, out_name, _ = OTHER_CASES[case]
    (small_tmpfs / "out").mkdir()
    (small_tmpfs / "out" / "notes.txt").write_text("another program's file\n")
    src, out = sources / "net.weights.h5", small_tmpfs / out_name
    source_bytes = src.read_bytes()
    before = tree(small_tmpfs)
    report = run_while_the_disk_fills(op, src, out, point, small_tmpfs, tmp_path)
    assert report["result"] == "failed", report
    if case == "torch":  # torch's writer words a full disk its own way ('unexpected pos ...'): its cause is that
        assert report["reached"] == [point] and report["path"] == os.fspath(out), report
        assert tree(small_tmpfs) == before
    else:  # a directory of shards: the error names its first shard
        assert os.path.dirname(report["path"]) == os.fspath(out), report
        check_failed({**report, "path": os.fspath(out)}, out, point, before, tree(small_tmpfs))
    assert src.read_bytes() == source_bytes


@pytest.mark.parametrize("case", [pytest.param(c, marks=[requires_torch] if c == "torch" else []) for c in OTHER_CASES])
def test_with_room_to_spare_the_same_conversions_hold_the_source_values(sources, small_tmpfs, tmp_path, case):
    op, out_name, _ = OTHER_CASES[case]
    (small_tmpfs / "out").mkdir()
    out = small_tmpfs / out_name
    report = run_while_the_disk_fills(op, sources / "net.weights.h5", out, "never", small_tmpfs, tmp_path)
    assert report == {"result": "ok", "reached": []}
    if case == "hugging-face-shards":
        assert len([n for n in os.listdir(out) if n.endswith(".safetensors")]) > 1
    assert arrays(out) == arrays(sources / "net.weights.h5")


EFBIG_CHILD = r"""
import json, os, resource, sys
sys.path.insert(0, os.environ["ROOT"])
src, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
import restorekit
from restorekit.errors import WriteFailedError
from restorekit.keras_files import _writer

_writer._room = lambda path: (None, "")  # no pre-check: the first write past the limit must meet the sink
sinks, real_init = [], _writer._H5Sink.__init__


def init(self, path):
    real_init(self, path)
    sinks.append(self)


_writer._H5Sink.__init__ = init
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    restorekit.convert(src, out)
    result = {"result": "ok"}
except WriteFailedError as e:
    result = {"result": "failed", "path": e.path, "errno": e.errno}
result["sink_errors"] = [getattr(s.error, "errno", None) for s in sinks]
print(json.dumps(result))
"""


def test_a_keras_write_past_the_file_size_limit_is_caught_by_the_sink_and_is_write_failed(sources, tmp_path):
    """EFBIG (``ulimit -f``) met mid-write, with the space pre-check out of the way: the sink keeps the
    error from HDF5 (no crash), the error names the output, and nothing is left."""
    src, out = sources / "net.keras", tmp_path / "out" / "net.weights.h5"
    (tmp_path / "out").mkdir()
    source_bytes = src.read_bytes()
    env = {**os.environ, "ROOT": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", EFBIG_CHILD, str(src), str(out), "100000"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # not -11 (h5py's crash) nor -25 (SIGXFSZ)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["result"] == "failed" and report["path"] == os.fspath(out) and report["errno"] == errno.EFBIG, report
    assert report["sink_errors"] == [errno.EFBIG], report  # the sink met the limit, not a pre-check
    assert tree(tmp_path / "out") == {}
    assert src.read_bytes() == source_bytes
