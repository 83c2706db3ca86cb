"""Tensor bytes in a data shard: dtypes, checksums, string tensors and slice keys.

Decoding is our own code (no maintained library decodes bundle shards without TF);
checksums use google-crc32c.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct

import google_crc32c
import numpy as np

from restorekit._bundle.table import mask_crc
from restorekit._bundle.varint import put_varint, read_varint
from restorekit.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MissingDependencyError,
)

__all__ = [
    "DTYPE_NAMES",
    "FLOAT_DTYPES",
    "check_crc",
    "check_tensor_bytes",
    "DT_BFLOAT16",
    "DT_BOOL",
    "DT_COMPLEX128",
    "DT_COMPLEX64",
    "DT_DOUBLE",
    "DT_FLOAT",
    "DT_FLOAT4_E2M1FN",
    "DT_FLOAT8_E4M3B11FNUZ",
    "DT_FLOAT8_E4M3FN",
    "DT_FLOAT8_E4M3FNUZ",
    "DT_FLOAT8_E5M2",
    "DT_FLOAT8_E5M2FNUZ",
    "DT_HALF",
    "DT_INT16",
    "DT_INT2",
    "DT_INT32",
    "DT_INT4",
    "DT_INT64",
    "DT_INT8",
    "DT_INVALID",
    "DT_RESOURCE",
    "DT_STRING",
    "DT_UINT2",
    "DT_UINT4",
    "DT_UINT8",
    "DT_VARIANT",
    "decode_slice_key",
    "decode_tensor",
    "dtype_enum",
    "empty_array",
    "empty_tensor",
    "dtype_name",
    "encode_slice_key",
    "encode_string_tensor",
    "itemsize",
    "numpy_dtype",
    "numpy_max_rank",
    "tensor_crc",
]

# TF DataType enum values (tensorflow/core/framework/types.proto) that code tests for.
DT_INVALID = 0
DT_FLOAT = 1
DT_DOUBLE = 2
DT_INT32 = 3
DT_UINT8 = 4
DT_INT16 = 5
DT_INT8 = 6
DT_STRING = 7
DT_COMPLEX64 = 8
DT_INT64 = 9
DT_BOOL = 10
DT_BFLOAT16 = 14
DT_COMPLEX128 = 18
DT_HALF = 19
DT_RESOURCE = 20
DT_VARIANT = 21
DT_FLOAT8_E5M2 = 24
DT_FLOAT8_E4M3FN = 25
DT_FLOAT8_E4M3FNUZ = 26
DT_FLOAT8_E4M3B11FNUZ = 27
DT_FLOAT8_E5M2FNUZ = 28
DT_INT4 = 29
DT_UINT4 = 30
DT_INT2 = 31
DT_UINT2 = 32
DT_FLOAT4_E2M1FN = 33
# The floating-point dtypes a cast between checkpoints' usual float types keeps among.
FLOAT_DTYPES = frozenset({DT_FLOAT, DT_DOUBLE, DT_BFLOAT16, DT_HALF})

# TF DataType enum -> (name, numpy dtype string or None when not a plain buffer).
_DTYPES = {
    DT_FLOAT: ("float32", "<f4"),
    DT_DOUBLE: ("float64", "<f8"),
    DT_INT32: ("int32", "<i4"),
    DT_UINT8: ("uint8", "u1"),
    DT_INT16: ("int16", "<i2"),
    DT_INT8: ("int8", "i1"),
    DT_STRING: ("string", None),
    DT_COMPLEX64: ("complex64", "<c8"),
    DT_INT64: ("int64", "<i8"),
    DT_BOOL: ("bool", "?"),
    11: ("qint8", "i1"),
    12: ("quint8", "u1"),
    13: ("qint32", "<i4"),
    DT_BFLOAT16: ("bfloat16", "bfloat16"),
    15: ("qint16", "<i2"),
    16: ("quint16", "<u2"),
    17: ("uint16", "<u2"),
    DT_COMPLEX128: ("complex128", "<c16"),
    DT_HALF: ("float16", "<f2"),
    DT_RESOURCE: ("resource", None),
    DT_VARIANT: ("variant", None),
    22: ("uint32", "<u4"),
    23: ("uint64", "<u8"),
    # ml_dtypes types, one byte per element in a shard (TF stores int4/int2 unpacked).
    DT_FLOAT8_E5M2: ("float8_e5m2", "float8_e5m2"),
    DT_FLOAT8_E4M3FN: ("float8_e4m3fn", "float8_e4m3fn"),
    DT_FLOAT8_E4M3FNUZ: ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    DT_FLOAT8_E4M3B11FNUZ: ("float8_e4m3b11fnuz", "float8_e4m3b11fnuz"),
    DT_FLOAT8_E5M2FNUZ: ("float8_e5m2fnuz", "float8_e5m2fnuz"),
    DT_INT4: ("int4", "int4"),
    DT_UINT4: ("uint4", "uint4"),
    DT_INT2: ("int2", "int2"),
    DT_UINT2: ("uint2", "uint2"),
    DT_FLOAT4_E2M1FN: ("float4_e2m1fn", "float4_e2m1fn"),
}
DTYPE_NAMES = {code: name for code, (name, _) in _DTYPES.items()}
_BY_NAME = {name: code for code, name in DTYPE_NAMES.items()}
_BY_NAME.update({"float": DT_FLOAT, "double": DT_DOUBLE, "half": DT_HALF, "bytes": DT_STRING, "str": DT_STRING,
                 "object": DT_STRING})
_ML_DTYPES = frozenset({"bfloat16"} | {np_name for code, (_, np_name) in _DTYPES.items() if code >= DT_FLOAT8_E5M2})


def dtype_name(code: int) -> str:
    """TF DataType enum -> 'float32', 'bfloat16', 'string', ... ('dtype_99' when unknown)."""
    return DTYPE_NAMES.get(code, f"dtype_{code}")


def dtype_enum(dtype) -> int:
    """A dtype name, numpy dtype or tf.DType -> the TF DataType enum.

    Raises:
        InvalidArgumentError: a dtype the checkpoint format has no code for.
    """
    if hasattr(dtype, "as_datatype_enum"):
        return int(dtype.as_datatype_enum)
    if isinstance(dtype, str) and dtype in _BY_NAME:
        return _BY_NAME[dtype]
    try:
        np_dtype = np.dtype(dtype)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"dtype {dtype!r} is not a dtype") from None
    if np_dtype.kind in "SUO":
        return DT_STRING
    name = np_dtype.name
    if name in _BY_NAME:
        return _BY_NAME[name]
    raise InvalidArgumentError(f"dtype {dtype!r} has no TensorFlow checkpoint equivalent")


def numpy_dtype(code: int) -> np.dtype:
    """The numpy dtype holding a TF dtype's values (object for strings).

    Raises:
        CorruptCheckpointError: a dtype code TensorFlow does not have.
        InvalidArgumentError: a dtype (resource, variant) that has no numpy form.
    """
    if code not in _DTYPES:
        raise CorruptCheckpointError(f"unknown TensorFlow dtype code {code}")
    name, np_name = _DTYPES[code]
    if np_name is None:
        if code == DT_STRING:
            return np.dtype(object)
        raise InvalidArgumentError(f"dtype {name!r} tensors cannot be read as numpy arrays")
    if np_name in _ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - ml_dtypes ships with TensorFlow
            raise MissingDependencyError(f"reading {name} needs ml_dtypes: pip install ml_dtypes") from None
        if not hasattr(ml_dtypes, np_name):  # pragma: no cover - an old ml_dtypes
            raise MissingDependencyError(f"reading {name} needs a newer ml_dtypes: pip install -U ml_dtypes")
        return np.dtype(getattr(ml_dtypes, np_name))
    return np.dtype(np_name)


def itemsize(code: int) -> int:
    """Bytes per element of a fixed-size TF dtype (its numpy itemsize).

    Raises:
        CorruptCheckpointError: an unknown dtype.
        InvalidArgumentError: a dtype (string, resource, variant) without fixed-size elements.
    """
    if code in (DT_STRING, DT_VARIANT, DT_RESOURCE):
        raise InvalidArgumentError(f"{dtype_name(code)} tensors have no fixed element size")
    return numpy_dtype(code).itemsize


def tensor_crc(raw: bytes) -> int:
    """Masked crc32c of a non-string tensor's bytes, as stored in its BundleEntryProto."""
    return mask_crc(google_crc32c.value(raw))


