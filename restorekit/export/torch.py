"""PyTorch ``state_dict`` files: write with ``torch.save``, read with ``torch.load(weights_only=True)``.

torch is imported only inside these functions. A ``.pt`` file is a pickle, so it is
only ever loaded with ``weights_only=True``: a file that asks to run code is refused
with ``CorruptCheckpointError`` before anything runs. What an export did (names,
axes, dtype stand-ins, string tensors) is recorded in the state_dict's ``_metadata``
attribute under ``'__restorekit__'``, where ``load_state_dict`` never looks at it.
"""

from __future__ import annotations

import collections
import os
import pickle
import re
from typing import Iterable, Iterator

import numpy as np

from restorekit.bundle import files
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, MissingDependencyError
from restorekit.export.base import (
    ExportResult,
    atomic_output,
    check_strings,
    checkpoint_entries,
    contiguous,
    layout_tensors,
    progress_bar,
    refuse,
    tf_dtype_of,
)
from restorekit.export.layout import STORED_AS, LayoutRecord, check_layout
from restorekit.export.rawcopy import copy_raw

__all__ = ["FORMAT", "SUFFIXES", "load", "read", "read_record", "read_shapes", "recognizes", "to_numpy", "write",
           "write_checkpoint"]

FORMAT = "torch"
SUFFIXES = (".pt", ".pth", ".bin")
LAYOUTS = (None, "torch")  # the layout= values write and write_checkpoint accept

RECORD_KEY = "__restorekit__"
# TF dtype name -> torch dtype attribute. ml_dtypes arrays cross by a same-width int view.
_TORCH_DTYPES = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint64": "uint64",
    "uint32": "uint32",
    "uint16": "uint16",
    "uint8": "uint8",
    "bool": "bool",
    "complex64": "complex64",
    "complex128": "complex128",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}
_BITS = {"bfloat16": ("int16", np.int16), "float8_e4m3fn": ("uint8", np.uint8), "float8_e5m2": ("uint8", np.uint8)}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # torch colours some of its messages
_SAFE_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError, KeyError)


def _torch():
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(
            "PyTorch files need torch: pip install restorekit[torch] "
            "(on CPU-only machines install the CPU wheel of torch first)"
        ) from None
    return torch


def from_numpy(array: np.ndarray, tf_dtype: str | None = None):
    """A torch tensor sharing ``array``'s memory where it can (bfloat16/float8 included)."""
    torch = _torch()
    tf_dtype = tf_dtype or tf_dtype_of(array)
    if tf_dtype in _BITS:
        int_name, int_type = _BITS[tf_dtype]
        return torch.from_numpy(contiguous(array).view(int_type)).view(getattr(torch, _TORCH_DTYPES[tf_dtype]))
    if tf_dtype in _TORCH_DTYPES or tf_dtype in STORED_AS:
        if not array.flags.writeable:
            array = array.copy()
        return torch.from_numpy(contiguous(array))
    raise InvalidArgumentError(f"dtype {tf_dtype!r} has no PyTorch equivalent")


def to_numpy(tensor) -> np.ndarray:
    """A CPU tensor -> numpy array; bfloat16 and float8 come back as ml_dtypes arrays."""
    from restorekit.bundle.format import dtype_enum, numpy_dtype

    torch = _torch()
    tensor = tensor.detach().cpu()
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _BITS:
        int_name, _ = _BITS[name]
        return tensor.contiguous().view(getattr(torch, int_name)).numpy().view(numpy_dtype(dtype_enum(name)))
    if name not in _TORCH_DTYPES:
        raise InvalidArgumentError(f"torch dtype {tensor.dtype} has no TensorFlow checkpoint equivalent")
    return tensor.numpy()


def _save(path: str, state: dict, record: LayoutRecord) -> None:
    torch = _torch()
    check_strings(record, "the state_dict metadata")
    state._metadata = {RECORD_KEY: record.to_json()}
    with atomic_output(path) as tmp:
        torch.save(state, tmp)


