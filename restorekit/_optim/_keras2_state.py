"""A Keras 2 (tf-keras ``OptimizerV2``) optimizer's slots in a TF2 checkpoint as a source, in TF1's terms.

``tf.train.Checkpoint(model=..., optimizer=...)`` and ``model.save_weights`` in the TF
format save an ``OptimizerV2`` (``tf_keras.optimizers.legacy``, and every Keras optimizer
before TF 2.11) as slot variables of the object graph,
``<weight>/.OPTIMIZER_SLOT/optimizer/<slot>/.ATTRIBUTES/VARIABLE_VALUE``, beside its
hyper-parameters as variables (``iter``, ``learning_rate``, ``decay``, ``momentum``, ``rho``,
``beta_1``, ``beta_2``; ``epsilon`` is a Python float and not saved). The graph says which
weight each slot belongs to, so nothing is paired by position, and the slots' names say
which optimizer made them. For a gradient ``g`` at step ``k = iter + 1`` (tf-keras'
``optimizers/legacy``):

| Keras 2 | update | the same state in TF1's terms |
| --- | --- | --- |
| ``Adam``: ``m``, ``v`` | ``ResourceApplyAdam`` with ``beta1_power = b1^k``: TF1's update, epsilon hat included | ``Adam`` = m, ``Adam_1`` = v, ``t = iter`` |
| ``Adam(amsgrad=True)``: also ``vhat`` | ``ResourceApplyAdamWithAmsgrad``: ``vhat = max(vhat, v)`` read where TF1 reads ``v`` | also ``vhat`` (TF1 has none: only an amsgrad target takes it) |
| ``SGD(momentum > 0)``: ``momentum`` | ``ResourceApplyKerasMomentum``: ``m = mu m - lr g``, ``var += m`` (nesterov ``var += mu m - lr g``) | ``Momentum`` = ``-m / lr`` (TF1's ``a = mu a + g``, ``var -= lr a``) |
| ``RMSprop(momentum > 0)``: ``rms``, ``mg`` (centered), ``momentum`` | ``ResourceApply(Centered)RMSProp``: TF1's op, epsilon inside the root and the rate inside ``momentum`` | ``RMSProp`` = rms, ``RMSProp_1`` = mg when centered, the last = momentum |
| ``Adagrad``: ``accumulator`` | ``ResourceApplyAdagradV2``: ``acc += g^2``, ``var -= lr g / (sqrt(acc) + eps)`` | ``Adagrad`` = accumulator, and ``epsilon_outside``: TF1 adds no epsilon, this one adds its own (not saved) outside the root, as torch does |

What is refused by name, before anything is written: ``RMSprop(momentum=0)`` (it adds
epsilon outside the root, ``lr g / (sqrt(rms) + eps)``, unlike TF1 and Keras 3), a ``decay`` (the rate falls as ``lr / (1 + decay iter)``, which no target
optimizer keeps), SGD momentum under a rate schedule (no ``learning_rate`` variable to
divide by), and optimizers whose slots are none of these (``Nadam``, ``Adamax``, ``Ftrl``,
``Adadelta``).
"""

from __future__ import annotations

from collections import Counter


from restorekit._optim._keras_state import KerasState
from restorekit._optim._tf1 import scalar
from restorekit.errors import InvalidArgumentError

__all__ = ["is_keras2_optimizer", "keras2_state"]

_VALUE = "VARIABLE_VALUE"
# the slot names of a Keras 2 optimizer -> (the TF1 optimizer whose terms they are read in, the Keras class)
_KINDS = {
    frozenset({"m", "v"}): ("Adam", "Adam"),
    frozenset({"m", "v", "vhat"}): ("Adam", "Adam"),  # amsgrad=True
    frozenset({"momentum"}): ("Momentum", "SGD"),
    frozenset({"rms", "momentum"}): ("RMSProp", "RMSprop"),
    frozenset({"rms", "mg", "momentum"}): ("RMSProp", "RMSprop"),
    frozenset({"accumulator"}): ("Adagrad", "Adagrad"),
}
# Why the other slot sets are not carried (yet).
_REFUSED = {
    frozenset({"rms"}): "RMSprop(momentum=0) (it adds epsilon outside the root, lr g / (sqrt(rms) + eps), unlike "
                        "TF1 and Keras 3)",
    frozenset({"rms", "mg"}): "RMSprop(momentum=0, centered=True) (it adds epsilon outside the root, unlike TF1 and "
                              "Keras 3)",
}
# Keras 2 optimizers whose slots look like a supported one's: told apart by the name their variables are saved under.
_LOOKALIKES = ("Adamax", "Nadam")


def _optimizer_nodes(graph) -> list:
    """The object graph's nodes that own slot variables and count steps in an ``iter`` child: Keras 2 optimizers."""
    return [i for i, node in enumerate(graph.nodes)
            if node.slot_variables and any(name == "iter" for _, name in node.children)]


def _graph(checkpoint):
    return getattr(checkpoint, "object_graph", None) if getattr(checkpoint, "is_object_based", True) else None


