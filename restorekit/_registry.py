"""The Source protocol every readable checkpoint format implements, the one registry of formats, and ``open``.

A format is a module (or package) of ``restorekit.formats`` that calls :func:`register`
when it is imported: its name, a ``detect(probe) -> score`` and an ``open(path) -> Source``.
The modules are found by listing that package on first use, so a new format is one new
module. This module sits below every format and knows none of them (it imports only
``errors``), so ``Checkpoint(path)`` can hand a path it cannot read to whichever format
claims it, and each format's reader can build on ``Entry`` and ``EntryMapping``.

``detect`` decides by the file's bytes: a format scores :data:`BY_BYTES` when the
first bytes (or the member names of a zip archive) are its own, :data:`BY_NAME` when
only the path's name suggests it. The name is a tiebreak, never an override: a
safetensors file called ``x.pt`` opens as safetensors.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import importlib
import os
import pkgutil
import zipfile
from collections.abc import Mapping as _MappingABC
from typing import Callable, Iterator, Mapping, Protocol, runtime_checkable

import numpy as np

from restorekit.errors import EntryNotFoundError, InvalidArgumentError

__all__ = [
    "BY_BYTES",
    "BY_NAME",
    "Entry",
    "EntryInfo",
    "EntryMapping",
    "Format",
    "Probe",
    "Source",
    "described",
    "detect",
    "file_and_group",
    "formats",
    "open_source",
    "register",
]

BY_NAME = 1
BY_BYTES = 2
# Where the formats are found: by listing this package, imported on first use (not at import: the
# formats sit above this module, which knows none of them).
FORMATS_PACKAGE = "restorekit.formats"
HEAD_BYTES = 16


@runtime_checkable
class EntryInfo(Protocol):
    """What every source says of one tensor without reading it.

    Read-only members, so a frozen dataclass (``Entry``, ``KerasEntry``) is one.
    """

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple: ...

    @property
    def dtype(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def path(self) -> str | None:
        """The readable path (``dense/kernel`` of a TF2 or Keras key), None where there is none."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor in a checkpoint: the EntryInfo of TF checkpoints and the file formats (``KerasEntry`` is one).

    ``nbytes`` is its size in the data shards; ``path`` its readable path where the source lists one with
    it (Keras files; a TF checkpoint gives it by ``readable_name``, from its object graph)."""

    name: str
    shape: tuple
    dtype: str
    nbytes: int
    path: str | None = None

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@runtime_checkable
class Source(Protocol):
    """A checkpoint in any format, opened once: what ``scan``, ``restore``, ``inspect``, ``verify`` and ``diff`` read.

    ``entries`` maps each name to its :class:`EntryInfo`; ``name in source``,
    ``source[name]`` and ``source.get(name, default)`` keep the ``Mapping`` contract (a
    missing name raises ``EntryNotFoundError``, a ``KeyError``). ``read(name)`` gives
    the tensor as numpy. ``stored_range(name)`` is ``(file, offset, size)`` when the
    tensor's bytes lie in one file exactly as a TF data shard would hold them (a writer
    may copy them as they are), else None. ``object_graph`` is the TF2 object graph, or
    None (empty for Keras files, which pair by readable path). ``verify()`` checks every
    tensor and lists what is wrong.
    """

    prefix: str

    @property
    def entries(self) -> Mapping[str, EntryInfo]: ...

    def __getitem__(self, name: str) -> EntryInfo: ...

    def __contains__(self, name: object) -> bool: ...

    def __iter__(self) -> Iterator[str]: ...

    def __len__(self) -> int: ...

    def read(self, name: str): ...

    def stored_range(self, name: str) -> tuple[str, int, int] | None: ...

    @property
    def object_graph(self): ...

    @property
    def is_object_based(self) -> bool: ...

    @property
    def object_paths(self) -> Mapping[str, str]: ...

    def readable_name(self, name: str) -> str: ...

    def verify(self, *, progress: bool = False): ...


class EntryMapping(_MappingABC):
    """The ``Mapping`` half of a Source, written once: name -> entry over ``self.entries``.

    A reader subclasses it and provides ``entries`` and ``_unknown(name)`` (the
    ``EntryNotFoundError`` naming its closest names). ``source[name]`` raises that error,
    which is a ``KeyError``, so ``Mapping.get(name, default)`` returns the default and
    ``except KeyError`` catches it; ``in``, iteration and ``len`` are over the entries'
    names. ``_entry_key`` is where a reader also takes another spelling of a name (a
    Keras file takes a readable path).
    """

    __slots__ = ()

    @property
    def entries(self) -> Mapping:
        raise NotImplementedError

    def _entry_key(self, name: str) -> str:
        return name

    def _unknown(self, name: str) -> EntryNotFoundError:
        return EntryNotFoundError(f"{getattr(self, 'prefix', self)!r} has no entry {name!r}.", name=name,
                                  candidates=list(self.entries))

    def __getitem__(self, name: str):
        try:
            return self.entries[self._entry_key(name)]
        except KeyError:
            raise self._unknown(name) from None

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor, as its entries count them."""
        return sum(e.nbytes for e in self.entries.values())


