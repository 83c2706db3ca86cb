"""A Keras 3 optimizer's saved variables as a source: each weight's slots, in TF1's terms, and ``iterations``.

Keras 3 saves its optimizer's variables as a list: ``iterations``, ``learning_rate`` (unless
the rate is a schedule), then the slots. A ``.keras`` archive or ``.weights.h5`` keeps them
by position only (``optimizer/vars/N``); a ``tf.train.Checkpoint`` of the optimizer keeps
the same list (``optimizer/_variables/N/...``) and, beside it, the weights the slots belong
to (``optimizer/_trainable_variables/i/...``). tf-keras' own optimizers since TF 2.11 (Keras 2's
``tf_keras.optimizers.Adam``, not ``.legacy``, which ``_keras2_state`` reads) save the same list
in a TF2 checkpoint, without the rate in it or the weights beside it, built and updating as
Keras 3's do. The slots are laid out by the optimizer's ``build``:

| Keras 3 | slots, in ``optimizer.variables`` order | the same state in TF1's terms |
| --- | --- | --- |
| ``Adam`` / ``AdamW`` | per weight: ``momentum``, ``velocity`` | ``Adam`` = momentum, ``Adam_1`` = velocity (the same update, 'epsilon hat' included) |
| ``SGD(momentum > 0)`` | per weight: ``momentum`` (``m = mu m - lr g``, ``var += m``) | ``Momentum`` = ``-m / lr`` (TF1's ``a = mu a + g``, ``var -= lr a``) |
| ``RMSprop`` | every ``velocity``, then every ``momentum`` (``momentum > 0``), then every ``average_gradient`` (``centered``) | ``RMSProp`` = velocity, ``RMSProp_1`` = average_gradient when centered, the last = momentum (both keep the rate inside it) |

Which weight a slot belongs to: the optimizer's own list where the checkpoint has it, else
the target's trainable weights in order (a model built as the source was), checked by
count and by every slot's shape.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from restorekit._optim._tf1 import TF1State, scalar
from restorekit.errors import InvalidArgumentError

__all__ = ["KERAS_NAMES", "KerasState", "is_keras_optimizer", "keras_state"]

_FILE = re.compile(r"^optimizer/vars/(\d+)$")  # .keras, .weights.h5
_TF2 = re.compile(r"^optimizer/_variables/(\d+)/\.ATTRIBUTES/VARIABLE_VALUE$")
_TF2_WEIGHT = re.compile(r"^optimizer/_trainable_variables/(\d+)/\.ATTRIBUTES/VARIABLE_VALUE$")
_TF2_ITERATIONS = "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"
_TF2_RATE = "optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE"
# the TF1 optimizer whose terms a Keras 3 optimizer's state is read in -> that Keras class
KERAS_NAMES = {"Adam": "Adam", "Momentum": "SGD", "RMSProp": "RMSprop"}


@dataclass
class KerasState(TF1State):
    """A Keras 3 optimizer's saved state, grouped as :class:`TF1State` is: weight key -> {TF1 leaf: entry key}."""

    is_centered: bool = False
    rate: float | None = None  # the source's learning_rate variable, where it has one
    factors: dict = field(default_factory=dict)  # entry key -> the factor that turns it into TF1's slot

    def read(self, checkpoint, leaf: str, key: str):
        del leaf
        value = checkpoint.read(key)
        factor = self.factors.get(key)
        return value if factor is None else (value * np.asarray(factor, value.dtype)).astype(value.dtype)

    def read_into(self, checkpoint, leaf: str, key: str, out):
        checkpoint.read_into(key, out)
        factor = self.factors.get(key)
        return out if factor is None else (out * np.asarray(factor, out.dtype)).astype(out.dtype)

    def slots_of(self, base: str, kind: str) -> dict | None:
        del kind
        return self.slots.get(base)

    @property
    def centered(self) -> bool:
        return self.is_centered


def _numbered(checkpoint, pattern) -> dict:
    found = {}
    for key in checkpoint.entries:
        m = pattern.match(key)
        if m:
            found[int(m.group(1))] = key
    return found


def is_keras_optimizer(checkpoint) -> bool:
    """True when ``checkpoint`` holds a Keras 3 optimizer's variables (a Keras file's or a TF2 checkpoint's)."""
    return bool(_numbered(checkpoint, _FILE) or _numbered(checkpoint, _TF2))


