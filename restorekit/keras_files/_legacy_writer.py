"""Writing legacy Keras 2 HDF5 files (tf-keras ``model.save('x.h5')`` / ``save_weights('x.h5')``) from one, atomically.

tf-keras loads such a file by position: ``layer_names`` (on the root of a weights file, on
``model_weights`` of a model file) lists the layers in order, and each layer group's
``weight_names`` lists its weights in the order the layer made them; a layer whose count
differs from the model's is refused. So an output keeps its source's structure and is
checked before anything is written: every tensor stays in the layer group it came from (a
rename within the group is written to ``weight_names`` at the weight's place), a layer keeps
all of its weights or none, and nothing new is added. Every attribute of the source (``backend``,
``keras_version``, ``model_config``, a weightless layer's empty ``weight_names``) is copied as
stored. Without any of its ``optimizer_weights`` a model file also loses ``training_config``,
as tf-keras writes ``model.save(path, include_optimizer=False)``: ``load_model`` then gives
the model uncompiled. The file is written by ``_writer``'s HDF5 writer through the commit
path (``atomic_output``: a temporary file beside the output, renamed over it when whole).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from restorekit._bundle.staging import atomic_output
from restorekit.errors import InvalidArgumentError, format_names
from restorekit.keras_files._layouts import attrs_list

__all__ = ["LEGACY_SUFFIXES", "LegacyLayout", "is_legacy_name", "legacy_plan", "write_legacy"]

LEGACY_SUFFIXES = (".h5", ".hdf5")
MODEL_WEIGHTS = "model_weights"
OPTIMIZER = "optimizer_weights"
# tf-keras' HDF5_OBJECT_HEADER_LIMIT: a list attribute larger than this is stored as chunks 'name0', 'name1', ...
_HEADER_LIMIT = 64512


def is_legacy_name(path) -> bool:
    """True for an output named as a legacy Keras HDF5 file (``x.h5``, ``x.hdf5``), not a Keras 3 ``x.weights.h5``."""
    lower = os.fspath(path).lower()
    return lower.endswith(LEGACY_SUFFIXES) and not lower.endswith(".weights.h5")


@dataclass(frozen=True)
class LegacyLayout:
    """The structure of a legacy Keras 2 file: where its weights are, in which order, and every group's attributes."""

    path: str
    root: str  # 'model_weights' in a model file, '' in a weights file
    attrs: dict  # group ('' for the file's root) -> {attribute: value as stored}
    layers: tuple  # layer_names, in order
    weights: dict  # weight group (a layer's, 'optimizer_weights') -> its weight_names, in order

    @classmethod
    def of(cls, ckpt) -> "LegacyLayout":
        """The layout of the legacy Keras file ``ckpt`` (a ``KerasCheckpoint``)."""
        attrs = ckpt.legacy_attrs()
        root = MODEL_WEIGHTS if MODEL_WEIGHTS in attrs else ""
        layers = tuple(attrs_list(attrs[root], "layer_names") or ())
        weights = {group: tuple(attrs_list(values, "weight_names") or ())
                   for group, values in attrs.items() if group not in ("", root)}
        return cls(ckpt.prefix, root, attrs, layers, weights)

    def group_of(self, key: str) -> str | None:
        """The weight group holding ``key`` (``model_weights/conv/conv/kernel:0`` -> ``model_weights/conv``), or None."""
        if key.startswith(OPTIMIZER + "/"):
            return OPTIMIZER if OPTIMIZER in self.weights else None
        parts = key.split("/")
        depth = 2 if self.root else 1
        if len(parts) <= depth or (self.root and parts[0] != self.root):
            return None
        group = "/".join(parts[:depth])
        return group if group in self.weights and group != OPTIMIZER else None


