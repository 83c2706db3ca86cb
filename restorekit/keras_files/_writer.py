"""Writing Keras 3 ``.weights.h5`` files and ``.keras`` archives that Keras loads: structure checks, atomic writes.

Keras 3 finds a layer's variables by position: the layer's group (named by attribute or
by class in a list, ``layers/dense_1``) holds ``vars/0``, ``vars/1``, ... and
``Layer.load_own_variables`` refuses a group whose count differs from the layer's. So
an output is checked before anything is written: every tensor is a ``.../vars/N`` key,
each group's indices run 0..n-1, and a layer group of the source keeps its count
(optimizer groups may change: Keras skips a mismatched optimizer with a warning).
A ``.keras`` archive is rewritten whole: its other members (``config.json``,
``metadata.json``, assets) copied as they are, its ``model.weights.h5`` written anew.

A sharded set (``write_sharded``) is laid out as Keras 3's ``ShardedH5IOStore`` lays it
out: groups in order, a new shard ``NAME_0000N.weights.h5`` once the running size passes
``max_shard_size`` (so one layer's ``vars`` may run over two shards; its ``name``
attribute stays in the shard that was current when the layer began), a tensor larger
than the limit refused, and the index ``NAME.weights.json`` naming each group's shards.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import zipfile

import numpy as np

from restorekit._bundle import crashpoints
from restorekit._bundle.staging import Staging, atomic_output
from restorekit._bundle.sweep import temp_name
from restorekit.errors import InvalidArgumentError, format_names

__all__ = ["WEIGHTS_MEMBER", "check_structure", "keras_size", "set_files", "shard_layout", "shard_paths", "write_archive",
           "write_order", "write_sharded", "write_weights"]

WEIGHTS_MEMBER = "model.weights.h5"
_COPY_BUFFER = 1 << 20

_KEY = re.compile(r"^(?:(.+)/)?vars/(\d+)$")


def _group_of(key: str) -> tuple[str, int] | None:
    """(layer group, index) of a ``.weights.h5`` key, or None when it is not one."""
    match = _KEY.match(key)
    return (match.group(1) or "", int(match.group(2))) if match else None


def _parts(key: str) -> tuple[str, int]:
    """(layer group, index) of a key that must be a ``.weights.h5`` key (``check_structure`` refuses the others)."""
    parts = _group_of(key)
    if parts is None:
        raise InvalidArgumentError(f"{key!r} is not a Keras .weights.h5 key ('<layer group>/vars/<index>')")
    return parts


def _groups(keys) -> dict:
    out: dict = {}
    for key in keys:
        group, index = _parts(key)
        out.setdefault(group, []).append(index)
    return out


def check_structure(keys, source_keys=None, *, where: str = "the output") -> None:
    """Refuse a set of keys ``model.load_weights`` could not load (see the module docstring).

    ``source_keys``: the keys of the file the output was edited from; a layer group
    there must keep its number of variables (or be left out whole).

    Raises:
        InvalidArgumentError: a key that is not ``.../vars/N``, a gap in a group's
            indices, or a layer group whose count changed.
    """
    keys = list(keys)
    bad = [k for k in keys if _group_of(k) is None]
    if bad:
        raise InvalidArgumentError(
            f"{where}: a Keras .weights.h5 holds variables as '<layer group>/vars/<index>'; "
            f"{format_names(bad)} {'is not such a key' if len(bad) == 1 else 'are not such keys'}. Keras finds variables by "
            f"position, so a renamed variable would not load: keep the file's keys (rename whole layer groups "
            f"only, 'layers/dense_1/vars/0' -> 'layers/dense_2/vars/0'), or write a TF checkpoint or safetensors"
        )
    groups = _groups(keys)
    for group, indices in groups.items():
        if sorted(indices) != list(range(len(indices))):
            raise InvalidArgumentError(
                f"{where}: layer group {group or '(the model)'!r} would hold variables {sorted(indices)}; "
                f"model.load_weights needs vars/0..vars/{len(indices) - 1} with no gap"
            )
    if source_keys is None:
        return
    for group, indices in _groups(source_keys).items():
        if group in groups and len(groups[group]) != len(indices) and not _is_optimizer(group):
            raise InvalidArgumentError(
                f"{where}: layer group {group or '(the model)'!r} had {len(indices)} variables and would hold "
                f"{len(groups[group])}; Keras' load_own_variables refuses a layer whose variable count differs. "
                f"Delete or add whole layer groups only"
            )


def _is_optimizer(group: str) -> bool:
    return group == "optimizer" or group.startswith("optimizer/")


def write_weights(path, tensors, *, attrs: dict | None = None) -> str:
    """Write ``(key, array)`` pairs as a Keras 3 ``.weights.h5`` file, atomically (temp file, rename).

    ``attrs``: ``{group path: {attribute: value}}`` to set on groups (the ``name``
    Keras stores on each ``vars`` group). bfloat16 arrays are stored as Keras stores
    them (the dataset marked ``dtype='bfloat16'``).

    Raises:
        InvalidArgumentError: keys ``model.load_weights`` could not load (nothing written).
        MissingDependencyError: h5py is not installed.
    """
    path = os.fspath(path)
    tensors = list(tensors) if not isinstance(tensors, list) else tensors
    check_structure([k for k, _ in tensors], where=repr(path))
    with atomic_output(path) as tmp:
        _write_h5(tmp, tensors, attrs)
    return path


def write_archive(path, source, tensors, *, attrs: dict | None = None) -> str:
    """Write a ``.keras`` archive at ``path``, atomically (temp file beside it, then rename): the members
    of the archive ``source`` as they are, in their order, with ``model.weights.h5`` holding ``tensors``
    (as ``write_weights`` writes them; stored, as Keras stores it). ``source`` may be ``path`` itself: it
    is read to the end before the new archive replaces it.

    Raises:
        InvalidArgumentError: keys ``model.load_weights`` could not load (nothing written).
        MissingDependencyError: h5py is not installed.
    """
    path, source = os.fspath(path), os.fspath(source)
    tensors = list(tensors) if not isinstance(tensors, list) else tensors
    check_structure([k for k, _ in tensors], where=repr(path))
    with atomic_output(path) as tmp:
        weights = temp_name(path + ".weights.h5")  # the new member, whole, before it goes into the archive
        try:
            _write_h5(weights, tensors, attrs)
            crashpoints.crash_point("keras-member-written")
            with zipfile.ZipFile(source) as old, zipfile.ZipFile(tmp, "w") as new:
                for info in old.infolist():
                    if info.filename == WEIGHTS_MEMBER:
                        with open(weights, "rb") as member:
                            _add_member(new, info, member, os.path.getsize(weights), zipfile.ZIP_STORED)
                    else:
                        with old.open(info) as member:
                            _add_member(new, info, member, info.file_size, info.compress_type)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(weights)
    return path


def _add_member(archive, like: zipfile.ZipInfo, data, size: int, compress_type: int) -> None:
    """Copy the stream ``data`` (``size`` bytes) into ``archive`` under the name, time and mode of ``like``."""
    info = zipfile.ZipInfo(like.filename, date_time=like.date_time)
    info.compress_type, info.external_attr, info.comment = compress_type, like.external_attr, like.comment
    info.file_size = size  # lets zipfile choose ZIP64 for a member over 4 GB
    with archive.open(info, "w") as out:
        shutil.copyfileobj(data, out, _COPY_BUFFER)


# HDF5 metadata a file holds besides its datasets' bytes (bounds for the room check below): measured with
# h5py 3.14 / HDF5 1.14, a dataset's header takes ~0.5 KB and each group ~1 KB (a key 6 groups deep, all
# new, costs 6.5 KB); an attribute its value's bytes and name plus its header.
_H5_SLACK, _H5_PER_DATASET, _H5_PER_GROUP, _H5_PER_ATTR = 64 << 10, 1 << 10, 2 << 10, 1 << 10


def _attr_bytes(name: str, value) -> int:
    try:
        size = np.asarray(value).nbytes
    except (TypeError, ValueError):  # pragma: no cover - h5py refuses it anyway
        size = 0
    if isinstance(value, (str, bytes)):
        size = len(value.encode() if isinstance(value, str) else value)
    elif isinstance(value, (list, tuple)):
        size = sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in value)
    return size + len(name) + _H5_PER_ATTR


def _room(path: str) -> tuple[int | None, str]:
    """Bytes a file at ``path`` may grow to (the smaller of the file-size limit and the free space), and why."""
    import resource

    limits = []
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, f"File too large (the file-size limit, ulimit -f, is {soft} bytes)"))
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        limits.append((st.f_bavail * st.f_frsize, "No space left on device"))
    except OSError:
        pass
    return min(limits) if limits else (None, "")


class _H5Sink:
    """The file HDF5 writes a new ``.weights.h5`` through (h5py's ``fileobj`` driver), which never fails a write.

    h5py crashes the process (SIGSEGV) once HDF5 has seen a write fail (ENOSPC when another program fills
    the disk, EFBIG past ``ulimit -f``): its ids cannot be released afterwards. So the first failure (an
    ``OSError``, or a Ctrl-C / SIGTERM raised in here) is kept in ``error`` and every later write skipped
    while HDF5 is told each one succeeded; ``_write_h5`` stops at the next dataset, h5py closes the file
    cleanly, and the kept error is raised then, to become the WriteFailedError of the commit path.
    Reads past what is on disk are zeros, as HDF5's own POSIX driver reads them.
    """

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self.pos = self.size = 0
        self.error: BaseException | None = None

    def _keep(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = offset + (self.size if whence == os.SEEK_END else self.pos if whence == os.SEEK_CUR else 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        count = len(data)
        try:
            if self.error is None:
                view, done = memoryview(data), 0
                while done < count:
                    wrote = os.pwrite(self.fd, view[done:], self.pos + done)
                    if wrote <= 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    done += wrote
        except BaseException as e:  # noqa: BLE001 - kept, raised once h5py has closed the file
            self._keep(e)
        self.pos += count
        self.size = max(self.size, self.pos)
        return count

    def read(self, count: int = -1) -> bytes:
        count = self.size - self.pos if count < 0 else count
        data = b""
        try:
            data = os.pread(self.fd, count, self.pos)
        except BaseException as e:  # noqa: BLE001
            self._keep(e)
        self.pos += count
        return data + bytes(count - len(data))

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else size
        try:
            if self.error is None:
                os.ftruncate(self.fd, size)
        except BaseException as e:  # noqa: BLE001
            self._keep(e)
        self.size = size
        return size

    def put(self, offset: int, array: np.ndarray) -> None:
        """Write ``array``'s bytes at ``offset`` straight from its buffer (a dataset's data: no HDF5, no copy)."""
        self.pos, pos = offset, self.pos
        self.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        self.pos = pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        os.close(self.fd)


_RAW_MIN = 1 << 16  # smaller datasets go through h5py whole: their bytes cost less than the extra calls


def _create_dataset(h5py, f, key: str, array: np.ndarray, sink: _H5Sink):
    """``f.create_dataset(key, data=array)``; a large array of a plain little-endian number type is laid out by HDF5
    (contiguous, allocated at once, no fill) and its bytes written by ``sink`` from the array itself: h5py's
    ``fileobj`` driver would copy them once more on the way."""
    if array.nbytes < _RAW_MIN or array.dtype.kind not in "iuf" or array.dtype.byteorder == ">" \
            or array.dtype.name == "bfloat16":
        return f.create_dataset(key, data=array)
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    ds = f.create_dataset(key, shape=array.shape, dtype=array.dtype, dcpl=dcpl)
    sink.put(ds.id.get_offset(), array)
    return ds


def _write_h5(path: str, tensors: list, attrs: dict | None) -> None:
    from restorekit.keras_files._reader import _h5py

    # A write that cannot fit is refused before it fills the disk: each dataset is checked to fit, with room
    # for the metadata written at close. Space that vanishes after this check (another program filling the
    # disk) is caught by _H5Sink, which keeps HDF5 from ever seeing a failed write.
    room, why = _room(path)
    needed = _H5_SLACK
    groups: set = set()

    def fits(more: int) -> None:
        nonlocal needed
        needed += more
        if room is not None and needed > room:
            raise OSError(errno.EFBIG if why.startswith("File") else errno.ENOSPC, why, path)

    def new_groups(key: str) -> int:
        parts = key.strip("/").split("/")[:-1]
        made = {"/".join(parts[: n + 1]) for n in range(len(parts))} - groups
        groups.update(made)
        return len(made)

    def written() -> None:
        if sink.error is not None:  # stop here; h5py closes the file cleanly, the error is raised after
            raise sink.error

    h5py = _h5py()
    crashpoints.crash_point("h5-room-checked")
    sink = _H5Sink(path)
    try:
        with h5py.File(sink, "w") as f:
            for i, (key, array) in enumerate(tensors):
                array = np.asarray(array() if callable(array) else array)
                fits(array.nbytes + _H5_PER_DATASET + _H5_PER_GROUP * new_groups(key))
                bfloat16 = array.dtype.name == "bfloat16"
                ds = _create_dataset(h5py, f, key, array, sink)
                if bfloat16:
                    ds.attrs["dtype"] = "bfloat16"
                written()
                crashpoints.crash_point(f"tensor-{i}")
            for group, values in (attrs or {}).items():
                fits(_H5_PER_GROUP * new_groups(f"{group}/x") + sum(_attr_bytes(n, v) for n, v in values.items()))
                target = f.require_group(group) if group else f
                for name, value in values.items():
                    target.attrs[name] = value
                written()
        written()  # the metadata h5py wrote at close
    finally:
        sink.close()


# ---------------------------------------------------------------- sharded sets

SHARDED_SUFFIX = ".weights.json"


def keras_size(shape, dtype: str) -> float:
    """The bytes Keras counts a tensor as when it cuts shards: elements times its dtype's bits / 8 (a bool is 1 bit)."""
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if dtype == "bool":
        return count / 8
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    return float(count * itemsize)