def keras_state(checkpoint, kind: str, *, momentum: bool, centered: bool, order: list) -> KerasState:
    """The Keras 3 optimizer state of ``checkpoint``, read as ``KERAS_NAMES[kind]``'s with the target's
    ``momentum`` and ``centered``; ``order`` is the target's trainable weights' checkpoint keys, in order
    (used where the checkpoint does not list the optimizer's own).

    Raises:
        InvalidArgumentError: the variables do not fit that optimizer: another count (another optimizer,
            ``momentum``, ``centered`` or ``amsgrad`` than the source's, or other trainable weights), or a slot
            of another shape than its weight.
    """
    name = KERAS_NAMES.get(kind)
    if name is None:
        raise InvalidArgumentError(f"carrying Keras 3 optimizer variables into a {kind} optimizer is not supported "
                                   f"yet (Adam, SGD with momentum and RMSprop are): scan without optimizer= for a "
                                   f"warm start")
    file_vars = _numbered(checkpoint, _FILE)
    variables = file_vars or _numbered(checkpoint, _TF2)
    weights = [key for _, key in sorted(_numbered(checkpoint, _TF2_WEIGHT).items())] or list(order)
    listed = [variables[i] for i in sorted(variables)]
    per_weight = {"Adam": 2, "Momentum": 1 if momentum else 0, "RMSProp": 1 + bool(momentum) + bool(centered)}[kind]
    if file_vars:
        head = len(listed) - per_weight * len(weights)
        if head not in (1, 2):
            raise InvalidArgumentError(
                f"the checkpoint's Keras optimizer has {len(listed)} variables, stored by position: a Keras {name}"
                f"{' with momentum' if kind != 'Adam' and momentum else ''}{' centered' if centered else ''} over "
                f"the {len(weights)} trainable weights the target pairs with the checkpoint would have "
                f"{per_weight * len(weights) + 2} (or {per_weight * len(weights) + 1} with a rate schedule). Pass the "
                f"optimizer the source run used, a model built as the source's, or scan without optimizer=")
        iterations = scalar(checkpoint, listed[0])
        rate = float(scalar(checkpoint, listed[1])) if head == 2 else None
        slots = listed[head:]
    else:
        # iterations (variable 0) and learning_rate are saved under their own names, never as _variables/N; Keras
        # 3 lists the rate second, tf-keras' optimizers (TF 2.11+, the same build and updates) do not list it
        iterations = scalar(checkpoint, _TF2_ITERATIONS)
        rate = float(scalar(checkpoint, _TF2_RATE)) if _TF2_RATE in checkpoint.entries else None
        slots = [variables[i] for i in sorted(variables) if i >= 1]
        if len(slots) != per_weight * len(weights):
            raise InvalidArgumentError(
                f"the checkpoint's Keras optimizer has {len(slots)} slot variables for {len(weights)} trainable "
                f"weights; a Keras {name}{' centered' if centered else ''} keeps {per_weight} per weight. Pass the "
                f"optimizer the source run used, or scan without optimizer=")
    # Keras 3 tracks the weights it was built on (_trainable_variables); tf-keras' optimizers do not
    keras = "3" if file_vars or _numbered(checkpoint, _TF2_WEIGHT) else "2"
    state = KerasState(global_step=int(iterations), label=f"Keras {keras} {name}", counter="iterations",
                       is_centered=centered, rate=rate)
    n = len(weights)
    for i, base in enumerate(weights):
        if kind == "Adam":
            leaves = {"Adam": slots[2 * i], "Adam_1": slots[2 * i + 1]}
        elif kind == "Momentum":
            leaves = {"Momentum": slots[i]} if momentum else {}
        else:
            blocks = [slots[i]] + ([slots[2 * n + i]] if centered and momentum else [slots[n + i]] if centered else [])
            if momentum:
                blocks.append(slots[n + i])
            leaves = dict(zip(("RMSProp", "RMSProp_1", "RMSProp_2"), blocks))
        shape = tuple(checkpoint.entries[base].shape)
        for key in leaves.values():
            if tuple(checkpoint.entries[key].shape) != shape:
                raise InvalidArgumentError(
                    f"the checkpoint's Keras optimizer variable {key!r} {list(checkpoint.entries[key].shape)} does "
                    f"not fit trainable weight {i} ({base!r} {list(shape)}): its variables are paired by position "
                    f"with the target's trainable weights, which must be built as the source's were")
        if leaves:
            state.slots[base] = leaves
            state.kinds[kind] += len(leaves)
    if kind == "Momentum" and momentum:
        if rate is None:
            raise InvalidArgumentError("the checkpoint's Keras SGD keeps no learning_rate variable (a schedule): its "
                                       "momentum holds -lr*a at a rate restorekit cannot read; not supported yet")
        state.factors = {k: -1.0 / rate for leaves in state.slots.values() for k in leaves.values()}
    state.kinds = Counter(state.kinds)
    return state
