"""The PyTorch format, read: a ``state_dict`` file (``.pt``, ``.pth``, ``.bin``) through ``torch.load(weights_only=True)``.

torch is imported only inside these functions. A ``.pt`` file is a pickle, so it is
only ever loaded with ``weights_only=True``, after ``torchfile`` has read what the
pickle claims without running any of it: a file that asks to run code is refused with
``CorruptCheckpointError`` before anything runs. What an export did (names, axes, dtype
stand-ins, string tensors) is read back from the state_dict's ``_metadata`` attribute
under ``'__restorekit__'``. The writer is ``restorekit.formats.torch``.

A training checkpoint's tensors are named by their path (``_torchfile.flatten``), and
``FILE:GROUP`` reads one group of it. A TorchScript archive is never loaded by torch:
``_torchscript`` reads its parameters and buffers, and their bytes come from its records.
"""

from __future__ import annotations

import collections
import os
import pickle
import re
import sys
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, MissingDependencyError
from restorekit.layouts import LayoutRecord
from restorekit.formats.torch import _torchfile as torchfile
from restorekit.formats.torch import _torchscript as torchscript
from restorekit.formats._dtypes import TORCH_DTYPES
from restorekit.formats.files import FileReader, FileView, by_name
from restorekit.formats._reading import check_output_size, open_zip, reader, regular_file
from restorekit._registry import BY_BYTES, Probe, file_and_group, register

__all__ = ["FORMAT", "SUFFIXES", "TorchReader", "load", "read", "read_metadata", "read_record", "read_shapes", "recognizes", "to_numpy"]

FORMAT = "torch"
SUFFIXES = (".pt", ".pth", ".bin", ".jit")

RECORD_KEY = "__restorekit__"
# ml_dtypes arrays cross to torch by a same-width int view.
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


def to_numpy(tensor) -> np.ndarray:
    """A CPU tensor -> numpy array; bfloat16 and float8 come back as ml_dtypes arrays."""
    from restorekit._bundle.format import dtype_enum, numpy_dtype

    torch = _torch()
    tensor = tensor.detach().cpu()
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _BITS:
        int_name, _ = _BITS[name]
        return tensor.contiguous().view(getattr(torch, int_name)).numpy().view(numpy_dtype(dtype_enum(name)))
    if name not in TORCH_DTYPES:
        raise InvalidArgumentError(f"torch dtype {tensor.dtype} has no TensorFlow checkpoint equivalent")
    return tensor.numpy()


def _is_view(value) -> bool:
    return isinstance(value, torchfile.View)


def _outside_weights(path: str, scan) -> tuple:
    """The unknown globals of ``scan`` when none of them builds a weight: the file is a
    checkpoint dict (no tensor among its own entries) whose tensors are all plain. Else ()."""
    if not isinstance(scan.obj, dict) or any(_is_view(v) for v in scan.obj.values()):
        return ()
    try:
        tree = torchfile.flatten(path, scan.obj, _is_view)
    except InvalidArgumentError:
        return ()
    if not all(v.kind == "dense" for v in tree.tensors.values()):
        return ()
    return tuple(dict.fromkeys(scan.unknown))


_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _torch_load(path: str, stand_ins: tuple = ()):
    """``torch.load(weights_only=True)``, memory-mapped where the format allows; torch's
    refusals and errors as restorekit's. ``stand_ins``: globals torch builds as empty
    placeholders (``torchfile.Placeholder``: never imported or called)."""
    torch = _torch()
    try:
        with torch.serialization.safe_globals([(torchfile.Placeholder, name) for name in stand_ins]):
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
    lines = _ANSI.sub("", str(e)).strip().splitlines()
    first = lines[0] if lines else ""
    detail = f"{type(e).__name__}: {first}" if first and not first.isdigit() else type(e).__name__
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
    metadata: dict  # the plain values of a training checkpoint ('step', 'epoch', ...), by path