def legacy_plan(layout: LegacyLayout, items, *, where: str) -> tuple[list[str], dict]:
    """``(keys in write order, {group: attributes})`` of an output holding ``items`` (``(name, origin, dtype)``),
    checked to load with tf-keras (see the module docstring) before anything is read or written.

    Raises:
        InvalidArgumentError: a tensor outside the layer group it came from, a new tensor, a layer that
            lost some of its weights, a dtype tf-keras cannot read from HDF5, or weights the source holds
            outside its layers.
    """
    source_keys = {f"{g}/{w}": g for g, names in layout.weights.items() for w in names}
    hidden = [g for g, names in layout.weights.items()
              if names and g != OPTIMIZER and g.rpartition("/")[2] not in layout.layers]
    if hidden:
        raise InvalidArgumentError(
            f"{layout.path!r} holds weights in {format_names(hidden)}, outside the layers its layer_names list, "
            f"which restorekit does not read; a legacy .h5 output would lose them. Save as a TF checkpoint or "
            f"safetensors instead"
        )
    kept: dict = {}  # origin -> output name
    for name, origin, dtype in items:
        group = layout.group_of(name)
        if origin not in source_keys or group is None or source_keys[origin] != group:
            what = "is new" if origin not in source_keys else f"comes from {source_keys[origin]!r}"
            raise InvalidArgumentError(
                f"{where}: {name!r} {what}; a legacy Keras .h5 holds each weight in its own layer's group, found "
                f"by position in weight_names, so it can keep, rename within the layer, change or delete the "
                f"source's weights but not add or move one. Save as a TF checkpoint or safetensors for that"
            )
        if dtype in ("bfloat16", "string") or origin in kept:
            raise InvalidArgumentError(
                f"{where}: {name!r} " + (f"is {dtype}, which tf-keras cannot load from HDF5; cast it to float16 "
                                         f"or float32" if origin not in kept else f"repeats {kept[origin]!r}")
            )
        kept[origin] = name
    for group, names in layout.weights.items():
        count = sum(f"{group}/{w}" in kept for w in names)
        if group != OPTIMIZER and 0 < count < len(names):
            raise InvalidArgumentError(
                f"{where}: layer {group.rpartition('/')[2]!r} had {len(names)} weights and would hold {count}; "
                f"tf-keras loads a layer's weights by position and refuses a count that differs. Keep or delete "
                f"whole layers"
            )
    return _layout_out(layout, kept)


def _layout_out(layout: LegacyLayout, kept: dict) -> tuple[list[str], dict]:
    keys: list = []
    attrs = {"": dict(layout.attrs[""])}
    if layout.root:
        attrs[layout.root] = dict(layout.attrs[layout.root])
    layers = []
    for group, names in layout.weights.items():
        new = [kept[f"{group}/{w}"] for w in names if f"{group}/{w}" in kept]
        if names and not new:
            continue  # every weight deleted: the layer (or the optimizer) leaves with them
        if group.rpartition("/")[2] in layout.layers and group != OPTIMIZER:
            layers.append(group.rpartition("/")[2])
        keys.extend(new)
        values = dict(layout.attrs[group])
        if new != [f"{group}/{w}" for w in names]:
            _set_names(values, "weight_names", [n[len(group) + 1:] for n in new])
        attrs[group] = values
    if OPTIMIZER not in attrs and OPTIMIZER in layout.weights:
        attrs[""].pop("training_config", None)  # as model.save(include_optimizer=False) writes it
    layers = [name for name in layout.layers if name in layers]
    if layers != list(layout.layers):
        _set_names(attrs[layout.root], "layer_names", layers)
    return keys, attrs


def _set_names(values: dict, name: str, names: list[str]) -> None:
    """Replace the list attribute ``name`` in ``values`` by ``names``, stored as the source stored it and
    chunked where tf-keras chunks it (``save_attributes_to_hdf5_group``)."""
    like = next((values[k] for k in (name, f"{name}0") if k in values), None)
    for key in [k for k in values if k == name or (k.startswith(name) and k[len(name):].isdigit())]:
        del values[key]
    encoded = np.array([n.encode("utf-8") for n in names], dtype="S") if names else np.zeros((0,))
    if like is not None and like.dtype.kind == "O":
        stored = np.array([n if (like.dtype.metadata or {}).get("vlen") is str else n.encode("utf-8") for n in names],
                          dtype=like.dtype) if names else encoded
    else:
        stored = encoded
    chunks = 1
    while any(part.nbytes > _HEADER_LIMIT for part in np.array_split(encoded, chunks)):
        chunks += 1
    if chunks == 1:
        values[name] = stored
        return
    for i, part in enumerate(np.array_split(stored, chunks)):
        values[f"{name}{i}"] = part


def write_legacy(path, tensors, attrs: dict) -> str:
    """Write ``(key, array or callable)`` pairs and ``{group: attributes}`` (from ``legacy_plan``) as a legacy
    Keras HDF5 file at ``path``, atomically (temporary file beside it, renamed over it when whole).

    Raises:
        OutputExistsError: another process is writing ``path``.
        WriteFailedError: the write failed; nothing is left behind.
    """
    from restorekit.keras_files._writer import _write_h5

    path = os.fspath(path)
    with atomic_output(path) as tmp:
        _write_h5(tmp, list(tensors), attrs)
    return path
