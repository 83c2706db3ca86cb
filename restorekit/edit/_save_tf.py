"""Saving an edited plan as a TF checkpoint: shard reuse or compaction, staging, checks of kept and written bytes."""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from restorekit._bundle import crashpoints, files, statefile
from restorekit._bundle.staging import Staging, link_or_copy
from restorekit._bundle.files import INDEX_SLACK, check_space  # noqa: F401  (importable from here as before)
from restorekit._bundle.format import decode_tensor, encode_slice_key
from restorekit._bundle.objectgraph import rewrite_keys
from restorekit._bundle.protos import decode_header, encode_entry
from restorekit._bundle.table import mask_crc, read_table
from restorekit._bundle.crc import FilePass
from restorekit._bundle.writer import BundleWriter, balance, check_num_shards
from restorekit._checkpoint import OBJECT_GRAPH_KEY
from restorekit.edit._plan import ATTRIBUTES, STRING, Concat, Item
from restorekit.edit._source import Source, check_readable
from restorekit.formats._sink import checkpoint_files
from restorekit.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    OutputError,
    RestoreKitWarning,
)

# Data shards a compacting save of copied tensors writes at once: one thread's reads and
# writes (which release the GIL) overlap the other's crc32c; see benchmarks/README.md.
WORKERS = 2


@dataclass(frozen=True)
class _Shards:
    """How the output's shards are made: the source's reused (linked, or kept in place) and/or new ones."""

    count: int
    new: int | None  # the one shard a reusing save writes, None when it writes only an index
    reuse: bool  # stored tensors stay where they are in the source's shards
    link: bool  # the source's shards are hard-linked (or copied, or uploaded) under the output's names
    parts: tuple | None = None  # a compacting save: the plan's names for each of the count shards, in order


def save_tf(source: Source, plan: dict[str, Item], prefix: str, *, compact: bool, in_place: bool,
            replacing: bool, update_state_file: bool, progress: bool = False, num_shards: int | None = None,
            check_kept: bool = True, max_shard_size=None) -> str:
    """Write ``plan`` as the checkpoint ``prefix``; see ``CheckpointEditor.save``.

    ``num_shards`` rewrites the tensors into that many data shards, balanced by bytes,
    in plan order (a compacting save), ``max_shard_size`` into data shards of at most that
    many bytes (``tfwrite.data_parts``); several shards are written at once (``WORKERS``).
    A remote ``prefix`` (``gs://``, any ``tf.io.gfile`` path) is written through a
    ``files.RemoteStaging``: each shard is uploaded as soon as it is complete and its
    local copy deleted, reused source shards are uploaded from where they are, and the
    ``.index`` goes last, so the local disk holds at most one shard.
    """
    ckpt = source.checkpoint
    if num_shards is not None:
        num_shards = check_num_shards(num_shards)
    plan = final_plan(source, plan)
    remote = files.is_remote(prefix)
    directory = files.dirname(prefix) if remote else os.path.dirname(prefix)
    # A remote shard cannot be linked; a shard count other than the source's means rewriting.
    compact = compact or num_shards is not None or max_shard_size is not None or files.is_remote(ckpt.prefix)
    check_shard_set(ckpt)
    shards = _shards(source, plan, prefix, compact=compact, in_place=in_place, replacing=replacing,
                     num_shards=num_shards, max_shard_size=max_shard_size)
    if not check_kept:
        # The caller chose the index-only speed: kept bytes are checked when they are read
        # (Checkpoint.read, TF's restore), not now; a truncated or missing shard still fails here.
        ckpt.check_shards()
    # The metadata now, before anything is staged; the kept bytes' crcs meanwhile, awaited before publishing.
    kept_checked = check_sources(source, plan, reuse=shards.reuse and check_kept)
    if remote:
        check_space(tempfile.gettempdir(), _largest_new_shard(source, plan, shards))
    else:
        check_space(directory, _bytes_to_write(source, plan, shards, directory))

    remove_before: list[str] = []
    remove_after: list[str] = []
    if replacing and not in_place:
        # Exactly the old output's files, matched literally (a glob would take model1.ckpt's
        # shards for model[1].ckpt's); its .index first, so it stops existing at once.
        remove_before = checkpoint_files(prefix)
    elif in_place and shards.count != ckpt.header.num_shards:
        remove_after = [ckpt.data_file(i) for i in range(ckpt.header.num_shards)]

    with (files.RemoteStaging(directory) if remote else Staging(directory, output=prefix)) as staging:
        writer = BundleWriter(prefix, num_shards=shards.count, shard_id=shards.new, staging=staging)
        try:
            sizes = _stage_shards(ckpt, prefix, shards, staging)
            crashpoints.crash_point("shards-staged")
            if shards.parts is not None:
                expected = write_parts(source, writer, plan, shards.parts, progress=progress)
            else:
                expected = write_plan(source, writer, plan, reuse=shards.reuse, progress=progress)
            writer.finish(commit=False)
            sizes.update(writer.shard_sizes)
            crashpoints.crash_point("before-verify")
            verify(staging.path(prefix + ".index"), sizes, expected, writer.entries)
            staging.sync()  # while the check runs: the commit then only renames
            kept_checked.result()  # a failed check raises here, and nothing is published
            crashpoints.crash_point("before-commit")
        except BaseException:
            _settle(kept_checked)  # its pass has started: let it end (it maps the source) before cleaning up
            writer.abort()
            raise
        staging.commit(remove_before=remove_before, remove_after=remove_after)
    if update_state_file:
        crashpoints.crash_point("before-state-file")
        statefile.write(prefix)
    return prefix


