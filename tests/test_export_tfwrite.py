"""restorekit/formats/tf/_writer.py: imports into TF checkpoints over several data shards (num_shards=)."""

import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import requires_torch
from restorekit._checkpoint import Checkpoint
from restorekit.cli import main
from restorekit.errors import InvalidArgumentError
from restorekit.export import convert, import_checkpoint

VALUES = {f"layer{i}/kernel": np.arange(i * 40, (i + 1) * 40 + 8 * i, dtype=np.float32) for i in range(7)}
VALUES["step"] = np.int64(7)


def _source(tmp_path, kind):
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    src.mkdir()
    arrays = {n: np.asarray(v) for n, v in VALUES.items()}
    if kind == "safetensors":
        save_file(arrays, str(src / "model.safetensors"))
        return src / "model.safetensors"
    if kind == "hf-shards":
        names = sorted(arrays)
        save_file({n: arrays[n] for n in names[:4]}, str(src / "model-00001-of-00002.safetensors"))
        save_file({n: arrays[n] for n in names[4:]}, str(src / "model-00002-of-00002.safetensors"))
        return src
    if kind == "npz":
        np.savez(src / "model.npz", **arrays)
        return src / "model.npz"
    import torch  # the "pt" case is marked requires_torch

    torch.save({n: torch.from_numpy(np.array(a)) for n, a in arrays.items()}, str(src / "model.pt"))
    return src / "model.pt"


@pytest.mark.parametrize("kind", ["safetensors", "hf-shards", "npz", pytest.param("pt", marks=requires_torch)])
def test_an_import_writes_n_data_shards_balanced_by_bytes_that_tf_reads(tmp_path, kind):
    out = str(tmp_path / "out" / "model.ckpt")
    convert(_source(tmp_path, kind), out, num_shards=3)
    assert Checkpoint(out).header.num_shards == 3
    reader = tf.train.load_checkpoint(out)
    for name, value in VALUES.items():
        np.testing.assert_array_equal(reader.get_tensor(name), value, err_msg=name)
    sizes = [os.path.getsize(f"{out}.data-{i:05d}-of-00003") for i in range(3)]
    largest = max(np.asarray(v).nbytes for v in VALUES.values())
    assert max(sizes) - min(sizes) <= largest, sizes


def test_import_checkpoint_takes_num_shards_too(tmp_path):
    out = str(tmp_path / "out" / "model.ckpt")
    import_checkpoint(_source(tmp_path, "safetensors"), out, num_shards=2)
    assert Checkpoint(out).header.num_shards == 2
    np.testing.assert_array_equal(tf.train.load_checkpoint(out).get_tensor("layer6/kernel"), VALUES["layer6/kernel"])


def test_more_shards_than_tensors_leaves_empty_shards_tf_reads(tmp_path):
    out = str(tmp_path / "out" / "model.ckpt")
    convert(_source(tmp_path, "safetensors"), out, num_shards=12)
    assert Checkpoint(out).header.num_shards == 12
    np.testing.assert_array_equal(tf.train.load_checkpoint(out).get_tensor("step"), VALUES["step"])


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True], ids=["zero", "negative", "float", "string", "bool"])
def test_a_bad_num_shards_is_refused_before_anything_is_written(tmp_path, bad):
    src = _source(tmp_path, "safetensors")
    with pytest.raises(InvalidArgumentError, match="num_shards"):
        convert(src, tmp_path / "out" / "model.ckpt", num_shards=bad)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", ["out/model.npz", "out/model.safetensors"], ids=["npz", "safetensors"])
def test_num_shards_is_refused_for_outputs_that_are_not_tf_checkpoints(tmp_path, out):
    src = _source(tmp_path, "safetensors")
    with pytest.raises(InvalidArgumentError, match="num_shards"):
        convert(src, tmp_path / out, num_shards=2)
    assert not (tmp_path / "out").exists()


def test_a_tf_to_tf_copy_takes_num_shards(tmp_path):
    first = str(tmp_path / "a" / "model.ckpt")
    convert(_source(tmp_path, "safetensors"), first)
    out = str(tmp_path / "b" / "model.ckpt")
    convert(first, out, num_shards=4)
    assert Checkpoint(out).header.num_shards == 4
    np.testing.assert_array_equal(tf.train.load_checkpoint(out).get_tensor("layer3/kernel"), VALUES["layer3/kernel"])


def test_cli_convert_num_shards(tmp_path, capsys):
    out = str(tmp_path / "out" / "model.ckpt")
    assert main(["convert", str(_source(tmp_path, "npz")), out, "--num-shards", "2"]) == 0
    assert Checkpoint(out).header.num_shards == 2
    assert main(["convert", str(tmp_path / "src" / "model.npz"), str(tmp_path / "x.safetensors"),
                 "--num-shards", "2"]) != 0
    assert "--num-shards" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


# ------------------------------------------------------------------ each fact of a source read once (issue 35 item 2)

@requires_torch
@pytest.mark.parametrize("shards", [dict(num_shards=2), dict(max_shard_size=400, to="tf"), {}], ids=["num-shards", "max-size", "one"])
def test_a_torch_source_is_loaded_once_per_conversion(tmp_path, monkeypatch, shards):
    # The sizes that balance the data shards, the record, the shapes and the tensors come from one load
    # (it was loaded again for the sizes, the record and the stream).
    from restorekit.formats.torch import _reader as torch_reader

    src = _source(tmp_path, "pt")
    loads = []
    real = torch_reader._load
    monkeypatch.setattr(torch_reader, "_load", lambda path: loads.append(path) or real(path))
    out = str(tmp_path / "out" / "model.ckpt")
    convert(src, out, **shards)
    assert len(loads) == 1, loads
    reader = tf.train.load_checkpoint(out)
    for name, value in VALUES.items():
        np.testing.assert_array_equal(reader.get_tensor(name), value, err_msg=name)


def test_a_file_conversion_reads_the_layout_record_once(tmp_path, monkeypatch):
    # The record opened with the file (formats.open) is the one the conversion undoes: not read again.
    from restorekit.formats.safetensors import SafetensorsReader

    prefix = str(tmp_path / "tf" / "model.ckpt")
    with tf.Graph().as_default():
        tf.compat.v1.get_variable("conv/kernel", initializer=np.arange(54, dtype=np.float32).reshape(3, 3, 2, 3))
        tf.compat.v1.get_variable("conv/bias", initializer=np.ones(3, np.float32))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver().save(sess, prefix)
    st = str(tmp_path / "model.safetensors")
    convert(prefix, st, layout="torch")
    reads = []
    real = SafetensorsReader.read_record
    monkeypatch.setattr(SafetensorsReader, "read_record", lambda self: reads.append(self.path) or real(self))
    out = str(tmp_path / "back.npz")
    convert(st, out)
    assert reads == [st]
    with np.load(out) as back:  # the record was undone: TF names and axes, bit for bit
        np.testing.assert_array_equal(back["conv/kernel"], np.arange(54, dtype=np.float32).reshape(3, 3, 2, 3))
        np.testing.assert_array_equal(back["conv/bias"], np.ones(3, np.float32))
