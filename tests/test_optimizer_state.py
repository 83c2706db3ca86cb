"""Optimizer state as part of a restore (issue 36): TF1 slots carried into torch.optim, checked against TF itself.

The oracle is TensorFlow: ``tests/tf1_optimizer_runs.py`` runs in its own process, trains a
tiny net 5 steps per optimizer, saves, and continues 20 steps; here the torch twin is
restored with ``scan(..., optimizer=opt)`` + ``restore`` and continues on the same batches.
The conversions themselves (``restorekit._optim._convert``) are checked in numpy first.
"""

import json
import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import restorekit
from conftest import requires_torch, save_variables
from restorekit._optim import _convert as convert
from tf1_optimizer_runs import AFTER, BEFORE, RUNS, batches

HERE = os.path.dirname(os.path.abspath(__file__))
EXACT = ["adam", "momentum", "nesterov", "rmsprop", "rmsprop_centered", "rmsprop_plain", "adagrad", "bert_adamw"]


# ------------------------------------------------------------------ the conversions, in numpy


def _tf1_adam_step(var, m, v, g, lr, b1, b2, eps, k):
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    return var - lr * math.sqrt(1 - b2 ** k) / (1 - b1 ** k) * m / (np.sqrt(v) + eps), m, v


def _torch_adam_step(var, m, v, g, lr, b1, b2, eps, step):
    step += 1
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    return var - lr / (1 - b1 ** step) * m / (np.sqrt(v) / math.sqrt(1 - b2 ** step) + eps), m, v


def test_adam_epsilon_makes_torchs_next_step_tf1s_epsilon_hat_step():
    rng = np.random.default_rng(0)
    var, m, v, g = rng.standard_normal(6), rng.standard_normal(6) * 1e-2, rng.random(6) * 1e-6, rng.standard_normal(6)
    steps, eps = 7, 1e-3  # a large epsilon: the placement matters
    want, _, _ = _tf1_adam_step(var, m, v, g, 0.01, 0.9, 0.99, eps, steps + 1)
    state = convert.to_adam(m, v, steps)
    got, _, _ = _torch_adam_step(var, state["exp_avg"], state["exp_avg_sq"], g, 0.01, 0.9, 0.99,
                                 convert.adam_epsilon(eps, 0.99, steps), state["step"])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    plain, _, _ = _torch_adam_step(var, m, v, g, 0.01, 0.9, 0.99, eps, steps)
    assert np.max(np.abs(plain - want)) > 1e-4  # torch's own eps would not be TF's


def test_adam_steps_are_read_from_beta1_power_and_checked_against_beta2_power():
    assert convert.adam_steps(np.float32(0.9) ** 6, np.float32(0.999) ** 6, 0.9, 0.999) == 5
    b1, b2 = np.float32(1.0), np.float32(1.0)
    for _ in range(3001):  # TF multiplies in float32, once per step: beta1_power underflows, beta2_power counts
        b1, b2 = b1 * np.float32(0.9), b2 * np.float32(0.999)
    assert convert.adam_steps(float(b1), float(b2), 0.9, 0.999) == 3000
    assert convert.adam_steps(0.0, 0.0, 0.9, 0.999, global_step=200000) == 200000  # both corrections are 1 by now
    with pytest.raises(restorekit.InvalidArgumentError, match=r"betas \(0\.95, 0\.999\)"):
        convert.adam_steps(0.9 ** 6, 0.999 ** 6, 0.95, 0.999)
    with pytest.raises(restorekit.InvalidArgumentError, match="beta2_power"):
        convert.adam_steps(0.9 ** 6, 0.99 ** 6, 0.9, 0.999)