def _decode_strings(raw: bytes, count: int, name: str, expected_crc: int | None) -> np.ndarray:
    # Layout: varint64 length per element, a masked crc32c (4 bytes) of the lengths
    # as little-endian uint32, then the bytes. The entry's crc covers the uint32
    # lengths, the 4 checksum bytes and the string bytes, in that order.
    pos = 0
    lengths = []
    where = f"the lengths of string tensor {name!r}"
    for _ in range(count):
        n, pos = read_varint(raw, pos, len(raw), where)
        lengths.append(n)
    if pos + 4 > len(raw) or pos + 4 + sum(lengths) != len(raw):
        raise CorruptCheckpointError(f"{name!r}: string tensor lengths do not add up to its {len(raw)} bytes")
    len_bytes = struct.pack(f"<{count}I", *[n & 0xFFFFFFFF for n in lengths])
    stored_len_crc = struct.unpack_from("<I", raw, pos)[0]
    if expected_crc is not None:
        crc = google_crc32c.extend(google_crc32c.value(len_bytes), raw[pos:])
        if mask_crc(crc) != expected_crc or mask_crc(google_crc32c.value(len_bytes)) != stored_len_crc:
            raise ChecksumMismatchError(f"{name!r}: string tensor fails its crc32c check; the shard is corrupt")
    pos += 4
    out = np.empty(count, dtype=object)
    for i, n in enumerate(lengths):
        out[i] = bytes(raw[pos : pos + n])
        pos += n
    return out


