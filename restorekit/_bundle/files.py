"""File access for checkpoints: the local disk directly, any other scheme through tf.io.gfile.

Local paths never import TensorFlow, so listing a checkpoint stays fast; ``gs://``,
``ram://``, ``hdfs://`` and the like go through ``tf.io.gfile``, imported on first use.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import stat

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError, InsufficientSpaceError, OutputError, OutputExistsError

__all__ = [
    "INDEX_SLACK",
    "basename",
    "check_shard_files",
    "check_space",
    "dirname",
    "exists",
    "free_space",
    "glob",
    "identity",
    "is_remote",
    "isdir",
    "join",
    "mtime",
    "open_regular",
    "RemoteStaging",
    "publish",
    "read_bytes",
    "read_into",
    "read_range",
    "remove",
    "size",
    "stat_regular",
]

# Room for an index, headers and filesystem rounding on top of the tensor bytes in the free-space check.
INDEX_SLACK = 1 << 20
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(path: str) -> bool:
    return bool(_SCHEME.match(str(path)))


def _gfile():
    tf = import_tensorflow()

    return tf.io.gfile


@contextlib.contextmanager
def _remote(path: str):
    """TensorFlow's errors for a remote ``path`` it cannot reach (no such bucket, no network, no credentials) as
    one restorekit error naming the path: TF's own first line does not."""
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith("tensorflow"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise CheckpointNotFoundError(f"cannot read {path!r}: {type(e).__name__}: {first}", path) from None


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
    if is_remote(path):
        with _remote(path):
            return _gfile().exists(path)
    return os.path.exists(path)


def isdir(path: str) -> bool:
    if is_remote(path):
        with _remote(path):
            return _gfile().isdir(path)
    return os.path.isdir(path)


def glob(directory: str, pattern: str) -> list[str]:
    """Files in ``directory`` whose names match a shell ``pattern``."""
    if is_remote(directory):
        with _remote(directory):
            names = _gfile().listdir(directory)
    else:
        names = os.listdir(directory)
    return sorted(join(directory, n.rstrip("/")) for n in names if fnmatch.fnmatch(n.rstrip("/"), pattern))


def mtime(path: str) -> float:
    if is_remote(path):
        with _remote(path):
            return _gfile().stat(path).mtime_nsec / 1e9
    return os.path.getmtime(path)


_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def _refuse_special(path: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "special file")
    raise CorruptCheckpointError(f"{path!r} is a {kind}, not a regular file; refusing to read it")


def open_regular(path: str):
    """Open a local file for reading (unbuffered binary), refusing anything but a regular file.

    A FIFO in place of an index or shard would block ``open`` forever and a device
    would read without end, so the path is checked with ``os.stat`` before it is
    opened, and the descriptor again after (O_NONBLOCK keeps a FIFO swapped in
    between from blocking the open).

    Raises:
        CorruptCheckpointError: ``path`` is a FIFO, device, socket or directory.
        OSError: ``path`` does not exist or cannot be opened.
    """
    _refuse_special(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        _refuse_special(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb", buffering=0)


def stat_regular(path: str) -> os.stat_result:
    """``os.stat(path)`` of a local file, refusing anything but a regular file (checked before a library that
    opens by path, such as HDF5, would block on a FIFO or read a device without end).

    Raises:
        CorruptCheckpointError: ``path`` is a FIFO, device, socket or directory.
        OSError: ``path`` does not exist.
    """
    st = os.stat(path)
    _refuse_special(path, st.st_mode)
    return st


def identity(st: os.stat_result) -> tuple:
    """What tells one version of a file from another: a file renamed over it (another inode) or rewritten
    in place (another size or mtime) gives another identity."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def size(path: str) -> int:
    """Length of a file in bytes (a local one must be a regular file).

    Raises:
        CorruptCheckpointError: a local ``path`` that is not a regular file.
    """
    if is_remote(path):
        with _remote(path):
            return int(_gfile().stat(path).length)
    return stat_regular(path).st_size


def read_bytes(path: str) -> bytes:
    """The whole file.

    Raises:
        CorruptCheckpointError: a local ``path`` that is not a regular file.
    """
    if is_remote(path):
        with _remote(path), _gfile().GFile(path, "rb") as f:
            return f.read()
    with open_regular(path) as f:
        return f.readall()


def read_range(path: str, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset``; fewer when the file is shorter (callers check).

    Raises:
        CorruptCheckpointError: a local ``path`` that is not a regular file.
    """
    if is_remote(path):
        with _remote(path), _gfile().GFile(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    with open_regular(path) as f:
        chunks = []
        while size > 0:
            chunk = os.pread(f.fileno(), min(size, 1 << 30), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            size -= len(chunk)
        return b"".join(chunks)


def read_into(path: str, offset: int, buffer) -> int:
    """Fill ``buffer`` (a writable C-contiguous buffer: a numpy array, a torch tensor's ``numpy()`` view) with
    the bytes at ``offset``, read straight into it; returns how many were read (fewer when the file is shorter).

    Reading into memory the caller already holds saves a fresh allocation (a page fault per 4 KiB the first
    time it is written) and the copy out of it.

    Raises:
        CorruptCheckpointError: a local ``path`` that is not a regular file.
    """
    view = memoryview(buffer)
    if not view.nbytes:
        return 0
    view = view.cast("B")
    if is_remote(path):
        data = read_range(path, offset, len(view))
        view[: len(data)] = data
        return len(data)
    done = 0
    with open_regular(path) as f:
        while done < len(view):
            n = os.preadv(f.fileno(), [view[done : done + (1 << 30)]], offset + done)
            if not n:
                break
            done += n
    return done


_SHARD_FILE = re.compile(r"\.data-(\d{5})-of-(\d{5})")


def check_shard_files(prefix: str, num_shards: int) -> None:
    """Refuse a local checkpoint whose data shards are not all there (one ``stat`` each, no reads).

    Shards of another save beside the prefix (another shard count) are named, since
    they are the usual cause and cannot stand in. (Shards of another save with the same
    count fail their crc32c when their bytes are read.) Remote prefixes are not checked.

    Raises:
        CorruptCheckpointError: a data shard is missing (nothing has been written).
    """
    if is_remote(prefix):
        return
    paths = [f"{prefix}.data-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]
    missing = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
    if not missing:
        return
    directory, base = os.path.split(prefix)
    try:
        names = os.listdir(directory or ".")
    except OSError:
        names = []
    others = sorted({int(m.group(2)) for n in names if n.startswith(base)
                     and (m := _SHARD_FILE.fullmatch(n[len(base):])) and int(m.group(2)) != num_shards})
    strays = (f"; the directory holds shards of another save of {base!r} (of "
              f"{', '.join(f'{n:05d}' for n in others)}), which cannot stand in") if others else ""
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    raise CorruptCheckpointError(
        f"{prefix!r} is missing {len(missing)} of its {num_shards} data shards ({shown}){strays}; nothing was written"
    )


def publish(local: str, remote: str, *, overwrite: bool) -> None:
    """Copy a finished local file to ``remote`` so that it appears whole or not at all.

    The bytes go to a hidden temporary object beside ``remote`` first, which is then
    renamed (on object stores a rename creates the final object in one step).

    Raises:
        OutputExistsError: ``remote`` exists and ``overwrite`` is False.
        OutputError: the copy or the rename failed (the temporary object is removed).
    """
    import uuid

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


class RemoteStaging:
    """Files for a remote directory, staged locally one at a time and uploaded as each is finished.

    The local side of a ``gs://`` (any ``tf.io.gfile``) save: ``path(final)`` names a
    local file under ``$TMPDIR`` that becomes ``final``; ``publish(final)`` uploads it
    at once (hidden name, then rename: see ``publish``) and deletes the local copy, so
    the local disk holds only the files not yet published. ``commit`` uploads what is
    left, ``.index`` files last; an error before then (``abort``) removes every object
    already uploaded. Same interface as ``staging.Staging`` where the save needs it.
    """

    def __init__(self, directory: str):
        import tempfile

        self.directory = directory.rstrip("/")
        self.tmpdir = tempfile.mkdtemp(prefix="restorekit-upload-")
        self._finals: dict[str, str] = {}
        self.uploaded: list[str] = []
        self.committed = False

    def path(self, final: str) -> str:
        if dirname(final) != self.directory:
            raise OutputError(f"{final!r} is not in the output directory {self.directory!r}")
        tmp = os.path.join(self.tmpdir, basename(final))
        self._finals[tmp] = final
        return tmp

    def publish(self, final: str, local: str | None = None) -> None:
        """Upload ``final``'s staged file (or the existing file ``local``) now; a staged file is then deleted."""
        tmp = local or os.path.join(self.tmpdir, basename(final))
        # A data shard under this name without its index is an orphan of an earlier failed save.
        publish(tmp, final, overwrite=not final.endswith(".index"))
        self.uploaded.append(final)
        if local is None:
            os.remove(tmp)
            self._finals.pop(tmp, None)

    def sync(self) -> None:
        """Nothing to do: what is published has been uploaded, and the rest is uploaded by ``commit``."""

    def commit(self, *, remove_before=(), remove_after=()) -> None:
        """Upload the staged files not yet published, ``.index`` files last."""
        if remove_before or remove_after:
            raise OutputError(f"{self.directory!r}: a remote output cannot replace files atomically")
        staged = [t for t in self._finals if os.path.exists(t)]
        for tmp in sorted(staged, key=lambda t: t.endswith(".index")):
            self.publish(self._finals[tmp])
        self.committed = True
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def abort(self) -> None:
        for final in self.uploaded:
            remove(final)
        self.uploaded = []
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self) -> "RemoteStaging":
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self.abort()


def check_parent(path: str) -> None:
    """Refuse an output whose would-be parent directory is a file (``os.makedirs`` would fail bare).

    Raises:
        OutputError: some existing ancestor of ``path`` is not a directory.
    """
    from restorekit.errors import OutputError

    if is_remote(path):
        return
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise OutputError(f"cannot write {path!r}: {parent!r} is a file, not a directory; nothing was written")


def output_prefix(out: str, source_name: str) -> str:
    """Where a TF checkpoint named by ``out`` goes: inside ``out`` when it is a directory or ends in '/'.

    ``source_name`` names the file in that directory (the source's own base name).
    """
    if out.endswith(("/", os.sep)) or (not is_remote(out) and os.path.isdir(out)):
        return join(out.rstrip("/" + os.sep) or "/", source_name)
    return out


def free_space(directory: str) -> int:
    """Free bytes on the local filesystem that holds (or would hold) ``directory``."""
    probe = os.path.abspath(directory or ".")
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


def check_space(directory: str, needed: int) -> None:
    """Refuse a write of about ``needed`` bytes into ``directory`` that its disk cannot hold.

    Called before anything is staged, so a full disk fails at once with nothing
    written instead of part-way with a staging directory to clean up. A remote
    ``directory`` (``gs://``) is not checked here: what a remote write stages locally
    is checked where it is staged (``$TMPDIR``).

    Raises:
        InsufficientSpaceError: fewer than ``needed`` bytes (plus ``INDEX_SLACK``) are free.
    """
    if is_remote(directory):
        return
    free = free_space(directory)
    if needed + INDEX_SLACK > free:
        raise InsufficientSpaceError(
            f"saving to {directory!r} needs about {(needed + INDEX_SLACK) / 1e6:.1f} MB but only "
            f"{free / 1e6:.1f} MB are free; nothing was written"
        )