def _shards(source: Source, plan: dict[str, Item], prefix: str, *, compact: bool, in_place: bool,
            replacing: bool, num_shards: int | None, max_shard_size=None) -> _Shards:
    n_src = source.checkpoint.header.num_shards
    if num_shards is not None:
        return _Shards(num_shards, None, False, False, balanced(source, plan, num_shards))
    if max_shard_size is not None:
        from restorekit.formats.tf._writer import data_parts

        parts = data_parts([(name, source.nbytes(item)) for name, item in plan.items()], max_shard_size=max_shard_size)
        assert parts is not None  # a max_shard_size always gives parts
        return _Shards(len(parts), None, False, False, parts)
    if compact:
        # One fresh shard; in place, its file name must differ from every live one.
        count = 2 if replacing and not files.is_remote(prefix) and _old_shard_count(prefix) == 1 else 1
        return _Shards(count, None, False, False, (tuple(plan),) + ((),) * (count - 1))
    if any(not it.stored for it in plan.values()):
        count, new = n_src + 1, n_src
    else:
        count, new = n_src, None
    return _Shards(count, new, True, not (in_place and count == n_src))


def balanced(source: Source, plan: dict[str, Item], count: int) -> tuple:
    """The plan's names cut into ``count`` runs (in order) of about equal bytes (``bundle.writer.balance``)."""
    return balance(((name, source.nbytes(item)) for name, item in plan.items()), count)


def _old_shard_count(prefix: str) -> int:
    try:
        return decode_header(read_table(files.read_bytes(prefix + ".index"))[0][1]).num_shards
    except (CorruptCheckpointError, OSError, IndexError):
        return 0


def check_shard_set(ckpt) -> None:
    """Refuse a checkpoint whose data shards are missing (``files.check_shard_files``) or too short.

    Raises:
        CorruptCheckpointError: before anything is written.
    """
    if not files.is_remote(ckpt.prefix):
        files.check_shard_files(ckpt.prefix, ckpt.header.num_shards)
        ckpt.check_shards()


def _bytes_to_write(source: Source, plan: dict[str, Item], shards: _Shards, directory: str) -> int:
    ckpt = source.checkpoint
    written = sum(source.nbytes(it) for it in plan.values() if not (shards.reuse and it.stored))
    if shards.link and not _same_device(ckpt.data_file(0), directory):
        paths = [ckpt.data_file(i) for i in range(ckpt.header.num_shards)]
        written += sum(os.path.getsize(p) for p in paths if os.path.exists(p))
    return written


def _largest_new_shard(source: Source, plan: dict[str, Item], shards: _Shards) -> int:
    """What a remote save stages locally at once: its largest new shard (reused shards upload from the source)."""
    if shards.parts is None:
        return sum(source.nbytes(it) for it in plan.values() if not it.stored)
    return max(sum(source.nbytes(plan[name]) for name in part) for part in shards.parts)


