"""Where a Keras file keeps its tensors and what they are called: the Keras 3 and legacy Keras 2 HDF5 layouts.

Only the structure is read here (groups, attributes, shapes, dtypes); see the
package docstring for the layouts and for which variable names are guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from restorekit.errors import CorruptCheckpointError

__all__ = ["CONTAINERS", "Dataset", "Keras3Walk", "attr_list", "config_index", "read_legacy", "text"]

_UNIQUIFIED = re.compile(r"_\d+$")
_OUTPUT_INDEX = re.compile(r":\d+$")
CONTAINERS = ("layers", "_layer_checkpoint_dependencies")  # the latter: Keras 2.13-2.15 .keras files

# Variables of the built-in layers in creation order (trainable first, as Keras saves them).
_VARIABLES = {
    "dense": ("kernel", "bias"),
    "einsum_dense": ("kernel", "bias"),
    "embedding": ("embeddings",),
    "batch_normalization": ("gamma", "beta", "moving_mean", "moving_variance"),
    "layer_normalization": ("gamma", "beta"),
    "group_normalization": ("gamma", "beta"),
    "rms_normalization": ("scale",),
    "normalization": ("mean", "variance", "count"),
    "p_re_lu": ("alpha",),
    "lstm_cell": ("kernel", "recurrent_kernel", "bias"),
    "gru_cell": ("kernel", "recurrent_kernel", "bias"),
    "simple_rnn_cell": ("kernel", "recurrent_kernel", "bias"),
    "separable_conv1d": ("depthwise_kernel", "pointwise_kernel", "bias"),
    "separable_conv2d": ("depthwise_kernel", "pointwise_kernel", "bias"),
}
for _conv in ("conv1d", "conv2d", "conv3d", "conv1d_transpose", "conv2d_transpose", "conv3d_transpose",
              "depthwise_conv1d", "depthwise_conv2d"):
    _VARIABLES[_conv] = ("kernel", "bias")
# Config switches that drop a variable: (config key, value that drops it).
_SWITCHES = {"bias": ("use_bias", False), "gamma": ("scale", False), "beta": ("center", False)}


def _snake(class_name: str) -> str:
    """``Conv2DTranspose`` -> ``conv2d_transpose``, ``PReLU`` -> ``p_re_lu``: how Keras names groups by class."""
    words = re.sub(r"(.)([A-Z][a-z0-9]+)", r"\1_\2", class_name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", words).lower()


@dataclass
class Dataset:
    """One tensor's place and description in the file (no data read)."""

    key: str
    shape: tuple
    dtype: str
    nbytes: int
    bfloat16: bool = False


# ---------------------------------------------------------------- Keras 3 layout

def config_index(config) -> dict:
    """Layer name -> (snake class name, layer config), from every nested config in ``config``."""
    index: dict = {}
    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            inner = node.get("config")
            if isinstance(node.get("class_name"), str) and isinstance(inner, dict) and isinstance(inner.get("name"), str):
                index.setdefault(inner["name"], (_snake(node["class_name"]), inner))
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return index


def _variable_names(kind: str | None, layer_config: dict | None, datasets: list) -> list[str]:
    """Names for a layer's variables by position (see the module docstring for what is guessed)."""
    n = len(datasets)
    full = _VARIABLES.get(kind or "")
    if full is not None:
        if layer_config is not None:
            kept = [v for v in full if not (v in _SWITCHES and layer_config.get(_SWITCHES[v][0]) is _SWITCHES[v][1])]
            if kind == "einsum_dense" and not layer_config.get("bias_axes"):
                kept = [v for v in kept if v != "bias"]
            if len(kept) == n:
                return kept
        if len(full) == n:
            return list(full)
        if full[-1] == "bias" and len(full) - 1 == n and "kernel" in full:
            return list(full[:-1])
    elif n == 2 and len(datasets[0].shape) > len(datasets[1].shape) >= 1:
        return ["kernel", "bias"]
    return [str(i) for i in range(n)]


