"""compare.files: safetensors, PyTorch and npz files (written by their own libraries, and by restorekit) opened
as checkpoints, read back, verified; damaged ones refused or reported."""

import struct
import zipfile

import numpy as np
import pytest
import tensorflow as tf

from conftest import requires_torch
from restorekit._compare import diff_checkpoints, open_checkpoint
from restorekit._compare.files import FileView
from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError, NoMatchError
from restorekit.export import convert

VALUES = {"dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "dense/bias": np.array([1, -2, 3], np.int64)}


def _safetensors(path):
    import safetensors.numpy

    safetensors.numpy.save_file(VALUES, str(path))


def _torch(path):
    import torch

    torch.save({k: torch.from_numpy(v) for k, v in VALUES.items()}, path)


def _npz(path):
    np.savez(path, **VALUES)


WRITERS = {"m.safetensors": _safetensors, "m.pt": _torch, "m.npz": _npz}


@pytest.mark.parametrize("name", [pytest.param("m.safetensors", id="safetensors_save_file"),
                                  pytest.param("m.pt", id="torch_save", marks=requires_torch),
                                  pytest.param("m.npz", id="np_savez")])
def test_a_file_written_by_its_own_library_reads_as_a_checkpoint(tmp_path, name):
    WRITERS[name](tmp_path / name)
    ckpt = open_checkpoint(tmp_path / name)
    assert isinstance(ckpt, FileView) and ckpt.format == {"m.safetensors": "safetensors", "m.pt": "torch",
                                                          "m.npz": "npz"}[name]
    assert sorted(ckpt.entries) == sorted(VALUES) and not ckpt.is_object_based
    assert ckpt.entries["dense/kernel"].shape == (3, 4) and ckpt.entries["dense/kernel"].dtype == "float32"
    assert ckpt.entries["dense/bias"].dtype == "int64" and ckpt.entries["dense/bias"].nbytes == 24
    for key, value in VALUES.items():
        np.testing.assert_array_equal(ckpt.read(key), value)
        assert ckpt.readable_name(key) == key
    with pytest.raises(NoMatchError, match="dense/kernal"):
        ckpt.read("dense/kernal")
    result = ckpt.verify()
    assert result.ok and result.tensors == 2 and "checksum" in str(result)


@pytest.fixture(scope="module")
def tf2_checkpoint(tmp_path_factory):
    """A TF2 object-based checkpoint (a tf.Module with a 3x4 kernel, a bias, a complex and a bfloat16 tensor)."""
    root = tf.Module()
    root.dense = tf.Module()
    root.dense.kernel = tf.Variable(np.arange(12, dtype=np.float32).reshape(3, 4))
    root.dense.bias = tf.Variable(np.array([0.5, -1.5, 2.5, 4.0], np.float32))
    root.phase = tf.Variable(np.array([1 + 2j, -3j], np.complex128))
    root.half = tf.Variable(tf.constant([1.5, -2.0], tf.bfloat16))
    return tf.train.Checkpoint(root=root).write(str(tmp_path_factory.mktemp("tf2") / "ckpt"))


@pytest.mark.parametrize("out,layout", [pytest.param("c.safetensors", None, id="safetensors"),
                                        pytest.param("c.pt", None, id="torch", marks=requires_torch),
                                        pytest.param("c.npz", None, id="npz"),
                                        pytest.param("t.safetensors", "torch", id="safetensors_layout_torch")])
def test_a_conversion_reads_back_as_its_tf_checkpoint_and_diffs_equal(tmp_path, tf2_checkpoint, out, layout):
    convert(tf2_checkpoint, tmp_path / out, layout=layout)
    view = open_checkpoint(tmp_path / out)
    assert view.is_object_based and view.record_layout == layout
    assert view.object_paths["dense/kernel"] == "dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    np.testing.assert_array_equal(view.read(view.object_paths["dense/kernel"]),
                                  np.arange(12, dtype=np.float32).reshape(3, 4))
    result = diff_checkpoints(tf2_checkpoint, tmp_path / out)
    assert result["equal"] and result["paired_by"] == "key" and result["same"] == 5  # 4 variables + the object graph
    assert view.verify().ok


def test_a_sharded_safetensors_set_reads_through_its_index(tmp_path, tf2_checkpoint):
    convert(tf2_checkpoint, tmp_path / "out", to="safetensors", max_shard_size=60)
    [index] = list((tmp_path / "out").glob("*.index.json"))
    view = open_checkpoint(index)
    assert len(view._reader.files) > 2  # several shards and the index
    assert diff_checkpoints(tf2_checkpoint, index)["equal"]
    assert diff_checkpoints(tf2_checkpoint, tmp_path / "out")["equal"]  # the directory too
    assert view.verify().ok


