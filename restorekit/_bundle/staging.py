"""Staging files beside their output and committing them as one: the commit path every writer takes.

``Staging`` does it for a checkpoint, several files (``.index`` plus data shards) that
must appear as one: no library renames a *set* of files. The ``.index`` is what makes a
checkpoint exist (every reader, TF's too, starts from it), so it is renamed last, and
whatever it replaces keeps working until that single ``os.replace`` (``commit`` holds the
steps). ``atomic_output`` does it for one file (an exported ``.safetensors``, a frozen ``.pb``).
Both hold the output's lock (``restorekit._bundle.locking``) throughout, sweep what dead
writers left in the directory (``sweep``), and a failure while writing leaves them as a
``WriteFailedError`` naming the output, with nothing staged left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from restorekit._bundle import crashpoints
from restorekit._bundle.commit import (fsync_directory, identity, indexes_first, publish, remove_tree, remove_unneeded,
                                       write_journal)
from restorekit._bundle.locking import make_directories, output_lock, remove_empty, write_failed
from restorekit._bundle.sweep import remove_orphans, sweep_stale, temp_name, tmp_base
from restorekit.errors import InvalidArgumentError, OutputError, WriteFailedError

__all__ = ["Staging", "atomic_output", "check_written", "link_or_copy", "write_bytes", "written_file"]


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

    The output's lock (``output_lock``) is held throughout. A failure while writing (disk
    full, a read-only directory, a library's ``RuntimeError``) leaves as a
    ``WriteFailedError`` naming ``path``, with the temporary file (and any directory
    made for it) gone.

    Raises:
        OutputError: ``path`` is a directory (before anything is written).
        OutputExistsError: another process is writing ``path``.
        WriteFailedError: the write failed.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise OutputError(f"output {path!r} is a directory; name a file")
    directory = os.path.dirname(os.path.abspath(path))
    with output_lock(path):
        # A fresh random name the caller creates: not tempfile.mkstemp, whose files are
        # 0600 (the output gets the permissions any new file gets), and not pre-created,
        # because open(tmp, 'wb') on an existing file truncates it, and ext4 then flushes
        # the whole file when it is closed (auto_da_alloc), which made exports ~3x slower.
        # The name carries our pid, so a writer killed here leaves nothing sweep_stale keeps.
        sweep_stale(directory)
        tmp = temp_name(path)
        try:
            crashpoints.crash_point("output-locked")
            yield tmp
            crashpoints.crash_point("before-replace")
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            failed = write_failed(e, path)
            if failed is not e:
                raise failed from e
            raise


def written_file(path: str) -> tuple[int, int, list]:
    """(size, crc32c, identity) of a file this process staged, made durable first: what a rank of a
    distributed write tells the rank that commits (``check_written``)."""
    from restorekit._bundle.crc import file_crcs

    with open(path, "rb") as f:
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
        crc = file_crcs(f.fileno(), [(0, size)], path=path)[0]
    found = identity(path)
    # Without the device number: another host's mount of the same file system numbers it differently.
    return size, crc if crc is not None else 0, found[1:] if found is not None else []


def check_written(path: str, size: int, crc: int, ident: list, rank: int) -> None:
    """Refuse to commit a file staged by another rank that is not here as that rank wrote it.

    The same inode, size and mtime say it is the file that rank made durable; a file system that shows
    another identity has the file's crc32c checked against the one the rank sent.

    Raises:
        OutputError: the file is missing here (the staging directory is not shared) or has other bytes.
    """
    from restorekit._bundle.crc import file_crcs

    found = identity(path)
    if found is None:
        raise OutputError(f"rank {rank} staged {os.path.basename(path)!r} in {os.path.dirname(path)!r}, which "
                          "this rank cannot see: every rank must write to one shared file system (docs/cluster.md)")
    if found[1:] == list(ident):
        return
    with open(path, "rb") as f:
        here = os.fstat(f.fileno()).st_size
        got = file_crcs(f.fileno(), [(0, here)], path=path)[0] if here == size else None
    if here != size or got != crc:
        raise OutputError(f"{path!r} differs from what rank {rank} wrote (size {here} != {size} or crc32c): "
                          "the shared file system did not show every rank the same bytes")


def write_bytes(path, data: bytes) -> None:
    """Write a small file atomically and durably: temp file, fsync, rename, fsync the directory."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(os.path.dirname(os.path.abspath(path)))


