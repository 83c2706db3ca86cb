"""Keras 2 (tf-keras) optimizer state in TF2 checkpoints as a source (issue 36), checked against tf-keras itself.

The oracle is tf-keras: ``tests/keras2_optimizer_runs.py`` (its own process) trains the net of
``tf1_optimizer_runs`` 5 steps with Keras 2 optimizers, saves TF2 checkpoints, and continues
each 20 steps; here a torch twin (``torch.optim``) and a Keras 3 twin (TensorFlow backend)
resume from the checkpoints and must meet every step's loss. Those runs are the slow set;
the fast set writes one small tf-keras checkpoint in-process for the refusals and the reset.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import restorekit
from conftest import requires_torch
from keras2_optimizer_runs import REFUSED, RUNS, keras3, path
from tf1_optimizer_runs import AFTER, BEFORE, batches

HERE = os.path.dirname(os.path.abspath(__file__))
SLOT = "/.OPTIMIZER_SLOT/optimizer/{}/.ATTRIBUTES/VARIABLE_VALUE"
# run: the torch.optim twin of its optimizer (the tf-keras run's hyper-parameters); its Keras 3 one is KERAS3's
TORCH = {
    "adam": ("Adam", {"lr": 0.01, "eps": 1e-7}),
    "amsgrad": ("Adam", {"lr": 0.01, "eps": 1e-7, "amsgrad": True}),
    "sgd": ("SGD", {"lr": 0.05, "momentum": 0.9}),
    "nesterov": ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "rmsprop": ("RMSprop", {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "eps": 1e-10}),
    "rmsprop_centered": ("RMSprop", {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "eps": 1e-10, "centered": True}),
    "adagrad": ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1, "eps": 1e-7}),
    "adam_new": ("Adam", {"lr": 0.01, "eps": 1e-7}),
}
LABELS = {"adam": "Keras 2 Adam", "amsgrad": "Keras 2 Adam", "sgd": "Keras 2 SGD", "nesterov": "Keras 2 SGD", "rmsprop": "Keras 2 RMSprop",
          "rmsprop_centered": "Keras 2 RMSprop", "adagrad": "Keras 2 Adagrad", "adam_new": "Keras 2 Adam"}


def _relative(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want)) / np.abs(np.asarray(want))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """tf-keras' runs (TF2 checkpoints after 5 steps, the losses of its 20-step continuations), in another process."""
    pytest.importorskip("tf_keras")
    out = str(tmp_path_factory.mktemp("keras2_optimizer_runs"))
    done = subprocess.run([sys.executable, os.path.join(HERE, "keras2_optimizer_runs.py"), out], capture_output=True,
                          text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "losses.json")) as f:
        return out, json.load(f)


def _keras3(name: str, directory: str, carry: bool, classes: int = 3):
    """Run ``name`` restored into a Keras 3 twin on the TensorFlow backend (carried, or fresh): 20 steps."""
    keras = pytest.importorskip("keras")
    if keras.config.backend() != "tensorflow":
        pytest.skip("the Keras 3 twin runs on the TensorFlow backend here")
    return keras3(name, directory, carry, classes)


def _torch(name: str, directory: str, carry: bool):
    """Run ``name`` restored into its torch twin with ``torch.optim`` (carried, or fresh): 20 steps' losses."""
    import torch

    from test_optimizer_state import _twin

    net = _twin(torch)
    cls, kwargs = TORCH[name]
    opt = getattr(torch.optim, cls)(net.parameters(), **kwargs)
    report = restorekit.scan(os.path.join(directory, path(name)), net, layout="torch",
                             optimizer=opt if carry else None)
    restorekit.restore(report)
    xs, ys = batches()
    losses = []
    for i in range(BEFORE, BEFORE + AFTER):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(xs[i])), torch.from_numpy(ys[i]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, report


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS), ids=[f"Keras 2 {n} resumes in Keras 3 as tf-keras continues" for n in RUNS])
def test_keras3_follows_tf_keras_own_continuation(runs, name):
    out, losses = runs
    got, report, _ = _keras3(name, out, carry=True)
    assert _relative(got, losses[name]) < 1e-5, str(report)
    section = report.optimizer
    assert section.source == LABELS[name] and section.step == BEFORE
    assert [r.parameter for r in section.carried] == ["fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"]
    assert section.reset == ()
    fresh, _, _ = _keras3(name, out, carry=False)  # the control: a warm start with fresh optimizer state
    assert _relative(fresh, losses[name]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_keras3_on_jax_and_torch_follows_tf_keras_own_continuation_without_tensorflow(runs, backend):
    from test_backends import BLOCKER, _missing

    why = _missing(backend)
    if why:
        pytest.skip(f"the {backend} backend {why}")
    out, losses = runs
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": os.pathsep.join([BLOCKER, os.path.dirname(HERE)])}
    done = subprocess.run([sys.executable, os.path.join(HERE, "keras2_optimizer_runs.py"), "resume", out],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, f"{backend}.json")) as f:
        got = json.load(f)
    assert not got["tensorflow_imported"]
    for name in RUNS:
        assert _relative(got["losses"][name], losses[name]) < 1e-5, f"{backend} {name}"
        assert _relative(got["fresh"][name], losses[name]) > 1e-3, f"{backend} {name}: the control"
        assert got["sources"][name] == [LABELS[name], BEFORE, 4]