def test_rmsprop_state_moves_the_learning_rate_out_of_the_buffer_and_epsilon_out_of_the_root():
    rng = np.random.default_rng(1)
    ms, mom, g = rng.random(5).astype(np.float32) + 0.01, rng.standard_normal(5).astype(np.float32), rng.standard_normal(5)
    lr, mu, rho, eps = 0.01, 0.5, 0.9, 1e-6
    state = convert.to_rmsprop(ms, mom, None, lr=lr, momentum=mu, steps=3)
    np.testing.assert_allclose(state["momentum_buffer"] * lr, mom, rtol=1e-6)
    ms1 = rho * ms + (1 - rho) * g * g
    tf_update = mu * mom + lr * g / np.sqrt(ms1 + eps)
    eps_torch = convert.rmsprop_epsilon(eps, float(ms1.min()))
    torch_update = lr * (mu * state["momentum_buffer"] + g / (np.sqrt(ms1) + eps_torch))
    np.testing.assert_allclose(torch_update, tf_update, rtol=convert.rmsprop_epsilon_error(eps, eps_torch, ms1) + 1e-6)
    smallest = int(np.argmin(ms1))
    assert math.isclose(math.sqrt(ms1[smallest]) + eps_torch, math.sqrt(ms1[smallest] + eps), rel_tol=1e-12)


# ------------------------------------------------------------------ TF's own runs vs the torch twin


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The TF1 runs (checkpoints after 5 steps, losses of TF's 20-step continuation), made in another process."""
    out = str(tmp_path_factory.mktemp("tf1_runs"))
    subprocess.run([sys.executable, os.path.join(HERE, "tf1_optimizer_runs.py"), out], check=True,
                   capture_output=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    with open(os.path.join(out, "losses.json")) as f:
        return out, json.load(f)


def _twin(torch, classes: int = 3):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, classes)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    return Net()


def _optimizer(torch, name: str, net):
    """The torch.optim twin of run ``name``'s TF1 optimizer, given the TF run's hyper-parameters."""
    cls, kw = RUNS[name]
    params = net.parameters()
    if cls == "AdamWeightDecayOptimizer":  # BERT's: decoupled decay, biases excluded
        named = dict(net.named_parameters())
        groups = [{"params": [p for n, p in named.items() if not n.endswith("bias")]},
                  {"params": [p for n, p in named.items() if n.endswith("bias")], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=kw["learning_rate"], eps=kw["epsilon"],
                                 weight_decay=kw["weight_decay_rate"])
    if cls == "AdamOptimizer":
        return torch.optim.Adam(params, lr=kw["learning_rate"], betas=(kw.get("beta1", 0.9), kw.get("beta2", 0.999)),
                                eps=kw.get("epsilon", 1e-8))
    if cls == "MomentumOptimizer":
        return torch.optim.SGD(params, lr=kw["learning_rate"], momentum=kw["momentum"],
                               nesterov=kw.get("use_nesterov", False))
    if cls == "RMSPropOptimizer":
        return torch.optim.RMSprop(params, lr=kw["learning_rate"], alpha=kw["decay"], eps=kw["epsilon"],
                                   momentum=kw.get("momentum", 0.0), centered=kw.get("centered", False))
    return torch.optim.Adagrad(params, lr=kw["learning_rate"], initial_accumulator_value=kw["initial_accumulator_value"])


def _continue(torch, runs, name: str, carry: bool):
    """The torch twin restored from run ``name`` (optimizer state carried, or fresh), then 20 steps: its losses."""
    out, _ = runs
    net = _twin(torch)
    optimizer = _optimizer(torch, name, net)
    report = restorekit.scan(os.path.join(out, name, "model.ckpt"), net, layout="torch",
                             optimizer=optimizer if carry else None)
    restorekit.restore(report)
    xs, ys = batches()
    losses = []
    for i in range(BEFORE, BEFORE + AFTER):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(xs[i])), torch.from_numpy(ys[i]))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return np.array(losses), report


