"""Keras files as checkpoints: Keras 3 ``.weights.h5`` and ``.keras``, legacy Keras 2 HDF5, read with h5py.

``restorekit.Checkpoint(path)`` hands these files to ``KerasCheckpoint``, which offers
the same verbs as a TF checkpoint (``entries``, ``read``, ``readable_name``,
``object_paths``) so ``scan`` and ``restore`` treat them alike.

Layouts (learned from Keras' own ``saving_lib`` and ``legacy_h5_format``):

* Keras 3 ``.weights.h5``: every Keras object (model, layer, optimizer) is a group
  holding ``vars/0``, ``vars/1``, ... and, in ``vars.attrs['name']``, the object's
  name. Lists of layers are container groups (``layers``) whose items are named by
  class (``dense``, ``dense_1``); other sub-objects by attribute (``cell``,
  ``query_dense``). The optimizer is ``optimizer/vars/N``.
* ``.keras``: a zip of ``config.json``, ``metadata.json`` and ``model.weights.h5``.
  The weights member is read in place (never extracted by its member name).
* Legacy Keras 2 HDF5: ``layer_names`` on the root (weights file) or on the
  ``model_weights`` group (model file), ``weight_names`` on each layer group.

Readable names are Keras variable paths without the saving model's own name:
``enc1/kernel``, ``block/a/kernel``, ``rnn/lstm_cell/kernel``. A Keras 3 file stores
variables by position only, so their names come from the layer's class: from
``config.json`` in a ``.keras`` file, guessed from the group name (``dense_1`` ->
Dense) in a bare ``.weights.h5``. The guesses: the conventional creation order per
layer type (``kernel, bias``; ``gamma, beta, moving_mean, moving_variance``;
``embeddings``; ...), a missing ``bias`` when a dense-like layer has one variable,
and ``kernel, bias`` for an unknown layer with two variables of falling rank (the
sub-layers of MultiHeadAttention). Where nothing fits the variable keeps its index
(``custom/0``). Legacy files name their weights; those names are used as stored.

Looking a path up in ``object_paths`` forgives scopes before the layer name: Keras puts
a Sequential's, subclassed model's or wrapper's name before its layers' paths
(``sequential_3/dense/kernel``, ``td/block/a/kernel``) depending on where the layers
were built, which a file cannot tell. A path not found as given is looked up without
its leading scopes (longest first), then as the one file path that ends with it; the
layer and variable names must still agree.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Iterator, Mapping

import numpy as np

from restorekit.bundle.objectgraph import decode_object_graph
from restorekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingDependencyError,
    NoMatchError,
    format_names,
)

__all__ = ["KERAS_SUFFIXES", "KerasCheckpoint", "KerasEntry", "is_keras_path", "no_shared_layers_error"]

KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")
INSTALL = "pip install 'restorekit[keras]'"

# One root node, no children: Keras files pair by name, never by position in an object graph.
_EMPTY_OBJECT_GRAPH = b"\n\x00"
_UNIQUIFIED = re.compile(r"_\d+$")
_OUTPUT_INDEX = re.compile(r":\d+$")
_CONTAINERS = ("layers", "_layer_checkpoint_dependencies")  # the latter: Keras 2.13-2.15 .keras files
_MAX_JSON = 256 << 20

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


def _h5py():
    try:
        import h5py
    except ModuleNotFoundError as e:
        if e.name != "h5py":
            raise
        raise MissingDependencyError(f"reading Keras files (.weights.h5, .keras, .h5) needs h5py: {INSTALL}") from None
    return h5py


def is_keras_path(path) -> bool:
    """True for a local path ending in ``.keras``, ``.h5`` or ``.hdf5`` that is not a TF checkpoint prefix."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    if not isinstance(path, str) or not path.lower().endswith(KERAS_SUFFIXES) or "://" in path:
        return False
    return not os.path.exists(path + ".index")