@pytest.mark.slow
@requires_torch
@pytest.mark.parametrize("name", list(RUNS), ids=[f"Keras 2 {n} resumes in torch.optim as tf-keras continues"
                                                   for n in RUNS])
def test_torch_optim_follows_tf_keras_own_continuation(runs, name):
    out, losses = runs
    got, report = _torch(name, out, carry=True)
    assert _relative(got, losses[name]) < 1e-5, str(report)
    section = report.optimizer
    assert section.source == LABELS[name] and section.step == BEFORE
    assert [r.parameter for r in section.carried] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    if name in ("adam", "sgd", "rmsprop"):
        stored = "layer_with_weights-0/kernel" if name == "sgd" else "model/layer_with_weights-0/kernel"
        first = {"adam": "m", "sgd": "momentum", "rmsprop": "rms"}[name]
        assert section.carried[0].slots[0] == stored + SLOT.format(first)
    if name == "adagrad":  # Keras 2 adds its epsilon outside the root, as torch: kept, not TF1's 0
        assert [n.text.split(":")[0] for n in section.settings if n.what == "eps"] == ["kept 1e-07"]
    fresh, _ = _torch(name, out, carry=False)
    assert _relative(fresh, losses[name]) > 1e-3


# run: the optax optimizer of its hyper-parameters (rms starts at 0 in Keras 2: optax's default initial_scale)
OPTAX = {"adam": lambda optax: optax.adam(0.01, eps=1e-7), "sgd": lambda optax: optax.sgd(0.05, momentum=0.9),
         "rmsprop": lambda optax: optax.rmsprop(0.01, decay=0.9, eps=1e-10, momentum=0.5)}


def _optax(name: str, directory: str, carry: bool):
    """Run ``name`` restored into the Flax NNX twin and its nnx.Optimizer (carried, or fresh): 20 steps' losses."""
    optax = pytest.importorskip("optax")
    nnx = pytest.importorskip("flax.nnx")
    from flax_optimizer_cases import continue_run, twin

    model = twin()
    opt = nnx.Optimizer(model, OPTAX[name](optax), wrt=nnx.Param)
    report = restorekit.scan(os.path.join(directory, path(name)), model, rules=restorekit.FLAX_FROM_TF,
                             optimizer=opt if carry else None)
    restorekit.restore(report)
    return continue_run(model, opt), report


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTAX), ids=[f"Keras 2 {n} resumes in optax as tf-keras continues" for n in OPTAX])
def test_optax_follows_tf_keras_own_continuation(runs, name):
    out, losses = runs
    got, report = _optax(name, out, carry=True)
    assert _relative(got, losses[name]) < 1e-5, str(report)
    assert report.optimizer.source == LABELS[name] and report.optimizer.step == BEFORE
    assert len(report.optimizer.carried) == 4 and report.optimizer.reset == ()
    fresh, _ = _optax(name, out, carry=False)
    assert _relative(fresh, losses[name]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name, match", [
    ("rmsprop_plain", r"RMSprop\(momentum=0\) \(it adds epsilon outside the root"),
    ("decay", r"decays its learning rate \(decay=0\.01"),
], ids=[f"a Keras 2 {n} checkpoint is refused by name" for n in REFUSED])
def test_keras2_state_not_carried_yet_is_refused_before_anything_is_written(runs, name, match):
    keras = pytest.importorskip("keras")
    from keras_optimizer_runs import compiled

    opt = keras.optimizers.Adam(0.01) if "rms" not in name else keras.optimizers.RMSprop(0.01)
    net = compiled(keras, opt)
    before = [v.numpy() for v in net.variables]
    with pytest.raises(restorekit.InvalidArgumentError, match=match):
        restorekit.scan(os.path.join(runs[0], name, "ckpt-1"), net, optimizer=opt)
    assert not opt.built and all(np.array_equal(v.numpy(), b) for v, b in zip(net.variables, before))


