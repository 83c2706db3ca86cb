"""What every target optimizer asks of a restore: each weight's status, the source's optimizer state, the step count.

``_plan`` (``torch.optim``) and ``_keras`` (Keras 3 optimizers) both pair a parameter's
state through its weight's record; the answers to "why does this parameter start fresh",
"which optimizer state does the checkpoint hold" and "how many steps did the source take"
are given here once.
"""

from __future__ import annotations

import numpy as np

from restorekit._optim import _convert as convert
from restorekit._optim._keras2_state import is_keras2_optimizer, keras2_state
from restorekit._optim._keras_state import is_keras_optimizer, keras_state
from restorekit._optim._tf1 import TF1_KINDS, TF1State, tf1_state
from restorekit._optim._torch_state import TorchState, is_torch_training_file, torch_state
from restorekit._policies import CAST
from restorekit._report import OptimizerNote, format_shape, policy_of
from restorekit._torch_target import stored_tensor
from restorekit.errors import InvalidArgumentError

__all__ = ["BERT", "held_kinds", "source_state", "steps_of", "weight_status", "why_reset"]

BERT = "Adam (BERT)"  # google-research BERT's AdamWeightDecayOptimizer: Adam's m and v, no bias correction


def source_state(checkpoint, wanted: str, *, momentum: bool, centered: bool, order) -> TF1State:
    """The checkpoint's optimizer state in TF1's terms: its TF1 slots, a Keras 2 optimizer's slots (a TF2 checkpoint),
    or a Keras 3 optimizer's variables read as the optimizer that takes ``wanted`` (TF1) state; ``order()`` gives
    the target's trainable weights' keys."""
    if is_keras2_optimizer(checkpoint):
        return keras2_state(checkpoint)
    if is_keras_optimizer(checkpoint):
        return keras_state(checkpoint, wanted, momentum=momentum, centered=centered, order=order())
    if is_torch_training_file(checkpoint):
        return torch_state(checkpoint) or TorchState(label="torch")
    return tf1_state(checkpoint)


def weight_status(report) -> dict:
    """variable name -> (how, reason) for every variable scan did not simply match."""
    status = {}
    for r in report.missing:
        status[r.variable_name] = ("missing", "its weight is not in the checkpoint")
    for r in report.shape_mismatched:
        status[r.variable_name] = ("mismatched", f"its weight is mismatched (checkpoint {format_shape(r.checkpoint_shape)}"
                                                 f", model {format_shape(r.shape)})")
    for r in report.dtype_mismatched:
        status[r.variable_name] = ("mismatched", f"its weight is mismatched (checkpoint {r.checkpoint_dtype}, "
                                                 f"model {r.dtype})")
    for r in report.skipped:
        if r.variable_name is not None:
            status[r.variable_name] = ("not_restored", f"its weight is not restored ({r.reason})")
    for r in report.matched:
        policy = policy_of(report, r.variable_name)
        if policy is not None and policy is not CAST:
            status[r.variable_name] = ("policy", f"its weight is restored through a policy ({r.reason}); the slots "
                                                 f"fit the checkpoint's weight, not this one")
        elif "ema" in r.how:
            status[r.variable_name] = ("policy", "its weight is restored from its moving average; the slots belong "
                                                 "to the raw weight")
    return status


def why_reset(name, status, matched, state):
    if name is None:
        return "not_in_module", "not a parameter or buffer of the scanned module"
    if name in status:
        return status[name]
    if name not in matched:
        return "not_restored", "its weight is not restored"
    if not state.kinds:
        return "no_slots", "the checkpoint holds no optimizer state"
    return None