def _string_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    # bytes(3) would be three zero bytes: refuse anything that is not text or bytes.
    raise InvalidArgumentError(f"a string tensor holds str or bytes; got {type(value).__name__} {value!r:.60}")


def _check_variant(raw: bytes, count: int, name: str, expected_crc: int) -> None:
    # Layout per element: varint64 length, the serialized variant, then a masked crc32c
    # of everything so far, where the length counts as a little-endian uint64. The
    # entry's crc covers the same stream, the per-element checksums included.
    pos, crc = 0, 0
    where = f"variant tensor {name!r}"
    for i in range(count):
        n, pos = read_varint(raw, pos, len(raw), where)
        if pos + n + 4 > len(raw):
            raise CorruptCheckpointError(f"{name!r}: variant element {i} runs past the tensor's {len(raw)} bytes")
        crc = google_crc32c.extend(crc, struct.pack("<Q", n))
        crc = google_crc32c.extend(crc, raw[pos : pos + n])
        pos += n
        stored = raw[pos : pos + 4]
        if struct.unpack("<I", stored)[0] != mask_crc(crc):
            raise ChecksumMismatchError(f"{name!r}: variant element {i} fails its crc32c check; the shard is corrupt")
        crc = google_crc32c.extend(crc, stored)
        pos += 4
    if pos != len(raw):
        raise CorruptCheckpointError(f"{name!r}: {len(raw) - pos} bytes left over after {count} variant elements")
    if mask_crc(crc) != expected_crc:
        raise ChecksumMismatchError(f"{name!r}: variant tensor fails its crc32c check; the shard is corrupt")


def check_tensor_bytes(raw: bytes, dtype: int, shape: tuple, *, name: str = "", crc32c: int) -> None:
    """Check a stored tensor's bytes against its dtype, shape and crc32c without making an array.

    Works for every dtype TF stores, variants and shapes numpy cannot hold included.

    Raises:
        ChecksumMismatchError: the bytes fail their crc32c.
        CorruptCheckpointError: the bytes do not fit the dtype and shape.
    """
    count = math.prod(int(d) for d in shape)
    if dtype == DT_STRING:
        _decode_strings(raw, count, name, crc32c)
    elif dtype == DT_VARIANT:
        _check_variant(raw, count, name, crc32c)
    else:
        if len(raw) != count * itemsize(dtype):
            raise CorruptCheckpointError(
                f"{name!r}: {len(raw)} bytes do not hold a {dtype_name(dtype)} tensor of shape {list(shape)}"
            )
        if tensor_crc(raw) != crc32c:
            raise ChecksumMismatchError(f"{name!r}: tensor bytes fail their crc32c check; the data shard is corrupt")


def encode_string_tensor(values) -> tuple[bytes, int]:
    """Serialize a string tensor for a data shard; return (bytes, masked entry crc).

    Raises:
        InvalidArgumentError: an element that is neither ``str`` nor bytes.
    """
    flat = [_string_bytes(v) for v in np.asarray(values, dtype=object).ravel()]
    out = bytearray()
    for v in flat:
        put_varint(out, len(v))
    len_bytes = struct.pack(f"<{len(flat)}I", *[len(v) & 0xFFFFFFFF for v in flat])
    len_crc = mask_crc(google_crc32c.value(len_bytes))
    checksum = struct.pack("<I", len_crc)
    out += checksum
    crc = google_crc32c.extend(google_crc32c.value(len_bytes), checksum)
    for v in flat:
        out += v
        crc = google_crc32c.extend(crc, v)
    return bytes(out), mask_crc(crc)


