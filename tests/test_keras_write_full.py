"""HDF5 writes that run out of room (RLIMIT_FSIZE): restorekit's WriteFailedError, never a crash, nothing left.

HDF5 cannot take a failed write (h5py can crash the process closing such a file), so
``keras_files.writer._write_h5`` refuses a dataset or attribute set that would not fit
before writing it. Each case runs in its own process under a file-size limit swept from
far too small to just enough: a crash there is a negative exit code, not a test error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
limit, op, src, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
sys.path.insert(0, os.environ["ROOT"])
import restorekit
from restorekit.edit import CheckpointEditor
from restorekit.errors import WriteFailedError
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    if op == "convert":
        restorekit.convert(src, out)
    elif op == "sharded":  # a Keras 3 sharded set: several .weights.h5 and the .weights.json naming them
        CheckpointEditor(src).save(out, max_shard_size=600)
    else:  # a .keras archive edited in place: every tensor doubled
        editor = CheckpointEditor(src)
        for name in list(editor.checkpoint):
            editor.set(name, editor.checkpoint.read(name) * 2)
        editor.save_in_place()
    print(json.dumps({"result": "ok"}))
except WriteFailedError as e:
    print(json.dumps({"result": "failed", "path": e.path, "cause": e.cause}))
"""


def deep_model():
    """Small dense layers three models deep: HDF5 metadata (groups) outweighs the weights."""
    inner = [keras.Sequential([keras.layers.Dense(2, name=f"d{b}_{i}") for i in range(12)], name=f"inner{b}")
             for b in range(4)]
    model = keras.Sequential([keras.Input((2,)), keras.Sequential(inner, name="middle")], name="outer")
    model(np.zeros((1, 2), np.float32))
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    model = deep_model()
    model.save_weights(root / "deep.weights.h5")
    wide = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, name="a"), keras.layers.Dense(64, name="b")])
    wide.save(root / "wide.keras")
    return root


def run(limit: int, op: str, src: str, out: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(limit), op, src, out], capture_output=True, text=True,
                          env={**os.environ, "ROOT": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300)
    assert proc.returncode == 0, f"limit {limit}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def listing(directory) -> dict:
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))}


# (A legacy Keras 2 .h5 is only ever read: no restorekit writer writes one, or a .weights.h5 from one.)
@pytest.mark.parametrize("case", [pytest.param("deep-weights-h5", marks=pytest.mark.slow), "keras-in-place",
                                  pytest.param("sharded-set", marks=pytest.mark.slow)])  # ~10 s each
def test_a_write_past_the_file_size_limit_is_write_failed_with_nothing_left(sources, tmp_path, case):
    name, op, out_name = {"deep-weights-h5": ("deep.weights.h5", "convert", "out.weights.h5"),
                          "keras-in-place": ("wide.keras", "in-place", None),
                          "sharded-set": ("deep.weights.h5", "sharded", "out.weights.json")}[case]
    work = tmp_path / "w"
    work.mkdir()
    src = work / name
    src.write_bytes((sources / name).read_bytes())
    out = work / out_name if out_name else src
    before = listing(work)
    full = 2 * os.path.getsize(src) + (1 << 20)
    results = []
    for limit in [0, 1000, *np.linspace(20_000, full, 10).astype(int).tolist()]:
        report = run(limit, op, str(src), str(out))
        if report["result"] == "ok" and limit > 20_000:
            # Just below what was enough: each refused or written whole, none a crash or a leftover.
            saved = listing(work)
            for tight in (limit - 1000, limit - 9000, limit - 33000, limit - 70000):
                for n in set(os.listdir(work)) - set(before):
                    os.remove(work / n)
                src.write_bytes(before[src.name])
                tight_report = run(tight, op, str(src), str(out))
                if tight_report["result"] == "failed":
                    assert listing(work) == before, f"limit {tight}: left something"
            for n in set(os.listdir(work)) - set(saved):
                os.remove(work / n)
            for n, data in saved.items():
                (work / n).write_bytes(data)
        results.append(report["result"])
        if report["result"] == "failed":
            assert report["path"] == str(out), report
            assert "File too large" in report["cause"], report
            assert listing(work) == before, f"limit {limit}: left {sorted(set(os.listdir(work)) - set(before))}"
        else:
            written = listing(work)
            for name_ in before:
                if name_ != out.name:
                    assert written[name_] == before[name_]  # the source untouched (convert, sharded)
            import restorekit

            got, want = restorekit.Checkpoint(str(out)), restorekit.Checkpoint(str(sources / name))
            factor = 2 if op == "in-place" else 1
            assert sorted(got) == sorted(want)
            for key in want:
                np.testing.assert_array_equal(got.read(key), want.read(key) * factor)
            break
    assert results[0] == "failed" and results[-1] == "ok", results