def shard_layout(sizes, max_shard_size: float, *, where: str = "the output") -> tuple[list, dict]:
    """``([[key, ...] per shard], {group: shard index its attributes go in})`` for ``(key, size)`` pairs in
    write order, cut as Keras cuts them (see the module docstring).

    Raises:
        InvalidArgumentError: a tensor larger than ``max_shard_size``.
    """
    parts: list = [[]]
    starts: dict = {}
    current = 0.0
    for key, size in sizes:
        if size > max_shard_size:
            raise InvalidArgumentError(
                f"{where}: {key!r} takes {int(size)} bytes, more than max_shard_size ({int(max_shard_size)} bytes); "
                f"Keras keeps each variable whole in one shard: pass a larger max_shard_size"
            )
        group = _parts(key)[0]
        starts.setdefault(group, len(parts) - 1)  # the group is made before its first tensor may open a shard
        current += size
        if current > max_shard_size:
            parts.append([])
            current = size
        parts[-1].append(key)
    return parts, starts


def shard_paths(index, count: int) -> list[str]:
    """The shards of a set at ``index`` in ``count`` parts, named as Keras names them: ``x.weights.json`` ->
    ``x_00000.weights.h5``, ... (Keras' ``Path.stem`` without ``'.weights'``)."""
    index = os.path.abspath(os.fspath(index))
    base = os.path.basename(index)[: -len(".json")].replace(".weights", "")
    return [os.path.join(os.path.dirname(index), f"{base}_{i:05d}.weights.h5") for i in range(count)]