def steps_of(state, adam: bool, betas: list, notes: list) -> tuple:
    """The steps the source run took, and what says so: TF1 Adam's beta powers (what its bias correction reads,
    checked against ``betas``, one ``(beta1, beta2)`` per group), else the step counter (``global_step``, a Keras
    optimizer's ``iterations``). Betas a source saved (Keras 2's ``beta_1``, ``beta_2``) are checked too."""
    if adam and state.kinds.get(BERT):
        steps = max([convert.uncorrected_steps(float(b1), float(b2)) for b1, b2 in betas] + [state.global_step or 0])
        notes.append(OptimizerNote("step", f"BERT's AdamWeightDecayOptimizer has no bias correction: from step {steps} "
                                           f"on, 1 - beta^step is exactly 1 (global_step {state.global_step} counts "
                                           f"the rate schedule, not a correction)"))
        return steps, "no bias correction"
    if adam and state.beta1_power is not None:
        found = {convert.adam_steps(state.beta1_power, state.beta2_power, float(b1), float(b2), state.global_step)
                 for b1, b2 in betas}
        if len(found) > 1:
            raise InvalidArgumentError(f"the param groups' betas count {sorted(found)} steps; give every group the TF run's")
        steps = found.pop()
        if state.global_step is not None and state.global_step != steps:
            notes.append(OptimizerNote("step", f"global_step is {state.global_step}, beta1_power counts {steps} "
                                               f"steps: bias correction reads the beta powers, so step = {steps}"))
        return steps, "beta1_power" + (", beta2_power" if state.beta2_power is not None else "")
    if adam and state.kinds and state.betas is not None:
        saved = tuple(float(b) for b in state.betas)
        for b1, b2 in betas:  # the saved betas are float32 variables
            if any(abs(float(b) - s) > 1e-6 * max(abs(s), 1.0) for b, s in zip((b1, b2), saved)):
                raise InvalidArgumentError(
                    f"the checkpoint's {state.label} ran with betas ({saved[0]:.6g}, {saved[1]:.6g}); the optimizer's "
                    f"are ({float(b1):.6g}, {float(b2):.6g}): give it the run's, or scan without optimizer= for a warm "
                    f"start")
    if adam and state.kinds:
        if state.global_step is None:
            raise InvalidArgumentError("the checkpoint holds Adam slots but no beta1_power and no global_step: the "
                                       "step count that bias correction reads is unknown")
        if state.counter == "global_step":
            notes.append(OptimizerNote("step", "no beta1_power: the step count is global_step's"))
    if state.global_step is not None:
        return state.global_step, state.counter
    return (0, f"no {state.counter}") if state.kinds else (None, "")


def roles(wanted: str, leaves: dict, centered: bool) -> dict:
    """A weight's slots ``{TF1 leaf: value}`` by what they are: ``m``, ``v`` (Adam; ``vhat``, the maximum of ``v``,
    where the source kept one), ``a`` (Momentum), ``ms``, ``mg``, ``mom`` (RMSProp; ``mg`` when centered, ``mom``
    where the source keeps one), ``acc`` (Adagrad)."""
    if wanted == "Adam":
        return {"m": leaves["Adam"], "v": leaves["Adam_1"], **({"vhat": leaves["vhat"]} if "vhat" in leaves else {})}
    if wanted == BERT:
        return {"m": leaves["adam_m"], "v": leaves["adam_v"]}
    if wanted == "Momentum":
        return {"a": leaves["Momentum"]}
    if wanted == "RMSProp":
        mg, mom = ("RMSProp_1", "RMSProp_2") if centered else (None, "RMSProp_1")
        return {"ms": leaves["RMSProp"], "mg": leaves.get(mg) if mg else None, "mom": leaves.get(mom)}
    return {"acc": leaves["Adagrad"]}


class Scratch:
    """One buffer, reused, that the slots of a weight the view transposes are read into: the view's transpose copies
    each out, so a slot costs one array of fresh memory, not two."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, np.uint8)

    def get(self, entry) -> np.ndarray | None:
        """Room for ``entry`` (a 2-D tensor of a numpy dtype) in the buffer; None for any other."""
        try:
            dtype = np.dtype(entry.dtype)
        except TypeError:  # bfloat16 and the like: read as they are
            return None
        if len(entry.shape) != 2 or entry.nbytes != dtype.itemsize * int(np.prod(entry.shape)):
            return None
        if self._buffer.size < entry.nbytes:
            self._buffer = np.empty(entry.nbytes, np.uint8)
        return self._buffer[: entry.nbytes].view(dtype).reshape(entry.shape)


def slot_reader(source, checkpoint, record, state, wanted: str, *, scratch: Scratch | None = None) -> tuple:
    """``(slots, read)`` for the weight of ``record``: ``slots`` the entries ``{leaf: key}``, ``read()`` their values
    by :func:`roles`, each put through the record's view as its weight is (None where the view computes the weight
    instead of showing a stored one); or ``(None, (how, why))`` where the weight has no slots of that shape.
    With ``scratch``, slots the view transposes are read into it first (the transpose is their one copy)."""
    base = entry_key(checkpoint, record.stored_name or record.checkpoint_name)
    slots = state.slots_of(base, wanted)
    if not slots:
        return None, ("no_slots", f"no {wanted} slots under {base!r} in the checkpoint")
    like = getattr(source, "like", None)
    if scratch is not None and like is not None:
        found = stored_tensor(source, record.checkpoint_name)
        scratch = scratch if found is not None and found[2] and found[0] is checkpoint else None
    shape = state.shape_of(checkpoint, base) if base in checkpoint.entries else None
    for key in slots.values():
        if shape is not None and state.shape_of(checkpoint, key) != shape:
            return None, ("slot_shape", f"slot {key!r} {format_shape(state.shape_of(checkpoint, key))} does not have "
                                        f"its weight's shape {format_shape(shape)}")

    held: list = []

    def read() -> dict | None:
        # Scan reads the slots (to set eps, measure drift, check shapes) and restore writes them: the values read
        # at scan are kept for restore and handed over once, so each slot is read from the checkpoint once and
        # held once (a later call reads again).
        if held:
            return held.pop()
        leaves = {}
        for leaf, key in slots.items():
            out = scratch.get(checkpoint.entries[key]) if scratch is not None else None
            array = state.read(checkpoint, leaf, key) if out is None else state.read_into(checkpoint, leaf, key, out)
            leaves[leaf] = array if like is None else like(record.checkpoint_name, array)
        found = None if any(a is None for a in leaves.values()) else roles(wanted, leaves, state.centered)
        held.append(found)
        return found

    return slots, read


def source_label(state, wanted: str) -> str:
    """What the report calls the source's optimizer state: ``'Adam (TF1)'``, ``'Keras 3 Adam'``."""
    if state.label != "TF1":
        return state.label
    return "AdamWeightDecayOptimizer (BERT, TF1)" if wanted == BERT else f"{wanted} (TF1)"