@requires_torch
@pytest.mark.parametrize("name", EXACT, ids=[f"{n} continues as TF does" for n in EXACT])
def test_a_resumed_torch_run_follows_tensorflows_own_continuation(runs, name):
    import torch

    want = np.array(runs[1][name])
    got, report = _continue(torch, runs, name, carry=True)
    relative = np.abs(got - want) / np.abs(want)
    assert relative.max() < 1e-5, f"{name}: step losses differ by up to {relative.max():.2e}\n{report}"
    assert sorted(r.parameter for r in report.optimizer.carried) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert report.optimizer.reset == ()
    if name == "bert_adamw":  # no bias correction: a step count at which torch's corrections are exactly 1
        assert report.optimizer.step == convert.uncorrected_steps(0.9, 0.999) > 37000
        assert report.optimizer.step_from == "no bias correction"
    else:
        assert report.optimizer.step == BEFORE
    fresh, _ = _continue(torch, runs, name, carry=False)  # the control: a warm start, not a resume
    assert (np.abs(fresh - want) / np.abs(want)).max() > 1e-3


@requires_torch
def test_adam_with_a_large_epsilon_names_what_torch_cannot_express_and_how_much(runs):
    import torch

    want = np.array(runs[1]["adam_eps"])
    got, report = _continue(torch, runs, "adam_eps", carry=True)
    fresh, _ = _continue(torch, runs, "adam_eps", carry=False)
    (drift,) = [n for n in report.optimizer.differences if n.what == "eps"]
    assert drift.size > 1e-2 and "epsilon hat" in drift.text
    assert "differs eps" in str(report)
    relative = np.abs(got - want) / np.abs(want)
    assert relative[0] < 1e-5  # eps is set so the next step is TF's own
    assert relative.max() < (np.abs(fresh - want) / np.abs(want)).max() / 10


@requires_torch
def test_a_slot_whose_weight_changed_shape_is_reported_reset_and_not_written(runs):
    import torch

    out, _ = runs
    net = _twin(torch, classes=5)  # a head for other classes: fc2 [5, 16] where the checkpoint's is [3, 16]
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    report = restorekit.scan(os.path.join(out, "adam", "model.ckpt"), net, layout="torch", optimizer=optimizer)
    section = report.optimizer
    assert [(r.parameter, r.how) for r in section.reset] == [("fc2.weight", "mismatched"), ("fc2.bias", "mismatched")]
    assert "checkpoint [3, 16], model [5, 16]" in section.reset[0].reason
    restorekit.restore(report)
    assert net.fc2.weight not in optimizer.state and net.fc2.bias not in optimizer.state
    checkpoint = restorekit.Checkpoint(os.path.join(out, "adam", "model.ckpt"))
    state = optimizer.state[net.fc1.weight]
    np.testing.assert_array_equal(state["exp_avg"].numpy(), checkpoint.read("fc1/kernel/Adam").T)
    np.testing.assert_array_equal(state["exp_avg_sq"].numpy(), checkpoint.read("fc1/kernel/Adam_1").T)
    assert float(state["step"]) == BEFORE and state["step"].dtype == torch.float32
    text = str(report)
    assert "optimizer  torch.optim.Adam <- Adam (TF1), step 5" in text and "fc2.weight (its weight is mismatched" in text
    assert report.to_dict()["optimizer"]["reset"][0]["how"] == "mismatched"
    copy = pickle.loads(pickle.dumps(report))
    assert copy == report and copy.optimizer == section and copy._optimizer is None


@requires_torch
@pytest.mark.parametrize("make, match", [
    (lambda t, p: t.optim.SGD(p, lr=0.1, momentum=0.9), r"holds Adam slots; torch\.optim\.SGD takes Momentum"),
    (lambda t, p: t.optim.Adam(p, lr=0.1, betas=(0.95, 0.999)), r"betas \(0\.95, 0\.999\)"),
    (lambda t, p: t.optim.Adadelta(p), r"torch\.optim\.adadelta\.Adadelta is not supported yet"),
], ids=["SGD given Adam slots is refused", "betas that do not fit beta1_power are refused",
        "an optimizer not supported yet is refused by name"])
