"""Name rules of layout='torch' that need no look at the layer: leaf names, kernel axes, foreign files, dtypes."""

from __future__ import annotations

import numpy as np

from restorekit.errors import CorruptCheckpointError, InvalidArgumentError

LAYOUTS = (None, "torch")
METADATA_KEY = "restorekit"
TF2_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
LEAVES = {
    "kernel": "weight",
    "weights": "weight",
    "bias": "bias",
    "biases": "bias",
    "gamma": "weight",
    "beta": "bias",
    "moving_mean": "running_mean",
    "moving_variance": "running_var",
    "embeddings": "weight",
}
# Kernel axes TF -> PyTorch by rank: Dense [in, out] -> [out, in]; Conv{1,2,3}D
# [spatial..., in, out] -> [out, in, spatial...]. Conv2DTranspose stores
# [H, W, out, in] and PyTorch's ConvTranspose2d [in, out, H, W]: the same permutation.
KERNEL_PERMS = {2: (1, 0), 3: (2, 1, 0), 4: (3, 2, 0, 1), 5: (4, 3, 0, 1, 2)}
_KERNEL_LEAVES = ("kernel", "weights")


def check_layout(layout) -> str | None:
    """Validate a ``layout`` argument (None or 'torch').

    Raises:
        InvalidArgumentError: any other value.
    """
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"unknown layout {layout!r}; use None (names and axes as stored) or 'torch'")
    return layout


def split_leaf(name: str) -> tuple[str, str]:
    """'a/b/kernel/.ATTRIBUTES/VARIABLE_VALUE' -> ('a/b', 'kernel')."""
    if name.endswith(TF2_SUFFIX):
        name = name[: -len(TF2_SUFFIX)]
    scope, _, leaf = name.rpartition("/")
    return scope, leaf


def torch_name(name: str) -> str:
    """'block1/conv/weights' -> 'block1.conv.weight'."""
    scope, leaf = split_leaf(name)
    leaf = LEAVES.get(leaf, leaf)
    return f"{scope}/{leaf}".replace("/", ".") if scope else leaf


def torch_permutation(name: str, rank: int) -> tuple[int, ...] | None:
    """The axes permutation taking a TF tensor to PyTorch layout, or None to keep it (by leaf name and rank)."""
    _, leaf = split_leaf(name)
    if leaf in _KERNEL_LEAVES:
        return KERNEL_PERMS.get(rank)
    return None


def dotted(path: str) -> str:
    """'model/kernel/.OPTIMIZER_SLOT/optimizer/m' -> 'model.kernel.OPTIMIZER_SLOT.optimizer.m'."""
    return ".".join(part.lstrip(".") or part for part in path.split("/"))


def invert(perm) -> tuple[int, ...]:
    """The permutation undoing ``perm``."""
    return tuple(int(i) for i in np.argsort(perm))


# TF dtypes a file format stores as another dtype; the record names the TF one.
STORED_AS = {"qint8": "int8", "quint8": "uint8", "qint16": "int16", "quint16": "uint16", "qint32": "int32"}


def restore_dtype(array: np.ndarray, dtype: str | None) -> np.ndarray:
    """Undo a dtype stand-in: complex128 comes back from float64 pairs; the rest as is."""
    if dtype == "complex128" and array.dtype == np.float64:
        if not array.shape or array.shape[-1] != 2:
            raise CorruptCheckpointError(f"a complex128 tensor stored as float64 pairs has shape {list(array.shape)}")
        return np.ascontiguousarray(array).view(np.complex128).reshape(array.shape[:-1])
    return array
