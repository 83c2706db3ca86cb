"""Tests for restorekit/export/_rawimport.py: safetensors tensors kernel-copied into a TF checkpoint on import."""

import os

import numpy as np
import pytest
import tensorflow as tf

from restorekit._checkpoint import Checkpoint
from restorekit.errors import CorruptCheckpointError
from restorekit.export import convert
from restorekit.formats.tf import _rawimport as rawimport


def _object_checkpoint(tmp_path):
    """A TF2 object-based checkpoint (strings: the object graph, a string variable) of several dtypes."""
    rng = np.random.RandomState(0)
    module = tf.Module()
    module.kernel = tf.Variable(rng.randn(64, 48).astype(np.float32))
    module.bias = tf.Variable(rng.randn(48).astype(np.float32))
    module.table = tf.Variable(rng.randn(300, 16).astype(np.float64))
    module.half = tf.Variable(tf.cast(rng.randn(40, 8), tf.bfloat16))
    module.codes = tf.Variable(rng.randint(-100, 100, (33,)).astype(np.int8))
    module.mask = tf.Variable(rng.rand(17) > 0.5)
    module.wave = tf.Variable((rng.randn(5, 3) + 1j * rng.randn(5, 3)).astype(np.complex128))
    module.word = tf.Variable("restorekit")
    module.step = tf.Variable(np.int64(1000))
    return tf.train.Checkpoint(model=module).write(str(tmp_path / "src" / "ckpt"))


def _spy(monkeypatch) -> list:
    """The names copied as raw bytes, in order."""
    copied = []
    copy_run = rawimport._copy_run

    def spy(shard, run, src, bar):
        copied.extend(name for name, _, _ in run)
        return copy_run(shard, run, src, bar)

    monkeypatch.setattr(rawimport, "_copy_run", spy)
    return copied


def _values(prefix) -> dict:
    reader = tf.train.load_checkpoint(str(prefix))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if x.dtype == object:
            assert x.tolist() == y.tolist(), name
        else:
            assert x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("align_above", [0, 1 << 40], ids=["runs aligned to 2 MiB", "runs packed"])
def test_raw_import_equals_decoded_import_bit_for_bit(tmp_path, monkeypatch, align_above):
    src = _object_checkpoint(tmp_path)
    convert(src, tmp_path / "st", max_shard_size="4KB")  # several shards, most tensors alone in one
    monkeypatch.setattr(rawimport, "ALIGN_ABOVE", align_above)
    copied = _spy(monkeypatch)
    convert(tmp_path / "st", tmp_path / "raw" / "model.ckpt")
    assert "model/kernel/.ATTRIBUTES/VARIABLE_VALUE" in copied
    with monkeypatch.context() as m:
        m.setattr(rawimport, "source_arrays", lambda *args: None)  # the decoding path
        convert(tmp_path / "st", tmp_path / "decoded" / "model.ckpt")
    raw, decoded = _values(tmp_path / "raw" / "model.ckpt"), _values(tmp_path / "decoded" / "model.ckpt")
    _same_bits(raw, decoded)  # tf.train.load_checkpoint checks every crc32c as it reads
    _same_bits(raw, _values(src))
    raw_entries = Checkpoint(str(tmp_path / "raw" / "model.ckpt")).entries
    decoded_entries = Checkpoint(str(tmp_path / "decoded" / "model.ckpt")).entries
    assert {n: (e.dtype, e.shape) for n, e in raw_entries.items()} == {
        n: (e.dtype, e.shape) for n, e in decoded_entries.items()}


def test_strings_and_transformed_tensors_are_decoded(tmp_path, monkeypatch):
    src = _object_checkpoint(tmp_path)
    convert(src, tmp_path / "st", max_shard_size="64KB")
    copied = _spy(monkeypatch)
    convert(tmp_path / "st", tmp_path / "back" / "model.ckpt")
    assert "model/word/.ATTRIBUTES/VARIABLE_VALUE" not in copied  # a string
    assert "model/wave/.ATTRIBUTES/VARIABLE_VALUE" not in copied  # complex128, stored as float64 pairs
    assert "model/table/.ATTRIBUTES/VARIABLE_VALUE" in copied
    _same_bits(_values(tmp_path / "back" / "model.ckpt"), _values(src))


def test_permuted_tensors_are_decoded(tmp_path, monkeypatch):
    rng = np.random.RandomState(1)
    module = tf.Module()
    module.dense = tf.Module()
    module.dense.kernel = tf.Variable(rng.randn(6, 4).astype(np.float32))
    module.dense.bias = tf.Variable(rng.randn(4).astype(np.float32))
    src = tf.train.Checkpoint(model=module).write(str(tmp_path / "src" / "ckpt"))
    result = convert(src, tmp_path / "model.safetensors", layout="torch")
    assert result.permuted  # the kernel is stored transposed
    copied = _spy(monkeypatch)
    back = convert(tmp_path / "model.safetensors", tmp_path / "back" / "model.ckpt")
    assert set(back.permuted).isdisjoint(copied)
    _same_bits(_values(tmp_path / "back" / "model.ckpt"), _values(src))


def test_the_buffered_copy_finishes_what_the_kernel_does_not(tmp_path, monkeypatch):
    src = _object_checkpoint(tmp_path)
    convert(src, tmp_path / "st", max_shard_size="4KB")

    class NoKernel(rawimport._KernelCopy):
        def _run(self):  # as where copy_file_range is refused (another filesystem)
            self.error = OSError(18, "Invalid cross-device link")
            self._finished.set()

    monkeypatch.setattr(rawimport, "_KernelCopy", NoKernel)
    copied = _spy(monkeypatch)
    convert(tmp_path / "st", tmp_path / "back" / "model.ckpt")
    assert copied
    _same_bits(_values(tmp_path / "back" / "model.ckpt"), _values(src))


def test_a_source_shorter_than_its_header_is_refused_with_nothing_written(tmp_path):
    src = _object_checkpoint(tmp_path)
    convert(src, tmp_path / "st", max_shard_size="4KB")
    shards = sorted(p for p in os.listdir(tmp_path / "st") if p.endswith(".safetensors"))
    victim = tmp_path / "st" / shards[-1]
    os.truncate(victim, os.path.getsize(victim) - 3)
    os.makedirs(tmp_path / "out")
    with pytest.raises(CorruptCheckpointError, match="safetensors"):
        convert(tmp_path / "st", tmp_path / "out" / "model.ckpt")
    assert os.listdir(tmp_path / "out") == []


def test_a_source_cut_while_importing_is_refused_with_nothing_written(tmp_path, monkeypatch):
    src = _object_checkpoint(tmp_path)
    convert(src, tmp_path / "st", max_shard_size="4KB")
    copy_run = rawimport._copy_run

    def cut_then_copy(shard, run, src, bar):
        os.truncate(run[-1][1].path, run[-1][1].offset + run[-1][1].size - 1)  # headers checked, bytes gone
        return copy_run(shard, run, src, bar)

    monkeypatch.setattr(rawimport, "_copy_run", cut_then_copy)
    os.makedirs(tmp_path / "out")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        convert(tmp_path / "st", tmp_path / "out" / "model.ckpt")
    assert os.listdir(tmp_path / "out") == []
