"""Write files under temporary names in their target directory, then rename them into place.

``Staging`` does it for a checkpoint, several files (``.index`` plus data shards) that
must appear as one: no library renames a *set* of files. The ``.index`` is what makes a
checkpoint exist (every reader, TF's too, starts from it), so it is renamed last, and
whatever it replaces keeps working until that single ``os.replace``. ``atomic_output``
does it for one file (an exported ``.safetensors``, a frozen ``.pb``). Both hold the output's
lock (``restorekit._bundle.locking``) throughout, and a failure while writing leaves them as a
``WriteFailedError`` naming the output, with nothing staged left behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import socket
import time
import uuid
import zlib

from restorekit._bundle.locking import (LOCK_SUFFIX, lock_path, make_directories, output_lock, remove_empty,
                                       remove_unheld_lock, write_failed)
from restorekit._bundle.protos import decode_header
from restorekit._bundle.table import read_table
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, OutputError, WriteFailedError

__all__ = [
    "Staging",
    "atomic_output",
    "crash_point",
    "fsync_directory",
    "link_or_copy",
    "lock_path",
    "output_lock",
    "remove_checkpoint_files",
    "sweep_stale",
    "temp_name",
    "write_bytes",
    "write_failed",
]

_TMP_PREFIX = ".restorekit-tmp-"
# Inside a staging directory: the names a commit renames or removes, for sweep_stale.
_JOURNAL = ".restorekit-journal"
_SHARD = re.compile(r"(.+)\.data-\d{5}-of-(\d{5})")
# A Hugging Face shard and the index that names it (restorekit.export._sharded writes both).
_HF_SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}\.safetensors")
_HF_INDEX = ".safetensors.index.json"
# A Keras 3 sharded weights set: ``NAME_00000.weights.h5``, ... named by ``NAME.weights.json``.
_KERAS_SHARD = re.compile(r"(.+)_\d{5}\.weights\.h5")
_KERAS_INDEX = ".weights.json"
# Files published just before the weights they describe (a Hugging Face config.json):
# a dead commit's copy stays only if some weights file its journal names is visible.
_COMPANIONS = ("config.json",)


def _is_index(path: str) -> bool:
    """An index makes its checkpoint exist: a TF ``.index``, a Hugging Face ``*.safetensors.index.json``
    or a Keras ``*.weights.json``."""
    return path.endswith((".index", _HF_INDEX, _KERAS_INDEX))
# Tests set this to a point name; the process then pauses there so it can be killed.
CRASH_HOOK_ENV = "RESTOREKIT_CRASH_HOOK"


def crash_point(point: str) -> None:
    """Pause at ``point`` when ``$RESTOREKIT_CRASH_HOOK`` names it (kill -9 tests).

    The hook value is ``point:marker_path``; the marker file is created when the point
    is reached, then the process sleeps until it is killed (a signal with a Python handler, such as
    ``interrupts.terminate_cleanly``'s SIGTERM, is handled within 0.05 s).
    """
    spec = os.environ.get(CRASH_HOOK_ENV)
    if not spec:
        return
    name, _, marker = spec.partition(":")
    if name != point:
        return
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    # Short naps, not one long sleep: a signal that lands just before a sleep's system call (its C
    # handler has run, the Python one waits for the next bytecode) is otherwise seen when the sleep ends.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.05)


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
    except (OverflowError, ValueError):  # not a pid this system can have
        return False
    return True


@functools.cache
def _host_tag() -> str:
    # A directory shared between machines (NFS) holds other hosts' temporaries: their
    # pids mean nothing here, so each name carries a short tag of its host.
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


# .restorekit-tmp-PID-HOST-RANDOM[.name]; names written before the host tag lack it.
_TMP_NAME = re.compile(r"\.restorekit-tmp-(\d+)-(?:([0-9a-f]{8})-)?[0-9a-f]{8}(?:\..*)?", re.S)


def _tmp_base() -> str:
    return f"{_TMP_PREFIX}{os.getpid()}-{_host_tag()}-{uuid.uuid4().hex[:8]}"


def temp_name(final) -> str:
    """A hidden temporary path beside ``final`` carrying this process's pid, for ``sweep_stale``.

    ``dir/model.pb`` -> ``dir/.restorekit-tmp-4242-1a2b3c4d-9f8e7d6c.model.pb``. The file
    is not created. Write there, then ``os.replace`` it onto ``final``; if the process
    dies first, the next writer in the directory removes it.
    """
    final = os.path.abspath(os.fspath(final))
    name = os.path.basename(final)
    # Keep the whole name within the 255 bytes most filesystems allow.
    while len(name.encode("utf-8", "surrogateescape")) > 200:
        name = name[:-1]
    return os.path.join(os.path.dirname(final), f"{_tmp_base()}.{name}")


def _is_stale_temporary(name: str) -> bool:
    match = _TMP_NAME.fullmatch(name)
    if match is None:
        return False
    pid, host = int(match.group(1)), match.group(2)
    if host is not None and host != _host_tag():
        return False
    return pid != os.getpid() and not _pid_alive(pid)


def sweep_stale(directory: str) -> None:
    """Remove what killed writers left in ``directory``: temporary files and staging
    directories whose process is gone (on this host), and lock files no one holds."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(LOCK_SUFFIX) and name.startswith("."):
            remove_unheld_lock(path)
        elif name.startswith(_TMP_PREFIX) and _is_stale_temporary(name):
            if os.path.isdir(path) and not os.path.islink(path):
                _remove_orphans(directory, path)
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)


