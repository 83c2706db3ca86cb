"""The ``.keras`` zip archive: member checks, a seekable view of the stored weights member, JSON members."""

from __future__ import annotations

import io
import json
import re
import struct
import zipfile
import zlib

from restorekit._bundle import files
from restorekit.errors import ChecksumMismatchError, CorruptCheckpointError

__all__ = ["MemberFile", "check_crc", "check_member", "json_attr", "json_member", "member_offset"]

_MAX_JSON = 256 << 20
_CHUNK = 1 << 20  # bytes read at a time by check_crc: memory stays at one chunk whatever the member's size


class MemberFile:
    """A read-only, seekable view of a stored (uncompressed) zip member, for h5py."""

    def __init__(self, path: str, offset: int, size: int):
        self._file = io.BufferedReader(files.open_regular(path))  # buffered: HDF5 reads its metadata in small pieces
        self._offset, self._size, self._pos = offset, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        if n <= 0:
            return b""
        self._file.seek(self._offset + self._pos)
        data = self._file.read(n)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


def check_crc(path: str, member: str, offset: int, size: int, crc: int, advance=None) -> None:
    """Check a stored member's bytes (``size`` of them at ``offset`` in ``path``) against its zip CRC-32.

    h5py reads the weights member in place, where zipfile's own check never runs, so a
    changed byte in a tensor would read as a changed value. Streamed in chunks;
    ``advance(n)`` is called after each.

    Raises:
        ChecksumMismatchError: the bytes do not match the CRC-32 the archive records (or end early).
    """
    running, left = 0, size
    with files.open_regular(path) as f:
        f.seek(offset)
        while left:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            running = zlib.crc32(chunk, running)
            left -= len(chunk)
            if advance is not None:
                advance(len(chunk))
    if left or running != crc:
        found = f"ends {left} bytes early" if left else f"has CRC-32 {running:08x}, the archive records {crc:08x}"
        raise ChecksumMismatchError(
            f"{path!r} is corrupt: its {member} member {found}; its bytes changed since Keras wrote it. "
            f"Save the model again with model.save('model.keras')"
        )


def check_member(path: str, member: str) -> None:
    parts = member.replace("\\", "/").split("/")
    if member.startswith(("/", "\\")) or ".." in parts or re.match(r"^[A-Za-z]:", member) or "\x00" in member:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive whose member {member!r} would land outside the folder it is unpacked in; "
            f"Keras never writes such a member. Do not load this file with keras; get the model from a trusted source"
        )


def member_offset(path: str, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes start: after its local header, whose name and extra lengths may differ from the directory's."""
    with files.open_regular(path) as f:
        f.seek(info.header_offset)
        header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def json_member(path: str, archive: zipfile.ZipFile, info):
    if info is None:
        return None
    if info.file_size > _MAX_JSON:
        raise CorruptCheckpointError(f"{path!r}: {info.filename} claims {info.file_size} bytes; not a Keras archive")
    return json_attr(path, archive.read(info), info.filename)


def json_attr(path: str, raw, what: str = "model_config"):
    # json.loads only: a config is data; nothing in it is deserialized or run.
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested past Python's stack
        raise CorruptCheckpointError(f"{path!r}: {what} is not valid JSON ({e}); save the model again") from None
