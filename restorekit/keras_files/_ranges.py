"""Where a Keras HDF5 dataset's bytes lie in its file, when they are the tensor's bytes as stored.

Read through h5py's low-level API (h5py has no call that answers this in one step).
"""

from __future__ import annotations

import numpy as np

from restorekit.keras_files._h5nodes import NODES
from restorekit.keras_files._layouts import Dataset

__all__ = ["stored_range"]


def stored_range(h5py, where, data: Dataset, standard: dict) -> tuple[int, int] | None:
    """(offset in its HDF5 file, size) of the dataset for ``data`` when its stored bytes are the tensor's
    little-endian bytes as they are (see ``KerasCheckpoint.stored_range``), else None. ``where`` is the
    dataset's node (or open low-level id), or the id of its file to open it from by key. Read through h5py's
    low-level API: the high-level objects cost more than the answer (~0.1 ms a dataset). ``standard``
    caches the standard little-endian HDF5 type of each dtype."""
    if data.dtype == "string" or data.nbytes == 0:
        return None
    plist = None
    if isinstance(where, NODES.Dataset):  # a walked node, its creation properties already read
        where, plist = where.id, where.plist
    try:
        ds = where if isinstance(where, h5py.h5d.DatasetID) else h5py.h5d.open(where, data.key.encode("utf-8"))
        offset = ds.get_offset()  # None when no storage was allocated
        if offset is None or ds.get_storage_size() != data.nbytes:
            return None
        plist = plist or ds.get_create_plist()
        if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() or plist.get_external_count():
            return None
        stored = ds.get_type()
        if data.bfloat16:  # Keras writes bfloat16 as 2-byte opaque values: the raw bits read() views
            plain = stored.get_class() == h5py.h5t.OPAQUE and stored.get_size() == 2
        else:
            if data.dtype not in standard:
                standard[data.dtype] = h5py.h5t.py_create(np.dtype(data.dtype).newbyteorder("<"))
            # equal to the standard little-endian type: byte order, size, precision, float layout
            plain = stored.get_class() in (h5py.h5t.INTEGER, h5py.h5t.FLOAT) and stored.equal(standard[data.dtype])
    except (TypeError, ValueError, KeyError, RuntimeError, OSError):  # h5py cannot say: read() decodes it (or reports it)
        return None
    return (int(offset), data.nbytes) if plain else None