def write(path, tensors: Iterable, *, layout: str | None = None, metadata: dict | None = None, graph=None,
          progress: bool = False) -> ExportResult:
    """Write ``(name, ndarray)`` pairs as a PyTorch ``state_dict`` file (``torch.save``).

    ``torch.save`` pickles one dict, so every tensor is held in memory until the file
    is written (``write_checkpoint`` maps a checkpoint's shards instead). Tensors share
    memory with the arrays given; the file appears at ``path`` only when complete.

    Args:
        path: the output file (replaced if it exists).
        tensors: an iterable of ``(TF name, ndarray)``; a third item, a TF dtype
            name, keeps dtypes numpy cannot name (``'qint8'``).
        layout: None, or 'torch' for PyTorch names and axes (``restorekit.export.layout``).
        metadata: refused (a state_dict has no place for free-form metadata).
        graph: the object graph of the tensors' checkpoint (``Checkpoint.object_graph``),
            so that layout 'torch' names them from their readable paths.
        progress: show a byte counter on stderr while tensors are gathered.

    Raises:
        MissingDependencyError: torch is not installed.
        NameCollisionError: the layout maps two names onto one (nothing is written).
        InvalidArgumentError: ``metadata`` given.
    """
    check_layout(layout)
    refuse(FORMAT, metadata=metadata)
    _torch()
    record = LayoutRecord(layout, graph=graph)
    state = collections.OrderedDict()
    permuted = []
    nbytes = 0
    with progress_bar(None, progress, "torch") as bar:
        for name, out, array, tf_dtype, was_permuted in layout_tensors(tensors, record):
            if was_permuted:
                permuted.append(name)
            if tf_dtype in STORED_AS:
                record.note_dtype(out, tf_dtype)
            state[out] = from_numpy(array, tf_dtype)
            nbytes += array.nbytes
            bar.update(array.nbytes)
    path = os.fspath(path)
    _save(path, state, record)
    return ExportResult(path, "torch", len(state), nbytes, layout, tuple(permuted), tuple(record.strings), record.kept,
                        unmapped=tuple(record.unmapped))


def write_checkpoint(checkpoint, path, *, names: dict | None = None, layout: str | None = None,
                     metadata: dict | None = None, progress: bool = False) -> ExportResult:
    """Write every tensor of a TF checkpoint as a ``state_dict`` file.

    ``names``: as in ``safetensors.write_checkpoint`` (a renamed subset, in order).

    Tensors that need no permutation are memory-mapped from the data shards (after a
    crc32c check), so ``torch.save`` reads them from the page cache instead of
    holding them all in memory; permuted kernels are materialised.

    Raises:
        MissingDependencyError: torch is not installed.
        NameCollisionError, InvalidArgumentError: before anything is written.
        ChecksumMismatchError, CorruptCheckpointError: a bad shard (no output left).
    """
    check_layout(layout)
    refuse(FORMAT, metadata=metadata)
    _torch()
    record = LayoutRecord.for_checkpoint(checkpoint, layout)
    plan = []
    for name, source in checkpoint_entries(checkpoint, names):
        entry = checkpoint.entries[source]
        if entry.dtype == "string":
            record.add_string(name, checkpoint.read(source))
            continue
        if entry.dtype not in _TORCH_DTYPES and entry.dtype not in STORED_AS:
            raise InvalidArgumentError(f"checkpoint entry {source!r} has dtype {entry.dtype!r}, which torch cannot hold")
        out, perm = record.plan(name, entry.shape)
        if entry.dtype in STORED_AS:
            record.note_dtype(out, entry.dtype)
        plan.append((source, out, perm))
    state = collections.OrderedDict()
    handles: dict = {}
    nbytes = sum(checkpoint.entries[name].nbytes for name, _, _ in plan)
    path = os.fspath(path)
    local = not files.is_remote(checkpoint.prefix)  # remote shards are read whole, not mapped
    try:
        with progress_bar(nbytes, progress, "torch") as bar:
            for name, out, perm in plan:
                entry = checkpoint.entries[name]
                if local and perm is None and not checkpoint.is_partitioned(name) and entry.nbytes:
                    raw = checkpoint.bundle_entry(name)
                    copy_raw(checkpoint, name, raw, _Discard(), handles, bar)  # crc check only
                    array = _map(checkpoint.data_file(raw.shard_id), raw.offset, raw.size, entry)
                else:
                    array = checkpoint.read(name)
                    if perm is not None:
                        array = np.ascontiguousarray(np.transpose(array, perm))
                    bar.update(entry.nbytes)
                state[out] = from_numpy(array, STORED_AS.get(entry.dtype, entry.dtype))
            _save(path, state, record)
    finally:
        for handle in handles.values():
            handle.close()
    permuted = tuple(record.tf_name(n) for n, note in record.tensors.items() if "perm" in note)
    return ExportResult(path, "torch", len(state), nbytes, layout, permuted, tuple(record.strings), record.kept,
                        unmapped=tuple(record.unmapped))


