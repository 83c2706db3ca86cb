"""Saving an edited Keras file: back to a Keras 3 ``.weights.h5`` that ``model.load_weights`` accepts, a legacy Keras 2
``.h5`` that tf-keras loads (from a legacy ``.h5`` only), or to another format.

A Keras file is read through h5py, so every tensor of the output is decoded (one at a
time) rather than copied as TF shard bytes. Outputs in Keras' own format keep the file's
keys (``layers/dense/vars/0``), checked by ``restorekit.keras_files._writer.check_structure``;
other formats get the readable paths (``enc1/kernel``) that scan and layout='torch' name by.
"""

from __future__ import annotations

import functools
import os

from restorekit._bundle.files import check_space
from restorekit._bundle.format import dtype_name
from restorekit.edit import _keras_renames as keras_renames
from restorekit.edit._plan import Item
from restorekit.edit._save_shards import save_shards, splits
from restorekit.edit._source import Source
from restorekit.errors import InvalidArgumentError, OutputExistsError
from restorekit._names import Kind, entry_kind

KERAS = "keras"


def is_keras_output(out: str, format: str) -> bool:
    """True when ``out`` / ``format`` ask for a Keras 3 ``.weights.h5`` or sharded ``.weights.json`` set."""
    return format == KERAS or (format == "tf" and os.fspath(out).lower().endswith((".weights.h5", SHARDED)))


SHARDED = ".weights.json"


def without_optimizer(plan: dict[str, Item]) -> dict[str, Item]:
    """``weights_only`` for a Keras file: its optimizer group goes (Keras 3 ``optimizer/``, Keras 2 ``optimizer_weights/``)."""
    return {n: it for n, it in plan.items() if n != "optimizer" and entry_kind(n) is not Kind.OPTIMIZER}


def _decoded(source: Source, plan: dict[str, Item]) -> dict[str, Item]:
    """Every item as a value read on demand (h5py reads; casts and edits applied)."""
    return {name: Item(it.origin, it.dtype, tuple(it.shape), base=functools.partial(source.value, it))
            for name, it in plan.items()}


def _readable(source: Source, plan: dict[str, Item], layer_names: dict) -> dict[str, Item]:
    """Unrenamed entries under their readable paths (``layers/dense/vars/0`` -> ``enc1/kernel``), layers
    renamed by ``layer_names``."""
    ckpt = source.checkpoint
    paths = keras_renames.readable_paths(ckpt, layer_names)[0] if layer_names else {}
    out = {}
    for name, it in plan.items():
        new = paths.get(name, ckpt.readable_name(name)) if name == it.origin else name
        out[new if new not in out and new not in plan else name] = it
    return out


def save_weights_h5(source: Source, plan: dict[str, Item], out: str, *, overwrite: bool,
                    layer_names: dict | None = None) -> str:
    """Write ``plan`` as a ``.weights.h5``; see ``CheckpointEditor.save``. ``layer_names``: renamed layers
    (``{'layers/dense/vars': 'enc9'}``), written as their groups' ``name`` attributes.

    Raises:
        InvalidArgumentError: the source is not a Keras 3 file, or the output could not
            load (see ``check_structure``); nothing is written.
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
    """
    from restorekit.keras_files._writer import write_weights

    ckpt = source.checkpoint
    _check_weights_source(ckpt)
    if not out.lower().endswith(".weights.h5"):
        raise InvalidArgumentError(f"{out!r}: Keras 3 loads weights files named '*.weights.h5'; name the output so")
    if os.path.exists(out) and not overwrite and os.path.realpath(out) != os.path.realpath(ckpt.prefix):
        raise OutputExistsError(path=out)
    if os.path.realpath(out) in {os.path.realpath(f) for f in ckpt.files[1:]}:  # a shard of a sharded set
        raise OutputExistsError(path=out, is_source=True)
    tensors, attrs = _weights(source, plan, out, layer_names)
    write_weights(out, tensors, attrs=attrs)
    return out


