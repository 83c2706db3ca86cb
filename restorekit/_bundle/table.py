"""The LevelDB-style sorted table that holds a checkpoint's ``.index``: reader and writer.

Our own reader and writer because no maintained Python package reads or writes this (TF-flavoured,
no snappy) table format without TensorFlow. Layout, from the end of the file:

* a 48-byte footer: two block handles (metaindex, index) as varints, zero padding,
  and the magic number ``0xdb4775248b80fb57``;
* the index block maps a separator key to the handle of each data block;
* each block is prefix-compressed ``(shared, unshared, value_len, key_delta, value)``
  records followed by uint32 restart offsets and their count, then a 5-byte trailer
  (compression type, masked crc32c of block + type).

Every length and offset is checked, so a corrupt or truncated index raises
``CorruptCheckpointError`` and never reads out of bounds or loops.
"""

from __future__ import annotations

import struct

import google_crc32c

from restorekit._bundle.varint import put_varint, read_varint
from restorekit.errors import ChecksumMismatchError, CorruptCheckpointError, InvalidArgumentError

__all__ = ["FOOTER_SIZE", "MAGIC", "mask_crc", "read_table", "unmask_crc", "write_table"]

MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
TRAILER_SIZE = 5
_MASK_DELTA = 0xA282EAD8


