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
import sys
import zlib
from dataclasses import dataclass
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
from restorekit.export import torchfile
from restorekit.export.layout import STORED_AS, LayoutRecord, check_layout
from restorekit.export.rawcopy import copy_raw
from restorekit.export.reading import check_output_size, open_zip, reader, regular_file

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
_CRC_CHUNK = 16 << 20
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
    shards: dict = {}
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
                    state[out] = _mapped(shards, checkpoint.data_file(raw.shard_id), raw, entry)
                    continue
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


def _mapped(shards: dict, path: str, raw, entry):
    """A tensor over ``raw``'s bytes in a private (copy-on-write) mapping of its data shard.

    One mapping per shard, and it holds no file descriptor (numpy's memmap holds one
    each, so a mapping per tensor ran into ``ulimit -n`` past about 1,000 tensors);
    nothing is ever written to the source shard.
    """
    torch = _torch()
    shard = shards.get(path)
    if shard is None:
        shard = shards[path] = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
    dtype = getattr(torch, _TORCH_DTYPES[STORED_AS.get(entry.dtype, entry.dtype)])
    tensor = torch.empty(0, dtype=dtype).set_(shard[raw.offset : raw.offset + raw.size])
    return tensor.view(tuple(entry.shape))


class _StandIn:
    """What torch builds for a global outside the weights (a Lightning checkpoint's omegaconf
    hyper-parameters): an empty object; the real global is never imported or called."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


def _outside_weights(scan) -> tuple:
    """The unknown globals of ``scan`` when none of them builds a weight: the weights sit in a
    dict of plain tensors under the checkpoint's 'state_dict' (or 'model') entry. Else ()."""
    state = torchfile.state_of(scan.obj, lambda v: isinstance(v, torchfile.View))
    if state is scan.obj or not isinstance(state, dict) or not state:
        return ()
    if not all(isinstance(v, torchfile.View) and v.kind == "dense" for v in state.values()):
        return ()
    return tuple(dict.fromkeys(scan.unknown))


_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _torch_load(path: str, stand_ins: tuple = ()):
    """``torch.load(weights_only=True)``, memory-mapped where the format allows; torch's
    refusals and errors as restorekit's. ``stand_ins``: globals torch builds as ``_StandIn``."""
    torch = _torch()
    try:
        with torch.serialization.safe_globals([(_StandIn, name) for name in stand_ins]):
            return _load_file(torch, path)
    except pickle.UnpicklingError as e:
        why = _reason(_ANSI.sub("", str(e)).strip() or type(e).__name__)
        if stand_ins:
            names = ", ".join(map(repr, stand_ins[:5])) + (" ..." if len(stand_ins) > 5 else "")
            raise CorruptCheckpointError(
                f"refusing to load {path!r}: its weights are plain tensors, but the rest of its pickle calls {names}, "
                f"which torch.load(weights_only=True) cannot build even as empty stand-ins ({why}). Nothing in it "
                f"was run; load it only if you trust its source, and save its state_dict alone"
            ) from None
        raise CorruptCheckpointError(
            f"refusing to load {path!r}: it is not a plain weights file and torch.load(weights_only=True) "
            f"rejected it ({why}). Nothing in it was run; load it only if you trust its source."
        ) from None
    except _SAFE_ERRORS + (OSError,) as e:
        raise _unreadable(path, e) from None


def _load_file(torch, path: str):
    if os.fspath(path).endswith(".safetensors"):
        # torch.load hands a path so named to safetensors whatever its bytes; this one
        # holds torch's format (it was sniffed so), so it goes in as an open file.
        with open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format


def _reason(text: str) -> str:
    """What torch's weights_only refusal says went wrong: its first lines only say that it failed."""
    unsupported = _UNSUPPORTED.search(text)
    if unsupported is not None:
        return f"the pickle calls {unsupported.group(1)!r}, which is not a tensor or a plain container"
    lines = [line.strip().removeprefix("WeightsUnpickler error:").strip() for line in text.splitlines()]
    detail = [line for line in lines[1:] if line and not line.startswith(("Please file an issue", "Check the documentation"))]
    return detail[0] if detail else lines[0]


