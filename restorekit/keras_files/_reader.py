"""The reader of one Keras file (Keras 3 ``.weights.h5`` and ``.keras``, legacy Keras 2 HDF5), read with h5py.

``restorekit.Checkpoint(path)`` hands these files to ``KerasCheckpoint``, which offers
the same verbs as a TF checkpoint (``entries``, ``read``, ``readable_name``,
``object_paths``) so ``scan`` and ``restore`` treat them alike.

Layouts (learned from Keras' own ``saving_lib`` and ``legacy_h5_format``):

* Keras 3 ``.weights.h5``: every Keras object (model, layer, optimizer) is a group
  holding ``vars/0``, ``vars/1``, ... and, in ``vars.attrs['name']``, the object's
  name. Lists of layers are container groups (``layers``) whose items are named by
  class (``dense``, ``dense_1``); other sub-objects by attribute (``cell``,
  ``query_dense``). The optimizer is ``optimizer/vars/N``.
* ``.keras``: a zip of ``config.json``, ``metadata.json`` and ``model.weights.h5``.
  The weights member is read in place (never extracted by its member name).
* Legacy Keras 2 HDF5: ``layer_names`` on the root (weights file) or on the
  ``model_weights`` group (model file), ``weight_names`` on each layer group.
* Sharded Keras 3 weights (``model.save_weights('x.weights.json', max_shard_size=...)``):
  a JSON index plus ``x_00000.weights.h5``, ... beside it, each shard a ``.weights.h5``
  holding part of the groups; read as one file by ``sharded.ShardedKerasCheckpoint``.

Readable names are Keras variable paths without the saving model's own name:
``enc1/kernel``, ``block/a/kernel``, ``rnn/lstm_cell/kernel``. A Keras path that several
variables share (two nested Functional blocks' ``fc/kernel``) is given to none of them:
each reads its path through the named layers instead (``block_a/fc/kernel``). A Keras 3 file stores
variables by position only, so their names come from the layer's class: from
``config.json`` in a ``.keras`` file, guessed from the group name (``dense_1`` ->
Dense) in a bare ``.weights.h5``. The guesses: the creation order per built-in layer
type (``kernel, bias``; ``depthwise_kernel, pointwise_kernel, bias``; ``gamma, beta,
moving_mean, moving_variance``; ``embeddings``; ...), less the optional variables
(``use_bias``, ``center``, ``scale``) when exactly one set of them fits the count
(a SeparableConv2D with two variables has no bias), the other sets a layer saves by
config (BatchNormalization ``renorm=True``; Dense, EinsumDense and Embedding after
``quantize('int8' | 'int4' | 'float8')``, told apart by their int8 kernels), and
``kernel, bias`` for a sub-layer of unknown class with two variables of falling rank.
SpectralNormalization saves its layer's kernel a second time, under its own ``vars/0``:
that copy keeps its key. Where nothing fits, or two configs fit (a BatchNormalization
with three variables: ``scale=False`` and ``center=False`` write the same file), and for custom
layers, the variable keeps its index (``custom/0``); ``scan`` pairs such variables by
position inside the layer of the same name, as Keras' ``load_weights`` does. Legacy
files name their weights; those names are used as stored, less a repeated layer
scope (Keras 2.0's ``conv2d_1/conv2d_1_1/kernel`` reads ``conv2d_1/kernel``).
Keras 2 ``CuDNNLSTM`` / ``CuDNNGRU`` weights are told by their shapes
(``cudnn_weights``) and converted on restore as Keras 2 converts them.

Looking a path up in ``object_paths`` forgives scopes before the layer name: Keras puts
a Sequential's, subclassed model's or wrapper's name before its layers' paths
(``sequential_3/dense/kernel``, ``td/block/a/kernel``) depending on where the layers
were built, which a file cannot tell. A path not found as given is looked up without
its leading scopes (longest first), then as the one file path that ends with it; the
layer and variable names must still agree.
"""

from __future__ import annotations

import os
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Iterator, Mapping

import numpy as np

