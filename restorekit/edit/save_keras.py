"""Saving an edited Keras file: back to a Keras 3 ``.weights.h5`` that ``model.load_weights`` accepts, or to another format.

A Keras file is read through h5py, so every tensor of the output is decoded (one at a
time) rather than copied as TF shard bytes. Outputs in Keras' own format keep the file's
keys (``layers/dense/vars/0``), checked by ``restorekit.keras_files.writer.check_structure``;
other formats get the readable paths (``enc1/kernel``) that scan and layout='torch' name by.
"""

from __future__ import annotations

import os

from restorekit.bundle.files import check_space
from restorekit.bundle.format import dtype_name
from restorekit.edit.plan import Item
from restorekit.edit.source import Source
from restorekit.errors import InvalidArgumentError, OutputExistsError

KERAS = "keras"


def is_keras_output(out: str, format: str) -> bool:
    """True when ``out`` / ``format`` ask for a Keras 3 ``.weights.h5``."""
    return format == KERAS or (format == "tf" and os.fspath(out).lower().endswith(".weights.h5"))


def without_optimizer(plan: dict[str, Item]) -> dict[str, Item]:
    """``weights_only`` for a Keras file: its optimizer group goes."""
    return {n: it for n, it in plan.items() if not n.startswith("optimizer/") and n != "optimizer"}


def _decoded(source: Source, plan: dict[str, Item]) -> dict[str, Item]:
    """Every item as a value read on demand (h5py reads; casts and edits applied)."""
    return {name: Item(it.origin, it.dtype, tuple(it.shape), base=lambda it=it: source.value(it))
            for name, it in plan.items()}


def _readable(source: Source, plan: dict[str, Item]) -> dict[str, Item]:
    """Unrenamed entries under their readable paths (``layers/dense/vars/0`` -> ``enc1/kernel``)."""
    ckpt = source.checkpoint
    out = {}
    for name, it in plan.items():
        new = ckpt.readable_name(name) if name == it.origin else name
        out[new if new not in out and new not in plan else name] = it
    return out


def save_weights_h5(source: Source, plan: dict[str, Item], out: str, *, overwrite: bool) -> str:
    """Write ``plan`` as a ``.weights.h5``; see ``CheckpointEditor.save``.

    Raises:
        InvalidArgumentError: the source is not a Keras 3 file, or the output could not
            load (see ``check_structure``); nothing is written.
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
    """
    from restorekit.keras_files.writer import write_weights

    ckpt = source.checkpoint
    _check_weights_source(ckpt)
    if not out.lower().endswith(".weights.h5"):
        raise InvalidArgumentError(f"{out!r}: Keras 3 loads weights files named '*.weights.h5'; name the output so")
    if os.path.exists(out) and not overwrite and os.path.realpath(out) != os.path.realpath(ckpt.prefix):
        raise OutputExistsError(path=out)
    if os.path.realpath(out) in {os.path.realpath(f) for f in ckpt.files[1:]}:  # a shard of a sharded set
        raise OutputExistsError(path=out, is_source=True)
    tensors, attrs = _weights(source, plan, out)
    write_weights(out, tensors, attrs=attrs)
    return out


def save_archive_in_place(source: Source, plan: dict[str, Item]) -> str:
    """Rewrite the ``.keras`` archive ``source`` was read from with ``plan`` as its weights; its other
    members are copied as they are. See ``CheckpointEditor.save_in_place``.

    Raises:
        InvalidArgumentError: the output could not load (see ``check_structure``); nothing is written.
    """
    from restorekit.keras_files.writer import write_archive

    ckpt = source.checkpoint
    _check_weights_source(ckpt)
    out = os.path.abspath(ckpt.prefix)
    tensors, attrs = _weights(source, plan, out)
    return write_archive(out, out, tensors, attrs=attrs)


def _check_weights_source(ckpt) -> None:
    if not getattr(ckpt, "is_weights_file", False):
        raise InvalidArgumentError(
            f"{ckpt.prefix!r} is a {getattr(ckpt, 'kind', 'TF checkpoint')}; a .weights.h5 is written from a Keras 3 "
            f".weights.h5 or .keras file only (its layer groups are what load_weights reads). Save as format='tf' "
            f"or 'safetensors', or load it into the model and call model.save_weights"
        )


def _weights(source: Source, plan: dict[str, Item], out: str) -> tuple[list, dict]:
    """``(key, read value)`` pairs and the ``vars`` groups' attributes of a Keras weights output, its
    structure checked to load (``check_structure``) before anything is read or written."""
    from restorekit.keras_files.writer import check_structure

    ckpt = source.checkpoint
    check_structure(list(plan), list(ckpt.entries), where=repr(out))
    check_space(os.path.dirname(os.path.abspath(out)), sum(source.nbytes(it) for it in plan.values()))
    ckpt.check_crc()  # a .keras member is read in place, past zipfile's own CRC check
    group_attrs = ckpt.group_attrs()
    attrs = {}
    for name, it in plan.items():
        group = name.rpartition("/vars/")[0] or ""
        source_group = (it.origin or "").rpartition("/vars/")[0] if it.origin in ckpt.entries else None
        origin_vars = f"{source_group}/vars" if source_group else "vars"
        if source_group is not None and origin_vars in group_attrs:
            attrs[f"{group}/vars" if group else "vars"] = group_attrs[origin_vars]
    if "vars" in group_attrs:
        attrs.setdefault("vars", group_attrs["vars"])
    return [(name, lambda it=it: source.value(it)) for name, it in plan.items()], attrs


def save_other(source: Source, plan: dict[str, Item], out: str, format: str, *, layout, overwrite: bool,
               progress: bool) -> str:
    """Write an edited Keras file as a TF checkpoint or a file of the export registry, under readable paths."""
    plan = _readable(source, _decoded(source, plan))
    source.checkpoint.check_crc()  # a .keras member is read in place, past zipfile's own CRC check
    if format == "tf":
        from restorekit.export.conversions import write_tf

        if layout is not None:
            raise InvalidArgumentError(f"layout={layout!r} applies to torch and safetensors files, not format='tf'")
        prefix = out[: -len(".index")] if out.endswith(".index") else out
        if os.path.exists(prefix + ".index") and not overwrite:
            raise OutputExistsError(path=prefix)
        check_space(os.path.dirname(os.path.abspath(prefix)), sum(source.nbytes(it) for it in plan.values()))
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        tensors = ((name, source.value(it), dtype_name(it.dtype)) for name, it in plan.items())
        return write_tf(prefix, tensors, progress=progress).path
    from restorekit.edit.save_export import save_export

    return save_export(source, plan, out, format, overwrite=overwrite, layout=layout, progress=progress)
