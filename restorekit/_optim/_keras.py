"""Keras 3 optimizers as targets (TensorFlow, JAX or torch backend): slots planned at scan, assigned at restore.

Each model variable's slots are paired through its weight's record, as for ``torch.optim``
(``_common``), and written with ``Variable.assign``, so no backend is imported here. For a
gradient ``g`` at step ``k = iterations + 1``, Keras 3 updates as TF1 does, up to where each
keeps the learning rate:

| TF1 / Keras 3 source (in TF1's terms) | Keras 3 target | state written | exact? |
| --- | --- | --- | --- |
| Adam ``m``, ``v``, ``t`` steps | ``Adam``: ``var -= lr sqrt(1-b2^k)/(1-b1^k) m / (sqrt(v) + eps)``: TF1's update, epsilon hat included | ``momentum = m``, ``velocity = v``, ``iterations = t`` | exact |
| Keras 2 Adam(amsgrad) ``vhat`` | ``Adam(amsgrad=True)``: ``v_hat = max(v_hat, v)`` read for ``v`` | ``velocity_hat = vhat`` | exact |
| Momentum ``a`` (``a = mu a + g``, ``var -= lr a``) | ``SGD(momentum=mu)``: ``m = mu m - lr g``, ``var += m`` (nesterov: ``var += mu m - lr g``) | ``momentum = -lr a`` | exact while ``lr`` stays |
| RMSProp ``ms``, ``mg``, ``mom`` | ``RMSprop(rho, momentum, centered)``: ``sqrt(ms - mg^2 + eps)`` inside the root, the rate inside ``mom``, as TF1 | ``velocity = ms``, ``average_gradient = mg``, ``momentum = mom`` | exact |
| Adagrad ``acc`` | ``Adagrad``: ``acc += g^2``, ``var -= lr g / sqrt(acc + eps)`` (TF1: no eps; Keras 2: ``sqrt(acc) + eps``) | ``accumulator = acc`` | exact with ``epsilon=0`` from TF1; else the difference is reported with its size |

A Keras term no TF1 optimizer has (``weight_decay``, clipping, ``use_ema``, gradient
accumulation) is reported as a difference when the source is TF1, never changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from restorekit._optim._common import held_kinds, slot_reader, source_label, source_state, steps_of, trained_keys, weight_status, why_reset
from restorekit._optim._torch_state import TorchState, check_groups, epsilon_hat_notes
from restorekit._report import OptimizerNote, OptimizerRecord, OptimizerSection, format_shape
from restorekit.errors import InvalidArgumentError

__all__ = ["KerasPlan", "is_keras_optimizer", "load", "read", "with_keras_optimizer"]

# Keras 3 optimizer class -> the TF1 optimizer whose state it takes
TARGETS = {"Adam": "Adam", "AdamW": "Adam", "SGD": "Momentum", "RMSprop": "RMSProp", "Adagrad": "Adagrad"}
# Keras 3 slot name -> the optimizer's own list of it. Keras has no public map from a model variable to its
# slots; each optimizer keeps one list per slot name, indexed by _get_variable_index (base_optimizer.py).
_LISTS = {"Adam": {"momentum": "_momentums", "velocity": "_velocities", "velocity_hat": "_velocity_hats"},
          "SGD": {"momentum": "momentums"},
          "RMSprop": {"velocity": "_velocities", "momentum": "_momentums", "average_gradient": "_average_gradients"},
          "Adagrad": {"accumulator": "_accumulators"}}
_TERMS = ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "use_ema", "gradient_accumulation_steps")


@dataclass
class KerasPlan:
    """The live half of a report's optimizer section for a Keras 3 optimizer: what ``restore`` assigns."""

    optimizer: Any  # a live keras.optimizers.Optimizer
    kind: str  # the Keras class name
    variables: list  # the model's trainable variables: what the optimizer is built on
    carries: list = field(default_factory=list)  # (variable, read): read() gives {slot name: array}
    resets: list = field(default_factory=list)  # variables whose slots start at zero
    steps: int | None = None
    epsilon: float | None = None  # set where the source adds epsilon elsewhere (torch's Adam)


