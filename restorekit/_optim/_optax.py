"""optax state of a Flax NNX ``nnx.Optimizer`` as a target: TF1 (or Keras 3) slots planned at scan, set at restore.

The optimizer's ``tx`` is read as the chain of optax transforms it is (``optax.adam`` is
``scale_by_adam`` then ``scale``), each with the hyper-parameters it closes over; a chain
that is none of the four below is refused by name before anything is written. For a gradient
``g`` at step ``k = t + 1`` after ``t`` steps:

| TF1 source (in TF1's terms) | optax target | state written | exact? |
| --- | --- | --- | --- |
| Adam ``m``, ``v``, ``t`` steps: ``var -= lr m_hat / (sqrt(v_hat) + eps/sqrt(1-b2^k))`` | ``optax.adam``/``adamw``: ``p -= lr m_hat / (sqrt(v_hat + eps_root) + eps)`` | ``mu = m``, ``nu = v``, ``count = t`` | TF's 'epsilon hat' moves with ``k``, optax's ``eps`` stays (``eps_root`` is inside the root and cannot make it up): the drift is reported |
| Momentum ``a``: ``a = mu a + g``, ``var -= lr a`` (nesterov: ``var -= lr (g + mu a)``) | ``optax.sgd(momentum=mu, nesterov=...)``: ``trace = mu trace + g``, ``p -= lr trace`` | ``trace = a`` | exact |
| RMSProp ``ms``, ``mg``, ``mom``: ``mom = mu mom + lr g / sqrt(ms - mg^2 + eps)``, ``var -= mom`` | ``optax.rmsprop(decay, eps, eps_in_sqrt=True, centered, momentum=mu)``: ``trace = mu trace - lr g / sqrt(nu - mu_g^2 + eps)``, ``p += trace`` | ``nu = ms``, ``mu = mg`` (centered), ``trace = -mom`` | exact (``eps_in_sqrt=False`` differs by the size reported) |

One ``count`` serves every parameter, as ``nnx.Optimizer.step`` does; both are set to ``t``.
jax, flax and optax are imported only inside the functions that read or write a live optimizer.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from restorekit._flax_target import module_variables, variable_name
from restorekit._optim._common import held_kinds, slot_reader, source_label, source_state, steps_of, trained_keys, weight_status, why_reset
from restorekit._optim._torch_state import TorchState, check_groups
from restorekit._report import OptimizerNote, OptimizerRecord, OptimizerSection, format_shape
from restorekit.errors import InvalidArgumentError

__all__ = ["OptaxPlan", "is_optax_optimizer", "load", "read", "with_optax_optimizer"]

# How far ahead the Adam epsilon drift is measured (as for torch.optim).
AHEAD = 100
_RATE = ("scale", "scale_by_learning_rate", "scale_by_schedule")
_STATES: dict[str, dict[str, tuple]] = {"adam": {"mu": ("ScaleByAdamState", "mu"), "nu": ("ScaleByAdamState", "nu")},
           "sgd": {"trace": ("TraceState", "trace")},
           "rmsprop": {"nu": (("ScaleByRmsState", "ScaleByRStdDevState"), "nu"), "mu": ("ScaleByRStdDevState", "mu"),
                       "trace": ("TraceState", "trace")}}
WANTED = {"adam": "Adam", "sgd": "Momentum", "rmsprop": "RMSProp"}


@dataclass
class OptaxPlan:
    """The live half of a report's optimizer section for an ``nnx.Optimizer``: what ``restore`` sets."""

    optimizer: Any  # a live flax.nnx.Optimizer
    kind: str  # 'adam', 'sgd' or 'rmsprop'
    leaves: dict  # parameter name -> {state name: its live OptVariable}
    carries: list = field(default_factory=list)  # (name, read): read() gives {state name: array}
    resets: list = field(default_factory=list)  # (name, {state name: fresh value})
    steps: int | None = None


