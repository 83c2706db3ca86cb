"""Where a Keras file keeps its tensors and what they are called: the Keras 3 and legacy Keras 2 HDF5 layouts.

Only the structure is read here (groups, attributes, shapes, dtypes); see the
package docstring for the layouts and for which variable names are guessed.
"""

from __future__ import annotations

import re
from typing import Mapping
from dataclasses import dataclass

import numpy as np

from restorekit.errors import CorruptCheckpointError

__all__ = ["CONTAINERS", "CudnnWeight", "Dataset", "Keras3Walk", "attr_list", "config_index", "cudnn_weights",
           "layer_variables", "read_legacy", "text"]

_UNIQUIFIED = re.compile(r"_\d+$")
_OUTPUT_INDEX = re.compile(r":\d+$")
CONTAINERS = ("layers", "_layer_checkpoint_dependencies")  # the latter: Keras 2.13-2.15 .keras files

# Variables of the built-in layers in creation order (trainable first, as Keras saves them).
_VARIABLES: dict[str, tuple[str | None, ...]] = {
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
    "conv_lstm_cell": ("kernel", "recurrent_kernel", "bias"),
    "separable_conv1d": ("depthwise_kernel", "pointwise_kernel", "bias"),
    "separable_conv2d": ("depthwise_kernel", "pointwise_kernel", "bias"),
    "attention": ("scale", "concat_score_weight"),
    "additive_attention": ("scale",),
}
for _conv in ("conv1d", "conv2d", "conv3d", "conv1d_transpose", "conv2d_transpose", "conv3d_transpose",
              "depthwise_conv1d", "depthwise_conv2d"):
    _VARIABLES[_conv] = ("kernel", "bias")
_VARIABLES["stft_spectrogram"] = ("real_kernel", "imag_kernel")
_VARIABLES["spectral_normalization"] = (None, "vector_u")  # None: its layer's kernel again, saved under its layer
# Other sets of variables a layer of the kind saves, by config (Keras 3.15, checked against layer.weights):
# renorm=True, and quantize('int8' | 'int4' | 'float8'). A quantized kernel is stored as int8, which tells them apart.
_QUANTIZED_DENSE = (
    ("kernel", "bias", "kernel_scale"),
    ("kernel", "bias", "kernel_scale", "kernel_zero", "g_idx"),
)
_FLOAT8 = ("kernel", "bias", "inputs_scale", "inputs_amax_history", "kernel_scale", "kernel_amax_history",
           "outputs_grad_scale", "outputs_grad_amax_history")
_VARIANTS = {
    "batch_normalization": (("gamma", "beta", "moving_mean", "moving_variance", "moving_stddev", "renorm_mean",
                             "renorm_stddev"),),
    "dense": (*_QUANTIZED_DENSE, _FLOAT8),
    "einsum_dense": (*_QUANTIZED_DENSE, _FLOAT8),
    "embedding": (("embeddings", "embeddings_scale"), ("embeddings", "embeddings_scale", "embeddings_zero", "g_idx")),
}
_INT8_STORED = {"kernel", "embeddings"}  # quantized variants only: int8 values with a scale
# Config switches that drop a variable: (config key, value that drops it).
_SWITCHES = {"bias": ("use_bias", False), "gamma": ("scale", False), "beta": ("center", False),
             "scale": ("use_scale", False)}
# Variables a layer may lack (a config switch drops them). A bare weights file keeps no config, so a
# layer with fewer variables is named only when one set of them fits its count: a SeparableConv2D with 2
# is use_bias=False; a BatchNormalization with 3 is scale=False or center=False, which the file cannot
# tell, so its variables keep their indices (scan pairs them by position, as Keras' load_weights does).
def _optional(names: tuple) -> tuple:
    return tuple(v for v in names if v in _SWITCHES or v == "concat_score_weight")
# Sub-objects saved under their attribute's name, of a known class (MultiHeadAttention's projections).
_ATTRIBUTE_KINDS = {"query_dense": "einsum_dense", "key_dense": "einsum_dense", "value_dense": "einsum_dense",
                    "output_dense": "einsum_dense"}


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


