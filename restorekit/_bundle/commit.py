"""Publishing a staged set in order: the journal a commit leaves for the sweep, renames with the index last, fsync.

``staging.Staging.commit`` runs these steps; ``sweep`` reads the journal back after a writer was
killed mid-commit. The ``.index`` (or JSON index) is what makes a checkpoint exist, so it is renamed
last, after the files it names.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from restorekit._bundle import crashpoints

__all__ = ["HF_INDEX", "JOURNAL", "KERAS_INDEX", "fsync_directory", "identity", "indexes_first", "is_index",
           "publish", "read_journal", "remove_tree", "remove_unneeded", "write_journal"]

# Inside a staging directory: the names a commit renames or removes, for sweep.sweep_stale.
JOURNAL = ".restorekit-journal"
# The index of a Hugging Face shard set (restorekit.formats.safetensors._shards writes it) and of a Keras 3 sharded weights set.
HF_INDEX = ".safetensors.index.json"
KERAS_INDEX = ".weights.json"


def is_index(path: str) -> bool:
    """An index makes its checkpoint exist: a TF ``.index``, a Hugging Face ``*.safetensors.index.json``
    or a Keras ``*.weights.json``."""
    return path.endswith((".index", HF_INDEX, KERAS_INDEX))


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


def identity(path: str) -> list | None:
    """What tells the file at ``path`` from another written there since: device, inode, size, mtime."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def write_journal(tmpdir: str, directory: str, staged: dict[str, str], removed, known: dict) -> None:
    """Record in ``tmpdir`` every name of ``directory`` a commit is about to touch, with which file each is.

    ``staged`` maps staged files to their final paths; ``removed`` lists the files it removes (those
    outside ``directory`` are not recorded); ``known`` gives identities recorded earlier for some of
    them (a set-aside link is the same file as the one it keeps).
    """
    # If this process is killed half-way, sweep_stale reads which names it touched, each with
    # the identity (device, inode, size, mtime) of the file it publishes or removes there: the sweep removes
    # a name only while it still means that file, never one another program wrote since.
    # A staged file's name also takes the file there now, which the commit replaces anyway.
    entries = [{"name": os.path.basename(final), "ids": [i for i in (identity(tmp), identity(final)) if i]}
               for tmp, final in staged.items()]
    entries += [{"name": os.path.basename(p), "ids": [i for i in (identity(p), known.get(p)) if i]}
                for p in removed if os.path.dirname(os.path.abspath(p)) == directory]
    tmp = os.path.join(tmpdir, JOURNAL + ".new")
    with open(tmp, "w") as f:
        json.dump({"version": 2, "entries": entries}, f)
    os.replace(tmp, os.path.join(tmpdir, JOURNAL))


def read_journal(tmpdir: str) -> dict | None:
    """``{name: identities or None}`` a dead commit's journal lists (None: it wrote none; its commit never began).

    An identity is ``[device, inode, size, mtime]`` of a file the commit published or removed under that
    name (the new one, and an old one it was to replace); journals written before identities
    were recorded give None for each name.
    """
    try:
        with open(os.path.join(tmpdir, JOURNAL)) as f:
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


def indexes_first(staged: dict[str, str], remove_before: list) -> list:
    """``remove_before``, led by the existing indexes the staged ones replace when a staged shard replaces a file."""
    if not any(os.path.exists(final) for tmp, final in staged.items() if not is_index(tmp)):
        return remove_before
    # A shard is about to replace one an existing index points at: that index
    # goes first, or a crash before the new index lands would show the old
    # index over new shards, a checkpoint that is neither.
    indexes = [final for tmp, final in staged.items() if is_index(tmp)]
    return [*[i for i in indexes if i not in remove_before], *remove_before]


def publish(staged: dict[str, str], directory: str, remove_before: list) -> None:
    """Remove ``remove_before``, then rename each staged file onto its final path in order, indexes last."""
    removed = False
    for old in remove_before:
        if os.path.exists(old):
            os.remove(old)
            removed = True
    if removed:
        fsync_directory(directory)
    crashpoints.crash_point("after-remove-before")
    for tmp in sorted(staged, key=is_index):
        crashpoints.crash_point(f"rename-{os.path.basename(tmp)}")
        if is_index(tmp):
            crashpoints.crash_point("before-index-rename")
        os.replace(tmp, staged[tmp])
    fsync_directory(directory)
    crashpoints.crash_point("after-index-rename")


def remove_unneeded(paths, keep: set) -> None:
    """Once the new index is in place: remove the old files it no longer names (``keep``: what was just published)."""
    for old in paths:
        if old not in keep and os.path.exists(old):
            crashpoints.crash_point("before-remove-after")
            os.remove(old)


def remove_tree(tmpdir: str) -> None:
    """Remove a staging directory, its journal last: interrupted here, it still tells the sweep what to remove."""
    try:
        names = os.listdir(tmpdir)
    except OSError:
        return
    for name in sorted(names, key=lambda n: n == JOURNAL):
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
