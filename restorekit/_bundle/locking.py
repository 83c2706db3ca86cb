"""The one-writer-at-a-time lock of an output, the directories made for it, and the error a failed write becomes.

``output_lock`` is taken by every commit (``staging.Staging``, ``staging.atomic_output``) and
by callers that check an output before writing it (the editor, ``convert``). The lock
file is opened without following links, never truncated unless it is a lock file, and
has a bounded name; see ``_open_lock``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
import types

from restorekit._bundle.files import is_remote
from restorekit._bundle.interrupts import terminate_cleanly
from restorekit.errors import OutputError, OutputExistsError, RestoreKitError, WriteFailedError

fcntl: types.ModuleType | None
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks
    fcntl = None

__all__ = ["LOCK_SUFFIX", "lock_path", "make_directories", "output_lock", "remove_empty", "remove_unheld_lock",
           "write_failed"]

LOCK_SUFFIX = ".restorekit-lock"

_OPEN_LOCK = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
# What a lock file holds: its holder's pid and a newline. A larger file at the lock's name is not one of ours.
_LOCK_BYTES = 32


def remove_unheld_lock(path: str) -> None:
    """Remove a lock file no process holds (its holder died); one that is held stays, and so does
    anything at a lock's name that is not a lock file (a link, a directory, a FIFO: never followed)."""
    if fcntl is None:  # pragma: no cover
        return
    try:
        fd = os.open(path, _OPEN_LOCK)
    except OSError:
        return
    try:
        ours = _lock_problem(os.fstat(fd)) is None
        if ours:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while its holder lives
    except OSError:
        ours = False
    if ours:
        _release(fd, path)
    else:
        os.close(fd)


def _release(fd: int, path: str) -> None:
    """Let go of a held lock: remove its file, only if the name still means the file ``fd`` locks
    (lockers re-check the name after locking, so none is left on an orphan), then close ``fd``,
    which releases the ``flock``."""
    try:
        if _same_file(fd, path):
            os.remove(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _lock_problem(st: os.stat_result) -> str | None:
    """Why the file at a lock's name is not a restorekit lock file, or None when it is one."""
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a file"
        return f"is {kind}"
    # No link at all: another writer's sweep removed the file, then unheld, between our open and our flock
    # (ranks writing one staging directory sweep it at once); _acquire then locks what the name means now.
    if st.st_nlink > 1:
        return "is a hard link to another file"
    if st.st_size > _LOCK_BYTES:
        return f"holds {st.st_size} bytes, not a lock's pid"
    return None


# Names this filesystem allows (bytes); a longer lock name is shortened and keeps a hash of the full one.
_NAME_MAX = 255


def lock_path(prefix) -> str:
    """The hidden lock file beside an output: ``dir/.model.ckpt.restorekit-lock``.

    For an output whose name leaves no room for the lock's dot and suffix (a legal 251-byte
    name), the name is cut and a hash of the whole name added, so it stays within 255 bytes
    and stays one output's.
    """
    prefix = os.path.abspath(os.fspath(prefix))
    base = os.path.basename(prefix)
    name = f".{base}{LOCK_SUFFIX}"
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) > _NAME_MAX:
        digest = hashlib.sha256(base.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        keep = base.encode("utf-8", "surrogateescape")[:150].decode("utf-8", "ignore")
        name = f".{keep}-{digest}{LOCK_SUFFIX}"
    return os.path.join(os.path.dirname(prefix), name)


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, _LOCK_BYTES, 0).decode("ascii", "replace").strip()
    except OSError:  # pragma: no cover
        pid = ""
    return f" (pid {pid})" if pid.isdigit() else ""


