"""TensorFlow's reader rules for a bundle: header versions, valid shapes, sizes, slices that tile a tensor.

TF's ``BundleReader`` refuses what these functions refuse, so a checkpoint we read is
one TF reads, and one we refuse TF refuses too (or would read wrongly). Every check
works on the index alone: nothing here reads tensor bytes or allocates a tensor.
"""

from __future__ import annotations

import numpy as np

from restorekit._bundle.format import DT_STRING, DT_VARIANT, dtype_name, itemsize
from restorekit._bundle.protos import BundleEntry, BundleHeader
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError

__all__ = [
    "BUNDLE_VERSION",
    "MAX_RANK",
    "check_header",
    "check_shape",
    "check_size",
    "element_count",
    "slice_layout",
    "stored_size",
]

# The tensor-bundle format version TF 2.21 writes and reads (kTensorBundleVersion);
# it reads bundles from producer 0 on (kTensorBundleMinProducer).
BUNDLE_VERSION = 1
MIN_PRODUCER = 0
# TensorShape::MaxDimensions(): TF refuses shapes of higher rank.
MAX_RANK = 254
_INT64_MAX = (1 << 63) - 1


def check_header(header: BundleHeader) -> None:
    """Refuse a header TF 2.21 refuses: a producer too old, a consumer too new, or ours marked bad.

    Raises:
        CorruptCheckpointError: naming the versions.
    """
    if header.version_producer < MIN_PRODUCER:
        raise CorruptCheckpointError(
            f"the checkpoint's format version {header.version_producer} is older than the oldest "
            f"TensorFlow reads ({MIN_PRODUCER})"
        )
    if header.version_min_consumer > BUNDLE_VERSION:
        raise CorruptCheckpointError(
            f"the checkpoint needs a reader of format version {header.version_min_consumer} or newer; "
            f"restorekit and TensorFlow 2.21 read version {BUNDLE_VERSION}"
        )
    if BUNDLE_VERSION in header.bad_consumers:
        raise CorruptCheckpointError(
            f"the checkpoint disallows readers of format version {BUNDLE_VERSION} "
            f"(bad_consumers {list(header.bad_consumers)}), the version restorekit and TensorFlow 2.21 read"
        )


def element_count(shape) -> int:
    """Number of elements of ``shape`` (1 for a scalar), as an exact Python int."""
    count = 1
    for d in shape:
        count *= int(d)
    return count


def check_shape(name: str, entry: BundleEntry) -> None:
    """Refuse a shape TF's ``TensorShape::IsValid`` refuses: unknown rank, rank over 254,
    a negative dimension, or more elements than an int64 counts.
    """
    if entry.unknown_rank:
        raise CorruptCheckpointError(f"entry {name!r} has a shape of unknown rank")
    if len(entry.shape) > MAX_RANK:
        raise CorruptCheckpointError(f"entry {name!r} has rank {len(entry.shape)}; TensorFlow allows at most {MAX_RANK}")
    count = 1
    for d in entry.shape:
        if d < 0:
            raise CorruptCheckpointError(f"entry {name!r} has a negative dimension in its shape {list(entry.shape)}")
        count *= d
        if count > _INT64_MAX:
            raise CorruptCheckpointError(f"entry {name!r}: shape {list(entry.shape)} has more elements than an int64 counts")


def stored_size(dtype: int, shape) -> int | None:
    """Bytes a tensor of ``dtype`` and ``shape`` takes in a shard; None for strings and variants
    (variable length).

    Raises:
        CorruptCheckpointError: a dtype TensorFlow does not have.
    """
    if dtype in (DT_STRING, DT_VARIANT):
        return None
    return element_count(shape) * itemsize(dtype)


