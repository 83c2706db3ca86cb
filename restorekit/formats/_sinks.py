"""The one table of the file formats restorekit writes: name -> format package, and file suffix -> name.

A format that writes is one package of ``restorekit.formats`` (its reader and its writer
side by side) that defines ``FORMAT`` (its name), ``SUFFIXES`` and ``LAYOUTS`` (the
``layout=`` values it accepts), and offers the same verbs with the same arguments::

    write(path, tensors, *, layout=None, metadata=None, graph=None, progress=False) -> ExportResult
    write_checkpoint(checkpoint, path, *, names=None, layout=None, metadata=None, progress=False) -> ExportResult
    read(path) -> iterator of (stored name, ndarray)
    read_shapes(path) -> {stored name: shape}
    read_record(path) -> LayoutRecord | None
    recognizes(head: bytes, suffix: str) -> bool      (a file's first 16 bytes, its lower-case suffix)

An argument a format cannot honour is refused with ``InvalidArgumentError``. The
packages are found by listing ``restorekit.formats``, so adding a format is adding its package;
a format module imports no framework (torch, ...) at import time, only in its verbs.
``convert``, ``export_checkpoint``, ``import_checkpoint`` and ``CheckpointEditor.save``
all dispatch through :func:`module`. ``'tf'`` (a checkpoint prefix) is the hub they
convert from and to, and has no module here.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from types import ModuleType

from restorekit.errors import InvalidArgumentError

TF = "tf"


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, ModuleType]:
    """Format name -> package, for every format of ``restorekit.formats`` that writes (imported on first use)."""
    found = {}
    for info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        candidate = importlib.import_module(f"{__package__}.{info.name}")
        name = getattr(candidate, "FORMAT", None)
        if isinstance(name, str) and callable(getattr(candidate, "write_checkpoint", None)):
            found[name] = candidate
    return found


def names() -> tuple[str, ...]:
    """Every format name: 'tf' first, then the file formats."""
    return (TF, *modules())


def module(name: str) -> ModuleType:
    """The module of file format ``name``.

    Raises:
        InvalidArgumentError: no such file format.
    """
    try:
        return modules()[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown format {name!r}; choose one of {', '.join(names())}") from None


def by_suffix(path) -> str | None:
    """The format a path's suffix names (``.pt`` -> 'torch'), or None."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    for name, mod in modules().items():
        if suffix in mod.SUFFIXES:
            return name
    return None


def sniff(path: str) -> str | None:
    """The format a file's first bytes say it holds, else its suffix's, else None."""
    with open(path, "rb") as f:
        head = f.read(16)
    suffix = os.path.splitext(path)[1].lower()
    for name, mod in modules().items():
        if mod.recognizes(head, suffix):
            return name
    return by_suffix(path)
