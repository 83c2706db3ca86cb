"""``scan(..., optimizer=opt)``: each parameter's optimizer state paired through its weight's record, planned.

A slot goes where its weight goes: the record that paired ``fc1/kernel`` with the module's
``fc1.weight`` (by name, rule set or ``layout='torch'``) is the one that finds
``fc1/kernel/Adam`` and puts it through the same names-and-axes steps (``source.like``). A
parameter whose weight is missing, mismatched, restored through a policy or not restored
keeps fresh state, and the report's optimizer section says why. Hyper-parameters are set
and differences measured by ``_convert``; ``_torch`` writes the state at restore.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from restorekit._optim import _convert as convert
from restorekit._optim._common import BERT, Scratch, held_kinds, slot_reader, source_state, source_label as _source_label, steps_of, trained_keys, weight_status, why_reset
from restorekit._optim._keras import is_keras_optimizer, with_keras_optimizer
from restorekit._optim._optax import is_optax_optimizer, with_optax_optimizer
from restorekit._report import OptimizerNote, OptimizerRecord, OptimizerSection, format_shape
from restorekit._torch_target import is_torch_module, module_items
from restorekit.errors import InvalidArgumentError

__all__ = ["OptimizerPlan", "with_optimizer"]

# torch.optim class -> the TF1 optimizer whose slots it takes
TARGETS = {"Adam": "Adam", "AdamW": "Adam", "SGD": "Momentum", "RMSprop": "RMSProp", "Adagrad": "Adagrad"}
# what the refusals name: each torch.optim class and the TF1 state it takes
CHOICES = {**TARGETS, "AdamW (for BERT's AdamWeightDecayOptimizer)": BERT}
# How far ahead the Adam epsilon drift is measured.
AHEAD = 100


@dataclass
class Carry:
    """One parameter whose state is carried: ``read()`` gives its torch state (numpy arrays and floats)."""

    param: object
    name: str | None
    read: Callable[[], dict]


@dataclass
class OptimizerPlan:
    """The live half of a report's optimizer section: what ``restore`` writes into which optimizer."""

    optimizer: object
    kind: str  # the torch.optim class name
    carries: list = field(default_factory=list)
    resets: list = field(default_factory=list)  # parameters whose state starts fresh
    groups: dict = field(default_factory=dict)  # param group index -> {hyper-parameter: value} to set


def _target_kind(optimizer) -> str:
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in TARGETS:
            return cls.__name__
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    raise InvalidArgumentError(
        f"optimizer= takes a torch.optim Adam, AdamW, SGD, RMSprop or Adagrad (or a Keras 3 Adam, AdamW, SGD, "
        f"RMSprop or Adagrad, or an nnx.Optimizer wrapping optax.adam, adamw, sgd or rmsprop); {name} is not supported yet "
        f"(its state would not be carried): scan without optimizer= for a warm start")