def is_keras2_optimizer(checkpoint) -> bool:
    """True when ``checkpoint`` is a TF2 checkpoint holding a Keras 2 (``OptimizerV2``) optimizer's slots."""
    graph = _graph(checkpoint)
    return graph is not None and bool(_optimizer_nodes(graph))


def _key(node) -> tuple:
    """``(checkpoint key, full name)`` of the variable a node saves, or ``(None, '')``."""
    for name, full_name, key in node.attributes:
        if name == _VALUE and key:
            return key, full_name
    return None, ""


def _hyper(checkpoint, graph, optimizer: int) -> dict:
    """The optimizer's saved hyper-parameters: ``{child name: (value, full name)}``."""
    found = {}
    for child, name in graph.nodes[optimizer].children:
        key, full_name = _key(graph.nodes[child])
        if key is not None and key in checkpoint.entries and tuple(checkpoint.entries[key].shape) == ():
            found[name] = (scalar(checkpoint, key), full_name)
    return found


def _leaves(kind: str, names: frozenset) -> tuple:
    """``(Keras 2 slot, TF1 leaf)`` for each slot of ``kind``, numbered as TF1 numbers its own."""
    if kind == "Adam":
        return (("m", "Adam"), ("v", "Adam_1")) + ((("vhat", "vhat"),) if "vhat" in names else ())
    if kind == "RMSProp":  # TF1's centered RMSProp numbers mg before the momentum
        if "mg" in names:
            return ("rms", "RMSProp"), ("mg", "RMSProp_1"), ("momentum", "RMSProp_2")
        return ("rms", "RMSProp"), ("momentum", "RMSProp_1")
    return (("momentum", "Momentum"),) if kind == "Momentum" else (("accumulator", "Adagrad"),)


def keras2_state(checkpoint) -> KerasState:
    """The Keras 2 optimizer state of ``checkpoint`` (a TF2 checkpoint, as stored: no view), in TF1's terms.

    Raises:
        InvalidArgumentError: several optimizers, or one whose state is not carried yet (named: RMSprop without
            momentum, a ``decay``, SGD momentum under a rate schedule, Nadam, Adamax, ...).
    """
    graph = _graph(checkpoint)
    nodes = _optimizer_nodes(graph)
    if len(nodes) != 1:
        raise InvalidArgumentError(f"the checkpoint holds {len(nodes)} Keras 2 optimizers' slots; optimizer= carries "
                                   f"one: scan without optimizer= for a warm start")
    hyper = _hyper(checkpoint, graph, nodes[0])
    # Keras 2 saves its hyper-parameters under the optimizer's name ('Adam/iter'): the class, unless name= was given
    named = hyper["iter"][1].rpartition("/")[0] if "iter" in hyper else ""
    slots: dict = {}  # weight key -> {Keras 2 slot name: slot key}
    for original, slot_name, slot in graph.nodes[nodes[0]].slot_variables:
        weight, _ = _key(graph.nodes[original])
        key, _ = _key(graph.nodes[slot])
        if weight in checkpoint.entries and key in checkpoint.entries:
            slots.setdefault(weight, {})[slot_name] = key
    names = frozenset(n for found in slots.values() for n in found)
    what = _KINDS.get(names)
    if what is None or named in _LOOKALIKES:
        why = (f"{named} (its name)" if named in _LOOKALIKES else _REFUSED.get(names)
               or f"an optimizer with slots {', '.join(sorted(names))}")
        raise InvalidArgumentError(f"the checkpoint's Keras 2 optimizer is {why}: carrying its state is not supported "
                                   f"yet; scan without optimizer= for a warm start")
    kind, cls = what
    decay = float(hyper.get("decay", (0.0, ""))[0])
    if decay:
        raise InvalidArgumentError(f"the checkpoint's Keras 2 {cls} decays its learning rate (decay={decay:g}: "
                                   f"lr / (1 + decay iter)), which no target optimizer keeps; not supported yet: "
                                   f"scan without optimizer= for a warm start")
    rate = float(hyper["learning_rate"][0]) if "learning_rate" in hyper else None
    centered = "mg" in names
    leaves_of = _leaves(kind, names)
    state = KerasState(global_step=int(hyper["iter"][0]) if "iter" in hyper else None, label=f"Keras 2 {cls}",
                       counter="iter", is_centered=centered, rate=rate, epsilon_outside=kind == "Adagrad",
                       betas=(float(hyper["beta_1"][0]), float(hyper["beta_2"][0]))
                       if kind == "Adam" and "beta_1" in hyper and "beta_2" in hyper else None)
    for weight, found in slots.items():
        if all(name in found for name, _ in leaves_of):  # a weight with part of the set has none (no_slots)
            state.slots[weight] = {leaf: found[name] for name, leaf in leaves_of}
            state.kinds[kind] += len(leaves_of)
    if kind == "Momentum":
        if not rate:
            raise InvalidArgumentError("the checkpoint's Keras 2 SGD keeps no learning_rate variable (a schedule): "
                                       "its momentum holds -lr*a at a rate restorekit cannot read; not supported yet")
        state.factors = {key: -1.0 / rate for leaves in state.slots.values() for key in leaves.values()}
    state.kinds = Counter(state.kinds)
    return state
