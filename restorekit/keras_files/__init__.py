"""Keras files as checkpoints: Keras 3 ``.weights.h5``, ``.keras`` and sharded ``.weights.json``, legacy Keras 2 HDF5.

``reader.KerasCheckpoint`` reads one file (its docstring describes the layouts);
``sharded.ShardedKerasCheckpoint`` subclasses it for a sharded Keras 3 set, as Keras'
``ShardedH5IOStore`` subclasses ``H5IOStore``. Which of the two opens a path is the
format registry's choice (``restorekit.formats.keras``), reached through
``restorekit.Checkpoint(path)`` or ``restorekit.formats.open(path)``. ``_writer`` writes
Keras 3 files and ``_legacy_writer`` legacy Keras 2 ``.h5`` files (from a legacy ``.h5``),
both through the one commit path.
"""

from __future__ import annotations

from restorekit.keras_files._reader import (
    INSTALL,
    KERAS_SUFFIXES,
    SHARDED_SUFFIX,
    KerasCheckpoint,
    KerasEntry,
    is_keras_path,
    no_shared_layers_error,
)
from restorekit.keras_files._sharded import ShardedKerasCheckpoint

__all__ = ["INSTALL", "KERAS_SUFFIXES", "SHARDED_SUFFIX", "KerasCheckpoint", "KerasEntry", "ShardedKerasCheckpoint",
           "is_keras_path", "no_shared_layers_error", "open_keras"]


def open_keras(path) -> KerasCheckpoint:
    """The reader of the Keras file at ``path``: a ``ShardedKerasCheckpoint`` for a ``.weights.json`` index."""
    import os

    cls = ShardedKerasCheckpoint if os.fspath(path).lower().endswith(SHARDED_SUFFIX) else KerasCheckpoint
    return cls(path)