def is_optax_optimizer(optimizer) -> bool:
    """True for a Flax NNX ``nnx.Optimizer`` (its classes checked: flax is not imported)."""
    return any(c.__name__ == "Optimizer" and c.__module__.startswith("flax.nnx") for c in type(optimizer).__mro__)


def _parts(update) -> list:
    """``[(transform name, its hyper-parameters)]``: an optax chain's ``update`` read through its closures."""
    found = inspect.getclosurevars(update).nonlocals
    if "update_fns" in found:  # optax.chain
        return [p for f in found["update_fns"] for p in _parts(f)]
    if set(found) == {"tx"} and hasattr(found["tx"], "update"):  # with_extra_args_support
        return _parts(found["tx"].update)
    name = getattr(update, "__qualname__", type(update).__name__).split(".<locals>")[0]
    return [(name, {k: v for k, v in found.items() if not callable(v)})]


def _chain(tx) -> tuple:
    """``(kind, {transform name: hyper-parameters})`` of a supported optax chain.

    Raises:
        InvalidArgumentError: a chain that is not optax.adam, adamw, sgd or rmsprop, named by its transforms.
    """
    parts = _parts(tx.update)
    names = [n for n, _ in parts]
    params = {n: p for n, p in parts}
    kind = None
    if len(names) in (2, 3) and names[-1] in _RATE and names[0] == "scale_by_adam" and names[1:-1] in ([], ["add_decayed_weights"]):
        kind = "adam"
    elif len(names) == 2 and names[0] in ("trace", "identity") and names[1] in _RATE:
        kind = "sgd"
    elif (len(names) == 3 and names[0] in ("scale_by_rms", "scale_by_stddev") and names[1] in _RATE
          and names[2] in ("trace", "identity")):
        kind = "rmsprop"
    if kind is None:
        raise InvalidArgumentError(
            f"optimizer= takes an nnx.Optimizer wrapping optax.adam, adamw, sgd or rmsprop; its tx is the chain "
            f"{' -> '.join(names) or type(tx).__name__}, which is not supported yet (its state would not be "
            f"carried): scan without optimizer= for a warm start")
    if kind == "adam" and params["scale_by_adam"].get("nesterov"):
        raise InvalidArgumentError("optax.nadam (scale_by_adam(nesterov=True)) is not TF1 Adam; carrying Adam slots "
                                   "into it is not supported: pass optax.adam, or scan without optimizer=")
    if kind == "rmsprop" and params[names[0]].get("bias_correction"):
        raise InvalidArgumentError("optax.rmsprop(bias_correction=True) corrects by a count TF1 RMSProp never kept: "
                                   "pass bias_correction=False (TF1's rule), or scan without optimizer=")
    return kind, params


def _state_leaves(optimizer, kind: str) -> dict:
    """parameter name -> {state name: live OptVariable}, and ``'count'`` -> the Adam count, from ``opt_state``."""
    from flax import nnx

    states = optimizer.opt_state if isinstance(optimizer.opt_state, tuple) else (optimizer.opt_state,)
    by_type: dict = {}
    for s in states:
        by_type.setdefault(type(s).__name__, s)
    leaves: dict = {}
    for what, (types, attr) in _STATES[kind].items():
        names = (types,) if isinstance(types, str) else types
        state = next((by_type[t] for t in names if t in by_type), None)
        if state is None:
            continue
        for path, leaf in nnx.to_flat_state(getattr(state, attr)):
            leaves.setdefault(variable_name(path), {})[what] = leaf
    return leaves