def test_an_optimizer_that_cannot_take_the_checkpoints_state_is_refused_before_anything_is_written(runs, make, match):
    import torch

    out, _ = runs
    net = _twin(torch)
    before = net.fc1.weight.detach().clone()
    optimizer = make(torch, net.parameters())
    with pytest.raises(restorekit.InvalidArgumentError, match=match):
        restorekit.scan(os.path.join(out, "adam", "model.ckpt"), net, layout="torch", optimizer=optimizer)
    assert torch.equal(net.fc1.weight, before) and not optimizer.state


@requires_torch
def test_rmsprop_centered_must_agree_with_the_slots(runs):
    import torch

    out, _ = runs
    net = _twin(torch)
    optimizer = torch.optim.RMSprop(net.parameters(), lr=0.01, alpha=0.9, momentum=0.5, centered=False)
    with pytest.raises(restorekit.InvalidArgumentError, match=r"centered.*RMSprop\(centered=True\)"):
        restorekit.scan(os.path.join(out, "rmsprop_centered", "model.ckpt"), net, layout="torch", optimizer=optimizer)


@requires_torch
def test_a_conv_kernels_slots_take_the_kernels_axis_permutation(tmp_path):
    import torch

    rng = np.random.default_rng(3)
    kernel = rng.standard_normal((3, 3, 2, 4)).astype(np.float32)  # TF's HWIO
    m, v = rng.standard_normal(kernel.shape).astype(np.float32), rng.random(kernel.shape).astype(np.float32)
    prefix = save_variables(tmp_path / "model.ckpt", {
        "conv/weights": kernel, "conv/biases": np.zeros(4, np.float32), "conv/weights/Momentum": m,
        "conv/biases/Momentum": np.ones(4, np.float32), "global_step": np.int64(9)})
    del v
    net = torch.nn.Sequential()
    net.add_module("conv", torch.nn.Conv2d(2, 4, 3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    report = restorekit.scan(prefix, net, layout="torch", optimizer=optimizer)
    restorekit.restore(report)
    np.testing.assert_array_equal(optimizer.state[net.conv.weight]["momentum_buffer"].numpy(), m.transpose(3, 2, 0, 1))
    assert report.optimizer.step == 9 and report.optimizer.step_from == "global_step"
    assert report.optimizer.carried[0].slots == ("conv/weights/Momentum",)


@requires_torch
def test_a_weight_without_slots_and_an_excluded_weight_start_fresh_with_their_reason(tmp_path):
    import torch

    rng = np.random.default_rng(4)
    values = {"fc/kernel": rng.standard_normal((4, 3)).astype(np.float32), "fc/bias": np.zeros(3, np.float32),
              "fc/kernel/Adagrad": np.full((4, 3), 0.5, np.float32), "global_step": np.int64(2)}
    prefix = save_variables(tmp_path / "model.ckpt", values)
    net = torch.nn.Sequential()
    net.add_module("fc", torch.nn.Linear(4, 3))
    optimizer = torch.optim.Adagrad(net.parameters(), lr=0.1, initial_accumulator_value=0.1)
    report = restorekit.scan(prefix, net, layout="torch", optimizer=optimizer)
    assert [(r.parameter, r.how) for r in report.optimizer.reset] == [("fc.bias", "no_slots")]
    restorekit.restore(report)
    np.testing.assert_array_equal(optimizer.state[net.fc.weight]["sum"].numpy(), np.full((3, 4), 0.5, np.float32))
    np.testing.assert_array_equal(optimizer.state[net.fc.bias]["sum"].numpy(), np.full(3, 0.1, np.float32))
    assert optimizer.param_groups[0]["eps"] == 0.0  # TF1 Adagrad has none; every accumulator starts above 0
    excluded = restorekit.scan(prefix, net, layout="torch", exclude=["fc.weight"],
                               optimizer=torch.optim.Adagrad(net.parameters(), lr=0.1))
    assert excluded.optimizer.reset[0].how == "not_restored" and "excluded" in excluded.optimizer.reset[0].reason


@requires_torch
def test_scan_and_restore_together_read_each_slot_from_the_checkpoint_once(runs, monkeypatch):
    import torch
    from restorekit._checkpoint import Checkpoint

    out, _ = runs
    reads = []
    real = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name: reads.append(name) or real(self, name))
    net = _twin(torch)
    optimizer = _optimizer(torch, "adam", net)
    report = restorekit.scan(os.path.join(out, "adam", "model.ckpt"), net, layout="torch", optimizer=optimizer)
    restorekit.restore(report)
    slots = sorted(n for n in reads if n.endswith(("/Adam", "/Adam_1")))
    assert slots == sorted(f"{w}/{leaf}" for w in ("fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias")
                           for leaf in ("Adam", "Adam_1"))  # once each: scan's values are the ones restore writes
    checkpoint = restorekit.Checkpoint(os.path.join(out, "adam", "model.ckpt"))
    np.testing.assert_array_equal(optimizer.state[net.fc2.weight]["exp_avg_sq"].numpy(),
                                  checkpoint.read("fc2/kernel/Adam_1").T)
    assert report.optimizer.step == BEFORE


@requires_torch
@pytest.mark.slow  # transformers' import and a BertForPreTraining: ~4 s
def test_berts_own_slots_follow_the_rule_set_into_adamw_and_its_next_step_is_berts_update(tmp_path):
    import torch

    transformers = pytest.importorskip("transformers")
    from test_export_hf import HIDDEN, INNER, LAYERS, POSITIONS, VOCAB, bert_values

    values = bert_values()
    values.update({k: np.abs(v) for k, v in values.items() if k.endswith("/adam_v")})  # v is a mean square
    prefix = save_variables(tmp_path / "bert_model.ckpt", values)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=2, intermediate_size=INNER, max_position_embeddings=POSITIONS)
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, eps=1e-6)
    report = restorekit.scan(prefix, model, rules="bert-tf-to-hf", optimizer=optimizer)
    restorekit.restore(report)
    assert len(report.optimizer.carried) == len(list(model.parameters())) and report.optimizer.reset == ()
    assert report.optimizer.source == "AdamWeightDecayOptimizer (BERT, TF1)"
    kernel = "bert/encoder/layer_1/intermediate/dense/kernel"  # [16, 32] in TF, transposed for torch
    weight = model.bert.encoder.layer[1].intermediate.dense.weight
    state = optimizer.state[weight]
    np.testing.assert_array_equal(state["exp_avg"].numpy(), values[kernel + "/adam_m"].T)
    np.testing.assert_array_equal(state["exp_avg_sq"].numpy(), values[kernel + "/adam_v"].T)
    assert state["exp_avg"].is_contiguous() and float(state["step"]) == convert.uncorrected_steps(0.9, 0.999)
    np.testing.assert_array_equal(optimizer.state[model.bert.embeddings.word_embeddings.weight]["exp_avg"].numpy(),
                                  values["bert/embeddings/word_embeddings/adam_m"])
    # one step with a known gradient: BERT's update, no bias correction, decoupled decay
    g = np.random.default_rng(5).standard_normal(weight.shape).astype(np.float32)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    weight.grad = torch.from_numpy(g.copy())
    var, m, v = values[kernel].T.astype(np.float64), values[kernel + "/adam_m"].T, values[kernel + "/adam_v"].T
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    want = var - 0.01 * (m / (np.sqrt(v) + 1e-6) + 0.1 * var)
    optimizer.step()
    np.testing.assert_allclose(weight.detach().numpy(), want, rtol=1e-5, atol=1e-6)
