"""Keras files in conversions: which requests write a Keras 3 ``.weights.h5`` or a legacy Keras 2 ``.h5``, and
writing one from a Keras file of the same kind.

Not a format module of the registry (it defines no ``FORMAT``): a ``.weights.h5`` holds
variables by position under layer groups, so it can be written only from a file that
has those groups (a Keras 3 ``.weights.h5`` or ``.keras``), never from names alone.
Reading Keras files is ``restorekit.keras_files.KerasCheckpoint``'s job; conversions
from them name tensors by readable path (``layouts._planned.keras_source``).
"""

from __future__ import annotations

import os

from restorekit._bundle.files import check_space
from restorekit.errors import InvalidArgumentError, OutputExistsError
from restorekit.export._request import KERAS_LEGACY
from restorekit.formats._sink import ExportResult

__all__ = ["KERAS", "KERAS_LEGACY", "copy_legacy", "copy_weights", "is_keras_target", "is_legacy_target"]

KERAS = "keras"


def is_legacy_target(out: str, to: str | None) -> bool:
    """True when ``convert(..., out, to=to)`` names a legacy Keras ``.h5`` / ``.hdf5`` (``to`` left out)."""
    from restorekit.keras_files._legacy_writer import is_legacy_name

    return to is None and is_legacy_name(out)


def is_keras_target(out: str, to: str | None) -> bool:
    """True when ``convert(..., out, to=to)`` asks for a Keras 3 ``.weights.h5``."""
    return to == KERAS or (to is None and os.fspath(out).lower().endswith(".weights.h5"))


def copy_weights(ckpt, out: str, *, weights_only: bool = False, overwrite: bool = False) -> ExportResult:
    """Write the weights of a Keras 3 file (``.weights.h5`` or ``.keras``) as a ``.weights.h5``.

    ``weights_only`` leaves the optimizer group out (Keras then skips the optimizer,
    with a warning, when a compiled model loads the file).

    Raises:
        InvalidArgumentError: the source is not a Keras 3 file (legacy Keras 2 HDF5 and
            TF checkpoints have no layer groups to write), or ``out`` is not ``*.weights.h5``.
        OutputExistsError: ``out`` is the source, or exists without ``overwrite``.
    """
    from restorekit.keras_files._writer import check_structure, write_weights

    if not getattr(ckpt, "is_weights_file", False):
        kind = getattr(ckpt, "kind", "TF checkpoint")
        raise InvalidArgumentError(
            f"{ckpt.prefix!r} is a {kind}: a .weights.h5 holds variables by position under Keras layer groups, which "
            f"only a Keras 3 .weights.h5 or .keras file has. Restore it into the model (restorekit.scan + restore) "
            f"and call model.save_weights('model.weights.h5')"
        )
    out = os.fspath(out)
    if not out.lower().endswith(".weights.h5"):
        raise InvalidArgumentError(f"{out!r}: Keras 3 loads weights files named '*.weights.h5'; name the output so")
    if os.path.exists(out):
        if os.path.realpath(out) in {os.path.realpath(f) for f in getattr(ckpt, "files", (ckpt.prefix,))}:
            raise OutputExistsError(path=out, is_source=True)
        if not overwrite:
            raise OutputExistsError(path=out)
    keys = [k for k in ckpt.entries if not (weights_only and k.startswith("optimizer/"))]
    check_structure(keys, list(ckpt.entries), where=repr(out))
    check_space(os.path.dirname(os.path.abspath(out)), sum(ckpt.entries[k].nbytes for k in keys))
    ckpt.check_crc()  # a .keras member is read in place, past zipfile's own CRC check
    write_weights(out, [(k, lambda k=k: ckpt.read(k)) for k in keys], attrs=ckpt.group_attrs())
    dropped = tuple(k for k in ckpt.entries if k not in set(keys))
    return ExportResult(out, KERAS, len(keys), sum(ckpt.entries[k].nbytes for k in keys), dropped=dropped)


def copy_legacy(ckpt, out: str, *, weights_only: bool = False, overwrite: bool = False) -> ExportResult:
    """Write a legacy Keras 2 ``.h5`` (model or weights file) again as one, in its structure
    (``restorekit.keras_files._legacy_writer``); ``weights_only`` leaves out ``optimizer_weights``
    (and with it ``training_config``, as ``model.save(include_optimizer=False)`` does).

    Raises:
        OutputNameError: the source is not a legacy Keras 2 ``.h5`` (nothing is written).
        OutputExistsError: ``out`` is the source, or exists without ``overwrite``.
    """
    from restorekit.export._targets import legacy_h5_refused
    from restorekit.keras_files._legacy_writer import LegacyLayout, legacy_plan, write_legacy

    kind = getattr(ckpt, "kind", None)
    if not (kind or "").startswith("legacy Keras"):
        raise legacy_h5_refused(out, kind)
    out = os.fspath(out)
    if os.path.exists(out):
        if os.path.realpath(out) in {os.path.realpath(f) for f in ckpt.files}:
            raise OutputExistsError(path=out, is_source=True)
        if not overwrite:
            raise OutputExistsError(path=out)
    items = [(k, k, e.dtype) for k, e in ckpt.entries.items() if not (weights_only and k.startswith("optimizer_weights/"))]
    keys, attrs = legacy_plan(LegacyLayout.of(ckpt), items, where=repr(out))
    check_space(os.path.dirname(os.path.abspath(out)), sum(ckpt.entries[k].nbytes for k in keys))
    write_legacy(out, [(k, lambda k=k: ckpt.read(k)) for k in keys], attrs)
    dropped = tuple(k for k in ckpt.entries if k not in set(keys))
    return ExportResult(out, KERAS_LEGACY, len(keys), sum(ckpt.entries[k].nbytes for k in keys), dropped=dropped)