def _read_journal(staging: str) -> dict | None:
    """``{name: identities or None}`` a dead commit's journal lists (None: it wrote none; its commit never began).

    An identity is ``[device, inode, size, mtime]`` of a file the commit published or removed under that
    name (the new one, and an old one it was to replace); journals written before identities
    were recorded give None for each name.
    """
    try:
        with open(os.path.join(staging, _JOURNAL)) as f:
            journal = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(journal, list):  # the first format: names only
        return {name: None for name in journal if isinstance(name, str)}
    if not isinstance(journal, dict) or not isinstance(journal.get("entries"), list):
        return None
    out: dict = {}
    for entry in journal["entries"]:
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            ids = out.setdefault(entry["name"], [])
            ids.extend(i for i in entry.get("ids", ()) if isinstance(i, list))
    return out


def _remove_ours(directory: str, name: str, identities) -> None:
    """Remove ``name`` when it still is a file the journal recorded there (any file, for an old journal)."""
    path = os.path.join(directory, name)
    if identities is not None and _identity(path) not in identities:
        return  # another program wrote that name since: not ours to remove
    with contextlib.suppress(OSError):
        os.remove(path)


def _remove_orphans(directory: str, staging: str) -> None:
    """Remove the visible files a writer killed mid-commit left that no index names.

    Its shards renamed before its index, or the old shards it was to remove after it
    (an in-place save), are data no checkpoint can reach; its journal lists every name
    it touched and which file each name was. A shard stays whenever a live ``.index`` names it
    (the commit's own, if it landed, or another writer's since); a Hugging Face or Keras shard,
    whenever its ``*.safetensors.index.json`` / ``*.weights.json`` lists it (and a Keras set's
    ``NAME_00000.weights.h5``, which Keras opens first whatever the index lists); a
    ``config.json`` renamed ahead of its weights, whenever any weights file the journal names
    is visible. A name that no longer means the file the journal recorded (another program
    wrote it since) always stays.
    """
    names = _read_journal(staging)
    if names is None:
        return  # it died before its commit began: nothing of it is visible
    counts: dict[str, int | None] = {}
    for name, identity in names.items():
        json_shard = _HF_SHARD.fullmatch(name) or _KERAS_SHARD.fullmatch(name)
        if json_shard:
            index = json_shard.group(1) + (_HF_INDEX if name.endswith(".safetensors") else _KERAS_INDEX)
            if not _json_index_names(os.path.join(directory, index), name):
                _remove_ours(directory, name, identity)
            continue
        shard = _SHARD.fullmatch(name)
        prefix = shard.group(1) if shard else name[: -len(".meta")] if name.endswith(".meta") else None
        if prefix is None:
            continue
        if prefix not in counts:
            counts[prefix] = _shard_count(os.path.join(directory, prefix + ".index"))
        count = counts[prefix]
        if count is None or (shard is not None and count != -1 and int(shard.group(2)) != count):
            _remove_ours(directory, name, identity)
    _remove_orphan_companions(directory, names)