def with_optax_optimizer(report, variables, optimizer):
    """``report`` with its optimizer section for an ``nnx.Optimizer`` wrapping optax, and the plan ``restore`` sets.

    Raises:
        InvalidArgumentError: an optax chain not supported yet, several sources, a target that is not the Flax NNX
            module the optimizer was built on, another optimizer's state, or hyper-parameters that contradict it.
    """
    from restorekit._flax_target import is_flax_module

    kind, params = _chain(optimizer.tx)
    if report.sources or not is_flax_module(variables):
        raise InvalidArgumentError("optimizer= with an nnx.Optimizer carries the optimizer state of one checkpoint "
                                   "into the Flax NNX module it was built on; scan that module from one source")
    wanted = WANTED[kind]
    leaves = _state_leaves(optimizer, kind)
    params_of = {name: v for name, v, _ in module_variables(variables, params_only=True)}
    strangers = sorted(set(leaves) - set(params_of))
    if strangers:
        raise InvalidArgumentError(f"the optimizer's state is for {strangers[:3]!r}, which the module has no "
                                   f"parameter of: pass the module the nnx.Optimizer was built on")
    centered = "scale_by_stddev" in params
    momentum = kind == "sgd" and "trace" in params or kind == "rmsprop" and "trace" in params
    source = report._source
    checkpoint = getattr(source, "checkpoint", source)
    order = [n for n in params_of if n in leaves]
    state = source_state(checkpoint, wanted, momentum=momentum, centered=centered,
                         order=lambda: trained_keys(report, checkpoint, order))
    _check(kind, wanted, state, momentum, centered)
    from_torch = False
    terms = []
    if isinstance(state, TorchState) and state.kinds:  # torch's own hyper-parameters, checked against the chain's
        from_torch = True
        adam_params = params.get("scale_by_adam", {})
        terms = check_groups(state, wanted, betas=(adam_params.get("b1", 0.9), adam_params.get("b2", 0.999))
                             if kind == "adam" else None, nesterov=params.get("trace", {}).get("nesterov"))
    notes: list = []
    adam = params.get("scale_by_adam", {})
    steps, step_from = steps_of(state, kind == "adam", [(adam.get("b1", 0.9), adam.get("b2", 0.999))], notes)
    plan = OptaxPlan(optimizer, kind, leaves, steps=steps)
    status = weight_status(report)
    matched = {r.variable_name: r for r in report.matched}
    carried: list = []
    reset: list = []
    roots: list = []
    lr = _rate(params)
    for name in order:
        why = why_reset(name, status, matched, state)
        found: Any = None
        slots: dict | None = None
        written: dict | None = None
        if why is None:
            slots, found = slot_reader(source, checkpoint, matched[name], state, wanted)
            why = found if slots is None else None
        if why is None:
            values = found()
            written = None if values is None else _to_optax(kind, values, set(leaves[name]))
            if written is None:
                why = ("view", f"{matched[name].checkpoint_name!r} is computed by the view, not a stored weight")
            elif {tuple(a.shape) for a in written.values()} != {tuple(params_of[name].get_value().shape)}:
                why = ("slot_shape", f"its slots are {format_shape(next(iter(written.values())).shape)}, the "
                                     f"parameter is {format_shape(tuple(params_of[name].get_value().shape))}")
        if why is not None:
            plan.resets.append((name, _fresh(kind, params, leaves[name])))
            reset.append(OptimizerRecord(name, reason=why[1], how=why[0]))
            continue
        if kind == "adam" and steps is not None:
            roots.append(float(np.median(np.sqrt(values["v"] / (1 - adam.get("b2", 0.999) ** (steps + 1))))))
        plan.carries.append((name, lambda found=found, have=set(leaves[name]): _to_optax(kind, found(), have)))
        carried.append(OptimizerRecord(name, tuple((slots or {}).values()), tuple(written or {}) + (("count",) if kind == "adam" else ())))
    settings, differences = _notes(kind, params, state, steps, [] if from_torch else roots, reset, lr)
    if from_torch:
        more = _from_torch(kind, params, state, terms)
        settings, differences = settings + more[0], differences + more[1]
    label = f"nnx.Optimizer(optax.{'adamw' if 'add_decayed_weights' in params else kind})"
    section = OptimizerSection(label, source_label(state, wanted), steps, step_from, tuple(carried), tuple(reset),
                               tuple(notes) + settings, differences)
    return replace(report, optimizer=section, _optimizer=plan)


