"""What a ``.pt`` file claims, read without torch and checked before ``torch.load`` maps it.

``torch.load(mmap=True)`` trusts the pickle: a storage declared longer than its zip
record takes the bytes of the next record, a view with stride 0 turns 4 bytes into
gigabytes, and the legacy format allocates whatever size the pickle names. So the
pickle is first read here with an unpickler that imports nothing and runs nothing (every
global becomes a placeholder), to learn each tensor's storage record, dtype size,
offset, shape and strides; those are checked against the archive before torch sees
the file. torch then loads it as before (``weights_only=True``, the safety judge).
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import re
from dataclasses import dataclass

from restorekit.errors import CorruptCheckpointError, InvalidArgumentError
from restorekit.formats._dtypes import STORAGE_DTYPES, STORAGE_ONLY, TORCH_DTYPES

__all__ = ["Scan", "ScanError", "StorageRef", "Tree", "View", "check_views", "flatten", "scan_legacy", "scan_zip", "state_of"]

_MAX_RANK = 64  # numpy's limit, and far above any real weight
_STORAGE_NAME = re.compile(r"[A-Za-z0-9_]+Storage")
_DTYPE_NAME = re.compile(r"[a-z0-9_]+")
# Rebuild functions of tensors restorekit does not import, and what to call them.
_KINDS = {
    "_rebuild_sparse_tensor": "sparse",
    "_rebuild_sparse_csr_tensor": "sparse",
    "_rebuild_meta_tensor_no_storage": "meta",
    "_rebuild_qtensor": "quantized",
    "_rebuild_nested_tensor": "nested",
    "_rebuild_wrapper_subclass": "tensor subclass",
    "_rebuild_device_tensor_from_numpy": "device",
    "_rebuild_device_tensor_from_cpu_tensor": "device",
    "_rebuild_xla_tensor": "device",
    "_rebuild_mtia_tensor": "device",
}
_ADVICE = {
    "sparse": "call .to_dense() before saving",
    "meta": "it has no values (a meta tensor); save it after materialising it",
    "quantized": "call .dequantize() or .int_repr() before saving",
}


@dataclass(frozen=True)
class StorageRef:
    """One storage record of the archive (``data/KEY``), as the pickle declares it."""

    key: str
    itemsize: int
    numel: int  # in elements of ``itemsize`` bytes
    location: str
    dtype: str = ""  # torch's name of its element type ('float32'), '' for an untyped storage

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class View:
    """A tensor as the pickle builds it: which storage, where, of what shape and strides."""

    storage: StorageRef | None
    offset: object
    shape: object
    stride: object
    itemsize: int
    kind: str = "dense"


@dataclass(frozen=True)
class Scan:
    """What a ``.pt`` file's pickle builds (Views where torch builds tensors), the bytes
    each storage record holds, and the globals the scan did not know (torch judges those)."""

    obj: object
    records: dict  # storage key -> bytes the archive holds for it (zip records; legacy: declared)
    unknown: tuple  # 'module.name' of each global that became a placeholder
    prefix: str = ""  # the archive's top folder ('archive/'), zip format only


class Placeholder:
    """Anything the scan does not need (and what torch builds for a training checkpoint's globals outside
    its weights): absorbs construction, state and items; the real global is never imported or called."""

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


@dataclass(frozen=True)
class _Itemsize:
    """A storage type or dtype global, reduced to its element size and torch's dtype name."""

    itemsize: int
    dtype: str = ""


def _dense(storage, offset=0, shape=(), stride=(), *rest):
    itemsize = storage.itemsize if isinstance(storage, StorageRef) else 0
    return View(storage if isinstance(storage, StorageRef) else None, offset, shape, stride, itemsize)


def _dense_v3(storage, offset, shape, stride, requires_grad=None, hooks=None, dtype=None, *rest):
    itemsize = dtype.itemsize if isinstance(dtype, _Itemsize) else 0
    return View(storage if isinstance(storage, StorageRef) else None, offset, shape, stride, itemsize)


