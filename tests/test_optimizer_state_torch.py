"""A torch training checkpoint's optimizer state as a source (issue 36): a torch run resumed in Keras 3 and Flax NNX.

The oracle is torch: ``tests/torch_optimizer_runs.py`` trains the torch twin of the TF1 net 5
steps with Adam and with SGD + momentum, saves ``{'model', 'optimizer', 'epoch'}``, and continues
20 steps. Keras 3 on JAX and Flax NNX with optax (TensorFlow blocked) resume each from ``FILE:model``
with ``optimizer=``.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import restorekit
from test_backends import BLOCKER, _missing
from torch_optimizer_runs import RUNS, torch_run

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """torch's runs: the training checkpoints after 5 steps and the losses of torch's own 20-step continuation."""
    pytest.importorskip("torch")
    out = str(tmp_path_factory.mktemp("torch_optimizer_runs"))
    return out, {name: torch_run(name, out) for name in RUNS}


@pytest.fixture(scope="module")
def resumed(runs):
    """Every run resumed by Keras 3 on JAX in its own process, TensorFlow blocked."""
    why = _missing("jax")
    if why:
        pytest.skip(f"the jax backend {why}")
    out, _ = runs
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": os.pathsep.join([BLOCKER, os.path.dirname(HERE)])}
    done = subprocess.run([sys.executable, os.path.join(HERE, "torch_optimizer_runs.py"), "resume", out],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "jax.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def resumed_flax(runs):
    """Every run resumed in the Flax NNX twin with optax, in its own process, TensorFlow blocked."""
    why = _missing("flax", "optax")
    if why:
        pytest.skip(f"Flax NNX {why}")
    out, _ = runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([BLOCKER, os.path.dirname(HERE)])}
    done = subprocess.run([sys.executable, os.path.join(HERE, "torch_optimizer_runs.py"), "flax", out],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "flax.json")) as f:
        return json.load(f)


def _relative(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want)) / np.abs(np.asarray(want))))


@pytest.mark.slow  # a Keras-on-JAX process: ~30 s
@pytest.mark.parametrize("name", list(RUNS), ids=[f"torch {n} resumed in Keras 3 on JAX" for n in RUNS])
def test_a_torch_run_resumed_in_keras_on_jax_follows_torchs_own_continuation(runs, resumed, name):
    want = runs[1][name]
    assert _relative(resumed["losses"][name], want) < 1e-5, resumed["reports"][name]
    assert _relative(resumed["fresh"][name], want) > 1e-3  # the control: a warm start, not a resume
    assert not resumed["tensorflow_imported"]
    report = resumed["reports"][name]
    assert report["source"] == f"torch {'Adam' if name == 'adam' else 'SGD'}"
    # torch's Adam counts its steps; its SGD keeps no count (Keras's SGD reads none)
    assert (report["step"], report["step_from"]) == ((5, "step") if name == "adam" else (0, "no step"))
    assert [r["parameter"] for r in report["carried"]] == ["fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"]
    assert report["carried"][0]["slots"][0] == "optimizer.state.0." + ("exp_avg" if name == "adam" else "momentum_buffer")


@pytest.mark.slow  # a Flax process: ~20 s
@pytest.mark.parametrize("name", list(RUNS), ids=[f"torch {n} resumed in Flax NNX with optax" for n in RUNS])
def test_a_torch_run_resumed_in_flax_nnx_follows_torchs_own_continuation(runs, resumed_flax, name):
    want = runs[1][name]
    assert _relative(resumed_flax["losses"][name], want) < 1e-5, resumed_flax["reports"][name]
    assert _relative(resumed_flax["fresh"][name], want) > 1e-3
    assert not resumed_flax["tensorflow_imported"]
    report = resumed_flax["reports"][name]
    assert report["differences"] == [] and report["reset"] == []  # optax adds eps where torch does: nothing differs
    slots = {r["parameter"]: r["slots"][0].rpartition(".")[0] for r in report["carried"]}
    assert slots == {"fc1/kernel": "optimizer.state.0", "fc1/bias": "optimizer.state.1",
                     "fc2/kernel": "optimizer.state.2", "fc2/bias": "optimizer.state.3"}  # torch's order, by name


@pytest.mark.slow
def test_torchs_adam_epsilon_becomes_keras_epsilon_hat_with_its_drift_named(resumed):
    report = resumed["reports"]["adam"]
    (setting,) = [n for n in report["settings"] if n["what"] == "epsilon"]
    assert setting["text"].startswith("1e-08 (torch's) -> 7.736e-10")  # 1e-8 * sqrt(1 - 0.999^6)
    (drift,) = [n for n in report["differences"] if n["what"] == "epsilon"]
    assert 0 < drift["size"] < 1e-5


@pytest.mark.parametrize("make, match", [
    (lambda keras: keras.optimizers.Adam(0.01, beta_1=0.8), r"betas are \(0\.9, 0\.999\).*pass the torch run's betas"),
    (lambda keras: keras.optimizers.SGD(0.05, momentum=0.9), r"holds Adam slots; keras\.optimizers\.SGD takes Momentum"),
], ids=["other betas are refused", "SGD given torch's Adam state is refused"])
def test_a_keras_optimizer_that_cannot_take_torchs_state_is_refused_before_anything_is_written(runs, make, match):
    keras = pytest.importorskip("keras")
    from keras_optimizer_runs import compiled

    out, _ = runs
    optimizer = make(keras)
    net = compiled(keras, optimizer)
    before = net.get_layer("fc1").kernel.numpy().copy()
    with pytest.raises(restorekit.InvalidArgumentError, match=match):
        restorekit.scan(os.path.join(out, "adam.pt:model"), net, layout="torch", optimizer=optimizer)
    np.testing.assert_array_equal(net.get_layer("fc1").kernel.numpy(), before)
    assert not optimizer.built


def test_optimizer_state_that_does_not_pair_with_the_model_by_order_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    keras = pytest.importorskip("keras")
    from keras_optimizer_runs import compiled

    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(8, 16))
    net.add_module("relu", torch.nn.ReLU())
    net.add_module("fc2", torch.nn.Linear(16, 3))
    # param groups in another order than named_parameters(): index 0 is fc2's weight
    optimizer = torch.optim.Adam([{"params": [net.fc2.weight, net.fc2.bias]}, {"params": [net.fc1.weight, net.fc1.bias]}])
    net(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    path = str(tmp_path / "train.pt")
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path)
    target = keras.optimizers.Adam(0.01)
    with pytest.raises(restorekit.InvalidArgumentError, match=r"parameter 0 has Adam of shape \[3, 16\].*'fc1\.weight'"):
        restorekit.scan(path + ":model", compiled(keras, target), layout="torch", optimizer=target)


def test_torchs_own_state_into_torch_optim_is_refused_not_converted_as_tf1s(runs):
    torch = pytest.importorskip("torch")

    out, _ = runs
    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(8, 16))
    net.add_module("relu", torch.nn.ReLU())
    net.add_module("fc2", torch.nn.Linear(16, 3))
    before = net.fc1.weight.detach().clone()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    with pytest.raises(restorekit.InvalidArgumentError, match=r"torch optimizer's state \(torch Adam\).*load_state_dict"):
        restorekit.scan(os.path.join(out, "adam.pt:model"), net, optimizer=optimizer)
    assert torch.equal(net.fc1.weight, before) and not optimizer.state