def _snake(class_name: str) -> str:
    """``Conv2DTranspose`` -> ``conv2d_transpose``, ``PReLU`` -> ``p_re_lu``: how Keras names groups by class."""
    words = re.sub(r"(.)([A-Z][a-z0-9]+)", r"\1_\2", class_name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", words).lower()


@dataclass(frozen=True)
class KerasEntry:
    """One tensor of a Keras file: its key in the file, shape, dtype, size in bytes, readable path."""

    name: str
    shape: tuple
    dtype: str
    nbytes: int
    path: str | None = None

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class _Paths(Mapping):
    """Readable path -> key; a lookup forgives model scopes before the layer (see the module docstring)."""

    def __init__(self, paths: dict):
        self._paths = paths
        by_suffix: dict = {}
        for path in paths:
            parts = path.split("/")
            for i in range(1, len(parts) - 1):
                by_suffix.setdefault("/".join(parts[i:]), []).append(path)
        self._by_suffix = {suffix: found[0] for suffix, found in by_suffix.items() if len(found) == 1}

    def __getitem__(self, name: str) -> str:
        key = self._paths.get(name)
        if key is None and isinstance(name, str):
            key = self._paths.get(self._by_suffix.get(name, ""))  # the file has scopes the model lacks
            parts = name.split("/")
            for i in range(1, len(parts) - 1):  # the model has scopes the file lacks
                if key is not None:
                    break
                key = self._paths.get("/".join(parts[i:]))
        if key is None:
            raise KeyError(name)
        return key

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


class _MemberFile:
    """A read-only, seekable view of a stored (uncompressed) zip member, for h5py."""

    def __init__(self, path: str, offset: int, size: int):
        self._file = open(path, "rb")
        self._offset, self._size, self._pos = offset, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        if n <= 0:
            return b""
        self._file.seek(self._offset + self._pos)
        data = self._file.read(n)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._file.close()


@dataclass
class _Dataset:
    key: str
    shape: tuple
    dtype: str
    nbytes: int
    bfloat16: bool = False


class KerasCheckpoint(Mapping):
    """A read-only view of a Keras file, with the verbs of ``restorekit.Checkpoint``.

    Made by ``restorekit.Checkpoint(path)`` for ``.weights.h5``, ``.keras``, ``.h5``
    and ``.hdf5`` files. Listing reads only the file's structure; ``read`` reads one
    tensor into numpy.

        ckpt = restorekit.Checkpoint('model.weights.h5')
        ckpt.readable_name('layers/dense/vars/0')   # 'enc1/kernel'
        ckpt.read('enc1/kernel')                    # a key or a readable path

    Attributes:
        prefix: the file's path (what a report names as its checkpoint).
        kind: what the file is, in words (``'Keras 3 weights file (.weights.h5)'``).
        config: the model config (parsed JSON, never deserialized), or None.
        layer_names: the saved model's top-level layer names.

    Raises:
        CheckpointNotFoundError: no file at the path.
        CorruptCheckpointError: not a Keras file, truncated, or a ``.keras`` archive
            with members that would escape its folder.
        MissingDependencyError: h5py is not installed.
    """

    is_object_based = True

    def __init__(self, path):
        self.prefix = os.fspath(path)
        if not os.path.isfile(self.prefix):
            raise CheckpointNotFoundError(f"no Keras file at {self.prefix!r}", self.prefix)
        self.config = None
        self.metadata = None
        self._member = None  # (offset, size) of model.weights.h5 inside a .keras archive
        if zipfile.is_zipfile(self.prefix) or self.prefix.lower().endswith(".keras"):
            self._open_archive()
        _h5py()
        with self._h5() as f:
            datasets, readable = self._walk(f)
        self._data = {d.key: d for d in datasets}
        self._readable = readable
        entries = {d.key: KerasEntry(d.key, d.shape, d.dtype, d.nbytes, readable.get(d.key)) for d in datasets}
        self._entries = MappingProxyType(dict(sorted(entries.items())))
        by_path = {path: key for key, path in readable.items()}
        model_paths = [p for p in by_path if not p.startswith("optimizer/")]
        self.layer_names = tuple(dict.fromkeys(p.split("/", 1)[0] for p in model_paths if "/" in p))
        self._paths = _Paths(dict(sorted(by_path.items())))

    # -- opening
    def _open_archive(self) -> None:
        try:
            with zipfile.ZipFile(self.prefix) as archive:
                infos = archive.infolist()
                for info in infos:
                    _check_member(self.prefix, info.filename)
                names = {info.filename: info for info in infos}
                if "model.weights.h5" not in names:
                    raise CorruptCheckpointError(
                        f"{self.prefix!r} is a zip archive but not a Keras 3 .keras file with weights (members: "
                        f"{format_names(names)}); save the model with model.save('model.keras')"
                    )
                self.config = _json_member(self.prefix, archive, names.get("config.json"))
                self.metadata = _json_member(self.prefix, archive, names.get("metadata.json"))
                info = names["model.weights.h5"]
                if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
                    raise CorruptCheckpointError(
                        f"{self.prefix!r}: model.weights.h5 is compressed or encrypted, which Keras never writes; "
                        f"load the model with keras and save it again with model.save('model.keras')"
                    )
                self._member = (_member_offset(self.prefix, info), info.file_size)
        except (zipfile.BadZipFile, EOFError, OSError) as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(
                f"{self.prefix!r} is not a readable .keras archive (truncated or corrupt zip: {e}); "
                f"save the model again with model.save('model.keras')"
            ) from None
        if self._member[0] + self._member[1] > os.path.getsize(self.prefix):
            raise CorruptCheckpointError(
                f"{self.prefix!r} is truncated: its model.weights.h5 runs past the end of the file; "
                f"save the model again with model.save('model.keras')"
            )

    @contextmanager
    def _h5(self):
        h5py = _h5py()
        raw = None
        try:
            if self._member is not None:
                raw = _MemberFile(self.prefix, *self._member)
                f = h5py.File(raw, "r")
            else:
                f = h5py.File(self.prefix, "r")
        except OSError as e:
            if raw is not None:
                raw.close()
            what = "the weights inside the .keras archive" if self._member is not None else "it"
            raise CorruptCheckpointError(
                f"{self.prefix!r} is not a readable Keras file: {what} is not valid HDF5 (truncated or corrupt: {e}). "
                f"Save it again with model.save_weights('model.weights.h5') or model.save('model.keras')"
            ) from None
        try:
            yield f
        finally:
            f.close()
            if raw is not None:
                raw.close()

    # -- structure
    def _walk(self, f) -> tuple[list, dict]:
        h5py = _h5py()
        if "model_weights" in f or _attr_list(f, "layer_names") is not None:
            self.kind = "legacy Keras model file (HDF5)" if "model_weights" in f else "legacy Keras weights file (HDF5)"
            if self.config is None and "model_config" in f.attrs:
                self.config = _json_attr(self.prefix, f.attrs["model_config"])
            return _legacy(self.prefix, f, h5py)
        if isinstance(f.get("vars"), h5py.Group) or any(isinstance(f.get(c), h5py.Group) for c in _CONTAINERS):
            self.kind = "Keras 3 archive (.keras)" if self._member is not None else "Keras 3 weights file (.weights.h5)"
            walker = _Keras3Walk(self.prefix, h5py, _config_index(self.config))
            walker.visit(f, "", "", root=True)
            return walker.datasets, walker.readable
        top = format_names(sorted(f.keys()), 6) or "nothing"
        raise CorruptCheckpointError(
            f"{self.prefix!r} is an HDF5 file but not Keras weights (its top level holds {top}). restorekit reads "
            f"Keras 3 .weights.h5 and .keras files and legacy Keras 2 .h5 weights; pass one of those"
        )

    # -- mapping protocol: key -> KerasEntry
    @property
    def entries(self) -> Mapping[str, KerasEntry]:
        """Sorted mapping key in the file (``layers/dense/vars/0``) -> KerasEntry."""
        return self._entries

    def __getitem__(self, name: str) -> KerasEntry:
        try:
            return self._entries[self._key(name)]
        except KeyError:
            raise self._unknown(name) from None

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"KerasCheckpoint({self.prefix!r}, {self.kind}, {len(self)} entries)"

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    # -- readable paths (what scan matches by)
    @cached_property
    def object_graph(self):
        """An empty object graph: Keras files are matched by readable path, never by object position."""
        return decode_object_graph(_EMPTY_OBJECT_GRAPH)

    @property
    def object_paths(self) -> Mapping[str, str]:
        """Readable path -> key (``enc1/kernel`` -> ``layers/dense/vars/0``); see the module docstring."""
        return self._paths

    def readable_name(self, name: str) -> str:
        """The readable path of key ``name`` (the key itself when there is none)."""
        return self._readable.get(name, name)

    def is_partitioned(self, name: str) -> bool:
        return False

    def _key(self, name: str) -> str:
        return name if name in self._entries else self._paths.get(name, name)

    def _unknown(self, name: str) -> NoMatchError:
        return NoMatchError(
            f"{self.kind} {self.prefix!r} has no entry {name!r}.", name=name,
            candidates=list(self._entries) + list(self._paths),
        )

    # -- reads
    def read(self, name: str) -> np.ndarray:
        """The tensor stored under key (or readable path) ``name``, as a numpy array.

        Raises:
            NoMatchError: no such entry (lists the closest names).
            CorruptCheckpointError: the file cannot be read.
        """
        return self.read_many([name])[0]

    def read_many(self, names) -> list:
        """Several tensors, opening the file once; the order of ``names``."""
        keys = [self._key(n) for n in names]
        for name, key in zip(names, keys):
            if key not in self._data:
                raise self._unknown(name)
        with self._h5() as f:
            return [self._read_one(f, self._data[k]) for k in keys]

    def _read_one(self, f, data: _Dataset) -> np.ndarray:
        try:
            value = np.asarray(f[data.key][()])
        except (OSError, KeyError, ValueError) as e:
            raise CorruptCheckpointError(f"{self.prefix!r}: cannot read {data.key!r} (truncated or corrupt: {e})") from None
        if data.bfloat16:
            import ml_dtypes

            value = value.astype(ml_dtypes.bfloat16) if value.dtype.kind == "f" else value.view(ml_dtypes.bfloat16)
        if tuple(value.shape) != data.shape:
            raise CorruptCheckpointError(f"{self.prefix!r}: {data.key!r} has shape {value.shape}, not {data.shape}")
        return value


# ---------------------------------------------------------------- zip members

def _check_member(path: str, member: str) -> None:
    parts = member.replace("\\", "/").split("/")
    if member.startswith(("/", "\\")) or ".." in parts or re.match(r"^[A-Za-z]:", member) or "\x00" in member:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive whose member {member!r} would land outside the folder it is unpacked in; "
            f"Keras never writes such a member. Do not load this file with keras; get the model from a trusted source"
        )


