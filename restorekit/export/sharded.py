"""Hugging Face-style sharded safetensors: ``model-0000N-of-0000M.safetensors`` + ``model.safetensors.index.json``, both ways.

Reading: a directory of shards, or its ``*.safetensors.index.json``, is one set of
tensors (:func:`find`, then the same verbs as a format module: ``read``,
``read_shapes``, ``read_record``). A shard missing from the set, an index naming a file
that is not there, shards of two saves mixed in one directory, or a tensor the index
and the shards disagree about is a ``CorruptCheckpointError`` before anything is read.

Writing (:func:`write_checkpoint`, :func:`write`): tensors in order, a new shard
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

import dataclasses
import json
import os
import re
from dataclasses import dataclass

from restorekit.bundle import atomic, files
from restorekit.bundle.jsonfile import read_json
from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidArgumentError, OutputExistsError
from restorekit.export import safetensors
from restorekit.export.base import ExportResult
from restorekit.export.layout import LayoutRecord

__all__ = ["ShardSet", "find", "output_files", "parse_size", "read", "read_record", "read_shapes", "write",
           "write_checkpoint"]

LAYOUTS = safetensors.LAYOUTS  # a set of shards takes the layouts one safetensors file takes
INDEX_SUFFIX = ".safetensors.index.json"
_SHARD = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors")
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


@dataclass(frozen=True)
class ShardSet:
    """A set of safetensors shards read as one: its files in order, and the index's weight map (None without one)."""

    files: tuple
    index: str | None = None
    weight_map: dict | None = None

    @property
    def path(self) -> str:
        return self.index or os.path.dirname(self.files[0])


def _bad(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where!r} is not a complete set of safetensors shards: {why}")


def find(path) -> ShardSet | None:
    """The shard set at ``path`` (a directory or an index file), or None when ``path`` is neither.

    A directory holding one ``*.safetensors.index.json`` is read through it; one without
    an index but with ``NAME-0000N-of-0000M.safetensors`` files (or a single
    ``model.safetensors``) is read from those.

    Raises:
        CorruptCheckpointError: shards missing, mixed, or an unreadable index.
    """
    path = os.fspath(path)
    if path.endswith(".index.json") and os.path.exists(path) and not os.path.isdir(path):
        return _from_index(path)  # refuses a FIFO or device by name
    if not os.path.isdir(path):
        return None
    names = sorted(os.listdir(path))
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if len(indexes) > 1:
        raise _bad(path, f"it holds {len(indexes)} index files ({', '.join(indexes)}); name the one to read")
    if indexes:
        return _from_index(os.path.join(path, indexes[0]))
    groups: dict[tuple, set] = {}
    for n in names:
        m = _SHARD.fullmatch(n)
        if m:
            groups.setdefault((m.group("stem"), int(m.group("n"))), set()).add(int(m.group("i")))
    if not groups:
        single = [n for n in names if n.endswith(".safetensors")]
        return ShardSet((os.path.join(path, single[0]),)) if len(single) == 1 else None
    if len(groups) > 1:
        saves = ", ".join(f"{stem}-*-of-{n:05d}" for stem, n in sorted(groups))
        raise _bad(path, f"shards of {len(groups)} different saves are mixed in it ({saves})")
    (stem, total), present = next(iter(groups.items()))
    missing = [_shard_name(stem, i, total) for i in range(1, total + 1) if i not in present]
    if missing or total == 0:
        raise _bad(path, f"missing {', '.join(missing) or 'every shard'}")
    return ShardSet(tuple(os.path.join(path, _shard_name(stem, i, total)) for i in range(1, total + 1)))


