"""The safetensors format, read: one ``.safetensors`` file, or a Hugging Face set of shards read as one.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte range; ``__metadata__`` -> str), then the raw little-endian tensor bytes.
We read it ourselves because the ``safetensors`` package cannot read bfloat16 into
numpy; the package itself is not needed here, and the tests check our files against it.

A set of shards (``model-0000N-of-0000M.safetensors`` + ``model.safetensors.index.json``,
or a directory of them) is read by ``ShardedSafetensorsReader``, a subclass of the
one-file ``SafetensorsReader`` with the same verbs: what differs is only which files
hold the tensors and how they are checked against each other (as Keras'
``ShardedH5IOStore`` subclasses ``H5IOStore``). A shard missing from the set, an index
naming a file that is not there, shards of two saves mixed in one directory, or a
tensor the index and the shards disagree about is a ``CorruptCheckpointError`` before
anything is read. The writers are ``restorekit.formats.safetensors`` and
``restorekit.formats.safetensors._shards``.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from restorekit._bundle.jsonfile import read_json
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError
from restorekit.formats._sink import raw_bytes_view
from restorekit.layouts import METADATA_KEY, LayoutRecord
from restorekit.formats._dtypes import FROM_SAFETENSORS
from restorekit.formats.files import FileReader, FileView, by_name
from restorekit.formats._reading import check_output_size, reader, regular_file
from restorekit._registry import BY_NAME, BY_BYTES, Probe, register

__all__ = ["FORMAT", "INDEX_SUFFIX", "SUFFIXES", "Header", "SafetensorsReader", "ShardSet", "ShardedSafetensorsReader",
           "TensorInfo", "find", "open_reader", "open_tensors", "read", "read_header", "read_record", "read_shapes",
           "recognizes", "shard_set"]

FORMAT = "safetensors"
SUFFIXES = (".safetensors",)
INDEX_SUFFIX = ".safetensors.index.json"
_SHARD = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors")

_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers ("header too large")
_MAX_RANK = 64  # numpy's limit


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors code, e.g. 'BF16'
    shape: tuple
    begin: int  # byte range within the data section
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header: tensors in file order, metadata, restorekit record."""

    tensors: dict
    metadata: dict
    data_start: int
    record: LayoutRecord | None


def _numpy_dtype(st_dtype: str) -> np.dtype:
    from restorekit._bundle.format import dtype_enum, numpy_dtype

    return numpy_dtype(dtype_enum(FROM_SAFETENSORS[st_dtype]))


@reader("safetensors file")
def read_header(path) -> Header:
    """Parse and check the header of a ``.safetensors`` file (no tensor bytes are read).

    Parsed strictly, as the format defines it: shape entries are non-negative JSON
    integers (not ``2.9``, not ``true``), dtypes are the format's, byte ranges are
    ordered pairs of integers that tile the data section, each range holds exactly
    its shape's bytes (computed without overflow), names appear once, and the header
    fits the file and the format's 100,000,000-byte limit.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        CorruptCheckpointError: not a well-formed safetensors file (names the tensor).
        InvalidArgumentError: a dtype of the format that restorekit cannot hold.
    """
    path = os.fspath(path)
    size = regular_file(path, "safetensors file")
    header, n = _read_json(path, size)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, "__metadata__ is not an object of strings")
    tensors = {name: _tensor_info(path, name, info) for name, info in header.items()}
    _check_coverage(path, tensors, size - 8 - n)
    record = None
    if METADATA_KEY in metadata:
        record = LayoutRecord.from_json(metadata[METADATA_KEY], where=path)
    ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].begin))
    return Header(ordered, metadata, 8 + n, record)


def _bad(path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path!r} is not a valid safetensors file: {why}")


