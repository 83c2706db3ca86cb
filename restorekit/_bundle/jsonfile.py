"""JSON index files beside shards (``model.safetensors.index.json``, Keras ``.weights.json``), read bounded.

One reader for every index, so the same limits hold everywhere: only a regular file
is opened (a FIFO would block, ``/dev/zero`` would read until memory runs out), at
most ``MAX_BYTES`` are read, and nesting deeper than ``MAX_DEPTH`` is refused by
name rather than escaping as a bare ``RecursionError``.

Why 64 MB: an index holds one short line per tensor (HF) or per layer (Keras),
about 100 bytes each, so 64 MB is some 600,000 tensors, far more than any model
published (the largest HF indexes are a few MB). Parsed JSON costs several times its
size in memory, so the bound also keeps a hostile index from taking gigabytes. A real
index nests 3 levels deep; 64 leaves room for any metadata a tool adds.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

from restorekit._bundle import files
from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "JsonFile", "read_json"]

MAX_BYTES = 64 << 20
MAX_DEPTH = 64


class JsonFile(NamedTuple):
    """A parsed JSON file and the ``os.stat_result`` of the version that was read."""

    value: object
    stat: os.stat_result


def read_json(path, what: str, *, max_bytes: int | None = None, max_depth: int | None = None) -> JsonFile:
    """Parse the JSON file ``path`` (a ``what``, for the messages), bounded in size and depth
    (``MAX_BYTES`` and ``MAX_DEPTH`` unless given).

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        CorruptCheckpointError: not a regular file, larger than ``max_bytes``, not UTF-8
            JSON, or nested deeper than ``max_depth``.
    """
    path = os.fspath(path)
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    max_depth = MAX_DEPTH if max_depth is None else max_depth
    try:
        with files.open_regular(path) as fh:
            st = os.fstat(fh.fileno())
            if st.st_size > max_bytes:
                raise _bad(path, what, f"it is {st.st_size} bytes, more than the {max_bytes} any index needs")
            raw = _read_at_most(fh.fileno(), max_bytes + 1)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no {what} at {path!r}", path) from None
    except OSError as e:
        raise _bad(path, what, f"it cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    if len(raw) > max_bytes:  # it grew while it was read
        raise _bad(path, what, f"it is more than the {max_bytes} bytes any index needs")
    try:
        value = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise _bad(path, what, f"it nests deeper than Python can parse (an index nests {max_depth} levels at most)") \
            from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, what, f"it is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    depth = _depth(value, max_depth)
    if depth > max_depth:
        raise _bad(path, what, f"it nests more than {max_depth} levels deep")
    return JsonFile(value, st)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, min(limit - total, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _depth(value, limit: int) -> int:
    """How deep ``value`` nests (a scalar is 0), counted without recursion; stops once past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            if level > deepest:
                deepest = level
                if deepest > limit:
                    return deepest
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _bad(path: str, what: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path!r} is not a {what}: {why}")
