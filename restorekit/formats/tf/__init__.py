"""The TF bundle format, both verbs: ``PREFIX.index`` + ``PREFIX.data-*`` read as a Source and written.

``_reader`` registers the format (name-based and TF2 object-based checkpoints, SavedModel
variables; the reader itself is ``restorekit.Checkpoint``); ``_writer`` writes a stream of
converted tensors as a checkpoint of one or more data shards balanced by bytes, and
``_rawimport`` copies safetensors bytes into the data shards at ``cp`` speed where they are
already TF's. Every write goes through the one commit path (``restorekit._bundle``).
"""

from __future__ import annotations

from restorekit.formats.tf._reader import detect
from restorekit.formats.tf._writer import data_parts, write_tf

__all__ = ["detect", "data_parts", "write_tf"]
