"""Checkpoint: resolve a path to a checkpoint prefix, list its entries, read tensors.

Only the ``.index`` is read when a Checkpoint is made; data shards are opened when a
tensor is read. TensorFlow is never imported for local paths.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Iterator, Mapping

import numpy as np

from restorekit import keras_files
from restorekit.bundle import files, statefile
from restorekit.bundle.objectgraph import OBJECT_GRAPH_KEY, decode_object_graph
from restorekit.bundle.format import decode_slice_key, decode_tensor, dtype_name, numpy_dtype
from restorekit.bundle.protos import BundleEntry, BundleHeader, decode_entry, decode_header
from restorekit.bundle.table import read_table
from restorekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NoMatchError,
    RestoreKitWarning,
    closest_names,
    format_names,
)

__all__ = ["Checkpoint", "Entry", "OBJECT_GRAPH_KEY", "resolve_prefix"]

_DATA_SUFFIX = re.compile(r"\.data-\d{5}-of-\d{5}$")
_WARNED: set = set()


@dataclass(frozen=True)
class Entry:
    """One tensor in a checkpoint. ``nbytes`` is its size in the data shards."""

    name: str
    shape: tuple
    dtype: str
    nbytes: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


def _state_file_prefix(directory: str) -> str | None:
    state = statefile.read(directory)
    return None if state is None else statefile.resolve(directory, state.model_checkpoint_path)


def _newest_index(directory: str) -> str | None:
    indexes = files.glob(directory, "*.index")
    if not indexes:
        return None
    return max(indexes, key=lambda p: (files.mtime(p), p))[: -len(".index")]


def resolve_prefix(path) -> str:
    """Turn any accepted path into a checkpoint prefix whose ``.index`` exists.

    Accepts a prefix, a directory (its ``checkpoint`` state file, else the newest
    ``*.index``), a ``.index`` or ``.data-*`` file, a SavedModel directory, or any
    ``tf.io.gfile`` path.

    Raises:
        CheckpointNotFoundError: nothing at ``path`` is a checkpoint.
    """
    path = str(path)
    if path.endswith(".index"):
        path = path[: -len(".index")]
    path = _DATA_SUFFIX.sub("", path)
    if files.exists(path + ".index"):
        return path
    if files.isdir(path):
        saved_model = files.join(path, "variables", "variables")
        if files.exists(saved_model + ".index"):
            return saved_model
        named = _state_file_prefix(path)
        if named is not None and files.exists(named + ".index"):
            return named
        fallback = None
        if named is not None:
            # Checkpoints copied from another machine name an absolute path there;
            # the same file name here is almost always what was meant.
            local = files.join(path, re.split(r"[/\\]", named)[-1])
            if files.exists(local + ".index"):
                fallback = local
        fallback = fallback or _newest_index(path)
        if fallback is None:
            raise CheckpointNotFoundError(
                f"directory {path!r} holds no checkpoint (no 'checkpoint' state file naming an existing "
                f"prefix and no *.index file). Pass the prefix of a checkpoint, such as 'dir/model.ckpt-1000'.",
                path,
            )
        if named is not None:
            reason = f"the 'checkpoint' state file in {path!r} names {named!r}, which does not exist"
        elif files.exists(files.join(path, "checkpoint")):
            reason = f"the 'checkpoint' state file in {path!r} names no checkpoint (it does not parse)"
        else:
            reason = f"{path!r} has no 'checkpoint' state file"
        if (path, fallback) not in _WARNED:  # once per directory and choice, however often it is opened
            _WARNED.add((path, fallback))
            warnings.warn(f"{reason}; using {fallback!r}", RestoreKitWarning, stacklevel=3)
        return fallback
    hint = ""
    parent = path.rsplit("/", 1)[0] if "/" in path else "."
    if files.isdir(parent):
        candidates = [p[: -len(".index")] for p in files.glob(parent, "*.index")]
        near = closest_names(path, candidates)
        if near:
            hint = f" Checkpoints nearby: {format_names(near)}."
    raise CheckpointNotFoundError(f"no checkpoint at {path!r} (looked for {path + '.index'!r}).{hint}", path)


class Checkpoint(Mapping):
    """A read-only view of a TensorFlow (V2) checkpoint.

    Reads the ``.index`` once, on construction; tensor bytes are read on ``read``.

        ckpt = restorekit.Checkpoint('train_dir')      # or a prefix, .index, SavedModel
        ckpt.entries['conv1/weights'].shape            # (7, 7, 3, 64)
        w = ckpt.read('conv1/weights')                 # numpy array, crc checked

    Raises:
        CheckpointNotFoundError: no checkpoint at the path.
        CorruptCheckpointError: the index is truncated or malformed.
    """

    def __new__(cls, path=None):
        # Keras files (.weights.h5, .keras, legacy .h5) have their own reader, with the same verbs.
        if cls is Checkpoint and keras_files.is_keras_path(path):
            return keras_files.KerasCheckpoint(path)
        return super().__new__(cls)

    def __init__(self, path):
        self.prefix = resolve_prefix(path)
        index_path = self.prefix + ".index"
        data = files.read_bytes(index_path)
        try:
            self._load_index(data)
        except CorruptCheckpointError as e:
            raise type(e)(f"{index_path!r} is not a readable checkpoint index: {e}") from None

    def _load_index(self, data: bytes) -> None:
        records = read_table(data)
        if not records or records[0][0] != b"":
            raise CorruptCheckpointError("index has no header record")
        self.header: BundleHeader = decode_header(records[0][1])
        if self.header.endianness != 0:
            raise CorruptCheckpointError("big-endian checkpoints are not supported")
        if not 1 <= self.header.num_shards <= 1_000_000:
            raise CorruptCheckpointError(f"impossible shard count {self.header.num_shards}")
        bundle: dict[str, BundleEntry] = {}
        slices: dict[str, list[tuple[tuple, BundleEntry]]] = {}
        for key, value in records[1:]:
            entry = decode_entry(value)
            if key[:1] == b"\x00":
                full_name, extents = decode_slice_key(key)
                slices.setdefault(full_name, []).append((extents, entry))
                continue
            try:
                name = key.decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptCheckpointError(f"entry name {key[:60]!r} is not UTF-8") from None
            if not entry.slices and entry.shard_id >= self.header.num_shards:
                raise CorruptCheckpointError(
                    f"entry {name!r} lives in shard {entry.shard_id} of {self.header.num_shards}"
                )
            bundle[name] = entry
        for name, parts in slices.items():
            if name not in bundle:
                raise CorruptCheckpointError(f"slices of {name!r} without a full entry")
        self._bundle = bundle
        self._slices = slices
        entries = {}
        for name, entry in bundle.items():
            nbytes = sum(e.size for _, e in slices[name]) if name in slices else entry.size
            entries[name] = Entry(name, tuple(entry.shape), dtype_name(entry.dtype), nbytes)
        self._entries = MappingProxyType(dict(sorted(entries.items())))

    # -- mapping protocol: name -> Entry
    @property
    def entries(self) -> Mapping[str, Entry]:
        """Sorted mapping checkpoint name -> Entry (partitioned variables under their full name)."""
        return self._entries

    def __getitem__(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise self._unknown(name) from None

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Checkpoint({self.prefix!r}, {len(self)} entries)"

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    # -- object-based (TF2) checkpoints
    @property
    def is_object_based(self) -> bool:
        """True for a ``tf.train.Checkpoint`` / Keras checkpoint (it has an object graph)."""
        return OBJECT_GRAPH_KEY in self._entries

    @cached_property
    def object_graph(self):
        """The decoded object graph (``restorekit.tf2.ObjectGraph``), or None for name-based checkpoints.

        Decoded on first use, without TensorFlow.

        Raises:
            CorruptCheckpointError: the ``_CHECKPOINTABLE_OBJECT_GRAPH`` entry is not an object graph.
        """
        if not self.is_object_based:
            return None

        raw = self.read(OBJECT_GRAPH_KEY)
        if getattr(raw, "shape", None) != () or not isinstance(raw.item(), bytes):
            raise CorruptCheckpointError(
                f"{self.prefix!r}: {OBJECT_GRAPH_KEY!r} is not a scalar string tensor (shape {getattr(raw, 'shape', '?')})"
            )
        try:
            return decode_object_graph(raw.item())
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{self.prefix!r}: {e}") from None

    @cached_property
    def object_paths(self) -> Mapping[str, str]:
        """Readable path -> checkpoint key, for object-based checkpoints (empty for name-based).

        Keras checkpoints give each variable its Keras ``variable.path``
        (``dense_1/kernel``); optimizer state reads ``optimizer/...`` (or
        ``<path>/.OPTIMIZER_SLOT/...``) and the save counter ``save_counter``, so
        ``restorekit.names.optimizer_slot_kind`` and ``is_global_step`` recognize them.
        """
        graph = self.object_graph
        if graph is None:
            return MappingProxyType({})
        return MappingProxyType({v.path: v.key for v in graph.variables if v.key in self._entries})

    def readable_name(self, name: str) -> str:
        """The readable path of checkpoint key ``name`` (the key itself when there is none)."""
        graph = self.object_graph if self.is_object_based else None
        if graph is None:
            return name
        tracked = graph.by_key.get(name)
        return tracked.path if tracked is not None else name

    def _unknown(self, name: str) -> NoMatchError:
        near = closest_names(name, self._entries)
        hint = f" Closest: {format_names(near)}." if near else ""
        return NoMatchError(f"checkpoint {self.prefix!r} has no entry {name!r}.{hint}", near)

    # -- low-level access for the editor and the exporters
    def data_file(self, shard_id: int) -> str:
        return f"{self.prefix}.data-{shard_id:05d}-of-{self.header.num_shards:05d}"

    def bundle_entry(self, name: str) -> BundleEntry:
        """The raw index record of a (non-partitioned) entry."""
        if name not in self._bundle:
            raise self._unknown(name)
        return self._bundle[name]

    def is_partitioned(self, name: str) -> bool:
        return name in self._slices

    def read_raw(self, entry: BundleEntry, name: str = "") -> bytes:
        """The exact bytes of one stored tensor, length-checked."""
        path = self.data_file(entry.shard_id)
        if not files.exists(path):
            raise CorruptCheckpointError(f"data shard {path!r} for {name!r} is missing")
        # Check against the file's length first: a corrupt offset or size must not seek
        # or allocate past it (OverflowError, MemoryError).
        length = os.path.getsize(path) if not files.is_remote(path) else None
        if length is not None and entry.offset + entry.size > length:
            raise CorruptCheckpointError(
                f"data shard {path!r} is truncated: {name!r} needs bytes {entry.offset}..{entry.offset + entry.size}"
            )
        raw = files.read_range(path, entry.offset, entry.size)
        if len(raw) != entry.size:
            raise CorruptCheckpointError(
                f"data shard {path!r} is truncated: {name!r} needs bytes {entry.offset}..{entry.offset + entry.size}"
            )
        return raw

    def read(self, name: str) -> np.ndarray:
        """The tensor stored under ``name``, as a numpy array (crc32c verified).

        Raises:
            NoMatchError: no such entry (lists the closest names).
            CorruptCheckpointError: the shard is missing, truncated or fails its checksum.
        """
        entry = self.bundle_entry(name)
        if name not in self._slices:
            return decode_tensor(self.read_raw(entry, name), entry.dtype, entry.shape, name=name, crc32c=entry.crc32c)
        # Slices must lie inside the full shape and tile it; a corrupt index would
        # otherwise allocate an arbitrary amount of memory or write out of bounds.
        full_size = math.prod(entry.shape)
        stored = 0
        indexes = []
        for extents, part in self._slices[name]:
            index, part_shape = _slice_index(name, entry.shape, extents)
            if tuple(part.shape) != part_shape:
                raise CorruptCheckpointError(
                    f"partitioned entry {name!r}: a slice of shape {list(part.shape)} is stored for extents {extents}"
                )
            stored += math.prod(part_shape)
            indexes.append((index, part))
        if stored != full_size:
            raise CorruptCheckpointError(
                f"partitioned entry {name!r}: its slices hold {stored} elements but its shape "
                f"{list(entry.shape)} needs {full_size}"
            )
        full = np.zeros(entry.shape, dtype=numpy_dtype(entry.dtype))
        for index, part in indexes:
            full[index] = decode_tensor(
                self.read_raw(part, name), entry.dtype, part.shape, name=name, crc32c=part.crc32c
            )
        return full


# isinstance(Checkpoint(path), Checkpoint) holds for Keras files too.
Checkpoint.register(keras_files.KerasCheckpoint)


def _slice_index(name: str, shape: tuple, extents: tuple) -> tuple[tuple, tuple]:
    """numpy index and shape of one slice; (start, -1) means the whole dimension."""
    if len(extents) != len(shape):
        raise CorruptCheckpointError(f"partitioned entry {name!r}: a slice has {len(extents)} extents for rank {len(shape)}")
    index, part_shape = [], []
    for dim, (start, length) in zip(shape, extents):
        if length < 0:
            start, length = 0, dim
        if start < 0 or start + length > dim:
            raise CorruptCheckpointError(
                f"partitioned entry {name!r}: slice [{start}, {start + length}) lies outside dimension {dim}"
            )
        index.append(slice(start, start + length))
        part_shape.append(length)
    return tuple(index), tuple(part_shape)
