"""Sharded Keras 3 weights: a ``.weights.json`` index and its ``.weights.h5`` shards, read as one Keras file.

Layout (learned from Keras' ``saving_lib.ShardedH5IOStore``):
``model.save_weights('x.weights.json', max_shard_size=GB)`` writes the index
``x.weights.json`` and the shards ``x_00000.weights.h5``, ``x_00001.weights.h5``, ...
beside it. Each shard is a ``.weights.h5`` with part of the datasets under the same
groups as the unsharded file; one layer's ``vars`` group may be split over
consecutive shards (its ``name`` attribute goes with the first part). The index is
``{"metadata": {"total_size": ...}, "weight_map": {"/layers/dense/vars": SHARD or [SHARD, ...]}}``:
for every ``vars`` group that holds variables, the shard files that hold them.

The shards' structures are merged into one tree and walked like one ``.weights.h5``,
so keys and readable paths are the ones the unsharded file of the same model gives.
What is checked when the set is opened, before any tensor is read:

* a shard is named by a plain file name beside the index; a path (``../x.h5``,
  ``/abs.h5``, ``sub/x.h5``) is refused before any file is opened;
* every shard the index names exists and is a readable HDF5 file;
* every shard holds exactly the groups the index places in it, and no dataset is in
  two shards (a shard from another save of another model is refused). HDF5 keeps no
  checksums: a shard from another save of the *same* model, with the same split,
  cannot be told apart.
"""

from __future__ import annotations

import os
import re

import numpy as np

from restorekit._bundle import files
from restorekit._bundle.jsonfile import read_json
from restorekit.errors import CorruptCheckpointError, format_names
from restorekit.keras_files._reader import KerasCheckpoint, _h5py
from restorekit.keras_files._h5nodes import check_storage
from restorekit.keras_files._layouts import CONTAINERS, Keras3Walk
from restorekit.keras_files._memtree import Group, sorted_tree, tree_types

__all__ = ["ShardedKerasCheckpoint"]

_DRIVE = re.compile(r"^[A-Za-z]:")


class _Stub:
    """What the walk reads of a dataset (shape, dtype, the ``dtype`` attribute), without the open file."""

    def __init__(self, ds):
        self.shape = ds.shape
        self.dtype = ds.dtype
        self.attrs = {"dtype": ds.attrs["dtype"]} if "dtype" in ds.attrs else {}


# Keras3Walk tells groups from datasets by these types; over the merged tree they are ours.
_TREE = tree_types(_Stub)


