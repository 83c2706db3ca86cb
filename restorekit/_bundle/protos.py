"""BundleEntryProto and BundleHeaderProto, decoded and encoded without importing TensorFlow.

TF's generated classes (``tensorflow.core.protobuf.tensor_bundle_pb2``) import all of
TensorFlow (4-8 s), which would make ``restorekit inspect`` slow and tie the editor to
TF. These two messages are small and frozen since 2016, so we carry our own codec of
the protobuf wire format for exactly them; tests cross-check it against TF's classes.
Unknown fields are kept verbatim so a re-encoded entry loses nothing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

from restorekit._bundle.varint import put_varint, read_varint
from restorekit.errors import CorruptCheckpointError

__all__ = [
    "BundleEntry",
    "BundleHeader",
    "decode_entry",
    "decode_header",
    "encode_entry",
    "encode_header",
    "iter_fields",
    "put_field",
]


@dataclass(frozen=True)
class BundleEntry:
    """One tensor's record in the index: where its bytes are and how to check them."""

    dtype: int = 0
    shape: tuple = ()
    shard_id: int = 0
    offset: int = 0
    size: int = 0
    crc32c: int = 0
    # Partitioned-variable slices (TensorSliceProto bytes), kept opaque.
    slices: tuple = ()
    unknown_rank: bool = False
    extra: bytes = b""
    # The serialized entry this one was decoded from or last encoded to (``encode_entry`` reuses it):
    # not an argument, so ``replace`` (a changed entry) starts without it.
    encoded: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def replace(self, **changes) -> "BundleEntry":
        return replace(self, **changes)


@dataclass(frozen=True)
class BundleHeader:
    num_shards: int = 1
    endianness: int = 0  # 0 little, 1 big
    version_producer: int = 1
    version_min_consumer: int = 0
    bad_consumers: tuple = field(default_factory=tuple)


def iter_fields(buf: bytes, pos: int = 0, end: int | None = None):
    """Yield (field_number, wire_type, value, start, stop) for each field of a message."""
    end = len(buf) if end is None else end
    while pos < end:
        start = pos
        key, pos = read_varint(buf, pos, end, "index entry")
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = read_varint(buf, pos, end, "index entry")
        elif wire == 1:
            if pos + 8 > end:
                raise CorruptCheckpointError("truncated fixed64 in index entry")
            value = struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        elif wire == 2:
            length, pos = read_varint(buf, pos, end, "index entry")
            if pos + length > end:
                raise CorruptCheckpointError("length-delimited field runs past the end of an index entry")
            value = bytes(buf[pos : pos + length])
            pos += length
        elif wire == 5:
            if pos + 4 > end:
                raise CorruptCheckpointError("truncated fixed32 in index entry")
            value = struct.unpack_from("<I", buf, pos)[0]
            pos += 4
        else:
            raise CorruptCheckpointError(f"unsupported protobuf wire type {wire} in index entry")
        if number == 0:
            raise CorruptCheckpointError("protobuf field number 0 in index entry")
        yield number, wire, value, start, pos


def _decode_shape(buf: bytes) -> tuple[tuple, bool]:
    dims = []
    unknown_rank = False
    for number, wire, value, _, _ in iter_fields(buf):
        if number == 2 and wire == 2:
            size = 0
            for n2, w2, v2, _, _ in iter_fields(value):
                if n2 == 1 and w2 == 0:
                    size = v2 - (1 << 64) if v2 >= 1 << 63 else v2
            dims.append(size)
        elif number == 3 and wire == 0:
            unknown_rank = bool(value)
    return tuple(dims), unknown_rank


_new_entry = object.__new__
_ENTRY_KEYS = {0x08: "dtype", 0x18: "shard_id", 0x20: "offset", 0x28: "size"}