@dataclasses.dataclass(frozen=True)
class Probe:
    """What detection looks at, read once per path: the first bytes of a file and, for a zip archive, its member names."""

    path: str
    exists: bool
    is_dir: bool
    head: bytes = b""
    members: tuple[str, ...] | None = None  # None: not a zip archive
    listing: tuple[str, ...] = ()  # a directory's file names

    @property
    def suffix(self) -> str:
        return os.path.splitext(self.path)[1].lower()

    @property
    def lower(self) -> str:
        return self.path.lower()

    @classmethod
    def of(cls, path: str) -> "Probe":
        if "://" in path:  # remote paths (gs://, s3://) are TF checkpoints, read through tf.io.gfile
            return cls(path, exists=False, is_dir=False)
        if os.path.isdir(path):
            try:
                listing = tuple(sorted(os.listdir(path)))
            except OSError:
                listing = ()
            return cls(path, exists=True, is_dir=True, listing=listing)
        if not os.path.isfile(path):  # missing, or a prefix: formats judge the name (a FIFO is not read)
            return cls(path, exists=os.path.exists(path), is_dir=False)
        try:
            with builtins.open(path, "rb") as f:
                head = f.read(HEAD_BYTES)
        except OSError:
            return cls(path, exists=True, is_dir=False)
        members = None
        if head.startswith(b"PK"):
            try:
                with zipfile.ZipFile(path) as archive:
                    members = tuple(archive.namelist())
            except (zipfile.BadZipFile, OSError, ValueError, EOFError):
                members = None  # a damaged archive: its format's reader words the error
        return cls(path, exists=True, is_dir=False, head=head, members=members)


@dataclasses.dataclass(frozen=True)
class Format:
    """One readable format: how to recognize it and how to open it."""

    name: str
    detect: Callable[[Probe], int]
    open: Callable[[str], Source]
    order: int = 50  # ties between equal scores go to the lower order


_FORMATS: dict[str, Format] = {}


def register(name: str, *, detect: Callable[[Probe], int], open: Callable[[str], Source], order: int = 50) -> Format:
    """Add a format to the registry (a format module calls this when imported). Registering a name again replaces it."""
    fmt = Format(name, detect, open, order)
    _FORMATS[name] = fmt
    return fmt


@functools.lru_cache(maxsize=None)
def _load() -> None:
    """Import every format module of ``restorekit.formats``, so each registers itself."""
    package = importlib.import_module(FORMATS_PACKAGE)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if not info.name.startswith("_") and info.name != "registry":
            importlib.import_module(f"{FORMATS_PACKAGE}.{info.name}")


def formats() -> dict[str, Format]:
    """Format name -> Format, for every registered format."""
    _load()
    return dict(sorted(_FORMATS.items(), key=lambda kv: (kv[1].order, kv[0])))


def file_and_group(path: str) -> tuple[str, str]:
    """``(FILE, GROUP)`` of ``FILE:GROUP`` (one group of a training checkpoint: ``ckpt.pt:model_state``)
    when FILE is a file and the whole path is not; else ``(path, '')``."""
    file, sep, group = path.rpartition(":")
    if sep and group and os.path.isfile(file) and not os.path.exists(path):
        return file, group
    return path, ""


def detect(path) -> str:
    """The name of the format ``path`` holds: decided by its bytes, its name only breaking ties.

    A path nothing claims is ``'tf'`` (a prefix whose ``.index`` is missing), so
    opening it raises the TF reader's ``CheckpointNotFoundError`` with its hints.
    """
    probe = Probe.of(file_and_group(os.fspath(path))[0])
    best, best_score = "tf", 0
    for fmt in formats().values():
        score = fmt.detect(probe)
        if score > best_score:
            best, best_score = fmt.name, score
    return best


def open_source(path, fmt: str | None = None) -> Source:
    """Open ``path`` as the Source its format reads it as (``fmt`` forces a format by name).

    An object that is already open (it has ``entries`` and ``read``) is returned as it is.

        src = restorekit.formats.open('model.safetensors')
        src.entries['dense/kernel'].shape, src.read('dense/kernel')

    Raises:
        CheckpointNotFoundError: nothing readable at ``path``.
        CorruptCheckpointError: the file is not a readable file of its format.
        InvalidArgumentError: ``fmt`` names no registered format.
    """
    if hasattr(path, "entries") and hasattr(path, "read"):
        return path
    registered = formats()
    name = detect(path) if fmt is None else fmt
    if name not in registered:
        raise InvalidArgumentError(f"unknown checkpoint format {name!r}; choose one of {', '.join(registered)}")
    return registered[name].open(os.fspath(path))


# What a file's first bytes say it is, for the error a file of no readable format gets (``UnknownFormatError``).
_MAGIC = (
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"\x04\x22\x4d\x18", "an LZ4 frame (joblib.dump(..., compress='lz4') writes these)"),
    (b"\x28\xb5\x2f\xfd", "zstandard-compressed data"),
    (b"BZh", "bzip2-compressed data"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"\x93NUMPY", "one numpy .npy array (restorekit reads .npz archives of them)"),
    (b"GGUF", "a GGUF model (llama.cpp)"),
    (b"\x7fELF", "an executable (ELF)"),
)


def described(probe: Probe) -> str | None:
    """What ``probe``'s first bytes say the file is, in words; None when they say nothing."""
    head = probe.head
    if probe.members is not None:
        shown = ", ".join(repr(m) for m in probe.members[:4]) + (", ..." if len(probe.members) > 4 else "")
        count = f"{len(probe.members)} member{'s' if len(probe.members) != 1 else ''}"
        return f"a zip archive ({count}: {shown})" if probe.members else "an empty zip archive"
    if len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a Python pickle (protocol {head[1]}: joblib, pickle.dump and the old torch.save write these)"
    for magic, words in _MAGIC:
        if head.startswith(magic):
            return words
    if head[4:8] == b"TFL3":
        return "a TensorFlow Lite model"
    if len(head) >= 3 and head[0] == 0x08 and head[2] in (0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42):
        return "a protobuf message (an ONNX model? restorekit reads those named '*.onnx')"
    if head.lstrip()[:1] in (b"{", b"["):
        return "JSON text"
    if not head:
        return "an empty file"
    return None