def check_size(name: str, entry: BundleEntry) -> None:
    """Refuse an entry whose byte size cannot hold its shape (TF's ``GetValue`` rule).

    A fixed-size dtype needs exactly elements x itemsize bytes; a string or variant
    tensor at least one byte per element (each length takes at least one varint byte).

    Raises:
        CorruptCheckpointError: the size does not fit, or the dtype is not TensorFlow's.
    """
    count = element_count(entry.shape)
    try:
        expected = stored_size(entry.dtype, entry.shape)
    except InvalidArgumentError:  # resource handles: never saved by TensorFlow
        raise CorruptCheckpointError(f"entry {name!r} is a {dtype_name(entry.dtype)} tensor, which checkpoints do not hold") from None
    if expected is None:
        if entry.size < count:
            raise CorruptCheckpointError(
                f"entry {name!r}: {entry.size} bytes cannot hold a {dtype_name(entry.dtype)} tensor of {count} elements "
                f"(shape {list(entry.shape)})"
            )
    elif entry.size != expected:
        raise CorruptCheckpointError(
            f"entry {name!r}: {entry.size} bytes stored for a {dtype_name(entry.dtype)} tensor of shape "
            f"{list(entry.shape)}, which takes {expected}"
        )


def _slice_bounds(name: str, shape: tuple, extents: tuple) -> tuple[tuple, tuple]:
    """(starts, lengths) of one slice; (start, -1) means the whole dimension."""
    if len(extents) != len(shape):
        raise CorruptCheckpointError(f"partitioned entry {name!r}: a slice has {len(extents)} extents for rank {len(shape)}")
    starts, lengths = [], []
    for dim, (start, length) in zip(shape, extents):
        if length == -1:
            start, length = 0, dim
        if start < 0 or length < 0 or start + length > dim:
            raise CorruptCheckpointError(
                f"partitioned entry {name!r}: slice [{start}, {start + length}) lies outside dimension {dim}"
            )
        starts.append(start)
        lengths.append(length)
    return tuple(starts), tuple(lengths)


def _first_overlap(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    # Two boxes overlap when their intervals intersect in every dimension (TF's
    # TensorSlice::Overlaps). Row i against the rows after it, vectorized.
    for i in range(len(starts) - 1):
        low = np.maximum(starts[i], starts[i + 1 :])
        high = np.minimum(ends[i], ends[i + 1 :])
        hits = np.flatnonzero(np.all(low < high, axis=1))
        if hits.size:
            return i, i + 1 + int(hits[0])
    return None


def slice_layout(name: str, full: BundleEntry, parts) -> list[tuple[tuple, BundleEntry]]:
    """Check the slices of a partitioned entry and return ``(numpy index, slice entry)`` pairs.

    TF's rules: every slice lies inside the full shape, has its dtype and the shape its
    extents say, no two slices overlap, and together they cover the whole tensor.

    Args:
        parts: ``(extents, BundleEntry)`` pairs, the extents decoded from each slice key.

    Raises:
        CorruptCheckpointError: naming the slices that break a rule.
    """
    layout, bounds = [], []
    covered = 0
    for extents, part in parts:
        starts, lengths = _slice_bounds(name, full.shape, extents)
        if tuple(part.shape) != lengths:
            raise CorruptCheckpointError(
                f"partitioned entry {name!r}: a slice of shape {list(part.shape)} is stored for extents {extents}"
            )
        if part.dtype != full.dtype:
            raise CorruptCheckpointError(
                f"partitioned entry {name!r} is {dtype_name(full.dtype)}; its slice {extents} is {dtype_name(part.dtype)}"
            )
        covered += element_count(lengths)
        bounds.append((starts, tuple(s + n for s, n in zip(starts, lengths))))
        layout.append((tuple(slice(s, s + n) for s, n in zip(starts, lengths)), part))
    if len(bounds) > 1 and full.shape:
        pair = _first_overlap(np.array([b[0] for b in bounds], np.int64), np.array([b[1] for b in bounds], np.int64))
        if pair is not None:
            a, b = (_shown(*bounds[k]) for k in pair)
            raise CorruptCheckpointError(f"partitioned entry {name!r}: slices {a} and {b} overlap")
    full_count = element_count(full.shape)
    if covered != full_count:
        # Disjoint slices inside the shape: fewer elements than the shape means a gap.
        raise CorruptCheckpointError(
            f"partitioned entry {name!r}: its slices cover {covered} of the {full_count} elements of "
            f"shape {list(full.shape)}; part of the tensor is missing"
        )
    return layout


def _shown(starts: tuple, ends: tuple) -> str:
    return "[" + ", ".join(f"{s}:{e}" for s, e in zip(starts, ends)) + "]"