def _open_lock(path: str, prefix: str) -> int:
    """Open (creating it) the lock file at ``path`` without following a link, and check it is a lock file.

    Never ``O_TRUNC`` and never through a symlink: a lock name pointing at the source must not
    shrink it. Anything but a small regular file at the name is refused, not waited on.
    """
    try:
        fd = os.open(path, _OPEN_LOCK | os.O_CREAT, 0o644)
    except OSError as e:
        why: str | None
        if os.path.islink(path):
            why = "is a symbolic link"
        elif os.path.isdir(path):
            why = "is a directory"
        else:
            raise write_failed(e, prefix) from None
        raise _refused_lock(path, prefix, why) from None
    try:
        why = _lock_problem(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        raise _refused_lock(path, prefix, why)
    return fd


def _refused_lock(path: str, prefix: str, why: str) -> OutputError:
    return OutputError(
        f"cannot lock {prefix!r} for writing: its lock file {path!r} {why}, not a restorekit lock; "
        "remove it and write again (restorekit never follows or truncates it)"
    )


def _acquire(path: str, prefix: str, wait: bool) -> int:
    assert fcntl is not None  # output_lock takes no lock where there is no fcntl
    while True:
        # A holder that just let go removes the directories it made once they are empty: make them again.
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = _open_lock(path, prefix)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputExistsError.worded(
                lambda w: f"another restorekit process{holder} is writing {prefix!r}; wait for it to finish"
                          + (f" (or pass {w.option('wait')} to queue behind it)" if w.option("wait") else ""),
                path=prefix,
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The file may have been removed (its holder finished, or a sweep found it
        # stale) between our open and our lock: then lock whatever the name means now.
        if _same_file(fd, path):
            return fd
        os.close(fd)


# Locks this process holds: lock path -> (thread, depth). A thread that holds an output's lock
# may take it again (convert holds it around the writer that commits); another thread may not.
_HELD: dict[str, tuple[int, int]] = {}
_HELD_GUARD = threading.Lock()


def _reenter(path: str) -> bool:
    with _HELD_GUARD:
        held = _HELD.get(path)
        if held is None or held[0] != threading.get_ident():
            return False
        _HELD[path] = (held[0], held[1] + 1)
        return True


def _leave(path: str) -> bool:
    """One level less of this thread's hold; True when that was the last."""
    with _HELD_GUARD:
        ident, depth = _HELD[path]
        if depth > 1:
            _HELD[path] = (ident, depth - 1)
            return False
        del _HELD[path]
        return True


def make_directories(directory: str) -> list[str]:
    """``os.makedirs(directory)``; return the directories it created, deepest first (to remove if nothing lands)."""
    created = []
    probe = os.path.abspath(directory)
    while not os.path.lexists(probe):
        created.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    os.makedirs(directory, exist_ok=True)
    return created


def remove_empty(directories) -> None:
    """Remove the directories a failed write created, deepest first, each only if it is empty."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:
            return


@contextlib.contextmanager
def output_lock(prefix, *, wait: bool = False):
    """Hold the one-writer-at-a-time lock of an output (a checkpoint prefix or a file).

        with output_lock('out/model.ckpt'):
            ...write out/model.ckpt.index and its shards...

    An advisory ``flock`` on a hidden file beside the output
    (``.model.ckpt.restorekit-lock``, holding the holder's pid), removed on release.
    The kernel releases the lock when its holder dies, however it dies; the file it
    leaves is removed by the next ``sweep_stale``. The lock file is opened without
    following links and must be a small regular file (see ``_open_lock``). The thread
    that holds a lock may take it again (every commit takes its output's lock, and a
    caller such as ``convert`` holds it around the whole write); another thread or
    process waits or raises. Directories made for the lock that hold nothing when it is
    released (the write failed) are removed. A SIGTERM while the lock is held (in the main
    thread, SIGTERM at its default action) runs the same cleanup as Ctrl-C before the
    process ends (``interrupts.terminate_cleanly``). Remote (``gs://``...) outputs are not
    locked: object stores have no such locks.

    Args:
        wait: block until the other writer finishes instead of raising.

    Yields:
        The lock file's path (None for a remote output).

    Raises:
        OutputExistsError: another process holds the lock and ``wait`` is False;
            ``.path`` is the output.
        OutputError: something that is not a lock file is at the lock's name.
        WriteFailedError: the lock file cannot be created (a read-only or unwritable directory).
    """
    prefix = os.fspath(prefix)
    if fcntl is None or is_remote(prefix):  # pragma: no cover - no advisory locks there
        yield None
        return
    path = lock_path(prefix)
    if _reenter(path):
        try:
            yield path
        finally:
            _leave(path)
        return
    with terminate_cleanly(), _hold(prefix, path, wait):
        yield path


@contextlib.contextmanager
def _hold(prefix: str, path: str, wait: bool):
    try:
        created = make_directories(os.path.dirname(path))
    except OSError as e:
        raise write_failed(e, prefix) from None
    try:
        fd = _acquire(path, prefix, wait)
    except BaseException:
        remove_empty(created)
        raise
    with _HELD_GUARD:
        _HELD[path] = (threading.get_ident(), 1)
    try:
        try:
            os.ftruncate(fd, 0)  # a regular file of at most a pid's bytes, ours (checked by _open_lock)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds without its pid
        yield
    finally:
        if _leave(path):
            try:
                _release(fd, path)
            finally:
                remove_empty(created)


def write_failed(error: BaseException, output) -> BaseException:
    """The restorekit error a failure while writing ``output`` becomes: a ``WriteFailedError`` naming the
    output and the cause, for an ``OSError`` or a library's ``RuntimeError`` (h5py, torch, safetensors);
    restorekit's own errors, and everything else, as they are."""
    if isinstance(error, RestoreKitError):
        return error
    if isinstance(error, OSError):
        cause = error.strerror or str(error) or type(error).__name__
    elif ((isinstance(error, RuntimeError) and not isinstance(error, (NotImplementedError, RecursionError)))
          or type(error).__name__ == "SafetensorError"):
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    else:
        return error
    failed = WriteFailedError(path=os.fspath(output), cause=cause)
    failed.errno = getattr(error, "errno", None)
    return failed