def set_files(index) -> list[str]:
    """The files of an existing sharded set at ``index``: the shards its weight map names (plain names beside
    it), then the index itself; only the index when it cannot be read."""
    index = os.path.abspath(os.fspath(index))
    names: list = []
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        for shards in weight_map.values():
            for name in [shards] if isinstance(shards, str) else shards:
                if isinstance(name, str) and name and os.path.basename(name) == name and name not in (".", ".."):
                    names.append(name)
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    directory = os.path.dirname(index)
    return [os.path.join(directory, n) for n in dict.fromkeys(names)] + [index]


def write_sharded(index, tensors, *, sizes: dict, max_shard_size: float, attrs: dict | None = None,
                  replace: tuple = ()) -> tuple[str, ...]:
    """Write ``(key, array or callable)`` pairs as a Keras 3 sharded set: ``NAME_00000.weights.h5``, ... and
    the index ``index`` (``NAME.weights.json``) that ``model.load_weights`` reads.

    ``sizes``: key -> bytes as Keras counts them (``keras_size``). Every file is staged in a
    hidden directory beside ``index``, then published shards first and the index last.
    ``replace``: the files of a set being replaced; shards that are not in the new set are
    removed once the new index is in place. When a new shard takes the name of a shard the
    old index lists (an in-place save; Keras' loader needs ``NAME_00000.weights.h5``, so the
    names cannot all be new), the old set is first re-published under free shard names
    (hard links, and its index rewritten to name them, in one rename): at every point the
    old set or the new one is whole, and the links go once the new index is in place.

    Returns:
        The index and shard paths written.

    Raises:
        InvalidArgumentError: keys ``model.load_weights`` could not load, an output not named
            ``*.weights.json``, or a tensor over ``max_shard_size`` (nothing written).
    """
    index = os.path.abspath(os.fspath(index))
    if not index.endswith(SHARDED_SUFFIX):
        raise InvalidArgumentError(f"{index!r}: Keras reads a sharded set through an index named '*{SHARDED_SUFFIX}'")
    tensors = dict(tensors)
    check_structure(list(tensors), where=repr(index))
    order = write_order(tensors)
    parts, starts = shard_layout([(k, sizes[k]) for k in order], max_shard_size, where=repr(index))
    directory = os.path.dirname(index)
    shards = shard_paths(index, len(parts))
    weight_map: dict = {}
    with Staging(directory, output=index) as staging:
        for i, (path, part) in enumerate(zip(shards, parts)):
            part_attrs = {g: a for g, a in (attrs or {}).items() if starts.get(_vars_owner(g), 0) == i}
            _write_h5(staging.path(path), [(k, tensors[k]) for k in part], part_attrs)
            for key in part:  # as Keras: a group's first tensor names its shard, a second makes that a list
                group, name = "/" + key.rpartition("/")[0], os.path.basename(path)
                if group not in weight_map:
                    weight_map[group] = name
                else:
                    names = weight_map[group] = weight_map[group] if isinstance(weight_map[group], list) else [
                        weight_map[group]]
                    names.extend([] if name in names else [name])
            crashpoints.crash_point(f"keras-shard-{i}-staged")
        text = json.dumps({"metadata": {"total_size": float(sum(sizes[k] for k in order))}, "weight_map": weight_map},
                          indent=4)
        with open(staging.path(index), "w", encoding="utf-8") as f:  # staged last: Staging renames in this order
            f.write(text)
        old = [os.path.abspath(p) for p in replace]
        remove_after = [p for p in old if p not in shards and p != index]
        named = set_files(index)[:-1] if os.path.exists(index) else []
        aside = _asides(index, shards, named)
        if aside:
            # New shards take names the old index lists: the old set is first re-published under other
            # names (linked, and its index rewritten to name them), so it stays whole until the new index lands.
            staging.set_aside(index, _renamed_index(index, aside), aside)
        # Every file the old index names is out of the new shards' way now: it stays until the new index lands.
        staging.commit(remove_after=remove_after, index_first=False)
    return (index, *shards)