class ShardedKerasCheckpoint(KerasCheckpoint):
    """A sharded Keras 3 weights set (``x.weights.json`` + shards) as one ``KerasCheckpoint``.

    Made by ``restorekit.Checkpoint('x.weights.json')``. Keys and readable paths are
    those of the unsharded ``.weights.h5``; ``read`` opens only the shards it needs;
    ``stored_range`` gives the shard file holding a dataset.

    Raises:
        CheckpointNotFoundError: no index at the path.
        CorruptCheckpointError: the index is not valid JSON or not a Keras shard index,
            names a shard outside its folder, a shard is missing or unreadable, or a
            shard's datasets are not where the index places them.
    """

    def __init__(self, path):
        self.prefix = os.fspath(path)
        self.config = None
        self.metadata = None
        self._member = None
        self.kind = "Keras 3 sharded weights (.weights.json)"
        placed = self._read_index()
        folder = os.path.dirname(os.path.abspath(self.prefix))
        names = list(dict.fromkeys(name for shards in placed.values() for name in shards))
        self._shards = tuple(os.path.join(folder, name) for name in names)
        self.check_shards()
        h5py = _h5py()
        held: dict[str, set] = {}
        self._root, self._where = Group(), {}
        for shard in self._shards:
            with self._h5(shard) as f:
                self._merge(h5py, f, shard, held)
        self._check_placement(placed, held)
        self._root = sorted_tree(self._root)
        if self._shards and not (isinstance(self._root.get("vars"), Group)
                                 or any(isinstance(self._root.get(c), Group) for c in CONTAINERS)):
            raise CorruptCheckpointError(
                f"{self.prefix!r}: its shards are HDF5 files but not Keras 3 weights (their top level holds "
                f"{format_names(sorted(self._root), 6) or 'nothing'}); save the model with model.save_weights"
            )
        walker = Keras3Walk(self.prefix, _TREE, {})
        walker.visit(self._root, "", "", root=True)
        self._index(walker.datasets, walker.readable)

    # -- the index
    def _read_index(self) -> dict:
        """``{'/group/vars': [shard name, ...]}`` from the index, every shard name checked to be a plain file name."""
        index, st = read_json(self.prefix, "Keras sharded weights index")
        self._version(self.prefix, st)  # what every later read checks the index against
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise self._not_an_index("it has no 'weight_map' object")
        placed = {}
        for group, shards in weight_map.items():
            shards = [shards] if isinstance(shards, str) else shards
            if not isinstance(shards, list) or not shards or not all(isinstance(s, str) for s in shards):
                raise self._not_an_index(f"its weight_map gives {group!r} {shards!r}, not a shard file name or list")
            for name in shards:
                self._check_name(name)
            placed[group] = list(dict.fromkeys(shards))
        return placed

    def _not_an_index(self, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.prefix!r} is not a Keras sharded weights index ({why}); Keras writes one with "
            f"model.save_weights('model.weights.json', max_shard_size=...)"
        )

    def _check_name(self, name: str) -> None:
        parts = name.replace("\\", "/").split("/")
        if len(parts) != 1 or name in ("", ".", "..") or "\x00" in name or _DRIVE.match(name) or os.path.isabs(name):
            raise CorruptCheckpointError(
                f"{self.prefix!r} names shard {name!r}, which is not a file beside the index; Keras writes plain "
                f"file names. Refused without opening it: get the weights from a trusted source"
            )

    # -- the shards
    @property
    def files(self) -> tuple[str, ...]:
        """The index and every shard it names."""
        return (self.prefix, *self._shards)

    def _file_of(self, key: str) -> str:
        return self._where[key]

    def shard_of(self, name: str) -> str:
        """The shard file holding key (or readable path) ``name``.

        Raises:
            NoMatchError: no such entry.
        """
        key = self._key(name)
        if key not in self._where:
            raise self._unknown(name)
        return self._where[key]

    def check_shards(self) -> None:
        """Check that every shard the index names is still a regular file (one ``stat`` each, no reads).

        Raises:
            CorruptCheckpointError: a shard is missing, or a FIFO, device or directory.
        """
        for shard in self._shards:
            try:
                files.stat_regular(shard)
            except OSError:
                raise CorruptCheckpointError(
                    f"shard {os.path.basename(shard)!r} of {self.prefix!r} is missing (expected at {shard!r}); "
                    f"copy every file the index names, or save the weights again"
                ) from None

    def _merge(self, h5py, f, shard: str, held: dict) -> None:
        """Add one shard's groups and datasets to the merged tree; note which groups hold datasets here."""
        name_of_shard = os.path.basename(shard)

        def visit(name: str, obj) -> None:
            *parents, last = name.split("/")
            parent = self._root
            for part in parents:
                parent = parent.setdefault(part, Group())
                if not isinstance(parent, Group):
                    raise self._mismatch(f"{name!r} lies under a dataset of another shard", shard)
            if isinstance(obj, h5py.Dataset):
                check_storage(obj.id.get_create_plist(), h5py, name, shard)  # before _Stub asks its shape
                if last in parent:
                    raise self._mismatch(f"{name!r} is also in {os.path.basename(self._where.get(name, '?'))!r}", shard)
                try:
                    parent[last] = _Stub(obj)
                except TypeError as e:  # a datatype numpy does not know
                    raise CorruptCheckpointError(f"{shard!r}: {name!r} has a datatype numpy does not know ({e})") from None
                self._where[name] = shard
                held.setdefault("/" + "/".join(parents), set()).add(name_of_shard)
                return
            group = parent.setdefault(last, Group())
            if not isinstance(group, Group):
                raise self._mismatch(f"{name!r} is a group here and a dataset in another shard", shard)
            for key, value in obj.attrs.items():
                if key in group.attrs and not _same(group.attrs[key], value):
                    raise self._mismatch(f"{name!r} is named {value!r} here and {group.attrs[key]!r} in another shard",
                                         shard)
                group.attrs[key] = value

        f.visititems(visit)

    def _check_placement(self, placed: dict, held: dict) -> None:
        """Every group's datasets lie in exactly the shards the index places them in."""
        for group in sorted(set(placed) | set(held)):
            expected, found = set(placed.get(group, ())), held.get(group, set())
            unlisted, empty = sorted(found - expected), sorted(expected - found)
            if unlisted:
                where = format_names(sorted(expected)) or "no shard"
                raise self._mismatch(f"it holds variables of {group!r}, which the index places in {where}", unlisted[0])
            if empty:
                raise self._mismatch(f"the index places variables of {group!r} in it, and it holds none", empty[0])

    def _mismatch(self, why: str, shard: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"shard {os.path.basename(shard)!r} does not match the index {self.prefix!r}: {why}. It is from another "
            f"save (or the index is); copy the index and its shards from one save, or save the weights again"
        )

    def group_attrs(self) -> dict:
        """``{'<layer group>/vars': attributes}`` of every ``vars`` group, merged over the shards."""
        out: dict = {}
        stack = [("", self._root)]
        while stack:
            key, group = stack.pop()
            for name, child in group.items():
                if isinstance(child, Group):
                    child_key = f"{key}/{name}" if key else name
                    if name == "vars" and child.attrs:
                        out[child_key] = dict(child.attrs)
                    stack.append((child_key, child))
        return out


def _same(a, b) -> bool:
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except (TypeError, ValueError):
        return False
