"""The safetensors format, both verbs: one ``.safetensors`` file or a Hugging Face shard set, read and written.

    tensors = restorekit.formats.safetensors.read('model.safetensors')       # (stored name, array), streamed
    restorekit.formats.safetensors.write('out.safetensors', tensors)           # streamed, atomic

``_reader`` reads one file or a shard set (a subclass of the one-file reader, the same
verbs); ``_writer`` writes one file tensor by tensor (with raw byte copies from TF shards);
``_shards`` writes a Hugging Face shard set and its ``model.safetensors.index.json``.
Every write goes through the one commit path (``restorekit._bundle``).
"""

from __future__ import annotations

from restorekit.formats.safetensors._reader import (
    FORMAT,
    INDEX_SUFFIX,
    SUFFIXES,
    Header,
    SafetensorsReader,
    ShardSet,
    ShardedSafetensorsReader,
    TensorInfo,
    find,
    open_reader,
    open_tensors,
    read,
    read_header,
    read_record,
    read_shapes,
    recognizes,
    shard_set,
)
from restorekit.formats.safetensors._writer import LAYOUTS, write, write_checkpoint

__all__ = ["FORMAT", "INDEX_SUFFIX", "LAYOUTS", "SUFFIXES", "Header", "SafetensorsReader", "ShardSet",
           "ShardedSafetensorsReader", "TensorInfo", "find", "open_reader", "open_tensors", "read", "read_header",
           "read_record", "read_shapes", "recognizes", "shard_set", "write", "write_checkpoint"]
