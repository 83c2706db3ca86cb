"""The ``checkpoint`` state file beside a checkpoint: read and written in one place.

TF writes it as a text-format ``CheckpointState`` proto. Its strings are C-escaped
bytes: a non-ASCII path (``/home/José/ckpt``) appears as octal escapes of its UTF-8
bytes (``Jos\\303\\251``), so it must be unescaped to bytes and then decoded as UTF-8,
never read as ``unicode_escape`` text. We write it the same way TF does. Our own parser
(a few lines) because TF's ``text_format`` would import all of TensorFlow.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from restorekit._bundle import files
from restorekit._bundle.staging import write_bytes

__all__ = ["STATE_FILE", "State", "is_outside", "parse", "read", "resolve", "write"]

STATE_FILE = "checkpoint"

_FIELD = re.compile(rb'^\s*(model_checkpoint_path|all_model_checkpoint_paths)\s*:\s*"((?:[^"\\]|\\.)*)"\s*$', re.M)
_SIMPLE = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b'"': b'"', b"'": b"'", b"\\": b"\\", b"a": b"\a",
           b"b": b"\b", b"f": b"\f", b"v": b"\v", b"?": b"?"}
_ESCAPE = re.compile(rb"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|(.))", re.S)


@dataclass(frozen=True)
class State:
    """What a state file says: the latest prefix and every prefix it keeps, as written."""

    model_checkpoint_path: str
    all_model_checkpoint_paths: tuple[str, ...] = ()


def _unescape(raw: bytes) -> bytes:
    def one(m: re.Match) -> bytes:
        octal, hexa, char = m.groups()
        if octal is not None:
            return bytes([int(octal, 8) & 0xFF])
        if hexa is not None:
            return bytes([int(hexa, 16)])
        return _SIMPLE.get(char, char)

    return _ESCAPE.sub(one, raw)


def _escape(text: str) -> str:
    out = []
    for byte in text.encode("utf-8"):
        if byte == 0x22:
            out.append('\\"')
        elif byte == 0x5C:
            out.append("\\\\")
        elif byte == 0x0A:
            out.append("\\n")
        elif 0x20 <= byte < 0x7F:
            out.append(chr(byte))
        else:  # as TF's text_format does: octal escapes of the UTF-8 bytes
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def parse(data: bytes) -> State | None:
    """The state in a state file's bytes, or None when it names no checkpoint."""
    latest, kept = None, []
    for m in _FIELD.finditer(data):
        try:
            value = _unescape(m.group(2)).decode("utf-8")
        except UnicodeDecodeError:
            value = _unescape(m.group(2)).decode("utf-8", "surrogateescape")
        if m.group(1) == b"model_checkpoint_path":
            latest = value
        else:
            kept.append(value)
    if latest is None:
        return None
    return State(latest, tuple(kept))


def read(directory: str) -> State | None:
    """The state file in ``directory``, or None when there is none or it names nothing."""
    path = files.join(directory, STATE_FILE)
    if not files.exists(path):
        return None
    return parse(files.read_bytes(path))


def resolve(directory: str, named: str) -> str:
    """A prefix as the state file names it, made a path: relative names are relative to ``directory``."""
    if files.is_remote(named) or os.path.isabs(named):
        return named
    return files.join(directory, named)


def is_outside(directory: str, prefix: str) -> bool:
    """True when the prefix a state file in ``directory`` names lies outside ``directory`` (symlinks resolved).

    TF's Saver writes absolute paths, so a copied run directory still names the
    original's checkpoints. Remote paths are compared as written.
    """
    if files.is_remote(directory) or files.is_remote(prefix):
        inside, where = directory.rstrip("/"), files.dirname(prefix).rstrip("/")
        return where != inside and not where.startswith(inside + "/")
    inside = os.path.realpath(directory)
    where = os.path.realpath(os.path.dirname(prefix))
    return os.path.commonpath([inside, where]) != inside


def write(prefix: str) -> None:
    """Point ``dirname(prefix)/checkpoint`` at ``prefix``, keeping the prefixes it listed that still exist.

    Listed prefixes outside the directory are dropped: TF's CheckpointManager and
    Saver delete the oldest listed prefixes as their own, wherever they are.

    Written atomically (a temporary file renamed over the old one); on remote paths
    through the same publish step as a checkpoint's files.
    """
    directory = files.dirname(prefix)
    name = files.basename(prefix)
    old = read(directory)
    kept, seen = [], {prefix, resolve(directory, name)}
    for listed in old.all_model_checkpoint_paths if old else ():
        path = resolve(directory, listed)
        if path not in seen and not is_outside(directory, path) and files.exists(path + ".index"):
            kept.append(listed)
            seen.add(path)
    kept.append(name)
    body = f"model_checkpoint_path: {_escape(name)}\n" + "".join(
        f"all_model_checkpoint_paths: {_escape(p)}\n" for p in kept
    )
    state = files.join(directory, STATE_FILE)
    if not files.is_remote(state):
        write_bytes(state, body.encode("ascii"))
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="restorekit-upload-") as local_dir:
        local = os.path.join(local_dir, STATE_FILE)
        with open(local, "wb") as f:
            f.write(body.encode("ascii"))
        files.publish(local, state, overwrite=True)
