"""Base-128 varints, the integer encoding of protobuf and of LevelDB tables, read and written in one place."""

from __future__ import annotations

from restorekit.errors import CorruptCheckpointError

__all__ = ["put_varint", "read_varint"]


def read_varint(buf, pos: int, end: int, what: str) -> tuple[int, int]:
    """The unsigned varint at ``buf[pos:end]`` and the position after it.

    Args:
        what: where the varint sits, for the error message ('index entry').

    Raises:
        CorruptCheckpointError: the varint runs past ``end`` or over 64 bits.
    """
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise CorruptCheckpointError(f"truncated varint in {what}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CorruptCheckpointError(f"varint longer than 64 bits in {what}")


def put_varint(out: bytearray, value: int) -> None:
    """Append ``value`` as a varint; a negative value as its 64-bit two's complement (protobuf int64)."""
    if 0 <= value < 0x80:  # most lengths and small fields: one byte
        out.append(value)
        return
    if value < 0:
        value += 1 << 64
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return