from restorekit._bundle import files
from restorekit._bundle.objectgraph import decode_object_graph
from restorekit.errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    EntryNotFoundError,
    InvalidArgumentError,
    MissingDependencyError,
    NoMatchError,
    RestoreKitError,
    format_names,
)
from restorekit._bundle.verification import Problem, VerifyResult
from restorekit._registry import Entry, EntryMapping
from restorekit.keras_files._archive import MemberFile, check_crc, check_member, json_attr, json_member, member_offset
from restorekit.keras_files._h5nodes import NODES, check_contained, check_dataset, check_links, root
from restorekit.keras_files import _layouts as layouts
from restorekit.keras_files._ranges import stored_range as _stored_range
from restorekit.keras_files._layouts import CONTAINERS, Dataset, Keras3Walk, attr_list, config_index, read_legacy

__all__ = ["KERAS_SUFFIXES", "KerasCheckpoint", "KerasEntry", "is_keras_path", "no_shared_layers_error"]

KERAS_SUFFIXES = (".keras", ".h5", ".hdf5", ".weights.json")
SHARDED_SUFFIX = ".weights.json"
INSTALL = "pip install 'restorekit[keras]'"

# One root node, no children: Keras files pair by name, never by position in an object graph.
_EMPTY_OBJECT_GRAPH = b"\n\x00"


def _h5py():
    try:
        import h5py
    except ModuleNotFoundError as e:
        if e.name != "h5py":
            raise
        raise MissingDependencyError(f"reading Keras files (.weights.h5, .keras, .h5) needs h5py: {INSTALL}") from None
    return h5py