def _first(data=None, *rest):
    return data


def _kind(kind: str):
    return lambda *args, **kwargs: View(None, 0, (), (), 0, kind)


class _Unpickler(pickle.Unpickler):
    """Reads torch's pickle into Views; imports nothing, every other global is a placeholder."""

    def __init__(self, file, itemsizes, unknown: list | None = None):
        super().__init__(file, encoding="utf-8")
        self._itemsizes = itemsizes
        self.storages: dict[str, StorageRef] = {}
        self.unknown: list[str] = [] if unknown is None else unknown  # shared by the pickles of one file

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch._utils":
            if name in ("_rebuild_tensor", "_rebuild_tensor_v2"):  # _rebuild_tensor: files of torch < 1.0
                return _dense
            if name == "_rebuild_tensor_v3":
                return _dense_v3
            if name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
                return _first
            if name in _KINDS:
                return _kind(_KINDS[name])
            return _kind(f"torch._utils.{name}")
        if (module, name) == ("torch", "Size"):
            return tuple
        if (module, name) == ("torch.serialization", "_get_layout"):
            return str
        if module in ("torch", "torch.storage") and (_STORAGE_NAME.fullmatch(name) or _DTYPE_NAME.fullmatch(name)):
            size = self._itemsizes(name)
            if size:
                tf_name = STORAGE_DTYPES.get(name[: -len("Storage")], "") if name.endswith("Storage") else name
                return _Itemsize(size, TORCH_DTYPES.get(tf_name, tf_name))
        self.unknown.append(f"{module}.{name}")
        return Placeholder

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] in ("storage", b"storage")):
            raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:80]}")
        _, kind, key, location, numel, *view = pid
        if not isinstance(kind, _Itemsize):
            raise pickle.UnpicklingError(f"storage {str(key)[:40]!r} has an unknown type")
        if isinstance(key, bytes):
            key = key.decode("ascii")
        if isinstance(location, bytes):
            location = location.decode("ascii")
        if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage record {str(pid)[:80]}")
        if view and view[0] is not None:
            raise pickle.UnpicklingError(f"storage {key!r} is a view of another storage (a pre-1.0 file)")
        ref = StorageRef(key, kind.itemsize, numel, location, kind.dtype)
        if self.storages.setdefault(key, ref) != ref:
            raise pickle.UnpicklingError(f"storage {key!r} is declared twice, differently")
        return ref


def _torch_itemsizes():
    import torch

    from restorekit._bundle.format import dtype_enum
    from restorekit._bundle.format import itemsize as tf_itemsize

    # Element sizes of torch's storage classes (torch.FloatStorage, ...), by name: a TF dtype's, or its own.
    storage = {stem: tf_itemsize(dtype_enum(name)) for stem, name in STORAGE_DTYPES.items()} | STORAGE_ONLY

    def itemsize(name: str) -> int:
        if name.endswith("Storage"):
            return storage.get(name[: -len("Storage")], 0)
        found = getattr(torch, name, None)
        return found.itemsize if isinstance(found, torch.dtype) else 0

    return itemsize


class ScanError(Exception):
    """The pickle could not be read; ``unknown`` lists the globals met before it failed."""

    def __init__(self, cause: BaseException, unknown: tuple):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.unknown = unknown


def load_pickle(unpickler: "_Unpickler"):
    """``unpickler.load()``; any failure of the restricted reader as ScanError."""
    try:
        return unpickler.load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, MemoryError, RecursionError) as e:
        raise ScanError(e, tuple(unpickler.unknown)) from None


_STATE_KEYS = ("state_dict", "model", "model_state_dict")
_SCALARS = (bool, int, float, str, bytes, type(None))


