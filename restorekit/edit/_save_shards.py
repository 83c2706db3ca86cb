"""Saving an edited checkpoint as a Hugging Face safetensors shard set, in one process or across the ranks of a
torch.distributed process group: the edited checkpoint handed to the writer ``convert`` uses
(``export._from_checkpoint.write_file``), so locking, the shard plan, the ranks' split and the one commit are
convert's own."""

from __future__ import annotations

import os

from restorekit._bundle import files
from restorekit.edit._plan import Item
from restorekit.edit._save_export import edited_checkpoint
from restorekit.edit._save_tf import final_plan
from restorekit.edit._source import Source
from restorekit.errors import OutputError

__all__ = ["save_shards", "splits"]


def splits(format: str, max_shard_size, distributed: bool) -> bool:
    """True when ``CheckpointEditor.save`` writes through :func:`save_shards`: safetensors shards, or any output
    asked for ``distributed`` (refused there by ``_bundle.ranks.distribute`` unless it is a shard set)."""
    return distributed or (format == "safetensors" and max_shard_size is not None)


def save_shards(source: Source, plan: dict[str, Item], out, format: str, *, layout: str | None, max_shard_size,
                overwrite: bool, progress: bool, distributed: bool) -> str:
    """Write ``plan`` as safetensors shards of at most ``max_shard_size`` bytes plus their index (``out`` a
    directory, or ``NAME.safetensors`` naming the files beside it); see ``CheckpointEditor.save``.

    With ``distributed``, every rank of the process group calls this alike (``_bundle.ranks.distribute``):
    each computes the edited values of its own shards only, writes them into rank 0's staging directory, and
    rank 0 publishes the set in one commit, byte for byte what one process writes.

    Returns:
        The index file (or the single ``model.safetensors`` of a set of one).

    Raises:
        OptionNotApplicableError: ``distributed`` for an output that is not a safetensors shard set.
        OutputError: a remote (``gs://``) output: shards are written to a POSIX file system.
        RankFailedError: with ``distributed``, a rank failed or was killed (it is named); nothing was published.
    """
    from restorekit.export._from_checkpoint import write_file
    from restorekit.export._request import request
    from restorekit.formats._sink import checkpoint_files

    out = os.fspath(out)
    sharded = format == "safetensors" and max_shard_size is not None
    if sharded and files.is_remote(out):
        raise OutputError(f"{out!r}: a safetensors shard set is written to a local or shared POSIX file system; "
                          "copy it to remote storage after")
    options = request(layout=layout, max_shard_size=max_shard_size)
    ckpt = source.checkpoint
    sources = tuple(ckpt.files) if hasattr(ckpt, "files") else tuple(checkpoint_files(ckpt.prefix))

    def work(ranks) -> str:
        edited = edited_checkpoint(source, final_plan(source, plan))  # computed values are read on demand
        return write_file(edited, sources, os.path.abspath(out), "safetensors", options, overwrite=overwrite,
                          progress=progress, ranks=ranks).path

    if not distributed:
        return work(None)
    from restorekit._bundle.ranks import distribute

    return distribute(out, work, to=format, sharded=sharded)
