"""The low-level nodes the Keras 3 walk reads files through (restorekit/keras_files/_h5nodes.py) answer as h5py's
high-level Group and Dataset do: member order, links, attributes, shapes, dtypes and missing members."""

import h5py
import numpy as np
import pytest

from restorekit.keras_files._h5nodes import NODES, root


@pytest.fixture
def h5file(tmp_path):
    path = tmp_path / "nodes.h5"
    with h5py.File(path, "w") as f:
        plain = f.create_group("plain")
        tracked = f.create_group("tracked", track_order=True)
        for group in (plain, tracked):
            for name in ("b", "a", "10", "2", "é"):
                group.create_group(name)
        vars_group = f.create_group("layers/dense/vars")
        vars_group.attrs["name"] = "enc1"
        vars_group.create_dataset("0", data=np.ones((4, 3), "<f4"))
        half = vars_group.create_dataset("1", data=np.zeros(3, "<u2"))
        half.attrs["dtype"] = "bfloat16"
        f["layers/dense/alias"] = h5py.SoftLink("/layers/dense/vars")
        f["layers/dense/dangling"] = h5py.SoftLink("/nowhere")
        f["layers/dense/kind"] = np.dtype("<f8")  # a named datatype
        f.create_group("empty")
    with h5py.File(path, "r") as f:
        yield f


def test_members_come_in_h5py_order_by_name_or_by_creation_where_tracked(h5file):
    nodes = root(h5file, h5py)
    for group in ("plain", "tracked", "layers/dense", "empty", "layers/dense/vars"):
        node = nodes
        for part in group.split("/"):
            node = node[part]
        assert list(node) == list(h5file[group]), group
    assert list(nodes["tracked"]) == ["b", "a", "10", "2", "é"]


def test_links_and_kinds_resolve_as_in_h5py(h5file):
    dense = root(h5file, h5py)["layers"]["dense"]
    assert isinstance(dense["alias"], NODES.Group) and list(dense["alias"]) == ["0", "1"]  # a soft link, followed
    assert dense.get("dangling") is None and h5file["layers/dense"].get("dangling") is None
    assert dense.get("missing") is None
    with pytest.raises(KeyError, match="doesn't exist"):
        dense["missing"]
    kind = dense["kind"]
    assert not isinstance(kind, (NODES.Group, NODES.Dataset))  # a named datatype is neither
    assert [name for name, child in dense.items() if child is None] == ["dangling"]


def test_datasets_and_attributes_read_as_in_h5py(h5file):
    vars_node = root(h5file, h5py)["layers"]["dense"]["vars"]
    assert vars_node.attrs.get("name") == h5file["layers/dense/vars"].attrs.get("name") == "enc1"
    assert vars_node.attrs.get("nothing") is None and vars_node.attrs.get("nothing", 5) == 5
    for name in ("0", "1"):
        node, ds = vars_node[name], h5file["layers/dense/vars"][name]
        assert isinstance(node, NODES.Dataset)
        assert node.shape == ds.shape and node.dtype == ds.dtype
        assert node.attrs.get("dtype") == ds.attrs.get("dtype")
    assert vars_node["1"].attrs.get("dtype") == "bfloat16"
    assert vars_node["0"] is vars_node["0"]  # each member is opened once
