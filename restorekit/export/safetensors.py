"""Streaming writer and reader of ``.safetensors`` files, with bit-exact TF round trips.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte range; ``__metadata__`` -> str), then the raw little-endian tensor bytes.
We read and write it ourselves because the ``safetensors`` package can neither write
tensor by tensor (``save_file`` takes a whole dict) nor read bfloat16 into numpy; the
package itself is not needed here, and the tests check our files load with it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from restorekit.bundle import atomic, files
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, OutputError
from restorekit.export.base import (
    ExportResult,
    atomic_output,
    check_strings,
    checkpoint_entries,
    layout_tensors,
    little_endian,
    progress_bar,
    raw_bytes_view,
)
from restorekit.export.layout import METADATA_KEY, STORED_AS, LayoutRecord, check_layout
from restorekit.export.reading import check_output_size, reader, regular_file
from restorekit.export.rawcopy import (  # noqa: F401  (tests patch _KernelCopy here)
    UncheckedRange,
    _KernelCopy,
    copy_raw,
    copy_raw_run,
    copy_unchecked_run,
    write_all,
)

__all__ = ["FORMAT", "SUFFIXES", "Header", "TensorInfo", "open_tensors", "read", "read_header", "read_record",
           "read_shapes", "recognizes", "write", "write_checkpoint"]

FORMAT = "safetensors"
SUFFIXES = (".safetensors",)
LAYOUTS = (None, "torch")  # the layout= values write and write_checkpoint accept

# TF dtype name -> safetensors dtype. Others are stored as a stand-in (STORED_AS,
# complex128 as float64 pairs) and named in the layout record.
_TO_ST = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_FROM_ST = {v: k for k, v in _TO_ST.items()}
_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers ("header too large")
_MAX_RANK = 64  # numpy's limit
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


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors code, e.g. 'BF16'
    shape: tuple
    begin: int  # byte range within the data section
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header: tensors in file order, metadata, restorekit record."""

    tensors: dict
    metadata: dict
    data_start: int
    record: LayoutRecord | None


def _numpy_dtype(st_dtype: str) -> np.dtype:
    from restorekit.bundle.format import dtype_enum, numpy_dtype

    return numpy_dtype(dtype_enum(_FROM_ST[st_dtype]))


def _stored(array: np.ndarray, tf_dtype: str, record: LayoutRecord, out: str) -> tuple[str, np.ndarray]:
    """(safetensors dtype, array to store) for one tensor, noting stand-ins in the record."""
    if tf_dtype in _TO_ST:
        return _TO_ST[tf_dtype], array
    if tf_dtype in STORED_AS:
        record.note_dtype(out, tf_dtype)
        return _TO_ST[STORED_AS[tf_dtype]], array
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
        layout: None, or 'torch' for PyTorch names and axes (``restorekit.export.layout``).
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
                atomic.crash_point(f"tensor-{len(entries) - 1}")
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
    handles: dict[str, object] = {}
    try:
        with atomic_output(path) as tmp, open(tmp, "wb", buffering=0) as f, progress_bar(offset, progress, "safetensors") as bar:
            write_all(f, header)
            done = 0
            for group in groups:
                atomic.crash_point(f"tensor-{done}")  # before each run of copied bytes or decoded tensor
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
    permuted = tuple(record.tf_name(n) for n, note in record.tensors.items() if "perm" in note)
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
        if entry.dtype not in _TO_ST and entry.dtype not in STORED_AS and entry.dtype != "complex128":
            raise InvalidArgumentError(f"checkpoint entry {source!r} has dtype {entry.dtype!r}, which safetensors cannot hold")
        out, perm = record.plan(name, entry.shape)
        shape = tuple(entry.shape[i] for i in perm) if perm is not None else tuple(entry.shape)
        if entry.dtype in _TO_ST:
            st_dtype = _TO_ST[entry.dtype]
        elif entry.dtype in STORED_AS:
            st_dtype = _TO_ST[STORED_AS[entry.dtype]]
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
    best = max(weight, key=weight.get, default=None)
    if best is None or weight[best] < _FOLIO_ABOVE or best % 8:
        return 0
    return best or _FOLIO


def _follows(previous, entry) -> bool:
    return (type(entry) is type(previous) and entry.shard_id == previous.shard_id
            and entry.offset == previous.offset + previous.size)


@reader("safetensors file")
def read_header(path) -> Header:
    """Parse and check the header of a ``.safetensors`` file (no tensor bytes are read).

    Parsed strictly, as the format defines it: shape entries are non-negative JSON
    integers (not ``2.9``, not ``true``), dtypes are the format's, byte ranges are
    ordered pairs of integers that tile the data section, each range holds exactly
    its shape's bytes (computed without overflow), names appear once, and the header
    fits the file and the format's 100,000,000-byte limit.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        CorruptCheckpointError: not a well-formed safetensors file (names the tensor).
        InvalidArgumentError: a dtype of the format that restorekit cannot hold.
    """
    path = os.fspath(path)
    size = regular_file(path, "safetensors file")
    header, n = _read_json(path, size)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, "__metadata__ is not an object of strings")
    tensors = {name: _tensor_info(path, name, info) for name, info in header.items()}
    _check_coverage(path, tensors, size - 8 - n)
    record = None
    if METADATA_KEY in metadata:
        record = LayoutRecord.from_json(metadata[METADATA_KEY], where=path)
    ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].begin))
    return Header(ordered, metadata, 8 + n, record)