def _member_offset(path: str, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes start: after its local header, whose name and extra lengths may differ from the directory's."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _json_member(path: str, archive: zipfile.ZipFile, info):
    if info is None:
        return None
    if info.file_size > _MAX_JSON:
        raise CorruptCheckpointError(f"{path!r}: {info.filename} claims {info.file_size} bytes; not a Keras archive")
    return _json_attr(path, archive.read(info), info.filename)


def _json_attr(path: str, raw, what: str = "model_config"):
    # json.loads only: a config is data; nothing in it is deserialized or run.
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path!r}: {what} is not valid JSON ({e}); save the model again") from None


# ---------------------------------------------------------------- Keras 3 layout

def _config_index(config) -> dict:
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


class _Keras3Walk:
    """Collects the datasets of a Keras 3 weights file with their readable paths."""

    def __init__(self, path: str, h5py, config_index: dict):
        self.path, self.h5py, self.index = path, h5py, config_index
        self.datasets: list = []
        self.readable: dict = {}
        self._taken: set = set()

    def visit(self, group, key: str, scope: str, *, root: bool = False, class_hint: str | None = None) -> None:
        vars_group = group.get("vars")
        if not isinstance(vars_group, self.h5py.Group):
            for name, child in group.items():  # a container: a list of layers named by class
                if isinstance(child, self.h5py.Group):
                    self.visit(child, f"{key}/{name}" if key else name, scope, class_hint=_UNIQUIFIED.sub("", name))
            return
        name = _text(vars_group.attrs.get("name")) or key.rsplit("/", 1)[-1] or "model"
        kind, layer_config = self.index.get(name, (None, None))
        kind = kind or _guess_kind(class_hint, name)
        own = name if root else scope + name
        self._own_variables(vars_group, f"{key}/vars" if key else "vars", own, kind, layer_config, key == "optimizer")
        functional = kind == "functional" or any(
            isinstance(group.get(c), self.h5py.Group) and any(_UNIQUIFIED.sub("", k) == "input_layer" for k in group[c])
            for c in _CONTAINERS
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


def _describe(ds, key: str, path: str) -> _Dataset:
    bfloat16 = _text(ds.attrs.get("dtype")) == "bfloat16"
    try:
        dtype = "bfloat16" if bfloat16 else np.dtype(ds.dtype).name
        if np.dtype(ds.dtype).kind in "OSUV" and not bfloat16:
            dtype = "string"
    except TypeError:
        raise CorruptCheckpointError(f"{path!r}: {key!r} has a dtype numpy does not know ({ds.dtype})") from None
    shape = tuple(int(d) for d in ds.shape) if ds.shape is not None else ()
    itemsize = 2 if bfloat16 else np.dtype(ds.dtype).itemsize
    return _Dataset(key, shape, dtype, int(np.prod(shape, dtype=np.int64)) * itemsize, bfloat16)


def _text(value) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _text(value.item())
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- legacy Keras 2 layout

def _attr_list(group, name: str) -> list[str] | None:
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
    return [_text(v) or str(v) for v in values]


def _legacy_readable(layer: str, weight: str) -> str:
    """``dense_1`` + ``dense_1/kernel:0`` -> ``dense_1/kernel``; the layer's name starts the path."""
    parts = _OUTPUT_INDEX.sub("", weight).split("/")
    if layer in parts:
        return "/".join(parts[parts.index(layer):])
    return "/".join([layer, *parts])


def _legacy(path: str, f, h5py) -> tuple[list, dict]:
    root = f["model_weights"] if "model_weights" in f else f
    layers = _attr_list(root, "layer_names") or []
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
        for weight in _attr_list(group, "weight_names") or []:
            add(group, weight, _legacy_readable(layer, weight))
    optimizer = f.get("optimizer_weights") if root is not f else None
    if isinstance(optimizer, h5py.Group):
        for weight in _attr_list(optimizer, "weight_names") or []:
            add(optimizer, weight, "optimizer/" + _OUTPUT_INDEX.sub("", weight))
    return datasets, readable


def no_shared_layers_error(ckpt: KerasCheckpoint, variable_names) -> NoMatchError:
    """The error for a Keras file whose layers share no name with the model being restored."""
    live = list(dict.fromkeys(n.split("/")[-2] if n.count("/") >= 1 else n for n in variable_names))
    return NoMatchError(
        f"{ckpt.kind} {ckpt.prefix!r} has layers {format_names(ckpt.layer_names, 6)}, and none of them names a "
        f"layer of the model ({format_names(live, 6)}). restorekit pairs Keras layers by name, not by position: "
        f"name the layers as in the file, or map them with rules=[(r'^new_name/', 'old_name/')] or assignment_map=.",
        name=live[0] if live else None, candidates=ckpt.layer_names,
    )
