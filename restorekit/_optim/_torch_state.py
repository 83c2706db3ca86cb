"""A torch training checkpoint's optimizer state as a source: ``optimizer.state_dict()`` saved beside the model's.

A training checkpoint ``{'model': model.state_dict(), 'optimizer': opt.state_dict(), ...}``
(``torch.save``) is scanned as ``FILE:GROUP`` (``train.pt:model``); the optimizer's state is
the dict beside it with ``state`` and ``param_groups``. torch numbers the parameters
``0..N-1`` in ``param_groups`` order; restorekit reads them as the model group's
parameters in ``state_dict`` order (``named_parameters()``, buffers left out) and checks every
state tensor's shape against its parameter's, refusing the file where they disagree. The
state is read in TF1's terms, as every target takes it:

| torch.optim | state | in TF1's terms | the target (Keras 3) |
| --- | --- | --- | --- |
| ``Adam(lr, betas, eps)``: ``p -= lr/(1-b1^k) m / (sqrt(v)/sqrt(1-b2^k) + eps)`` | ``exp_avg``, ``exp_avg_sq``, ``step = t`` | ``Adam = m``, ``Adam_1 = v``, ``t`` steps | ``Adam``'s epsilon hat ``eps sqrt(1-b2^k)`` at ``k = t+1``: the next step exact, the drift after reported |
| ``SGD(lr, momentum, nesterov, dampening=0)``: ``buf = mu buf + g``, ``p -= lr buf`` | ``momentum_buffer`` | ``Momentum = buf`` (the same recursion) | ``SGD``'s ``momentum = -lr buf``: exact |

``dampening``, ``amsgrad`` and ``weight_decay`` (coupled, in ``Adam`` and ``SGD``) have no TF1
term: the first two are refused, the decay is reported with its size. Into optax nothing converts: optax adds eps where torch does.
Back into TF1 slots, ``_tf1_target`` writes these leaves under their TF names (``var/Adam``, ...).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from restorekit._optim._tf1 import TF1State
from restorekit._registry import file_and_group
from restorekit._report import OptimizerNote
from restorekit.errors import InvalidArgumentError

__all__ = ["TorchState", "check_groups", "is_torch_training_file", "keras_epsilon", "torch_state"]

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm's: in state_dict, not parameters
_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "model_state")


@dataclass
class TorchState(TF1State):
    """A torch optimizer's state in TF1's terms: stored parameter name -> {TF1 leaf: key}, the values beside."""

    values: dict = field(default_factory=dict)  # key -> array, in the stored (torch) axes
    groups: list = field(default_factory=list)  # the param groups' hyper-parameters (no 'params')

    def read(self, checkpoint, leaf: str, key: str):
        del checkpoint, leaf
        return self.values[key]

    def read_into(self, checkpoint, leaf: str, key: str, out):
        np.copyto(out, self.read(checkpoint, leaf, key))
        return out

    def shape_of(self, checkpoint, key: str) -> tuple:
        return tuple(self.values[key].shape)

    def slots_of(self, base: str, kind: str) -> dict | None:
        del kind
        return self.slots.get(base)


def is_torch_training_file(checkpoint) -> bool:
    """True for a torch file read as one group of a training checkpoint (``FILE:GROUP``) or as a whole dict."""
    return getattr(checkpoint, "format", None) == "torch" and isinstance(getattr(checkpoint, "prefix", None), str)


def _load(path: str):
    import torch

    try:  # the file was opened (and checked: weights only) as the source already
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (not zip) file cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def _numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy()


def torch_state(checkpoint) -> TorchState | None:
    """The torch optimizer state saved beside the model group ``checkpoint`` reads, or None where the file holds none.

    Raises:
        InvalidArgumentError: the optimizer's parameters do not pair with the model's by order and shape, or
            they hold state with terms TF1 has none for (``dampening``, ``amsgrad``).
    """
    path, group = file_and_group(checkpoint.prefix)
    loaded = _load(path)
    if not isinstance(loaded, dict):
        return None
    optimizers = [k for k, v in loaded.items() if isinstance(v, dict) and {"state", "param_groups"} <= set(v)]
    model_key = group or next((k for k in _MODEL_KEYS if isinstance(loaded.get(k), dict)), None)
    if not optimizers or model_key is None:
        return None
    if len(optimizers) > 1:
        raise InvalidArgumentError(f"{path!r} holds {len(optimizers)} optimizer state dicts ({', '.join(optimizers)}); "
                                   f"carrying one of several is not supported yet: scan without optimizer=")
    saved = loaded[optimizers[0]]
    model = loaded[model_key]
    names = [n for n in model if n.rpartition(".")[2] not in _BUFFERS]
    order = [i for g in saved["param_groups"] for i in g["params"]]
    if len(order) != len(names):
        raise InvalidArgumentError(
            f"{path!r}: the optimizer ({optimizers[0]!r}) has {len(order)} parameters, the model group "
            f"({model_key!r}) {len(names)} (buffers left out); restorekit pairs them by order and cannot here: "
            f"scan without optimizer=")
    state = TorchState(label="torch", counter="step",
                       groups=[{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]])
    steps = set()
    for position, index in enumerate(order):
        held = saved["state"].get(index)
        if not held:
            continue
        name = names[position]
        want = tuple(model[name].shape)
        kind, leaves = _leaves(held, path, index)
        for leaf, (_, value) in leaves.items():
            if tuple(value.shape) != want:
                raise InvalidArgumentError(
                    f"{path!r}: the optimizer's parameter {index} has {leaf} of shape {list(value.shape)}, the "
                    f"model's parameter {position} ({name!r}) is {list(want)}: restorekit pairs them in "
                    f"named_parameters() order (the order param_groups lists), which this checkpoint does not "
                    f"follow (param groups built in another order, or buffers among the weights); scan without "
                    f"optimizer=")
        keys = {}
        for leaf, (torch_leaf, value) in leaves.items():
            keys[leaf] = key = f"{optimizers[0]}.state.{index}.{torch_leaf}"
            state.values[key] = _numpy(value)
        state.slots[name] = keys
        state.kinds[kind] += len(keys)
        if "step" in held:
            steps.add(int(float(held["step"])))
    if len(steps) > 1:
        raise InvalidArgumentError(f"{path!r}: the optimizer's parameters took different step counts "
                                   f"({sorted(steps)}); one count is carried: scan without optimizer=")
    state.global_step = steps.pop() if steps else None
    state.kinds = Counter(state.kinds)
    if state.kinds:
        state.label = f"torch {'Adam' if 'Adam' in state.kinds else 'SGD'}"
    return state


def _leaves(held: dict, path: str, index: int) -> tuple:
    """``(TF1 kind, {TF1 leaf: (torch's name, tensor)})`` of one parameter's torch state."""
    if "max_exp_avg_sq" in held:
        raise InvalidArgumentError(f"{path!r}: the optimizer ran with amsgrad=True (max_exp_avg_sq); TF1's and "
                                   f"Keras's Adam keep no such maximum: not supported yet, scan without optimizer=")
    if "exp_avg" in held and "exp_avg_sq" in held:
        return "Adam", {"Adam": ("exp_avg", held["exp_avg"]), "Adam_1": ("exp_avg_sq", held["exp_avg_sq"])}
    if "momentum_buffer" in held and held["momentum_buffer"] is not None:
        return "Momentum", {"Momentum": ("momentum_buffer", held["momentum_buffer"])}
    raise InvalidArgumentError(f"{path!r}: the optimizer's state of parameter {index} ({', '.join(held)}) is "
                               f"neither Adam's nor SGD's with momentum; carrying it is not supported yet")


def check_groups(state: TorchState, kind: str, *, betas=None, nesterov=None) -> list:
    """The source's hyper-parameters against the target's, in TF1's terms: refuses what changes the state's meaning
    (other betas, dampening, nesterov); returns ``[(what, text, size)]`` for what the target leaves out (decay)."""
    out = []
    for i, g in enumerate(state.groups):
        if kind == "Adam" and betas is not None:
            saved = tuple(float(b) for b in g.get("betas", (0.9, 0.999)))
            if any(not math.isclose(a, float(b), rel_tol=1e-6) for a, b in zip(saved, betas)):
                raise InvalidArgumentError(f"the torch run's betas are {saved} (param group {i}), the target's "
                                           f"{tuple(float(b) for b in betas)}: pass the torch run's betas")
        if kind == "Momentum":
            if float(g.get("dampening", 0) or 0):
                raise InvalidArgumentError(f"the torch run's SGD has dampening {g['dampening']} (param group {i}): "
                                           f"TF1's and Keras's momentum add the whole gradient; not supported")
            if nesterov is not None and bool(g.get("nesterov")) != bool(nesterov):
                raise InvalidArgumentError(f"the torch run's SGD has nesterov={bool(g.get('nesterov'))}: pass "
                                           f"nesterov={bool(g.get('nesterov'))}")
        decay = float(g.get("weight_decay", 0) or 0)
        if decay:
            out.append(("weight_decay", f"{decay:g} in the torch run (param group {i}, coupled: added to the "
                                        f"gradient): the target adds no such term, every update differs", decay))
    return out


def keras_epsilon(state: TorchState, beta2: float, steps: int, root: float, ahead: int) -> tuple:
    """Keras's (and TF1's) epsilon hat that makes its next step (``steps + 1``) torch's, and the drift of the update's
    denominator over the next ``ahead`` steps (relative, at ``root`` = the median ``sqrt(v_hat)``).

    torch adds ``eps`` to ``sqrt(v_hat)``; Keras and TF1's ``AdamOptimizer`` add their epsilon to
    ``sqrt(v)`` before the bias correction: equal when theirs is ``eps sqrt(1 - b2^k)``, which moves with ``k``.
    """
    eps = {float(g.get("eps", 1e-8)) for g in state.groups}
    if len(eps) > 1:
        raise InvalidArgumentError(f"the torch run's param groups have eps {sorted(eps)}; one Keras epsilon carries one")
    torch_eps = eps.pop()
    fixed = torch_eps * math.sqrt(1.0 - beta2 ** (steps + 1))
    drift = 0.0
    for k in range(steps + 1, steps + 1 + ahead):
        wanted = torch_eps * math.sqrt(1.0 - beta2 ** k)
        drift = max(drift, abs(fixed - wanted) / (root * math.sqrt(1.0 - beta2 ** k) + wanted))
    return torch_eps, fixed, drift


AHEAD = 100  # how far ahead an epsilon drift is measured


def epsilon_hat_notes(state: TorchState, beta2: float, steps: int, root: float, target: str) -> tuple:
    """``(epsilon hat, setting, difference)`` for Adam state carried from torch into ``target`` ('Keras', 'TF1'),
    an optimizer that adds its epsilon to ``sqrt(v)``: the epsilon set (:func:`keras_epsilon`), and the report's
    notes of it and of its drift over the next :data:`AHEAD` steps."""
    eps, hat, drift = keras_epsilon(state, beta2, steps, root, AHEAD)
    setting = OptimizerNote("epsilon", f"{eps:.4g} (torch's) -> {hat:.4g}: torch adds eps to the bias-corrected "
                                       f"sqrt(v_hat), {target} to sqrt(v) ('epsilon hat'); equal at step {steps + 1}")
    difference = OptimizerNote("epsilon", f"torch's eps sqrt(1-beta2^k) moves with the step k, {target}'s epsilon "
                                          f"stays: over the next {AHEAD} steps the update's denominator differs by up "
                                          f"to {drift:.2g} (relative, at the median sqrt(v_hat))", drift)
    return hat, setting, difference