def _remove_orphan_companions(directory: str, names: dict) -> None:
    """Remove a dead commit's ``config.json`` when none of the weights its journal names (new or old) is visible."""
    companions = [n for n in names if n in _COMPANIONS]
    if not companions or any(os.path.exists(os.path.join(directory, n)) for n in names if n not in _COMPANIONS):
        return
    for name in companions:
        _remove_ours(directory, name, names[name])


def _json_index_names(index: str, name: str) -> bool:
    """True when the JSON index ``index`` (Hugging Face or Keras) names shard ``name`` in its
    ``weight_map`` (a Keras group may map to a list of shards), or cannot be read: keep it."""
    if index.endswith(_KERAS_INDEX) and name == os.path.basename(index)[: -len(_KERAS_INDEX)] + "_00000.weights.h5":
        if os.path.lexists(index):
            return True  # Keras' loader opens NAME_00000.weights.h5 first, whatever the index lists
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        named = set()
        for value in weight_map.values():
            named.update(value if isinstance(value, list) else [value])
        return name in named
    except FileNotFoundError:
        return False
    except (OSError, ValueError, AttributeError):
        return True


def _shard_count(index: str) -> int | None:
    """The shard count an index names; None when there is no index (-1 when it cannot be read: keep all)."""
    try:
        with open(index, "rb") as f:
            return decode_header(read_table(f.read())[0][1]).num_shards
    except FileNotFoundError:
        return None
    except (OSError, CorruptCheckpointError, IndexError):
        return -1


def remove_checkpoint_files(prefix) -> list[str]:
    """Delete the checkpoint at ``prefix``: ``prefix.index`` first, then its data shards.

    Only ``prefix.index`` and ``prefix.data-NNNNN-of-MMMMM`` are removed, the name
    matched literally (never a glob: ``model[1]`` or ``model*`` are names, not patterns).
    The index goes first, so an interrupted removal leaves no checkpoint, not half of one.

    Returns:
        The paths removed, the index first.

    Raises:
        OutputError: a file could not be removed.
    """
    prefix = os.path.abspath(os.fspath(prefix))
    directory, base = os.path.split(prefix)
    shard = re.compile(re.escape(base) + r"\.data-\d{5}-of-\d{5}")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    doomed = [prefix + ".index"] if base + ".index" in names else []
    doomed += sorted(os.path.join(directory, n) for n in names if shard.fullmatch(n))
    for path in doomed:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise OutputError(f"could not remove {path!r}: {e.strerror}") from None
    if doomed:
        fsync_directory(directory)
    return doomed


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
            crash_point("output-locked")
            yield tmp
            crash_point("before-replace")
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            failed = write_failed(e, path)
            if failed is not e:
                raise failed from e
            raise


