"""What killed writers leave and its removal: temporary names carrying their writer's pid, the sweep, orphans.

Every temporary name (``temp_name``, a staging directory) carries the pid and host of the
process writing it, so the next writer in the directory (``sweep_stale``) can remove those
whose process is gone, and, for a staging directory whose journal says its commit began,
the files that commit made visible that no index names. ``remove_checkpoint_files``
deletes a whole checkpoint, its index first.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import socket
import uuid
import zlib

from restorekit._bundle.commit import HF_INDEX, KERAS_INDEX, fsync_directory, identity, read_journal
from restorekit._bundle.locking import LOCK_SUFFIX, remove_unheld_lock
from restorekit._bundle.protos import decode_header
from restorekit._bundle.table import read_table
from restorekit.errors import CorruptCheckpointError, OutputError

__all__ = ["remove_checkpoint_files", "remove_orphans", "sweep_stale", "temp_name", "tmp_base"]

_TMP_PREFIX = ".restorekit-tmp-"
_SHARD = re.compile(r"(.+)\.data-\d{5}-of-(\d{5})")
# A Hugging Face shard and the index that names it (restorekit.formats.safetensors._shards writes both).
_HF_SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}\.safetensors")
# A Keras 3 sharded weights set: ``NAME_00000.weights.h5``, ... named by ``NAME.weights.json``.
_KERAS_SHARD = re.compile(r"(.+)_\d{5}\.weights\.h5")
# Files published just before the weights they describe (a Hugging Face config.json):
# a dead commit's copy stays only if some weights file its journal names is visible.
_COMPANIONS = ("config.json",)


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


def tmp_base() -> str:
    """A fresh hidden name carrying this process's pid and host (a staging directory's, or ``temp_name``'s start)."""
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
    return os.path.join(os.path.dirname(final), f"{tmp_base()}.{name}")


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
                remove_orphans(directory, path)
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)


def _remove_ours(directory: str, name: str, identities) -> None:
    """Remove ``name`` when it still is a file the journal recorded there (any file, for an old journal)."""
    path = os.path.join(directory, name)
    if identities is not None and identity(path) not in identities:
        return  # another program wrote that name since: not ours to remove
    with contextlib.suppress(OSError):
        os.remove(path)


def remove_orphans(directory: str, staging: str) -> None:
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
    names = read_journal(staging)
    if names is None:
        return  # it died before its commit began: nothing of it is visible
    counts: dict[str, int | None] = {}
    for name, identities in names.items():
        json_shard = _HF_SHARD.fullmatch(name) or _KERAS_SHARD.fullmatch(name)
        if json_shard:
            index = json_shard.group(1) + (HF_INDEX if name.endswith(".safetensors") else KERAS_INDEX)
            if not _json_index_names(os.path.join(directory, index), name):
                _remove_ours(directory, name, identities)
            continue
        shard = _SHARD.fullmatch(name)
        prefix = shard.group(1) if shard else name[: -len(".meta")] if name.endswith(".meta") else None
        if prefix is None:
            continue
        if prefix not in counts:
            counts[prefix] = _shard_count(os.path.join(directory, prefix + ".index"))
        count = counts[prefix]
        if count is None or (shard is not None and count != -1 and int(shard.group(2)) != count):
            _remove_ours(directory, name, identities)
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
    if index.endswith(KERAS_INDEX) and name == os.path.basename(index)[: -len(KERAS_INDEX)] + "_00000.weights.h5":
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