def _stage_shards(ckpt, prefix: str, shards: _Shards, staging) -> dict[int, int]:
    """Link (or copy, or upload) the reused source shards; return shard id -> size for ``verify``."""
    sizes = {}
    n_src = ckpt.header.num_shards
    for i in range(n_src) if shards.reuse else ():
        sizes[i] = os.path.getsize(ckpt.data_file(i))
        if not shards.link:
            continue
        final = f"{prefix}.data-{i:05d}-of-{shards.count:05d}"
        if isinstance(staging, files.RemoteStaging):
            staging.publish(final, local=ckpt.data_file(i))
        else:
            link_or_copy(ckpt.data_file(i), staging.path(final))
    return sizes


def check_sources(source: Source, plan: dict[str, Item], *, reuse: bool) -> Future:
    """Check what the output takes from the source before anything is published.

    A shard-reusing save writes only an index for the tensors it keeps, so it reads
    each kept tensor once here and checks its crc32c: without this a flipped bit in
    the source would pass into the output unnoticed (and TF would refuse it later).
    The cost is one pass over the kept bytes per save, on every core and without copying
    them (``crc.file_crcs``: each shard mapped under a read lease, so another process
    truncating it cannot crash this one), so about the time of one two-thread crc32c pass
    over the bytes in the page cache (benchmarks/bench_crc.py), or one read of the kept
    bytes at the disk's speed from a cold disk. That pass runs on a background thread
    while the index is written and verified (its threads release the GIL): the returned
    future's ``result()`` raises what it found, and ``save_tf`` waits for it before it
    publishes anything. A compacting save checks each crc while it copies; here it only
    refuses entries whose metadata cannot be right (at once).

    Returns:
        A future of the kept bytes' check (already done when there is nothing to check).

    Raises:
        ChecksumMismatchError: a kept tensor fails its crc32c (names it).
        CorruptCheckpointError: a shard is missing or too short, or an entry's dtype or
            size cannot describe its bytes.
    """
    ckpt = source.checkpoint
    kept, cast = [], []
    for item in plan.values():
        if item.stored and ckpt.is_partitioned(item.read_name):
            kept += [(item.read_name, part) for _, part in ckpt._slices[item.read_name]]
        elif item.stored:
            kept.append((item.read_name, ckpt.bundle_entry(item.read_name)))
        elif item.base is None and item.cast is not None:
            cast.append((item.read_name, ckpt.bundle_entry(item.read_name)))  # its crc is checked as it streams
    checked = _start_check(ckpt, kept) if reuse else _done()  # the bytes' pass first, the metadata meanwhile
    try:
        for name, entry in kept + cast:
            check_readable(name, entry)
    except BaseException:
        _settle(checked)
        raise
    return checked


def _settle(future: Future) -> None:
    """Wait for a running check to end (its threads map the source), dropping what it raises."""
    with contextlib.suppress(BaseException):
        future.result()


def _done() -> Future:
    done: Future = Future()
    done.set_result(None)
    return done


def _start_check(ckpt, kept: list) -> Future:
    """The check of the kept bytes, under way: the first data shard's crc pass starts here, on this thread
    (so at once, not when this thread next lets go of the GIL); string tensors and any further shards follow
    on a background thread, which the returned future stands for."""
    by_shard: dict[int, list] = {}
    for name, entry in kept:
        if entry.dtype != STRING:
            by_shard.setdefault(entry.shard_id, []).append((name, entry))
    shards = [(ckpt.data_file(i), entries) for i, entries in sorted(by_shard.items())]
    first = _start_shard(*shards[0]) if shards else None
    strings = [(name, entry) for name, entry in kept if entry.dtype == STRING]
    try:
        pool = ThreadPoolExecutor(1, thread_name_prefix="restorekit-check")
        try:
            return pool.submit(_finish_check, ckpt, strings, first, shards[1:])
        finally:
            pool.shutdown(wait=False)
    except BaseException:
        if first is not None:
            _settle_shard(first)
        raise


def _finish_check(ckpt, strings: list, first, rest: list) -> None:
    try:
        for name, entry in strings:
            decode_tensor(ckpt.read_raw(entry, name), STRING, entry.shape, name=name, crc32c=entry.crc32c)
    except BaseException:
        if first is not None:
            _settle_shard(first)
        raise
    if first is not None:
        _end_shard(*first)
    for path, entries in rest:
        _end_shard(*_start_shard(path, entries))