@functools.cache
def numpy_max_rank() -> int:
    """The most dimensions a numpy array may have (64 in numpy 2, 32 before)."""
    try:
        np.empty((1,) * 64)
    except ValueError:  # pragma: no cover - numpy 1.x
        return 32
    return 64


def _check_numpy_rank(name: str, shape) -> None:
    # TF allows 254 dimensions, numpy fewer: such a tensor is valid, just not a numpy array.
    if len(shape) > numpy_max_rank():
        raise InvalidArgumentError(
            f"{name!r} has {len(shape)} dimensions; numpy arrays hold at most {numpy_max_rank()}, so it "
            "cannot be read as one (its bytes can be copied, renamed and verified)"
        )


def decode_tensor(raw: bytes, dtype: int, shape: tuple, *, name: str = "", crc32c: int | None = None) -> np.ndarray:
    """Tensor bytes from a shard -> numpy array, checking the crc when one is given.

    Raises:
        ChecksumMismatchError: the bytes do not match ``crc32c``.
        CorruptCheckpointError: the byte count does not fit the dtype and shape.
        InvalidArgumentError: more dimensions than a numpy array can have.
    """
    count = math.prod(int(d) for d in shape)  # Python ints: a corrupt shape must not wrap around
    if dtype == DT_STRING:
        strings = _decode_strings(raw, count, name, crc32c)
        _check_numpy_rank(name, shape)
        try:
            return strings.reshape(shape)
        except ValueError:
            raise CorruptCheckpointError(f"{name!r}: stored shape {list(shape)} is not a possible array shape") from None
    _check_nbytes(dtype, shape, len(raw), name)
    check_crc(raw, crc32c, name=name)
    out = empty_tensor(dtype, shape, len(raw), name=name)
    out.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, np.uint8)
    return out


def _check_nbytes(dtype: int, shape: tuple, nbytes: int, name: str) -> None:
    if nbytes != math.prod(int(d) for d in shape) * numpy_dtype(dtype).itemsize:
        raise CorruptCheckpointError(
            f"{name!r}: {nbytes} bytes do not hold a {dtype_name(dtype)} tensor of shape {list(shape)}"
        )


_ALIGN = 64
_MAPPED = 4 << 20  # where numpy starts asking for huge pages


def empty_tensor(dtype: int, shape: tuple, nbytes: int, *, name: str = "") -> np.ndarray:
    """An uninitialized array for a stored non-string tensor of ``nbytes`` bytes, its size checked before it is allocated.

    Raises:
        CorruptCheckpointError: ``nbytes`` does not fit the dtype and shape, or the shape is not a possible array.
        InvalidArgumentError: more dimensions than a numpy array can have.
    """
    _check_nbytes(dtype, shape, nbytes, name)
    _check_numpy_rank(name, shape)
    if not nbytes:  # no memory to align; numpy refuses some such shapes, e.g. (0, 2**40, 2**40)
        try:
            return np.empty(shape, dtype=numpy_dtype(dtype))
        except ValueError:
            raise CorruptCheckpointError(f"{name!r}: stored shape {list(shape)} is not a possible array shape") from None
    return _aligned(nbytes).view(numpy_dtype(dtype)).reshape(shape)


def empty_array(shape: tuple, dtype) -> np.ndarray:
    """An uninitialized array of fresh memory, as :func:`empty_tensor` gives (aligned; large ones populated at once)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return _aligned(nbytes).view(dtype).reshape(shape) if nbytes else np.empty(shape, dtype)


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh memory, 64-byte aligned: XLA and TensorFlow take such a numpy array without copying it
    (jax.device_put of a Keras variable on JAX aliases it), and numpy's own large arrays start 16 bytes into a page."""
    if nbytes >= _MAPPED:
        # Anonymous pages, populated in one call: numpy asks large arrays for transparent huge pages, whose
        # faults wait on compaction when memory is fragmented (BERT-base's 420 MB: 1.0-1.4 s that way against
        # 0.4-0.45 s so, on a loaded 2-core VM, each read included).
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes), np.uint8)
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes]