def _unreadable(path: str, e: BaseException) -> CorruptCheckpointError:
    detail = _ANSI.sub("", str(e)).strip().splitlines()
    detail = detail[0] if detail else ""
    detail = f"{type(e).__name__}: {detail}" if detail and not detail.isdigit() else type(e).__name__
    return CorruptCheckpointError(
        f"{path!r} is not a readable PyTorch file ({detail}; it is neither torch.save's zip format nor its legacy one)"
    )


@dataclass(frozen=True)
class _Loaded:
    state: collections.OrderedDict
    record: LayoutRecord | None
    views: dict  # name -> torchfile.View, as the pickle declares them
    sizes: dict  # name -> bytes the tensor expands to
    crcs: dict  # storage key -> the zip record's CRC-32 (empty for the legacy format)
    size: int  # of the file
    swapped: bool  # the file's byte order is not ours (torch swapped the mapped bytes)


def _scan(path: str):
    """What the pickle claims (``torchfile``), read without torch running anything of it."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        with open_zip(path, "PyTorch file") as archive:
            scan = torchfile.scan_zip(path, archive)
            prefix = scan.prefix
            crcs = {i.filename[len(prefix + "data/"):]: i.CRC for i in archive.infolist()
                    if i.filename.startswith(prefix + "data/")}
            order = archive.read(prefix + "byteorder") if prefix + "byteorder" in archive.namelist() else b"little"
        return scan, crcs, order.decode("ascii", "replace") != sys.byteorder
    with open(path, "rb") as f:
        data = f.read()
    return torchfile.scan_legacy(path, data), {}, False


def _load(path: str) -> _Loaded:
    size = regular_file(path, "PyTorch file")
    torch = _torch()
    try:
        scan, crcs, swapped = _scan(path)
    except torchfile.ScanError as e:
        if e.unknown:
            _torch_load(path)  # torch's weights_only loader judges globals; it refuses the unsafe
        raise _unreadable(path, e.cause) from None
    obj = None
    if scan.unknown:
        # Globals torch's weights_only loader must judge first: refused there, nothing ran;
        # those outside the weights (hyper-parameters of a training checkpoint) it builds as stand-ins.
        obj = _torch_load(path, _outside_weights(scan))
    views = torchfile.views_of(path, scan)
    sizes = torchfile.check_views(path, scan, views)
    if obj is None:
        obj = _torch_load(path)
    state = torchfile.state_of(obj, torch.is_tensor)
    _check_loaded(path, state, views)
    record = None
    meta = getattr(state, "_metadata", None)
    if isinstance(meta, dict) and isinstance(meta.get(RECORD_KEY), str):
        record = LayoutRecord.from_json(meta[RECORD_KEY], where=path)
    return _Loaded(collections.OrderedDict(state), record, views, sizes, crcs, size, swapped)


def _check_loaded(path: str, state, views: dict) -> None:
    """torch built what the scan read: the same names, and each a dense CPU tensor of the same view."""
    torch = _torch()
    if not isinstance(state, dict) or [str(k) for k in state] != list(views):
        raise CorruptCheckpointError(f"{path!r}: torch.load read a different state_dict than its pickle declares")
    for name, tensor in state.items():
        view = views[str(name)]
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"{path!r}: entry {name!r} is not a tensor")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type != "cpu":
            raise InvalidArgumentError(f"{path!r}: tensor {name!r} is not a dense CPU tensor, which restorekit cannot import")
        same = (tuple(tensor.shape) == tuple(view.shape) and tuple(tensor.stride()) == tuple(view.stride)
                and tensor.storage_offset() == view.offset and tensor.element_size() == view.itemsize)
        if not same:
            raise CorruptCheckpointError(f"{path!r}: tensor {name!r} is not the view its pickle declares")


@reader("PyTorch file")
def load(path) -> tuple[collections.OrderedDict, LayoutRecord | None]:
    """Load a ``.pt`` file safely: (name -> tensor, the restorekit record or None).

    The pickle is first read without running anything of it (``torchfile``): every
    tensor must lie within its storage record, no two tensors may share bytes in
    different views, and only dense tensors are accepted. Then
    ``torch.load(weights_only=True)`` (memory-mapped when the file allows) loads it. A
    checkpoint dict holding the weights under ``'state_dict'`` or ``'model'`` is
    unwrapped. Tensor bytes are not read here; ``read`` checks each record's CRC-32.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        CorruptCheckpointError: unreadable; a storage record shorter or longer than its
            tensors need; or a pickle that is not plain weights (``weights_only``
            refused it; nothing in it ran).
        InvalidArgumentError: the file holds no tensors, non-tensor values, or sparse,
            meta, quantized or overlapping tensors (each named).
        MissingDependencyError: torch is not installed.
    """
    loaded = _load(os.fspath(path))
    return loaded.state, loaded.record


@reader("PyTorch file")
def read(path, *, max_output_bytes: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, ndarray)`` for each tensor of a ``.pt`` state_dict, as stored.

    Each tensor's storage record is checked against its zip CRC-32 before it is yielded.

    Args:
        max_output_bytes: refuse a file whose tensors add up to more bytes than this
            (default: the larger of 1 GiB and 64 times the file), before reading any:
            a view with stride 0 makes gigabytes of a few bytes.

    Raises:
        as ``load``; CorruptCheckpointError: a record fails its CRC-32.
        OutputError: over ``max_output_bytes``.
    """
    path = os.fspath(path)
    loaded = _load(path)
    check_output_size(path, loaded.size, loaded.sizes, max_output_bytes,
                      why=" (a view repeating its storage, such as expand(), counts every element)")
    return _arrays(path, loaded)


