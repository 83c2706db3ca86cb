"""Any readable source opened as a checkpoint, for ``inspect``, ``verify`` and ``diff``: ``restorekit.formats.open``.

The non-TF files (safetensors, PyTorch, npz) are ``FileView``s, now in
``restorekit.formats.files``; their names stay importable from here.
"""

from __future__ import annotations

from restorekit.formats import open_source
from restorekit.formats.files import FileVerifyResult, FileView

__all__ = ["FileView", "FileVerifyResult", "open_checkpoint"]


def open_checkpoint(path):
    """A checkpoint-like view of ``path`` (``restorekit.formats.open``): ``Checkpoint`` for TF, ``KerasCheckpoint``
    for Keras files, ``FileView`` for the other formats. An object that is already open is returned as it is.

        ckpt = open_checkpoint('model.safetensors')
        ckpt.entries['dense/kernel'].shape, ckpt.read('dense/kernel')

    Raises:
        CheckpointNotFoundError: nothing readable at ``path``.
        CorruptCheckpointError: the file is not a readable file of the format it claims.
    """
    return open_source(path)
