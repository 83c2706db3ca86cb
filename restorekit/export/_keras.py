"""Keras files in conversions: which requests write a Keras 3 ``.weights.h5``, and writing one from a Keras file.

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
from restorekit.formats._sink import ExportResult

__all__ = ["KERAS", "copy_weights", "is_keras_target"]

KERAS = "keras"


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
