"""Write files under temporary names in their target directory, then rename them into place.

``Staging`` does it for a checkpoint, several files (``.index`` plus data shards) that
must appear as one: no library renames a *set* of files. The ``.index`` is what makes a
checkpoint exist (every reader, TF's too, starts from it), so it is renamed last, and
whatever it replaces keeps working until that single ``os.replace``. ``atomic_output``
does it for one file (an exported ``.safetensors``, a frozen ``.pb``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid

from restorekit.errors import InvalidArgumentError, OutputError

__all__ = ["Staging", "atomic_output", "crash_point", "fsync_directory", "link_or_copy", "write_bytes"]

_TMP_PREFIX = ".restorekit-tmp-"
# Tests set this to a point name; the process then pauses there so it can be killed.
CRASH_HOOK_ENV = "RESTOREKIT_CRASH_HOOK"


def crash_point(point: str) -> None:
    """Pause at ``point`` when ``$RESTOREKIT_CRASH_HOOK`` names it (kill -9 tests).

    The hook value is ``point:marker_path``; the marker file is created when the point
    is reached, then the process sleeps until it is killed.
    """
    spec = os.environ.get(CRASH_HOOK_ENV)
    if not spec:
        return
    name, _, marker = spec.partition(":")
    if name != point:
        return
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's live process
        return True
    return True


def sweep_stale(directory: str) -> None:
    """Remove temporary directories left by killed writers (their pid is gone)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(_TMP_PREFIX):
            continue
        try:
            pid = int(name[len(_TMP_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def link_or_copy(src: str, dst: str) -> bool:
    """Hard-link ``src`` to ``dst``, or copy it (in chunks) across filesystems. True when linked."""
    try:
        os.link(src, dst)
        return True
    except OSError:
        shutil.copyfile(src, dst)
        return False


@contextlib.contextmanager
def atomic_output(path):
    """Yield a temporary path beside ``path``; move it onto ``path`` only on success.

        with atomic_output('model.pb') as tmp:
            write(tmp)

    Raises:
        OutputError: ``path`` is a directory (before anything is written).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise OutputError(f"output {path!r} is a directory; name a file")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # A fresh random name the caller creates: not tempfile.mkstemp, whose files are
    # 0600 (the output gets the permissions any new file gets), and not pre-created,
    # because open(tmp, 'wb') on an existing file truncates it, and ext4 then flushes
    # the whole file when it is closed (auto_da_alloc), which made exports ~3x slower.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes(path, data: bytes) -> None:
    """Write a small file atomically and durably: temp file, fsync, rename, fsync the directory."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(os.path.dirname(os.path.abspath(path)))


class Staging:
    """A hidden temporary directory inside ``directory`` holding files until ``commit``.

        with Staging('out') as st:
            write(st.path('out/model.index'))
            st.commit()          # renames every file into 'out/', the .index last

    Leaving the block without ``commit`` (an error) removes everything staged.
    """

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory or ".")
        os.makedirs(self.directory, exist_ok=True)
        sweep_stale(self.directory)
        self.tmpdir = os.path.join(self.directory, f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.tmpdir)
        self._finals: dict[str, str] = {}
        self.committed = False

    def path(self, final: str) -> str:
        """The temporary path that becomes ``final`` on commit (same directory only)."""
        final = os.path.abspath(final)
        if os.path.dirname(final) != self.directory:
            raise InvalidArgumentError(f"{final!r} is not in the staging directory {self.directory!r}")
        tmp = os.path.join(self.tmpdir, os.path.basename(final))
        self._finals[tmp] = final
        return tmp

    def commit(self, *, remove_before=(), remove_after=()) -> None:
        """Rename staged files into place, ``.index`` files last.

        Args:
            remove_before: files of a checkpoint being overwritten, its ``.index`` first;
                deleted before any rename, so a crash leaves the old checkpoint, the new
                one, or neither, and never a mix.
            remove_after: files the new index no longer needs (an in-place save's old
                shards); deleted once the new index is in place.
        """
        staged = [t for t in self._finals if os.path.exists(t)]
        for tmp in staged:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        finals = set(self._finals.values())
        for old in remove_before:
            if os.path.exists(old):
                os.remove(old)
        for tmp in sorted(staged, key=lambda t: t.endswith(".index")):
            if tmp.endswith(".index"):
                crash_point("before-index-rename")
            os.replace(tmp, self._finals[tmp])
        fsync_directory(self.directory)
        self.committed = True
        for old in remove_after:
            if old not in finals and os.path.exists(old):
                os.remove(old)
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self.abort()
