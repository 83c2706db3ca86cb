"""Plan layout='torch' for a whole checkpoint: group its variables into layers, tell each layer's kind, map it.

The kind of a layer is read from what it holds, not from one name: the set of its
leaves (``kernel``, ``recurrent_kernel``, ``depthwise_kernel``, ``moving_mean``, ...),
their ranks and shapes (a depthwise bias has ``in * multiplier`` entries, a Keras GRU
bias two rows), and its neighbours (the four projections of a MultiHeadAttention).
Names decide only where the tensors cannot (a depthwise convolution without bias
and with ``depthwise`` in no name looks exactly like a regular one); what stays
ambiguous is not guessed but listed as unmapped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from restorekit.layouts import _kinds as kinds
from restorekit.errors import InvalidArgumentError, format_names
from restorekit.layouts._flatten import flatten_inputs, model_config, suspects
from restorekit.layouts._kinds import Part
from restorekit.layouts._live import PRIVATE, model_paths
from restorekit.layouts._names import dotted, split_leaf, torch_name

# Segments of an object path that are Keras' own bookkeeping for functional and
# Sequential models: such paths say nothing about the layer, its Keras path does.
_INTERNAL = re.compile(
    r"_operations|_functional|_layers|_self_tracked_trackables|layer-\d+|layer_with_weights-\d+"
    r"|_?variables|_trainable_variables|_non_trainable_variables|\.ATTRIBUTES"
)
LEAF_ALIASES = {
    "weights": "kernel",
    "biases": "bias",
    "depthwise_weights": "depthwise_kernel",
    "pointwise_weights": "pointwise_kernel",
}


@dataclass
class Plan:
    """Every stored tensor of an export, the TF keys left unmapped (with why) and the optimizer state kept."""

    parts: list = field(default_factory=list)
    unmapped: dict = field(default_factory=dict)
    kept: list = field(default_factory=list)
    internal: list = field(default_factory=list)  # readable paths that run through Keras internals (no model given)
    unsure: dict = field(default_factory=dict)  # Dense scope -> why its inputs may be a flattened map in Keras' order

    def by_key(self) -> dict:
        out: dict = {}
        for part in self.parts:
            if part.key is not None:
                out.setdefault(part.key, []).append(part)
        return out


@dataclass(frozen=True)
class Var:
    key: str
    path: str  # readable path, leaf normalised
    shape: tuple
    dtype: str
    hint: str  # every name the variable is known by, lowercased (for name tie-breaks)


def readable_path(tracked) -> str:
    """The path a torch module tree would use for an object-graph variable.

    Subclassed models and ``tf.Module`` trees: the attribute path (``model/fc1/_kernel``
    -> ``model/fc1/kernel``). Functional and Sequential models, whose attribute paths
    run through Keras internals (``_operations/3``): the Keras ``variable.path``.
    """
    parts = tracked.object_path.split("/")
    if tracked.kind != "variable" or any(_INTERNAL.fullmatch(p) for p in parts):
        return tracked.path
    return "/".join([PRIVATE.get(p, p) for p in parts[:-1]] + [parts[-1].lstrip("_")])


def plan_checkpoint(checkpoint, *, forget_bias: float = 1.0, layer_kinds: dict | None = None, model=None,
                    flatten_channels: dict | None = None) -> Plan:
    """Plan the torch layout of every entry of ``checkpoint`` (see the module docstring).

    ``model``: the live Keras model the checkpoint was written from; object-graph
    variables are then named by the layers on their way (``restorekit.layouts._live``),
    and its config shows which Dense layers read a flattened feature map (``_flatten``), as a
    Keras file's own config does. ``flatten_channels``: ``{Dense path or name: channels}``
    of the map each flattens (None: it reads no flattened map), where no config shows it.

    Raises:
        InvalidArgumentError: a ``flatten_channels`` key that names no Dense layer, or
            channels that do not divide its inputs.
    """
    from restorekit._names import optimizer_slot_kind

    plan = Plan()
    graph = checkpoint.object_graph
    entries = checkpoint.entries
    tracked = graph.by_key if graph is not None else {}
    live = {} if model is None else model_paths(model, [t.object_path for t in tracked.values() if t.kind == "variable"])
    flatten = flatten_inputs(model_config(model) if model is not None else getattr(checkpoint, "config", None))
    model = []
    for key, entry in entries.items():
        t = tracked.get(key)
        if entry.dtype == "string":
            plan.parts.append(Part(key, key, "string", tuple(entry.shape), entry.dtype))
        elif t is not None and t.kind != "variable":  # optimizer state, save_counter: see the package docstring
            plan.parts.append(Part(dotted(t.path), key, "optimizer", tuple(entry.shape), entry.dtype))
            if t.kind == "optimizer":
                plan.kept.append(key)
        elif t is None and key.startswith("optimizer/"):  # a Keras file's optimizer group: by position only
            plan.parts.append(Part(torch_name(key), key, "optimizer", tuple(entry.shape), entry.dtype))
            plan.kept.append(key)
        elif t is None and (graph is not None or optimizer_slot_kind(key)):
            plan.parts.append(Part(torch_name(key), key, "other", tuple(entry.shape), entry.dtype))
            if optimizer_slot_kind(key):  # name-based (TF1) slots and Adam's beta powers: kept, TF axes
                plan.kept.append(key)
        else:
            path = (live.get(t.object_path) or readable_path(t)) if t is not None else key
            if t is not None and any(_INTERNAL.fullmatch(p) for p in path.split("/")):
                plan.internal.append(path)
            # the layer's own names (its attribute and its Keras name), for name tie-breaks
            names = (path, t.path, t.full_name) if t is not None else (path,)
            hint = " ".join(split_leaf(n)[0].rpartition("/")[2] for n in names).lower()
            scope, leaf = split_leaf(path)
            path = f"{scope}/{LEAF_ALIASES.get(leaf, leaf)}" if scope else LEAF_ALIASES.get(leaf, leaf)
            model.append(Var(key, path, tuple(entry.shape), entry.dtype, hint))
    layers: dict[str, dict] = {}
    for var in model:
        scope, leaf = split_leaf(var.path)
        layers.setdefault(scope, {})[leaf] = var
    given = {k.strip("/"): v for k, v in (flatten_channels or {}).items()}
    _check_flatten_keys(given, layers)
    context = kinds.Context(set(layers), forget_bias, {k.strip("/"): v.lower() for k, v in (layer_kinds or {}).items()},
                            flatten, given)
    if flatten is None:  # no config shows the structure: name the Dense layers that may follow a Flatten
        for scope, (conv, channels) in suspects(layers).items():
            if scope not in given and scope.rpartition("/")[2] not in given:
                context.unsure[scope] = (f"its {layers[scope]['kernel'].shape[0]} inputs are a multiple of the "
                                         f"{channels} channels of {conv!r}")
    for scope, leaves in layers.items():
        parts, unmapped = kinds.map_layer(scope, leaves, context)
        plan.parts.extend(parts)
        plan.unmapped.update(unmapped)
    plan.unsure.update(context.unsure)
    return plan


def _check_flatten_keys(given: dict, layers: dict) -> None:
    dense = [s for s, leaves in layers.items() if "kernel" in leaves and len(leaves["kernel"].shape) == 2
             and "recurrent_kernel" not in leaves]
    names = set(dense) | {s.rpartition("/")[2] for s in dense}
    unknown = [k for k in given if k not in names]
    if unknown:
        raise InvalidArgumentError(f"flatten_channels names no Dense layer: {format_names(unknown)} (Dense layers: "
                                   f"{format_names(dense) or 'none'})")


def name_only_refusal(path: str, shape: tuple) -> str | None:
    """Why a tensor known only by name and shape (no siblings) cannot be mapped, or None when it can.

    Used when tensors stream in one at a time: what only the whole layer could tell
    (recurrent, depthwise and attention kernels, split biases) is refused.
    """
    scope, leaf = split_leaf(path)
    leaf = LEAF_ALIASES.get(leaf.lstrip("_"), leaf.lstrip("_"))
    last = scope.rpartition("/")[2]
    if leaf in ("recurrent_kernel", "depthwise_kernel", "pointwise_kernel"):
        return f"a {leaf} is mapped from its whole layer only (export from the TF checkpoint)"
    if leaf in ("kernel", "bias") and (kinds.is_cell(last) or last in ("gates", "candidate")):
        return "a recurrent cell is mapped from its whole layer only (export from the TF checkpoint)"
    if leaf == "kernel" and len(shape) >= 3 and ("depthwise" in scope.lower() or "einsum" in scope.lower()
                                                  or last in kinds.ATTENTION_PARTS):
        return "a depthwise or EinsumDense kernel is mapped from its whole layer only (export from the TF checkpoint)"
    if leaf == "bias" and len(shape) >= 2:
        return "a bias of rank 2 belongs to a layer mapped as a whole only (export from the TF checkpoint)"
    return None
