"""The numpy ``.npz`` format, both verbs: archives read from their ``.npy`` headers and written one tensor at a time.

    tensors = restorekit.formats.npz.read('model.npz')     # no pickle; a deflate bomb refused by size
    restorekit.formats.npz.write('out.npz', tensors)        # streamed, atomic; np.load reads it
"""

from __future__ import annotations

from restorekit.formats.npz._reader import (
    FORMAT,
    RECORD,
    SUFFIXES,
    NpzReader,
    read,
    read_record,
    read_shapes,
    recognizes,
)
from restorekit.formats.npz._writer import LAYOUTS, write, write_checkpoint

__all__ = ["FORMAT", "LAYOUTS", "RECORD", "SUFFIXES", "NpzReader", "read", "read_record", "read_shapes",
           "recognizes", "write", "write_checkpoint"]