def test_a_changed_value_in_a_conversion_is_reported(tmp_path, tf2_checkpoint):
    convert(tf2_checkpoint, tmp_path / "c.npz")
    with np.load(tmp_path / "c.npz") as data:
        arrays = {k: data[k] for k in data.files}
    key = "dense/bias/.ATTRIBUTES/VARIABLE_VALUE"
    arrays[key] = arrays[key] + np.float32(0.125)
    np.savez(tmp_path / "d.npz", **arrays)
    result = diff_checkpoints(tf2_checkpoint, tmp_path / "d.npz")
    assert not result["equal"] and result["same"] == 4
    assert result["values"] == [{"name": key, "max_abs_diff": 0.125, "differing": 4}]


# ------------------------------------------------------------------ damaged files

def test_a_truncated_safetensors_file_is_refused(tmp_path):
    _safetensors(tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-5])
    with pytest.raises(CorruptCheckpointError, match="'.*cut.safetensors' is not a valid safetensors file"):
        open_checkpoint(tmp_path / "cut.safetensors")


@requires_torch
def test_a_zip_that_is_not_a_torch_file_is_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / "m.pt", "w") as archive:
        archive.writestr("notes.txt", "not weights")
    with pytest.raises(CorruptCheckpointError, match="m.pt"):
        open_checkpoint(tmp_path / "m.pt")


def test_a_missing_file_is_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no file at"):
        open_checkpoint(tmp_path / "absent.safetensors")


def _flip_in_member(path, member_suffix, at=2):
    """Flip one byte of a stored zip member's data (its CRC-32 in the directory stays the old one)."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(member_suffix))
    data = bytearray(open(path, "rb").read())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + at] ^= 0xFF
    open(path, "wb").write(bytes(data))


@requires_torch
def test_verify_reports_a_torch_record_failing_its_zip_crc(tmp_path):
    _torch(tmp_path / "m.pt")
    _flip_in_member(tmp_path / "m.pt", "data/0")
    result = open_checkpoint(tmp_path / "m.pt").verify()
    assert not result.ok and len(result.problems) == 1
    assert "fails its CRC-32" in result.problems[0].message


def test_an_npz_member_failing_its_crc_is_refused_on_opening(tmp_path):
    """Listing an npz reads it through once (its exact dtypes live in the reader's notes): damage shows there."""
    _npz(tmp_path / "m.npz")
    _flip_in_member(tmp_path / "m.npz", "dense/kernel.npy", at=130)  # past the 128-byte .npy header
    with pytest.raises(CorruptCheckpointError, match="Bad CRC-32 for file 'dense/kernel.npy'"):
        open_checkpoint(tmp_path / "m.npz")


def test_verify_reads_one_tensor_at_a_time(tmp_path):
    import tracemalloc

    import safetensors.numpy

    tensors = {f"t{i}": np.full((512, 1024), i, np.float32) for i in range(12)}  # 2 MiB each, 24 MiB in all
    safetensors.numpy.save_file(tensors, str(tmp_path / "big.safetensors"))
    del tensors
    view = open_checkpoint(tmp_path / "big.safetensors")
    tracemalloc.start()
    try:
        result = view.verify()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.ok and result.tensors == 12
    assert peak < 8 << 20


@requires_torch
def test_a_foreign_pt_and_restorekits_torch_layout_conversion_of_it_pair_every_tensor(tmp_path):
    """A torch-layout export read back undoes its record (TF names); beside a foreign .pt it is read as stored."""
    import torch
    from torch import nn

    class ScaleShift(nn.Module):  # a [1, 16] scale beside a [16] shift: no Linear, kept as it is
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(1, 16)), nn.Parameter(torch.randn(16))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.rnn = nn.Conv1d(1, 8, 3), nn.BatchNorm1d(8), nn.LSTM(8, 16)
            self.layernorm, self.proj, self.head = ScaleShift(), nn.Linear(16, 4, bias=False), nn.Linear(4, 2)

    torch.manual_seed(0)
    net = Net()
    net.bn.running_mean.normal_()
    net.bn.num_batches_tracked.fill_(7)
    torch.save(net.state_dict(), tmp_path / "f.pt")
    assert len(net.state_dict()) == 16
    with pytest.warns(UserWarning):  # the guessed names are warned about (no record in a foreign file)
        convert(tmp_path / "f.pt", tmp_path / "g.safetensors", layout="torch")
    assert open_checkpoint(tmp_path / "g.safetensors").record_layout == "torch"
    for a, b, side in (("f.pt", "g.safetensors", "b"), ("g.safetensors", "f.pt", "a")):
        d = diff_checkpoints(tmp_path / a, tmp_path / b)
        assert d["equal"] and d["same"] == 16 and d["as_stored"] == side, d
    # a changed tensor is still told
    state = net.state_dict()
    state["head.bias"] = state["head.bias"] + 1
    torch.save(state, tmp_path / "h.pt")
    d = diff_checkpoints(tmp_path / "h.pt", tmp_path / "g.safetensors")
    assert not d["equal"] and d["same"] == 15 and [v["name"] for v in d["values"]] == ["head.bias"], d
