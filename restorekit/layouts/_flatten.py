"""Which Dense layers read a flattened feature map, and its channel count: the one column reorder of layout='torch'.

Keras (and tf-slim) flatten a channels-last feature map ``[*spatial, C]`` spatial position
first: input ``s * C + c``. ``torch.nn.Flatten`` after a ``Conv2d`` flattens ``[C, *spatial]``
channel first: input ``c * S + s``. The Dense after the Flatten is the same numbers with
its input axis in another order, so a plain transpose of its kernel loads with
``strict=True`` into the torch twin and computes something else. The reorder needs only
``C`` (``S`` is the kernel's input size over ``C``): the kernel ``[S*C, out]`` is read as
``[S, C, out]``, its axes turned to ``[out, C, S]`` and flattened to ``[out, C*S]``.

Only the model's structure shows where a Flatten sits, so it is read from a Keras config:
a ``.keras`` file's ``config.json``, a Keras 2 ``.h5``'s ``model_config``, or the live
model's ``get_config()`` (``torch_view(..., model=m)``). Sequential models are a chain;
functional ones are followed through their ``inbound_nodes`` (Keras 3 ``keras_history``
and Keras 2 ``[name, node, index, kwargs]`` both). From each Dense, layers that keep the
shape and hold no weights (Dropout, Activation, ...) are passed back to a ``Flatten`` (or
a ``Reshape`` to one axis); from there, back to the layer that set the feature map's
``data_format`` and channels (a convolution's ``filters``; a pooling, padding or
normalization keeps them). Keras' own loader never needs this, so no library offers it.

A bare checkpoint (TF1, tf-slim, a TF2 checkpoint without its model, a ``.weights.h5``)
cannot show a Flatten: :func:`suspects` names each Dense whose input size is a multiple of
a convolution's channels, and the caller warns by name; ``flatten_channels=`` settles it.
"""

from __future__ import annotations

from dataclasses import dataclass

from restorekit.errors import InvalidArgumentError

# Layers with no weights that keep their input's shape: a Dense behind them reads what they read.
_SHAPE_KEEPING = {
    "Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianNoise", "GaussianDropout",
    "AlphaDropout", "Activation", "ReLU", "LeakyReLU", "PReLU", "ELU", "ThresholdedReLU", "Softmax",
    "ActivityRegularization", "Identity", "Masking", "TFOpLambda",
}
# Layers between a feature map's maker and the Flatten that keep its channels (and data_format).
_CHANNEL_KEEPING = _SHAPE_KEEPING | {
    "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D", "AveragePooling3D",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D",
    "UpSampling1D", "UpSampling2D", "UpSampling3D", "BatchNormalization", "LayerNormalization",
    "GroupNormalization", "UnitNormalization", "MaxPool1D", "MaxPool2D", "MaxPool3D", "AvgPool1D",
    "AvgPool2D", "AvgPool3D", "Rescaling", "Add", "Multiply", "Subtract", "Average", "Maximum", "Minimum",
}


@dataclass(frozen=True)
class FlattenInput:
    """What a Dense reads: a feature map of ``channels`` flattened spatial-first by ``via`` (``why``: not reorderable)."""

    channels: int | None
    via: str
    why: str | None = None


@dataclass(eq=False)
class _Layer:
    name: str
    kind: str
    config: dict
    inputs: list  # names of the layers of its own model whose outputs it reads (_INPUT: the model's input)
    shape: tuple | None  # its input's shape without the batch axis, where the config records it
    graph: "_Graph"
    inner: "_Graph | None" = None  # a nested model's own layers


@dataclass(eq=False)
class _Graph:
    layers: dict  # name -> _Layer
    output: str | None  # the layer whose output is the model's
    parent: _Layer | None = None  # the layer this model is inside its parent model


_INPUT = "\0input"  # a Sequential model's first layer reads the model's input


def flatten_inputs(config) -> dict | None:
    """``{Dense layer name: FlattenInput}`` for every Dense that reads a flattened feature map in Keras' order.

    ``config``: a Keras model config (``{'class_name', 'config': {'layers': ...}}`` as
    files store it, or the inner ``get_config()`` dict). None when it holds no layers
    (a subclassed model's config): the structure is then unknown.
    """
    graphs = _graphs(config)
    if not graphs:
        return None
    found: dict = {}
    for graph in graphs:
        for layer in graph.layers.values():
            if layer.kind != "Dense":
                continue
            seen = _reads(layer)
            if seen is None:
                continue
            earlier = found.get(layer.name)
            if earlier is not None and earlier != seen:
                seen = FlattenInput(None, seen.via, "two layers of this name read different inputs")
            found[layer.name] = seen
    return found


