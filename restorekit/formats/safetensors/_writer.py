"""Streaming writer of ``.safetensors`` files, with bit-exact TF round trips; the reader is ``restorekit.formats.safetensors``.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte range; ``__metadata__`` -> str), then the raw little-endian tensor bytes.
We write it ourselves because the ``safetensors`` package cannot write tensor by tensor
(``save_file`` takes a whole dict); the package itself is not needed here, and the tests
check our files load with it. The reading verbs of the export format table (``read``,
``read_shapes``, ``read_record``, ``recognizes``) are the reader's, imported here.
"""

from __future__ import annotations

import json
import os
import struct
from typing import BinaryIO, Iterable

import numpy as np

from restorekit._bundle import crashpoints, files
from restorekit.errors import InvalidArgumentError, OutputError
from restorekit.formats._sink import ExportResult, atomic_output, check_strings, checkpoint_entries, layout_tensors, little_endian, progress_bar, raw_bytes_view
from restorekit.layouts import METADATA_KEY, STORED_AS, LayoutRecord, check_layout
from restorekit.formats._dtypes import TO_SAFETENSORS
from restorekit.formats.safetensors._reader import _MAX_HEADER
from restorekit.formats._rawcopy import (  # noqa: F401  (tests patch _KernelCopy here)
    UncheckedRange,
    _KernelCopy,
    copy_raw,
    copy_raw_run,
    copy_unchecked_run,
    write_all,
)

__all__ = ["LAYOUTS", "write", "write_checkpoint"]

LAYOUTS = (None, "torch")  # the layout= values write and write_checkpoint accept

_CHUNK = 16 << 20
# The generic writer does not know the header before the tensors, so it leaves this
# much room for it and writes it last; small files are then rewritten compactly.
_RESERVE = 256 << 10
_COMPACT_BELOW = 64 << 20
# The kernel copies a byte range at `cp` speed only when its output offset agrees with
# its source offset modulo the page cache's largest folio (2 MiB): measured on ext4,
# 1.3 GB took 0.34 s aligned so, 0.50 s page-aligned only, 0.85 s 8-byte aligned
# (benchmarks/README.md). So when at least _FOLIO_ABOVE bytes are copied raw, the header
# is padded with spaces (the format allows it) to put the data there; that costs under
# 2 MiB of file size, and mmap readers get 2 MiB-aligned tensors too.
_FOLIO = 2 << 20
_FOLIO_ABOVE = 64 << 20


def _stored(array: np.ndarray, tf_dtype: str, record: LayoutRecord, out: str) -> tuple[str, np.ndarray]:
    """(safetensors dtype, array to store) for one tensor, noting stand-ins in the record."""
    if tf_dtype in TO_SAFETENSORS:
        return TO_SAFETENSORS[tf_dtype], array
    if tf_dtype in STORED_AS:
        record.note_dtype(out, tf_dtype)
        return TO_SAFETENSORS[STORED_AS[tf_dtype]], array
    if tf_dtype == "complex128":
        record.note_dtype(out, tf_dtype)
        return "F64", np.ascontiguousarray(array).view(np.float64).reshape(array.shape + (2,))
    raise InvalidArgumentError(f"tensor {out!r} of dtype {tf_dtype!r} cannot be stored in safetensors")


def _metadata(user: dict | None, record: LayoutRecord) -> dict:
    meta = {}
    for key, value in (user or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgumentError(f"safetensors metadata maps str to str; got {key!r}: {value!r}")
        meta[key] = value
    if METADATA_KEY in meta:
        raise InvalidArgumentError(f"metadata key {METADATA_KEY!r} is reserved for restorekit's layout record")
    meta.setdefault("format", "pt" if record.layout == "torch" else "tf")
    meta[METADATA_KEY] = record.to_json()
    return meta


def _encode_header(entries: list, meta: dict, size: int | None = None, start: int = 0) -> bytes:
    """8-byte length + JSON header, padded with spaces to ``size`` bytes when given, else so
    that the data section starts at an offset congruent to ``start`` modulo _FOLIO when
    ``start`` is set (a multiple of 8), else at the next multiple of 8."""
    header = {"__metadata__": meta}
    for name, st_dtype, shape, begin, end in entries:
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) > _MAX_HEADER:
        raise InvalidArgumentError(f"safetensors header would be {len(text)} bytes, over the format's limit of {_MAX_HEADER}")
    # Pad with spaces (allowed by the format) so the data starts 8-byte aligned.
    if size is not None:
        target = size
    elif start and len(text) + _FOLIO <= _MAX_HEADER:
        target = len(text) + (start - 8 - len(text)) % _FOLIO
    else:
        target = len(text) + (-(8 + len(text)) % 8)
    return struct.pack("<Q", target) + text + b" " * (target - len(text))


