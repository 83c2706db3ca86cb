"""Writing Keras 3 ``.weights.h5`` files and ``.keras`` archives that Keras loads: structure checks, atomic writes.

Keras 3 finds a layer's variables by position: the layer's group (named by attribute or
by class in a list, ``layers/dense_1``) holds ``vars/0``, ``vars/1``, ... and
``Layer.load_own_variables`` refuses a group whose count differs from the layer's. So
an output is checked before anything is written: every tensor is a ``.../vars/N`` key,
each group's indices run 0..n-1, and a layer group of the source keeps its count
(optimizer groups may change: Keras skips a mismatched optimizer with a warning).
A ``.keras`` archive is rewritten whole: its other members (``config.json``,
``metadata.json``, assets) copied as they are, its ``model.weights.h5`` written anew.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import zipfile

import numpy as np

from restorekit.bundle import atomic
from restorekit.bundle.atomic import atomic_output, temp_name
from restorekit.errors import InvalidArgumentError, format_names

__all__ = ["WEIGHTS_MEMBER", "check_structure", "write_archive", "write_weights"]

WEIGHTS_MEMBER = "model.weights.h5"
_COPY_BUFFER = 1 << 20

_KEY = re.compile(r"^(?:(.+)/)?vars/(\d+)$")


def _group_of(key: str) -> tuple[str, int] | None:
    """(layer group, index) of a ``.weights.h5`` key, or None when it is not one."""
    match = _KEY.match(key)
    return (match.group(1) or "", int(match.group(2))) if match else None


def _groups(keys) -> dict:
    out: dict = {}
    for key in keys:
        group, index = _group_of(key)
        out.setdefault(group, []).append(index)
    return out


def check_structure(keys, source_keys=None, *, where: str = "the output") -> None:
    """Refuse a set of keys ``model.load_weights`` could not load (see the module docstring).

    ``source_keys``: the keys of the file the output was edited from; a layer group
    there must keep its number of variables (or be left out whole).

    Raises:
        InvalidArgumentError: a key that is not ``.../vars/N``, a gap in a group's
            indices, or a layer group whose count changed.
    """
    keys = list(keys)
    bad = [k for k in keys if _group_of(k) is None]
    if bad:
        raise InvalidArgumentError(
            f"{where}: a Keras .weights.h5 holds variables as '<layer group>/vars/<index>'; "
            f"{format_names(bad)} {'is not such a key' if len(bad) == 1 else 'are not such keys'}. Keras finds variables by "
            f"position, so a renamed variable would not load: keep the file's keys (rename whole layer groups "
            f"only, 'layers/dense_1/vars/0' -> 'layers/dense_2/vars/0'), or write a TF checkpoint or safetensors"
        )
    groups = _groups(keys)
    for group, indices in groups.items():
        if sorted(indices) != list(range(len(indices))):
            raise InvalidArgumentError(
                f"{where}: layer group {group or '(the model)'!r} would hold variables {sorted(indices)}; "
                f"model.load_weights needs vars/0..vars/{len(indices) - 1} with no gap"
            )
    if source_keys is None:
        return
    for group, indices in _groups(source_keys).items():
        if group in groups and len(groups[group]) != len(indices) and not _is_optimizer(group):
            raise InvalidArgumentError(
                f"{where}: layer group {group or '(the model)'!r} had {len(indices)} variables and would hold "
                f"{len(groups[group])}; Keras' load_own_variables refuses a layer whose variable count differs. "
                f"Delete or add whole layer groups only"
            )


def _is_optimizer(group: str) -> bool:
    return group == "optimizer" or group.startswith("optimizer/")


def write_weights(path, tensors, *, attrs: dict | None = None) -> str:
    """Write ``(key, array)`` pairs as a Keras 3 ``.weights.h5`` file, atomically (temp file, rename).

    ``attrs``: ``{group path: {attribute: value}}`` to set on groups (the ``name``
    Keras stores on each ``vars`` group). bfloat16 arrays are stored as Keras stores
    them (the dataset marked ``dtype='bfloat16'``).

    Raises:
        InvalidArgumentError: keys ``model.load_weights`` could not load (nothing written).
        MissingDependencyError: h5py is not installed.
    """
    path = os.fspath(path)
    tensors = list(tensors) if not isinstance(tensors, list) else tensors
    check_structure([k for k, _ in tensors], where=repr(path))
    with atomic_output(path) as tmp:
        _write_h5(tmp, tensors, attrs)
    return path


def write_archive(path, source, tensors, *, attrs: dict | None = None) -> str:
    """Write a ``.keras`` archive at ``path``, atomically (temp file beside it, then rename): the members
    of the archive ``source`` as they are, in their order, with ``model.weights.h5`` holding ``tensors``
    (as ``write_weights`` writes them; stored, as Keras stores it). ``source`` may be ``path`` itself: it
    is read to the end before the new archive replaces it.

    Raises:
        InvalidArgumentError: keys ``model.load_weights`` could not load (nothing written).
        MissingDependencyError: h5py is not installed.
    """
    path, source = os.fspath(path), os.fspath(source)
    tensors = list(tensors) if not isinstance(tensors, list) else tensors
    check_structure([k for k, _ in tensors], where=repr(path))
    with atomic_output(path) as tmp:
        weights = temp_name(path + ".weights.h5")  # the new member, whole, before it goes into the archive
        try:
            _write_h5(weights, tensors, attrs)
            with zipfile.ZipFile(source) as old, zipfile.ZipFile(tmp, "w") as new:
                for info in old.infolist():
                    if info.filename == WEIGHTS_MEMBER:
                        with open(weights, "rb") as member:
                            _add_member(new, info, member, os.path.getsize(weights), zipfile.ZIP_STORED)
                    else:
                        with old.open(info) as member:
                            _add_member(new, info, member, info.file_size, info.compress_type)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(weights)
    return path


def _add_member(archive, like: zipfile.ZipInfo, data, size: int, compress_type: int) -> None:
    """Copy the stream ``data`` (``size`` bytes) into ``archive`` under the name, time and mode of ``like``."""
    info = zipfile.ZipInfo(like.filename, date_time=like.date_time)
    info.compress_type, info.external_attr, info.comment = compress_type, like.external_attr, like.comment
    info.file_size = size  # lets zipfile choose ZIP64 for a member over 4 GB
    with archive.open(info, "w") as out:
        shutil.copyfileobj(data, out, _COPY_BUFFER)


def _write_h5(path: str, tensors: list, attrs: dict | None) -> None:
    from restorekit.keras_files import _h5py

    h5py = _h5py()
    with h5py.File(path, "w") as f:
        for i, (key, array) in enumerate(tensors):
            array = np.asarray(array() if callable(array) else array)
            bfloat16 = array.dtype.name == "bfloat16"
            ds = f.create_dataset(key, data=array)
            if bfloat16:
                ds.attrs["dtype"] = "bfloat16"
            atomic.crash_point(f"tensor-{i}")
        for group, values in (attrs or {}).items():
            target = f.require_group(group) if group else f
            for name, value in values.items():
                target.attrs[name] = value