def is_keras_optimizer(optimizer) -> bool:
    """True for a Keras 3 optimizer (any backend)."""
    return any(cls.__module__.startswith("keras.") and cls.__name__ == "BaseOptimizer" for cls in type(optimizer).__mro__)


def _kind(optimizer) -> str:
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("keras.src.optimizers") and cls.__name__ in TARGETS:
            return cls.__name__
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    raise InvalidArgumentError(
        f"optimizer= takes a Keras 3 Adam, AdamW, SGD, RMSprop or Adagrad; {name} is not supported yet (its state "
        f"would not be carried): scan without optimizer= for a warm start")


def _number(value) -> float:
    return float(np.asarray(value.numpy() if hasattr(value, "numpy") else value))


def _trainable(variables, optimizer) -> list:
    found = getattr(variables, "trainable_variables", None)
    if found is None:
        found = [v for v in (variables if isinstance(variables, (list, tuple)) else []) if getattr(v, "trainable", False)]
    found = list(found)
    if not found or not all(isinstance(getattr(v, "path", None), str) for v in found):
        raise InvalidArgumentError("optimizer= with a Keras 3 optimizer carries its state into a Keras 3 model (or "
                                   "a list of its variables) with trainable variables; this target has none")
    built = getattr(optimizer, "_trainable_variables", None) if getattr(optimizer, "built", False) else None
    if built is not None and [id(v) for v in built] != [id(v) for v in found]:
        raise InvalidArgumentError(f"the optimizer is built for {len(built)} other variables than the model's "
                                   f"{len(found)} trainable ones: pass a fresh optimizer or the model it was built for")
    return found


def _check(optimizer, kind: str, wanted: str, state) -> None:
    held = held_kinds(state, wanted, into="Keras", target=f"keras.optimizers.{kind}", choices=TARGETS,
                      amsgrad=bool(getattr(optimizer, "amsgrad", False)))
    if kind == "SGD" and held and not optimizer.momentum:
        raise InvalidArgumentError("the checkpoint holds Momentum slots; keras.optimizers.SGD(momentum=0) keeps no "
                                   "momentum to carry them: pass the source run's momentum")
    if kind == "RMSprop" and held and bool(optimizer.centered) != state.centered:
        raise InvalidArgumentError(f"the checkpoint's RMSProp slots are {'' if state.centered else 'not '}centered; "
                                   f"pass RMSprop(centered={state.centered})")
    if getattr(optimizer, "amsgrad", False) and not state.amsgrad:
        raise InvalidArgumentError("keras.optimizers.Adam(amsgrad=True) takes the maximum of v (velocity_hat), which "
                                   "only a Keras 2 Adam(amsgrad=True) source keeps: pass amsgrad=False or scan "
                                   "without optimizer=")


def _to_keras(kind: str, slots: dict, lr: float, momentum: bool) -> dict:
    """Slots in TF1's terms (``_common.roles``) -> the Keras 3 optimizer's slot values."""
    if kind in ("Adam", "AdamW"):
        return {"momentum": slots["m"], "velocity": slots["v"], **({"velocity_hat": slots["vhat"]} if "vhat" in slots
                                                                    else {})}
    if kind == "SGD":
        a = slots["a"]
        return {"momentum": (a * np.asarray(-lr, a.dtype)).astype(a.dtype)}
    if kind == "Adagrad":
        return {"accumulator": slots["acc"]}
    out = {"velocity": slots["ms"]}
    if slots.get("mg") is not None:
        out["average_gradient"] = slots["mg"]
    if momentum and slots.get("mom") is not None:
        out["momentum"] = slots["mom"]
    return out


