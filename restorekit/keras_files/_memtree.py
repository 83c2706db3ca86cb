"""An in-memory tree that ``Keras3Walk`` reads as it reads an HDF5 file: groups by name with attributes.

A sharded set's shards merged into one tree, and a Keras file's structure rebuilt from
its entries with renamed layers, are walked this way; each caller supplies the leaf
type that stands for a dataset (``shape``, ``dtype``, ``attrs``).
"""

from __future__ import annotations

from types import SimpleNamespace

__all__ = ["Group", "node", "sorted_tree", "tree_types"]


class Group(dict):
    """A group: children by name, plus the group's attributes."""

    def __init__(self):
        super().__init__()
        self.attrs: dict = {}


def node(root: Group, path: str) -> Group:
    """The group at ``path`` ('a/b') under ``root``, created with its parents where missing."""
    group = root
    for part in path.split("/") if path else ():
        group = group.setdefault(part, Group())
    return group


def sorted_tree(group: Group) -> Group:
    """The tree with children in name order, the order h5py lists one file's members in."""
    out = Group()
    out.attrs = group.attrs
    for name in sorted(group):
        child = group[name]
        out[name] = sorted_tree(child) if isinstance(child, Group) else child
    return out


def tree_types(leaf: type) -> SimpleNamespace:
    """What ``Keras3Walk`` takes for h5py: it tells groups from datasets by these types."""
    return SimpleNamespace(Group=Group, Dataset=leaf)