def _from_index(index: str) -> ShardSet:
    data = read_json(index, "safetensors index").value
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(f"{index!r} is not a safetensors index (its weight_map is not an object of "
                                     f"name -> file)")
    directory = os.path.dirname(os.path.abspath(index))
    files = list(dict.fromkeys(weight_map.values()))
    if not files:
        raise _bad(index, "its weight_map is empty")
    for name in files:
        if os.path.basename(name) != name:
            raise _bad(index, f"it names {name!r}, not a file beside it")
    missing = [name for name in files if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise _bad(index, f"it names {', '.join(repr(m) for m in missing)}, which {'is' if len(missing) == 1 else 'are'} not in {directory!r}")
    stems = {(m.group("stem"), m.group("n")) for m in map(_SHARD.fullmatch, files) if m}
    strays = [n for n in os.listdir(directory) if n not in files and (m := _SHARD.fullmatch(n))
              and any(m.group("stem") == stem for stem, _ in stems)]
    if strays:
        raise _bad(index, f"{', '.join(sorted(strays))} in the same directory belong to another save; remove them")
    return ShardSet(tuple(os.path.join(directory, n) for n in files), index, dict(weight_map))


def _shard_name(stem: str, i: int, total: int) -> str:
    return f"{stem}-{i:05d}-of-{total:05d}.safetensors"


def _headers(shards: ShardSet) -> list:
    """Each shard's parsed header, checked against the index and against the other shards."""
    headers = []
    owner: dict[str, str] = {}
    for path in shards.files:
        header = safetensors.read_header(path)
        for name in header.tensors:
            if name in owner:
                raise _bad(shards.path, f"tensor {name!r} is in both {owner[name]!r} and {path!r}")
            owner[name] = path
            if shards.weight_map is not None and shards.weight_map.get(name) != os.path.basename(path):
                raise _bad(shards.path, f"tensor {name!r} is in {os.path.basename(path)!r}, the index says "
                                        f"{shards.weight_map.get(name)!r}")
        headers.append(header)
    if shards.weight_map is not None:
        absent = [n for n in shards.weight_map if n not in owner]
        if absent:
            raise _bad(shards.path, f"the index lists {', '.join(repr(n) for n in absent[:5])}, which no shard holds")
    return headers


def read_shapes(shards: ShardSet) -> dict:
    """Stored name -> shape over every shard (reads only the headers)."""
    return {name: info.shape for header in _headers(shards) for name, info in header.tensors.items()}


def read_record(shards: ShardSet) -> LayoutRecord | None:
    """The shards' restorekit layout records merged into one, or None (files from elsewhere)."""
    records = [h.record for h in _headers(shards) if h.record is not None]
    if not records:
        return None
    merged = LayoutRecord(records[0].layout)
    for record in records:
        merged.tensors.update(record.tensors)
        merged.strings.update(record.strings)
    return merged


def read(shards: ShardSet):
    """Yield ``(stored name, ndarray)`` over every shard in order, one tensor at a time."""
    _headers(shards)
    for path in shards.files:
        yield from safetensors.read(path)


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
    """Refuse an existing output (unless ``overwrite``); return the old files to replace."""
    old = previous_files(out)
    if old and not overwrite:
        raise OutputExistsError(path=old[0])
    directory = output_files(out, 1)[0]
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
    with atomic.Staging(os.path.dirname(final), output=final) as staging:
        extra = stage_texts(staging, texts)
        result = write(staging.path(final))
        staging.commit(remove_before=[final] if os.path.exists(final) else [])
    return dataclasses.replace(result, path=os.fspath(out), files=(os.fspath(out),) + extra)


def _publish(out, parts: list, overwrite: bool, write_one, texts: dict | None = None) -> ExportResult:
    """Stage ``texts`` and ``write_one(tmp, part)`` for every shard, write the index, then publish texts first,
    shards next, the index (or the single file) last."""
    old = check_output(out, overwrite=overwrite)
    directory, paths, index = output_files(out, len(parts))
    if not overwrite:  # each name asked for itself: a directory that cannot be listed hides nothing
        taken = [p for p in (*paths, index) if p is not None and os.path.lexists(p)]
        if taken:
            raise OutputExistsError(path=taken[0])
    results = []
    weight_map = {}
    with atomic.Staging(directory, output=output_files(out, 1)[1][0]) as staging:
        extra = stage_texts(staging, texts)
        for k, (path, part) in enumerate(zip(paths, parts), 1):
            result = write_one(staging.path(path), part)
            results.append(result)
            weight_map.update({name: os.path.basename(path) for name in safetensors.read_shapes(staging.path(path))})
            atomic.crash_point(f"shard-{k}-staged")
        if index is not None:
            text = json.dumps({"metadata": {"total_size": sum(r.nbytes for r in results)}, "weight_map": weight_map},
                              indent=2, sort_keys=True)
            with open(staging.path(index), "w", encoding="utf-8") as f:
                f.write(text + "\n")
            atomic.crash_point("index-json-written")
        if extra:
            # A new config.json must never sit beside old weights: the old output goes first, index first.
            staging.commit(remove_before=old)
        else:
            staging.commit(remove_before=[p for p in old if p not in paths and p != index])
    first = results[0]
    return ExportResult(
        index or paths[0], "safetensors", sum(r.count for r in results), sum(r.nbytes for r in results), first.layout,
        tuple(n for r in results for n in r.permuted), tuple(n for r in results for n in r.strings),
        tuple(n for r in results for n in r.kept), files=tuple(paths) + ((index,) if index else ()) + extra,
    )


def write_checkpoint(checkpoint, out, *, names: dict | None = None, layout: str | None = None,
                     metadata: dict | None = None, max_shard_size, overwrite: bool = False,
                     progress: bool = False, texts: dict | None = None) -> ExportResult:
    """Write a TF checkpoint (or the renamed subset ``names``) as sharded safetensors; each shard
    is written by ``safetensors.write_checkpoint``, raw shard bytes copied where possible.

    ``texts`` (path -> text, a ``config.json``) are published in the same commit, before the weights.

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
        return safetensors.write_checkpoint(checkpoint, tmp, names={n: names[n] for n in part}, layout=layout,
                                            metadata=metadata, progress=progress)

    return _publish(out, parts, overwrite, write_one, texts)


def write(out, tensors, *, sizes: list, layout: str | None = None, metadata: dict | None = None, graph=None,
          max_shard_size, overwrite: bool = False, progress: bool = False, texts: dict | None = None) -> ExportResult:
    """Write ``(name, ndarray[, TF dtype])`` items as sharded safetensors, one tensor at a time.

    ``sizes`` lists ``(name, shape, bytes)`` of the numeric tensors in the order ``tensors``
    yields them (string tensors are not listed: they go with the shard being written).

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
        return safetensors.write(tmp, part_tensors(part, last), layout=layout, metadata=metadata, graph=graph,
                                 progress=progress)

    return _publish(out, parts, overwrite, write_one, texts)


def _is_string(item) -> bool:
    dtype = item[2] if len(item) > 2 else None
    return dtype == "string" or getattr(getattr(item[1], "dtype", None), "kind", "") == "O"


def find_source(path) -> ShardSet:
    """``find(path)``, or CheckpointNotFoundError when nothing is there."""
    shards = find(path)
    if shards is None:
        raise CheckpointNotFoundError(f"no safetensors shards or index at {os.fspath(path)!r}", os.fspath(path))
    return shards
