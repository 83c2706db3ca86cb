"""Hugging Face-style sharded safetensors, written: ``model-0000N-of-0000M.safetensors`` + ``model.safetensors.index.json``.

Reading a set of shards is ``restorekit.formats.safetensors.ShardedSafetensorsReader``
(the one-file reader's subclass). Writing (:func:`write_checkpoint`, :func:`write`): tensors in order, a new shard
whenever the next tensor would take the current one over ``max_shard_size`` (a tensor
larger than that gets a shard of its own), as ``save_pretrained`` does. Each shard is a
complete safetensors file carrying restorekit's layout record for its own tensors, so
import undoes everything an export did. One shard is written as ``model.safetensors``
without an index, as ``save_pretrained`` does. Every file is staged, then published
shards first and the index last: a crash leaves the old output, the new one, or none.
A ``config.json`` is staged with them and renamed first (the old output removed before
it), so the weights never become visible without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re

from restorekit._bundle import crashpoints, files
from restorekit._bundle.ranks import assign
from restorekit._bundle.staging import Staging, check_written, written_file
from restorekit._bundle.sweep import sweep_stale
from restorekit.errors import InvalidArgumentError, OutputError, OutputExistsError
from restorekit.formats.safetensors import _reader, _writer
from restorekit.formats._sink import ExportResult
from restorekit.layouts import LayoutRecord
from restorekit.formats.safetensors._reader import _SHARD, INDEX_SUFFIX, _shard_name

__all__ = ["output_files", "parse_size", "write", "write_checkpoint"]

LAYOUTS = _writer.LAYOUTS  # a set of shards takes the layouts one safetensors file takes
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value) -> int:
    """Bytes from an int or a string such as ``'5GB'`` (10**9) or ``'2GiB'`` (2**30), as ``save_pretrained`` reads them.

    Raises:
        InvalidArgumentError: not a positive size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).upper() not in _UNITS:
            raise InvalidArgumentError(f"max_shard_size={value!r} is not a size such as 5000000, '500MB' or '2GiB'")
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise InvalidArgumentError(f"max_shard_size={value!r} must be positive")
    return size


# ------------------------------------------------------------------ writing
def output_files(out, count: int) -> tuple[str, list[str], str | None]:
    """(directory, shard paths, index path or None) of a sharded output ``out`` in ``count`` shards.

    ``out`` is a directory (files named ``model...``) or a path ending in ``.safetensors``
    (its stem names the files, beside it).
    """
    out = os.path.abspath(os.fspath(out))
    if out.endswith(".safetensors"):
        directory, stem = os.path.dirname(out), os.path.basename(out)[: -len(".safetensors")]
    else:
        directory, stem = out, "model"
    if count <= 1:
        return directory, [os.path.join(directory, stem + ".safetensors")], None
    shards = [os.path.join(directory, _shard_name(stem, i, count)) for i in range(1, count + 1)]
    return directory, shards, os.path.join(directory, stem + INDEX_SUFFIX)


def previous_files(out) -> list[str]:
    """The files of an earlier sharded (or single-file) output at ``out``: index first, then shards."""
    directory, (single,), _ = output_files(out, 1)
    stem = os.path.basename(single)[: -len(".safetensors")]
    try:
        names = os.listdir(directory)
    except OSError:  # a directory that can be written but not listed: what can be asked for by name
        return [p for p in (os.path.join(directory, stem + INDEX_SUFFIX), single) if os.path.lexists(p)]
    index = [os.path.join(directory, stem + INDEX_SUFFIX)] if stem + INDEX_SUFFIX in names else []
    shards = sorted(os.path.join(directory, n) for n in names
                    if (m := _SHARD.fullmatch(n)) and m.group("stem") == stem)
    return index + shards + ([single] if os.path.basename(single) in names else [])


