"""restorekit/export/_request.py: the one options table, OptionNotApplicableError, one vocabulary (out, to,
max_shard_size) across convert / export_checkpoint / import_checkpoint / CheckpointEditor.save, and
conversions that open their source once."""

import os

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import CheckpointEditor
from restorekit._checkpoint import Checkpoint
from restorekit.errors import InvalidArgumentError, OptionNotApplicableError
from restorekit.export import convert, export_checkpoint, import_checkpoint
from restorekit.export._request import OPTIONS, check
from restorekit.formats.files import FileView
from restorekit.keras_files import KerasCheckpoint

N = 1000  # float32 elements per variable: 4000 bytes each


@pytest.fixture
def tf2(tmp_path):
    """A TF2 object-based checkpoint written by TensorFlow: four 4000-byte variables and the object graph."""
    values = {k: np.arange(N, dtype=np.float32) * (i + 1) for i, k in enumerate("abcd")}
    ckpt = tf.train.Checkpoint(**{k: tf.Variable(v) for k, v in values.items()})
    return ckpt.write(str(tmp_path / "src" / "model.ckpt")), values


def _tf_shards(prefix) -> list:
    return sorted(n for n in os.listdir(os.path.dirname(prefix)) if ".data-" in n)


# ------------------------------------------------------------------ the table refuses, with fields, writing nothing
REFUSALS = [
    ("num-shards-for-npz", lambda p, t: convert(p, t / "out" / "m.npz", num_shards=2),
     "num_shards", "npz", ("tf",), None),
    ("layout-for-npz", lambda p, t: convert(p, t / "out" / "m.npz", layout="torch"),
     "layout", "npz", ("torch", "safetensors"), "tf"),
    ("layout-tf-to-tf", lambda p, t: convert(p, t / "out" / "m.ckpt", layout="torch"),
     "layout", "tf", ("torch", "safetensors"), "tf"),
    ("max-shard-size-for-torch", lambda p, t: convert(p, t / "out" / "m.pt", to="torch", max_shard_size="1GB"),
     "max_shard_size", "torch", ("tf", "safetensors", "keras-sharded"), None),
    ("config-for-tf", lambda p, t: convert(p, t / "out" / "m.ckpt", rules="bert-tf-to-hf", config=True),
     "config", "tf", ("torch", "safetensors", "npz"), None),
    ("editor-max-shard-size-for-torch",
     lambda p, t: CheckpointEditor(p).save(t / "out" / "m.pt", max_shard_size=100),
     "max_shard_size", "torch", ("tf", "safetensors", "keras-sharded"), None),
    ("editor-distributed-for-tf", lambda p, t: CheckpointEditor(p).save(t / "out" / "m.ckpt", distributed=True),
     "distributed", "tf", ("safetensors with max_shard_size",), None),
    ("editor-distributed-unsharded",
     lambda p, t: CheckpointEditor(p).save(t / "out" / "m.safetensors", distributed=True),
     "distributed", "safetensors (unsharded)", ("safetensors with max_shard_size",), None),
    ("editor-layout-for-tf", lambda p, t: CheckpointEditor(p).save(t / "out" / "m.ckpt", layout="torch"),
     "layout", "tf", ("torch", "safetensors"), "tf"),
    ("editor-num-shards-for-npz", lambda p, t: CheckpointEditor(p).save(t / "out" / "m.npz", num_shards=2),
     "num_shards", "npz", ("tf",), None),
]


