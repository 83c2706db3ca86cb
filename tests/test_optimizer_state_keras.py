"""Keras 3 optimizers as targets, and Keras 3 optimizer state as a source (issue 36), checked against TensorFlow.

The oracle is TensorFlow: ``tests/keras_optimizer_runs.py tf`` trains the TF1 net 5 steps with
Adam, Momentum and RMSProp, and fits a Keras 3 model (TensorFlow backend) one epoch with Adam,
saves, and continues each 20 steps. Keras 3 on JAX and on torch resumes every case in one
process per backend (TensorFlow blocked); the TF backend and ``torch.optim`` resume here.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import restorekit
from conftest import requires_torch
from keras_optimizer_runs import CASES, CONTROLS, ORACLE, resume
from test_backends import BLOCKER, _missing

HERE = os.path.dirname(os.path.abspath(__file__))


def _relative(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want)) / np.abs(np.asarray(want))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """TensorFlow's runs (checkpoints and Keras files after 5 steps, the losses of its 20-step continuations)."""
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    if keras.config.backend() != "tensorflow":
        pytest.skip("the oracle runs are Keras on the TensorFlow backend")
    out = str(tmp_path_factory.mktemp("keras_optimizer_runs"))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    done = subprocess.run([sys.executable, os.path.join(HERE, "keras_optimizer_runs.py"), "tf", out],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "losses.json")) as f:
        return out, json.load(f)


_RESUMED: dict = {}


# Keras on torch runs in the slow set (CI runs both): one backend process in the fast set keeps it under 10 minutes.
# each backend is one Keras process (~25 s): both run in the slow set, which CI runs too
@pytest.fixture(scope="module", params=[pytest.param("jax", marks=pytest.mark.slow),
                                        pytest.param("torch", marks=pytest.mark.slow)])