def with_keras_optimizer(report, variables, optimizer):
    """``report`` with its optimizer section for a Keras 3 optimizer, and the plan ``restore`` assigns.

    Raises:
        InvalidArgumentError: an optimizer not supported yet, several sources, a target without trainable Keras
            variables, another optimizer's state, or hyper-parameters that contradict it.
    """
    kind = _kind(optimizer)
    if report.sources:
        raise InvalidArgumentError("optimizer= carries the optimizer state of one checkpoint; scan several sources "
                                   "without it")
    wanted = TARGETS[kind]
    trainable = _trainable(variables, optimizer)
    paths = [v.path for v in trainable]
    source = report._source
    checkpoint = getattr(source, "checkpoint", source)
    momentum = bool(getattr(optimizer, "momentum", 0))
    state = source_state(checkpoint, wanted, momentum=momentum, centered=bool(getattr(optimizer, "centered", False)),
                         order=lambda: trained_keys(report, checkpoint, paths))
    _check(optimizer, kind, wanted, state)
    notes: list = []
    betas = [(optimizer.beta_1, optimizer.beta_2)] if wanted == "Adam" else []
    steps, step_from = steps_of(state, wanted == "Adam", betas, notes)
    lr = _number(optimizer.learning_rate)
    plan = KerasPlan(optimizer, kind, trainable, steps=steps)
    roots: list = []
    status = weight_status(report)
    matched = {r.variable_name: r for r in report.matched}
    carried: list = []
    reset: list = []
    smallest: list = []  # Adagrad: each carried accumulator's smallest value, where the epsilon matters most
    for variable in trainable:
        name = variable.path
        why = why_reset(name, status, matched, state)
        slots = None
        if why is None:
            slots, found = slot_reader(source, checkpoint, matched[name], state, wanted)
            why = found if slots is None else None
        if why is None:
            values = found()
            if values is not None and "v" in values and steps is not None:
                roots.append(float(np.median(np.sqrt(values["v"] / (1 - float(optimizer.beta_2) ** (steps + 1))))))
            if values is None:
                why = ("view", f"{matched[name].checkpoint_name!r} is computed by the view, not a stored weight")
            else:
                written = _to_keras(kind, values, lr, momentum)
                if kind == "Adagrad":
                    smallest.append(float(np.min(written["accumulator"])))
                shapes = {tuple(a.shape) for a in written.values()}
                if shapes != {tuple(variable.shape)}:
                    why = ("slot_shape", f"its slots are {format_shape(next(iter(shapes)))}, the variable is "
                                         f"{format_shape(tuple(variable.shape))}")
        if why is not None:
            plan.resets.append(variable)
            reset.append(OptimizerRecord(name, reason=why[1], how=why[0]))
            continue
        plan.carries.append((variable, lambda found=found: _to_keras(kind, found(), lr, momentum)))
        carried.append(OptimizerRecord(name, tuple((slots or {}).values()), tuple(written) + ("iterations",)))
    settings, differences = _notes(optimizer, kind, state, steps, lr, reset)
    if kind == "Adagrad" and smallest:
        differences += (_adagrad_epsilon(float(optimizer.epsilon), min(smallest), state),)
    if isinstance(state, TorchState) and state.kinds:
        more = _from_torch(plan, optimizer, wanted, state, steps, roots)
        settings, differences = settings + more[0], differences + more[1]
    label = f"keras.optimizers.{kind} ({_backend(trainable[0])})"
    section = OptimizerSection(label, source_label(state, wanted), steps, step_from, tuple(carried), tuple(reset),
                               tuple(notes) + settings, differences)
    return replace(report, optimizer=section, _optimizer=plan)


def _backend(variable) -> str:
    from restorekit._trackables import keras_backend

    return keras_backend(variable)


def _from_torch(plan, optimizer, wanted: str, state, steps, roots: list) -> tuple:
    """A torch optimizer's state into Keras: the source's hyper-parameters checked, Adam's epsilon moved."""
    betas = (optimizer.beta_1, optimizer.beta_2) if wanted == "Adam" else None
    terms = check_groups(state, wanted, betas=betas, nesterov=getattr(optimizer, "nesterov", None))
    settings, differences = [], [OptimizerNote(what, text, size) for what, text, size in terms]
    if wanted == "Adam" and steps is not None and roots:
        plan.epsilon, setting, difference = epsilon_hat_notes(state, float(optimizer.beta_2), steps,
                                                              float(np.median(roots)), "Keras")
        settings.append(setting)
        differences.append(difference)
    return tuple(settings), tuple(differences)