def check_crc(raw, crc32c: int | None, *, name: str = "") -> None:
    """Check a non-string tensor's bytes (bytes, or an array over them, read without a copy) against its crc32c.

    Raises:
        ChecksumMismatchError: the bytes do not match ``crc32c`` (None: nothing to check).
    """
    if crc32c is None:
        return
    if isinstance(raw, np.ndarray):
        raw = raw.reshape(-1).view(np.uint8)  # the crc reads the array's memory as it is (C order)
    crc = tensor_crc(raw)
    if crc != crc32c:
        raise ChecksumMismatchError(
            f"{name!r}: tensor bytes fail their crc32c check (stored {crc32c:#010x}, "
            f"computed {crc:#010x}); the data shard is corrupt"
        )


# ------------------------------------------------------------------ slice keys

def _ordered_string(key: bytes, pos: int) -> tuple[bytes, int]:
    out = bytearray()
    while pos + 1 < len(key):
        b = key[pos]
        if b == 0x00:
            nxt = key[pos + 1]
            if nxt == 0x01:
                return bytes(out), pos + 2
            if nxt == 0xFF:
                out.append(0)
                pos += 2
                continue
            break
        if b == 0xFF:
            if key[pos + 1] == 0x00:
                out.append(0xFF)
                pos += 2
                continue
            break
        out.append(b)
        pos += 1
    raise CorruptCheckpointError("malformed slice key in index")


def _ordered_num(key: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(key):
        raise CorruptCheckpointError("truncated slice key in index")
    n = key[pos]
    if pos + 1 + n > len(key):
        raise CorruptCheckpointError("truncated slice key in index")
    return int.from_bytes(key[pos + 1 : pos + 1 + n], "big"), pos + 1 + n


def _ordered_signed(key: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(key):
        raise CorruptCheckpointError("truncated slice key in index")
    first = key[pos]
    negative = not first & 0x80
    flip = 0xFF if negative else 0x00
    header = first ^ flip
    n = 0
    while n < 8 and header & (0x80 >> n):
        n += 1
    if n == 0 or n >= 8 or pos + n > len(key):
        raise CorruptCheckpointError("unsupported or truncated number in slice key")
    body = bytes(b ^ flip for b in key[pos : pos + n])
    value = int.from_bytes(body, "big") & ((1 << (8 * n - n - 1)) - 1)
    return (~value if negative else value), pos + n


def decode_slice_key(key: bytes) -> tuple[str, tuple[tuple[int, int], ...]]:
    """A partitioned variable's slice key -> (full name, ((start, length), ...)).

    Length -1 means the whole dimension.
    """
    zero, pos = _ordered_num(key, 0)
    if zero != 0:
        raise CorruptCheckpointError("slice key does not start with 0")
    name, pos = _ordered_string(key, pos)
    dims, pos = _ordered_num(key, pos)
    extents = []
    for _ in range(dims):
        start, pos = _ordered_signed(key, pos)
        length, pos = _ordered_signed(key, pos)
        extents.append((start, length))
    return name.decode("utf-8", "replace"), tuple(extents)


def _put_ordered_string(out: bytearray, value: bytes) -> None:
    # 0x00 -> 0x00 0xff and 0xff -> 0xff 0x00, terminated by 0x00 0x01.
    for b in value:
        out += b"\x00\xff" if b == 0 else b"\xff\x00" if b == 0xFF else bytes((b,))
    out += b"\x00\x01"


def _put_ordered_num(out: bytearray, value: int) -> None:
    n = (value.bit_length() + 7) // 8
    out.append(n)
    out += value.to_bytes(n, "big")


def _put_ordered_signed(out: bytearray, value: int) -> None:
    # OrderedCode::WriteSignedNumIncreasing: n header bits of 1 (of 0 when negative),
    # then the sign bit, then the two's complement value in the rest of n bytes.
    x = ~value if value < 0 else value
    n = 1
    while x >= 1 << (7 * n - 1):
        n += 1
    if n >= 8:
        raise InvalidArgumentError(f"slice bound {value} is too large for a slice key")
    body = bytearray((value & ((1 << (8 * n)) - 1)).to_bytes(n, "big"))
    body[0] ^= (0xFF << (8 - n)) & 0xFF
    out += body


def encode_slice_key(name: str, extents) -> bytes:
    """(full name, ((start, length), ...)) -> a partitioned variable's slice key.

    The inverse of ``decode_slice_key`` (TF's ``EncodeTensorNameSlice``); length -1
    means the whole dimension.
    """
    out = bytearray()
    _put_ordered_num(out, 0)
    _put_ordered_string(out, name.encode("utf-8"))
    _put_ordered_num(out, len(extents))
    for start, length in extents:
        _put_ordered_signed(out, start)
        _put_ordered_signed(out, length)
    return bytes(out)