@pytest.mark.slow
@requires_torch
def test_amsgrads_vhat_is_carried_where_the_target_keeps_one_and_refused_where_not(runs):
    import optax
    import torch
    from flax import nnx

    from flax_optimizer_cases import twin
    from keras_optimizer_runs import compiled
    from test_optimizer_state import _twin

    out, _ = runs
    prefix = os.path.join(out, path("amsgrad"))
    stored = restorekit.Checkpoint(prefix)
    kernel = "model/layer_with_weights-0/kernel"
    vhat, v = stored.read(kernel + SLOT.format("vhat")), stored.read(kernel + SLOT.format("v"))
    assert (vhat > v).any()  # the run's v fell somewhere: vhat is not v, so carrying it is seen
    net = _twin(torch)
    adam = torch.optim.Adam(net.parameters(), lr=0.01, eps=1e-7, amsgrad=True)
    report = restorekit.scan(prefix, net, layout="torch", optimizer=adam)
    restorekit.restore(report)
    np.testing.assert_array_equal(adam.state[net.fc1.weight]["max_exp_avg_sq"].numpy(), vhat.T)
    assert "amsgrad" not in {d.what for d in report.optimizer.differences}
    keras = pytest.importorskip("keras")
    opt = keras.optimizers.Adam(0.01, amsgrad=True)
    restorekit.restore(restorekit.scan(prefix, compiled(keras, opt), optimizer=opt))
    np.testing.assert_array_equal({w.name: w.numpy() for w in opt.variables}["fc1_kernel_velocity_hat"], vhat)
    net = _twin(torch)
    plain = torch.optim.Adam(net.parameters(), lr=0.01)
    with pytest.raises(restorekit.InvalidArgumentError, match=r"keeps vhat.*torch\.optim\.Adam as given keeps none"):
        restorekit.scan(prefix, net, layout="torch", optimizer=plain)
    assert not plain.state
    opt = keras.optimizers.Adam(0.01)
    with pytest.raises(restorekit.InvalidArgumentError, match=r"keeps vhat.*keras\.optimizers\.Adam as given"):
        restorekit.scan(prefix, compiled(keras, opt), optimizer=opt)
    assert not opt.built
    model = twin()
    with pytest.raises(restorekit.InvalidArgumentError, match=r"keeps vhat.*optax\.adam as given"):
        restorekit.scan(prefix, model, rules=restorekit.FLAX_FROM_TF,
                        optimizer=nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param))


@pytest.mark.slow
def test_tf1_adagrad_resumes_in_keras3_adagrad_and_a_new_head_starts_at_the_initial_accumulator(runs):
    keras = pytest.importorskip("keras")
    from keras_optimizer_runs import compiled, continue_run

    out, losses = runs
    prefix = os.path.join(out, "tf1", "adagrad", "model.ckpt")

    def resume(carry: bool, classes: int = 3):
        keras.utils.set_random_seed(1)
        opt = keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)
        net = compiled(keras, opt, classes)
        report = restorekit.scan(prefix, net, optimizer=opt if carry else None)
        restorekit.restore(report)
        return net, opt, report

    net, _, report = resume(True)
    assert _relative(continue_run(net), losses["tf1_adagrad"]) < 1e-5, str(report)
    assert report.optimizer.source == "Adagrad (TF1)" and report.optimizer.step == BEFORE
    (epsilon,) = [d for d in report.optimizer.differences if d.what == "epsilon"]
    assert 0 < epsilon.size < 1e-5 and "TF1 adds none" in epsilon.text  # named, with its size
    assert _relative(continue_run(resume(False)[0]), losses["tf1_adagrad"]) > 1e-3
    _, opt, report = resume(True, classes=5)
    assert [r.parameter for r in report.optimizer.reset] == ["fc2/kernel", "fc2/bias"]
    accumulators = {v.name: v.numpy() for v in opt.variables}
    np.testing.assert_array_equal(accumulators["fc2_kernel_accumulator"], np.full((16, 5), 0.1, np.float32))
    np.testing.assert_array_equal(accumulators["fc1_kernel_accumulator"],
                                  restorekit.Checkpoint(prefix).read("fc1/kernel/Adagrad"))


# ------------------------------------------------------------------ the fast set: one tf-keras checkpoint, in-process


@pytest.fixture(scope="module")
def adam_checkpoint(tmp_path_factory):
    """A tf-keras model trained 2 steps with the legacy (OptimizerV2) Adam, saved by tf.train.Checkpoint."""
    tf = pytest.importorskip("tensorflow")
    tf_keras = pytest.importorskip("tf_keras")
    from keras2_optimizer_runs import _model

    net = _model(tf_keras, "legacy.Adam", {"learning_rate": 0.01})
    xs, ys = batches()
    for i in range(2):
        net.train_on_batch(xs[i], ys[i])
    prefix = str(tmp_path_factory.mktemp("keras2_adam") / "ckpt-1")
    tf.train.Checkpoint(model=net, optimizer=net.optimizer).write(prefix)
    return prefix