def _notes(optimizer, kind: str, state, steps, lr: float, reset: list) -> tuple:
    settings, differences = [], []
    tf1 = state.label == "TF1"
    if kind in ("Adam", "AdamW") and not isinstance(state, TorchState):
        settings.append(OptimizerNote("epsilon", "kept: Keras 3 Adam adds epsilon after the bias correction of the "
                                                 "rate, as TF1 ('epsilon hat'): the same update at every step"))
        if reset and steps:
            b1, b2, k = float(optimizer.beta_1), float(optimizer.beta_2), steps + 1
            factor = (1 - b1) / (1 - b1 ** k) * (1 - b2 ** k) ** 0.5 / (1 - b2) ** 0.5
            differences.append(OptimizerNote(
                "iterations", f"one counter for every variable: the {len(reset)} reset variable(s) start from zero "
                              f"slots but their bias correction reads iterations = {steps}, so their first update is "
                              f"{factor:.3g} times a fresh Adam's", factor))
    if kind == "SGD" and state.kinds:
        source = (f"the source's momentum / -{state.rate:g} (its learning_rate)" if getattr(state, "rate", None)
                  else "TF1's Momentum slot")
        settings.append(OptimizerNote("momentum", f"-lr*a with the optimizer's learning_rate {lr:g}: Keras keeps the "
                                                  f"rate inside its momentum; a is {source}"))
    if kind == "RMSprop" and not optimizer.momentum and tf1 and state.kinds:
        settings.append(OptimizerNote("momentum", "0: TF1's momentum slot is not read (with momentum 0 TF "
                                                  "overwrites it every step)"))
    if tf1:
        for term in _TERMS:
            value = getattr(optimizer, term, None)
            if value:
                differences.append(OptimizerNote(term, f"{value}: the TF1 optimizer has no such term; the updates "
                                                       f"equal TF's only where the TF run had the same", float(value)))
    return tuple(settings), tuple(differences)


def _adagrad_epsilon(epsilon: float, smallest: float, state) -> OptimizerNote:
    """Keras 3 Adagrad divides by ``sqrt(acc + epsilon)``; TF1 by ``sqrt(acc)``, Keras 2 by ``sqrt(acc) + epsilon``
    (its own, taken as this one): how far apart, at the smallest accumulator carried (where they differ most)."""
    inside = np.sqrt(np.float64(smallest) + epsilon)
    source = np.sqrt(np.float64(smallest)) + (epsilon if state.epsilon_outside else 0.0)
    size = float(abs(inside - source) / inside)
    how = "Keras 2 adds it outside the root" if state.epsilon_outside else "TF1 adds none (epsilon=0 makes it exact)"
    return OptimizerNote("epsilon", f"Keras 3 Adagrad adds epsilon {epsilon:g} inside the root, {how}: the "
                                    f"denominators differ by up to {size:.2g} (relative) over the carried state", size)


def read(plan) -> list:
    """Every carried variable's slot values (numpy), read and checked before anything is assigned."""
    if not isinstance(plan, KerasPlan):
        return []
    return [(variable, read_slots()) for variable, read_slots in plan.carries]


def load(plan, values: list) -> None:
    """Build the plan's optimizer on the model's trainable variables if it is not, then assign ``values`` (from
    :func:`read`), zeros to the reset variables' slots and ``iterations``."""
    if not isinstance(plan, KerasPlan):
        return
    optimizer = plan.optimizer
    if not optimizer.built:
        optimizer.build(plan.variables)
    lists = {name: getattr(optimizer, attr, None) or [] for name, attr in _LISTS["Adam" if plan.kind == "AdamW"
                                                                             else plan.kind].items()}

    def slot(name, variable):
        found = lists[name]
        return found[optimizer._get_variable_index(variable)] if found else None

    for variable, slots in values:
        for name, value in slots.items():
            target = slot(name, variable)
            if target is not None:
                target.assign(value.reshape(tuple(target.shape)))
    for variable in plan.resets:
        for name in lists:
            target = slot(name, variable)
            if target is not None:
                fresh = float(optimizer.initial_accumulator_value) if plan.kind == "Adagrad" else 0.0  # as build
                target.assign(np.full(tuple(target.shape), fresh, np.dtype(str(getattr(target, "dtype", "float32")))))
    if plan.epsilon is not None:
        optimizer.epsilon = plan.epsilon
    if plan.steps is not None:
        optimizer.iterations.assign(plan.steps)
