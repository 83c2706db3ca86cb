"""Reads of Keras files stay inside the file they are given (restorekit/keras_files, h5nodes.py).

Hand-built HDF5 files (h5py): external storage, external links and virtual datasets are
refused by name before anything is read from the other file (the other file is a FIFO
that records whether anything opened it); FIFOs and devices in place of a file are refused; a file replaced or
rewritten under an open KerasCheckpoint raises on the next read; dataset types no Keras
weight has are refused at read and verify with the dataset's name.
"""

import io
import json
import os
import zipfile
from contextlib import redirect_stderr, redirect_stdout

import h5py
import numpy as np
import pytest

import restorekit
from restorekit.cli import main
from restorekit.errors import CheckpointChangedError, CorruptCheckpointError, ExternalDataError

KERNEL = np.arange(6, dtype="<f4").reshape(2, 3)
BIAS = np.array([1, 2, 3], dtype="<f4")


def _weights(path, fill=None, *, kernel=KERNEL):
    """A Keras 3 ``.weights.h5`` with one dense layer; ``fill(vars_group, file)`` adds or replaces ``vars/0``."""
    with h5py.File(path, "w") as f:
        v = f.create_group("layers/dense/vars")
        v.attrs["name"] = "dense"
        if fill is None:
            v["0"] = kernel
        else:
            fill(v, f)
        v["1"] = BIAS
    return str(path)


def _legacy(path, fill):
    """A legacy Keras 2 weights ``.h5`` whose one weight is made by ``fill(layer_group, file)``."""
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = [b"dense"]
        g = f.create_group("dense")
        g.attrs["weight_names"] = [b"kernel:0"]
        fill(g, f)
    return str(path)