def _scan(path: str):
    """What the pickle claims (``torchfile``), read without torch running anything of it."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        with open_zip(path, "PyTorch file") as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) == 1 and torchscript.is_script(pickles[0][: -len("data.pkl")], archive.namelist()):
                return torchscript.scan_script(path, archive), None, False
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
    file, group = file_and_group(path)
    size = regular_file(file, "PyTorch file")
    torch = _torch()
    try:
        scan, crcs, swapped = _scan(file)
    except torchfile.ScanError as e:
        if e.unknown:
            _torch_load(file)  # torch's weights_only loader judges globals; it refuses the unsafe
        raise _unreadable(file, e.cause) from None
    obj = None
    if scan.unknown:
        # Globals torch's weights_only loader must judge first: refused there, nothing ran;
        # those outside the weights (hyper-parameters of a training checkpoint) it builds as stand-ins.
        obj = _torch_load(file, _outside_weights(path, scan))
    views = torchfile.flatten(path, scan.obj, _is_view, group).tensors
    sizes = torchfile.check_views(path, scan, views)
    if crcs is None:  # a TorchScript archive: its tensors built from its records here (zipfile checks their CRC)
        obj = _script_tensors(file, scan, views)
        crcs = {}
    if obj is None:
        obj = _torch_load(file)
    tree = torchfile.flatten(path, obj, torch.is_tensor, group)
    _check_loaded(path, tree.tensors, views)
    record = None
    meta = getattr(tree.state, "_metadata", None)
    if isinstance(meta, dict) and isinstance(meta.get(RECORD_KEY), str):
        record = LayoutRecord.from_json(meta[RECORD_KEY], where=path)
    return _Loaded(collections.OrderedDict(tree.tensors), record, views, sizes, crcs, size, swapped, tree.metadata)


def _script_tensors(path: str, scan, views: dict) -> dict:
    """name -> tensor of a TorchScript archive's parameters and buffers, from its storage records."""
    torch = _torch()
    storages: dict = {}
    state = {}
    with open_zip(path, "PyTorch file") as archive:
        order = archive.read(scan.prefix + "byteorder") if scan.prefix + "byteorder" in archive.namelist() else b"little"
        if order.decode("ascii", "replace") != sys.byteorder:
            raise InvalidArgumentError(f"{path!r}: a TorchScript archive written {order!r}-endian, which restorekit "
                                       f"reads only on a machine of that byte order")
        for name, view in views.items():
            ref = view.storage
            dtype = getattr(torch, ref.dtype, None) if ref.dtype else None
            if not isinstance(dtype, torch.dtype):
                raise InvalidArgumentError(f"{path!r}: TorchScript tensor {name!r} has a storage of no known dtype")
            if ref.key not in storages:
                raw = bytearray(archive.read(scan.prefix + "data/" + ref.key))
                storages[ref.key] = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            state[name] = storages[ref.key].as_strided(tuple(view.shape), tuple(view.stride), view.offset)
    return state


def _check_loaded(path: str, state, views: dict) -> None:
    """torch built what the scan read: the same names, and each a dense CPU tensor of the same view."""
    torch = _torch()
    if list(state) != list(views):
        raise CorruptCheckpointError(f"{path!r}: torch.load read a different state_dict than its pickle declares")
    for name, tensor in state.items():
        view = views[name]
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
    return _read_loaded(path, _load(path), max_output_bytes)


@reader("PyTorch file")
def _load_checked(path: str) -> _Loaded:
    """``_load`` inside the reader's error boundary (what ``load`` raises, for a reader that keeps the load)."""
    return _load(os.fspath(path))


@reader("PyTorch file")
def _read_loaded(path: str, loaded: _Loaded, max_output_bytes: int | None):
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
        with open_zip(file_and_group(path)[0], "PyTorch file") as archive:
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
def read_metadata(path) -> dict:
    """The plain values (numbers, strings, lists of them) of a training checkpoint, by path: ``{'step': 3, ...}``."""
    return _load(os.fspath(path)).metadata


@reader("PyTorch file")
def read_record(path) -> LayoutRecord | None:
    """The restorekit layout record of a ``.pt`` file, or None (a file from elsewhere)."""
    return load(path)[1]


def recognizes(head: bytes, suffix: str) -> bool:
    """True for torch.save's zip format (any suffix but ``.npz``) and its legacy bare pickle."""
    return (head.startswith(b"PK") and suffix != ".npz") or head[:1] == b"\x80"


class TorchReader(FileReader):
    """A PyTorch ``state_dict`` file: its tensors as stored (names and axes of the file).

    ``path`` may name one group of a training checkpoint: ``ckpt.pt:model_state`` reads the
    tensors under ``model_state.`` without that prefix (``restorekit.From(path, prefix=...)``).

    The file is loaded once per reader (the restricted scan, then ``torch.load`` memory-mapped)
    and every verb reads that load: a conversion asks for the record, the shapes, the sizes of
    its shards and the tensors of one file, and none of them loads it again."""

    fmt = FORMAT
    checks = ("PyTorch files carry no per-tensor checksum: verified means every storage record matches its zip "
              "CRC-32 and every tensor reads back and decodes")

    def __init__(self, path):
        file, _ = file_and_group(os.fspath(path))
        super().__init__(file)
        self.path = os.fspath(path)
        self._loaded: _Loaded | None = None

    def loaded(self) -> _Loaded:
        """The file as loaded once (``load``'s checks and errors), shared by every verb of this reader."""
        if self._loaded is None:
            self._loaded = _load_checked(self.path)
        return self._loaded

    def metadata(self) -> dict:
        """The plain values of a training checkpoint (``step``, ``epoch``, hyper-parameters), by path."""
        return self.loaded().metadata

    def read(self, max_output_bytes: int | None = None):
        return _read_loaded(self.path, self.loaded(), max_output_bytes)

    def read_shapes(self) -> dict:
        return {name: tuple(t.shape) for name, t in self.loaded().state.items()}

    def read_record(self) -> LayoutRecord | None:
        return self.loaded().record

    def stored_tensors(self) -> dict:
        return {name: (tuple(t.shape), to_numpy(t.reshape(-1)[:0]).dtype, lambda t=t: to_numpy(t))
                for name, t in self.loaded().state.items()}


def detect(probe: Probe) -> int:
    if probe.members is not None and any(m == "data.pkl" or m.endswith("/data.pkl") for m in probe.members):
        return BY_BYTES
    if probe.members is None and probe.head[:1] == b"\x80" and probe.head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        # torch.save's legacy format: a bare pickle (PROTO opcode, protocol 2 to 5)
        return BY_BYTES
    return by_name(probe, SUFFIXES)


register(FORMAT, detect=detect, open=lambda path: FileView(path, TorchReader(path)), order=31)