def _bad(path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path!r} is not a valid safetensors file: {why}")


def _unique(pairs: list) -> dict:
    """json object hook: a name given twice is an error (json.loads would keep the last)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key!r} appears twice")
        out[key] = value
    return out


def _read_json(path: str, size: int) -> tuple[dict, int]:
    """(the JSON header as a dict, its length in bytes)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(path, "shorter than its 8-byte header length")
        n = struct.unpack("<Q", head)[0]
        if n > _MAX_HEADER or 8 + n > size:
            raise _bad(path, f"header length {n} does not fit a {size}-byte file (nor the format's {_MAX_HEADER})")
        try:
            header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_unique)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _bad(path, f"header is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    return header, n


# Every dtype the format defines; those restorekit lacks are refused as unsupported, not corrupt.
_ST_DTYPES = frozenset(_FROM_ST) | {"F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C128"}


def _is_count(value) -> bool:
    return type(value) is int and value >= 0  # bool is an int subclass, and 2.9 is not an int


def _tensor_info(path: str, name: str, info) -> TensorInfo:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _bad(path, f"entry {name!r} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise _bad(path, f"tensor {name!r} has dtype {str(dtype)[:40]!r}, which the format does not define")
    if dtype not in _FROM_ST:
        raise InvalidArgumentError(f"{path!r}: tensor {name!r} has dtype {dtype!r}, which restorekit cannot read")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _bad(path, f"tensor {name!r} has shape {str(shape)[:80]}; dimensions are non-negative integers")
    if len(shape) > _MAX_RANK:
        raise _bad(path, f"tensor {name!r} has {len(shape)} dimensions, over numpy's {_MAX_RANK}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {name!r} has data_offsets {str(offsets)[:80]}; expected [begin, end], begin <= end")
    begin, end = offsets
    # Python integers do not wrap, so a product past 2**63 is compared as it is.
    need = math.prod(shape) * _numpy_dtype(dtype).itemsize
    if end - begin != need:
        raise _bad(path, f"tensor {name!r}: byte range {begin}..{end} does not hold {dtype} {shape} ({need} bytes)")
    return TensorInfo(dtype, tuple(shape), begin, end)


def _check_coverage(path: str, tensors: dict, data_size: int) -> None:
    """The tensors must tile the data section: no overlap, no gap, nothing after."""
    cursor = 0
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != cursor:
            raise _bad(path, f"tensor {name!r} starts at {info.begin}, expected {cursor} (overlap or gap)")
        cursor = info.end
    if cursor != data_size:
        raise _bad(path, f"tensors cover {cursor} bytes of a {data_size}-byte data section")


@reader("safetensors file")
def read_shapes(path) -> dict:
    """Stored name -> shape of every tensor of a ``.safetensors`` file (reads only the header)."""
    return {name: info.shape for name, info in read_header(path).tensors.items()}


@reader("safetensors file")
def read_record(path) -> LayoutRecord | None:
    """The restorekit layout record of a ``.safetensors`` file, or None (a file from elsewhere)."""
    return read_header(path).record


def recognizes(head: bytes, suffix: str) -> bool:
    """True when a file's first bytes are a safetensors header length followed by its JSON."""
    return len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20)


@reader("safetensors file")
def read(path, *, max_output_bytes: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, ndarray)`` for each tensor of a ``.safetensors`` file, as stored.

    One tensor is read at a time; bfloat16 and float8 come back as ml_dtypes arrays.
    Names and axes are those in the file (see ``import_checkpoint`` for TF ones).
    ``max_output_bytes`` is honoured as by the other readers (a safetensors file holds
    every byte it yields, so only a limit below its size refuses it).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: as ``read_header``.
        OutputError: over ``max_output_bytes``.
    """
    path = os.fspath(path)
    header = read_header(path)
    check_output_size(path, os.path.getsize(path), {n: i.end - i.begin for n, i in header.tensors.items()},
                      max_output_bytes)
    return _arrays(path, header)


def open_tensors(path) -> dict:
    """Stored name -> every tensor of a ``.safetensors`` file as a private memory map (read on use).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: as ``read_header``.
    """
    path = os.fspath(path)
    header = read_header(path)
    out = {}
    for name, info in header.tensors.items():
        dtype = _numpy_dtype(info.dtype)
        if info.end == info.begin:
            out[name] = np.empty(info.shape, dtype=dtype)
        else:
            # copy-on-write: a caller may hand the array to torch.from_numpy, nothing reaches the file
            count = (info.end - info.begin) // dtype.itemsize
            out[name] = np.memmap(path, dtype=dtype, mode="c", offset=header.data_start + info.begin,
                                  shape=(count,)).reshape(tuple(info.shape))
    return out


def _arrays(path: str, header: Header):
    with open(path, "rb") as f:
        for name, info in header.tensors.items():
            array = np.empty(info.shape, dtype=_numpy_dtype(info.dtype))
            f.seek(header.data_start + info.begin)
            if array.nbytes and f.readinto(raw_bytes_view(array)) != array.nbytes:
                raise CorruptCheckpointError(f"{path!r}: tensor {name!r} is truncated")
            yield name, array