def _variable_names(kind: str | None, layer_config: dict | None, datasets: list, undecided: list | None = None) -> list:
    """Names for a layer's variables by position (see the module docstring for what is guessed).

    None for a variable that is another layer's, saved again (SpectralNormalization's kernel).
    Where two sets of names fit, the indices; ``undecided`` then gets the sets.
    """
    n = len(datasets)
    kind = kind or ""
    full = _VARIABLES.get(kind)
    if full is not None:
        variants = (full, *_VARIANTS.get(kind, ()))
        if layer_config is not None:
            configured = [kept for kept in (_configured(kind, v, layer_config) for v in variants)
                          if len(kept) == n and _fits(kept, datasets)]
            if len(configured) == 1:
                return configured[0]
        fitting = [kept for variant in variants
                   for kept in ([v for v in variant if v not in dropped]
                                for dropped in _drops(_optional(variant), len(variant) - n))
                   if _fits(kept, datasets)]
        if len(fitting) == 1:
            return fitting[0]
        if undecided is not None and len(fitting) > 1:
            undecided.extend(tuple(names) for names in fitting)
    elif layer_config is None and n == 2 and len(datasets[0].shape) > len(datasets[1].shape) >= 1:
        return ["kernel", "bias"]  # a sub-layer of an unknown class (no config says it is a custom layer)
    return [str(i) for i in range(n)]


def _configured(kind: str, variant: tuple, layer_config: dict) -> list:
    """The variables of ``variant`` that ``layer_config`` keeps (use_bias, center, scale, bias_axes, score_mode)."""
    kept = [v for v in variant if not (v in _SWITCHES and layer_config.get(_SWITCHES[v][0]) is _SWITCHES[v][1])]
    if kind == "einsum_dense" and not layer_config.get("bias_axes"):
        kept = [v for v in kept if v != "bias"]
    if kind == "attention" and layer_config.get("score_mode", "dot") != "concat":
        kept = [v for v in kept if v != "concat_score_weight"]
    return kept


def _int8(names: list) -> bool:
    """Whether a set of variables is an int8- or int4-quantized layer's (an int8 kernel with its scale)."""
    return "inputs_scale" not in names and any(
        v is not None and v.endswith("_scale") and v.rpartition("_")[0] in _INT8_STORED for v in names)


def _drops(optional: tuple, count: int):
    """Every set of ``count`` variables of ``optional``."""
    if count < 0 or count > len(optional):
        return
    if count == 0:
        yield ()
        return
    for i, first in enumerate(optional):
        for rest in _drops(optional[i + 1:], count - 1):
            yield (first, *rest)


def _fits(names: list, datasets: list) -> bool:
    """False where a name cannot be the dataset at its place: a kernel is of rank 2 or more, a bias not;
    a quantized layer's kernel is stored as int8, an unquantized one's is not."""
    int8 = _int8(names)
    for name, data in zip(names, datasets):
        if name in _INT8_STORED and (data.dtype == "int8") != int8:
            return False
        if name is None:
            continue
        if name.endswith("kernel") and len(data.shape) < 2:
            return False
        if name in ("bias", "gamma", "beta", "moving_mean", "moving_variance") and len(data.shape) > 2:
            return False
    return True