def save_legacy_h5(source: Source, plan: dict[str, Item], out: str, *, overwrite: bool) -> str:
    """Write ``plan`` as a legacy Keras 2 ``.h5`` in its source's structure (see
    ``restorekit.keras_files._legacy_writer``); see ``CheckpointEditor.save``.

    Raises:
        OutputNameError: the source is not a legacy Keras 2 ``.h5`` file (nothing is written).
        InvalidArgumentError: an edit the layout cannot hold (a new tensor, a weight moved to another
            layer, a layer that lost some of its weights, bfloat16); nothing is written.
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
    """
    from restorekit.export._targets import legacy_h5_refused
    from restorekit.keras_files._legacy_writer import LegacyLayout, legacy_plan, write_legacy

    ckpt = source.checkpoint
    if not getattr(ckpt, "kind", "").startswith("legacy Keras"):
        raise legacy_h5_refused(out, getattr(ckpt, "kind", None))
    if os.path.exists(out) and not overwrite and os.path.realpath(out) != os.path.realpath(ckpt.prefix):
        raise OutputExistsError(path=out)
    items = [(name, it.origin, dtype_name(it.dtype)) for name, it in plan.items()]
    keys, attrs = legacy_plan(LegacyLayout.of(ckpt), items, where=repr(out))
    check_space(os.path.dirname(os.path.abspath(out)), sum(source.nbytes(plan[k]) for k in keys))
    return write_legacy(out, [(k, lambda it=plan[k]: source.value(it)) for k in keys], attrs)


def save_archive_in_place(source: Source, plan: dict[str, Item], layer_names: dict | None = None) -> str:
    """Rewrite the ``.keras`` archive ``source`` was read from with ``plan`` as its weights; its other
    members are copied as they are. See ``CheckpointEditor.save_in_place``.

    Raises:
        InvalidArgumentError: the output could not load (see ``check_structure``); nothing is written.
    """
    from restorekit.keras_files._writer import write_archive

    ckpt = source.checkpoint
    _check_weights_source(ckpt)
    out = os.path.abspath(ckpt.prefix)
    tensors, attrs = _weights(source, plan, out, layer_names)
    return write_archive(out, out, tensors, attrs=attrs)


def _check_weights_source(ckpt) -> None:
    if not getattr(ckpt, "is_weights_file", False):
        raise InvalidArgumentError(
            f"{ckpt.prefix!r} is a {getattr(ckpt, 'kind', 'TF checkpoint')}; a .weights.h5 is written from a Keras 3 "
            f".weights.h5 or .keras file only (its layer groups are what load_weights reads). Save as format='tf' "
            f"or 'safetensors', or load it into the model and call model.save_weights"
        )


def _weights(source: Source, plan: dict[str, Item], out: str, layer_names: dict | None) -> tuple[list, dict]:
    """``(key, read value)`` pairs and the ``vars`` groups' attributes of a Keras weights output, its
    structure checked to load (``check_structure``) before anything is read or written. Layers without
    variables of their own keep their attributes too (a parent's name scopes its sub-layers' paths);
    a layer whose variables were all deleted leaves with them."""
    from restorekit.keras_files._writer import check_structure

    ckpt = source.checkpoint
    check_structure(list(plan), list(ckpt.entries), where=repr(out))
    check_space(os.path.dirname(os.path.abspath(out)), sum(source.nbytes(it) for it in plan.values()))
    ckpt.check_crc()  # a .keras member is read in place, past zipfile's own CRC check
    group_attrs = ckpt.group_attrs()
    for group, name in (layer_names or {}).items():
        group_attrs[group] = {**group_attrs.get(group, {}), "name": name}
    attrs = {}
    for name, it in plan.items():
        group = name.rpartition("/vars/")[0] or ""
        source_group = (it.origin or "").rpartition("/vars/")[0] if it.origin in ckpt.entries else None
        origin_vars = f"{source_group}/vars" if source_group else "vars"
        if source_group is not None and origin_vars in group_attrs:
            attrs[f"{group}/vars" if group else "vars"] = group_attrs[origin_vars]
    if "vars" in group_attrs:
        attrs.setdefault("vars", group_attrs["vars"])
    had = {name.rpartition("/vars/")[0] for name in ckpt.entries}
    kept = {name.rpartition("/vars/")[0] for name in plan}
    for group, values in group_attrs.items():
        owner = group[: -len("/vars")] if group.endswith("/vars") else ""
        if group in attrs or not owner:
            continue
        if owner not in had or any(k == owner or k.startswith(owner + "/") for k in kept):
            attrs[group] = values  # a layer without variables (Flatten, a parent): its name scopes what it holds
    return [(name, lambda it=it: source.value(it)) for name, it in plan.items()], attrs