def _unique(pairs: list) -> dict:
    """json object hook: a name given twice is an error (json.loads would keep the last)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key!r} appears twice")
        out[key] = value
    return out


def _read_json(path: str, size: int) -> tuple[dict, int]:
    """(the JSON header as a dict, its length in bytes)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(path, "shorter than its 8-byte header length")
        n = struct.unpack("<Q", head)[0]
        if n > _MAX_HEADER or 8 + n > size:
            raise _bad(path, f"header length {n} does not fit a {size}-byte file (nor the format's {_MAX_HEADER})")
        try:
            header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_unique)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _bad(path, f"header is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    return header, n


# Every dtype the format defines; those restorekit lacks are refused as unsupported, not corrupt.
_ST_DTYPES = frozenset(FROM_SAFETENSORS) | {"F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C128"}


def _is_count(value) -> bool:
    return type(value) is int and value >= 0  # bool is an int subclass, and 2.9 is not an int


def _tensor_info(path: str, name: str, info) -> TensorInfo:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _bad(path, f"entry {name!r} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise _bad(path, f"tensor {name!r} has dtype {str(dtype)[:40]!r}, which the format does not define")
    if dtype not in FROM_SAFETENSORS:
        raise InvalidArgumentError(f"{path!r}: tensor {name!r} has dtype {dtype!r}, which restorekit cannot read")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _bad(path, f"tensor {name!r} has shape {str(shape)[:80]}; dimensions are non-negative integers")
    if len(shape) > _MAX_RANK:
        raise _bad(path, f"tensor {name!r} has {len(shape)} dimensions, over numpy's {_MAX_RANK}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {name!r} has data_offsets {str(offsets)[:80]}; expected [begin, end], begin <= end")
    begin, end = offsets
    # Python integers do not wrap, so a product past 2**63 is compared as it is.
    need = math.prod(shape) * _numpy_dtype(dtype).itemsize
    if end - begin != need:
        raise _bad(path, f"tensor {name!r}: byte range {begin}..{end} does not hold {dtype} {shape} ({need} bytes)")
    return TensorInfo(dtype, tuple(shape), begin, end)


def _check_coverage(path: str, tensors: dict, data_size: int) -> None:
    """The tensors must tile the data section: no overlap, no gap, nothing after."""
    cursor = 0
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != cursor:
            raise _bad(path, f"tensor {name!r} starts at {info.begin}, expected {cursor} (overlap or gap)")
        cursor = info.end
    if cursor != data_size:
        raise _bad(path, f"tensors cover {cursor} bytes of a {data_size}-byte data section")


@reader("safetensors file")
def read_shapes(path) -> dict:
    """Stored name -> shape of every tensor of a ``.safetensors`` file (reads only the header)."""
    return {name: info.shape for name, info in read_header(path).tensors.items()}


@reader("safetensors file")
def read_record(path) -> LayoutRecord | None:
    """The restorekit layout record of a ``.safetensors`` file, or None (a file from elsewhere)."""
    return read_header(path).record


def recognizes(head: bytes, suffix: str) -> bool:
    """True when a file's first bytes are a safetensors header length followed by its JSON."""
    return len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20)


@reader("safetensors file")
def read(path, *, max_output_bytes: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, ndarray)`` for each tensor of a ``.safetensors`` file, as stored.

    One tensor is read at a time; bfloat16 and float8 come back as ml_dtypes arrays.
    Names and axes are those in the file (see ``import_checkpoint`` for TF ones).
    ``max_output_bytes`` is honoured as by the other readers (a safetensors file holds
    every byte it yields, so only a limit below its size refuses it).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: as ``read_header``.
        OutputError: over ``max_output_bytes``.
    """
    path = os.fspath(path)
    header = read_header(path)
    check_output_size(path, os.path.getsize(path), {n: i.end - i.begin for n, i in header.tensors.items()},
                      max_output_bytes)
    return _arrays(path, header)


def open_tensors(path) -> dict:
    """Stored name -> every tensor of a ``.safetensors`` file as a private memory map (read on use).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: as ``read_header``.
    """
    path = os.fspath(path)
    header = read_header(path)
    out = {}
    for name, info in header.tensors.items():
        dtype = _numpy_dtype(info.dtype)
        if info.end == info.begin:
            out[name] = np.empty(info.shape, dtype=dtype)
        else:
            # copy-on-write: a caller may hand the array to torch.from_numpy, nothing reaches the file
            count = (info.end - info.begin) // dtype.itemsize
            out[name] = np.memmap(path, dtype=dtype, mode="c", offset=header.data_start + info.begin,
                                  shape=(count,)).reshape(tuple(info.shape))
    return out


def _arrays(path: str, header: Header):
    with open(path, "rb") as f:
        for name, info in header.tensors.items():
            array = np.empty(info.shape, dtype=_numpy_dtype(info.dtype))
            f.seek(header.data_start + info.begin)
            if array.nbytes and f.readinto(raw_bytes_view(array)) != array.nbytes:
                raise CorruptCheckpointError(f"{path!r}: tensor {name!r} is truncated")
            yield name, array


@dataclass(frozen=True)
class ShardSet:
    """A set of safetensors shards read as one: its files in order, and the index's weight map (None without one)."""

    files: tuple
    index: str | None = None
    weight_map: dict | None = None

    @property
    def path(self) -> str:
        return self.index or os.path.dirname(self.files[0])


def _bad_set(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where!r} is not a complete set of safetensors shards: {why}")


def find(path) -> ShardSet | None:
    """The shard set at ``path`` (a directory or an index file), or None when ``path`` is neither.

    A directory holding one ``*.safetensors.index.json`` is read through it; one without
    an index but with ``NAME-0000N-of-0000M.safetensors`` files (or a single
    ``model.safetensors``) is read from those.

    Raises:
        CorruptCheckpointError: shards missing, mixed, or an unreadable index.
    """
    path = os.fspath(path)
    if path.endswith(".index.json") and os.path.exists(path) and not os.path.isdir(path):
        return _from_index(path)  # refuses a FIFO or device by name
    if not os.path.isdir(path):
        return None
    names = sorted(os.listdir(path))
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if len(indexes) > 1:
        raise _bad_set(path, f"it holds {len(indexes)} index files ({', '.join(indexes)}); name the one to read")
    if indexes:
        return _from_index(os.path.join(path, indexes[0]))
    groups: dict[tuple, set] = {}
    for n in names:
        m = _SHARD.fullmatch(n)
        if m:
            groups.setdefault((m.group("stem"), int(m.group("n"))), set()).add(int(m.group("i")))
    if not groups:
        single = [n for n in names if n.endswith(".safetensors")]
        return ShardSet((os.path.join(path, single[0]),)) if len(single) == 1 else None
    if len(groups) > 1:
        saves = ", ".join(f"{stem}-*-of-{n:05d}" for stem, n in sorted(groups))
        raise _bad_set(path, f"shards of {len(groups)} different saves are mixed in it ({saves})")
    (stem, total), present = next(iter(groups.items()))
    missing = [_shard_name(stem, i, total) for i in range(1, total + 1) if i not in present]
    if missing or total == 0:
        raise _bad_set(path, f"missing {', '.join(missing) or 'every shard'}")
    return ShardSet(tuple(os.path.join(path, _shard_name(stem, i, total)) for i in range(1, total + 1)))


def _from_index(index: str) -> ShardSet:
    data = read_json(index, "safetensors index").value
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(f"{index!r} is not a safetensors index (its weight_map is not an object of "
                                     f"name -> file)")
    directory = os.path.dirname(os.path.abspath(index))
    files = list(dict.fromkeys(weight_map.values()))
    if not files:
        raise _bad_set(index, "its weight_map is empty")
    for name in files:
        if os.path.basename(name) != name:
            raise _bad_set(index, f"it names {name!r}, not a file beside it")
    missing = [name for name in files if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise _bad_set(index, f"it names {', '.join(repr(m) for m in missing)}, which {'is' if len(missing) == 1 else 'are'} not in {directory!r}")
    stems = {(m.group("stem"), m.group("n")) for m in map(_SHARD.fullmatch, files) if m}
    strays = [n for n in os.listdir(directory) if n not in files and (m := _SHARD.fullmatch(n))
              and any(m.group("stem") == stem for stem, _ in stems)]
    if strays:
        raise _bad_set(index, f"{', '.join(sorted(strays))} in the same directory belong to another save; remove them")
    return ShardSet(tuple(os.path.join(directory, n) for n in files), index, dict(weight_map))


def _shard_name(stem: str, i: int, total: int) -> str:
    return f"{stem}-{i:05d}-of-{total:05d}.safetensors"


def _headers(shards: ShardSet) -> list:
    """(shard, its parsed header) of every shard, checked against the index and against the other shards."""
    headers = []
    owner: dict[str, str] = {}
    for path in shards.files:
        header = read_header(path)
        for name in header.tensors:
            if name in owner:
                raise _bad_set(shards.path, f"tensor {name!r} is in both {owner[name]!r} and {path!r}")
            owner[name] = path
            if shards.weight_map is not None and shards.weight_map.get(name) != os.path.basename(path):
                raise _bad_set(shards.path, f"tensor {name!r} is in {os.path.basename(path)!r}, the index says "
                                        f"{shards.weight_map.get(name)!r}")
        headers.append((path, header))
    if shards.weight_map is not None:
        absent = [n for n in shards.weight_map if n not in owner]
        if absent:
            raise _bad_set(shards.path, f"the index lists {', '.join(repr(n) for n in absent[:5])}, which no shard holds")
    return headers


# ------------------------------------------------------------------ one file, a set of shards

class SafetensorsReader(FileReader):
    """One ``.safetensors`` file: its tensors as stored (names and axes of the file)."""

    fmt = FORMAT
    checks = ("safetensors carries no checksum: verified means the header is consistent (dtypes, shapes, "
              "byte ranges tiling the data) and every tensor reads back and decodes")

    @property
    def data_files(self) -> tuple[str, ...]:
        """The safetensors files holding the tensors, in order."""
        return (self.path,)

    def headers(self) -> list[tuple[str, Header]]:
        """(file, its parsed and checked header) of every data file."""
        return [(self.path, read_header(self.path))]

    def read(self, max_output_bytes: int | None = None):
        return read(self.path, max_output_bytes=max_output_bytes)

    def check_size(self, headers: list, max_output_bytes: int | None) -> None:
        """Refuse tensors (of ``headers``, as ``headers()`` gives them) over ``max_output_bytes`` (see ``read``).

        Raises:
            OutputError: over the limit.
        """
        sizes = {n: i.end - i.begin for _, h in headers for n, i in h.tensors.items()}
        check_output_size(self.path, sum(os.path.getsize(p) for p, _ in headers), sizes, max_output_bytes)

    def read_shapes(self) -> dict:
        return {name: info.shape for _, header in self.headers() for name, info in header.tensors.items()}

    def read_record(self) -> LayoutRecord | None:
        return read_record(self.path)

    def stored_tensors(self) -> dict:
        out = {}
        for path in self.data_files:
            for name, array in open_tensors(path).items():
                out[name] = (tuple(array.shape), array.dtype, lambda a=array: a)
        return out


class ShardedSafetensorsReader(SafetensorsReader):
    """A set of safetensors shards read as one file: the same verbs over every shard, checked as a set."""

    def __init__(self, path: str, shards: ShardSet):
        self.path, self.shards = path, shards
        self.files = tuple(shards.files) + ((shards.index,) if shards.index else ())

    @property
    def data_files(self) -> tuple[str, ...]:
        return tuple(self.shards.files)

    def headers(self) -> list[tuple[str, Header]]:
        return _headers(self.shards)

    def read(self, max_output_bytes: int | None = None):
        headers = self.headers()
        self.check_size(headers, max_output_bytes)
        return (item for path in self.data_files for item in read(path))

    def read_record(self) -> LayoutRecord | None:
        """The shards' restorekit layout records merged into one, or None (files from elsewhere)."""
        records = [h.record for _, h in self.headers() if h.record is not None]
        if not records:
            return None
        merged = LayoutRecord(records[0].layout)
        for record in records:
            merged.tensors.update(record.tensors)
            merged.strings.update(record.strings)
        return merged


def shard_set(path: str) -> ShardSet | None:
    """The safetensors shard set at ``path``, or None (also for any directory holding a TF checkpoint)."""
    if os.path.isdir(path):
        names = os.listdir(path)
        if "checkpoint" in names or any(n.endswith(".index") for n in names):
            return None
    elif not path.endswith(".index.json"):
        return None
    return find(path)


def open_reader(path) -> SafetensorsReader:
    """The reader of the safetensors file or shard set at ``path``.

    Raises:
        CheckpointNotFoundError: nothing there.
        CorruptCheckpointError: an incomplete or mixed set of shards.
    """
    path = os.fspath(path)
    shards = shard_set(path)
    return ShardedSafetensorsReader(path, shards) if shards is not None else SafetensorsReader(path)


# ------------------------------------------------------------------ detection and registration

def detect(probe: Probe) -> int:
    if probe.is_dir:
        names = probe.listing
        if "checkpoint" in names or any(n.endswith(".index") for n in names):
            return 0  # a TF checkpoint directory, even with a safetensors file beside it
        if any(n.endswith(INDEX_SUFFIX) for n in names) or any(n.endswith(".safetensors") for n in names):
            return BY_BYTES
        return 0
    if recognizes(probe.head, probe.suffix):
        return BY_BYTES
    if probe.lower.endswith(".index.json") and probe.head.lstrip()[:1] == b"{":
        return BY_BYTES
    if probe.lower.endswith(INDEX_SUFFIX):
        return BY_NAME  # unreadable here (a FIFO, a device): the shard set's reader says what is wrong with it
    return by_name(probe, SUFFIXES)


register(FORMAT, detect=detect, open=lambda path: FileView(path, open_reader(path)), order=30)
