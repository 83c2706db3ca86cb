"""CheckpointEditor: rename, change, add, delete and cast checkpoint tensors, then save safely and streaming.

Built on our own bundle writer (``bundle/writer.py``) because TF's writer cannot copy
stored bytes verbatim or reuse shards, which is what keeps edits of many-GB
checkpoints fast and memory-bounded.
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import google_crc32c
import numpy as np

from restorekit.bundle import atomic, files, statefile
from restorekit.bundle.objectgraph import rewrite_keys
from restorekit.bundle.format import (
    decode_tensor,
    dtype_enum,
    dtype_name,
    encode_slice_key,
    numpy_dtype,
)
from restorekit.bundle.protos import decode_entry, decode_header
from restorekit.bundle.table import mask_crc, read_table
from restorekit.bundle.writer import CHUNK_SIZE, BundleWriter, array_chunks
from restorekit.checkpoint import OBJECT_GRAPH_KEY, Checkpoint, Entry, RestoreKitWarning, resolve_prefix
from restorekit.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    EditError,
    InsufficientSpaceError,
    InvalidArgumentError,
    MissingDependencyError,
    NameCollisionError,
    NoMatchError,
    OutputError,
    OutputExistsError,
    format_names,
)
from restorekit.names import apply_renames, closest_names, matches, optimizer_slot_kind
from restorekit.report import format_shape

__all__ = ["CheckpointEditor"]

STRING = 7
_FLOATS = {1, 2, 14, 19}  # float32, float64, bfloat16, float16
_COMPLEX = {8, 18}  # complex64, complex128
_EXPORTERS = {
    "torch": "restorekit.export.torch",
    "safetensors": "restorekit.export.safetensors",
    "npz": "restorekit.export.npz",
}
_ATTRIBUTES = "/.ATTRIBUTES/"
_INDEX_SLACK = 1 << 20  # room for the index and filesystem rounding in the free-space check


@dataclass(frozen=True)
class _Item:
    """One tensor of the output. Frozen: an edit makes a new item, so ``concat`` snapshots stay valid."""

    origin: str | None  # source checkpoint name this tensor started from (None: added)
    dtype: int
    shape: tuple
    base: object = None  # None: the origin's stored bytes; ndarray: a given value; callable: computed
    ops: tuple = ()  # array -> array functions applied to the base, in order
    cast: int | None = None  # a cast of the origin's bytes, streamed on save

    @property
    def stored(self) -> bool:
        """True when the output bytes are the origin's bytes, unchanged."""
        return self.base is None and not self.ops and self.cast is None


@dataclass(frozen=True)
class _Concat:
    """The base of a ``concat`` result: its input items (snapshots) and the axis."""

    items: tuple
    axis: int