def _archive(path, weights):
    """A ``.keras`` zip holding ``weights`` as its stored model.weights.h5."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("config.json", json.dumps({"class_name": "Sequential", "config": {"name": "s", "layers": []}}))
        z.writestr("metadata.json", "{}")
        z.write(weights, "model.weights.h5")
    return str(path)


def _sharded(folder, fill):
    """A sharded Keras set: index ``m.weights.json`` and one shard ``m_00000.weights.h5`` made by ``_weights``."""
    _weights(folder / "m_00000.weights.h5", fill)
    index = folder / "m.weights.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"/layers/dense/vars": "m_00000.weights.h5"}}))
    return str(index)


def _external_storage(fifo):
    def fill(v, f):
        v.create_dataset("0", shape=(2, 3), dtype="<f4", external=[(fifo, 0, 24)])
    return fill


def _external_link(fifo):
    def fill(v, f):
        v["0"] = h5py.ExternalLink(fifo, "/x")
    return fill


def _virtual(fifo):
    def fill(v, f):
        layout = h5py.VirtualLayout(shape=(2, 3), dtype="<f4")
        layout[:] = h5py.VirtualSource(fifo, "x", shape=(2, 3))
        v.create_virtual_dataset("0", layout)
    return fill


FOREIGN = {"external-storage": (_external_storage, "external file"),
           "external-link": (_external_link, "external link"),
           "virtual-dataset": (_virtual, "virtual dataset")}


def _build(tmp_path, container, fill):
    if container == "weights.h5":
        return _weights(tmp_path / "m.weights.h5", fill)
    if container == "keras":
        return _archive(tmp_path / "m.keras", _weights(tmp_path / "inner.h5", fill))
    if container == "legacy-h5":
        def legacy_fill(g, f):  # the weight in the layer group, under its Keras 2 name
            holder = g.create_group("tmp")
            fill(holder, f)
            g.move("tmp/0", "kernel:0")
        return _legacy(tmp_path / "m.h5", legacy_fill)
    (tmp_path / "set").mkdir()
    return _sharded(tmp_path / "set", fill)


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("container", ["weights.h5", "keras", "legacy-h5", "sharded"])
@pytest.mark.parametrize("kind", list(FOREIGN))
def test_data_in_another_file_is_refused_by_name_before_it_is_read(tmp_path, fifo, kind, container):
    make, words = FOREIGN[kind]
    path = _build(tmp_path, container, make(fifo.path))
    with pytest.raises(ExternalDataError, match=words) as caught:
        restorekit.Checkpoint(path)
    assert "elsewhere.fifo" in str(caught.value) and "0" in str(caught.value)
    assert isinstance(caught.value, CorruptCheckpointError)
    out = tmp_path / "out.safetensors"
    for argv in (["inspect", path], ["inspect", "--stats", path], ["verify", path], ["convert", path, str(out)]):
        code, text = _cli(*argv)
        assert code == 3 and words in text and "elsewhere.fifo" in text, (argv, text)
    assert not out.exists()


def test_a_soft_link_inside_the_file_still_reads(tmp_path):
    def fill(v, f):
        f["stored/kernel"] = KERNEL
        v["0"] = h5py.SoftLink("/stored/kernel")
    ckpt = restorekit.Checkpoint(_weights(tmp_path / "m.weights.h5", fill))
    np.testing.assert_array_equal(ckpt.read("layers/dense/vars/0"), KERNEL)


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras", "m.h5", "m.weights.json"])
def test_a_fifo_or_device_in_place_of_the_file_is_refused(tmp_path, special, name):
    path = tmp_path / name
    if special == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    with pytest.raises(CorruptCheckpointError, match="FIFO|character device"):
        restorekit.Checkpoint(path)


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_a_fifo_or_device_in_place_of_a_shard_is_refused(tmp_path, special):
    index = _sharded(tmp_path, None)
    os.remove(tmp_path / "m_00000.weights.h5")
    if special == "fifo":
        os.mkfifo(tmp_path / "m_00000.weights.h5")
    else:
        os.symlink("/dev/zero", tmp_path / "m_00000.weights.h5")
    with pytest.raises(CorruptCheckpointError, match="FIFO|character device"):
        restorekit.Checkpoint(index)


# ------------------------------------------------------------------ one version of a file per checkpoint


def test_a_weights_file_replaced_under_an_open_checkpoint_raises_on_the_next_read(tmp_path):
    path = _weights(tmp_path / "m.weights.h5")
    ckpt = restorekit.Checkpoint(path)
    np.testing.assert_array_equal(ckpt.read("dense/kernel"), KERNEL)
    np.testing.assert_array_equal(ckpt.read("dense/kernel"), KERNEL)  # the same version reads again
    # what save_in_place does: a new file, complete, renamed over the old one
    os.replace(_weights(tmp_path / "new.weights.h5", kernel=KERNEL + 100), path)
    with pytest.raises(CheckpointChangedError, match="changed after"):
        ckpt.read("dense/kernel")
    with pytest.raises(CheckpointChangedError):
        ckpt.read_many(["dense/kernel", "dense/bias"])
    assert not ckpt.verify().ok
    np.testing.assert_array_equal(restorekit.Checkpoint(path).read("dense/kernel"), KERNEL + 100)


def test_a_weights_file_rewritten_in_place_under_an_open_checkpoint_raises(tmp_path):
    path = _weights(tmp_path / "m.weights.h5")
    ckpt = restorekit.Checkpoint(path)
    inode = os.stat(path).st_ino
    _weights(path, kernel=np.zeros((2, 3), "f4"))  # h5py truncates and rewrites the same file
    assert os.stat(path).st_ino == inode
    with pytest.raises(CheckpointChangedError):
        ckpt.read("dense/kernel")


def test_a_keras_archive_replaced_under_an_open_checkpoint_raises(tmp_path):
    path = _archive(tmp_path / "m.keras", _weights(tmp_path / "a.h5"))
    ckpt = restorekit.Checkpoint(path)
    np.testing.assert_array_equal(ckpt.read("layers/dense/vars/0"), KERNEL)
    os.replace(_archive(tmp_path / "n.keras", _weights(tmp_path / "b.h5", kernel=KERNEL * 2)), path)
    with pytest.raises(CheckpointChangedError):
        ckpt.read("layers/dense/vars/0")


@pytest.mark.parametrize("replaced", ["the-shard", "the-index", "the-shard-removed"])
def test_a_sharded_set_changed_under_an_open_checkpoint_raises(tmp_path, replaced):
    index = _sharded(tmp_path, None)
    ckpt = restorekit.Checkpoint(index)
    np.testing.assert_array_equal(ckpt.read("dense/kernel"), KERNEL)
    shard = tmp_path / "m_00000.weights.h5"
    if replaced == "the-shard":
        os.replace(_weights(tmp_path / "n.h5", kernel=KERNEL - 1), shard)
    elif replaced == "the-index":
        new = tmp_path / "n.json"
        new.write_text(json.dumps({"metadata": {"x": 1}, "weight_map": {"/layers/dense/vars": "m_00000.weights.h5"}}))
        os.replace(new, index)
    else:
        os.remove(shard)
    with pytest.raises(CheckpointChangedError):
        ckpt.read("dense/kernel")


# ------------------------------------------------------------------ dataset types no Keras weight has


def _compound(v, f):
    v["0"] = np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")])


def _null(v, f):
    v.create_dataset("0", data=h5py.Empty("<f4"))


def _object_refs(v, f):
    v.create_dataset("0", data=np.array([f.ref, f.ref]), dtype=h5py.ref_dtype)


def _region_refs(v, f):
    target = f.create_dataset("target", data=np.ones(4, "f4"))
    v.create_dataset("0", data=np.array([target.regionref[0:2]] * 2), dtype=h5py.regionref_dtype)


@pytest.mark.parametrize("fill, words", [
    (_compound, "compound type"), (_null, "null dataspace"), (_object_refs, "object references"),
    (_region_refs, "region references"),
], ids=["compound", "null-dataspace", "object-references", "region-references"])
def test_a_dataset_type_no_keras_weight_has_is_refused_by_name(tmp_path, fill, words):
    path = _weights(tmp_path / "m.weights.h5", fill)
    ckpt = restorekit.Checkpoint(path)
    result = ckpt.verify()
    assert [(p.name, p.kind) for p in result.problems] == [("layers/dense/vars/0", "corrupt")]
    assert words in result.problems[0].message
    with pytest.raises(CorruptCheckpointError, match=f"'layers/dense/vars/0' {words}|{words}"):
        ckpt.read("layers/dense/vars/0")
    np.testing.assert_array_equal(ckpt.read("layers/dense/vars/1"), BIAS)  # the others still read
    out = tmp_path / "out.safetensors"
    for argv in (["inspect", "--stats", path], ["convert", path, str(out)]):
        code, text = _cli(*argv)
        assert code == 3 and "layers/dense/vars/0" in text and words in text, (argv, text)
    assert not out.exists()



# ------------------------------------------------------------------ the shard index is read bounded (bundle/jsonfile.py)


def test_a_keras_shard_index_larger_than_any_index_is_refused_before_it_is_read(tmp_path):
    index = _sharded(tmp_path, None)
    with open(index, "r+b") as f:
        f.truncate(300 << 20)  # sparse: 300 MB long, no disk used
    with pytest.raises(CorruptCheckpointError, match=f"{300 << 20} bytes, more than the {64 << 20}"):
        restorekit.Checkpoint(index)


@pytest.mark.parametrize("depth", [100, 100_000], ids=["deeper-than-an-index", "deeper-than-python"])
def test_a_deeply_nested_keras_shard_index_is_a_restorekit_error(tmp_path, depth):
    index = _sharded(tmp_path, None)
    nested = "[" * depth + "]" * depth
    with open(index, "w") as f:
        f.write('{"metadata": {"x": ' + nested + '}, "weight_map": {"/layers/dense/vars": "m_00000.weights.h5"}}')
    with pytest.raises(CorruptCheckpointError, match="nests"):
        restorekit.Checkpoint(index)
