"""Checkpoint surgery: ``CheckpointEditor`` renames, changes, adds, deletes and casts tensors, then saves safely.

Built on our own bundle writer (``bundle/writer.py``) because TF's writer cannot copy
stored bytes verbatim or reuse shards, which is what keeps edits of many-GB
checkpoints fast and memory-bounded. The package, bottom to top::

    plan         one frozen Item per output tensor; name lookups
    source       crc-checked reads of the source: chunks, values, streamed casts/concats
    values       value edits (set, copy_rows, add, concat, cast) as new items
    renames      name edits (rename, rename_all, delete, strip optimizer state)
    save_tf      TF output: shard reuse or compaction, staging, checks of kept bytes
    save_export  torch / safetensors / npz output through restorekit.export
    save_remote  gs:// and other remote outputs: write locally, upload
    editor       CheckpointEditor, the public class
"""

from __future__ import annotations

from restorekit.edit._editor import CheckpointEditor

__all__ = ["CheckpointEditor"]