class CheckpointEditor:
    """Edit a TensorFlow checkpoint and save the result, streaming and atomically.

        ed = CheckpointEditor('ckpt/model.ckpt-1000')
        ed.rename_all([(r'^bert/', 'encoder/')])
        ed.set('cls/bias', np.zeros(2, np.float32))
        ed.strip_optimizer_slots()
        ed.save('out/model.ckpt')

    Nothing is read until needed: edits are checked against the index at once (a bad
    argument raises at that call and queues nothing) and applied when saving.
    ``get`` and ``list`` show the checkpoint as it would be saved.

    Saving streams one tensor at a time: unchanged tensors are never decoded. Without
    ``compact=True`` the source data shards are reused (hard-linked, or copied across
    filesystems) and only the index plus one extra shard with the changed tensors is
    written; ``compact=True`` writes one new shard with only the kept tensors' bytes.
    Files are written under temporary names in the target directory and renamed into
    place, the ``.index`` last; a crash leaves no output or a complete one.

    Partitioned (sliced) variables keep their slices when renamed or copied; an edit of
    their values (``set``, ``cast``, ...) stores them as one full tensor, which TF's
    readers slice on restore.

    TF2 object-based checkpoints: ``set``, ``add`` and ``cast`` leave the object graph
    (``_CHECKPOINTABLE_OBJECT_GRAPH``) as it is. ``delete`` keeps it consistent (the
    deleted tensor's attribute is removed from the graph). ``rename`` keeps it
    consistent while new names keep their ``/.ATTRIBUTES/...`` part: the graph's
    ``checkpoint_key`` is updated, so ``tf.train.Checkpoint.restore`` still restores each
    value *to the object it came from* (a rename does not move a value to another
    object; ``get`` it and ``set`` it on the other key for that). A rename that drops
    ``/.ATTRIBUTES/`` converts the output to a name-based checkpoint: the graph entry is
    left out and a ``RestoreKitWarning`` says so. The graph is rewritten by restorekit's
    own codec (``restorekit.bundle.objectgraph``), without TensorFlow.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``path``.
    """

    def __init__(self, path):
        self.prefix = resolve_prefix(path)
        self._checkpoint: Checkpoint | None = None
        self._items: dict[str, _Item] | None = None

    def __repr__(self) -> str:
        return f"CheckpointEditor({self.prefix!r})"

    # ------------------------------------------------------------------ state
    @property
    def checkpoint(self) -> Checkpoint:
        """The source checkpoint (its index is read on first use)."""
        if self._checkpoint is None:
            self._checkpoint = Checkpoint(self.prefix)
        return self._checkpoint

    @property
    def _plan(self) -> dict[str, _Item]:
        if self._items is None:
            ckpt = self.checkpoint
            self._items = {}
            for name in ckpt:
                entry = ckpt.bundle_entry(name)
                self._items[name] = _Item(origin=name, dtype=entry.dtype, shape=tuple(entry.shape))
        return self._items

    def _key(self, name):
        """``name``, or in a TF2 checkpoint the key its readable path ``name`` is stored under.

        Keras 3 keys often name no layer (``optimizer/_trainable_variables/0/.ATTRIBUTES/
        VARIABLE_VALUE``); ``set('fc1/kernel', ...)`` means the entry ``Checkpoint.
        object_paths`` gives for that path, as long as it has not been renamed.
        """
        if isinstance(name, str) and name not in self._plan:
            try:
                key = self.checkpoint.object_paths.get(name)
            except CorruptCheckpointError:  # an unreadable object graph: raw keys only
                return name
            if key is not None and key in self._plan:
                return key
        return name

    def _item(self, name: str) -> _Item:
        plan = self._plan
        if not isinstance(name, str) or name not in plan:
            near = closest_names(str(name), plan)
            hint = f" Closest: {format_names(near)}." if near else ""
            raise NoMatchError(f"{self.prefix!r} (as edited) has no entry {name!r}.{hint}", near)
        return plan[name]

    def _check_new_name(self, name, *, allow=()) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"a checkpoint name is a non-empty str, got {name!r}")
        if name in self._plan and name not in allow:
            raise NameCollisionError(f"{name!r} already exists in {self.prefix!r} (as edited); delete it first")

    def _select(self, pattern, *, what: str) -> list[str]:
        """Exact names first; otherwise the ``names.matches`` pattern rule. Never empty."""
        patterns = [pattern] if isinstance(pattern, str) or hasattr(pattern, "pattern") else list(pattern)
        found: list[str] = []
        for p in patterns:
            if isinstance(p, str) and p in self._plan:
                hits = [p]
            else:
                hits = [n for n in self._plan if matches(p, n)]
                key = self._key(p) if not hits and isinstance(p, str) else None
                if key in self._plan:
                    hits = [key]  # a TF2 readable path, when no key matches it as a pattern
            if not hits:
                text = getattr(p, "pattern", p)
                near = closest_names(str(text), self._plan)
                hint = f" Closest: {format_names(near)}." if near else ""
                raise NoMatchError(f"{what} {text!r} matches no entry of {self.prefix!r}.{hint}", near)
            found += [h for h in hits if h not in found]
        return found

    # ------------------------------------------------------------------ reading
    def list(self, pattern=None) -> list[Entry]:
        """Entries (name, shape, dtype, nbytes) as they would be saved, in entry order.

        Args:
            pattern: keep names containing this substring or matching it as a regex
                (``names.matches`` rule); None keeps all.
        """
        out = []
        for name, item in self._plan.items():
            if pattern is not None and not (isinstance(pattern, str) and pattern in name):
                try:
                    if not matches(pattern, name):
                        continue
                except InvalidArgumentError:
                    continue
            out.append(Entry(name, tuple(item.shape), dtype_name(item.dtype), self._nbytes(item)))
        return out

    def _nbytes(self, item: _Item) -> int:
        if item.stored:
            return self.checkpoint[item.origin].nbytes
        if item.dtype == STRING:
            return self.checkpoint[item.origin].nbytes if item.origin and item.base is None else 0
        return math.prod(item.shape) * numpy_dtype(item.dtype).itemsize

    def get(self, name: str) -> np.ndarray:
        """The value of ``name`` as it would be saved (a new array; crc checked).

        Raises:
            NoMatchError: no such entry.
            CorruptCheckpointError: the source bytes are truncated or fail their crc32c.
        """
        name = self._key(name)
        item = self._item(name)
        value = self._value(item)
        # A value given to set/add is returned as a copy, so editing it changes nothing queued.
        return value.copy() if isinstance(item.base, np.ndarray) else value

    def _load(self, name: str) -> np.ndarray:
        """A source tensor, read straight into its array (one copy in memory), crc checked."""
        ckpt = self.checkpoint
        entry = ckpt.bundle_entry(name)
        if ckpt.is_partitioned(name) or entry.dtype == STRING or files.is_remote(ckpt.prefix):
            return ckpt.read(name)
        array = np.empty(entry.shape, numpy_dtype(entry.dtype))
        flat = array.reshape(-1).view(np.uint8)
        if flat.size != entry.size:
            raise CorruptCheckpointError(
                f"{name!r}: the index says {entry.size} bytes for a {dtype_name(entry.dtype)} tensor of shape "
                f"{format_shape(entry.shape)} ({flat.size} expected)"
            )
        pos = 0
        for chunk in self._checked_chunks(name):
            flat[pos : pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
            pos += len(chunk)
        return array

    def _raw_chunks(self, entry, name: str) -> Iterator[bytes]:
        """A stored tensor's bytes in chunks; string tensors are checked by decoding."""
        ckpt = self.checkpoint
        if entry.dtype == STRING:
            raw = ckpt.read_raw(entry, name)
            decode_tensor(raw, STRING, entry.shape, name=name, crc32c=entry.crc32c)
            yield raw
            return
        path = ckpt.data_file(entry.shard_id)
        if files.is_remote(path):
            yield ckpt.read_raw(entry, name)
            return
        try:
            f = open(path, "rb")
        except OSError:
            raise CorruptCheckpointError(f"data shard {path!r} for {name!r} is missing or unreadable") from None
        with f:
            f.seek(entry.offset)
            remaining = entry.size
            while remaining:
                chunk = f.read(min(CHUNK_SIZE, remaining))
                if not chunk:
                    raise CorruptCheckpointError(
                        f"data shard {path!r} is truncated: {name!r} needs bytes "
                        f"{entry.offset}..{entry.offset + entry.size}"
                    )
                remaining -= len(chunk)
                yield chunk

    def _value(self, item: _Item) -> np.ndarray:
        if item.base is None:
            value = self._load(item.origin)
            if item.cast is not None:
                value = value.astype(numpy_dtype(item.cast))
        elif isinstance(item.base, np.ndarray):
            value = item.base.copy() if item.ops else item.base
        elif isinstance(item.base, _Concat):
            value = np.concatenate([self._value(it) for it in item.base.items], axis=item.base.axis)
        else:
            value = item.base()
        for op in item.ops:
            value = op(value)
        return value

    def _checked_chunks(self, name: str) -> Iterator[bytes]:
        """A stored numeric tensor's bytes in chunks; raises at the end if the crc32c fails."""
        entry = self.checkpoint.bundle_entry(name)
        crc = 0
        for chunk in self._raw_chunks(entry, name):
            crc = google_crc32c.extend(crc, chunk)
            yield chunk
        if mask_crc(crc) != entry.crc32c:
            raise ChecksumMismatchError(f"{name!r}: tensor bytes fail their crc32c check; the data shard is corrupt")

    def _cast_chunks(self, item: _Item) -> Iterator[bytes]:
        """The bytes of a pure cast, converted chunk by chunk (memory: one chunk)."""
        source, target = numpy_dtype(self.checkpoint.bundle_entry(item.origin).dtype), numpy_dtype(item.cast)
        pending = b""
        overflow = 0
        for chunk in self._checked_chunks(item.origin):
            chunk = pending + chunk
            usable = len(chunk) - len(chunk) % source.itemsize
            pending = chunk[usable:]
            values, lost = _cast_counting(np.frombuffer(chunk[:usable], source), target)
            overflow += lost
            yield values.tobytes()
        _warn_overflow(item.origin, overflow, target)
        if pending:
            raise CorruptCheckpointError(f"{item.origin!r}: stored size is not a whole number of {source} values")

    def _concat_chunks(self, concat: _Concat) -> Iterator[bytes]:
        """The bytes of a ``concat`` result without building it.

        Along axis 0 the result is its inputs' bytes one after another: stored inputs
        are copied chunk by chunk (crc checked), others decoded one at a time, so the
        peak is the largest input. Along another axis each output block interleaves
        rows of every input; the inputs are held (together the result's size), and
        the result is produced a chunk of rows at a time, never whole.
        """
        if concat.axis == 0:
            for it in concat.items:
                if it.stored and not self.checkpoint.is_partitioned(it.origin):
                    yield from self._checked_chunks(it.origin)
                else:
                    yield from array_chunks(self._value(it))
            return
        values = [self._value(it) for it in concat.items]
        outer = math.prod(values[0].shape[: concat.axis])
        rows = [v.reshape(outer, -1) for v in values]
        row_bytes = sum(r.shape[1] for r in rows) * values[0].itemsize
        step = max(1, CHUNK_SIZE // max(row_bytes, 1))
        for start in range(0, outer, step):
            block = np.concatenate([r[start : start + step] for r in rows], axis=1)
            yield from array_chunks(block)

    # ------------------------------------------------------------------ values in
    def _coerce(self, name: str, value, dtype: int, *, allow_dtype_change: bool) -> np.ndarray:
        """``value`` as an array of ``dtype`` (or its own dtype when allowed to change). Copies."""
        if dtype == STRING and not allow_dtype_change:
            return _string_array(name, value)
        given = np.asarray(value)
        if given.dtype.kind in "SUO":
            if dtype != STRING and not allow_dtype_change:
                raise EditError(f"{name!r} is {dtype_name(dtype)}; got strings. Pass allow_dtype_change=True to store strings.")
            return _string_array(name, value)
        try:
            given_code = dtype_enum(given.dtype)
        except ValueError:
            raise EditError(f"{name!r}: dtype {given.dtype} has no TensorFlow checkpoint equivalent") from None
        if allow_dtype_change or given_code == dtype:
            return np.array(given, copy=True)
        target = numpy_dtype(dtype)
        if isinstance(value, (np.ndarray, np.generic)):
            raise EditError(
                f"{name!r} is {dtype_name(dtype)}; got a {dtype_name(given_code)} array. Pass "
                f"value.astype({dtype_name(dtype)!r}), or allow_dtype_change=True to store {dtype_name(given_code)}."
            )
        # Python numbers and lists take the entry's dtype unless that loses their kind.
        lossy = (target.kind in "iub" and given.dtype.kind in "fc") or (target.kind != "c" and given.dtype.kind == "c")
        if lossy or (target.kind == "b" and given.dtype.kind != "b"):
            raise EditError(f"{name!r} is {dtype_name(dtype)}; {value!r} does not convert without loss")
        return given.astype(target)

    @staticmethod
    def _region(name: str, shape: tuple, index) -> tuple:
        """Shape of ``tensor[index]``, checked without allocating the tensor."""
        if isinstance(index, list):
            index = np.asarray(index)
        dummy = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), shape=shape, strides=(0,) * len(shape))
        try:
            return dummy[index].shape
        except (IndexError, TypeError, ValueError) as e:
            raise EditError(f"index {index!r} does not fit {name!r} of shape {format_shape(shape)}: {e}") from None

    # ------------------------------------------------------------------ edits
    def rename(self, old: str, new: str) -> None:
        """Rename one entry (partitioned slices follow).

        Raises:
            NoMatchError: ``old`` does not exist.
            NameCollisionError: ``new`` already exists.
        """
        old = self._key(old)
        self._item(old)
        if new == old:
            return
        self._check_new_name(new)
        self._items = {(new if k == old else k): v for k, v in self._plan.items()}

    def rename_all(self, rule) -> dict[str, str]:
        """Rename every entry by ``rule``: a callable, a mapping, or a list of ``(regex, replacement)``.

        Returns:
            {old: new} for the names that changed.

        Raises:
            NameCollisionError: two names land on one (checked before anything changes).
            NoMatchError: the rule changes nothing, a mapping key is not an entry, or a
                regex of the list matches no name.
        """
        names = list(self._plan)
        if isinstance(rule, dict):
            missing = [k for k in rule if k not in self._plan]
            if missing:
                near = closest_names(str(missing[0]), names)
                raise NoMatchError(f"rename mapping names {format_names(missing)}, not entries of {self.prefix!r}", near)
        elif isinstance(rule, (list, tuple)):
            import re

            current = names
            for item in rule:
                if isinstance(item, (tuple, list)) and len(item) == 2:
                    try:
                        pattern = re.compile(item[0]) if isinstance(item[0], str) else item[0]
                    except re.error as e:
                        raise InvalidArgumentError(f"rename pattern {item[0]!r} is not a valid regex: {e}") from None
                    if not any(pattern.search(n) for n in current):
                        raise NoMatchError(f"rename pattern {pattern.pattern!r} matches no entry of {self.prefix!r}")
                    current = [pattern.sub(item[1], n) for n in current]
        mapping = apply_renames(names, rule)
        changed = {old: new for old, new in mapping.items() if old != new}
        if not changed:
            raise NoMatchError(f"the rename rule changes no name of {self.prefix!r}")
        self._items = {mapping[k]: v for k, v in self._plan.items()}
        return changed

    def set(self, name: str, value, *, index=None, allow_dtype_change: bool = False,
            allow_shape_change: bool = False) -> None:
        """Replace a tensor's value, whole or at ``index`` (``set(name, rows, index=[3, 7])``).

        Args:
            name: an existing entry.
            value: the new value (copied now). Whole: same shape and dtype as the entry.
                With ``index``: broadcastable to ``tensor[index]``. Python numbers and
                lists take the entry's dtype.
            index: anything numpy accepts as an index: an int, a list of rows, slices.
            allow_dtype_change / allow_shape_change: store a whole value as given.

        Raises:
            NoMatchError: unknown name.
            EditError: wrong shape, dtype or index.
        """
        name = self._key(name)
        item = self._item(name)
        if index is None:
            array = self._coerce(name, value, item.dtype, allow_dtype_change=allow_dtype_change)
            if array.shape != tuple(item.shape) and not allow_shape_change:
                raise EditError(
                    f"{name!r} has shape {format_shape(item.shape)}; got {format_shape(array.shape)}. "
                    "Pass allow_shape_change=True to store the new shape."
                )
            self._plan[name] = _Item(item.origin, dtype_enum(array.dtype), array.shape, base=array)
            return
        if allow_dtype_change or allow_shape_change:
            raise EditError(f"{name!r}: a set with index= keeps the entry's shape and dtype")
        region = self._region(name, item.shape, index)
        array = self._coerce(name, value, item.dtype, allow_dtype_change=False)
        try:
            np.broadcast_shapes(array.shape, region)
            if np.broadcast_shapes(array.shape, region) != region:
                raise ValueError
        except ValueError:
            raise EditError(
                f"{name!r}[{index!r}] has shape {format_shape(region)}; got a value of shape {format_shape(array.shape)}"
            ) from None
        if isinstance(index, list):
            index = np.asarray(index)

        def assign(a, index=index, array=array):
            a[index] = array
            return a

        self._plan[name] = self._with_op(item, assign)

    def _with_op(self, item: _Item, op: Callable) -> _Item:
        if isinstance(item.base, np.ndarray):
            return replace(item, base=op(item.base.copy()))
        return replace(item, ops=item.ops + (op,))

    def copy_rows(self, name: str, src_rows, dst_rows) -> None:
        """Copy rows (first axis) of ``name`` onto other rows: ``t[dst_rows] = t[src_rows]``.

        Raises:
            EditError: lengths differ, a row is out of range, or the tensor is a scalar.
        """
        name = self._key(name)
        item = self._item(name)
        if not item.shape:
            raise EditError(f"{name!r} is a scalar; it has no rows")
        src = np.asarray(src_rows).reshape(-1)
        dst = np.asarray(dst_rows).reshape(-1)
        if src.size != dst.size:
            raise EditError(f"copy_rows({name!r}): {src.size} source rows but {dst.size} destination rows")
        n = item.shape[0]
        for rows in (src, dst):
            if rows.dtype.kind not in "iu" or (rows.size and (rows.min() < -n or rows.max() >= n)):
                raise EditError(f"copy_rows({name!r}): rows {rows.tolist()} are not integers in range for {n} rows")

        def copy(a, src=src, dst=dst):
            a[dst] = a[src]
            return a

        self._plan[name] = self._with_op(item, copy)

    def add(self, name: str, value) -> None:
        """Add a new tensor (numpy incl. bfloat16, bool, complex, or strings).

        Raises:
            NameCollisionError: ``name`` exists.
            EditError: a value with no checkpoint dtype.
        """
        self._check_new_name(name)
        array = np.asarray(value)
        if array.dtype.kind in "SUO":
            array = _string_array(name, value)
        else:
            try:
                dtype_enum(array.dtype)
            except ValueError:
                raise EditError(f"{name!r}: dtype {array.dtype} has no TensorFlow checkpoint equivalent") from None
            array = np.array(array, copy=True)
        self._plan[name] = _Item(None, dtype_enum(array.dtype), array.shape, base=array)

    def delete(self, pattern) -> list[str]:
        """Delete an entry by exact name, or every entry a pattern (``names.matches`` rule) takes.

        An exact name deletes only itself (``'dense/kernel'`` keeps ``'dense/kernel/Momentum'``).

        Returns:
            The deleted names.

        Raises:
            NoMatchError: nothing matches.
        """
        names = self._select(pattern, what="delete pattern")
        self._items = {k: v for k, v in self._plan.items() if k not in names}
        return names

    def concat(self, names, axis: int, new_name: str) -> None:
        """Add ``new_name`` holding the given entries concatenated along ``axis`` (inputs are kept).

        Raises:
            NoMatchError: an unknown name.
            EditError: dtypes or shapes that do not concatenate.
            NameCollisionError: ``new_name`` exists.
        """
        if isinstance(names, str) or not names:
            raise EditError(f"concat takes a non-empty list of names, got {names!r}")
        names = [self._key(n) for n in names]
        items = [self._item(n) for n in names]
        self._check_new_name(new_name)
        dtypes = {it.dtype for it in items}
        if len(dtypes) > 1:
            raise EditError(f"concat of {format_names(names)}: mixed dtypes {sorted(dtype_name(d) for d in dtypes)}")
        ranks = {len(it.shape) for it in items}
        rank = ranks.pop()
        if ranks or rank == 0:
            raise EditError(f"concat of {format_names(names)}: ranks differ or are 0")
        if not -rank <= axis < rank:
            raise EditError(f"concat axis {axis} is out of range for rank {rank}")
        axis %= rank
        others = {tuple(d for i, d in enumerate(it.shape) if i != axis) for it in items}
        if len(others) > 1:
            shapes = ", ".join(format_shape(it.shape) for it in items)
            raise EditError(f"concat of {format_names(names)} along axis {axis}: shapes {shapes} do not fit")
        shape = list(items[0].shape)
        shape[axis] = sum(it.shape[axis] for it in items)

        self._plan[new_name] = _Item(None, items[0].dtype, tuple(shape), base=_Concat(tuple(items), axis))

    def cast(self, pattern, dtype) -> list[str]:
        """Cast entries to ``dtype`` (e.g. float32 to ``'bfloat16'`` or ``'float16'``).

        An exact name is cast whatever its numeric dtype; a pattern casts only the
        floating-point entries it matches (so ``'.*'`` leaves ``global_step`` alone).
        Pure casts are streamed on save, one chunk at a time.

        Returns:
            The names cast.

        Raises:
            EditError: an unknown dtype, or an exact name that is a string or bool.
            NoMatchError: nothing to cast.
        """
        try:
            code = dtype_enum(dtype)
            target = numpy_dtype(code)
        except (ValueError, CorruptCheckpointError):
            raise EditError(f"cannot cast to {dtype!r}: not a checkpoint dtype") from None
        if code == STRING:
            raise EditError("cannot cast to strings")
        exact = isinstance(pattern, str) and pattern in self._plan
        names = self._select(pattern, what="cast pattern")
        if exact:
            if self._plan[pattern].dtype in (STRING, 10):
                raise EditError(f"cannot cast {pattern!r} ({dtype_name(self._plan[pattern].dtype)}) to {dtype_name(code)}")
        else:
            names = [n for n in names if self._plan[n].dtype in _FLOATS]
        names = [n for n in names if self._plan[n].dtype != code]
        if not names:
            raise NoMatchError(f"cast pattern {pattern!r} matches no entry that is not already {dtype_name(code)}")
        for n in names:
            source = self._plan[n].dtype
            if (source in _COMPLEX and code not in _COMPLEX) or (source in _FLOATS and code not in _FLOATS | _COMPLEX):
                raise EditError(
                    f"casting {n!r} from {dtype_name(source)} to {dtype_name(code)} would truncate its values; "
                    f"if that is meant, set() it to value.astype({dtype_name(code)!r}) with allow_dtype_change=True"
                )
        ckpt = self.checkpoint
        for n in names:
            item = self._plan[n]
            if item.stored and not ckpt.is_partitioned(item.origin):
                self._plan[n] = replace(item, cast=code, dtype=code)
            else:
                self._plan[n] = replace(self._with_op(item, lambda a, t=target, n=n: _cast(a, t, n)), dtype=code)
        return names

    def strip_optimizer_slots(self) -> list[str]:
        """Delete optimizer slots and state (Adam m/v, Momentum, beta powers, TF2 optimizer objects).

        Returns:
            The deleted names (empty when there were none).
        """
        ckpt = self.checkpoint
        # In a TF2 checkpoint a key's spelling says nothing: Keras 3 saves the model's
        # own weights under 'optimizer/_trainable_variables/N/...' when the optimizer
        # tracked them first. The object graph says what each key really is.
        tracked = ckpt.object_graph.by_key if ckpt.is_object_based else {}

        def is_optimizer_state(name: str, item: _Item) -> bool:
            if name == OBJECT_GRAPH_KEY:
                return False
            if item.origin in tracked:
                return tracked[item.origin].kind == "optimizer"
            return optimizer_slot_kind(name) is not None

        names = [n for n, item in self._plan.items() if is_optimizer_state(n, item)]
        self._items = {k: v for k, v in self._plan.items() if k not in names}
        return names

    # ------------------------------------------------------------------ saving
    def save(self, out, *, format: str = "tf", compact: bool = False, overwrite: bool = False,
             update_state_file: bool = False, progress: bool = False) -> str:
        """Write the edited checkpoint to ``out`` (created if needed), atomically.

        Args:
            out: a checkpoint prefix (``'out/model.ckpt'``), an existing directory (the
                source's file name is used there), or a file for other formats. A
                ``gs://`` (any ``tf.io.gfile``) path is written locally under ``$TMPDIR``
                first, then uploaded file by file, the ``.index`` last; it must not exist.
            format: ``'tf'``, ``'torch'``, ``'safetensors'`` or ``'npz'``.
            compact: write one new shard holding only the kept tensors (``'tf'``).
            overwrite: replace an existing output (never the source: use save_in_place).
            update_state_file: point the directory's ``checkpoint`` file at ``out``.
            progress: show a byte counter on stderr while writing (when it is a terminal).

        Returns:
            The output prefix (or file).

        Raises:
            OutputExistsError: ``out`` is the source, or exists and ``overwrite`` is False.
            InsufficientSpaceError: the disk cannot hold the output; nothing is written.
            CorruptCheckpointError: a source tensor fails its checks; nothing is written.
        """
        if format not in ("tf", *_EXPORTERS):
            raise InvalidArgumentError(f"format must be 'tf', 'torch', 'safetensors' or 'npz', got {format!r}")
        out = os.fspath(out)
        if files.is_remote(out):
            return self._save_remote(out, format=format, compact=compact, overwrite=overwrite,
                                     update_state_file=update_state_file, progress=progress)
        if format != "tf":
            return self._export(os.path.abspath(out), format, overwrite=overwrite)
        prefix = out[: -len(".index")] if out.endswith(".index") else out
        if os.path.isdir(prefix):
            prefix = os.path.join(prefix, os.path.basename(self.prefix))
        prefix = os.path.abspath(prefix)
        if not files.is_remote(self.prefix) and os.path.realpath(prefix) == os.path.realpath(self.prefix):
            raise OutputExistsError(
                f"{out!r} is the source checkpoint; call save_in_place() to replace it (the old one is kept "
                "until the new one is complete)"
            )
        existing = os.path.exists(prefix + ".index")
        if existing and not overwrite:
            raise OutputExistsError(f"{prefix!r} already holds a checkpoint; pass overwrite=True to replace it")
        return self._save_tf(prefix, compact=compact, in_place=False, replacing=existing,
                             update_state_file=update_state_file, progress=progress)

    def _save_remote(self, out: str, *, format: str, compact: bool, overwrite: bool,
                     update_state_file: bool, progress: bool) -> str:
        """Save to ``gs://`` and the like: write locally (under ``$TMPDIR``), then upload.

        Each file is uploaded under a hidden name and renamed; the data shards go first
        and the ``.index`` last, so the checkpoint exists for readers only once it is
        complete. An existing remote checkpoint is not replaced: that would briefly mix
        old and new files, which no object store can rename as one.
        """
        import tempfile

        target = out[: -len(".index")] if format == "tf" and out.endswith(".index") else out.rstrip("/")
        # (ram:// calls any prefix of a file a directory, so a checkpoint's own prefix is not one)
        if format == "tf" and files.isdir(target) and not files.exists(target + ".index"):
            target = files.join(target, os.path.basename(self.prefix))
        if format == "tf" and target == self.prefix:
            raise OutputExistsError(f"{out!r} is the source checkpoint; save under a new name")
        if files.exists(target + ".index" if format == "tf" else target):
            if overwrite:
                raise OutputError(
                    f"{target!r} exists on a remote filesystem, where replacing it cannot be atomic; "
                    "delete it first or save under a new name"
                )
            raise OutputExistsError(f"{target!r} exists; pass overwrite=True to replace it")
        base = files.basename(target)
        directory = files.dirname(target)
        with tempfile.TemporaryDirectory(prefix="restorekit-upload-") as local_dir:
            local = os.path.join(local_dir, base)
            if format == "tf":
                self._save_tf(local, compact=compact, in_place=False, replacing=False,
                              update_state_file=False, progress=progress)
                shards = sorted(n for n in os.listdir(local_dir) if n.startswith(base + ".data-"))
                names = shards + [base + ".index"]
            else:
                self._export(local, format, overwrite=False)
                names = [base]
            uploaded = []
            try:
                for name in names:
                    # data shards without their index are orphans of an earlier failed save
                    files.publish(os.path.join(local_dir, name), files.join(directory, name),
                                  overwrite=name != names[-1])
                    uploaded.append(name)
            except BaseException:
                for name in uploaded:
                    files.remove(files.join(directory, name))
                raise
        if update_state_file and format == "tf":
            _update_state_file(target)
        return target

    def save_in_place(self, *, compact: bool = False, update_state_file: bool = False,
                      progress: bool = False) -> str:
        """Replace the source checkpoint with the edited one; the old one stays until the new one is complete."""
        if files.is_remote(self.prefix):
            raise OutputError(
                f"{self.prefix!r}: a remote checkpoint cannot be replaced atomically (its files are separate "
                "objects); save() it under a new name instead"
            )
        prefix = self._save_tf(os.path.abspath(self.prefix), compact=compact, in_place=True, replacing=True,
                               update_state_file=update_state_file, progress=progress)
        self._checkpoint = None
        self._items = None
        return prefix

    def _final_plan(self) -> dict[str, _Item]:
        """The plan, with the TF2 object graph rewritten when keys were renamed or deleted."""
        plan = dict(self._plan)
        ckpt = self.checkpoint
        graph = plan.get(OBJECT_GRAPH_KEY)
        if OBJECT_GRAPH_KEY not in ckpt or graph is None or not graph.stored or graph.origin != OBJECT_GRAPH_KEY:
            return plan
        key_map = {it.origin: name for name, it in plan.items() if it.origin is not None}
        if all(key_map.get(k) == k for k in ckpt):
            return plan
        lost = [f"{old!r} -> {new!r}" for old, new in key_map.items()
                if old != new and _ATTRIBUTES in old and _ATTRIBUTES not in new]
        if lost:
            # TF finds a value's object from the "<path>/.ATTRIBUTES/" part of its key;
            # a key without it cannot stay in the graph.
            del plan[OBJECT_GRAPH_KEY]
            warnings.warn(
                f"restorekit: {self.prefix!r} is an object-based (TF2) checkpoint and the renames "
                f"{', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''} drop the '/.ATTRIBUTES/' part TF needs; "
                f"saving it as a name-based checkpoint (without {OBJECT_GRAPH_KEY!r}). Keep '/.ATTRIBUTES/...' "
                "in new names to keep tf.train.Checkpoint restores working.",
                RestoreKitWarning,
                stacklevel=4,
            )
            return plan
        source_keys = set(ckpt)

        def rebuild():
            raw = bytes(self._load(OBJECT_GRAPH_KEY).reshape(-1)[0])
            dropped = {key for key in source_keys if key not in key_map}
            return np.array(rewrite_keys(raw, key_map, dropped), dtype=object)

        plan[OBJECT_GRAPH_KEY] = _Item(OBJECT_GRAPH_KEY, STRING, (), base=rebuild)
        return plan

    def _check_space(self, directory: str, needed: int) -> None:
        probe = directory
        while not os.path.exists(probe):
            probe = os.path.dirname(probe) or "."
        free = shutil.disk_usage(probe).free
        if needed + _INDEX_SLACK > free:
            raise InsufficientSpaceError(
                f"saving to {directory!r} needs about {(needed + _INDEX_SLACK) / 1e6:.1f} MB but only "
                f"{free / 1e6:.1f} MB are free; nothing was written"
            )

    @staticmethod
    def _same_device(a: str, b: str) -> bool:
        while not os.path.exists(b):
            b = os.path.dirname(b) or "."
        try:
            return os.stat(a).st_dev == os.stat(b).st_dev
        except OSError:
            return False

    def _save_tf(self, prefix: str, *, compact: bool, in_place: bool, replacing: bool,
                 update_state_file: bool, progress: bool = False) -> str:
        ckpt = self.checkpoint
        plan = self._final_plan()
        directory = os.path.dirname(prefix)
        n_src = ckpt.header.num_shards
        compact = compact or files.is_remote(ckpt.prefix)  # a remote shard cannot be linked
        old_shards = 0
        if replacing:
            try:
                old_shards = decode_header(read_table(files.read_bytes(prefix + ".index"))[0][1]).num_shards
            except (CorruptCheckpointError, OSError, IndexError):
                old_shards = 0
        changed = any(not it.stored for it in plan.values())
        if compact:
            # One fresh shard; in place, its file name must differ from every live one.
            num_shards, new_shard, reuse = (2 if old_shards == 1 else 1), 0, False
        elif changed:
            num_shards, new_shard, reuse = n_src + 1, n_src, True
        else:
            num_shards, new_shard, reuse = n_src, None, True
        link_shards = reuse and not (in_place and num_shards == n_src)

        written = sum(self._nbytes(it) for it in plan.values() if not (reuse and it.stored))
        if link_shards and not self._same_device(ckpt.data_file(0), directory):
            written += sum(os.path.getsize(ckpt.data_file(i)) for i in range(n_src) if os.path.exists(ckpt.data_file(i)))
        self._check_space(directory, written)

        remove_before: list[str] = []
        remove_after: list[str] = []
        if replacing and not in_place:
            remove_before = [prefix + ".index"] + files.glob(directory, os.path.basename(prefix) + ".data-*")
        elif in_place and num_shards != n_src:
            remove_after = [ckpt.data_file(i) for i in range(n_src)]

        with atomic.Staging(directory) as staging:
            writer = BundleWriter(prefix, num_shards=num_shards, shard_id=new_shard, staging=staging)
            try:
                shard_paths = {}
                if link_shards:
                    for i in range(n_src):
                        shard_paths[i] = staging.path(f"{prefix}.data-{i:05d}-of-{num_shards:05d}")
                        atomic.link_or_copy(ckpt.data_file(i), shard_paths[i])
                elif reuse:
                    shard_paths = {i: ckpt.data_file(i) for i in range(n_src)}
                if new_shard is not None:
                    shard_paths[new_shard] = staging.path(writer.data_path(new_shard))
                expected = self._write(writer, plan, reuse=reuse, progress=progress)
                writer.finish(commit=False)
                if num_shards == 2 and not reuse:
                    extra = staging.path(f"{prefix}.data-00001-of-00002")
                    open(extra, "wb").close()
                    shard_paths[1] = extra
                atomic.crash_point("before-verify")
                self._verify(staging.path(prefix + ".index"), shard_paths, expected)
                atomic.crash_point("before-commit")
            except BaseException:
                writer.abort()
                raise
            staging.commit(remove_before=remove_before, remove_after=remove_after)
        if update_state_file:
            _update_state_file(prefix)
        return prefix

    def _write(self, writer: BundleWriter, plan: dict[str, _Item], *, reuse: bool,
               progress: bool = False) -> set[bytes]:
        """Stream every tensor of ``plan`` into ``writer``; return the index keys written."""
        from restorekit.export import progress_bar

        keys = set()
        with progress_bar(sum(self._nbytes(item) for item in plan.values()), progress, "save") as bar:
            for name, item in plan.items():
                keys |= self._write_one(writer, name, item, reuse=reuse)
                bar.update(self._nbytes(item))
        return keys

    def _nbytes(self, item: _Item) -> int:
        if item.origin is not None and item.stored:
            return self.checkpoint.entries[item.origin].nbytes
        itemsize = 1 if item.dtype == STRING else numpy_dtype(item.dtype).itemsize
        return math.prod(item.shape) * itemsize

    def _write_one(self, writer: BundleWriter, name: str, item: _Item, *, reuse: bool) -> set[bytes]:
        """Write one tensor (or the slices of a partitioned one); return the index keys written."""
        ckpt = self.checkpoint
        keys = set()
        if item.stored and ckpt.is_partitioned(item.origin):
            for extents, part in ckpt._slices[item.origin]:
                key = encode_slice_key(name, extents)
                if reuse:
                    writer.add_entry_only(key, part)
                else:
                    self._copy(writer, key, part, item.origin)
                keys.add(key)
            writer.add_entry_only(name, ckpt.bundle_entry(item.origin))
        elif item.stored:
            entry = ckpt.bundle_entry(item.origin)
            if reuse:
                writer.add_entry_only(name, entry)
            else:
                self._copy(writer, name, entry, item.origin)
        elif item.base is None and not item.ops and item.cast is not None:
            writer.add_stream(name, item.cast, item.shape, self._cast_chunks(item))
        elif isinstance(item.base, _Concat) and not item.ops and item.cast is None and item.dtype != STRING:
            writer.add_stream(name, item.dtype, item.shape, self._concat_chunks(item.base))
        else:
            writer.add(name, self._value(item))
        keys.add(name.encode("utf-8"))
        return keys

    def _copy(self, writer: BundleWriter, key, entry, origin: str) -> None:
        """Copy an unchanged tensor's bytes (crc checked, never decoded)."""
        path = self.checkpoint.data_file(entry.shard_id)
        if files.is_remote(path):
            writer.add_raw(key, entry, self._raw_chunks(entry, origin))
        else:
            writer.add_copy(key, entry, path)

    @staticmethod
    def _verify(index_path: str, shard_paths: dict[int, str], expected: set[bytes]) -> None:
        """Re-read the staged index: the expected keys, each entry inside an existing shard."""
        records = read_table(files.read_bytes(index_path))
        header = decode_header(records[0][1])
        keys = {k for k, _ in records[1:]}
        if keys != expected:
            raise OutputError(f"verification of {index_path!r} failed: the index holds other keys than written")
        sizes = {i: os.path.getsize(p) for i, p in shard_paths.items() if os.path.exists(p)}
        for key, value in records[1:]:
            entry = decode_entry(value)
            if entry.slices and not entry.size:
                continue
            if entry.shard_id >= header.num_shards or entry.offset + entry.size > sizes.get(entry.shard_id, -1):
                raise OutputError(
                    f"verification of {index_path!r} failed: {key[:80]!r} points past its shard {entry.shard_id}"
                )

    def _export(self, out: str, format: str, *, overwrite: bool) -> str:
        try:
            module = importlib.import_module(_EXPORTERS[format])
        except ImportError as e:
            raise MissingDependencyError(f"format={format!r} needs {_EXPORTERS[format]!r}: {e}") from None
        if os.path.exists(out) and not overwrite:
            raise OutputExistsError(f"{out!r} exists; pass overwrite=True to replace it")
        plan = self._plan
        directory = os.path.dirname(out)
        self._check_space(directory, sum(self._nbytes(it) for it in plan.values()))
        tensors = ((name, self._value(it)) for name, it in plan.items() if name != OBJECT_GRAPH_KEY)
        # Only renames, deletions and subsets: the exporter copies raw shard bytes itself.
        raw = OBJECT_GRAPH_KEY not in plan and all(it.stored for it in plan.values())
        with atomic.Staging(directory) as staging:
            tmp = staging.path(out)
            if raw and hasattr(module, "write_checkpoint"):
                module.write_checkpoint(self.checkpoint, tmp, names={name: it.origin for name, it in plan.items()})
            elif format == "npz":
                module.write(tmp, tensors)
            else:
                module.write(tmp, tensors, layout=None)
            if not os.path.exists(tmp):
                raise OutputError(f"the {format} exporter wrote nothing at {tmp!r}")
            staging.commit()
        return out