def resumed(request, runs):
    """Every case resumed by Keras 3 on one backend, in its own process with TensorFlow blocked."""
    backend = request.param
    why = _missing(backend)
    if why:
        pytest.skip(f"the {backend} backend {why}")
    out, _ = runs
    if backend not in _RESUMED:
        env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": os.pathsep.join([BLOCKER, os.path.dirname(HERE)])}
        done = subprocess.run([sys.executable, os.path.join(HERE, "keras_optimizer_runs.py"), "resume", out],
                              capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        with open(os.path.join(out, f"{backend}.json")) as f:
            _RESUMED[backend] = json.load(f)
    return backend, _RESUMED[backend]


@pytest.mark.parametrize("case", list(CASES), ids=[f"{c} resumes as TensorFlow continues" for c in CASES])
def test_keras_on_jax_and_torch_follows_tensorflows_own_continuation(runs, resumed, case):
    backend, got = resumed
    want = runs[1][ORACLE[case]]
    assert not got["tensorflow_imported"]
    assert _relative(got["losses"][case], want) < 1e-5, f"{backend} {case}: {got['reports'][case]}"
    control = case if case in CONTROLS else "keras_file"  # the Keras file cases start from the same weights
    assert _relative(got["fresh"][control], want) > 1e-3  # the control: a warm start with fresh optimizer state
    section = got["reports"][case]
    assert [r["parameter"] for r in section["carried"]] == ["fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"]
    assert section["reset"] == [] and section["step"] == 5
    assert section["optimizer"].endswith(f"({backend})")


def test_a_slot_whose_weight_changed_shape_is_reported_reset_on_every_backend(resumed):
    _, got = resumed
    reset = got["head"]["reset"]
    assert [(r["parameter"], r["how"]) for r in reset] == [("fc2/kernel", "mismatched"), ("fc2/bias", "mismatched")]
    assert "checkpoint [16, 3], model [16, 5]" in reset[0]["reason"]
    (note,) = [n for n in got["head"]["differences"] if n["what"] == "iterations"]
    assert "reset" in note["text"] and note["size"] > 0  # one step counter: the reset slots' bias correction is named


@pytest.mark.parametrize("case", ["tf1_momentum", "keras_tf2"],
                         ids=["TF1 Momentum resumes in Keras SGD on TensorFlow",
                              "a tf.train.Checkpoint of a Keras optimizer resumes on TensorFlow"])
def test_keras_on_tensorflow_follows_tensorflows_own_continuation(runs, case):
    got, report = resume(runs[0], case, True)
    assert _relative(got, runs[1][ORACLE[case]]) < 1e-5, str(report)
    assert report.optimizer.step == 5


def test_a_changed_head_keeps_zero_slots_and_the_rest_is_the_files(runs):
    import keras

    from keras_optimizer_runs import compiled

    out, _ = runs
    opt = keras.optimizers.Adam(0.01)
    net = compiled(keras, opt, classes=5)
    report = restorekit.scan(os.path.join(out, "keras", "model.weights.h5"), net, optimizer=opt)
    restorekit.restore(report)
    stored = restorekit.formats.open(os.path.join(out, "keras", "model.weights.h5"))
    slots = {v.name: v.numpy() for v in opt.variables}
    np.testing.assert_array_equal(slots["fc1_kernel_momentum"], stored.read("optimizer/vars/2"))
    np.testing.assert_array_equal(slots["fc1_kernel_velocity"], stored.read("optimizer/vars/3"))
    assert not slots["fc2_kernel_momentum"].any() and not slots["fc2_bias_velocity"].any()
    assert int(opt.iterations.numpy()) == 5
    text = str(report)
    assert "optimizer  keras.optimizers.Adam (tensorflow) <- Keras 3 Adam, step 5 (iterations)" in text
    assert "fc2/kernel (its weight is mismatched" in text


@pytest.mark.parametrize("make, path, match", [
    (lambda k: k.optimizers.Adadelta(0.1), "adam/model.ckpt", r"keras\.src\.optimizers\.adadelta\.Adadelta is not supported yet"),
    (lambda k: k.optimizers.SGD(0.05, momentum=0.9), "adam/model.ckpt", r"holds Adam slots; keras\.optimizers\.SGD takes Momentum"),
    (lambda k: k.optimizers.SGD(0.05), "momentum/model.ckpt", r"SGD\(momentum=0\) keeps no momentum"),
    (lambda k: k.optimizers.RMSprop(0.01, momentum=0.5, centered=True), "rmsprop/model.ckpt", r"not centered"),
    (lambda k: k.optimizers.Adam(0.01, beta_1=0.95), "adam/model.ckpt", r"betas \(0\.95, 0\.999\)"),
    (lambda k: k.optimizers.SGD(0.05, momentum=0.9), "keras/model.weights.h5", r"has 10 variables, stored by position"),
], ids=["a Keras optimizer not supported yet is refused by name", "SGD given Adam slots is refused",
        "SGD without momentum given Momentum slots is refused", "centered against the slots is refused",
        "betas that do not fit beta1_power are refused", "a Keras file's variables that do not fit are refused"])
def test_a_keras_optimizer_that_cannot_take_the_state_is_refused_before_anything_is_written(runs, make, path, match):
    import keras

    from keras_optimizer_runs import compiled

    opt = make(keras)
    net = compiled(keras, opt)
    before = [v.numpy() for v in net.variables]
    with pytest.raises(restorekit.InvalidArgumentError, match=match):
        restorekit.scan(os.path.join(runs[0], path), net, optimizer=opt)
    assert not opt.built and all(np.array_equal(v.numpy(), b) for v, b in zip(net.variables, before))


@requires_torch
def test_a_keras_files_adam_state_resumes_in_torch_optim(runs):
    import torch

    from tf1_optimizer_runs import AFTER, BEFORE, batches

    out, losses = runs

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    def run(carry: bool):
        net = Net()
        optimizer = torch.optim.Adam(net.parameters(), lr=0.01, eps=1e-7)  # Keras 3 Adam's default epsilon
        report = restorekit.scan(os.path.join(out, "keras", "model.keras"), net, layout="torch",
                                 optimizer=optimizer if carry else None)
        restorekit.restore(report)
        xs, ys = batches()
        got = []
        for i in range(BEFORE, BEFORE + AFTER):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(xs[i])), torch.from_numpy(ys[i]))
            loss.backward()
            optimizer.step()
            got.append(loss.item())
        return got, report

    got, report = run(True)
    assert _relative(got, losses["keras"]) < 1e-5, str(report)
    assert report.optimizer.source == "Keras 3 Adam" and report.optimizer.step_from == "iterations"
    assert report.optimizer.carried[0].slots == ("optimizer/vars/2", "optimizer/vars/3")
    assert _relative(run(False)[0], losses["keras"]) > 1e-3
