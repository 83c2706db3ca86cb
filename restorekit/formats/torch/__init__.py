"""The PyTorch format, both verbs: ``state_dict`` files (``.pt``, ``.pth``, ``.bin``) read and written.

    tensors = restorekit.formats.torch.read('model.pt')     # (stored name, array); no pickle code runs
    restorekit.formats.torch.write('out.pt', tensors)        # torch.save, atomic

``_reader`` reads zip and legacy (pre-1.6) files, nested training checkpoints and
TorchScript archives through the restricted reader of ``_torchfile`` / ``_torchscript``;
``_writer`` writes with ``torch.save`` through the one commit path. torch is imported only
inside the verbs that need it.
"""

from __future__ import annotations

from restorekit.formats.torch._reader import (
    FORMAT,
    SUFFIXES,
    TorchReader,
    load,
    read,
    read_metadata,
    read_record,
    read_shapes,
    recognizes,
    to_numpy,
)
from restorekit.formats.torch._writer import LAYOUTS, from_numpy, write, write_checkpoint

__all__ = ["FORMAT", "LAYOUTS", "SUFFIXES", "TorchReader", "from_numpy", "load", "read", "read_metadata",
           "read_record", "read_shapes", "recognizes", "to_numpy", "write", "write_checkpoint"]