def _update_state_file(prefix: str) -> None:
    """Point ``dir/checkpoint`` at ``prefix`` (written to a temporary file, then renamed)."""
    statefile.write(prefix)


def _cast_counting(array: np.ndarray, target: np.dtype) -> tuple[np.ndarray, int]:
    """``array.astype(target)`` and how many finite values it turned into inf or nan."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = array.astype(target)
    if out.dtype.kind in "iub":
        return out, 0
    return out, int(np.count_nonzero(np.isfinite(array) & ~np.isfinite(out)))


def _warn_overflow(name: str, count: int, target: np.dtype) -> None:
    if count:
        warnings.warn(
            f"{name!r}: {count} finite values are out of {np.dtype(target).name}'s range and became inf or nan",
            RestoreKitWarning,
            stacklevel=3,
        )


def _cast(array: np.ndarray, target: np.dtype, name: str) -> np.ndarray:
    out, lost = _cast_counting(np.asarray(array), target)
    _warn_overflow(name, lost, target)
    return out


def _string_array(name: str, value) -> np.ndarray:
    """``value`` as an object array of bytes/str (a string tensor), or EditError."""
    array = np.array(value, dtype=object)
    odd = next((v for v in array.reshape(-1) if not isinstance(v, (bytes, str))), None)
    if odd is not None:
        raise EditError(f"{name!r}: a string tensor holds bytes or str values, not {type(odd).__name__}")
    return array