class _Discard:
    def write(self, data) -> int:
        return len(data)


def _map(path: str, offset: int, size: int, entry) -> np.ndarray:
    from restorekit.bundle.format import dtype_enum, numpy_dtype

    dtype = numpy_dtype(dtype_enum(STORED_AS.get(entry.dtype, entry.dtype)))
    # A private copy-on-write mapping: torch.from_numpy wants a writable array, and
    # nothing must ever reach the source shard.
    count = int(np.prod(entry.shape, dtype=np.int64)) if entry.shape else 1
    return np.memmap(path, dtype=dtype, mode="c", offset=offset, shape=(count,)).reshape(tuple(entry.shape))


def load(path) -> tuple[collections.OrderedDict, LayoutRecord | None]:
    """Load a ``.pt`` file safely: (name -> tensor, the restorekit record or None).

    Uses ``torch.load(weights_only=True)`` (memory-mapped when the file allows). A
    checkpoint dict holding the weights under ``'state_dict'`` or ``'model'`` is
    unwrapped.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        CorruptCheckpointError: unreadable, or a pickle that is not plain weights
            (``weights_only`` refused it; nothing in it ran).
        InvalidArgumentError: the file holds no tensors or non-tensor values.
        MissingDependencyError: torch is not installed.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        from restorekit.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"no PyTorch file at {path!r}", path)
    torch = _torch()
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except pickle.UnpicklingError as e:
        text = _ANSI.sub("", str(e)).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise CorruptCheckpointError(
            f"refusing to load {path!r}: it is not a plain weights file and torch.load(weights_only=True) "
            f"rejected it ({first}). Nothing in it was run; load it only if you trust its source."
        ) from None
    except _SAFE_ERRORS + (OSError,) as e:
        detail = _ANSI.sub("", str(e)).strip()
        detail = f"{type(e).__name__}: {detail}" if detail and not detail.isdigit() else type(e).__name__
        raise CorruptCheckpointError(
            f"{path!r} is not a readable PyTorch file (neither torch.save's zip format nor its legacy one; {detail})"
        ) from None
    if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"{path!r} holds a {type(obj).__name__}, not a state_dict of tensors")
    others = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if others:
        from restorekit.errors import format_names

        raise InvalidArgumentError(f"{path!r}: these entries are not tensors: {format_names(others)}")
    record = None
    meta = getattr(obj, "_metadata", None)
    if isinstance(meta, dict) and isinstance(meta.get(RECORD_KEY), str):
        record = LayoutRecord.from_json(meta[RECORD_KEY], where=path)
    return collections.OrderedDict(obj), record


def read(path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, ndarray)`` for each tensor of a ``.pt`` state_dict, as stored.

    Raises:
        as ``load``.
    """
    state, _ = load(path)
    return ((name, to_numpy(t)) for name, t in state.items())


def read_shapes(path) -> dict:
    """Stored name -> shape of every tensor of a ``.pt`` state_dict."""
    state, _ = load(path)
    return {name: tuple(t.shape) for name, t in state.items()}


def read_record(path) -> LayoutRecord | None:
    """The restorekit layout record of a ``.pt`` file, or None (a file from elsewhere)."""
    return load(path)[1]


def recognizes(head: bytes, suffix: str) -> bool:
    """True for torch.save's zip format (any suffix but ``.npz``) and its legacy bare pickle."""
    return (head.startswith(b"PK") and suffix != ".npz") or head[:1] == b"\x80"
