"""The editor's reads of its source checkpoint: stored bytes in checked chunks, values, streamed casts and concats."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from restorekit._bundle import files
from restorekit._bundle.crc import extend
from restorekit._bundle.format import DTYPE_NAMES, decode_tensor, dtype_name, numpy_dtype
from restorekit._bundle.table import mask_crc
from restorekit._bundle.writer import CHUNK_SIZE, array_chunks
from restorekit.edit._plan import STRING, Concat, Item, nbytes
from restorekit.errors import ChecksumMismatchError, CorruptCheckpointError, EditError
from restorekit._report import format_shape


class Source:
    """Reads of one checkpoint on the editor's behalf; every byte read is crc checked."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def nbytes(self, item: Item) -> int:
        return nbytes(item, self.checkpoint)

    def value(self, item: Item) -> np.ndarray:
        """The array ``item`` stands for (for a stored item, a fresh read)."""
        if item.base is None:
            value = self.load(item.read_name)
            if item.cast is not None:
                value = cast_array(value, numpy_dtype(item.cast), item.read_name)
        elif isinstance(item.base, np.ndarray):
            value = item.base.copy() if item.ops else item.base
        elif isinstance(item.base, Concat):
            value = np.concatenate([self.value(it) for it in item.base.items], axis=item.base.axis)
        else:
            value = item.base()
        for op in item.ops:
            value = op(value)
        return value

    def load(self, name: str) -> np.ndarray:
        """A source tensor, read straight into its array (one copy in memory), crc checked."""
        ckpt = self.checkpoint
        entry = ckpt.bundle_entry(name)
        if ckpt.is_partitioned(name) or entry.dtype == STRING or files.is_remote(ckpt.prefix):
            return ckpt.read(name)
        check_readable(name, entry)
        array = np.empty(entry.shape, numpy_dtype(entry.dtype))
        flat = array.reshape(-1).view(np.uint8)
        pos = 0
        for chunk in self.checked_chunks(name):
            flat[pos : pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
            pos += len(chunk)
        return array

    def raw_chunks(self, entry, name: str) -> Iterator[bytes]:
        """A stored tensor's bytes in chunks; string tensors are checked by decoding."""
        ckpt = self.checkpoint
        if entry.dtype == STRING:
            raw = ckpt.read_raw(entry, name)
            decode_tensor(raw, STRING, entry.shape, name=name, crc32c=entry.crc32c)
            yield raw
            return
        path = ckpt.data_file(entry.shard_id)
        if files.is_remote(path):
            yield ckpt.read_raw(entry, name)
            return
        try:
            f = open(path, "rb")
        except OSError:
            raise CorruptCheckpointError(f"data shard {path!r} for {name!r} is missing or unreadable") from None
        with f:
            f.seek(entry.offset)
            remaining = entry.size
            while remaining:
                chunk = f.read(min(CHUNK_SIZE, remaining))
                if not chunk:
                    raise CorruptCheckpointError(
                        f"data shard {path!r} is truncated: {name!r} needs bytes "
                        f"{entry.offset}..{entry.offset + entry.size}"
                    )
                remaining -= len(chunk)
                yield chunk

    def checked_chunks(self, name: str) -> Iterator[bytes]:
        """A stored numeric tensor's bytes in chunks; raises at the end if the crc32c fails."""
        entry = self.checkpoint.bundle_entry(name)
        crc = 0
        for chunk in self.raw_chunks(entry, name):
            crc = extend(crc, chunk)
            yield chunk
        if mask_crc(crc) != entry.crc32c:
            raise ChecksumMismatchError(f"{name!r}: tensor bytes fail their crc32c check; the data shard is corrupt")

    def cast_chunks(self, item: Item) -> Iterator[bytes]:
        """The bytes of a pure cast, converted chunk by chunk (memory: one chunk)."""
        assert item.cast is not None, "cast_chunks is for an item that casts its origin"
        entry = self.checkpoint.bundle_entry(item.read_name)
        check_readable(item.read_name, entry)
        source, target = numpy_dtype(entry.dtype), numpy_dtype(item.cast)
        pending = b""
        for chunk in self.checked_chunks(item.read_name):
            chunk = pending + chunk
            usable = len(chunk) - len(chunk) % source.itemsize
            pending = chunk[usable:]
            yield cast_array(np.frombuffer(chunk[:usable], source), target, item.read_name).tobytes()
        if pending:
            raise CorruptCheckpointError(f"{item.read_name!r}: stored size is not a whole number of {source} values")

    def concat_chunks(self, concat: Concat) -> Iterator[bytes]:
        """The bytes of a ``concat`` result without building it.

        Along axis 0 the result is its inputs' bytes one after another: stored inputs
        are copied chunk by chunk (crc checked), others decoded one at a time, so the
        peak is the largest input. Along another axis each output block interleaves
        rows of every input; the inputs are held (together the result's size), and
        the result is produced a chunk of rows at a time, never whole.
        """
        if concat.axis == 0:
            for it in concat.items:
                if it.stored and not self.checkpoint.is_partitioned(it.read_name):
                    check_readable(it.read_name, self.checkpoint.bundle_entry(it.read_name))
                    yield from self.checked_chunks(it.read_name)
                else:
                    yield from array_chunks(self.value(it))
            return
        values = [self.value(it) for it in concat.items]
        outer = math.prod(values[0].shape[: concat.axis])
        rows = [v.reshape(outer, -1) for v in values]
        row_bytes = sum(r.shape[1] for r in rows) * values[0].itemsize
        step = max(1, CHUNK_SIZE // max(row_bytes, 1))
        for start in range(0, outer, step):
            block = np.concatenate([r[start : start + step] for r in rows], axis=1)
            yield from array_chunks(block)


def check_readable(name: str, entry) -> None:
    """Refuse a numeric entry whose metadata cannot describe its bytes (dtype 0, size off its shape).

    Copying such an entry would produce an output that TensorFlow refuses to read.
    """
    if entry.dtype == STRING:
        return
    if entry.dtype not in DTYPE_NAMES:
        raise CorruptCheckpointError(
            f"{name!r}: the index gives it dtype {dtype_name(entry.dtype)}, which no tensor can have; "
            "the checkpoint index is corrupt"
        )
    try:
        itemsize = numpy_dtype(entry.dtype).itemsize
    except CorruptCheckpointError:  # resource, variant: encoded with lengths, no fixed size to compare
        return
    expected = math.prod(int(d) for d in entry.shape) * itemsize
    if expected != entry.size:
        raise CorruptCheckpointError(
            f"{name!r}: the index says {entry.size} bytes for a {dtype_name(entry.dtype)} tensor of shape "
            f"{format_shape(entry.shape)} ({expected} expected); the checkpoint index is corrupt"
        )


def cast_array(array: np.ndarray, target: np.dtype, name: str) -> np.ndarray:
    """``array.astype(target)``, or EditError naming a value the cast would change.

    Rounding a float to a narrower float is what such a cast is for and passes. A finite
    float that overflows to inf (or nan), and an integer that wraps, or that the target
    cannot hold exactly, change the value itself and are refused, as truncation is.
    The check runs a block at a time, so it holds no second copy of a whole tensor.
    """
    array = np.asarray(array)
    with np.errstate(over="ignore", invalid="ignore"):
        out = array.astype(target)
    flat_in, flat_out = array.reshape(-1), out.reshape(-1)
    step = max(1, CHUNK_SIZE // max(array.itemsize, 1))
    count, first = 0, None
    for start in range(0, flat_in.size, step):
        bad = np.flatnonzero(_changed(flat_in[start : start + step], flat_out[start : start + step]))
        if bad.size and first is None:
            first = start + int(bad[0])
        count += bad.size
    if first is not None:
        what = "value" if count == 1 else "values"
        raise EditError(
            f"casting {name!r} from {_name(array.dtype)} to {_name(out.dtype)} would change {count} {what} "
            f"(e.g. {flat_in[first].item()!r} -> {flat_out[first].item()!r}): rounding a float is allowed, "
            f"overflow and wrap-around are not; nothing was written. If that is meant, set() it to value.astype({_name(out.dtype)!r}) "
            "with allow_dtype_change=True"
        )
    return out


def _name(dtype) -> str:
    return np.dtype(dtype).name


def _int_range(dtype: np.dtype) -> tuple[int, int]:
    try:
        info = np.iinfo(dtype)
    except ValueError:  # int4, int2, ...: ml_dtypes types
        import ml_dtypes

        ml_info = ml_dtypes.iinfo(dtype)
        return int(ml_info.min), int(ml_info.max)
    return int(info.min), int(info.max)


def _is_int(dtype: np.dtype) -> bool:
    return dtype.kind in "iu" or dtype.name in ("int4", "uint4", "int2", "uint2")


def _changed(a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Mask of the values of ``a`` that ``out`` (its cast) does not hold, beyond float rounding."""
    if a.dtype.kind == "b":
        return np.zeros(a.shape, bool)
    if not _is_int(a.dtype):  # float (bfloat16 and float8 are kind 'V') or complex: only overflow counts
        return np.isfinite(a) & ~np.isfinite(out)
    if a.dtype.kind not in "iu":
        a = a.astype(np.int64)
    if out.dtype.kind == "b":
        return (a != 0) & (a != 1)
    if _is_int(out.dtype):
        (lo, hi), (a_lo, a_hi) = _int_range(out.dtype), _int_range(a.dtype)
        return (a < max(lo, a_lo)) | (a > min(hi, a_hi))
    # Integer to float: exact only if the float is finite, inside the integer range and equal on the way back.
    real = (out.real if out.dtype.kind == "c" else out).astype(np.float64)
    lo, hi = _int_range(a.dtype)
    inside = np.isfinite(real) & (real >= float(lo)) & (real < float(hi + 1))
    back = np.where(inside, real, 0.0).astype(a.dtype)
    return ~inside | (back != a)
