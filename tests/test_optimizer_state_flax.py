"""optax state of a Flax NNX ``nnx.Optimizer`` as a target (issue 36), checked against TensorFlow's own continuation.

The oracle is ``tests/tf1_optimizer_runs.py`` (TF1 trains the tiny net 5 steps, saves, and
continues 20); ``tests/flax_optimizer_cases.py`` restores the Flax NNX twin and its optax state
with ``scan(..., optimizer=)`` + ``restore`` in a process where TensorFlow is blocked, continues
on the same batches, and runs the control (a warm start with fresh optimizer state), a head of
another shape, and the optax chains that are refused.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCKER = os.path.join(HERE, "blockers", "no_tensorflow")
REASON = "optax state as a target needs flax and optax installed (pip install 'restorekit[flax]')"
BAR = ["adam", "momentum", "rmsprop"]  # the bar
MORE = ["nesterov", "rmsprop_centered", "adam_eps"]  # slow: the variants, and Adam with a large epsilon


# every case needs a TF oracle process and a Flax process (~25 s each fixture): the slow set, which CI runs too
pytestmark = pytest.mark.slow


def _relative(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want)) / np.abs(np.asarray(want))))


def _run(tmp_path_factory, cases: list) -> tuple:
    pytest.importorskip("flax", reason=REASON)
    pytest.importorskip("optax", reason=REASON)
    pytest.importorskip("tensorflow", reason="the oracle runs are TensorFlow's")
    out = str(tmp_path_factory.mktemp("tf1_optax_runs"))
    subprocess.run([sys.executable, os.path.join(HERE, "tf1_optimizer_runs.py"), out, *cases], check=True,
                   capture_output=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600)
    with open(os.path.join(out, "losses.json")) as f:
        losses = json.load(f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([BLOCKER, os.path.dirname(HERE), HERE])}
    done = subprocess.run([sys.executable, os.path.join(HERE, "flax_optimizer_cases.py"), out, *cases],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses, json.loads(done.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def bar(tmp_path_factory):
    return _run(tmp_path_factory, BAR)


@pytest.fixture(scope="module")
def more(tmp_path_factory):
    return _run(tmp_path_factory, MORE)


@pytest.mark.parametrize("case", BAR, ids=[f"{c} resumes in optax as TensorFlow continues" for c in BAR])
def test_flax_with_optax_follows_tensorflows_own_continuation(bar, case):
    want, got = bar
    assert not got["tensorflow_imported"]
    assert _relative(got["losses"][case], want[case]) < 1e-5, got["reports"][case]
    assert _relative(got["fresh"][case], want[case]) > 1e-3  # the control: fresh optimizer state
    section = got["reports"][case]
    assert [r["parameter"] for r in section["carried"]] == ["fc1/bias", "fc1/kernel", "fc2/bias", "fc2/kernel"]
    assert section["reset"] == [] and section["step"] == 5


@pytest.mark.parametrize("case", MORE[:2], ids=[f"{c} resumes in optax as TensorFlow continues" for c in MORE[:2]])
def test_flax_with_optax_variants_follow_tensorflow(more, case):
    want, got = more
    assert _relative(got["losses"][case], want[case]) < 1e-5, got["reports"][case]
    assert _relative(got["fresh"][case], want[case]) > 1e-3


def test_adam_with_a_large_epsilon_reports_the_epsilon_hat_drift_optax_cannot_follow(more):
    want, got = more
    drift = {d["what"]: d for d in got["reports"]["adam_eps"]["differences"]}["eps"]
    assert drift["size"] > 1e-3 and "optax.adam(eps=" in drift["text"]
    carried, fresh = _relative(got["losses"]["adam_eps"], want["adam_eps"]), _relative(got["fresh"]["adam_eps"], want["adam_eps"])
    assert carried < fresh / 5  # still far closer than a warm start


def test_the_default_epsilon_drift_is_reported_small(bar):
    _, got = bar
    drift = {d["what"]: d for d in got["reports"]["adam"]["differences"]}["eps"]
    assert 0 < drift["size"] < 1e-5
    assert not got["reports"]["momentum"]["differences"] and not got["reports"]["rmsprop"]["differences"]


def test_a_head_of_another_shape_is_reported_reset_and_left_fresh(bar):
    head = bar[1]["changed_head"]
    reset = {r["parameter"]: r["how"] for r in head["section"]["reset"]}
    assert reset == {"fc2/bias": "mismatched", "fc2/kernel": "mismatched"}
    assert [r["parameter"] for r in head["section"]["carried"]] == ["fc1/bias", "fc1/kernel"]
    assert head["head_fresh"] and head["fc1_carried"] and head["count"] == head["step"] == 5
    assert "reset          2   fc2/bias" in head["text"]
    assert "count" in {d["what"] for d in head["section"]["differences"]}  # the shared count, named with its factor


@pytest.mark.parametrize("name, message", [
    ("adagrad", "scale_by_rss -> scale, which is not supported"),
    ("lion", "scale_by_lion"),
    ("nadam", "optax.nadam"),
    ("sgd_for_adam", "holds Adam slots; optax.sgd takes Momentum"),
], ids=["optax.adagrad is refused by name", "optax.lion is refused by name", "optax.nadam is refused",
        "optax.sgd given Adam slots is refused"])
def test_unsupported_optax_optimizers_are_refused_before_anything_is_written(bar, name, message):
    error, text, untouched = bar[1]["refusals"][name]
    assert error == "InvalidArgumentError" and message in text and untouched