def _start_shard(path: str, entries: list) -> tuple:
    """Open the data shard ``path`` and start the crc pass over the ``(name, entry)`` it keeps."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        raise CorruptCheckpointError(f"data shard {path!r} for {entries[0][0]!r} is missing or unreadable") from None
    try:
        return path, entries, fd, FilePass(fd, [(entry.offset, entry.size) for _, entry in entries], path=path)
    except BaseException:
        os.close(fd)
        raise


def _settle_shard(started: tuple) -> None:
    with contextlib.suppress(BaseException):
        _end_shard(*started)


def _end_shard(path: str, entries: list, fd: int, started: FilePass) -> None:
    """Wait for a shard's crc pass and compare each kept tensor's crc32c with its entry's."""
    try:
        crcs = started.result()
    finally:
        os.close(fd)
    for (name, entry), crc in zip(entries, crcs):
        if crc is None:
            raise CorruptCheckpointError(
                f"data shard {path!r} is truncated: {name!r} needs bytes {entry.offset}..{entry.offset + entry.size}"
            )
        if mask_crc(crc) != entry.crc32c:
            raise ChecksumMismatchError(
                f"{name!r}: source bytes fail their crc32c check (stored {entry.crc32c:#010x}, computed "
                f"{mask_crc(crc):#010x}); the source data shard is corrupt (or belongs to another save), "
                "nothing was written"
            )


def final_plan(source: Source, plan: dict[str, Item]) -> dict[str, Item]:
    """The plan, with the TF2 object graph rewritten when keys were renamed or deleted."""
    plan = dict(plan)
    ckpt = source.checkpoint
    graph = plan.get(OBJECT_GRAPH_KEY)
    if OBJECT_GRAPH_KEY not in ckpt or graph is None or not graph.stored or graph.origin != OBJECT_GRAPH_KEY:
        return plan
    key_map = {it.origin: name for name, it in plan.items() if it.origin is not None}
    if all(key_map.get(k) == k for k in ckpt):
        return plan
    lost = [f"{old!r} -> {new!r}" for old, new in key_map.items()
            if old != new and ATTRIBUTES in old and ATTRIBUTES not in new]
    if lost:
        # TF finds a value's object from the "<path>/.ATTRIBUTES/" part of its key;
        # a key without it cannot stay in the graph.
        del plan[OBJECT_GRAPH_KEY]
        warnings.warn(
            f"{ckpt.prefix!r} is an object-based (TF2) checkpoint and the renames "
            f"{', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''} drop the '/.ATTRIBUTES/' part TF needs; "
            f"saving it as a name-based checkpoint (without {OBJECT_GRAPH_KEY!r}). Keep '/.ATTRIBUTES/...' "
            "in new names to keep tf.train.Checkpoint restores working.",
            RestoreKitWarning,
            stacklevel=5,
        )
        return plan
    source_keys = set(ckpt)

    def rebuild():
        raw = bytes(source.load(OBJECT_GRAPH_KEY).reshape(-1)[0])
        dropped = {key for key in source_keys if key not in key_map}
        return np.array(rewrite_keys(raw, key_map, dropped), dtype=object)

    plan[OBJECT_GRAPH_KEY] = Item(OBJECT_GRAPH_KEY, STRING, (), base=rebuild)
    return plan


def _same_device(a: str, b: str) -> bool:
    while not os.path.exists(b):
        b = os.path.dirname(b) or "."
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def write_plan(source: Source, writer: BundleWriter, plan: dict[str, Item], *, reuse: bool,
               progress: bool = False) -> set[bytes]:
    """Stream every tensor of ``plan`` into ``writer`` (its one shard); return the index keys written."""
    from restorekit.formats._sink import progress_bar

    keys = set()
    if not progress:
        for name, item in plan.items():
            keys |= _write_one(source, writer, writer, name, item, reuse=reuse)
        return keys
    with progress_bar(sum(source.nbytes(item) for item in plan.values()), progress, "save") as bar:
        for name, item in plan.items():
            keys |= _write_one(source, writer, writer, name, item, reuse=reuse)
            bar.update(source.nbytes(item))
    return keys