def partition(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_shard_size`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    total = 0
    for name, size in sizes:
        if shards[-1] and total + size > max_shard_size:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += size
    return shards


def check_output(out, *, overwrite: bool) -> list[str]:
    """Refuse an existing output (unless ``overwrite``); return the old files to replace.

    What a killed writer left first goes (``sweep_stale``): the shards its commit renamed before the index
    are no output, and must not stop the rerun."""
    directory = output_files(out, 1)[0]
    if os.path.isdir(directory):
        sweep_stale(directory)
    old = previous_files(out)
    if old and not overwrite:
        raise OutputExistsError(path=old[0])
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise InvalidArgumentError(f"sharded output {out!r}: {directory!r} is a file, not a directory")
    return old


def stage_texts(staging, texts: dict | None) -> tuple:
    """Stage small text files (path -> text, e.g. a ``config.json``); return their paths.

    Staged before the weights, they are renamed before them: a crash leaves them beside
    no new weights (``sweep_stale`` removes them) or beside complete ones.
    """
    for path, text in (texts or {}).items():
        with open(staging.path(path), "w", encoding="utf-8") as f:
            f.write(text)
    return tuple(texts or ())


def publish_file(out, write, *, texts: dict) -> ExportResult:
    """``write(tmp)`` one weights file, published with ``texts`` (path -> text) in one commit: texts first, ``out`` last.

    An existing ``out`` is removed first, so a crash never shows old weights beside a new ``config.json``.
    """
    final = os.path.abspath(os.fspath(out))
    with Staging(os.path.dirname(final), output=final) as staging:
        extra = stage_texts(staging, texts)
        result = write(staging.path(final))
        staging.commit(remove_before=[final] if os.path.exists(final) else [])
    return dataclasses.replace(result, path=os.fspath(out), files=(os.fspath(out),) + extra)


def _publish(out, parts: list, overwrite: bool, write_one, texts: dict | None = None, *, ranks=None,
             nbytes: list | None = None, skip_one=None) -> ExportResult:
    """Stage ``texts`` and ``write_one(tmp, part)`` for every shard, write the index, then publish texts first,
    shards next, the index (or the single file) last. With ``ranks``, each rank writes its shards
    (``_publish_ranks``)."""
    if ranks is not None:
        return _publish_ranks(out, parts, overwrite, write_one, texts, ranks, nbytes or [0] * len(parts),
                              skip_one or (lambda part: None))
    old = _check_names(out, len(parts), overwrite)
    directory, paths, index = output_files(out, len(parts))
    results = []
    weight_map: dict = {}
    with Staging(directory, output=output_files(out, 1)[1][0]) as staging:
        extra = stage_texts(staging, texts)
        for k, (path, part) in enumerate(zip(paths, parts), 1):
            result = write_one(staging.path(path), part)
            results.append(result)
            weight_map.update({name: os.path.basename(path) for name in _reader.read_shapes(staging.path(path))})
            crashpoints.crash_point(f"shard-{k}-staged")
        _finish(staging, out, old, results, weight_map, bool(extra))
    return _result(out, results, extra)


def _check_names(out, count: int, overwrite: bool) -> list[str]:
    """The old files to replace (``check_output``); without ``overwrite``, every new name asked for itself."""
    old = check_output(out, overwrite=overwrite)
    _, paths, index = output_files(out, count)
    if not overwrite:  # each name asked for itself: a directory that cannot be listed hides nothing
        taken = [p for p in (*paths, index) if p is not None and os.path.lexists(p)]
        if taken:
            raise OutputExistsError(path=taken[0])
    return old


def _finish(staging, out, old: list, results: list, weight_map: dict, extra: bool) -> None:
    """Write the index of the staged shards (when there are several), then commit: texts, shards, index."""
    _, paths, index = output_files(out, len(results))
    if index is not None:
        text = json.dumps({"metadata": {"total_size": sum(r.nbytes for r in results)}, "weight_map": weight_map},
                          indent=2, sort_keys=True)
        with open(staging.path(index), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        crashpoints.crash_point("index-json-written")
    if extra:
        # A new config.json must never sit beside old weights: the old output goes first, index first.
        staging.commit(remove_before=old)
    else:
        staging.commit(remove_before=[p for p in old if p not in paths and p != index])


def _result(out, results: list, extra: tuple) -> ExportResult:
    _, paths, index = output_files(out, len(results))
    first = results[0]
    return ExportResult(
        index or paths[0], "safetensors", sum(r.count for r in results), sum(r.nbytes for r in results), first.layout,
        tuple(n for r in results for n in r.permuted), tuple(n for r in results for n in r.strings),
        tuple(n for r in results for n in r.kept), files=tuple(paths) + ((index,) if index else ()) + extra,
    )


def _publish_ranks(out, parts: list, overwrite: bool, write_one, texts, ranks, nbytes: list, skip_one) -> ExportResult:
    """``_publish`` across ranks: rank 0 checks the output and opens the staging directory; each rank writes the
    shards ``ranks.assign`` gives it there; rank 0 gathers every rank's (shard, size, crc32c), checks them,
    writes the index and commits. An exchange after each step stops every rank when one failed."""
    directory, paths, index = output_files(out, len(parts))
    owner = assign(nbytes, ranks.size)
    ranks.at("staging")
    with contextlib.ExitStack() as stack:
        staging, old, extra = None, [], ()
        if ranks.rank == 0:
            old = _check_names(out, len(parts), overwrite)
            staging = stack.enter_context(Staging(directory, output=output_files(out, 1)[1][0]))
            extra = stage_texts(staging, texts)
        tmpdir = ranks.exchange("staging", staging.tmpdir if staging is not None else None)[0]
        ranks.at("writing")
        mine = []
        for k, (path, part) in enumerate(zip(paths, parts), 1):
            if owner[k - 1] != ranks.rank:
                skip_one(part)
                continue
            tmp = os.path.join(tmpdir, os.path.basename(path))
            result = write_one(tmp, part)
            mine.append((k, result, list(_reader.read_shapes(tmp)), *written_file(tmp)))
            crashpoints.crash_point(f"shard-{k}-staged")
        crashpoints.crash_point("rank-shards-staged")
        written = sorted((item + (rank,) for rank, items in enumerate(ranks.exchange("writing", mine)) for item in items),
                         key=lambda item: item[0])
        if [item[0] for item in written] != list(range(1, len(parts) + 1)):
            raise OutputError(f"the ranks wrote shards {[item[0] for item in written]} of {len(parts)}: "
                              "they planned differently (is every rank given the same source and options?)")
        ranks.at("publishing")
        results = [item[1] for item in written]
        if staging is not None:
            weight_map = {}
            for k, result, names, size, crc, ident, rank in written:
                tmp = staging.path(paths[k - 1])
                check_written(tmp, size, crc, ident, rank)
                weight_map.update({name: os.path.basename(paths[k - 1]) for name in names})
            crashpoints.crash_point("ranks-gathered")
            _finish(staging, out, old, results, weight_map, bool(extra))
            ranks.published = True
        extra = tuple(ranks.exchange("publishing", extra)[0])
    return _result(out, results, extra)


def write_checkpoint(checkpoint, out, *, names: dict | None = None, layout: str | None = None,
                     metadata: dict | None = None, max_shard_size, overwrite: bool = False,
                     progress: bool = False, texts: dict | None = None, ranks=None) -> ExportResult:
    """Write a TF checkpoint (or the renamed subset ``names``) as sharded safetensors; each shard
    is written by ``_writer.write_checkpoint``, raw shard bytes copied where possible.

    ``texts`` (path -> text, a ``config.json``) are published in the same commit, before the weights.
    ``ranks`` (``restorekit._bundle.ranks.Ranks``): every rank of a process group calls this alike and
    writes the shards assigned to it, byte for byte what one process writes; rank 0 commits.

    Raises:
        OutputExistsError: an earlier output is there (without ``overwrite``).
        NameCollisionError, InvalidArgumentError: before anything is written.
        CorruptCheckpointError: a data shard of the checkpoint is missing (before anything is written).
    """
    limit = parse_size(max_shard_size)
    header = getattr(checkpoint, "header", None)  # views and planned checkpoints check their source when read
    if getattr(checkpoint, "prefix", None) is not None and header is not None:
        files.check_shard_files(checkpoint.prefix, header.num_shards)  # before anything is written
    names = dict(names) if names is not None else {n: n for n in checkpoint.entries}
    record = LayoutRecord.for_checkpoint(checkpoint, layout)
    sizes = []
    for name, source in names.items():
        entry = checkpoint.entries[source]
        if entry.dtype != "string":
            record.plan(name, entry.shape)  # a name collision fails here, before anything is written
            sizes.append((name, entry.nbytes))
    parts = partition(sizes, limit)
    # String tensors (the TF2 object graph) travel in the first shard's record.
    parts[0] = [n for n, source in names.items() if checkpoint.entries[source].dtype == "string"] + parts[0]

    def write_one(tmp, part):
        return _writer.write_checkpoint(checkpoint, tmp, names={n: names[n] for n in part}, layout=layout,
                                            metadata=metadata, progress=progress)

    return _publish(out, parts, overwrite, write_one, texts, ranks=ranks, nbytes=_part_bytes(parts, sizes))


def write(out, tensors, *, sizes: list, layout: str | None = None, metadata: dict | None = None, graph=None,
          max_shard_size, overwrite: bool = False, progress: bool = False, texts: dict | None = None,
          ranks=None) -> ExportResult:
    """Write ``(name, ndarray[, TF dtype])`` items as sharded safetensors, one tensor at a time.

    ``sizes`` lists ``(name, shape, bytes)`` of the numeric tensors in the order ``tensors``
    yields them (string tensors are not listed: they go with the shard being written).
    With ``ranks`` (as ``write_checkpoint``), the items of another rank's shards are passed over
    unwritten: give them as placeholders (``rank_names`` says which are this rank's) so that none is read.

    Raises:
        NameCollisionError: the layout maps two names onto one, in any shards (before anything is written).
    """
    limit = parse_size(max_shard_size)
    record = LayoutRecord(layout, graph=graph)
    for name, shape, _ in sizes:
        record.plan(name, shape)
    parts = partition([(name, nbytes) for name, _, nbytes in sizes], limit)
    stream = iter(tensors)
    pending: list = []

    def part_tensors(part, last):
        wanted = len(part)
        while wanted or last:
            item = pending.pop() if pending else next(stream, None)
            if item is None:
                return
            if not _is_string(item):
                if not wanted:  # the next shard's first tensor
                    pending.append(item)
                    return
                wanted -= 1
            yield item

    def write_one(tmp, part):
        last = part is parts[-1]
        return _writer.write(tmp, part_tensors(part, last), layout=layout, metadata=metadata, graph=graph,
                                 progress=progress)

    def skip_one(part):
        for _ in part_tensors(part, part is parts[-1]):
            pass

    nbytes = _part_bytes(parts, [(name, size) for name, _, size in sizes])
    return _publish(out, parts, overwrite, write_one, texts, ranks=ranks, nbytes=nbytes, skip_one=skip_one)


def _part_bytes(parts: list, sizes: list) -> list[int]:
    size = dict(sizes)
    return [sum(size.get(name, 0) for name in part) for part in parts]


def rank_names(sizes: list, max_shard_size, ranks) -> set | None:
    """The names of ``sizes`` (``(name, shape, bytes)``, as ``write`` takes them) in the shards ``ranks``'s rank
    writes; None without ranks (every name)."""
    if ranks is None:
        return None
    parts = partition([(name, nbytes) for name, _, nbytes in sizes], parse_size(max_shard_size))
    owner = assign(_part_bytes(parts, [(name, nbytes) for name, _, nbytes in sizes]), ranks.size)
    return {name for part, rank in zip(parts, owner) if rank == ranks.rank for name in part}


def _is_string(item) -> bool:
    dtype = item[2] if len(item) > 2 else None
    return dtype == "string" or getattr(getattr(item[1], "dtype", None), "kind", "") == "O"