def is_keras_path(path) -> bool:
    """True for a local path ending in ``.keras``, ``.h5``, ``.hdf5`` or ``.weights.json`` (a sharded Keras 3
    index) that is not a TF checkpoint prefix."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    if not isinstance(path, str) or not path.lower().endswith(KERAS_SUFFIXES) or "://" in path:
        return False
    return not os.path.exists(path + ".index")


@dataclass(frozen=True)
class KerasEntry(Entry):
    """One tensor of a Keras file: its key in the file (``name``), shape, dtype, size in bytes, readable path."""


class _Paths(Mapping):
    """Readable path -> key; a lookup forgives model scopes before the layer (see the module docstring)."""

    def __init__(self, paths: dict):
        self._paths = paths
        by_suffix: dict = {}
        for path in paths:
            parts = path.split("/")
            for i in range(1, len(parts) - 1):
                by_suffix.setdefault("/".join(parts[i:]), []).append(path)
        self._by_suffix = {suffix: found[0] for suffix, found in by_suffix.items() if len(found) == 1}

    def __getitem__(self, name: str) -> str:
        key = self._paths.get(name)
        if key is None and isinstance(name, str):
            key = self._paths.get(self._by_suffix.get(name, ""))  # the file has scopes the model lacks
            parts = name.split("/")
            for i in range(1, len(parts) - 1):  # the model has scopes the file lacks
                if key is not None:
                    break
                key = self._paths.get("/".join(parts[i:]))
        if key is None:
            raise KeyError(name)
        return key

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


class KerasCheckpoint(EntryMapping):
    """A read-only view of a Keras file, with the verbs of ``restorekit.Checkpoint``.

    Made by ``restorekit.Checkpoint(path)`` for ``.weights.h5``, ``.keras``, ``.h5``
    and ``.hdf5`` files. Listing reads only the file's structure; ``read`` reads one
    tensor into numpy.

        ckpt = restorekit.Checkpoint('model.weights.h5')
        ckpt.readable_name('layers/dense/vars/0')   # 'enc1/kernel'
        ckpt.read('enc1/kernel')                    # a key or a readable path

    Attributes:
        prefix: the file's path (what a report names as its checkpoint).
        kind: what the file is, in words (``'Keras 3 weights file (.weights.h5)'``).
        config: the model config (parsed JSON, never deserialized), or None.
        layer_names: the saved model's top-level layer names.
        undecided: layer path -> the sets of names two configs give its indexed variables.

    Raises:
        CheckpointNotFoundError: no file at the path.
        CorruptCheckpointError: not a Keras file, truncated, or a ``.keras`` archive
            with members that would escape its folder; a FIFO or device at the path.
        ExternalDataError: an HDF5 external link, external storage or virtual dataset
            (data in another file), refused by name before anything is read from it.
        CheckpointChangedError: (on a later read) the file was replaced or rewritten
            since it was opened; every read is from the version that was opened, or raises.
        MissingDependencyError: h5py is not installed.
    """

    is_object_based = True
    undecided: Mapping = MappingProxyType({})
    _walked_ranges = None  # key -> (offset, size) or None, found while walking a Keras 3 file (see _stored_ranges)

    def __init__(self, path):
        self.prefix = os.fspath(path)
        if type(self) is KerasCheckpoint and self.prefix.lower().endswith(SHARDED_SUFFIX):
            # One class per kind of file: the registry (restorekit.Checkpoint, restorekit.formats.open) picks it.
            raise InvalidArgumentError(f"{self.prefix!r} is the index of a sharded Keras 3 weights set: open it with "
                                       f"restorekit.Checkpoint(path) (a ShardedKerasCheckpoint), not KerasCheckpoint")
        _regular(self.prefix, False)
        self.config = None
        self.metadata = None
        self._member: tuple[int, int] | None = None  # (offset, size) of model.weights.h5 inside a .keras archive
        with files.open_regular(self.prefix) as fh:
            is_zip = zipfile.is_zipfile(fh)
        if is_zip or self.prefix.lower().endswith(".keras"):
            self._open_archive()
        _h5py()
        with self._h5() as f:
            datasets, readable = self._walk(f)
        self._index(datasets, readable)

    def _index(self, datasets: list, readable: dict) -> None:
        """Entries, readable paths and layer names from the datasets a walk found."""
        self._data = {d.key: d for d in datasets}
        self._readable = readable
        entries = {d.key: KerasEntry(d.key, d.shape, d.dtype, d.nbytes, readable.get(d.key)) for d in datasets}
        self._entries = MappingProxyType(dict(sorted(entries.items())))
        by_path = {path: key for key, path in readable.items()}
        model_paths = [p for p in by_path if not p.startswith("optimizer/")]
        self.layer_names = tuple(dict.fromkeys(p.split("/", 1)[0] for p in model_paths if "/" in p))
        self._paths = _Paths(dict(sorted(by_path.items())))

    @property
    def files(self) -> tuple[str, ...]:
        """Every file the checkpoint reads (an output must be none of them)."""
        return (self.prefix,)

    def _file_of(self, key: str) -> str:
        """The file that holds key ``key``'s dataset."""
        return self.prefix

    # -- opening
    def _open_archive(self) -> None:
        try:
            with files.open_regular(self.prefix) as fh, zipfile.ZipFile(fh) as archive:
                self._version(self.prefix, os.fstat(fh.fileno()))  # the member's place is this version's
                infos = archive.infolist()
                for info in infos:
                    check_member(self.prefix, info.filename)
                names = {info.filename: info for info in infos}
                if "model.weights.h5" not in names:
                    raise CorruptCheckpointError(
                        f"{self.prefix!r} is a zip archive but not a Keras 3 .keras file with weights (members: "
                        f"{format_names(names)}); save the model with model.save('model.keras')"
                    )
                self.config = json_member(self.prefix, archive, names.get("config.json"))
                self.metadata = json_member(self.prefix, archive, names.get("metadata.json"))
                info = names["model.weights.h5"]
                if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
                    raise CorruptCheckpointError(
                        f"{self.prefix!r}: model.weights.h5 is compressed or encrypted, which Keras never writes; "
                        f"load the model with keras and save it again with model.save('model.keras')"
                    )
                self._member = (member_offset(self.prefix, info), info.file_size)
                self._member_crc = info.CRC
        except (zipfile.BadZipFile, EOFError, OSError) as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(
                f"{self.prefix!r} is not a readable .keras archive (truncated or corrupt zip: {e}); "
                f"save the model again with model.save('model.keras')"
            ) from None
        if self._member[0] + self._member[1] > os.path.getsize(self.prefix):
            raise CorruptCheckpointError(
                f"{self.prefix!r} is truncated: its model.weights.h5 runs past the end of the file; "
                f"save the model again with model.save('model.keras')"
            )

    @contextmanager
    def _h5(self, path: str | None = None):
        """The HDF5 file ``path`` (default: this checkpoint's own file, or its archive member), open for reading:
        the version this checkpoint was made from (see ``_version``), checked to hold nothing from other files."""
        h5py = _h5py()
        raw = None
        path = path or self.prefix
        try:
            if self._member is not None:
                raw = MemberFile(self.prefix, *self._member)
                f = h5py.File(raw, "r")
            else:
                self._version(path, _regular(path, self._versions.get(path) is not None))  # before HDF5 opens it
                f = h5py.File(path, "r")
        except OSError as e:
            if raw is not None:
                raw.close()
            if isinstance(e, RestoreKitError):
                raise
            what = "the weights inside the .keras archive" if self._member is not None else "it"
            raise CorruptCheckpointError(
                f"{path!r} is not a readable Keras file: {what} is not valid HDF5 (truncated or corrupt: {e}). "
                f"Save it again with model.save_weights('model.weights.h5') or model.save('model.keras')"
            ) from None
        try:
            self._version(path if raw is None else self.prefix, os.fstat(raw.fileno() if raw is not None
                                                                         else f.id.get_vfd_handle()))
            if path != self.prefix and self.prefix in self._versions:  # a shard: its index must be the same too
                self._version(self.prefix, _regular(self.prefix, True))
            if path not in self._contained:  # once per file: the walks check each dataset they open
                check_links(f, h5py, path)
                self._contained.add(path)
            yield f
        except (OSError, RuntimeError, KeyError, ValueError, RecursionError) as e:
            # h5py reports damage inside a file as any of these; a link cycle or deep nesting as RecursionError.
            if isinstance(e, RestoreKitError):
                raise
            raise CorruptCheckpointError(
                f"{path!r} is not a readable Keras file: its HDF5 structure is damaged "
                f"({type(e).__name__}: {e}). Save it again"
            ) from None
        finally:
            f.close()
            if raw is not None:
                raw.close()

    @cached_property
    def _versions(self) -> dict:
        return {}  # path -> identity of the version of it this checkpoint was made from

    @cached_property
    def _contained(self) -> set:
        return set()  # paths checked to hold no external links

    def _version(self, path: str, st: os.stat_result) -> None:
        """Note the version of ``path`` this checkpoint reads (the first time), or refuse another one: a file
        replaced (``save_in_place`` renames a new file over it) or rewritten since would mix two versions."""
        found = files.identity(st)
        if self._versions.setdefault(path, found) != found:
            raise CheckpointChangedError(
                f"{path!r} changed after {self.prefix!r} was opened (replaced or rewritten by another save?); "
                f"reading on would mix tensors of two versions. Open it again with restorekit.Checkpoint"
            )

    # -- structure
    def _walk(self, f) -> tuple[list, dict]:
        h5py = _h5py()
        if "model_weights" in f or attr_list(f, "layer_names") is not None:
            self.kind = "legacy Keras model file (HDF5)" if "model_weights" in f else "legacy Keras weights file (HDF5)"
            if self.config is None and "model_config" in f.attrs:
                self.config = json_attr(self.prefix, f.attrs["model_config"])
            check_contained(f, h5py, self.prefix)  # read_legacy opens datasets through h5py, unchecked
            return read_legacy(self.prefix, f, h5py)
        if isinstance(f.get("vars"), h5py.Group) or any(isinstance(f.get(c), h5py.Group) for c in CONTAINERS):
            self.kind = "Keras 3 archive (.keras)" if self._member is not None else "Keras 3 weights file (.weights.h5)"
            # Walked through low-level nodes: h5py's high-level objects cost more than the walk itself.
            walker = Keras3Walk(self.prefix, NODES, config_index(self.config))
            walker.visit(root(f, h5py, self.prefix), "", "", root=True)
            self.undecided = MappingProxyType(walker.undecided)  # see Keras3Walk; diff pairs them by the other side
            # Where the bytes lie is read now, from the datasets the walk has open: reopening each later costs more.
            standard: dict = {}
            self._walked_ranges = {d.key: _stored_range(h5py, walker.objects[d.key], d, standard)
                                   for d in walker.datasets}
            return walker.datasets, walker.readable
        top = format_names(sorted(f.keys()), 6) or "nothing"
        raise CorruptCheckpointError(
            f"{self.prefix!r} is an HDF5 file but not Keras weights (its top level holds {top}). restorekit reads "
            f"Keras 3 .weights.h5 and .keras files and legacy Keras 2 .h5 weights; pass one of those"
        )

    # -- mapping protocol: key -> KerasEntry
    @property
    def entries(self) -> Mapping[str, KerasEntry]:
        """Sorted mapping key in the file (``layers/dense/vars/0``) -> KerasEntry."""
        return self._entries

    def __repr__(self) -> str:
        return f"KerasCheckpoint({self.prefix!r}, {self.kind}, {len(self)} entries)"

    # -- readable paths (what scan matches by)
    @cached_property
    def object_graph(self):
        """An empty object graph: Keras files are matched by readable path, never by object position."""
        return decode_object_graph(_EMPTY_OBJECT_GRAPH)

    @property
    def object_paths(self) -> Mapping[str, str]:
        """Readable path -> key (``enc1/kernel`` -> ``layers/dense/vars/0``); see the module docstring."""
        return self._paths

    def readable_name(self, name: str) -> str:
        """The readable path of key ``name`` (the key itself when there is none)."""
        return self._readable.get(name, name)

    @cached_property
    def layer_variables(self) -> Mapping[str, list]:
        """Layer scope -> ``[(key, leaf, shape, dtype)]`` in the order the layer made them (Keras pairs by it)."""
        return MappingProxyType(layouts.layer_variables(list(self._data.values()), self._readable))

    @cached_property
    def cudnn_weights(self) -> Mapping[str, "layouts.CudnnWeight"]:
        """Key -> ``CudnnWeight`` for the weights of Keras 2 CuDNNLSTM / CuDNNGRU layers (legacy files only)."""
        legacy = not self.is_weights_file
        return MappingProxyType(layouts.cudnn_weights(self.layer_variables) if legacy else {})

    def is_partitioned(self, name: str) -> bool:
        """True: a Keras tensor is read through h5py, never copied as TF shard bytes (what writers ask this for)."""
        return True

    def stored_range(self, name: str) -> tuple[str, int, int] | None:
        """``(path, offset, size)`` of key (or readable path) ``name``'s bytes as they lie in this file, or None.

        Given only where the stored bytes are exactly the tensor's little-endian bytes: a
        contiguous dataset (no chunks, filters or external file) of a standard
        little-endian integer or IEEE float type (or Keras' 2-byte opaque bfloat16),
        allocated with exactly the entry's byte count. Chunked, compressed, big-endian,
        empty and unwritten datasets give None and are read through h5py. Inside a
        ``.keras`` archive the offset is the one in the archive. The ranges come from
        h5py's parse of the file's structure; HDF5 keeps no checksum of the data.

        Raises:
            NoMatchError: no such entry.
            CorruptCheckpointError: a dataset's bytes would run past the end of the file
                (of its member in a ``.keras`` archive).
        """
        key = self._key(name)
        if key not in self._data:
            raise self._unknown(name)
        found = self._stored_ranges.get(key)
        return None if found is None else (self._file_of(key), *found)

    def _by_file(self, keys) -> dict:
        """``{file: [keys it holds]}`` in the order of ``keys``: each file is opened once."""
        out: dict = {}
        for key in keys:
            out.setdefault(self._file_of(key), []).append(key)
        return out

    def _size_of(self, path: str) -> int:
        """Bytes available to the datasets of ``path`` (of the weights member in a ``.keras`` archive)."""
        return self._member[1] if self._member is not None else os.path.getsize(path)

    @cached_property
    def _stored_ranges(self) -> dict:
        """Key -> (offset, size) in its file of every dataset that ``stored_range`` describes."""
        h5py = _h5py()
        base = self._member[0] if self._member is not None else 0
        ranges: dict[str, tuple[int, int]] = {}
        standard: dict = {}
        for path, keys in self._by_file(self._data).items():
            limit = self._size_of(path)
            for key, found in self._ranges_in(h5py, path, keys, standard):
                if found is None:
                    continue
                offset, size = found
                if offset + size > limit:
                    where = "its model.weights.h5 member" if self._member is not None else "the file"
                    raise CorruptCheckpointError(
                        f"{path!r} is corrupt or truncated: dataset {key!r} claims bytes {offset}..{offset + size}, "
                        f"past the end of {where} ({limit} bytes); save the model's weights again"
                    )
                ranges[key] = (base + offset, size)
        return ranges

    def _ranges_in(self, h5py, path: str, keys: list, standard: dict) -> list:
        """``[(key, (offset, size) or None)]`` for ``keys`` in file ``path``: as the walk found them, or read now."""
        if self._walked_ranges is not None:
            return [(key, self._walked_ranges[key]) for key in keys]
        with self._h5(path) as f:
            return [(key, _stored_range(h5py, f.id, self._data[key], standard)) for key in keys]

    def bundle_entry(self, name: str):
        """The TF view of an entry (dtype code, shape) that the editor plans with; no shard, offset or crc."""
        from restorekit._bundle.format import dtype_enum
        from restorekit._bundle.protos import BundleEntry

        entry = self[name]
        return BundleEntry(dtype=dtype_enum(entry.dtype), shape=tuple(entry.shape), size=entry.nbytes)

    @property
    def is_archive(self) -> bool:
        """True for a ``.keras`` archive (its weights are the ``model.weights.h5`` member)."""
        return self._member is not None

    @property
    def is_weights_file(self) -> bool:
        """True for a Keras 3 weights layout (a ``.weights.h5``, or the weights inside a ``.keras``)."""
        return self.kind.startswith("Keras 3")

    def group_attrs(self) -> dict:
        """``{'<layer group>/vars': attributes}`` of every ``vars`` group (Keras stores the object's ``name`` there)."""
        h5py = _h5py()
        out = {}
        with self._h5() as f:
            def visit(name, obj):
                if isinstance(obj, h5py.Group) and name.rsplit("/", 1)[-1] == "vars" and len(obj.attrs):
                    out[name] = dict(obj.attrs)
            if isinstance(f.get("vars"), h5py.Group) and len(f["vars"].attrs):
                out["vars"] = dict(f["vars"].attrs)
            f.visititems(visit)
        return out

    def legacy_attrs(self) -> dict:
        """``{group: {attribute: value}}`` of a legacy Keras 2 file's root (``''``), its ``model_weights`` group,
        each group directly under the weights' root and ``optimizer_weights``; each value typed as stored
        (what ``_legacy_writer`` copies)."""
        h5py = _h5py()
        with self._h5() as f:
            root = "model_weights" if "model_weights" in f else ""
            base = f[root] if root else f
            paths = ["", root, *(f"{root}/{n}" if root else n for n, g in base.items() if isinstance(g, h5py.Group)),
                     *(["optimizer_weights"] if isinstance(f.get("optimizer_weights"), h5py.Group) else [])]
            return {p: {n: np.asarray(f[p or "/"].attrs[n], dtype=f[p or "/"].attrs.get_id(n).dtype)
                        for n in f[p or "/"].attrs} for p in dict.fromkeys(paths)}

    def check_shards(self) -> None:
        """Nothing to do: a Keras file is one file, and its datasets were checked when it was opened."""

    def check_crc(self, advance=None) -> None:
        """Check the weights member of a ``.keras`` archive against its zip CRC-32 (streamed; nothing for
        other files: HDF5 keeps no checksum of the data). Whole-file conversions call this before writing.

        Raises:
            ChecksumMismatchError: the member's bytes changed since Keras wrote them.
        """
        if self._member is not None:
            check_crc(self.prefix, "model.weights.h5", *self._member, self._member_crc, advance)

    def verify(self, *, progress: bool = False) -> VerifyResult:
        """Check the file as ``Checkpoint.verify`` checks a TF checkpoint, and list what is wrong.

        A ``.keras`` archive's weights member is checked against its zip CRC-32 (a
        'checksum' problem named ``model.weights.h5``); then every dataset is read back
        and checked against its declared shape ('corrupt' problems). HDF5 keeps no
        checksum of tensor data, so in a ``.weights.h5`` a changed data byte is not found.
        """
        from tqdm import tqdm

        problems, checked = [], 0
        total = (self._member[1] if self._member is not None else 0) + self.nbytes
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr,
                  disable=None if progress else True, leave=False) as bar:
            try:
                self.check_crc(bar.update)
            except CorruptCheckpointError as e:
                problems.append(Problem("model.weights.h5", "checksum", str(e)))
            for path, in_file in self._by_file(dict.fromkeys(self._data)).items():  # one file per shard of a set
                try:
                    with self._h5(path) as f:
                        for key in in_file:
                            data = self._data[key]
                            try:
                                self._read_one(f, data, path)
                                checked += data.nbytes
                            except CorruptCheckpointError as e:
                                problems.append(Problem(key, "corrupt", str(e)))
                            bar.update(data.nbytes)
                except CorruptCheckpointError as e:  # the HDF5 structure itself
                    problems.append(Problem(os.path.basename(path or self.prefix), "corrupt", str(e)))
        checks = ("verified means the model.weights.h5 member matches its zip CRC-32 and every dataset reads back "
                  "with its declared shape" if self._member is not None else
                  "HDF5 keeps no checksum of tensor data: verified means every dataset reads back with its declared "
                  "shape; a changed data byte is not found")
        return VerifyResult(self.prefix, len(self._data), checked, tuple(problems), checks)

    def _key(self, name: str) -> str:
        return name if name in self._entries else self._paths.get(name, name)

    _entry_key = _key  # ckpt['enc1/kernel'] takes a readable path too

    def _unknown(self, name: str) -> EntryNotFoundError:
        return EntryNotFoundError(
            f"{self.kind} {self.prefix!r} has no entry {name!r}.", name=name,
            candidates=list(self._entries) + list(self._paths),
        )

    # -- reads
    def read(self, name: str) -> np.ndarray:
        """The tensor stored under key (or readable path) ``name``, as a numpy array.

        Raises:
            NoMatchError: no such entry (lists the closest names).
            CorruptCheckpointError: the file cannot be read.
        """
        return self.read_many([name])[0]

    def read_many(self, names) -> list:
        """Several tensors, opening the file once; the order of ``names``."""
        keys = [self._key(n) for n in names]
        for name, key in zip(names, keys):
            if key not in self._data:
                raise self._unknown(name)
        values = {}
        for path, in_file in self._by_file(dict.fromkeys(keys)).items():
            with self._h5(path) as f:
                for key in in_file:
                    values[key] = self._read_one(f, self._data[key], path)
        return [values[k] for k in keys]

    def _read_one(self, f, data: Dataset, path: str) -> np.ndarray:
        # Keras never compresses: a tensor larger than the file is a damaged shape (or a bomb), refused before allocating.
        available = self._size_of(path)
        if data.nbytes > available:
            raise CorruptCheckpointError(
                f"{path!r}: {data.key!r} declares shape {list(data.shape)} of {data.dtype} ({data.nbytes} bytes), "
                f"more than the {available} bytes the file holds: the file is corrupt"
            )
        try:
            ds = f[data.key]
        except (OSError, KeyError, ValueError) as e:
            raise CorruptCheckpointError(f"{path!r}: cannot read {data.key!r} (truncated or corrupt: {e})") from None
        check_dataset(ds, _h5py(), data.key, path, bfloat16=data.bfloat16)
        try:
            value = np.asarray(ds[()])
        except (OSError, KeyError, ValueError) as e:
            raise CorruptCheckpointError(f"{path!r}: cannot read {data.key!r} (truncated or corrupt: {e})") from None
        if data.bfloat16:
            import ml_dtypes

            value = value.astype(ml_dtypes.bfloat16) if value.dtype.kind == "f" else value.view(ml_dtypes.bfloat16)
        if tuple(value.shape) != data.shape:
            raise CorruptCheckpointError(f"{path!r}: {data.key!r} has shape {value.shape}, not {data.shape}")
        return value


