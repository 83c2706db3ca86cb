"""The LevelDB-style sorted table that holds a checkpoint's ``.index``.

Our own reader because no maintained Python package reads this (TF-flavoured, no
snappy) table format without TensorFlow. Layout, from the end of the file:

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

from restorekit.errors import CorruptCheckpointError, ChecksumMismatchError

__all__ = ["FOOTER_SIZE", "MAGIC", "mask_crc", "read_table", "unmask_crc"]

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


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise CorruptCheckpointError("truncated varint in index table")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CorruptCheckpointError("varint longer than 64 bits in index table")


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
        shared, pos = _varint(block, pos, limit)
        unshared, pos = _varint(block, pos, limit)
        value_len, pos = _varint(block, pos, limit)
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
    _meta_offset, pos = _varint(data, pos, footer + 40)
    _meta_size, pos = _varint(data, pos, footer + 40)
    index_offset, pos = _varint(data, pos, footer + 40)
    index_size, pos = _varint(data, pos, footer + 40)
    records: list[tuple[bytes, bytes]] = []
    previous = None
    for _, handle in _block_records(_block(data, index_offset, index_size, verify=verify)):
        offset, p = _varint(handle, 0, len(handle))
        size, _ = _varint(handle, p, len(handle))
        if offset + size + TRAILER_SIZE > footer:
            raise CorruptCheckpointError("data block handle points past the index's data area")
        for key, value in _block_records(_block(data, offset, size, verify=verify)):
            if previous is not None and key <= previous:
                raise CorruptCheckpointError(f"index keys out of order at {key[:80]!r}")
            previous = key
            records.append((key, value))
    return records