@dataclass(frozen=True)
class Tree:
    """What a ``.pt`` file holds, flattened: its tensors and its plain values, each named by its path."""

    tensors: dict  # 'model_state.lstm.weight_ih_l0' -> tensor (a View, or torch's tensor)
    metadata: dict  # 'step', 'optimizer_state.param_groups.0.lr' -> a number, string, or list of them
    state: object  # the dict the names start from (its ``_metadata`` carries a restorekit record)


def _holds_tensor(node, is_tensor) -> bool:
    if is_tensor(node):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v, is_tensor) for v in node.values())
    return isinstance(node, (list, tuple)) and any(_holds_tensor(v, is_tensor) for v in node)


def state_of(obj, is_tensor):
    """The dict a ``.pt`` file's names start from: itself, or its 'state_dict' / 'model' /
    'model_state_dict' entry when every tensor of the file lies there (the rest is metadata)."""
    if isinstance(obj, dict) and not any(is_tensor(v) for v in obj.values()):
        for key in _STATE_KEYS:
            if isinstance(obj.get(key), dict) and not any(
                    _holds_tensor(v, is_tensor) for k, v in obj.items() if k != key):
                return obj[key]
    return obj


def flatten(path: str, obj, is_tensor, group: str = "") -> Tree:
    """The tensors and plain values of ``obj``, named by their path through dicts and lists.

    A flat state_dict keeps its names; a training checkpoint (``{'step', 'model_state',
    'optimizer_state'}``) names each tensor by its path (``model_state.lstm.weight_ih_l0``,
    ``optimizer_state.state.0.exp_avg``); one whose tensors all lie in its 'state_dict' (or
    'model') entry reads as that state_dict. ``group`` keeps only the entries under that path,
    without it (``model_state``: ``lstm.weight_ih_l0``). Other objects (the stand-ins of a
    checkpoint's hyper-parameters) are left out.

    Raises:
        InvalidArgumentError: no tensors, keys that are not names, a flat state_dict holding
            objects that are not tensors, two paths spelling one name, a ``group`` holding nothing.
    """
    root = state_of(obj, is_tensor)
    if not isinstance(root, dict):
        raise InvalidArgumentError(f"{path!r} holds a {_type_name(root)}, not a state_dict of tensors")
    if not root:
        raise InvalidArgumentError(f"{path!r} holds an empty state_dict: there are no tensors to import")
    unnamed = [k for k in root if not isinstance(k, str)]
    if unnamed:
        from restorekit.errors import format_names

        raise InvalidArgumentError(
            f"{path!r} holds tensors under keys that are not names ({format_names(unnamed)}); "
            f"a state_dict is keyed by parameter names: save model.state_dict(), or rename the keys to strings"
        )
    if any(is_tensor(v) for v in root.values()):  # a state_dict: every entry a tensor or a plain value
        others = [k for k, v in root.items() if not is_tensor(v) and not _plain(v)]
        if others:
            from restorekit.errors import format_names

            raise InvalidArgumentError(f"{path!r}: these entries are not tensors: {format_names(others)}")
    tensors: dict = {}
    metadata: dict = {}
    if root is not obj:  # the checkpoint's other entries (epoch, global_step, ...) as metadata
        for key, value in obj.items():
            if value is not root:
                _walk(path, value, str(key), is_tensor, tensors, metadata)
    for key, value in root.items():
        _walk(path, value, key, is_tensor, tensors, metadata)
    if group:
        tensors, metadata = _under(group, tensors), _under(group, metadata)
        if not tensors:
            groups = sorted({name.split(".", 1)[0] for name in flatten(path, obj, is_tensor).tensors})
            raise InvalidArgumentError(f"{path!r} holds no tensors under {group!r}; its tensors lie under "
                                       f"{', '.join(map(repr, groups))}")
    if not tensors:
        raise InvalidArgumentError(f"{path!r} holds no tensors")
    return Tree(tensors, metadata, root)


def _plain(value) -> bool:
    return isinstance(value, _SCALARS) or (isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value))


