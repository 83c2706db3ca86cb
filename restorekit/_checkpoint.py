"""Checkpoint: resolve a path to a checkpoint prefix, list its entries, read tensors.

Only the ``.index`` is read when a Checkpoint is made; data shards are opened when a
tensor is read. TensorFlow is never imported for local paths.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from functools import cached_property
from types import MappingProxyType
from typing import Mapping

import numpy as np

from restorekit import keras_files
from restorekit._bundle import files, statefile
from restorekit import _registry as registry
from restorekit._registry import Entry
from restorekit._bundle.checks import check_header, check_shape, check_size, slice_layout
from restorekit._bundle.objectgraph import OBJECT_GRAPH_KEY, decode_object_graph
from restorekit._bundle.format import (
    DT_STRING,
    DT_VARIANT,
    DTYPE_NAMES,
    check_crc,
    check_tensor_bytes,
    decode_slice_key,
    decode_tensor,
    dtype_name,
    empty_tensor,
    numpy_dtype,
)
from restorekit._bundle.protos import BundleEntry, BundleHeader, decode_entry, decode_header
from restorekit._bundle.table import mask_crc, read_table
from restorekit._bundle.verification import Problem, VerifyResult
from restorekit._bundle.writer import copy_checked
from restorekit.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    EntryNotFoundError,
    InvalidArgumentError,
    RestoreKitWarning,
    UnknownFormatError,
    closest_names,
    format_names,
)

__all__ = ["Checkpoint", "Entry", "OBJECT_GRAPH_KEY", "Problem", "VerifyResult", "resolve_prefix"]

_DATA_SUFFIX = re.compile(r"\.data-\d{5}-of-\d{5}$")
_WARNED: set = set()


def _state_file_prefix(directory: str) -> str | None:
    state = statefile.read(directory)
    return None if state is None else statefile.resolve(directory, state.model_checkpoint_path)


def _newest_index(directory: str) -> str | None:
    indexes = files.glob(directory, "*.index")
    if not indexes:
        return None
    return max(indexes, key=lambda p: (files.mtime(p), p))[: -len(".index")]


def _warn_once(path: str, choice: str, message: str) -> None:
    if (path, choice) not in _WARNED:  # once per directory and choice, however often it is opened
        _WARNED.add((path, choice))
        warnings.warn(message, RestoreKitWarning, stacklevel=4)


def state_file_points_outside(directory) -> str | None:
    """The prefix ``directory``'s state file names when that prefix lies outside ``directory``, else None.

    TF's Saver writes absolute paths, so a copied checkpoint directory still names the
    original; reading through it reads the original, and editing through it in place
    would edit the original.
    """
    directory = str(directory)
    if files.is_remote(directory) or not files.isdir(directory):
        return None
    named = _state_file_prefix(directory)
    if named is None or files.is_remote(named):
        return None
    inside = os.path.realpath(directory)
    where = os.path.realpath(os.path.dirname(named))
    return named if os.path.commonpath([inside, where]) != inside else None


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
        if not files.is_remote(path) and files.isdir(path) and not path.endswith("/"):
            _warn_once(path, path, f"{path!r} is both a checkpoint prefix and a directory; using the prefix "
                                   f"(write {path + '/'!r} for the directory)")
        return path
    if files.isdir(path):
        saved_model = files.join(path, "variables", "variables")
        if files.exists(saved_model + ".index"):
            return saved_model
        named = _state_file_prefix(path)
        if named is not None and files.exists(named + ".index"):
            if state_file_points_outside(path) is not None:
                _warn_once(path, named, f"the 'checkpoint' state file in {path!r} names {named!r}, outside that "
                                        f"directory (a copied checkpoint directory?); using {named!r} as TF does. "
                                        "Pass the exact prefix to read another")
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
        _warn_once(path, fallback, f"{reason}; using {fallback!r}")
        return fallback
    _refuse_unknown_file(path)
    hint = ""
    parent = path.rsplit("/", 1)[0] if "/" in path else "."
    if files.isdir(parent):
        candidates = [p[: -len(".index")] for p in files.glob(parent, "*.index")]
        near = closest_names(path, candidates)
        if near:
            hint = f" Checkpoints nearby: {format_names(near)}."
    raise CheckpointNotFoundError(f"no checkpoint at {path!r} (looked for {path + '.index'!r}).{hint}", path)


def _refuse_unknown_file(path: str) -> None:
    """A file that is there, in no format the registry claims: an error saying what it is, never "not found"."""
    if not files.is_remote(path) and os.path.isfile(path):
        raise UnknownFormatError(path, looks_like=registry.described(registry.Probe.of(path)),
                                 formats=tuple(registry.formats()))


class Checkpoint(registry.EntryMapping):
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
        # Every other format (Keras files, safetensors, .pt, .npz) has its own reader with the same verbs:
        # the registry decides by the file's bytes which one reads ``path``.
        if cls is Checkpoint and isinstance(path, (str, os.PathLike)):
            fmt = registry.detect(path)
            if fmt != "tf":
                return registry.open_source(path, fmt)
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
        check_header(self.header)
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
                name = f"{full_name} {list(extents)}"
                slices.setdefault(full_name, []).append((extents, entry))
            else:
                try:
                    name = key.decode("utf-8")
                except UnicodeDecodeError:
                    raise CorruptCheckpointError(f"entry name {key[:60]!r} is not UTF-8") from None
                bundle[name] = entry
            check_shape(name, entry)
            if (not entry.slices or key[:1] == b"\x00") and entry.shard_id >= self.header.num_shards:
                raise CorruptCheckpointError(f"entry {name!r} lives in shard {entry.shard_id} of {self.header.num_shards}")
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

    # -- mapping protocol (registry.EntryMapping): name -> Entry
    @property
    def entries(self) -> Mapping[str, Entry]:
        """Sorted mapping checkpoint name -> Entry (partitioned variables under their full name)."""
        return self._entries

    def __repr__(self) -> str:
        return f"Checkpoint({self.prefix!r}, {len(self)} entries)"

    # -- object-based (TF2) checkpoints
    @property
    def is_object_based(self) -> bool:
        """True for a ``tf.train.Checkpoint`` / Keras checkpoint (it has an object graph)."""
        return OBJECT_GRAPH_KEY in self._entries

    @cached_property
    def object_graph(self):
        """The decoded object graph (``restorekit._tf2.ObjectGraph``), or None for name-based checkpoints.

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
        ``restorekit._names.optimizer_slot_kind`` and ``is_global_step`` recognize them.
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

    def key(self, name: str) -> str:
        """The checkpoint key of ``name``: a key itself, or the key saved under a TF2 readable path.

        Raises:
            NoMatchError: neither a key nor a readable path (lists the closest of both).
        """
        if name in self._entries:
            return name
        key = self._paths().get(name)
        if key is None:
            raise self._unknown(name)
        return key

    def _paths(self) -> Mapping[str, str]:
        """``object_paths``, empty when the object graph cannot be decoded (the raw keys still read)."""
        try:
            return self.object_paths
        except CorruptCheckpointError:
            return {}

    def _unknown(self, name: str) -> EntryNotFoundError:
        # readable paths are candidates too: 'head/kernel' is far from its raw TF2 key
        return EntryNotFoundError(
            f"checkpoint {self.prefix!r} has no entry {name!r}.", name=name,
            candidates=list(self._entries) + list(self._paths()),
        )

    def check_shards(self) -> None:
        """Check that every data shard exists and is long enough for what the index places in it.

        Costs one ``stat`` per shard, no reads: a truncated or missing shard is named
        here instead of surfacing as TensorFlow's ``OutOfRangeError`` from a restore.

        Raises:
            CorruptCheckpointError: a shard is missing, not a regular file, or shorter
                than the index says.
        """
        needed: dict[int, int] = {}
        pieces = list(self._bundle.values()) + [p for parts in self._slices.values() for _, p in parts]
        for entry in pieces:
            if entry.size:
                needed[entry.shard_id] = max(needed.get(entry.shard_id, 0), entry.offset + entry.size)
        for shard_id, end in sorted(needed.items()):
            path = self.data_file(shard_id)
            try:
                length = files.size(path)
            except OSError:
                raise CorruptCheckpointError(f"data shard {path!r} of {self.prefix!r} is missing") from None
            if length < end:
                raise CorruptCheckpointError(
                    f"data shard {path!r} is truncated: {length} bytes, but the index places tensors up to byte "
                    f"{end}; the checkpoint was cut short (an interrupted copy or save?)"
                )

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

    def stored_range(self, name: str) -> tuple[str, int, int] | None:
        """``(data shard, offset, size)`` of the bytes of ``name`` (a key or readable path) as stored, or None for a
        partitioned entry (its bytes lie in several slices): what a writer may copy as it is (crc32c in the index).

        Raises:
            EntryNotFoundError: no such entry.
        """
        key = name if name in self._bundle else self.key(name)
        if key in self._slices:
            return None
        entry = self.bundle_entry(key)
        return self.data_file(entry.shard_id), entry.offset, entry.size

    def _shard_for(self, entry: BundleEntry, name: str) -> str:
        """The data shard holding ``entry``, checked to be a regular file long enough for it.

        Checked before anything is read or allocated: a corrupt offset or size must not
        seek or allocate past the file (OverflowError, MemoryError), and a FIFO or device
        in a shard's place must not block or read without end.
        """
        path = self.data_file(entry.shard_id)
        try:
            length = files.size(path)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"data shard for {name!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - OSError locally, tf.errors.OpError on remote paths
            if files.exists(path):
                raise CorruptCheckpointError(f"data shard {path!r} for {name!r} is unreadable: {e}") from None
            raise CorruptCheckpointError(f"data shard {path!r} for {name!r} is missing") from None
        if entry.offset + entry.size > length:
            raise CorruptCheckpointError(
                f"data shard {path!r} is truncated: {name!r} needs bytes {entry.offset}..{entry.offset + entry.size} "
                f"of its {length}"
            )
        return path

    def read_raw(self, entry: BundleEntry, name: str = "") -> bytes:
        """The exact bytes of one stored tensor, length-checked.

        Raises:
            CorruptCheckpointError: the shard is missing, not a regular file, or too short.
        """
        path = self._shard_for(entry, name)
        raw = files.read_range(path, entry.offset, entry.size)
        if len(raw) != entry.size:
            raise CorruptCheckpointError(
                f"data shard {path!r} is truncated: {name!r} needs bytes {entry.offset}..{entry.offset + entry.size}"
            )
        return raw

    def read(self, name: str) -> np.ndarray:
        """The tensor stored under ``name`` (a key, or a TF2 readable path), as a numpy array (crc32c verified).

        Raises:
            NoMatchError: no such entry (lists the closest names and readable paths).
            CorruptCheckpointError: the shard is missing, truncated or fails its checksum.
        """
        if name not in self._bundle and name != OBJECT_GRAPH_KEY:
            name = self.key(name)
        entry = self.bundle_entry(name)
        if name not in self._slices:
            check_size(name, entry)
            if entry.dtype in (DT_STRING, DT_VARIANT):
                return decode_tensor(self.read_raw(entry, name), entry.dtype, entry.shape, name=name, crc32c=entry.crc32c)
            path = self._shard_for(entry, name)  # before allocating: the shard holds entry.size bytes
            out = empty_tensor(entry.dtype, entry.shape, entry.size, name=name)
            self._fill(path, entry, out, name)
            return out
        # Check the slices against TF's rules before allocating the full tensor: a
        # corrupt index would otherwise allocate an arbitrary amount of memory, write
        # out of bounds, or leave zeros where a slice is missing.
        layout = slice_layout(name, entry, self._slices[name])
        for _, part in layout:
            check_size(name, part)
            try:
                self._shard_for(part, name)
            except CorruptCheckpointError as e:
                need = sum(p.size for _, p in layout)
                raise CorruptCheckpointError(
                    f"partitioned entry {name!r} of shape {list(entry.shape)} claims {need} bytes in its slices, "
                    f"more than its shards hold: {e}"
                ) from None
        if entry.dtype == DT_STRING:
            full = np.zeros(entry.shape, dtype=numpy_dtype(entry.dtype))
        else:  # the slices cover it exactly once (slice_layout): fresh memory, aligned as an unpartitioned read's
            full = empty_tensor(entry.dtype, entry.shape, sum(p.size for _, p in layout), name=name)
        for index, part in layout:
            full[index] = decode_tensor(
                self.read_raw(part, name), entry.dtype, part.shape, name=name, crc32c=part.crc32c
            )
        return full

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Read the tensor ``name`` straight into ``out``, crc32c checked: no array of its own, no copy.

        ``out`` is a writable C-contiguous numpy array of the entry's dtype and shape,
        memory the caller already holds (a torch parameter's ``numpy()`` view, a reused
        buffer). A partitioned or string entry is read as ``read`` reads it and copied in.

        Raises:
            InvalidArgumentError: ``out`` is not such an array.
            NoMatchError: no such entry.
            CorruptCheckpointError: as ``read``; ``out`` then holds whatever was read (``check`` first
                to know the bytes are good before writing into memory that matters).
        """
        if name not in self._bundle:
            name = self.key(name)
        entry = self.bundle_entry(name)
        dtype = numpy_dtype(entry.dtype) if entry.dtype in DTYPE_NAMES and entry.dtype != DT_VARIANT else None
        if not (isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == tuple(entry.shape)
                and out.flags.c_contiguous and out.flags.writeable):
            got = type(out).__name__
            if isinstance(out, np.ndarray):
                how = "" if out.flags.c_contiguous else "non-contiguous "
                how = how if out.flags.writeable else "read-only " + how
                got = f"a {how}{out.dtype} {list(out.shape)} array"
            raise InvalidArgumentError(
                f"read_into {name!r} needs a writable C-contiguous {dtype_name(entry.dtype)} array of shape "
                f"{list(entry.shape)}, got {got}"
            )
        if name in self._slices or entry.dtype == DT_STRING:
            np.copyto(out, self.read(name))
            return
        check_size(name, entry)
        self._fill(self._shard_for(entry, name), entry, out, name)

    def _fill(self, path: str, entry: BundleEntry, out: np.ndarray, name: str) -> None:
        # As bytes: a buffer of float16 or bfloat16 is not one memoryview can hold.
        if files.read_into(path, entry.offset, out.reshape(-1).view(np.uint8)) != entry.size:
            raise CorruptCheckpointError(
                f"data shard {path!r} is truncated: {name!r} needs bytes {entry.offset}..{entry.offset + entry.size}"
            )
        check_crc(out, entry.crc32c, name=name)

    def check(self, name: str) -> None:
        """Check the stored bytes of ``name`` as ``read`` would (size, slices, shards, crc32c), keeping nothing.

        The bytes are read in 1 MiB chunks into one reused buffer, so checking costs no memory
        of the tensor's size: a restore checks every tensor this way before it copies any.

        Raises:
            NoMatchError: no such entry.
            CorruptCheckpointError: what ``read`` would raise (ChecksumMismatchError for bad bytes).
        """
        if name not in self._bundle:
            name = self.key(name)
        try:
            self._verify_entry(name, self.bundle_entry(name), lambda n: None)
        except CorruptCheckpointError as e:
            raise type(e)(f"{name!r}: {e}") from None

    # -- verification
    def verify(self, *, progress: bool = False) -> VerifyResult:
        """Check every tensor against TF's rules and its bytes against their crc32c.

        Reads each tensor's bytes once, in chunks (memory stays small however big the
        checkpoint), and makes no arrays, so every dtype and rank TF stores is checked.
        Per entry: a dtype TF has, a byte size that fits shape x dtype, slices that
        tile their tensor exactly, shards that exist, are regular files and are long
        enough, and the crc32c. The index itself was checked when the Checkpoint was made.

        Every entry is checked, whatever the earlier ones showed: the result lists all
        problems rather than raising on the first, so one run shows all the damage.

        Args:
            progress: show a tqdm byte counter on stderr (when it is a terminal).

        Returns:
            A ``VerifyResult``: tensors and bytes checked, and the problems found
            (``result.ok`` when there are none).
        """
        from tqdm import tqdm

        total = sum(e.size for e in self._bundle.values()) + sum(p.size for ps in self._slices.values() for _, p in ps)
        problems, checked = [], 0
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr,
                  disable=None if progress else True, leave=False) as bar:
            for name, entry in self._bundle.items():
                try:
                    checked += self._verify_entry(name, entry, bar.update)
                except CorruptCheckpointError as e:
                    kind = "checksum" if isinstance(e, ChecksumMismatchError) else "corrupt"
                    problems.append(Problem(name, kind, str(e)))
        return VerifyResult(self.prefix, len(self._bundle), checked, tuple(problems))

    def _verify_entry(self, name: str, entry: BundleEntry, advance) -> int:
        if entry.dtype not in DTYPE_NAMES:
            raise CorruptCheckpointError(f"unknown TensorFlow dtype code {entry.dtype}")
        parts = self._slices.get(name)
        if parts is None:
            if entry.slices:
                raise CorruptCheckpointError(f"the entry lists {len(entry.slices)} slices; the index holds none")
            pieces = [entry]
        else:
            if len(entry.slices) != len(parts):
                raise CorruptCheckpointError(
                    f"the entry lists {len(entry.slices)} slices; the index holds {len(parts)}"
                )
            pieces = [part for _, part in slice_layout(name, entry, parts)]
        for piece in pieces:
            check_size(name, piece)
            self._shard_for(piece, name)
        for piece in pieces:
            self._check_bytes(name, piece, advance)
        return sum(p.size for p in pieces)

    def _check_bytes(self, name: str, entry: BundleEntry, advance) -> None:
        path = self.data_file(entry.shard_id)
        if entry.dtype in (DT_STRING, DT_VARIANT) or files.is_remote(path):
            check_tensor_bytes(self.read_raw(entry, name), entry.dtype, entry.shape, name=name, crc32c=entry.crc32c)
            advance(entry.size)
            return
        with files.open_regular(path) as f:
            crc = copy_checked(f.fileno(), entry.offset, entry.size, lambda chunk: advance(len(chunk)))
        if crc is None:
            raise CorruptCheckpointError(f"data shard {path!r} is truncated: {name!r} runs past its end")
        if mask_crc(crc) != entry.crc32c:
            raise ChecksumMismatchError(
                f"tensor bytes fail their crc32c check (stored {entry.crc32c:#010x}, computed {mask_crc(crc):#010x}); "
                f"the data shard {path!r} is corrupt"
            )


# isinstance(Checkpoint(path), Checkpoint) holds for Keras files too.
Checkpoint.register(keras_files.KerasCheckpoint)