def save_other(source: Source, plan: dict[str, Item], out: str, format: str, *, layout, overwrite: bool,
               progress: bool, layer_names: dict | None = None, max_shard_size=None, distributed: bool = False) -> str:
    """Write an edited Keras file as a TF checkpoint (``max_shard_size``: in data shards of at most that size),
    safetensors shards (``max_shard_size``, across ranks with ``distributed``) or a file of the export registry,
    under readable paths."""
    plan = _readable(source, _decoded(source, plan), layer_names or {})
    source.checkpoint.check_crc()  # a .keras member is read in place, past zipfile's own CRC check
    if splits(format, max_shard_size, distributed):
        return save_shards(source, plan, out, format, layout=layout, max_shard_size=max_shard_size,
                           overwrite=overwrite, progress=progress, distributed=distributed)
    if format == "tf":
        from restorekit.formats.tf._writer import data_parts, write_tf

        prefix = out[: -len(".index")] if out.endswith(".index") else out
        if os.path.exists(prefix + ".index") and not overwrite:
            raise OutputExistsError(path=prefix)
        check_space(os.path.dirname(os.path.abspath(prefix)), sum(source.nbytes(it) for it in plan.values()))
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        tensors = ((name, source.value(it), dtype_name(it.dtype)) for name, it in plan.items())
        parts = data_parts([(name, source.nbytes(it)) for name, it in plan.items()], max_shard_size=max_shard_size)
        return write_tf(prefix, tensors, progress=progress, parts=parts).path
    from restorekit.edit._save_export import save_export

    return save_export(source, plan, out, format, overwrite=overwrite, layout=layout, progress=progress)


def save_sharded(source: Source, plan: dict[str, Item], out: str, *, overwrite: bool, max_shard_size,
                 layer_names: dict | None = None, in_place: bool = False) -> str:
    """Write ``plan`` as a Keras 3 sharded set (``out`` = ``NAME.weights.json`` + ``NAME_0000N.weights.h5``);
    see ``CheckpointEditor.save``. ``in_place``: ``out`` is the source set, replaced whole.

    Raises:
        InvalidArgumentError: the source is not a Keras 3 file, a bad or missing ``max_shard_size``, a tensor
            over it, or an output that could not load; nothing is written.
        OutputExistsError: ``out`` exists and ``overwrite`` is False, or a shard of the output would be a
            file of the source.
    """
    from restorekit.keras_files._writer import (check_structure, keras_size, set_files, shard_layout, shard_paths,
                                               write_order, write_sharded)

    ckpt = source.checkpoint
    _check_weights_source(ckpt)
    if not out.endswith(SHARDED):
        raise InvalidArgumentError(f"{out!r}: Keras loads a sharded set through an index named '*{SHARDED}'")
    limit = _shard_limit(ckpt, max_shard_size)
    if os.path.exists(out) and not overwrite and not in_place:
        raise OutputExistsError(path=out)
    check_structure(list(plan), list(ckpt.entries), where=repr(out))
    sizes = {name: keras_size(it.shape, dtype_name(it.dtype)) for name, it in plan.items()}
    # a tensor over the limit is refused here, before anything is read
    parts, _ = shard_layout([(k, sizes[k]) for k in write_order(plan)], limit, where=repr(out))
    old = set_files(out) if os.path.exists(out) else []
    sources = {os.path.realpath(f) for f in ckpt.files}
    if not in_place and any(os.path.realpath(p) in sources for p in [*shard_paths(out, len(parts)), *old]):
        raise OutputExistsError(path=out, is_source=True)
    tensors, attrs = _weights(source, plan, out, layer_names)
    write_sharded(out, tensors, sizes=sizes, max_shard_size=limit, attrs=attrs, replace=tuple(old))
    return out


def _shard_limit(ckpt, max_shard_size) -> float:
    """Bytes per shard: ``max_shard_size`` (bytes, or ``'500MB'``, ``'2GiB'``), or for a sharded source the
    largest shard it has, which cuts the same tensors into the same shards again."""
    if max_shard_size is None:
        shard_of = getattr(ckpt, "shard_of", None)
        if shard_of is None:
            raise InvalidArgumentError(
                f"a sharded Keras set needs max_shard_size= (bytes, or a size such as '500MB'); {ckpt.prefix!r} "
                f"is one file, with no shard size to keep"
            )
        from restorekit.keras_files._writer import keras_size

        per_shard: dict = {}
        for key, entry in ckpt.entries.items():
            per_shard[shard_of(key)] = per_shard.get(shard_of(key), 0) + keras_size(entry.shape, entry.dtype)
        return max(per_shard.values(), default=1.0) or 1.0
    if isinstance(max_shard_size, float):
        raise InvalidArgumentError(
            f"max_shard_size={max_shard_size!r}: restorekit takes bytes or a size string ('2GiB' is Keras' "
            f"max_shard_size=2), not a float"
        )
    from restorekit.formats.safetensors._shards import parse_size

    return float(parse_size(max_shard_size))