def _params(optimizer) -> list:
    """``(group index, parameter)`` for every parameter of ``optimizer``, in its state_dict order."""
    return [(g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]


def with_optimizer(report, variables, optimizer):
    """``report`` with its optimizer section, and the live plan ``restore`` writes (``report._optimizer``).

    Raises:
        InvalidArgumentError: ``optimizer`` is no supported torch.optim optimizer, the target is not a torch
            module, the checkpoint holds another optimizer's state (SGD given Adam slots), or hyper-parameters
            contradict the state (betas that do not fit ``beta1_power``, ``centered`` against the slots).
    """
    if optimizer is None:
        return report
    if is_keras_optimizer(optimizer):
        return with_keras_optimizer(report, variables, optimizer)
    if is_optax_optimizer(optimizer):
        return with_optax_optimizer(report, variables, optimizer)
    kind = _target_kind(optimizer)
    if report.sources or not is_torch_module(variables):
        raise InvalidArgumentError("optimizer= carries TF1 optimizer state into the torch.optim optimizer of one "
                                   "torch.nn.Module scanned from one checkpoint; other targets are not supported yet")
    source = report._source
    checkpoint = getattr(source, "checkpoint", source)  # a view's own checkpoint: slots are read as stored
    wanted = TARGETS[kind]
    groups = optimizer.param_groups
    names = {id(t): key for key, _, _, t in module_items(variables)}
    state = source_state(checkpoint, wanted, momentum=any(g.get("momentum", 0) for g in groups),
                         centered=any(g.get("centered") for g in groups),
                         order=lambda: trained_keys(report, checkpoint, [names.get(id(p)) for _, p in _params(optimizer)]))
    if wanted == "Adam" and state.kinds.get(BERT):
        wanted = BERT  # BERT's adam_m / adam_v: Adam's moments without bias correction
    held_kinds(state, wanted, into="torch.optim", target=f"torch.optim.{kind}", choices=CHOICES,
               amsgrad=any(g.get("amsgrad") for g in groups))
    plan = OptimizerPlan(optimizer, kind)
    notes: list = []
    if not state.kinds:
        if kind == "SGD" and all(g.get("momentum", 0) == 0 for g in groups):
            return replace(report, optimizer=OptimizerSection(f"torch.optim.{kind}", f"no optimizer state ({state.label})"),
                           _optimizer=plan)
    if kind == "SGD" and state.kinds and any(g.get("momentum", 0) == 0 for g in groups):
        raise InvalidArgumentError("the checkpoint holds Momentum slots; torch.optim.SGD(momentum=0) keeps no buffer "
                                   "to carry them: pass the TF run's momentum")
    if kind == "RMSprop" and state.kinds and any(bool(g.get("centered")) != state.centered for g in groups):
        raise InvalidArgumentError(f"the checkpoint's RMSProp slots are {'' if state.centered else 'not '}centered "
                                   f"(3 slots per variable are); pass RMSprop(centered={state.centered})")
    steps, step_from = steps_of(state, kind in ("Adam", "AdamW"), [g.get("betas", (0.9, 0.999)) for g in groups], notes)
    status = weight_status(report)
    matched = {r.variable_name: r for r in report.matched}
    carried: list = []
    reset: list = []
    stats: dict = {}
    scratch = Scratch()
    for g, param in _params(optimizer):
        name = names.get(id(param))
        why = why_reset(name, status, matched, state)
        if why is None:
            record, read, values, why = _carry(source, checkpoint, matched[name], param, state, wanted, kind, groups[g],
                                               steps, scratch)
        if why is not None:
            plan.resets.append(param)
            reset.append(OptimizerRecord(name or f"param_groups[{g}] parameter {len(reset)}", reason=why[1], how=why[0]))
            continue
        stats.setdefault(g, []).append(values)
        plan.carries.append(Carry(param, name, read))
        carried.append(record)
    settings, differences = _settings(plan, kind, state, groups, stats, steps)
    section = OptimizerSection(f"torch.optim.{kind}", _source_label(state, wanted), steps, step_from, tuple(carried),
                               tuple(reset), tuple(notes) + settings, differences)
    return replace(report, optimizer=section, _optimizer=plan)


def _carry(source, checkpoint, record, param, state, wanted, kind, group, steps, scratch):
    """``(OptimizerRecord, read, its values now, None)`` for a parameter whose slots are carried, or
    ``(None, None, None, (how, why))``."""
    slots, read_slots = slot_reader(source, checkpoint, record, state, wanted, scratch=scratch)
    if slots is None:
        return None, None, None, read_slots

    def read() -> dict:
        found = read_slots()
        return {} if found is None else _convert(kind, found, group, steps)

    values = read()
    if not values:
        base = record.stored_name or record.checkpoint_name
        return None, None, None, ("view", f"{record.checkpoint_name!r} is computed by the view, not a plain image of {base!r}")
    target = tuple(param.shape)
    arrays = {k: v for k, v in values.items() if isinstance(v, np.ndarray)}
    if any(tuple(a.shape) != target for a in arrays.values()):
        return None, None, None, ("slot_shape", f"its slots become {format_shape(next(iter(arrays.values())).shape)} through the "
                                    f"view, the parameter is {format_shape(target)}")
    return OptimizerRecord(record.variable_name, tuple(slots.values()), tuple(values)), read, values, None


def _convert(kind: str, slots: dict, group, steps: int) -> dict:
    if kind in ("Adam", "AdamW"):
        return convert.to_adam(slots["m"], slots["v"], steps, slots.get("vhat"))
    if kind == "SGD":
        return convert.to_sgd(slots["a"])
    if kind == "RMSprop":
        return convert.to_rmsprop(slots["ms"], slots["mom"], slots["mg"], lr=float(group["lr"]),
                                  momentum=float(group["momentum"]), steps=steps)
    return convert.to_adagrad(slots["acc"], steps)


def _settings(plan, kind: str, state, groups, stats: dict, steps) -> tuple:
    """The hyper-parameters set per group, and the differences left, with their sizes."""
    settings, differences = [], []
    for g, group in enumerate(groups):
        values = stats.get(g, [])
        where = f" (param group {g})" if len(groups) > 1 else ""
        if kind in ("Adam", "AdamW") and values and state.kinds.get(BERT):
            settings.append(OptimizerNote("eps", f"{float(group['eps']):.4g} kept{where}: BERT adds epsilon to sqrt(v) "
                                                 f"as torch does once its bias corrections are 1"))
            decay = float(group.get("weight_decay", 0) or 0)
            settings.append(OptimizerNote("weight_decay", f"{decay:g}{where}: " + (
                "decoupled, as BERT's weight_decay_rate (the checkpoint does not keep it): give each group the "
                "source run's rate, 0 where it excluded parameters (LayerNorm, bias)" if kind == "AdamW" else
                "torch.optim.Adam decays coupled; BERT's weight_decay_rate is decoupled: use AdamW")))
        elif kind in ("Adam", "AdamW") and values:
            eps, beta2 = float(group["eps"]), float(group["betas"][1])
            new = convert.adam_epsilon(eps, beta2, steps)
            plan.groups.setdefault(g, {})["eps"] = new
            settings.append(OptimizerNote("eps", f"{eps:.4g} -> {new:.4g}{where}: TF1 Adam adds epsilon to sqrt(v) "
                                                 f"before bias correction ('epsilon hat'); equal at step {steps + 1}"))
            root = float(np.median([np.median(np.sqrt(v["exp_avg_sq"] / (1 - beta2 ** (steps + 1)))) for v in values]))
            drift = convert.adam_epsilon_drift(eps, beta2, steps, AHEAD, root)
            differences.append(OptimizerNote("eps", f"TF's epsilon hat eps/sqrt(1-beta2^k) moves with the step k, "
                                                    f"torch's eps stays: over the next {AHEAD} steps the update's "
                                                    f"denominator differs by up to {drift:.2g} (relative, at the median "
                                                    f"sqrt(v_hat)){where}", drift))
        if kind == "RMSprop" and values:
            eps = float(group["eps"])
            squares = [v["square_avg"] - (v["grad_avg"] ** 2 if "grad_avg" in v else 0) for v in values]
            new = convert.rmsprop_epsilon(eps, min(float(np.min(s)) for s in squares))
            error = max(convert.rmsprop_epsilon_error(eps, new, s) for s in squares)
            plan.groups.setdefault(g, {})["eps"] = new
            settings.append(OptimizerNote("eps", f"{eps:.4g} -> {new:.4g}{where}: TF1 RMSProp adds epsilon inside the "
                                                 f"square root, torch outside; equal at the smallest mean square"))
            differences.append(OptimizerNote("eps", f"the denominators sqrt(ms + eps) and sqrt(ms) + eps' differ by up "
                                                    f"to {error:.2g} (relative) over the carried state{where}", error))
            if float(group["momentum"]) == 0 and state.kinds:
                settings.append(OptimizerNote("momentum", f"0{where}: TF1's momentum slot is not read (with momentum "
                                                          f"0 TF overwrites it every step)"))
        if kind == "Adagrad":
            eps = float(group["eps"])
            if values and state.epsilon_outside:
                settings.append(OptimizerNote("eps", f"kept {eps:.4g}{where}: Keras 2 Adagrad adds its epsilon "
                                                     f"outside the root, as torch does (give the run's; tf-keras' "
                                                     f"default is 1e-07)"))
            elif values and (float(group["initial_accumulator_value"]) > 0 or len(values) == len(group["params"])):
                plan.groups.setdefault(g, {})["eps"] = 0.0
                settings.append(OptimizerNote("eps", f"{eps:.4g} -> 0{where}: TF1 Adagrad adds no epsilon (its "
                                                     f"accumulator starts above 0)"))
            elif values:
                smallest = min(float(np.min(v["sum"])) for v in values)
                size = eps / max(np.sqrt(smallest), 1e-300)
                differences.append(OptimizerNote("eps", f"torch adds eps {eps:.4g} to sqrt(sum), TF1 nothing: up to "
                                                        f"{size:.2g} (relative){where}", size))
            if float(group.get("lr_decay", 0)):
                differences.append(OptimizerNote("lr_decay", f"{group['lr_decay']}{where}: TF1 Adagrad has no decay "
                                                             f"of the rate; every update differs"))
        differences.extend(_terms_tf1_lacks(kind, group, where, kept_vhat=state.amsgrad,
                                            bert=bool(state.kinds.get(BERT))))
    return tuple(settings), tuple(differences)


def _terms_tf1_lacks(kind: str, group, where: str, *, kept_vhat: bool = False, bert: bool = False) -> list:
    out = []
    decay = float(group.get("weight_decay", 0) or 0)
    if bert and kind == "AdamW":
        pass  # AdamW's decoupled decay is BERT's weight_decay_rate term: the update is the same
    elif decay:
        how = ("decoupled: p *= 1 - lr*weight_decay" if kind == "AdamW"
               else "coupled: weight_decay*p added to the gradient")
        out.append(OptimizerNote("weight_decay", f"{decay:g}{where} ({how}): the TF1 optimizer has no such term; "
                                                 f"the updates equal TF's only where the TF loss had the same decay",
                                 decay))
    if group.get("maximize"):
        out.append(OptimizerNote("maximize", f"True{where}: TF1 minimizes; every update has the other sign"))
    if group.get("amsgrad") and not kept_vhat:
        out.append(OptimizerNote("amsgrad", f"True{where}: TF1 Adam keeps no maximum of v; max_exp_avg_sq starts "
                                            f"at exp_avg_sq and the updates differ once v falls"))
    dampening = float(group.get("dampening", 0) or 0)
    if dampening:
        out.append(OptimizerNote("dampening", f"{dampening:g}{where}: TF1 Momentum adds the whole gradient; torch "
                                              f"adds (1 - dampening) of it, so its buffer and updates shrink towards "
                                              f"{1 - dampening:g} of TF's", dampening))
    return out