class Keras3Walk:
    """Collects the datasets of a Keras 3 weights file with their readable paths."""

    def __init__(self, path: str, h5py, config_index: dict):
        self.path, self.h5py, self.index = path, h5py, config_index
        self.datasets: list = []
        self.readable: dict = {}
        self.objects: dict = {}  # key -> the dataset object it was described from (valid while the file is open)
        self.owners: dict = {}  # '<group>/vars' -> the readable path of the object that owns it ('enc1', 'block/a')
        self.undecided: dict = {}  # layer path -> the sets of names that fit its indexed variables (in order)
        self._taken: set = set()
        self._tree: dict = {}  # key -> (its Keras path, its path through every named layer: 'block_a/fc/kernel')

    def visit(self, group, key: str, scope: str, *, root: bool = False, class_hint: str | None = None,
              tree: str = "") -> None:
        vars_group = group.get("vars")
        if not isinstance(vars_group, self.h5py.Group):
            for name, child in group.items():  # a container: a list of layers named by class
                if isinstance(child, self.h5py.Group):
                    self.visit(child, f"{key}/{name}" if key else name, scope, class_hint=_UNIQUIFIED.sub("", name),
                               tree=tree)
            return
        name = text(vars_group.attrs.get("name")) or key.rsplit("/", 1)[-1] or "model"
        kind, layer_config = self.index.get(name, (None, None))
        kind = kind or _guess_kind(class_hint, name)
        own = name if root else scope + name
        self.owners[f"{key}/vars" if key else "vars"] = "" if root else own
        self._own_variables(vars_group, f"{key}/vars" if key else "vars", own, kind, layer_config, key == "optimizer",
                            name if root else tree + name)
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
                    self.visit(child, child_key, "optimizer/", tree="optimizer/")
                else:
                    self.visit(child, child_key, inner, class_hint=_UNIQUIFIED.sub("", child_name),
                               tree="" if root else f"{tree}{name}/")
        if root:
            self._name_repeated_paths_by_tree()

    def _name_repeated_paths_by_tree(self) -> None:
        """Give a Keras path that several variables share (two nested Functional blocks' ``fc/kernel``: their
        layers were built outside the blocks' scopes) to none of them: each reads its path through the named
        layers (``block_a/fc/kernel``, ``block_b/fc/kernel``), as the model's layer tree says, when those differ."""
        by_path: dict = {}
        for key, (path, tree) in self._tree.items():
            by_path.setdefault(path, []).append((key, tree))
        for path, found in by_path.items():
            trees = [tree for _, tree in found]
            if len(found) < 2 or len(set(trees)) < len(trees) or set(trees) & set(self.readable.values()):
                continue
            for key, tree in found:
                self.readable[key] = tree

    def _own_variables(self, vars_group, vars_key: str, own: str, kind, layer_config, optimizer: bool,
                       tree: str) -> None:
        found = []
        for index in sorted((k for k in vars_group if k.isdigit()), key=int):
            ds = vars_group[index]
            if isinstance(ds, self.h5py.Dataset):
                found.append(_describe(ds, f"{vars_key}/{index}", self.path))
                self.objects[found[-1].key] = ds
        fitting: list = []
        names = [str(i) for i in range(len(found))] if optimizer else _variable_names(kind, layer_config, found, fitting)
        if fitting:
            self.undecided[own] = tuple(fitting)
        for data, var in zip(found, names):
            self.datasets.append(data)
            path = data.key if optimizer or var is None else f"{own}/{var}"
            if path != data.key:
                self._tree[data.key] = (path, f"{tree}/{var}")
            if path in self._taken:
                path = data.key
            self._taken.add(path)
            self.readable[data.key] = path


def _guess_kind(class_hint: str | None, name: str) -> str | None:
    if class_hint in _ATTRIBUTE_KINDS:
        return _ATTRIBUTE_KINDS[class_hint]
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
    return attrs_list(group.attrs, name)


def attrs_list(attrs, name: str) -> list[str] | None:
    """``attr_list`` over a group's attributes as a mapping (h5py's, or a dict of them read already)."""
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
    """``dense_1`` + ``dense_1/kernel:0`` -> ``dense_1/kernel``; the layer's name starts the path.

    Keras 2.0 files often keep the layer's scope twice, the second uniquified
    (``conv2d_1/conv2d_1_1/kernel:0``: the layer was built in a re-entered name scope);
    Keras itself loads weights by position, so the repeat means nothing and is dropped.
    """
    parts = _OUTPUT_INDEX.sub("", weight).split("/")
    if layer in parts:
        parts = parts[parts.index(layer):]
    else:
        parts = [layer, *parts]
    repeat = re.compile(re.escape(layer) + r"(?:_\d+)?")
    return "/".join([parts[0]] + [p for p in parts[1:-1] if not repeat.fullmatch(p)] + parts[-1:])


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


