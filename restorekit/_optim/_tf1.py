"""A TF1 name-based checkpoint's optimizer state: each weight's slots by optimizer, the beta powers, global_step.

What an entry is comes from ``_names`` (``entry_kind``, ``optimizer_slot_kind``), as for
every other caller: this module only groups the slots by the weight they sit under.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from restorekit._names import Kind, counter_kind, entry_kind, optimizer_slot_kind

__all__ = ["SLOT_LEAVES", "TF1State", "scalar", "tf1_state"]

# The slots a TF1 optimizer makes per variable, in creation order (TF numbers a second slot '_1').
SLOT_LEAVES = {
    "Adam": ("Adam", "Adam_1"),  # m, v
    "Momentum": ("Momentum",),  # the accumulation
    "RMSProp": ("RMSProp", "RMSProp_1"),  # ms (starts at 1.0), momentum
    "RMSProp centered": ("RMSProp", "RMSProp_1", "RMSProp_2"),  # ms, mg, momentum
    "Adagrad": ("Adagrad",),  # the accumulator (starts at initial_accumulator_value)
    "Adam (BERT)": ("adam_m", "adam_v"),  # google-research BERT's AdamWeightDecayOptimizer: m, v
}
TF1_KINDS = ("Adam", "Momentum", "RMSProp", "Adagrad", "Adam (BERT)")


@dataclass
class TF1State:
    """The optimizer state a checkpoint holds, grouped: weight key -> {slot leaf: entry key}, per optimizer."""

    slots: dict = field(default_factory=dict)  # weight key -> {leaf: key}
    kinds: Counter = field(default_factory=Counter)  # optimizer_slot_kind -> entries
    beta1_power: float | None = None
    beta2_power: float | None = None
    global_step: int | None = None
    label: str = "TF1"  # what the report calls the source's optimizer state: 'Adam (TF1)'
    counter: str = "global_step"  # the entry the step count is read from where no beta power says it
    # Adagrad's epsilon: TF1 adds none; Keras 2 adds its own (not saved) outside the root, as torch does
    epsilon_outside: bool = False
    betas: tuple | None = None  # Adam's (beta_1, beta_2) where the source saved them (Keras 2)

    def read(self, checkpoint, leaf: str, key: str):
        """Slot ``leaf`` (stored at ``key``) as TF1 keeps it: the values the conversions take."""
        del leaf
        return checkpoint.read(key)

    def read_into(self, checkpoint, leaf: str, key: str, out):
        """:meth:`read`, into ``out`` (a buffer of the entry's dtype and shape); returns the value."""
        del leaf
        checkpoint.read_into(key, out)
        return out

    def shape_of(self, checkpoint, key: str) -> tuple:
        """The stored shape of ``key`` (a weight or a slot)."""
        return tuple(checkpoint.entries[key].shape)

    def slots_of(self, base: str, kind: str) -> dict | None:
        """``{leaf: key}`` of ``kind``'s slots under weight ``base`` (``'RMSProp'`` finds the centered set too);
        None when any is missing."""
        found = self.slots.get(base, {})
        leaves = SLOT_LEAVES[kind]
        if kind == "RMSProp" and "RMSProp_2" in found:
            leaves = SLOT_LEAVES["RMSProp centered"]
        if not all(leaf in found for leaf in leaves):
            return None
        return {leaf: found[leaf] for leaf in leaves}

    @property
    def centered(self) -> bool:
        """True when the RMSProp slots come in threes (ms, mg, momentum): ``centered=True``."""
        return any("RMSProp_2" in leaves for leaves in self.slots.values())

    @property
    def amsgrad(self) -> bool:
        """True when the Adam slots keep the maximum of ``v`` (a Keras 2 ``Adam(amsgrad=True)``'s ``vhat``; TF1 has none)."""
        return any("vhat" in leaves for leaves in self.slots.values())


def scalar(checkpoint, key: str):
    """The one value of the scalar entry ``key`` (a step counter, a beta power, a saved hyper-parameter)."""
    return np.asarray(checkpoint.read(key)).reshape(()).item()


def tf1_state(checkpoint) -> TF1State:
    """The optimizer state of ``checkpoint`` (a TF1 name-based checkpoint, as stored: no view)."""
    state = TF1State()
    for name in checkpoint.entries:
        kind = entry_kind(name)
        if kind is Kind.COUNTER and counter_kind(name) == "global_step" and state.global_step is None:
            state.global_step = int(scalar(checkpoint, name))
        if kind is not Kind.OPTIMIZER:
            continue
        slot = optimizer_slot_kind(name) or "optimizer"
        state.kinds[slot] += 1
        if name in ("beta1_power", "beta2_power"):
            setattr(state, name, float(scalar(checkpoint, name)))
        elif slot in TF1_KINDS:
            base, _, leaf = name.rpartition("/")
            state.slots.setdefault(base, {})[leaf] = name
    return state