class Keras3Walk:
    """Collects the datasets of a Keras 3 weights file with their readable paths."""

    def __init__(self, path: str, h5py, config_index: dict):
        self.path, self.h5py, self.index = path, h5py, config_index
        self.datasets: list = []
        self.readable: dict = {}
        self.objects: dict = {}  # key -> the dataset object it was described from (valid while the file is open)
        self.owners: dict = {}  # '<group>/vars' -> the readable path of the object that owns it ('enc1', 'block/a')
        self._taken: set = set()

    def visit(self, group, key: str, scope: str, *, root: bool = False, class_hint: str | None = None) -> None:
        vars_group = group.get("vars")
        if not isinstance(vars_group, self.h5py.Group):
            for name, child in group.items():  # a container: a list of layers named by class
                if isinstance(child, self.h5py.Group):
                    self.visit(child, f"{key}/{name}" if key else name, scope, class_hint=_UNIQUIFIED.sub("", name))
            return
        name = text(vars_group.attrs.get("name")) or key.rsplit("/", 1)[-1] or "model"
        kind, layer_config = self.index.get(name, (None, None))
        kind = kind or _guess_kind(class_hint, name)
        own = name if root else scope + name
        self.owners[f"{key}/vars" if key else "vars"] = "" if root else own
        self._own_variables(vars_group, f"{key}/vars" if key else "vars", own, kind, layer_config, key == "optimizer")
        functional = kind == "functional" or any(
            isinstance(group.get(c), self.h5py.Group) and any(_UNIQUIFIED.sub("", k) == "input_layer" for k in group[c])
            for c in CONTAINERS
        )
        # Keras paths omit the root model, and a Functional model's layers were built outside its scope.
        inner = "" if root else (scope if functional else f"{scope}{name}/")
        for child_name, child in group.items():
            if child_name != "vars" and isinstance(child, self.h5py.Group):
                child_key = f"{key}/{child_name}" if key else child_name
                if root and child_name == "optimizer":
                    self.visit(child, child_key, "optimizer/")
                else:
                    self.visit(child, child_key, inner, class_hint=_UNIQUIFIED.sub("", child_name))

    def _own_variables(self, vars_group, vars_key: str, own: str, kind, layer_config, optimizer: bool) -> None:
        found = []
        for index in sorted((k for k in vars_group if k.isdigit()), key=int):
            ds = vars_group[index]
            if isinstance(ds, self.h5py.Dataset):
                found.append(_describe(ds, f"{vars_key}/{index}", self.path))
                self.objects[found[-1].key] = ds
        names = [str(i) for i in range(len(found))] if optimizer else _variable_names(kind, layer_config, found)
        for data, var in zip(found, names):
            self.datasets.append(data)
            path = data.key if optimizer else f"{own}/{var}"
            if path in self._taken:
                path = data.key
            self._taken.add(path)
            self.readable[data.key] = path


def _guess_kind(class_hint: str | None, name: str) -> str | None:
    for candidate in (class_hint, _UNIQUIFIED.sub("", name)):
        if candidate and candidate in _VARIABLES:
            return candidate
    return None


def _describe(ds, key: str, path: str) -> Dataset:
    bfloat16 = text(ds.attrs.get("dtype")) == "bfloat16"
    try:
        stored = np.dtype(ds.dtype)
        dtype = "bfloat16" if bfloat16 else stored.name
        if stored.kind in "OSUV" and not bfloat16:
            dtype = "string"
    except TypeError:
        raise CorruptCheckpointError(f"{path!r}: {key!r} has a dtype numpy does not know ({ds.dtype})") from None
    shape = ds.shape
    shape = tuple(int(d) for d in shape) if shape is not None else ()
    itemsize = 2 if bfloat16 else stored.itemsize
    return Dataset(key, shape, dtype, int(np.prod(shape, dtype=np.int64)) * itemsize, bfloat16)


def text(value) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray) and value.shape == ():
        return text(value.item())
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- legacy Keras 2 layout

def attr_list(group, name: str) -> list[str] | None:
    """A list attribute as Keras 2 writes it: ``name``, or chunked as ``name0``, ``name1``, ..."""
    attrs = group.attrs
    if name in attrs:
        values = list(np.asarray(attrs[name]).ravel())
    elif f"{name}0" in attrs:
        values, i = [], 0
        while f"{name}{i}" in attrs:
            values.extend(np.asarray(attrs[f"{name}{i}"]).ravel())
            i += 1
    else:
        return None
    return [text(v) or str(v) for v in values]


def _legacy_readable(layer: str, weight: str) -> str:
    """``dense_1`` + ``dense_1/kernel:0`` -> ``dense_1/kernel``; the layer's name starts the path."""
    parts = _OUTPUT_INDEX.sub("", weight).split("/")
    if layer in parts:
        return "/".join(parts[parts.index(layer):])
    return "/".join([layer, *parts])


def read_legacy(path: str, f, h5py) -> tuple[list, dict]:
    root = f["model_weights"] if "model_weights" in f else f
    layers = attr_list(root, "layer_names") or []
    datasets, readable, taken = [], {}, set()

    def add(group, weight: str, name: str) -> None:
        ds = group.get(weight)
        if not isinstance(ds, h5py.Dataset):
            raise CorruptCheckpointError(
                f"{path!r} is a legacy Keras HDF5 file whose weight {weight!r} is missing from {group.name!r} "
                f"(truncated or edited); save the weights again"
            )
        data = _describe(ds, ds.name.lstrip("/"), path)
        datasets.append(data)
        readable[data.key] = name if name not in taken else data.key
        taken.add(readable[data.key])

    for layer in layers:
        group = root.get(layer)
        if not isinstance(group, h5py.Group):
            raise CorruptCheckpointError(
                f"{path!r} is a legacy Keras HDF5 file that lists layer {layer!r} but has no group for it; save it again"
            )
        for weight in attr_list(group, "weight_names") or []:
            add(group, weight, _legacy_readable(layer, weight))
    optimizer = f.get("optimizer_weights") if root is not f else None
    if isinstance(optimizer, h5py.Group):
        for weight in attr_list(optimizer, "weight_names") or []:
            add(optimizer, weight, "optimizer/" + _OUTPUT_INDEX.sub("", weight))
    return datasets, readable
