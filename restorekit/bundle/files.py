"""File access for checkpoints: the local disk directly, any other scheme through tf.io.gfile.

Local paths never import TensorFlow, so listing a checkpoint stays fast; ``gs://``,
``ram://``, ``hdfs://`` and the like go through ``tf.io.gfile``, imported on first use.
"""

from __future__ import annotations

import fnmatch
import os
import re
from restorekit._tensorflow import import_tensorflow

__all__ = ["basename", "dirname", "exists", "glob", "isdir", "join", "mtime", "publish", "read_bytes", "read_range", "is_remote"]

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(path: str) -> bool:
    return bool(_SCHEME.match(str(path)))


def _gfile():
    tf = import_tensorflow()

    return tf.io.gfile


def join(*parts: str) -> str:
    if is_remote(parts[0]):
        return "/".join([parts[0].rstrip("/")] + [p.strip("/") for p in parts[1:]])
    return os.path.join(*parts)


def dirname(path: str) -> str:
    if is_remote(path):
        return path.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(path)


def basename(path: str) -> str:
    if is_remote(path):
        return path.rstrip("/").rsplit("/", 1)[-1]
    return os.path.basename(path)


def exists(path: str) -> bool:
    return _gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def glob(directory: str, pattern: str) -> list[str]:
    """Files in ``directory`` whose names match a shell ``pattern``."""
    if is_remote(directory):
        names = _gfile().listdir(directory)
    else:
        names = os.listdir(directory)
    return sorted(join(directory, n.rstrip("/")) for n in names if fnmatch.fnmatch(n.rstrip("/"), pattern))


def mtime(path: str) -> float:
    if is_remote(path):
        return _gfile().stat(path).mtime_nsec / 1e9
    return os.path.getmtime(path)


def read_bytes(path: str) -> bytes:
    if is_remote(path):
        with _gfile().GFile(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def read_range(path: str, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset``; fewer when the file is shorter (callers check)."""
    if is_remote(path):
        with _gfile().GFile(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def publish(local: str, remote: str, *, overwrite: bool) -> None:
    """Copy a finished local file to ``remote`` so that it appears whole or not at all.

    The bytes go to a hidden temporary object beside ``remote`` first, which is then
    renamed (on object stores a rename creates the final object in one step).

    Raises:
        OutputExistsError: ``remote`` exists and ``overwrite`` is False.
        OutputError: the copy or the rename failed (the temporary object is removed).
    """
    import uuid

    from restorekit.errors import OutputError, OutputExistsError

    gfile = _gfile()
    directory, name = dirname(remote), basename(remote)
    tmp = join(directory, f".{name}.restorekit-tmp-{uuid.uuid4().hex[:8]}")
    try:
        gfile.makedirs(directory)
        gfile.copy(local, tmp, overwrite=True)
        gfile.rename(tmp, remote, overwrite=overwrite)
    except Exception as e:  # tf.errors.OpError and OSError alike
        try:
            if gfile.exists(tmp):
                gfile.remove(tmp)
        except Exception:  # noqa: BLE001 - best effort; the original error matters
            pass
        if type(e).__name__ == "AlreadyExistsError":
            raise OutputExistsError(path=remote) from None
        raise OutputError(f"could not write {remote!r}: {e}") from None


def remove(path: str) -> None:
    """Delete a file if it exists (best effort, for cleaning up after a failed write)."""
    try:
        if is_remote(path):
            if _gfile().exists(path):
                _gfile().remove(path)
        elif os.path.exists(path):
            os.remove(path)
    except Exception:  # noqa: BLE001
        pass