def layer_variables(datasets: list, readable: dict) -> dict:
    """The file's layer scope -> ``[(key, leaf, shape, dtype)]`` in the order the layer created them.

    ``datasets`` in the file's order (a Keras 3 layer's ``vars/N``, a legacy layer's
    ``weight_names``); what ``scan`` pairs by position, as Keras' ``load_weights`` does.
    """
    out: dict = {}
    for data in datasets:
        path = readable.get(data.key, data.key)
        if path.startswith("optimizer/") or path == data.key:
            continue
        scope, _, leaf = path.rpartition("/")
        out.setdefault(scope, []).append((data.key, leaf, data.shape, data.dtype))
    return out


# ---------------------------------------------------------------- CuDNN RNN weights of Keras 2

@dataclass(frozen=True)
class CudnnWeight:
    """One weight of a Keras 2 ``CuDNNLSTM`` / ``CuDNNGRU`` layer, and its conversion for a Keras LSTM / GRU.

    CuDNN layers store each gate's input kernel in cuDNN's (Fortran) order, each gate's
    recurrent kernel transposed, and two biases (input and recurrent) in one vector of
    ``2 * gates * units``. Keras 2 converts them when it loads them into an ``LSTM`` or a
    ``GRU(reset_after=True)`` (tf-keras ``hdf5_format._convert_rnn_weights``); calling this
    does the same for one weight: ``(stored value, variable) -> value``.
    """

    layer: str  # 'CuDNNLSTM' or 'CuDNNGRU'
    role: str  # 'kernel', 'recurrent_kernel' or 'bias'
    units: int

    @property
    def gates(self) -> int:
        return 4 if self.layer == "CuDNNLSTM" else 3

    @property
    def __name__(self) -> str:  # how a report names the conversion
        return f"{self.layer} {self.role} converted as Keras 2 loads it"

    def shape(self, stored: tuple) -> tuple:
        """The shape of the converted value."""
        if self.role != "bias":
            return tuple(stored)
        return (self.gates * self.units,) if self.layer == "CuDNNLSTM" else (2, self.gates * self.units)

    def convert(self, value: np.ndarray) -> np.ndarray:
        value = np.asarray(value)
        gates, units = self.gates, self.units
        if self.role == "bias":
            return value[: gates * units] + value[gates * units:] if gates == 4 else value.reshape(2, gates * units)
        rows = value.shape[0]
        blocks = value.reshape(rows, gates, units).transpose(1, 0, 2)  # gate, row, unit
        if self.role == "kernel":  # each gate's [rows, units] block holds a [units, rows] matrix in C order
            blocks = blocks.reshape(gates, units, rows).transpose(0, 2, 1)
        else:
            blocks = blocks.transpose(0, 2, 1)
        return np.ascontiguousarray(blocks.transpose(1, 0, 2).reshape(rows, gates * units))

    def __call__(self, value, variable=None) -> np.ndarray:
        return self.convert(value)


def cudnn_weights(layers: Mapping[str, list]) -> dict:
    """Key -> CudnnWeight for every weight of a CuDNN RNN in ``layer_variables`` of a legacy file.

    Told from the shapes, as Keras 2 tells them: a layer of ``kernel [in, g*u]``,
    ``recurrent_kernel [u, g*u]`` and a bias of ``2*g*u`` (g = 4: CuDNNLSTM, 3: CuDNNGRU).
    """
    out: dict = {}
    for entries in layers.values():
        if [leaf for _, leaf, _, _ in entries] != ["kernel", "recurrent_kernel", "bias"]:
            continue
        (k, _, kernel, _), (r, _, recurrent, _), (b, _, bias, _) = entries
        if len(kernel) != 2 or len(recurrent) != 2 or len(bias) != 1 or not recurrent[0]:
            continue
        units = recurrent[0]
        gates = recurrent[1] // units
        if gates not in (3, 4) or recurrent[1] != gates * units or kernel[1] != gates * units or bias[0] != 2 * gates * units:
            continue
        layer = "CuDNNLSTM" if gates == 4 else "CuDNNGRU"
        out.update({key: CudnnWeight(layer, role, units)
                    for key, role in ((k, "kernel"), (r, "recurrent_kernel"), (b, "bias"))})
    return out