def _fast_shape(buf: bytes, pos: int, end: int) -> tuple[tuple, int] | None:
    """The dims of a plain TensorShapeProto (under 128 bytes) at ``pos`` and the position after it; None otherwise."""
    if pos >= end or buf[pos] >= 0x80:  # a shape over 127 bytes (rank > ~20): the general decoder
        return None
    stop = pos + 1 + buf[pos]
    pos += 1
    if stop > end:
        return None
    dims = []
    while pos < stop:
        if buf[pos] != 0x12 or pos + 1 >= stop or buf[pos + 1] >= 0x80:
            return None
        dim_stop = pos + 2 + buf[pos + 1]
        pos += 2
        if dim_stop > stop:
            return None
        value = 0
        while pos < dim_stop:
            if buf[pos] != 0x08:
                return None
            pos += 1
            value = shift = 0
            while True:
                if pos >= dim_stop or shift > 62:  # 63 bits at most: a negative size is not plain
                    return None
                b = buf[pos]
                pos += 1
                value |= (b & 0x7F) << shift
                if b < 0x80:
                    break
                shift += 7
        dims.append(value)
    return tuple(dims), pos


def _decode_entry_fast(buf: bytes) -> BundleEntry | None:
    """The common entry (dtype, plain shape, shard, offset, size, crc) in one pass; None otherwise.

    Listing a checkpoint, and any edit, parses every entry, so this path matters: varints
    are read inline (a call per varint cost more than the rest), and the entry is built
    without the frozen dataclass's per-field ``__init__``. The general field walker handles
    everything else (``None`` sends it there: a field this path does not take, a repeated
    shape or crc, or anything malformed).
    """
    end = len(buf)
    pos = 0
    fields = {"dtype": 0, "shape": (), "shard_id": 0, "offset": 0, "size": 0, "crc32c": 0}
    seen = 0
    while pos < end:
        key = buf[pos]
        pos += 1
        name = _ENTRY_KEYS.get(key)
        if name is not None:
            value = shift = 0
            while True:
                if pos >= end or shift > 63:
                    return None
                b = buf[pos]
                pos += 1
                value |= (b & 0x7F) << shift
                if b < 0x80:
                    break
                shift += 7
            fields[name] = value
        elif key == 0x12 and not seen & 1:
            seen |= 1
            parsed = _fast_shape(buf, pos, end)
            if parsed is None:
                return None
            fields["shape"], pos = parsed
        elif key == 0x35 and pos + 4 <= end and not seen & 2:  # crc32c, fixed32
            seen |= 2
            fields["crc32c"] = buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16 | buf[pos + 3] << 24
            pos += 4
        else:
            return None
    entry = _new_entry(BundleEntry)
    fields.update(slices=(), unknown_rank=False, extra=b"", encoded=bytes(buf))  # written back as read
    entry.__dict__.update(fields)
    return entry


def decode_entry(buf: bytes) -> BundleEntry:
    """Parse a serialized BundleEntryProto.

    Raises:
        CorruptCheckpointError: the bytes are not a well-formed entry.
    """
    fast = _decode_entry_fast(buf)
    if fast is not None:
        return fast
    values = {}
    slices = []
    extra = bytearray()
    shape: tuple = ()
    unknown_rank = False
    shapes = 0
    for number, wire, value, start, stop in iter_fields(buf):
        if number == 2 and wire == 2:
            # protobuf would merge a repeated message field (the dims of both shapes
            # in one list); TF's writer writes one shape, so two mean a damaged entry.
            shapes += 1
            if shapes > 1:
                raise CorruptCheckpointError("index entry has more than one shape field")
            shape, unknown_rank = _decode_shape(value)
        elif number == 7 and wire == 2:
            slices.append(value)
        elif (number, wire) in ((1, 0), (3, 0), (4, 0), (5, 0), (6, 5)):
            values[number] = value
        else:
            extra += buf[start:stop]
    if any(d < 0 for d in shape):
        raise CorruptCheckpointError(f"negative dimension in stored shape {shape}")
    return BundleEntry(
        dtype=values.get(1, 0),
        shape=shape,
        shard_id=values.get(3, 0),
        offset=values.get(4, 0),
        size=values.get(5, 0),
        crc32c=values.get(6, 0),
        slices=tuple(slices),
        unknown_rank=unknown_rank,
        extra=bytes(extra),
    )