def write_parts(source: Source, writer: BundleWriter, plan: dict[str, Item], parts: tuple, *,
                progress: bool = False) -> set[bytes]:
    """Write ``parts[i]`` (names of ``plan``, in order) into data shard ``i``, up to ``WORKERS`` shards at once.

    Each shard is one thread's sequential stream (memory: a copy buffer per thread and
    the tensor being changed); a shard is closed, and with a remote staging uploaded,
    as soon as it is complete. The first error stops the other shards after their
    current tensor and is raised.
    """
    import threading
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    from restorekit.formats._sink import progress_bar

    stop = threading.Event()
    lock = threading.Lock()
    # A remote output stages one shard at a time on the local disk. Shards that compute
    # (casts, new values) are written one at a time: numpy holds the GIL there, and two
    # such threads took 1.5x as long as one on 2 cores (benchmarks/README.md).
    copies = all(plan[name].stored for part in parts for name in part)
    remote = isinstance(writer.staging, files.RemoteStaging)
    workers = min(WORKERS, len(parts)) if copies and not remote else 1
    with progress_bar(sum(source.nbytes(item) for item in plan.values()), progress, "save") as bar:

        def fill(shard_id: int) -> set[bytes]:
            shard = writer.shard(shard_id)
            keys: set[bytes] = set()
            for name in parts[shard_id]:
                if stop.is_set():
                    return keys
                keys |= _write_one(source, writer, shard, name, plan[name], reuse=False)
                with lock:
                    bar.update(source.nbytes(plan[name]))
            shard.close()
            return keys

        if workers <= 1:
            return set().union(*map(fill, range(len(parts))))
        pool = ThreadPoolExecutor(workers, thread_name_prefix="restorekit-shard")
        futures = [pool.submit(fill, i) for i in range(len(parts))]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            return set().union(*(f.result() for f in futures))  # the first error, if any, is raised here
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)


def _write_one(source: Source, writer: BundleWriter, shard, name: str, item: Item, *, reuse: bool) -> set[bytes]:
    """Write one tensor (or the slices of a partitioned one) into ``shard`` (a ShardWriter, or ``writer``
    for its own shard); return the index keys written."""
    ckpt = source.checkpoint
    keys = set()
    if item.stored and ckpt.is_partitioned(item.read_name):
        for extents, part in ckpt._slices[item.read_name]:
            key = encode_slice_key(name, extents)
            if reuse:
                writer.add_entry_only(key, part)
            else:
                _copy(source, shard, key, part, item.read_name)
            keys.add(key)
        writer.add_entry_only(name, ckpt.bundle_entry(item.read_name))
    elif item.stored:
        entry = ckpt.bundle_entry(item.read_name)
        if reuse:
            writer.add_entry_only(name, entry)
        else:
            _copy(source, shard, name, entry, item.read_name)
    elif item.base is None and not item.ops and item.cast is not None:
        shard.add_stream(name, item.cast, item.shape, source.cast_chunks(item))
    elif isinstance(item.base, Concat) and not item.ops and item.cast is None and item.dtype != STRING:
        shard.add_stream(name, item.dtype, item.shape, source.concat_chunks(item.base))
    else:
        shard.add(name, source.value(item))
    keys.add(name.encode("utf-8"))
    return keys


def _copy(source: Source, shard, key, entry, origin: str) -> None:
    """Copy an unchanged tensor's bytes (crc checked, never decoded)."""
    check_readable(origin, entry)
    path = source.checkpoint.data_file(entry.shard_id)
    if files.is_remote(path):
        shard.add_raw(key, entry, source.raw_chunks(entry, origin))
    else:
        shard.add_copy(key, entry, path)


def verify(index_path: str, sizes: dict[int, int], expected: set[bytes], written: dict) -> None:
    """Re-read the staged index: the expected keys, each record the bytes written for its entry (``written``:
    key -> BundleEntry), each entry inside its shard (``sizes``: shard id -> bytes)."""
    records = read_table(files.read_bytes(index_path))
    header = decode_header(records[0][1])
    keys = {k for k, _ in records[1:]}
    if keys != expected:
        raise OutputError(f"verification of {index_path!r} failed: the index holds other keys than written")
    for key, value in records[1:]:
        entry = written.get(key)
        if entry is None or value != encode_entry(entry):  # the bytes read back decode to what was written
            raise OutputError(f"verification of {index_path!r} failed: {key[:80]!r} reads back other bytes than written")
        if entry.slices and not entry.size:
            continue
        if entry.shard_id >= header.num_shards or entry.offset + entry.size > sizes.get(entry.shard_id, -1):
            raise OutputError(
                f"verification of {index_path!r} failed: {key[:80]!r} points past its shard {entry.shard_id}"
            )


def missing_directories(directory: str) -> list[str]:
    """The directories on the way to ``directory`` that do not exist yet, deepest first."""
    missing = []
    while directory and not os.path.exists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    return missing


def remove_if_empty(directories: list[str]) -> None:
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:  # not empty (another writer's files) or already gone
            return
