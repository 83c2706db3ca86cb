"""Checkpoints seen through a plan: renamed or filtered entries, computed values, a re-encoded TF2 object graph.

What a view hands the writers in place of the ``Checkpoint`` it was made from: ``PlannedCheckpoint``
(the output of an edit or a conversion plan), ``WithObjectGraph`` (a raw-copied subset whose
object graph is rewritten) and ``keras_source`` (a Keras file under its readable paths).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from restorekit._bundle.objectgraph import OBJECT_GRAPH_KEY
from restorekit._names import is_weight
from restorekit._registry import Entry

__all__ = ["PlannedCheckpoint", "WithObjectGraph", "keras_source"]


class WithObjectGraph:
    """A ``Checkpoint`` whose TF2 object graph entry reads as ``raw`` (a re-encoded graph).

    Lets the raw-copy exporters (``write_checkpoint``) write a subset or renamed set of an
    object-based checkpoint with its graph rewritten to match, at copy speed.
    """

    def __init__(self, checkpoint, raw: bytes):
        self._checkpoint = checkpoint
        self._raw = raw

    def __getattr__(self, name):
        return getattr(self._checkpoint, name)

    def read(self, name, *args, **kwargs):
        if name == OBJECT_GRAPH_KEY:
            return np.array(self._raw, dtype=object)
        return self._checkpoint.read(name, *args, **kwargs)

    @property
    def object_graph(self):
        from restorekit._bundle.objectgraph import decode_object_graph

        return decode_object_graph(self._raw)


class PlannedCheckpoint:
    """A checkpoint seen as the output of a plan: ``names`` ({output name: source entry}, in
    order), some values computed (``computed``: {output name: (TF dtype, shape, nbytes, read
    function)}), the TF2 object graph re-encoded as ``graph`` (raw bytes, or None: as stored).

    Duck-types what ``torch_view`` and the writers read of a ``Checkpoint``, so that a
    renamed, filtered or edited checkpoint is mapped to torch layer by layer as a whole
    (the view takes no ``names=``), with raw shard bytes still copied for stored tensors.
    """

    def __init__(self, checkpoint, names: dict, *, graph: bytes | None = None, computed: dict | None = None):
        self._checkpoint = checkpoint
        self._names = dict(names)
        self._graph = graph
        self._computed = dict(computed or {})
        self.prefix = checkpoint.prefix
        entries = {}
        for out, source in self._names.items():
            if out in self._computed:
                dtype, shape, nbytes, _ = self._computed[out]
                entries[out] = Entry(out, tuple(shape), dtype, nbytes)
            else:
                entry = checkpoint.entries[source]
                entries[out] = Entry(out, tuple(entry.shape), entry.dtype, entry.nbytes)
        self.entries = entries
        self.is_object_based = OBJECT_GRAPH_KEY in entries

    @property
    def config(self):
        """The source's Keras model config where it has one (a Keras file's): layout 'torch' reads its Flattens."""
        return getattr(self._checkpoint, "config", None)

    @cached_property
    def object_graph(self):
        if not self.is_object_based:
            return None
        if self._graph is None:
            return self._checkpoint.object_graph
        from restorekit._bundle.objectgraph import decode_object_graph

        return decode_object_graph(self._graph)

    def read(self, name: str) -> np.ndarray:
        if name in self._computed:
            return self._computed[name][3]()
        if name == OBJECT_GRAPH_KEY and self._graph is not None:
            return np.array(self._graph, dtype=object)
        return self._checkpoint.read(self._names[name])

    def is_partitioned(self, name: str) -> bool:
        """True when ``name`` must be read (computed, or partitioned in the source), not copied as raw bytes."""
        return name in self._computed or self._checkpoint.is_partitioned(self._names[name])

    def bundle_entry(self, name: str):
        return self._checkpoint.bundle_entry(self._names[name])

    def data_file(self, shard_id: int) -> str:
        return self._checkpoint.data_file(shard_id)

    def readable_name(self, name: str) -> str:
        return name


def keras_source(ckpt, *, weights_only: bool = False):
    """A Keras file (``KerasCheckpoint``) as the checkpoint it holds under readable paths (``enc1/kernel``),
    the names scan, TF checkpoints and layout 'torch' use; ``weights_only`` leaves out its optimizer group.
    Its ``stored_range`` lets the safetensors writer copy the bytes of plain datasets as they lie in the file.
    A ``.keras`` archive's weights member is checked against its zip CRC-32 first (a conversion reads it whole).

    Raises:
        ChecksumMismatchError: the ``.keras`` weights member's bytes changed.
    """
    ckpt.check_crc()
    names = {}
    for key in ckpt.entries:
        path = ckpt.readable_name(key)
        if weights_only and not is_weight(key, path=path):
            continue
        names[path if path not in names else key] = key
    return _KerasSource(ckpt, names)


class _KerasSource(PlannedCheckpoint):
    """A Keras file under readable paths, with the byte ranges of its plain datasets (``stored_range``)."""

    def __init__(self, ckpt, names: dict):
        super().__init__(ckpt, names)
        self._keras, self._keys = ckpt, dict(names)

    def stored_range(self, name: str):
        """``KerasCheckpoint.stored_range`` of the entry named ``name`` here: (path, offset, size) or None."""
        return self._keras.stored_range(self._keys[name])