def _regular(path: str, known: bool) -> os.stat_result:
    """``os.stat`` of ``path``, refused unless a regular file (HDF5 would block on a FIFO, read a device without
    end); a file gone that this checkpoint has read before was replaced or removed since."""
    try:
        return files.stat_regular(path)
    except FileNotFoundError:
        if known:
            raise CheckpointChangedError(f"{path!r} was removed after it was opened (replaced by another save?); "
                                         f"open the checkpoint again") from None
        raise CheckpointNotFoundError(f"no Keras file at {path!r}", path) from None


def no_shared_layers_error(ckpt: KerasCheckpoint, variable_names) -> NoMatchError:
    """The error for a Keras file whose layers share no name with the model being restored."""
    live = list(dict.fromkeys(n.split("/")[-2] if n.count("/") >= 1 else n for n in variable_names))
    return NoMatchError(
        f"{ckpt.kind} {ckpt.prefix!r} has layers {format_names(ckpt.layer_names, 6)}, and none of them names a "
        f"layer of the model ({format_names(live, 6)}). restorekit pairs Keras layers by name, not by position: "
        f"name the layers as in the file, or map them with rules=[(r'^new_name/', 'old_name/')] or assignment_map=.",
        name=live[0] if live else None, candidates=ckpt.layer_names,
    )