def model_config(model) -> dict | None:
    """The live Keras model's config, or None where it has none (subclassed models); no Keras import."""
    get_config = getattr(model, "get_config", None)
    if get_config is None:
        return None
    try:
        config = get_config()
    except Exception:  # noqa: BLE001 - a subclassed model's get_config raises NotImplementedError or its own errors
        return None
    return config if isinstance(config, dict) else None


def reorder_ops(kernel_shape: tuple, channels: int, where: str) -> dict:
    """The ops turning a Dense kernel ``[S*C, out]`` into torch's ``[out, C*S]`` (none when ``S`` or ``C`` is 1).

    Raises:
        InvalidArgumentError: the kernel's input size is not a multiple of ``channels``.
    """
    inputs, out = (int(d) for d in kernel_shape)
    if channels <= 0 or inputs % channels:
        raise InvalidArgumentError(
            f"layout 'torch': Dense {where!r} has {inputs} inputs, not a multiple of the {channels} channels "
            f"given for the feature map it flattens"
        )
    spatial = inputs // channels
    if spatial == 1 or channels == 1:
        return {"perm": (1, 0)}
    return {"split": ((inputs, out), (spatial, channels, out)), "perm": (2, 1, 0),
            "view": ((out, channels, spatial), (out, inputs))}


def suspects(layers: dict) -> dict:
    """``{Dense scope: (convolution scope, channels)}`` for Dense layers that may read a flattened feature map.

    ``layers``: ``{scope: {leaf: Var}}`` of the plan. A Dense is named when its input
    size is a multiple (above one) of the output channels of a convolution in the same
    checkpoint; the last such convolution in the checkpoint's order is named.
    """
    convs = []
    for scope, leaves in layers.items():
        kernel = leaves.get("kernel") or leaves.get("pointwise_kernel")
        if kernel is not None and len(kernel.shape) >= 3 and "recurrent_kernel" not in leaves:
            convs.append((scope, int(kernel.shape[-1])))
        elif "depthwise_kernel" in leaves and len(leaves["depthwise_kernel"].shape) >= 3:
            shape = leaves["depthwise_kernel"].shape
            convs.append((scope, int(shape[-2]) * int(shape[-1])))
    out = {}
    for scope, leaves in layers.items():
        kernel = leaves.get("kernel")
        if kernel is None or len(kernel.shape) != 2 or "recurrent_kernel" in leaves:
            continue
        inputs = int(kernel.shape[0])
        fitting = [(conv, c) for conv, c in convs if c > 1 and inputs > c and inputs % c == 0]
        if fitting:
            out[scope] = fitting[-1]
    return out


# ------------------------------------------------------------------ reading a config
def _graphs(config, parent: _Layer | None = None) -> list:
    """Every (nested) model of ``config`` as a ``_Graph``, outermost first."""
    if not isinstance(config, dict):
        return []
    inner = config.get("config") if isinstance(config.get("config"), dict) and "layers" not in config else config
    layers = inner.get("layers") if isinstance(inner, dict) else None
    if not isinstance(layers, list):
        return []
    sequential = str(config.get("class_name", "")) == "Sequential" or all(
        not isinstance(item, dict) or "inbound_nodes" not in item for item in layers)
    graph = _Graph({}, None, parent)
    nested: list = []
    previous = None
    for item in layers:
        if not isinstance(item, dict):
            continue
        raw = item.get("config")
        cfg: dict = raw if isinstance(raw, dict) else {}
        name = str(cfg.get("name", item.get("name", "")))
        if sequential:
            inputs, shape = [previous or _INPUT], None
        else:
            inputs, shape = _inbound(item.get("inbound_nodes"))
        build = item.get("build_config")
        if isinstance(build, dict) and isinstance(build.get("input_shape"), (list, tuple)):
            shape = _without_batch(build["input_shape"]) or shape
        layer = _Layer(name, str(item.get("class_name", "")), cfg, inputs, shape, graph)
        graph.layers[name] = layer
        below = _graphs(item, layer)
        if below:
            layer.inner = below[0]
            nested.extend(below)
        previous = name
    graph.output = previous if sequential else _output_name(inner.get("output_layers") if isinstance(inner, dict) else None)
    return [graph, *nested]


def _output_name(outputs) -> str | None:
    """The one output layer's name of a functional config (``['fc', 0, 0]`` or ``[['fc', 0, 0]]``)."""
    if isinstance(outputs, list) and len(outputs) == 1 and isinstance(outputs[0], list):
        outputs = outputs[0]
    if isinstance(outputs, list) and outputs and isinstance(outputs[0], str):
        return outputs[0]
    return None