def _arrays(path: str, loaded: _Loaded):
    checked = set()
    for name, tensor in loaded.state.items():
        key = loaded.views[name].storage.key
        if key not in checked and key in loaded.crcs:
            _check_crc(path, name, key, tensor, loaded)
            checked.add(key)
        yield name, to_numpy(tensor)


def _check_crc(path: str, name: str, key: str, tensor, loaded: _Loaded) -> None:
    """The CRC-32 of the record behind ``tensor`` (the mapped bytes torch will hand over)."""
    expected = loaded.crcs[key]
    if loaded.swapped:  # torch swapped the mapped copy: check the record as stored instead
        with open_zip(path, "PyTorch file") as archive:
            prefix = next(n for n in archive.namelist() if n.endswith("data.pkl"))[: -len("data.pkl")]
            crc = 0
            with archive.open(prefix + "data/" + key) as record:
                while chunk := record.read(_CRC_CHUNK):
                    crc = zlib.crc32(chunk, crc)
    else:
        torch = _torch()
        storage = tensor.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        crc = 0
        for start in range(0, raw.size, _CRC_CHUNK):
            crc = zlib.crc32(raw[start:start + _CRC_CHUNK], crc)
    if crc != expected:
        raise CorruptCheckpointError(
            f"{path!r}: the storage record 'data/{key}' of tensor {name!r} fails its CRC-32 "
            f"(stored {expected:08x}, computed {crc:08x}); the file is damaged"
        )


@reader("PyTorch file")
def read_shapes(path) -> dict:
    """Stored name -> shape of every tensor of a ``.pt`` state_dict."""
    state, _ = load(path)
    return {name: tuple(t.shape) for name, t in state.items()}


@reader("PyTorch file")
def read_record(path) -> LayoutRecord | None:
    """The restorekit layout record of a ``.pt`` file, or None (a file from elsewhere)."""
    return load(path)[1]


def recognizes(head: bytes, suffix: str) -> bool:
    """True for torch.save's zip format (any suffix but ``.npz``) and its legacy bare pickle."""
    return (head.startswith(b"PK") and suffix != ".npz") or head[:1] == b"\x80"