def write(path, tensors: Iterable, *, layout: str | None = None, metadata: dict | None = None, graph=None,
          progress: bool = False) -> ExportResult:
    """Write ``(name, ndarray)`` pairs to a ``.safetensors`` file, one tensor at a time.

    Only one tensor is held at a time. The file appears at ``path`` only once it is
    complete (a temporary file beside it, then ``os.replace``).

        write('model.safetensors', ((n, ckpt.read(n)) for n in ckpt), layout='torch')

    Args:
        path: the output file (replaced if it exists).
        tensors: an iterable of ``(TF name, ndarray)``, consumed once; a third item,
            a TF dtype name, keeps dtypes numpy cannot name (``'qint8'``).
        layout: None, or 'torch' for PyTorch names and axes (``restorekit.layouts``).
        metadata: extra ``__metadata__`` entries, str -> str.
        graph: the object graph of the tensors' checkpoint (``Checkpoint.object_graph``),
            so that layout 'torch' names them from their readable paths.
        progress: show a byte counter on stderr (when it is a terminal).

    Returns:
        An ExportResult. String tensors are carried in the metadata and listed there.

    Raises:
        NameCollisionError: the layout maps two names onto one (nothing is written).
        InvalidArgumentError: a dtype safetensors cannot hold, or bad metadata.
    """
    check_layout(layout)
    record = LayoutRecord(layout, graph=graph)
    _metadata(metadata, record)  # validate before writing anything
    path = os.fspath(path)
    entries = []
    permuted = []
    offset = 0
    with atomic_output(path) as tmp:
        with open(tmp, "w+b") as f, progress_bar(None, progress, "safetensors") as bar:
            f.seek(8 + _RESERVE)
            for name, out, array, tf_dtype, was_permuted in layout_tensors(tensors, record):
                if was_permuted:
                    permuted.append(name)
                st_dtype, array = _stored(array, tf_dtype, record, out)
                array = little_endian(array)
                f.write(raw_bytes_view(array))
                entries.append((out, st_dtype, array.shape, offset, offset + array.nbytes))
                offset += array.nbytes
                bar.update(array.nbytes)
                crashpoints.crash_point(f"tensor-{len(entries) - 1}")
            check_strings(record, "file metadata")
            header = _encode_header(entries, _metadata(metadata, record))
            if len(header) - 8 <= _RESERVE and offset >= _COMPACT_BELOW:
                f.seek(0)
                f.write(_encode_header(entries, _metadata(metadata, record), size=_RESERVE))
                compact = None
            else:
                compact = header
        if compact is not None:
            _rewrite(tmp, compact, 8 + _RESERVE, offset)
    return ExportResult(path, "safetensors", len(entries), offset, layout, tuple(permuted), tuple(record.strings), record.kept,
                        unmapped=tuple(record.unmapped))


def _rewrite(tmp: str, header: bytes, data_start: int, size: int) -> None:
    """Replace ``tmp`` by ``header`` + its data section (when the reserved room did not fit)."""
    with atomic_output(tmp) as tmp2, open(tmp, "rb") as src, open(tmp2, "wb") as dst:
        dst.write(header)
        src.seek(data_start)
        remaining = size
        while remaining:
            chunk = src.read(min(_CHUNK, remaining))
            if not chunk:
                raise OutputError(f"temporary file {tmp!r} shrank while it was written")
            dst.write(chunk)
            remaining -= len(chunk)


def write_checkpoint(checkpoint, path, *, names: dict | None = None, layout: str | None = None,
                     metadata: dict | None = None, progress: bool = False) -> ExportResult:
    """Write every tensor of a TF checkpoint to ``path``, copying raw shard bytes where possible.

    ``names`` (``{TF name in the output: checkpoint entry}``, in output order) exports
    a renamed subset the same way: ``CheckpointEditor`` passes it after renames and
    deletions, so stripping optimizer slots and exporting still copies raw bytes.

    The header is built from the index first; then each numeric tensor that needs no
    permutation is copied from its data shard in large chunks, crc32c checked on the
    way (safetensors stores exactly the little-endian bytes a TF shard holds).

    A source that keeps no checksum but knows where a tensor's bytes lie as stored
    (``checkpoint.stored_range(name)`` -> ``(path, offset, size)``, as a Keras file's
    contiguous, unfiltered little-endian datasets do) has those ranges copied by the
    kernel unchecked (``copy_unchecked_run``); its other tensors are read and decoded.

    Raises:
        NameCollisionError, InvalidArgumentError: before anything is written.
        ChecksumMismatchError, CorruptCheckpointError: a bad shard, or a stored range past
            the end of its file (no output left).
    """
    check_layout(layout)
    record = LayoutRecord.for_checkpoint(checkpoint, layout)
    _metadata(metadata, record)
    path = os.fspath(path)
    plan = _checkpoint_plan(checkpoint, names, record)
    # A view's record notes every tensor of the checkpoint; a subset (one shard) keeps the notes of its own.
    written = {step[1] for step in plan}
    record.tensors = {stored: note for stored, note in record.tensors.items() if stored in written}
    offset = 0
    check_strings(record, "file metadata")
    # The header lists tensors in name order; the data section holds them in the order
    # of their bytes in the shards, so an unedited shard is one run that the kernel
    # copies in one stream. Tensors that are decoded (permuted, partitioned) come last.
    by_name = list(plan)
    plan.sort(key=lambda step: (0, step[5].shard_id, step[5].offset) if step[5] is not None else (1,))
    ranges = {}
    for name, out, st_dtype, shape, perm, raw, nbytes in plan:
        ranges[out] = (offset, offset + nbytes)
        offset += nbytes
    entries = [(out, st_dtype, shape, *ranges[out]) for name, out, st_dtype, shape, *_ in by_name]
    groups = _groups(plan)
    header = _encode_header(entries, _metadata(metadata, record), start=_copy_alignment(groups))
    handles: dict[str, BinaryIO] = {}
    try:
        with atomic_output(path) as tmp, open(tmp, "wb", buffering=0) as f, progress_bar(offset, progress, "safetensors") as bar:
            write_all(f, header)
            done = 0
            for group in groups:
                crashpoints.crash_point(f"tensor-{done}")  # before each run of copied bytes or decoded tensor
                done += len(group)
                if isinstance(group[0][5], UncheckedRange):
                    copy_unchecked_run([(step[0], step[5]) for step in group], f, handles, bar)
                    continue
                if group[0][5] is not None:
                    copy_raw_run(checkpoint, [(step[0], step[5]) for step in group], f, handles, bar)
                    continue
                name, out, st_dtype, shape, perm, raw, nbytes = group[0]
                array = checkpoint.read(name)
                if perm is not None:
                    array = np.transpose(array, perm)
                _, array = _stored(array, checkpoint.entries[name].dtype, LayoutRecord(), out)
                view = raw_bytes_view(little_endian(array))
                write_all(f, view)
                bar.update(len(view))
    finally:
        for handle in handles.values():
            handle.close()
    permuted = record.permuted()
    return ExportResult(path, "safetensors", len(plan), offset, layout, permuted, tuple(record.strings), record.kept,
                        unmapped=tuple(record.unmapped))