def _walk(path: str, node, name: str, is_tensor, tensors: dict, metadata: dict) -> None:
    if name in tensors or name in metadata:
        raise InvalidArgumentError(f"{path!r}: two entries are named {name!r} (a key with dots and a nested one)")
    if is_tensor(node):
        tensors[name] = node
    elif _plain(node):
        metadata[name] = list(node) if isinstance(node, tuple) else node
    elif isinstance(node, dict):
        for key, value in node.items():
            _walk(path, value, f"{name}.{key}", is_tensor, tensors, metadata)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _walk(path, value, f"{name}.{i}", is_tensor, tensors, metadata)


def _under(group: str, named: dict) -> dict:
    start = group.rstrip(".") + "."
    return {name[len(start):]: value for name, value in named.items() if name.startswith(start)}


def scan_zip(path: str, archive) -> Scan:
    """The tensors of torch.save's zip format, from its ``data.pkl`` (CRC checked by zipfile)."""
    pickles = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise CorruptCheckpointError(f"{path!r} is a zip archive but not torch.save's: no single 'NAME/data.pkl'")
    prefix = pickles[0][: -len("data.pkl")]
    records = {}
    for info in archive.infolist():
        if info.filename.startswith(prefix + "data/"):
            if info.compress_type != 0:
                raise CorruptCheckpointError(
                    f"{path!r}: record {info.filename!r} is compressed; torch.save stores its records as they are"
                )
            records[info.filename[len(prefix + "data/"):]] = info.file_size
    unpickler = _Unpickler(io.BytesIO(archive.read(pickles[0])), _torch_itemsizes())
    obj = load_pickle(unpickler)
    return Scan(obj, records, tuple(unpickler.unknown), prefix)


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def scan_legacy(path: str, data: bytes) -> Scan:
    """The tensors of torch's legacy (pre-1.6) format: magic, version, sys info, the pickle,
    the storage keys, then each storage as an 8-byte little-endian element count and its bytes.

    The header's ``little_endian`` names the machine that wrote the file, not the bytes: torch
    writes (and reads) every legacy storage little-endian, swapping on a big-endian machine, so
    the bytes are kept as stored and torch reads them as they are meant on any machine.

    Raises:
        CorruptCheckpointError: not the legacy header, a storage list naming an unknown
            storage, an element count other than the pickle declares, a file shorter or
            longer than its storages.
    """
    stream = io.BytesIO(data)
    itemsizes = _torch_itemsizes()
    unknown: list[str] = []
    magic, protocol, sys_info = (load_pickle(_Unpickler(stream, itemsizes, unknown)) for _ in range(3))
    if magic != _LEGACY_MAGIC or protocol != _LEGACY_PROTOCOL or not isinstance(sys_info, dict):
        raise CorruptCheckpointError(
            f"{path!r} is a pickle but not torch.save's legacy format (no magic number {_LEGACY_MAGIC:#x}, "
            f"protocol {_LEGACY_PROTOCOL} and system info before the data)"
        )
    unpickler = _Unpickler(stream, itemsizes, unknown)
    obj = load_pickle(unpickler)
    keys = load_pickle(_Unpickler(stream, itemsizes, unknown))
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CorruptCheckpointError(f"{path!r}: the legacy storage list is not a list of keys")
    storages = unpickler.storages
    records = {}
    position = stream.tell()
    for key in keys:
        ref = storages.get(key)
        if ref is None:
            raise CorruptCheckpointError(f"{path!r}: the legacy storage list names {key!r}, which no tensor uses")
        count = int.from_bytes(data[position:position + 8], "little") if position + 8 <= len(data) else None
        if count is not None and count != ref.numel:
            raise CorruptCheckpointError(
                f"{path!r}: storage {key!r} holds {count} elements where the pickle declares {ref.numel}"
            )
        records[key] = ref.nbytes if position + 8 + ref.nbytes <= len(data) else max(0, len(data) - position - 8)
        position += 8 + ref.nbytes
    if position != len(data):
        raise CorruptCheckpointError(
            f"{path!r}: its storages declare {position} bytes in all, but the file holds {len(data)}"
        )
    return Scan(obj, records, tuple(unpickler.unknown))