def write_bytes(path, data: bytes) -> None:
    """Write a small file atomically and durably: temp file, fsync, rename, fsync the directory."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def _identity(path: str) -> list | None:
    """What tells the file at ``path`` from another written there since: device, inode, size, mtime."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


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
            self.tmpdir = os.path.join(self.directory, _tmp_base())
            os.mkdir(self.tmpdir)
            crash_point("staging-made")
        except BaseException as e:
            if os.path.isdir(getattr(self, "tmpdir", "")):
                _remove_tree(self.tmpdir)
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
            identity = _identity(tmp)
            if identity is not None and self._synced.get(tmp) != identity:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                self._synced[tmp] = identity

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
        self._set_aside_ids = {aside: _identity(old) for old, aside in links.items()}  # a link: the same file
        self._write_journal(list(self._finals), [], asides)
        for old, aside in links.items():
            crash_point("before-aside-link")
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
        crash_point("before-aside-index")
        os.replace(tmp, index)
        fsync_directory(self.directory)
        crash_point("after-aside-index")

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
        crash_point("commit-start")
        try:
            self._publish(list(remove_before), [*remove_after, *self._asides], index_first)
        except BaseException:
            self._roll_back()
            raise
        finally:
            self._release()

    def _publish(self, remove_before: list, remove_after: list, index_first: bool) -> None:
        staged = [t for t in self._finals if os.path.exists(t)]
        self.sync()
        finals = set(self._finals.values())
        indexes = [self._finals[t] for t in staged if _is_index(t)]
        if index_first and any(os.path.exists(self._finals[t]) for t in staged if not _is_index(t)):
            # A shard is about to replace one an existing index points at: that index
            # goes first, or a crash before the new index lands would show the old
            # index over new shards, a checkpoint that is neither.
            remove_before = [*[i for i in indexes if i not in remove_before], *remove_before]
        self._write_journal(staged, remove_before, remove_after)
        removed = False
        for old in remove_before:
            if os.path.exists(old):
                os.remove(old)
                removed = True
        if removed:
            fsync_directory(self.directory)
        crash_point("after-remove-before")
        for tmp in sorted(staged, key=_is_index):
            crash_point(f"rename-{os.path.basename(tmp)}")
            if _is_index(tmp):
                crash_point("before-index-rename")
            os.replace(tmp, self._finals[tmp])
        fsync_directory(self.directory)
        crash_point("after-index-rename")
        self.committed = True
        for old in remove_after:
            if old not in finals and os.path.exists(old):
                crash_point("before-remove-after")
                os.remove(old)
        _remove_tree(self.tmpdir)

    def _roll_back(self) -> None:
        """After an exception mid-commit: what the sweep does after a kill, here and now."""
        if self._journal_written:
            with contextlib.suppress(OSError):
                _remove_orphans(self.directory, self.tmpdir)
        _remove_tree(self.tmpdir)

    def _write_journal(self, staged, remove_before, remove_after) -> None:
        # If this process is killed half-way, sweep_stale reads which names it touched, each with
        # the identity (device, inode, size, mtime) of the file it publishes or removes there: the sweep removes
        # a name only while it still means that file, never one another program wrote since.
        # A staged file's name also takes the file there now, which the commit replaces anyway.
        entries = [{"name": os.path.basename(self._finals[t]),
                    "ids": [i for i in (_identity(t), _identity(self._finals[t])) if i]} for t in staged]
        entries += [{"name": os.path.basename(p), "ids": [i for i in (_identity(p), self._set_aside_ids.get(p)) if i]}
                    for p in (*remove_before, *remove_after) if os.path.dirname(os.path.abspath(p)) == self.directory]
        tmp = os.path.join(self.tmpdir, _JOURNAL + ".new")
        with open(tmp, "w") as f:
            json.dump({"version": 2, "entries": entries}, f)
        os.replace(tmp, os.path.join(self.tmpdir, _JOURNAL))
        self._journal_written = True

    def abort(self) -> None:
        try:
            if getattr(self, "tmpdir", None) is not None:
                self._roll_back() if self._journal_written else _remove_tree(self.tmpdir)
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


def _remove_tree(tmpdir: str) -> None:
    """Remove a staging directory, its journal last: interrupted here, it still tells the sweep what to remove."""
    try:
        names = os.listdir(tmpdir)
    except OSError:
        return
    for name in sorted(names, key=lambda n: n == _JOURNAL):
        path = os.path.join(tmpdir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
        except OSError:
            pass
    with contextlib.suppress(OSError):
        os.rmdir(tmpdir)