def test_a_slot_whose_weight_changed_shape_is_reported_reset_and_the_rest_are_the_checkpoints(adam_checkpoint):
    keras = pytest.importorskip("keras")
    from keras_optimizer_runs import compiled

    opt = keras.optimizers.Adam(0.01)
    net = compiled(keras, opt, classes=5)  # a head for other classes: fc2 [16, 5] where the checkpoint's is [16, 3]
    report = restorekit.scan(adam_checkpoint, net, optimizer=opt)
    section = report.optimizer
    assert [(r.parameter, r.how) for r in section.reset] == [("fc2/kernel", "mismatched"), ("fc2/bias", "mismatched")]
    assert "checkpoint [16, 3], model [16, 5]" in section.reset[0].reason
    assert section.source == "Keras 2 Adam" and section.step == 2 and section.step_from == "iter"
    restorekit.restore(report)
    stored = restorekit.Checkpoint(adam_checkpoint)
    slots = {v.name: v.numpy() for v in opt.variables}
    kernel = "model/layer_with_weights-0/kernel"
    np.testing.assert_array_equal(slots["fc1_kernel_momentum"], stored.read(kernel + SLOT.format("m")))
    np.testing.assert_array_equal(slots["fc1_kernel_velocity"], stored.read(kernel + SLOT.format("v")))
    assert slots["fc1_kernel_velocity"].any()
    assert not slots["fc2_kernel_momentum"].any() and not slots["fc2_bias_velocity"].any()
    assert int(opt.iterations.numpy()) == 2
    assert "optimizer  keras.optimizers.Adam (tensorflow) <- Keras 2 Adam, step 2 (iter)" in str(report)


@pytest.mark.parametrize("make, match", [
    (lambda k: k.optimizers.SGD(0.05, momentum=0.9), r"holds Adam slots; keras\.optimizers\.SGD takes Momentum"),
    (lambda k: k.optimizers.Adam(0.01, beta_2=0.99), r"Keras 2 Adam ran with betas \(0\.9, 0\.999\).*\(0\.9, 0\.99\)"),
], ids=["an optimizer of another kind is refused", "betas other than the run's saved ones are refused"])
def test_an_optimizer_that_cannot_take_the_state_is_refused_before_anything_is_written(adam_checkpoint, make, match):
    keras = pytest.importorskip("keras")
    from keras_optimizer_runs import compiled

    opt = make(keras)
    net = compiled(keras, opt)
    before = [v.numpy() for v in net.variables]
    with pytest.raises(restorekit.InvalidArgumentError, match=match):
        restorekit.scan(adam_checkpoint, net, optimizer=opt)
    assert not opt.built and all(np.array_equal(v.numpy(), b) for v, b in zip(net.variables, before))


@requires_torch
def test_torch_optim_of_another_kind_is_refused_and_a_changed_head_is_reset(adam_checkpoint):
    import torch

    from test_optimizer_state import _twin

    net = _twin(torch)
    before = net.fc1.weight.detach().clone()
    sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(restorekit.InvalidArgumentError, match=r"holds Adam slots; torch\.optim\.SGD takes Momentum"):
        restorekit.scan(adam_checkpoint, net, layout="torch", optimizer=sgd)
    assert torch.equal(net.fc1.weight, before) and not sgd.state
    other = torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.95, 0.999))  # the run's were Keras' (0.9, 0.999)
    with pytest.raises(restorekit.InvalidArgumentError, match=r"Keras 2 Adam ran with betas \(0\.9, 0\.999\)"):
        restorekit.scan(adam_checkpoint, net, layout="torch", optimizer=other)
    assert torch.equal(net.fc1.weight, before) and not other.state
    net = _twin(torch, classes=5)
    adam = torch.optim.Adam(net.parameters(), lr=0.01, eps=1e-7)
    report = restorekit.scan(adam_checkpoint, net, layout="torch", optimizer=adam)
    assert [(r.parameter, r.how) for r in report.optimizer.reset] == [("fc2.weight", "mismatched"),
                                                                       ("fc2.bias", "mismatched")]
    restorekit.restore(report)
    assert net.fc2.weight not in adam.state and net.fc2.bias not in adam.state
    stored = restorekit.Checkpoint(adam_checkpoint)
    np.testing.assert_array_equal(adam.state[net.fc1.weight]["exp_avg"].numpy(),
                                  stored.read("model/layer_with_weights-0/kernel" + SLOT.format("m")).T)
    assert float(adam.state[net.fc1.weight]["step"]) == 2