def _type_name(obj) -> str:
    return "placeholder object" if isinstance(obj, Placeholder) else type(obj).__name__


def check_views(path: str, scan: Scan, views: dict) -> dict:
    """Check every tensor against its storage and the archive; return name -> bytes it expands to.

    Raises:
        InvalidArgumentError: a sparse, meta, quantized or other non-dense tensor, or two
            tensors sharing bytes of one storage in different views (importing each on
            its own would silently drop that link).
        CorruptCheckpointError: a storage record shorter or longer than declared, a view
            reaching past its storage, a malformed shape, stride or offset.
    """
    sizes = {}
    spans = collections.defaultdict(list)
    for name, view in views.items():
        if view.kind != "dense" or (view.storage is not None and view.storage.location.startswith("meta")):
            kind = "meta" if view.kind == "dense" else view.kind
            advice = _ADVICE.get(kind, "restorekit imports dense CPU tensors only")
            raise InvalidArgumentError(f"{path!r}: tensor {name!r} is a {kind} tensor, which restorekit cannot import; {advice}")
        shape, stride, offset = _geometry(path, name, view)
        ref = view.storage
        held = scan.records.get(ref.key)
        if held is None:
            raise CorruptCheckpointError(f"{path!r}: tensor {name!r} needs storage record 'data/{ref.key}', which is missing")
        if held != ref.nbytes:
            raise CorruptCheckpointError(
                f"{path!r}: tensor {name!r}: its storage record 'data/{ref.key}' holds {held} bytes where the "
                f"pickle declares {ref.nbytes}"
            )
        count = math.prod(shape)
        sizes[name] = count * view.itemsize
        if count:
            end = (offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * view.itemsize
            if end > ref.nbytes:
                raise CorruptCheckpointError(
                    f"{path!r}: tensor {name!r} of shape {list(shape)} (strides {list(stride)}, offset {offset}) "
                    f"reaches byte {end} of a {ref.nbytes}-byte storage"
                )
            spans[ref.key].append((offset * view.itemsize, end, name, (offset, shape, stride, view.itemsize)))
    for items in spans.values():
        _check_overlap(path, items)
    return sizes


def _geometry(path: str, name: str, view: View) -> tuple[tuple, tuple, int]:
    shape, stride, offset, storage = view.shape, view.stride, view.offset, view.storage
    if not (
        storage is not None
        and view.itemsize > 0
        and isinstance(shape, (tuple, list))
        and isinstance(stride, (tuple, list))
        and isinstance(offset, int)
        and len(shape) == len(stride) <= _MAX_RANK
        and all(type(d) is int and d >= 0 for d in (*shape, *stride, offset))
    ):
        raise CorruptCheckpointError(
            f"{path!r}: tensor {name!r} has a malformed storage, shape, strides or offset "
            f"({_short(shape)}, {_short(stride)}, {_short(offset)})"
        )
    if storage.nbytes % view.itemsize:
        raise CorruptCheckpointError(f"{path!r}: tensor {name!r}: its storage is not a whole number of elements")
    return tuple(shape), tuple(stride), offset


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_overlap(path: str, items: list) -> None:
    """Refuse two tensors of one storage whose byte ranges meet unless they are one view (tied weights)."""
    items.sort()
    furthest = None
    for start, end, name, geometry in items:
        if furthest is not None and start < furthest[1] and geometry != furthest[3]:
            raise InvalidArgumentError(
                f"{path!r}: tensors {furthest[2]!r} and {name!r} share bytes of one storage in different views; "
                "restorekit imports each tensor on its own and would lose that link (save them with .clone())"
            )
        if furthest is None or end > furthest[1]:
            furthest = (start, end, name, geometry)