def _from_torch(kind: str, params: dict, state, terms: list) -> tuple:
    """torch's Adam adds eps where optax does (to sqrt(nu_hat)): the same update, where the two eps agree."""
    settings = [OptimizerNote("state", "torch's own update: " + ("exp_avg -> mu, exp_avg_sq -> nu, step -> count"
                                                             if kind == "adam" else "momentum_buffer -> trace"))]
    differences = [OptimizerNote(what, text, size) for what, text, size in terms]
    if kind == "adam":
        p = params["scale_by_adam"]
        torch_eps = {float(g.get("eps", 1e-8)) for g in state.groups}
        eps, root_eps = float(p["eps"]), float(p.get("eps_root", 0.0))
        for other in sorted(torch_eps - {eps}):
            differences.append(OptimizerNote("eps", f"{eps:g}; the torch run's is {other:g} (optax cannot change "
                                                    f"it on a built optimizer): pass optax.adam(eps={other:g})",
                                             abs(eps - other) / max(other, 1e-300)))
        if root_eps:
            differences.append(OptimizerNote("eps_root", f"{root_eps:g}: torch adds nothing inside the square root",
                                             root_eps))
    return tuple(settings), tuple(differences)


def _check(kind: str, wanted: str, state, momentum: bool, centered: bool) -> None:
    held = held_kinds(state, wanted, into="optax", target=f"optax.{kind}",
                      choices={f"optax.{k}": v for k, v in WANTED.items()})
    if kind == "sgd" and held and not momentum:
        raise InvalidArgumentError("the checkpoint holds Momentum slots; optax.sgd(momentum=None) keeps no trace to "
                                   "carry them: pass the source run's momentum")
    if kind == "rmsprop" and held and centered != state.centered:
        raise InvalidArgumentError(f"the checkpoint's RMSProp slots are {'' if state.centered else 'not '}centered; "
                                   f"pass optax.rmsprop(centered={state.centered})")


def _rate(params: dict) -> float | None:
    step = next((p.get("step_size") for n, p in params.items() if n == "scale"), None)
    return None if step is None else -float(step)


def _to_optax(kind: str, slots: dict | None, have: set) -> dict | None:
    """Slots in TF1's terms (``_common.roles``) -> the optax state's leaves (only those the optimizer keeps)."""
    if slots is None:
        return None
    if kind == "adam":
        out = {"mu": slots["m"], "nu": slots["v"]}
    elif kind == "sgd":
        out = {"trace": slots["a"]}
    else:
        out = {"nu": slots["ms"]}
        if slots.get("mg") is not None:
            out["mu"] = slots["mg"]
        if "trace" in have and slots.get("mom") is not None:
            mom = slots["mom"]
            out["trace"] = (-mom).astype(mom.dtype)  # optax's trace holds -lr g / root, TF1's mom +lr g / root
    return {k: v for k, v in out.items() if k in have}


def _fresh(kind: str, params: dict, leaves: dict) -> dict:
    """What a fresh optax state holds: zeros, and the RMS transforms' ``initial_scale`` for ``nu``."""
    scale = float(next((p.get("initial_scale", 0.0) for n, p in params.items() if n.startswith("scale_by_")
                        and n != "scale_by_adam"), 0.0))
    out = {}
    for what, leaf in leaves.items():
        current = np.asarray(leaf.get_value())
        out[what] = np.full(current.shape, scale if (kind == "rmsprop" and what == "nu") else 0.0, current.dtype)
    return out