def _int32(value: int) -> int:
    # int32 fields carry negative values as 64-bit two's complement varints.
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _packed_varints(value: bytes) -> list[int]:
    out, pos = [], 0
    while pos < len(value):
        v, pos = read_varint(value, pos, len(value), "index header")
        out.append(v)
    return out


def decode_header(buf: bytes) -> BundleHeader:
    """Parse a serialized BundleHeaderProto (scalars: the last value wins, as in protobuf).

    Raises:
        CorruptCheckpointError: the bytes are not a well-formed header.
    """
    values = {}
    version: dict[int, list[int]] = {}
    for number, wire, value, _, _ in iter_fields(buf):
        if number == 3 and wire == 2:
            # VersionDef: producer = 1, min_consumer = 2, repeated bad_consumers = 3
            # (packed or not). A repeated version message merges, as protobuf does.
            for n2, w2, v2, _, _ in iter_fields(value):
                if w2 == 0:
                    version.setdefault(n2, []).append(_int32(v2))
                elif n2 == 3 and w2 == 2:
                    version.setdefault(3, []).extend(_int32(v) for v in _packed_varints(v2))
        elif wire == 0:
            values[number] = value
    return BundleHeader(
        num_shards=values.get(1, 1),
        endianness=values.get(2, 0),
        version_producer=version.get(1, [0])[-1],
        version_min_consumer=version.get(2, [0])[-1],
        bad_consumers=tuple(version.get(3, [])),
    )


def put_field(out: bytearray, number: int, wire: int, value) -> None:
    put_varint(out, (number << 3) | wire)
    if wire == 0:
        put_varint(out, value)
    elif wire == 2:
        put_varint(out, len(value))
        out += value
    elif wire == 5:
        out += struct.pack("<I", value)


def _encode_shape(shape: tuple, unknown_rank: bool) -> bytes:
    out = bytearray()
    for d in shape:
        dim = bytearray()
        if d:
            put_field(dim, 1, 0, d)
        put_field(out, 2, 2, bytes(dim))
    if unknown_rank:
        put_field(out, 3, 0, 1)
    return bytes(out)


def encode_entry(entry: BundleEntry) -> bytes:
    """Serialize a BundleEntry the way TF does (default-valued fields omitted).

    An entry read from an index (the common fields only) gives back the bytes it was read
    from, and one encoded before its earlier encoding: a save that keeps most entries as
    they were (a rename) encodes only what changed."""
    if entry.encoded is not None:
        return entry.encoded
    out = bytearray()
    if entry.dtype:
        put_field(out, 1, 0, entry.dtype)
    shape = _encode_shape(entry.shape, entry.unknown_rank)
    if shape or not entry.slices:
        put_field(out, 2, 2, shape)
    if entry.shard_id:
        put_field(out, 3, 0, entry.shard_id)
    if entry.offset:
        put_field(out, 4, 0, entry.offset)
    if entry.size:
        put_field(out, 5, 0, entry.size)
    if entry.crc32c:
        put_field(out, 6, 5, entry.crc32c)
    for s in entry.slices:
        put_field(out, 7, 2, s)
    out += entry.extra
    encoded = bytes(out)
    object.__setattr__(entry, "encoded", encoded)
    return encoded


def encode_header(header: BundleHeader) -> bytes:
    out = bytearray()
    if header.num_shards:
        put_field(out, 1, 0, header.num_shards)
    if header.endianness:
        put_field(out, 2, 0, header.endianness)
    version = bytearray()
    if header.version_producer:
        put_field(version, 1, 0, header.version_producer)
    if header.version_min_consumer:
        put_field(version, 2, 0, header.version_min_consumer)
    for b in header.bad_consumers:
        put_field(version, 3, 0, b)
    put_field(out, 3, 2, bytes(version))
    return bytes(out)