def _checkpoint_plan(checkpoint, names: dict | None, record: LayoutRecord) -> list[tuple]:
    """One step per numeric tensor: (entry name, stored name, safetensors dtype, stored shape,
    permutation, the raw entry when its bytes are copied as stored (else None), byte count).
    String tensors go to ``record``."""
    plan = []
    local = not files.is_remote(checkpoint.prefix)  # remote shards are read through tf.io.gfile
    for name, source in checkpoint_entries(checkpoint, names):
        entry = checkpoint.entries[source]
        if entry.dtype == "string":
            record.add_string(name, checkpoint.read(source))
            continue
        if entry.dtype not in TO_SAFETENSORS and entry.dtype not in STORED_AS and entry.dtype != "complex128":
            raise InvalidArgumentError(f"checkpoint entry {source!r} has dtype {entry.dtype!r}, which safetensors cannot hold")
        out, perm = record.plan(name, entry.shape)
        shape = tuple(entry.shape[i] for i in perm) if perm is not None else tuple(entry.shape)
        if entry.dtype in TO_SAFETENSORS:
            st_dtype = TO_SAFETENSORS[entry.dtype]
        elif entry.dtype in STORED_AS:
            st_dtype = TO_SAFETENSORS[STORED_AS[entry.dtype]]
            record.note_dtype(out, entry.dtype)
        else:
            st_dtype, shape = "F64", shape + (2,)
            record.note_dtype(out, entry.dtype)
        raw = None
        if perm is None and local:
            raw = _unchecked(checkpoint, source, entry) if checkpoint.is_partitioned(source) else checkpoint.bundle_entry(source)
        plan.append((source, out, st_dtype, shape, perm, raw, entry.nbytes))
    return plan


def _unchecked(checkpoint, source: str, entry) -> UncheckedRange | None:
    """Where ``source``'s bytes lie as stored in a source that keeps no checksum (a Keras file:
    ``stored_range``), or None: the tensor is read and decoded."""
    stored_range = getattr(checkpoint, "stored_range", None)
    found = stored_range(source) if stored_range is not None else None
    if found is None or found[2] != entry.nbytes:
        return None
    return UncheckedRange(*found)


def _groups(plan: list) -> list[list]:
    """The plan's steps in order, grouped: stored tensors lying back to back in one shard
    form one group (one kernel copy); every decoded tensor is a group of its own."""
    groups: list[list] = []
    for step in plan:
        raw = step[5]
        previous = groups[-1][-1][5] if groups else None
        if raw is not None and previous is not None and _follows(previous, raw):
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


def _copy_alignment(groups: list) -> int:
    """Where the data section should start modulo _FOLIO so most raw-copied bytes keep
    their source offset modulo _FOLIO; 0 (the format's 8-byte alignment) when few are."""
    weight: dict[int, int] = {}
    offset = 0
    for group in groups:
        size = sum(step[6] for step in group)
        if group[0][5] is not None:
            start = (group[0][5].offset - offset) % _FOLIO
            weight[start] = weight.get(start, 0) + size
        offset += size
    best = max(weight, key=weight.__getitem__, default=None)
    if best is None or weight[best] < _FOLIO_ABOVE or best % 8:
        return 0
    return best or _FOLIO


def _follows(previous, entry) -> bool:
    return (type(entry) is type(previous) and entry.shard_id == previous.shard_id
            and entry.offset == previous.offset + previous.size)