def trained_keys(report, checkpoint, names) -> list:
    """The checkpoint keys of the weights of ``names`` (the target's trained variables, in the optimizer's order)
    that the checkpoint holds, matched or not: the order a Keras optimizer stored by position pairs with."""
    records = {r.variable_name: r for r in report.matched + report.shape_mismatched + report.dtype_mismatched}
    return [entry_key(checkpoint, records[n].stored_name or records[n].checkpoint_name) for n in names if n in records]


def entry_key(checkpoint, name: str) -> str:
    """The checkpoint's key of weight ``name``: ``name`` itself, or the key whose readable name it is (a layout
    names a Keras file's ``layers/dense/vars/0`` by its path ``fc1/kernel``)."""
    if name in checkpoint.entries:
        return name
    readable = getattr(checkpoint, "readable_name", None)
    found = [key for key in checkpoint.entries if readable is not None and readable(key) == name]
    return found[0] if len(found) == 1 else name


def held_kinds(state, wanted: str, *, into: str, target: str, choices: dict, amsgrad: bool = False) -> list:
    """The TF1 slot kinds the checkpoint holds, after refusing state no target can take: optimizer
    state that is not TF1 slots (nor a Keras 3 optimizer's variables read as them), or slots of
    another optimizer than ``target`` (``'torch.optim.SGD'``) takes (``wanted``: 'Momentum').

    ``into`` names the target family in the message ('torch.optim', 'Keras', 'optax');
    ``choices`` maps each optimizer of that family to the TF1 kind it takes; ``amsgrad`` says whether the
    target keeps the maximum of ``v`` (an amsgrad source's ``vhat`` goes nowhere else).
    """
    if isinstance(state, TorchState) and state.kinds and into not in ("Keras", "optax"):
        raise InvalidArgumentError(
            f"the checkpoint holds a torch optimizer's state ({state.label}); carrying it into {into} is not "
            f"supported yet (into Keras 3 optimizers and optax it is; into torch.optim, load it with "
            f"optimizer.load_state_dict): scan without optimizer= for a warm start")
    others = {k: n for k, n in state.kinds.items() if k not in TF1_KINDS}
    if others:
        raise InvalidArgumentError(
            f"the checkpoint's optimizer state ({', '.join(f'{k} ({n})' for k, n in others.items())}) is neither TF1 "
            f"slots nor a Keras 3 optimizer's variables; carrying it into {into} is not supported yet: scan without "
            f"optimizer= for a warm start")
    held = sorted(k for k in state.kinds if k in TF1_KINDS)
    if held and wanted not in held:
        takes = ", ".join(k for k, v in choices.items() if v in held) or f"no optimizer of {into}"
        raise InvalidArgumentError(
            f"the checkpoint holds {' and '.join(held)} slots; {target} takes {wanted} state. Pass the optimizer the "
            f"source run used ({takes}), or scan without optimizer= for a warm start with fresh optimizer state")
    if state.amsgrad and not amsgrad:
        raise InvalidArgumentError(
            f"the checkpoint's Adam keeps vhat, the maximum of v (amsgrad=True); {target} as given keeps none, so "
            f"its updates would differ: pass amsgrad=True (where {into} has it), or scan without optimizer=")
    return held