def _inbound(nodes) -> tuple[list, tuple | None]:
    """(producer names, the first input's shape) of a functional layer's ``inbound_nodes``, Keras 3 or 2."""
    names: list = []
    shape = None
    if not isinstance(nodes, list):
        return names, shape
    for node in nodes:
        if isinstance(node, dict):  # Keras 3: {'args': [...], 'kwargs': {...}}
            for tensor in _keras_tensors(node.get("args")):
                history = tensor.get("keras_history")
                if isinstance(history, list) and history:
                    names.append(str(history[0]))
                if shape is None and isinstance(tensor.get("shape"), list):
                    shape = _without_batch(tensor["shape"])
        elif isinstance(node, list):  # Keras 2: [[name, node, index, kwargs], ...]
            names.extend(str(t[0]) for t in node if isinstance(t, list) and t)
    return list(dict.fromkeys(names)), shape


def _keras_tensors(value) -> list:
    if isinstance(value, dict):
        if value.get("class_name") == "__keras_tensor__" and isinstance(value.get("config"), dict):
            return [value["config"]]
        return [t for v in value.values() for t in _keras_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _keras_tensors(v)]
    return []


def _without_batch(shape) -> tuple | None:
    if not isinstance(shape, (list, tuple)) or not shape or isinstance(shape[0], (list, tuple)):
        return None
    return tuple(shape[1:])


def _producer(layer: _Layer) -> _Layer | None:
    """The one layer whose output ``layer`` reads, across nested models (None: a model input, several, unknown)."""
    if len(layer.inputs) != 1:
        return None
    graph = layer.graph
    if layer.inputs[0] == _INPUT:
        node = None
    else:
        node = graph.layers.get(layer.inputs[0])
        if node is None:
            return None
    if node is None or (node.kind == "InputLayer" and graph.parent is not None):
        # a nested model's input: what its layer reads in the model around it
        return _producer(graph.parent) if graph.parent is not None else None
    while node is not None and node.inner is not None:  # a nested model: its output layer
        node = node.inner.layers.get(node.inner.output) if node.inner.output else None
    return node


def _reads(dense: _Layer) -> FlattenInput | None:
    """What ``dense`` reads, when it is a feature map flattened in Keras' spatial-first order."""
    node = _producer(dense)
    while node is not None and node.kind in _SHAPE_KEEPING:
        node = _producer(node)
    if node is None:
        return None
    reshape = node.kind == "Reshape"
    if reshape and len(node.config.get("target_shape") or ()) != 1:
        return None
    if node.kind != "Flatten" and not reshape:
        return None
    maker, channels = _feature_map(node)
    if maker is None:
        return None  # no convolution or pooling before it: the twin flattens the same array
    map_format = str(maker.config.get("data_format") or "channels_last")
    flatten_format = "channels_last" if reshape else str(node.config.get("data_format") or "channels_last")
    if map_format == "channels_first" and flatten_format == "channels_last":
        return None  # Keras flattens [C, *spatial] as torch does
    if map_format == "channels_last" and flatten_format == "channels_first":
        return FlattenInput(None, node.name, f"{node.kind} {node.name!r} flattens a channels_last map as "
                                             "channels_first, an order no torch.nn.Flatten gives")
    if node.shape is not None and len(node.shape) >= 2 and isinstance(node.shape[-1 if map_format == "channels_last"
                                                                                 else 0], int):
        channels = int(node.shape[-1 if map_format == "channels_last" else 0])
    if channels is None:
        return FlattenInput(None, node.name, f"the channels of the map {node.kind} {node.name!r} flattens are not "
                                             "in the model's config")
    return FlattenInput(channels, node.name)


def _feature_map(flatten: _Layer) -> tuple[_Layer | None, int | None]:
    """(the layer that made the map ``flatten`` reads, its channels) walking back through channel-keeping layers."""
    node = _producer(flatten)
    multiplier = 1
    maker = None
    while node is not None:
        if "data_format" in node.config and maker is None:
            maker = node
        if "filters" in node.config and isinstance(node.config["filters"], int):
            return maker or node, multiplier * node.config["filters"]
        if node.kind.startswith("DepthwiseConv"):
            multiplier *= int(node.config.get("depth_multiplier") or 1)
        elif node.kind.startswith(("GlobalAveragePooling", "GlobalMaxPooling", "GlobalAvgPool", "GlobalMaxPool")):
            return None, None  # the spatial axes are gone: nothing is left to reorder
        elif node.kind not in _CHANNEL_KEEPING and not node.kind.startswith("DepthwiseConv"):
            break
        node = _producer(node)
    return maker, None