def _asides(index: str, shards: list, old: list) -> dict:
    """``{old shard: free name}`` for the old set's shards that a new shard's name would replace, when the old
    index is in place; each free name is a shard name of the same set (``NAME_0000K.weights.h5``, numbered past
    every shard there), so the sweep and the reader take it as one."""
    if not os.path.exists(index):
        return {}
    taken = [p for p in old if p in shards and p != index and os.path.exists(p)]  # old: the shards it names
    if not taken:
        return {}
    directory = os.path.dirname(index)
    stem = os.path.basename(shard_paths(index, 1)[0])[: -len("00000.weights.h5")]
    try:
        listed = os.listdir(directory)
    except OSError:  # an unlistable directory: set_aside refuses a name that is taken
        listed = []
    numbers = [int(n[len(stem):len(stem) + 5]) for n in listed
               if n.startswith(stem) and re.fullmatch(r"\d{5}\.weights\.h5", n[len(stem):])]
    start = max([*numbers, len(shards) - 1, len(old)]) + 1
    return {p: os.path.join(directory, f"{stem}{start + k:05d}.weights.h5") for k, p in enumerate(taken)}


def _renamed_index(index: str, aside: dict) -> str:
    """The old index's text with each shard ``aside`` moves named by its new name."""
    with open(index, encoding="utf-8") as f:
        content = json.load(f)
    names = {os.path.basename(a): os.path.basename(b) for a, b in aside.items()}
    weight_map = content.get("weight_map", {})
    for group, value in weight_map.items():
        weight_map[group] = [names.get(v, v) for v in value] if isinstance(value, list) else names.get(value, value)
    return json.dumps(content, indent=4)


def write_order(keys) -> list[str]:
    """``.../vars/N`` keys in the order a sharded set holds them: groups as first given, each group's
    variables by index (``vars/2`` before ``vars/10``)."""
    keys = list(keys)
    seen: dict = {}
    for key in keys:
        seen.setdefault(_parts(key)[0], len(seen))
    return sorted(keys, key=lambda k: (seen[_parts(k)[0]], _parts(k)[1]))


def _vars_owner(vars_group: str) -> str:
    """``'layers/dense/vars'`` -> ``'layers/dense'`` (``'vars'`` -> ``''``): the layer group whose attributes these are."""
    return vars_group[: -len("/vars")] if vars_group.endswith("/vars") else ""