@pytest.mark.parametrize("call, option, fmt, applies_to, source", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_an_option_that_does_not_apply_is_refused_with_its_fields_and_nothing_is_written(
        tf2, tmp_path, call, option, fmt, applies_to, source):
    prefix, _ = tf2
    with pytest.raises(OptionNotApplicableError) as raised:
        call(prefix, tmp_path)
    e = raised.value
    assert isinstance(e, InvalidArgumentError) and isinstance(e, ValueError)
    assert (e.option, e.format, e.source) == (option, fmt, source)
    assert set(applies_to) <= set(e.applies_to) and fmt not in e.applies_to
    assert f"{option}=" in str(e) and "nothing was written" in str(e)
    assert not (tmp_path / "out").exists()


def test_import_refuses_a_layout_an_npz_source_does_not_have(tf2, tmp_path):
    prefix, _ = tf2
    convert(prefix, tmp_path / "m.npz")
    with pytest.raises(OptionNotApplicableError) as raised:
        import_checkpoint(tmp_path / "m.npz", tmp_path / "out" / "m", layout="torch")
    assert (raised.value.option, raised.value.format, raised.value.source) == ("layout", "tf", "npz")
    assert not (tmp_path / "out").exists()


def test_the_table_covers_every_option_the_verbs_check():
    assert set(OPTIONS) == {"layout", "rules", "weights_only", "ema", "max_shard_size", "num_shards", "config", "model",
                            "flatten_channels"}
    check({"num_shards": None, "layout": None, "ema": False}, target="npz")  # not given: nothing to refuse
    with pytest.raises(OptionNotApplicableError, match="weights_only"):
        check({"weights_only": True, "ema": True}, target="keras")  # ema: a .weights.h5 keeps Keras' values
    with pytest.raises(InvalidArgumentError, match="give one of them"):
        convert("unused", "unused", num_shards=2, max_shard_size=100)


# ------------------------------------------------------------------ max_shard_size on TF outputs
def test_convert_to_tf_with_max_shard_size_writes_data_shards_of_at_most_that_size(tf2, tmp_path):
    prefix, values = tf2
    out = str(tmp_path / "out" / "model.ckpt")
    # entries in key order: the graph (a 296-byte string), a..d (4000 each): at 8000 bytes a shard,
    # [graph, a] [b, c] [d] (graph + a + b would be 8296)
    result = convert(prefix, out, to="tf", max_shard_size=8000)
    assert result.path == out and len(_tf_shards(out)) == 3 == Checkpoint(out).header.num_shards
    assert all(os.path.getsize(os.path.join(tmp_path / "out", n)) <= 8000 for n in _tf_shards(out))
    reader = tf.train.load_checkpoint(out)
    for k, v in values.items():
        np.testing.assert_array_equal(reader.get_tensor(f"{k}/.ATTRIBUTES/VARIABLE_VALUE"), v)
    restored = tf.train.Checkpoint(**{k: tf.Variable(np.zeros(N, np.float32)) for k in values})
    restored.read(out).assert_consumed()
    np.testing.assert_array_equal(restored.c.numpy(), values["c"])


def test_import_and_the_editor_take_max_shard_size_for_tf_outputs(tf2, tmp_path):
    prefix, values = tf2
    convert(prefix, tmp_path / "m.safetensors")
    back = str(tmp_path / "back" / "model.ckpt")
    import_checkpoint(tmp_path / "m.safetensors", back, max_shard_size="4KB")  # 4000 bytes each: one a shard
    assert len(_tf_shards(back)) == 4  # [a] [b] [c] [d], the graph (counted 0 bytes: a string) with d
    edited = str(tmp_path / "edited" / "model.ckpt")
    ed = CheckpointEditor(prefix)
    ed.delete("a/.ATTRIBUTES/VARIABLE_VALUE")
    ed.save(edited, max_shard_size=12_000)  # graph + b + c + d is 12296 bytes: [graph, b, c] [d]
    assert len(_tf_shards(edited)) == 2
    for path, names in ((back, "abcd"), (edited, "bcd")):
        reader = tf.train.load_checkpoint(path)
        for k in names:
            np.testing.assert_array_equal(reader.get_tensor(f"{k}/.ATTRIBUTES/VARIABLE_VALUE"), values[k])


def test_a_bad_max_shard_size_for_a_tf_output_is_refused_before_anything_is_written(tf2, tmp_path):
    prefix, _ = tf2
    for call in (lambda: convert(prefix, tmp_path / "out" / "m", to="tf", max_shard_size="lots"),
                 lambda: CheckpointEditor(prefix).save(tmp_path / "out" / "m", max_shard_size=0),
                 lambda: CheckpointEditor(prefix).save(tmp_path / "out" / "m", max_shard_size=10, num_shards=2)):
        with pytest.raises(InvalidArgumentError, match="max_shard_size"):
            call()
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the old keyword names
def test_the_old_keyword_names_warn_and_still_work(tf2, tmp_path):
    prefix, values = tf2
    with pytest.warns(DeprecationWarning, match=r"path=.*out="):
        export_checkpoint(prefix, path=tmp_path / "a.npz", format="npz")
    with pytest.warns(DeprecationWarning, match=r"format=.*to="):
        export_checkpoint(prefix, tmp_path / "b.npz", format="npz")
    with pytest.warns(DeprecationWarning, match=r"out_prefix=.*out="):
        import_checkpoint(tmp_path / "a.npz", out_prefix=str(tmp_path / "back" / "m"))
    with pytest.warns(DeprecationWarning, match=r"format=.*to="):
        CheckpointEditor(prefix).save(tmp_path / "c.npz", format="npz")
    for name in ("a.npz", "b.npz", "c.npz"):
        with np.load(tmp_path / name) as data:
            np.testing.assert_array_equal(data["b/.ATTRIBUTES/VARIABLE_VALUE"], values["b"])
    np.testing.assert_array_equal(tf.train.load_checkpoint(str(tmp_path / "back" / "m")).get_tensor(
        "d/.ATTRIBUTES/VARIABLE_VALUE"), values["d"])
    with pytest.raises(InvalidArgumentError, match="pass to= only"):
        export_checkpoint(prefix, tmp_path / "d.npz", to="npz", format="npz")
    assert not (tmp_path / "d.npz").exists()


# ------------------------------------------------------------------ the source is opened once
@pytest.fixture
def opens(monkeypatch):
    """Every path a Checkpoint, KerasCheckpoint or FileView was opened at, in order."""
    seen = []
    for cls in (Checkpoint, KerasCheckpoint, FileView):
        original = cls.__init__

        def counted(self, path, *args, _original=original, **kwargs):
            seen.append(os.path.abspath(os.fspath(path)))
            return _original(self, path, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counted)
    return seen


@pytest.fixture
def keras_file(tmp_path):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")])
    model.save_weights(tmp_path / "k.weights.h5")
    return str(tmp_path / "k.weights.h5"), model.get_layer("dense").kernel.numpy()


@pytest.mark.parametrize("source, out", [("tf", "o.safetensors"), ("tf", "o/model.ckpt"), ("safetensors", "o/model.ckpt"),
                                         ("safetensors", "o.npz"), ("keras", "o/model.ckpt"), ("keras", "o.safetensors")],
                         ids=["tf-to-safetensors", "tf-to-tf", "safetensors-to-tf", "safetensors-to-npz",
                              "keras-to-tf", "keras-to-safetensors"])
def test_a_conversion_opens_its_source_once(tf2, keras_file, tmp_path, opens, source, out):
    prefix, values = tf2
    src = {"tf": prefix, "keras": keras_file[0], "safetensors": str(tmp_path / "s.safetensors")}[source]
    if source == "safetensors":
        convert(prefix, src)
    opens.clear()
    convert(src, tmp_path / out)
    assert opens.count(os.path.abspath(src)) == 1, opens
    back = restorekit.formats.open(str(tmp_path / out))
    if source == "keras":
        np.testing.assert_array_equal(back.read("dense/kernel"), keras_file[1])
    else:
        np.testing.assert_array_equal(back.read("a/.ATTRIBUTES/VARIABLE_VALUE"), values["a"])