class Staging:
    """A hidden temporary directory inside ``directory`` holding files until ``commit``.

        with Staging('out', output='out/model') as st:
            write(st.path('out/model.index'))
            st.commit()          # renames every file into 'out/', the .index last

    ``output`` is what the commit publishes (a prefix, a file, an index): its lock
    (``output_lock``) is held from here until the commit or abort. Leaving the block
    without ``commit`` (an error, Ctrl-C) removes everything staged; a failure while
    writing leaves as a ``WriteFailedError`` naming ``output``.

    Raises:
        OutputExistsError: another process is writing ``output``.
        WriteFailedError: the directory cannot be made or written.
    """

    def __init__(self, directory: str, *, output):
        self.directory = os.path.abspath(directory or ".")
        self.output = os.fspath(output)
        self._lock: contextlib.AbstractContextManager | None = output_lock(self.output)
        self._lock.__enter__()
        try:
            self._created = make_directories(self.directory)
            sweep_stale(self.directory)
            self.tmpdir = os.path.join(self.directory, tmp_base())
            os.mkdir(self.tmpdir)
            crashpoints.crash_point("staging-made")
        except BaseException as e:
            if os.path.isdir(getattr(self, "tmpdir", "")):
                remove_tree(self.tmpdir)
            remove_empty(getattr(self, "_created", []))
            self._release()
            failed = write_failed(e, self.output)
            if failed is not e:
                raise failed from e
            raise
        self._finals: dict[str, str] = {}
        self._synced: dict[str, list | None] = {}  # staged file -> its identity when sync() made it durable
        self._journal_written = False
        self._asides: list[str] = []
        self._set_aside_ids: dict = {}
        self.committed = False

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.__exit__(None, None, None)

    def path(self, final: str) -> str:
        """The temporary path that becomes ``final`` on commit (same directory only)."""
        final = os.path.abspath(final)
        if os.path.dirname(final) != self.directory:
            raise InvalidArgumentError(f"{final!r} is not in the staging directory {self.directory!r}")
        tmp = os.path.join(self.tmpdir, os.path.basename(final))
        self._finals[tmp] = final
        return tmp

    def sync(self) -> None:
        """Make the files staged so far durable now, so that ``commit`` only renames them.

        For a caller with something else to wait for before it may commit (a save whose
        check of kept bytes is still running). A file changed after this is made durable
        again by ``commit``."""
        for tmp in self._finals:
            synced = identity(tmp)
            if synced is not None and self._synced.get(tmp) != synced:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                self._synced[tmp] = synced

    def set_aside(self, index: str, text: str, links: dict) -> None:
        """Keep a set being replaced whole under other names while the new one takes its names.

        Each ``old -> aside`` of ``links`` is hard-linked (or copied), then ``text`` (the old
        index rewritten to name the asides) replaces ``index`` in one rename: the old set is
        visible all along, and the new shards can then be renamed over the old names. The
        asides are journalled first (a kill leaves nothing the sweep cannot remove) and
        removed once the new index is in place.
        """
        asides = list(links.values())
        self._asides = asides
        self._set_aside_ids = {aside: identity(old) for old, aside in links.items()}  # a link: the same file
        self._write_journal(list(self._finals), [], asides)
        for old, aside in links.items():
            crashpoints.crash_point("before-aside-link")
            if os.path.lexists(aside):
                raise OutputError(f"cannot keep {old!r} aside as {aside!r}: that name is taken")
            link_or_copy(old, aside)
        self._write_journal(list(self._finals), [], asides)  # now with the asides' identities
        tmp = os.path.join(self.tmpdir, ".restorekit-aside-index")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        fsync_directory(self.directory)
        crashpoints.crash_point("before-aside-index")
        os.replace(tmp, index)
        fsync_directory(self.directory)
        crashpoints.crash_point("after-aside-index")

    def commit(self, *, remove_before=(), remove_after=(), index_first: bool = True) -> None:
        """Rename staged files into place in the order staged, ``.index`` files last.

        Files staged first are renamed first: a Hugging Face ``config.json`` staged before
        a single ``model.safetensors`` lands before it (the weights make the output visible).

        A checkpoint appears when its index does, so a crash at any point leaves the old
        checkpoint, the new one, or none, never an index over shards it did not write.
        An exception (Ctrl-C included) part-way through removes what this commit made
        visible that no index names, as the next writer's sweep would after a kill; the
        journal that lists it goes last.

        Args:
            remove_before: files of a checkpoint being overwritten, its ``.index`` first;
                deleted before any rename, so a crash leaves the old checkpoint, the new
                one, or neither, and never a mix.
            remove_after: files the new index no longer needs (an in-place save's old
                shards); deleted once the new index is in place.
            index_first: when a staged shard would replace an existing file, remove the
                existing index first (it might name that file). False when the caller
                knows no old index names a file a new shard replaces (``set_aside``).
        """
        crashpoints.crash_point("commit-start")
        try:
            self._publish(list(remove_before), [*remove_after, *self._asides], index_first)
        except BaseException:
            self._roll_back()
            raise
        finally:
            self._release()

    def _publish(self, remove_before: list, remove_after: list, index_first: bool) -> None:
        staged = {tmp: final for tmp, final in self._finals.items() if os.path.exists(tmp)}
        self.sync()
        if index_first:
            remove_before = indexes_first(staged, remove_before)
        self._write_journal(staged, remove_before, remove_after)
        publish(staged, self.directory, remove_before)
        self.committed = True
        remove_unneeded(remove_after, keep=set(self._finals.values()))
        remove_tree(self.tmpdir)

    def _roll_back(self) -> None:
        """After an exception mid-commit: what the sweep does after a kill, here and now."""
        if self._journal_written:
            with contextlib.suppress(OSError):
                remove_orphans(self.directory, self.tmpdir)
        remove_tree(self.tmpdir)

    def _write_journal(self, staged, remove_before, remove_after) -> None:
        write_journal(self.tmpdir, self.directory, {t: self._finals[t] for t in staged}, [*remove_before, *remove_after],
                      self._set_aside_ids)
        self._journal_written = True

    def abort(self) -> None:
        try:
            if getattr(self, "tmpdir", None) is not None:
                self._roll_back() if self._journal_written else remove_tree(self.tmpdir)
            remove_empty(getattr(self, "_created", []))
        finally:
            self._release()

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.committed:
            self.abort()
        if exc is not None:
            failed = write_failed(exc, self.output)
            if isinstance(failed, WriteFailedError) and _inside(failed.path, self.tmpdir):
                # A writer inside (atomic_output on a staged file) named its temporary file: the output is ours.
                failed = WriteFailedError(path=self.output, cause=failed.cause)
                failed.errno = getattr(exc, "errno", None)
            if failed is not exc:
                raise failed from exc


def _inside(path, directory: str) -> bool:
    return path is not None and os.path.abspath(path).startswith(os.path.join(os.path.abspath(directory), ""))
