"""Write a stream of converted tensors as a TF checkpoint: one data shard, or several balanced by bytes."""

from __future__ import annotations

import os

from restorekit._bundle.staging import Staging
from restorekit.formats import _sinks as formats
from restorekit.formats.tf import _rawimport as rawimport
from restorekit.formats._sink import ExportResult, checkpoint_files, progress_bar

__all__ = ["data_parts", "write_tf"]


def write_tf(out_prefix: str, tensors, *, layout=None, permuted=(), total=None, progress=False,
             parts=None) -> ExportResult:
    """Write ``(name, array, TF dtype or None)`` as the checkpoint ``out_prefix``, replacing exactly its old files
    (staged beside it, published with the ``.index`` last).

    ``parts`` (``bundle.writer.balance`` of the tensors' sizes) writes ``len(parts)`` data
    shards, each tensor into the one that lists it; a tensor no part lists (a string
    tensor) goes into the first. Bytes copied as they lie (``rawimport``) are copied per shard.
    """
    from restorekit._bundle.writer import BundleWriter

    count = nbytes = 0
    strings = []
    shard_of = {name: k for k, part in enumerate(parts or ((),)) for name in part}
    old = checkpoint_files(out_prefix)  # the .index first: the old checkpoint stops existing at once
    with Staging(os.path.dirname(os.path.abspath(out_prefix)), output=out_prefix) as staging:
        writer = BundleWriter(out_prefix, num_shards=len(parts or ((),)), staging=staging)
        try:
            with progress_bar(total, progress, "tf") as bar:
                runs = [rawimport.RawRuns(writer.shard(k), bar) for k in range(writer.num_shards)]
                try:
                    for name, array, dtype in tensors:
                        if dtype == "string":
                            strings.append(name)
                        count += 1
                        nbytes += _add(writer.shard(shard_of.get(name, 0)), runs[shard_of.get(name, 0)], name,
                                       array, dtype, bar)
                    for run in runs:
                        run.flush()
                finally:
                    for run in runs:
                        run.close()
            writer.finish(commit=False)
        except BaseException:
            writer.abort()
            raise
        staging.commit(remove_before=old)
    return ExportResult(out_prefix, formats.TF, count, nbytes, layout, tuple(permuted), tuple(strings))


def data_parts(sizes, *, num_shards: int | None = None, max_shard_size=None) -> tuple | None:
    """``write_tf``'s ``parts`` for ``sizes`` (``[(name, bytes)]`` in write order): ``num_shards`` runs balanced by
    bytes (``bundle.writer.balance``), or runs of at most ``max_shard_size`` bytes each (a larger tensor alone, as
    safetensors shards are cut: ``sharded.partition``); None for one data shard."""
    from restorekit._bundle.writer import balance
    from restorekit.formats.safetensors._shards import parse_size, partition

    if num_shards is not None:
        return balance(sizes, num_shards)
    if max_shard_size is not None:
        return tuple(tuple(part) for part in partition(list(sizes), parse_size(max_shard_size)))
    return None


def _add(shard, runs, name: str, array, dtype, bar) -> int:
    """Write one tensor of ``write_tf`` into ``shard`` (bytes copied as they lie go to ``runs``); return its byte count."""
    from restorekit._bundle.writer import array_chunks

    if isinstance(array, rawimport.StoredBytes):
        runs.add(name, array, dtype)  # the bar moves as the run is copied
        return array.nbytes
    runs.flush()  # what the runs hold goes first: the shard is written in order
    if dtype is not None and dtype != "string":
        # add_stream keeps dtypes numpy cannot name (qint8 stored as int8, ...).
        shard.add_stream(name, dtype, array.shape, array_chunks(array))
    else:
        shard.add(name, array)
    size = array.nbytes if array.dtype != object else 0
    bar.update(size)
    return size