def mask_crc(crc: int) -> int:
    """LevelDB's crc masking, used for both block trailers and tensor checksums."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask_crc(masked: int) -> int:
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def _block(data: bytes, offset: int, size: int, *, verify: bool) -> memoryview:
    if offset + size + TRAILER_SIZE > len(data):
        raise CorruptCheckpointError(
            f"block at offset {offset} of size {size} runs past the end of the {len(data)}-byte index"
        )
    kind = data[offset + size]
    if verify:
        expected = unmask_crc(struct.unpack_from("<I", data, offset + size + 1)[0])
        actual = google_crc32c.value(bytes(data[offset : offset + size + 1]))
        if actual != expected:
            raise ChecksumMismatchError(f"index block at offset {offset} fails its crc32c check")
    if kind != 0:
        raise CorruptCheckpointError(
            f"index block at offset {offset} uses compression type {kind}; "
            "TensorFlow writes checkpoint indexes uncompressed"
        )
    return memoryview(data)[offset : offset + size]


def _block_records(block: memoryview):
    n = len(block)
    if n < 4:
        raise CorruptCheckpointError("index block shorter than its restart count")
    num_restarts = struct.unpack_from("<I", block, n - 4)[0]
    limit = n - 4 - 4 * num_restarts
    if num_restarts == 0 or limit < 0:
        raise CorruptCheckpointError(f"index block has an impossible restart count {num_restarts}")
    pos = 0
    key = b""
    while pos < limit:
        shared, pos = read_varint(block, pos, limit, "index table")
        unshared, pos = read_varint(block, pos, limit, "index table")
        value_len, pos = read_varint(block, pos, limit, "index table")
        if shared > len(key) or pos + unshared + value_len > limit:
            raise CorruptCheckpointError("index record overruns its block")
        key = key[:shared] + bytes(block[pos : pos + unshared])
        pos += unshared
        value = bytes(block[pos : pos + value_len])
        pos += value_len
        yield key, value


def read_table(data: bytes, *, verify: bool = True) -> list[tuple[bytes, bytes]]:
    """All (key, value) records of a table, in stored (sorted) order.

    Args:
        data: the whole ``.index`` file.
        verify: check every block's crc32c.

    Raises:
        CorruptCheckpointError: truncated, malformed or unsorted table.
    """
    if len(data) < FOOTER_SIZE:
        raise CorruptCheckpointError(f"index is {len(data)} bytes, shorter than the {FOOTER_SIZE}-byte footer")
    footer = len(data) - FOOTER_SIZE
    magic = struct.unpack_from("<Q", data, len(data) - 8)[0]
    if magic != MAGIC:
        raise CorruptCheckpointError("index footer has the wrong magic number (truncated or not an index)")
    pos = footer
    _meta_offset, pos = read_varint(data, pos, footer + 40, "index table")
    _meta_size, pos = read_varint(data, pos, footer + 40, "index table")
    index_offset, pos = read_varint(data, pos, footer + 40, "index table")
    index_size, pos = read_varint(data, pos, footer + 40, "index table")
    records: list[tuple[bytes, bytes]] = []
    previous = None
    for _, handle in _block_records(_block(data, index_offset, index_size, verify=verify)):
        offset, p = read_varint(handle, 0, len(handle), "index table")
        size, _ = read_varint(handle, p, len(handle), "index table")
        if offset + size + TRAILER_SIZE > footer:
            raise CorruptCheckpointError("data block handle points past the index's data area")
        for key, value in _block_records(_block(data, offset, size, verify=verify)):
            if previous is not None and key <= previous:
                raise CorruptCheckpointError(f"index keys out of order at {key[:80]!r}")
            previous = key
            records.append((key, value))
    return records


# ------------------------------------------------------------------ writer
# Our own writer for the same reason as the reader: no maintained Python package
# writes this table format. It follows LevelDB's TableBuilder (what TF links):
# data blocks with restarts every 16 keys, an empty metaindex block, an index block
# (restart interval 1) keyed by each data block's last key, then the footer.

BLOCK_SIZE = 256 * 1024
_RESTART_INTERVAL = 16


def _shared_prefix(a: bytes, b: bytes) -> int:
    """How many leading bytes ``a`` and ``b`` share (by one xor of the two as integers, not byte by byte)."""
    limit = min(len(a), len(b))
    diff = int.from_bytes(a[:limit], "big") ^ int.from_bytes(b[:limit], "big")
    return limit - (diff.bit_length() + 7) // 8


def _build_block(records, restart_interval: int) -> bytes:
    out = bytearray()
    restarts = []
    last = b""
    for i, (key, value) in enumerate(records):
        if i % restart_interval == 0:
            restarts.append(len(out))
            shared = 0
        else:
            shared = _shared_prefix(last, key)
        put_varint(out, shared)
        put_varint(out, len(key) - shared)
        put_varint(out, len(value))
        out += key[shared:]
        out += value
        last = key
    for r in restarts or [0]:
        out += struct.pack("<I", r)
    out += struct.pack("<I", len(restarts or [0]))
    return bytes(out)


def _with_trailer(block: bytes) -> bytes:
    crc = google_crc32c.extend(google_crc32c.value(block), b"\x00")
    return block + b"\x00" + struct.pack("<I", mask_crc(crc))


def write_table(records) -> bytes:
    """Serialize sorted (key, value) byte records as an uncompressed table (an ``.index`` file).

    Raises:
        InvalidArgumentError: keys that are not strictly increasing.
    """
    out = bytearray()
    index = []
    block: list[tuple[bytes, bytes]] = []
    block_bytes = 0
    previous = None

    def flush():
        nonlocal block, block_bytes
        if not block:
            return
        raw = _build_block(block, _RESTART_INTERVAL)
        handle = bytearray()
        put_varint(handle, len(out))
        put_varint(handle, len(raw))
        index.append((block[-1][0], bytes(handle)))
        out.extend(_with_trailer(raw))
        block, block_bytes = [], 0

    for key, value in records:
        key, value = bytes(key), bytes(value)
        if previous is not None and key <= previous:
            raise InvalidArgumentError(f"table keys must be strictly increasing: {key[:80]!r} after {previous[:80]!r}")
        previous = key
        block.append((key, value))
        block_bytes += len(key) + len(value) + 8
        if block_bytes >= BLOCK_SIZE:
            flush()
    flush()
    handles = bytearray()
    for raw in (_build_block([], 1), _build_block(index, 1)):
        put_varint(handles, len(out))
        put_varint(handles, len(raw))
        out.extend(_with_trailer(raw))
    footer = bytes(handles).ljust(FOOTER_SIZE - 8, b"\x00") + struct.pack("<Q", MAGIC)
    return bytes(out + footer)