def _notes(kind: str, params: dict, state, steps, roots: list, reset: list, lr) -> tuple:
    settings, differences = [], []
    if kind == "adam" and roots and steps is not None:
        p = params["scale_by_adam"]
        eps, b2, root_eps = float(p["eps"]), float(p["b2"]), float(p["eps_root"])
        root = float(np.median(roots))
        exact = eps / math.sqrt(1.0 - b2 ** (steps + 1))
        drift = max(abs(eps - eps / math.sqrt(1.0 - b2 ** k)) / (root + eps / math.sqrt(1.0 - b2 ** k))
                    for k in range(steps + 1, steps + 1 + AHEAD))
        differences.append(OptimizerNote(
            "eps", f"TF1 Adam's epsilon hat eps/sqrt(1-b2^k) moves with the step k, optax's eps ({eps:.4g}) is added "
                   f"to sqrt(nu_hat) unchanged and cannot be set on a built optimizer: over the next {AHEAD} steps the "
                   f"update's denominator differs by up to {drift:.2g} (relative, at the median sqrt(nu_hat)); "
                   f"optax.adam(eps={exact:.6g}) makes step {steps + 1} exact", drift))
        if root_eps:
            differences.append(OptimizerNote("eps_root", f"{root_eps:g}: TF1 Adam adds nothing inside the square "
                                                         f"root", root_eps / max(root * root, 1e-300)))
        if reset and steps:
            b1, k = float(p["b1"]), steps + 1
            factor = (1 - b1) / (1 - b1 ** k) * (1 - b2 ** k) ** 0.5 / (1 - b2) ** 0.5
            differences.append(OptimizerNote(
                "count", f"one count for every parameter: the {len(reset)} reset parameter(s) start from zero state "
                         f"but their bias correction reads count = {steps}, so their first update is {factor:.3g} "
                         f"times a fresh Adam's", factor))
    decay = float(params.get("add_decayed_weights", {}).get("weight_decay", 0) or 0)
    if decay:
        differences.append(OptimizerNote("weight_decay", f"{decay:g} (decoupled, optax.adamw): TF1 Adam has no such "
                                                         f"term; the updates equal TF's only where its loss had the same",
                                         decay))
    if kind == "sgd" and state.kinds:
        settings.append(OptimizerNote("trace", "= TF1's Momentum accumulation: the same recursion, nesterov or not"))
    if kind == "rmsprop" and state.kinds:
        rms = params.get("scale_by_rms") or params.get("scale_by_stddev") or {}
        if "trace" in params:
            settings.append(OptimizerNote("trace", f"-mom: optax scales by -lr before its trace, TF1 keeps +lr inside "
                                                   f"mom; equal while the rate stays the source's"
                                                   f"{'' if lr is not None else ' (a schedule: check it does)'}"))
        elif state.label == "TF1":
            settings.append(OptimizerNote("momentum", "None: TF1's momentum slot is not read (with momentum 0 TF "
                                                      "overwrites it every step)"))
        if not rms.get("eps_in_sqrt", True):
            eps = float(rms.get("eps", 1e-8))
            differences.append(OptimizerNote("eps_in_sqrt", f"False: optax adds eps {eps:.4g} outside the square root, "
                                                            f"TF1 inside; pass eps_in_sqrt=True for TF1's update", eps))
    return tuple(settings), tuple(differences)


def read(plan) -> list:
    """Every carried parameter's state values (numpy), read and checked before anything is set."""
    if not isinstance(plan, OptaxPlan):
        return []
    return [(name, read_state()) for name, read_state in plan.carries]


def load(plan, values: list) -> None:
    """Set ``values`` (from :func:`read`), the reset parameters' fresh state, ``count`` and ``step`` on the plan's
    optimizer; every value is placed (dtype, sharding of the leaf it replaces) before any is set."""
    if not isinstance(plan, OptaxPlan):
        return
    import jax

    def placed(leaf, value):
        current = leaf.get_value()
        return jax.device_put(np.asarray(value).astype(current.dtype).reshape(current.shape),
                              getattr(current, "sharding", None))

    sets = [(plan.leaves[name][what], placed(plan.leaves[name][what], value))
            for name, state in list(values) + plan.resets for what, value in state.items()]
    optimizer = plan.optimizer
    if plan.steps is not None:
        states = optimizer.opt_state if isinstance(optimizer.opt_state, tuple) else (optimizer.opt_state,)
        for s in states:
            count = getattr(s, "count", None)
            if count is not None and hasattr(count, "set_value"):
                sets.append((count, placed(count, plan.steps)))
        sets.append((optimizer.step, placed(optimizer.step, plan.steps)))
    for leaf, array in sets:
        leaf.set_value(array)
