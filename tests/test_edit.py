"""Tests for restorekit/edit/: CheckpointEditor edits, streaming atomic saves, TF1/TF2 restores, bad input."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from restorekit._bundle.writer import BundleWriter
from restorekit._checkpoint import OBJECT_GRAPH_KEY, Checkpoint, RestoreKitWarning
from restorekit.edit import CheckpointEditor
from restorekit.edit._source import Source
from conftest import requires_torch, write_bundle
from restorekit.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    EditError,
    InsufficientSpaceError,
    NameCollisionError,
    NoMatchError,
    OutputError,
    OutputExistsError,
)

tf1 = tf.compat.v1
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIXED = {
    "bf16": (np.arange(6, dtype=np.float32) / 3).astype(ml_dtypes.bfloat16).reshape(2, 3),
    "f32": np.arange(8, dtype=np.float32).reshape(4, 2),
    "i32": np.array([1, -2, 3], np.int32),
    "i64": np.int64(9),
    "flag": np.array([True, False]),
    "c64": np.array([1 + 2j], np.complex64),
    "vocab": np.array([b"a", b"bc", b""], dtype=object),
}


def visible(directory):
    """Files in ``directory`` other than hidden temporary ones."""
    return sorted(f for f in os.listdir(directory) if not f.startswith(".")) if os.path.isdir(directory) else []


def digest(prefix):
    directory, base = os.path.split(prefix)
    return {f: hashlib.sha256(open(os.path.join(directory, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(directory)) if f.startswith(base)}


def read_all(prefix):
    ckpt = Checkpoint(prefix)
    return {name: ckpt.read(name) for name in ckpt}


@pytest.fixture
def mixed(tmp_path):
    return write_bundle(tmp_path / "mixed" / "m", MIXED)


# ------------------------------------------------------------------ reading


def test_editor_reads_nothing_until_needed(small_checkpoint):
    prefix, values = small_checkpoint
    ed = CheckpointEditor(prefix)
    assert ed._source is None
    assert [e.name for e in ed.list()] == sorted(values)
    assert np.array_equal(ed.get("dense/kernel"), values["dense/kernel"])


@pytest.mark.parametrize(
    "pattern, expected",
    [(".*kernel.*", ["dense/kernel", "dense/kernel/Momentum", "logits/kernel"]),
     ("logits", ["logits/bias", "logits/kernel"]),
     (".*/bias", ["dense/bias", "logits/bias"]),
     ("global_step", ["global_step"])],
    ids=["anywhere", "scope", "regex", "exact"],
)
def test_list_filters_by_the_one_pattern_rule(small_checkpoint, pattern, expected):
    entries = CheckpointEditor(small_checkpoint[0]).list(pattern)
    assert [e.name for e in entries] == expected
    assert all(e.dtype in ("float32", "int64") for e in entries)


@pytest.mark.parametrize("pattern", ["Momentum", "kernel"], ids=["slot-leaf", "infix"])
def test_list_delete_and_inspect_filter_agree_on_a_pattern_and_suggest_the_one_meant(small_checkpoint, pattern,
                                                                                      capsys):
    from restorekit.cli import main

    prefix = small_checkpoint[0]
    editor = CheckpointEditor(prefix)
    for call in (editor.list, editor.delete):
        with pytest.raises(NoMatchError, match=f"Did you mean '.\\*{pattern}"):
            call(pattern)
    assert main(["inspect", prefix, "--filter", pattern]) == 3
    assert f"Did you mean '.*{pattern}" in capsys.readouterr().err
    assert [e.name for e in editor.list(f".*{pattern}.*")] == [n for n in editor.checkpoint.entries if pattern in n]


# ------------------------------------------------------------------ renames


def test_rename_rewrites_only_the_index_and_saver_restores_it(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    ed = CheckpointEditor(prefix)
    ed.rename("dense/kernel", "encoder/kernel")
    out = ed.save(tmp_path / "new" / "dir" / "model.ckpt")  # creates the directories
    assert visible(tmp_path / "new" / "dir") == ["model.ckpt.data-00000-of-00001", "model.ckpt.index"]
    src_data = os.stat(Checkpoint(prefix).data_file(0))
    assert os.stat(out + ".data-00000-of-00001").st_ino == src_data.st_ino  # hard-linked, not copied
    reader = tf.train.load_checkpoint(out)
    assert "encoder/kernel" in reader.get_variable_to_shape_map()
    assert "dense/kernel" not in reader.get_variable_to_shape_map()
    with tf.Graph().as_default():
        kernel = tf1.get_variable("encoder/kernel", shape=[4, 3])
        step = tf1.train.get_or_create_global_step()
        with tf1.Session() as sess:
            tf1.train.Saver([kernel, step]).restore(sess, out)
            assert np.array_equal(sess.run(kernel), values["dense/kernel"])
            assert sess.run(step) == 7


@pytest.mark.parametrize(
    "rule",
    [lambda n: n.replace("dense/", "encoder/"),
     {"dense/kernel": "encoder/kernel", "dense/bias": "encoder/bias", "dense/kernel/Momentum": "encoder/kernel/Momentum"},
     [(r"^dense/", "encoder/")]],
    ids=["callable", "mapping", "regex-list"],
)
def test_rename_all_accepts_every_rule_kind(small_checkpoint, tmp_path, rule):
    prefix, values = small_checkpoint
    ed = CheckpointEditor(prefix)
    changed = ed.rename_all(rule)
    assert changed == {"dense/kernel": "encoder/kernel", "dense/bias": "encoder/bias",
                       "dense/kernel/Momentum": "encoder/kernel/Momentum"}
    got = read_all(ed.save(tmp_path / "out" / "m"))
    assert sorted(got) == sorted(["encoder/kernel", "encoder/bias", "encoder/kernel/Momentum",
                                  "logits/kernel", "logits/bias", "global_step"])
    assert np.array_equal(got["encoder/kernel/Momentum"], values["dense/kernel/Momentum"])


# ------------------------------------------------------------------ values


def test_value_edits_are_saved_and_read_by_tensorflow(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    ed = CheckpointEditor(prefix)
    ed.set("logits/bias", np.arange(5, dtype=np.float32))
    ed.set("logits/kernel", [[9.0] * 5, [8.0] * 5], index=[0, 2])
    ed.set("dense/kernel", 0.0, index=(slice(None), 1))
    ed.copy_rows("dense/kernel", [3], [0])
    ed.add("extra/table", np.array([[1, 2]], np.int32))
    ed.concat(["dense/bias", "logits/bias"], 0, "all/bias")
    ed.cast("dense/kernel/Momentum", "bfloat16")
    assert ed.get("logits/kernel")[2].tolist() == [8.0] * 5
    out = ed.save(tmp_path / "out" / "m")
    reader = tf.train.load_checkpoint(out)
    kernel = values["dense/kernel"].copy()
    kernel[:, 1] = 0
    kernel[0] = kernel[3]
    logits = values["logits/kernel"].copy()
    logits[[0, 2]] = [[9.0] * 5, [8.0] * 5]
    assert np.array_equal(reader.get_tensor("dense/kernel"), kernel)
    assert np.array_equal(reader.get_tensor("logits/kernel"), logits)
    assert np.array_equal(reader.get_tensor("logits/bias"), np.arange(5))
    assert np.array_equal(reader.get_tensor("extra/table"), [[1, 2]])
    assert np.array_equal(reader.get_tensor("all/bias"), np.concatenate([values["dense/bias"], np.arange(5)]))
    assert reader.get_variable_to_dtype_map()["dense/kernel/Momentum"] == tf.bfloat16
    momentum = values["dense/kernel/Momentum"].astype(ml_dtypes.bfloat16)
    assert np.array_equal(np.asarray(reader.get_tensor("dense/kernel/Momentum")), momentum)
    # The source is untouched.
    assert np.array_equal(Checkpoint(prefix).read("dense/kernel"), values["dense/kernel"])


@pytest.mark.parametrize("compact", [False, True], ids=["reused-shards", "compacted"])
def test_every_dtype_survives_an_edit(mixed, tmp_path, compact):
    ed = CheckpointEditor(mixed)
    ed.rename("vocab", "tokens/vocab")
    ed.set("i32", np.array([7, 8, 9], np.int32))
    ed.cast("f32", "float16")
    out = ed.save(tmp_path / "out" / "m", compact=compact)
    reader = tf.train.load_checkpoint(out)
    dtypes = {k: v.name for k, v in reader.get_variable_to_dtype_map().items()}
    assert dtypes == {"bf16": "bfloat16", "f32": "float16", "i32": "int32", "i64": "int64", "flag": "bool",
                      "c64": "complex64", "tokens/vocab": "string"}
    assert np.array_equal(np.asarray(reader.get_tensor("bf16")), MIXED["bf16"])
    assert list(reader.get_tensor("tokens/vocab")) == [b"a", b"bc", b""]
    assert reader.get_tensor("i32").tolist() == [7, 8, 9]
    assert reader.get_tensor("f32").tolist() == MIXED["f32"].tolist()
    assert reader.get_tensor("flag").tolist() == [True, False]
    assert reader.get_tensor("c64").tolist() == [1 + 2j]
    assert len(visible(tmp_path / "out")) == (2 if compact else 3)


def test_strip_and_delete_with_compaction_drop_bytes(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    ed = CheckpointEditor(prefix)
    assert ed.strip_optimizer_slots() == ["dense/kernel/Momentum"]
    assert ed.delete("logits") == ["logits/bias", "logits/kernel"]
    assert ed.delete("global_step") == ["global_step"]
    linked = ed.save(tmp_path / "linked" / "m")
    compact = ed.save(tmp_path / "compact" / "m", compact=True)
    assert sorted(read_all(linked)) == sorted(read_all(compact)) == ["dense/bias", "dense/kernel"]
    assert os.path.getsize(compact + ".data-00000-of-00001") == (12 + 3) * 4
    assert os.path.getsize(linked + ".data-00000-of-00001") == os.path.getsize(Checkpoint(prefix).data_file(0))
    assert np.array_equal(read_all(compact)["dense/kernel"], values["dense/kernel"])


def test_delete_of_an_exact_name_keeps_its_slots(small_checkpoint):
    ed = CheckpointEditor(small_checkpoint[0])
    assert ed.delete("dense/kernel") == ["dense/kernel"]
    assert "dense/kernel/Momentum" in [e.name for e in ed.list()]


def test_list_after_setting_a_string_tensor_reports_its_stored_bytes(mixed, tmp_path):
    ed = CheckpointEditor(mixed)
    ed.set("vocab", np.array([b"hello", b"", "\u00e9" * 100], dtype=object))
    listed = {e.name: e for e in ed.list()}
    out = ed.save(tmp_path / "out" / "m")
    saved = Checkpoint(out).entries["vocab"]
    # 3 varint lengths (1, 1, 2 bytes), a 4-byte crc, then 5 + 0 + 200 bytes of strings
    assert listed["vocab"].nbytes == saved.nbytes == 213
    assert listed["f32"].nbytes == 32


def test_cast_pattern_casts_only_floats(small_checkpoint):
    ed = CheckpointEditor(small_checkpoint[0])
    assert sorted(ed.cast(".*", "float16")) == ["dense/bias", "dense/kernel", "dense/kernel/Momentum",
                                               "logits/bias", "logits/kernel"]
    assert {e.name: e.dtype for e in ed.list()}["global_step"] == "int64"
    assert ed.get("dense/bias").dtype == np.float16


# ------------------------------------------------------------------ in place, state file


def test_save_in_place_keeps_a_readable_checkpoint_and_updates_state_only_when_asked(small_checkpoint):
    prefix, values = small_checkpoint
    directory = os.path.dirname(prefix)
    state_before = open(os.path.join(directory, "checkpoint")).read()
    ed = CheckpointEditor(prefix)
    ed.set("dense/bias", np.ones(3, np.float32))
    ed.save_in_place()
    assert open(os.path.join(directory, "checkpoint")).read() == state_before
    assert visible(directory) == ["checkpoint", "model.ckpt.data-00000-of-00002", "model.ckpt.data-00001-of-00002",
                                  "model.ckpt.index"]
    assert read_all(prefix)["dense/bias"].tolist() == [1, 1, 1]
    ed.rename("dense/bias", "dense/b")
    ed.save_in_place(compact=True, update_state_file=True)
    assert visible(directory) == ["checkpoint", "model.ckpt.data-00000-of-00001", "model.ckpt.index"]
    got = read_all(prefix)
    assert got["dense/b"].tolist() == [1, 1, 1]
    assert np.array_equal(got["dense/kernel"], values["dense/kernel"])
    assert tf.train.latest_checkpoint(directory) == prefix
    assert 'model_checkpoint_path: "model.ckpt"' in open(os.path.join(directory, "checkpoint")).read()


# ------------------------------------------------------------------ partitioned variables


@pytest.fixture
def partitioned(tmp_path):
    value = np.arange(40, dtype=np.float32).reshape(10, 4)
    with tf.Graph().as_default():
        tf1.get_variable("emb", initializer=tf.constant(value), partitioner=tf1.fixed_size_partitioner(3))
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            prefix = saver.save(sess, str(tmp_path / "part" / "m"), write_meta_graph=False)
    return prefix, value


def _restore_partitioned(prefix, name, shape):
    with tf.Graph().as_default():
        var = tf1.get_variable(name, shape=shape, partitioner=tf1.fixed_size_partitioner(3))
        with tf1.Session() as sess:
            tf1.train.Saver().restore(sess, prefix)
            return sess.run(tf.convert_to_tensor(var))


@pytest.mark.parametrize("compact", [False, True], ids=["reused-shards", "compacted"])
def test_renamed_partitioned_variable_keeps_its_slices(partitioned, tmp_path, compact):
    prefix, value = partitioned
    ed = CheckpointEditor(prefix)
    ed.rename("emb", "embeddings/table")
    out = ed.save(tmp_path / "out" / "m", compact=compact)
    assert Checkpoint(out).is_partitioned("embeddings/table")
    assert np.array_equal(_restore_partitioned(out, "embeddings/table", [10, 4]), value)


def test_edited_partitioned_variable_is_stored_whole_and_still_restores(partitioned, tmp_path):
    prefix, value = partitioned
    ed = CheckpointEditor(prefix)
    ed.set("emb", -1.0, index=0)
    out = ed.save(tmp_path / "out" / "m")
    value = value.copy()
    value[0] = -1
    assert not Checkpoint(out).is_partitioned("emb")
    assert np.array_equal(_restore_partitioned(out, "emb", [10, 4]), value)


# ------------------------------------------------------------------ TF2 object-based checkpoints


class _Model(tf.Module):
    def __init__(self):
        super().__init__()
        self.kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
        self.bias = tf.Variable(np.zeros(3, np.float32))


@pytest.fixture
def tf2_checkpoint(tmp_path):
    model = _Model()
    optimizer = tf.Module()
    optimizer.m = tf.Variable(np.ones(3, np.float32))
    return tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "tf2" / "ckpt"))


KERNEL_KEY = "model/kernel/.ATTRIBUTES/VARIABLE_VALUE"


def test_tf2_set_keeps_the_object_graph_valid(tf2_checkpoint, tmp_path):
    ed = CheckpointEditor(tf2_checkpoint)
    ed.set(KERNEL_KEY, np.full((2, 3), 5, np.float32))
    out = ed.save(tmp_path / "out" / "ckpt")
    model = _Model()
    tf.train.Checkpoint(model=model).restore(out).expect_partial().assert_existing_objects_matched()
    assert model.kernel.numpy().tolist() == [[5] * 3] * 2


def test_tf2_rename_and_strip_keep_the_object_graph_consistent(tf2_checkpoint, tmp_path):
    ed = CheckpointEditor(tf2_checkpoint)
    ed.rename(KERNEL_KEY, "encoder/kernel/.ATTRIBUTES/VARIABLE_VALUE")
    assert ed.strip_optimizer_slots() == ["optimizer/m/.ATTRIBUTES/VARIABLE_VALUE"]
    out = ed.save(tmp_path / "out" / "ckpt")
    keys = tf.train.load_checkpoint(out).get_variable_to_shape_map()
    assert "encoder/kernel/.ATTRIBUTES/VARIABLE_VALUE" in keys and KERNEL_KEY not in keys
    assert not any(k.startswith("optimizer/") for k in keys)
    model = _Model()
    optimizer = tf.Module()
    optimizer.m = tf.Variable(np.zeros(3, np.float32))
    status = tf.train.Checkpoint(model=model, optimizer=optimizer).restore(out).expect_partial()
    status.assert_existing_objects_matched()  # every graph attribute names an existing key
    assert model.kernel.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]  # the value stays with its object
    assert optimizer.m.numpy().tolist() == [0, 0, 0]


def test_tf2_rename_out_of_the_object_layout_converts_with_a_warning(tf2_checkpoint, tmp_path):
    ed = CheckpointEditor(tf2_checkpoint)
    ed.rename(KERNEL_KEY, "dense/kernel")
    with pytest.warns(RestoreKitWarning, match="name-based") as caught:
        out = ed.save(tmp_path / "out" / "ckpt")
    assert not any(str(w.message).startswith("restorekit") for w in caught)  # the CLI adds the one prefix
    ckpt = Checkpoint(out)
    assert OBJECT_GRAPH_KEY not in ckpt
    assert ckpt.read("dense/kernel").tolist() == [[0, 1, 2], [3, 4, 5]]
    with tf.Graph().as_default():
        kernel = tf1.get_variable("dense/kernel", shape=[2, 3])
        with tf1.Session() as sess:
            tf1.train.Saver([kernel]).restore(sess, out)
            assert sess.run(kernel).tolist() == [[0, 1, 2], [3, 4, 5]]


# ------------------------------------------------------------------ other formats


@pytest.mark.parametrize("fmt, suffix", [("safetensors", ".safetensors"), ("npz", ".npz"),
                                         pytest.param("torch", ".pt", marks=requires_torch)],
                         ids=["safetensors", "npz", "torch"])
def test_save_to_other_formats(small_checkpoint, tmp_path, fmt, suffix):
    prefix, values = small_checkpoint
    ed = CheckpointEditor(prefix)
    ed.rename("dense/kernel", "encoder/kernel")
    out = ed.save(tmp_path / "out" / f"model{suffix}", format=fmt)
    if fmt == "safetensors":
        from safetensors.numpy import load_file

        got = load_file(out)
    elif fmt == "npz":
        got = dict(np.load(out))
    else:
        import torch

        got = {k: v.numpy() for k, v in torch.load(out, weights_only=True).items()}
    assert np.array_equal(got["encoder/kernel"], values["dense/kernel"])
    assert len(got) == len(values)
    assert visible(tmp_path / "out") == [f"model{suffix}"]


# ------------------------------------------------------------------ bad input: error type, nothing written


Bad = namedtuple("Bad", "edit error")

BAD_EDITS = {
    "rename-collision": Bad(lambda ed: ed.rename_all({"dense/bias": "b", "logits/bias": "b"}), NameCollisionError),
    "rename-onto-existing": Bad(lambda ed: ed.rename("dense/bias", "logits/bias"), NameCollisionError),
    "rule-matches-nothing": Bad(lambda ed: ed.rename_all([(r"^encoder/", "x/")]), NoMatchError),
    "rule-changes-nothing": Bad(lambda ed: ed.rename_all(lambda n: n), NoMatchError),
    "rename-unknown": Bad(lambda ed: ed.rename("dense/kernal", "x"), NoMatchError),
    "set-wrong-shape": Bad(lambda ed: ed.set("dense/bias", np.zeros(4, np.float32)), EditError),
    "set-wrong-dtype": Bad(lambda ed: ed.set("dense/bias", np.zeros(3, np.float64)), EditError),
    "set-rows-wrong-shape": Bad(lambda ed: ed.set("dense/kernel", np.zeros((2, 4), np.float32), index=[0, 1]), EditError),
    "set-index-out-of-range": Bad(lambda ed: ed.set("dense/kernel", 0.0, index=[9]), EditError),
    "set-float-into-int": Bad(lambda ed: ed.set("global_step", 1.5), EditError),
    "set-unknown": Bad(lambda ed: ed.set("nope", 1.0), NoMatchError),
    "copy-rows-mismatch": Bad(lambda ed: ed.copy_rows("dense/kernel", [0, 1], [2]), EditError),
    "add-existing": Bad(lambda ed: ed.add("dense/bias", np.zeros(3)), NameCollisionError),
    "delete-nothing": Bad(lambda ed: ed.delete("decoder"), NoMatchError),
    "concat-shapes": Bad(lambda ed: ed.concat(["dense/kernel", "logits/kernel"], 0, "x"), EditError),
    "cast-unknown-dtype": Bad(lambda ed: ed.cast("dense/bias", "float7"), EditError),
}


@pytest.mark.parametrize("case", list(BAD_EDITS), ids=list(BAD_EDITS))
def test_bad_edit_fails_at_the_call_and_queues_nothing(small_checkpoint, tmp_path, case):
    ed = CheckpointEditor(small_checkpoint[0])
    before = ed.list()
    with pytest.raises(BAD_EDITS[case].error):
        BAD_EDITS[case].edit(ed)
    assert ed.list() == before
    with pytest.raises(OutputExistsError):  # and nothing to save over the source either
        ed.save(small_checkpoint[0])


def test_set_accepts_a_dtype_change_when_asked(small_checkpoint, tmp_path):
    ed = CheckpointEditor(small_checkpoint[0])
    ed.set("dense/bias", np.zeros(3, np.float64), allow_dtype_change=True)
    assert Checkpoint(ed.save(tmp_path / "o" / "m"))["dense/bias"].dtype == "float64"


def test_missing_source():
    with pytest.raises(CheckpointNotFoundError):
        CheckpointEditor("/nonexistent/model.ckpt")


def _corrupt(prefix, what):
    ckpt = Checkpoint(prefix)
    if what == "index":
        data = open(prefix + ".index", "rb").read()
        open(prefix + ".index", "wb").write(data[: len(data) // 2])
    elif what == "shard-crc":
        entry = ckpt.bundle_entry("dense/kernel")
        with open(ckpt.data_file(0), "r+b") as f:
            f.seek(entry.offset + 5)
            f.write(b"\x7f")
    else:
        path = ckpt.data_file(0)
        os.truncate(path, os.path.getsize(path) - 4)


@pytest.mark.parametrize(
    "what, error, compact",
    [("index", CorruptCheckpointError, False), ("shard-crc", ChecksumMismatchError, True),
     ("shard-truncated", CorruptCheckpointError, True)],
    ids=["truncated-index", "crc-mismatch", "truncated-shard"],
)
def test_corrupt_source_raises_and_writes_nothing(small_checkpoint, tmp_path, what, error, compact):
    prefix = small_checkpoint[0]
    _corrupt(prefix, what)
    out = tmp_path / "out"
    with pytest.raises(error):
        ed = CheckpointEditor(prefix)
        ed.rename("dense/bias", "b")
        ed.save(out / "m", compact=compact)
    assert visible(out) == []


def test_output_equal_to_source_or_existing(small_checkpoint, tmp_path):
    prefix = small_checkpoint[0]
    ed = CheckpointEditor(prefix)
    ed.rename("dense/bias", "b")
    before = digest(prefix)
    with pytest.raises(OutputExistsError, match="save_in_place"):
        ed.save(prefix)
    with pytest.raises(OutputExistsError):
        ed.save(prefix + ".index")
    assert digest(prefix) == before
    out = ed.save(tmp_path / "o" / "m")
    written = digest(out)
    with pytest.raises(OutputExistsError):
        ed.save(out)
    assert digest(out) == written
    ed.rename("b", "bias2")
    ed.save(out, overwrite=True)
    assert "bias2" in Checkpoint(out)


def test_output_errors_carry_the_path_and_whether_it_is_the_source(small_checkpoint, tmp_path):
    prefix = small_checkpoint[0]
    ed = CheckpointEditor(prefix)
    ed.rename("dense/bias", "b")
    source_files = digest(prefix)
    with pytest.raises(OutputExistsError) as source:
        ed.save(prefix)
    assert source.value.is_source and source.value.path == prefix
    out = ed.save(tmp_path / "o" / "m")
    written = digest(out)
    with pytest.raises(OutputExistsError) as existing:
        ed.save(tmp_path / "o" / "m")
    assert not existing.value.is_source and existing.value.path == out
    assert digest(out) == written and sorted(os.listdir(tmp_path / "o")) == sorted(written)
    with pytest.raises(OutputExistsError) as exported:
        ed.save(prefix + ".index", format="npz")
    assert not exported.value.is_source and exported.value.path == prefix + ".index"
    assert digest(prefix) == source_files


@pytest.mark.parametrize(
    "call, name",
    [(lambda ed: ed.get("dense/kernal"), "dense/kernal"),
     (lambda ed: ed.delete("dense/kernal"), "dense/kernal"),
     (lambda ed: ed.rename_all({"dense/kernal": "x"}), "dense/kernal"),
     (lambda ed: ed.rename_all([("^dense/kernal$", "x")]), "^dense/kernal$")],
    ids=["get", "delete", "rename-mapping", "rename-regex"],
)
def test_no_match_errors_name_the_closest_entries_once(small_checkpoint, call, name):
    with pytest.raises(NoMatchError) as caught:
        call(CheckpointEditor(small_checkpoint[0]))
    assert caught.value.name == name and "dense/kernel" in caught.value.closest
    assert str(caught.value).count("Closest:") == 1


def test_too_little_disk_raises_before_writing(small_checkpoint, tmp_path, monkeypatch):
    import shutil

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6, 100))
    ed = CheckpointEditor(small_checkpoint[0])
    ed.set("dense/bias", np.ones(3, np.float32))
    with pytest.raises(InsufficientSpaceError):
        ed.save(tmp_path / "out" / "m")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ kill -9 at any point

_SCRIPT = """
import sys, numpy as np
from restorekit.edit import CheckpointEditor
src, out, mode = sys.argv[1:4]
ed = CheckpointEditor(src)
ed.set("dense/bias", np.full(3, 5, np.float32))
ed.rename("logits/kernel", "head/kernel")
ed.save_in_place(compact=True) if mode == "in-place" else ed.save(out, compact=True)
print("done")
"""


def _run_until(point, src, out, mode, tmp_path):
    marker = tmp_path / f"reached-{point}-{mode}"
    env = dict(os.environ, RESTOREKIT_CRASH_HOOK=f"{point}:{marker}", PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, src, out, mode], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the save never reached {point!r}: {proc.communicate()[1].decode()[-2000:]}")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


POINTS = ["tensor-0", "tensor-3", "before-verify", "before-commit", "before-index-rename"]


@pytest.mark.parametrize("point", POINTS, ids=POINTS)
def test_kill_9_leaves_the_source_intact_and_no_partial_output(small_checkpoint, tmp_path, point):
    prefix, values = small_checkpoint
    before = digest(prefix)
    out = str(tmp_path / "out" / "m")
    _run_until(point, prefix, out, "new", tmp_path)
    assert digest(prefix) == before
    assert not os.path.exists(out + ".index")
    with pytest.raises(CheckpointNotFoundError):
        Checkpoint(out)
    if point != "before-index-rename":
        assert visible(tmp_path / "out") == []
    # A later save succeeds and sweeps the dead writer's temporary files.
    ed = CheckpointEditor(prefix)
    ed.set("dense/bias", np.full(3, 5, np.float32))
    ed.save(out, compact=True)
    assert read_all(out)["dense/bias"].tolist() == [5, 5, 5]
    assert sorted(os.listdir(tmp_path / "out")) == ["m.data-00000-of-00001", "m.index"]


@pytest.mark.parametrize("point", ["tensor-2", "before-index-rename"], ids=["mid-write", "before-index-rename"])
def test_kill_9_during_save_in_place_keeps_the_old_checkpoint(small_checkpoint, tmp_path, point):
    prefix, values = small_checkpoint
    _run_until(point, prefix, "", "in-place", tmp_path)
    got = read_all(prefix)
    assert sorted(got) == sorted(values)
    for name, value in values.items():
        assert np.array_equal(got[name], value)


def test_unedited_export_takes_the_raw_copy_path_with_the_same_result(small_checkpoint, tmp_path):
    from safetensors.numpy import load_file

    prefix, values = small_checkpoint
    got = load_file(CheckpointEditor(prefix).save(tmp_path / "o" / "m.safetensors", format="safetensors"))
    assert sorted(got) == sorted(values)
    assert np.array_equal(got["dense/kernel"], values["dense/kernel"])


def test_save_with_progress_counts_every_byte(small_checkpoint, tmp_path, monkeypatch):
    import restorekit.formats._sink as export_base

    totals = []

    class Bar:
        def __init__(self, total, enabled, desc):
            totals.append([total, 0, enabled])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            totals[-1][1] += n

    monkeypatch.setattr(export_base, "progress_bar", Bar)
    prefix, values = small_checkpoint
    ed = CheckpointEditor(prefix)
    ed.set("dense/bias", np.zeros(3, np.float32))
    ed.save(tmp_path / "out" / "model.ckpt", progress=True, compact=True)
    expected = sum(np.asarray(v).nbytes for v in values.values())
    assert totals == [[expected, expected, True]]


# ------------------------------------------------------------------ concat, streamed on save

@pytest.fixture
def tables(tmp_path):
    rng = np.random.RandomState(3)
    values = {
        "emb/a": rng.randn(37, 6).astype(np.float32),
        "emb/b": rng.randn(11, 6).astype(np.float32),
        "cube/a": rng.randn(5, 3, 4).astype(ml_dtypes.bfloat16),
        "cube/b": rng.randn(5, 2, 4).astype(ml_dtypes.bfloat16),
    }
    return write_bundle(tmp_path / "tables" / "m", values), values


@pytest.mark.parametrize("compact", [False, True], ids=["reused-shards", "compacted"])
def test_concat_along_axis_0_streams_its_inputs_without_building_the_result(tables, tmp_path, monkeypatch, compact):
    import restorekit.edit._source as edit_source

    prefix, values = tables
    ed = CheckpointEditor(prefix)
    ed.set("emb/b", np.full((2, 6), 7.0, np.float32), index=[0, 5])  # an edited input beside a stored one
    ed.concat(["emb/a", "emb/b", "emb/a"], 0, "emb/all")
    edited_b = values["emb/b"].copy()
    edited_b[[0, 5]] = 7.0
    expected = np.concatenate([values["emb/a"], edited_b, values["emb/a"]])
    monkeypatch.setattr(edit_source, "CHUNK_SIZE", 100)  # many chunks per stored input
    monkeypatch.setattr(np, "concatenate", lambda *a, **k: pytest.fail("the concat result was built whole"))
    out = ed.save(tmp_path / "out" / "m", compact=compact)
    monkeypatch.undo()
    got = tf.train.load_checkpoint(out).get_tensor("emb/all")
    assert got.dtype == np.float32 and np.array_equal(got, expected)


@pytest.mark.parametrize("chunk", [10_000, 40, 1], ids=["one-block", "several-rows", "row-by-row"])
def test_concat_along_inner_axes_is_written_in_blocks_of_rows(tables, tmp_path, monkeypatch, chunk):
    import restorekit.edit._source as edit_source

    prefix, values = tables
    ed = CheckpointEditor(prefix)
    ed.concat(["cube/a", "cube/b", "cube/a"], 1, "cube/mid")
    ed.concat(["cube/b", "cube/b"], -1, "cube/last")
    monkeypatch.setattr(edit_source, "CHUNK_SIZE", chunk)
    out = ed.save(tmp_path / "out" / "m")
    ckpt = Checkpoint(out)
    mid = np.concatenate([values["cube/a"], values["cube/b"], values["cube/a"]], axis=1)
    last = np.concatenate([values["cube/b"], values["cube/b"]], axis=2)
    assert ckpt.read("cube/mid").tobytes() == mid.tobytes() and ckpt.read("cube/mid").shape == (5, 8, 4)
    assert ckpt.read("cube/last").tobytes() == last.tobytes() and ckpt.read("cube/last").shape == (5, 2, 8)
    assert ed.get("cube/mid").tobytes() == mid.tobytes()


def test_concat_of_a_corrupt_stored_input_raises_and_writes_nothing(tables, tmp_path):
    prefix, _ = tables
    ckpt = Checkpoint(prefix)
    entry = ckpt.bundle_entry("emb/b")
    with open(ckpt.data_file(0), "r+b") as f:
        f.seek(entry.offset + 3)
        f.write(b"\x55")
    ed = CheckpointEditor(prefix)
    ed.concat(["emb/a", "emb/b"], 0, "emb/all")
    out = tmp_path / "out"
    with pytest.raises(ChecksumMismatchError, match="emb/b"):
        ed.save(out / "m", compact=True)
    assert visible(out) == []


# ------------------------------------------------------------------ remote outputs (ram:// stands in for gs://)

def _ram_dir():
    import uuid

    return f"ram://restorekit-save-{uuid.uuid4().hex[:8]}"


def _remote_listing(directory):
    return sorted(tf.io.gfile.listdir(directory)) if tf.io.gfile.exists(directory) else []


def test_save_to_a_remote_path_uploads_shards_then_the_index(small_checkpoint, monkeypatch):
    import restorekit._bundle.files as files

    prefix, values = small_checkpoint
    remote = _ram_dir()
    order = []
    real = files.publish
    monkeypatch.setattr(files, "publish", lambda local, path, **kw: order.append(path.rsplit("/", 1)[1]) or real(local, path, **kw))
    ed = CheckpointEditor(prefix)
    ed.rename("dense/bias", "dense/b")
    ed.set("logits/bias", np.arange(5, dtype=np.float32))
    out = ed.save(remote + "/edited/model.ckpt", update_state_file=True)
    assert out == remote + "/edited/model.ckpt"
    assert order[-2:] == ["model.ckpt.index", "checkpoint"] and all(".data-" in n for n in order[:-2])
    reader = tf1.train.NewCheckpointReader(out)  # (load_checkpoint takes a ram:// prefix for a directory)
    assert np.array_equal(reader.get_tensor("dense/b"), values["dense/bias"])
    assert np.array_equal(reader.get_tensor("logits/bias"), np.arange(5))
    assert tf.train.latest_checkpoint(remote + "/edited") == out
    assert not [n for n in _remote_listing(remote + "/edited") if n.startswith(".")]  # no temporary objects


def test_remote_checkpoint_is_read_edited_and_saved_locally_and_remotely(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    remote = _ram_dir()
    first = CheckpointEditor(prefix).save(remote + "/model.ckpt")
    ed = CheckpointEditor(first)  # a remote source: its shards cannot be linked, so they are copied
    ed.delete("dense/kernel/Momentum")
    local = ed.save(tmp_path / "local" / "model.ckpt")
    again = ed.save(remote + "/again/model.ckpt")
    for out in (local, again):
        reader = tf1.train.NewCheckpointReader(out)
        assert sorted(reader.get_variable_to_shape_map()) == sorted(set(values) - {"dense/kernel/Momentum"})
        assert np.array_equal(reader.get_tensor("logits/kernel"), values["logits/kernel"])


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_export_to_a_remote_file(small_checkpoint, tmp_path, fmt):
    prefix, values = small_checkpoint
    remote = _ram_dir() + f"/model.{fmt}"
    CheckpointEditor(prefix).save(remote, format=fmt)
    local = str(tmp_path / f"copy.{fmt}")
    tf.io.gfile.copy(remote, local)
    if fmt == "safetensors":
        from safetensors.numpy import load_file

        got = load_file(local)
    else:
        got = dict(np.load(local))
    assert np.array_equal(got["dense/kernel"], values["dense/kernel"])


def test_existing_remote_output_is_never_replaced(small_checkpoint):
    prefix, _ = small_checkpoint
    remote = _ram_dir() + "/model.ckpt"
    CheckpointEditor(prefix).save(remote)
    before = tf.io.gfile.stat(remote + ".index").length
    ed = CheckpointEditor(prefix)
    ed.delete("dense/kernel/Momentum")
    with pytest.raises(OutputExistsError):
        ed.save(remote)
    with pytest.raises(OutputError, match="cannot be atomic"):
        ed.save(remote, overwrite=True)
    with pytest.raises(OutputError, match="replaced atomically"):
        CheckpointEditor(remote).save_in_place()
    assert tf.io.gfile.stat(remote + ".index").length == before


def test_failed_upload_of_the_index_leaves_no_remote_files(small_checkpoint, monkeypatch):
    import restorekit._bundle.files as files

    prefix, _ = small_checkpoint
    remote = _ram_dir()
    real = files.publish

    def publish(local, path, **kw):
        if path.endswith(".index"):
            raise OutputError(f"could not write {path!r}: simulated network error")
        return real(local, path, **kw)

    monkeypatch.setattr(files, "publish", publish)
    ed = CheckpointEditor(prefix)
    ed.set("logits/bias", np.zeros(5, np.float32))
    with pytest.raises(OutputError, match="simulated"):
        ed.save(remote + "/model.ckpt")
    assert _remote_listing(remote) == []


# ------------------------------------------------------------------ casts that would lose values

def test_cast_to_an_integer_or_from_complex_is_refused_and_queues_nothing(mixed):
    ed = CheckpointEditor(mixed)
    before = ed.list()
    with pytest.raises(EditError, match="truncate"):
        ed.cast(".*", "int8")
    with pytest.raises(EditError, match="truncate"):
        ed.cast("f32", "int32")
    with pytest.raises(EditError, match="truncate"):
        ed.cast("c64", "float32")
    assert ed.list() == before
    assert ed.cast("i64", "int32") == ["i64"]  # integer to integer stays allowed
    assert ed.get("i64").dtype == np.int32


def test_add_of_an_object_array_that_is_not_strings_fails_at_the_call(small_checkpoint):
    ed = CheckpointEditor(small_checkpoint[0])
    before = ed.list()
    with pytest.raises(EditError, match="bytes or str"):
        ed.add("obj", np.array([object()]))
    with pytest.raises(EditError, match="bytes or str"):
        ed.add("mixed", np.array([b"a", 3], dtype=object))
    assert ed.list() == before


@pytest.mark.parametrize("fmt", ["safetensors", pytest.param("torch", marks=requires_torch)])
def test_strip_and_rename_then_export_copies_raw_bytes_without_decoding(small_checkpoint, tmp_path, monkeypatch, fmt):
    from restorekit.export import import_checkpoint

    prefix, values = small_checkpoint
    ed = CheckpointEditor(prefix)
    ed.strip_optimizer_slots()
    ed.rename("dense/kernel", "fc/kernel")
    monkeypatch.setattr(Source, "value", lambda self, item: pytest.fail("a tensor was decoded"))
    out = tmp_path / f"model.{'pt' if fmt == 'torch' else fmt}"
    ed.save(out, format=fmt)
    monkeypatch.undo()
    back = str(tmp_path / "back" / "m")
    import_checkpoint(str(out), back)
    got = read_all(back)
    expected = {("fc/kernel" if n == "dense/kernel" else n): v for n, v in values.items() if n != "dense/kernel/Momentum"}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert np.array_equal(got[name], value), name


def test_tf2_keras_entries_are_edited_by_their_readable_paths(tmp_path):
    import keras

    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(3, name="head")(keras.layers.Dense(5, name="body")(inp)))
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(model.trainable_variables)
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "k" / "ckpt"))
    ckpt = Checkpoint(prefix)
    assert "head/kernel" not in ckpt.entries  # Keras 3 keys name no layer
    slot = next(p for p in ckpt.object_paths if p.startswith("optimizer/") and p.endswith("head_kernel_momentum"))
    ed = CheckpointEditor(prefix)
    np.testing.assert_array_equal(ed.get("body/kernel"), model.get_layer("body").kernel.numpy())
    ed.set("head/kernel", np.zeros((5, 3), np.float32))
    ed.copy_rows("body/kernel", [0], [1])
    assert ed.delete(slot) == [ckpt.object_paths[slot]]
    out = ed.save(tmp_path / "out" / "ckpt")
    inp = keras.Input((4,))
    fresh = keras.Model(inp, keras.layers.Dense(3, name="head")(keras.layers.Dense(5, name="body")(inp)))
    tf.train.Checkpoint(model=fresh).restore(out).expect_partial()
    np.testing.assert_array_equal(fresh.get_layer("head").kernel.numpy(), np.zeros((5, 3)))
    body = model.get_layer("body").kernel.numpy()
    body[1] = body[0]
    np.testing.assert_array_equal(fresh.get_layer("body").kernel.numpy(), body)
    assert ckpt.object_paths[slot] not in Checkpoint(out).entries


def test_a_scope_pattern_that_is_also_a_readable_path_still_takes_the_whole_scope(tmp_path):
    class Model(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.ones([3, 2]))  # unnamed: readable paths are the object paths
            self.b = tf.Variable(tf.zeros([2]))

    model = Model()
    optimizer = tf1.train.AdamOptimizer()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model.w) + tf.reduce_sum(model.b)
    optimizer.apply_gradients(zip(tape.gradient(loss, [model.w, model.b]), [model.w, model.b]))
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "m" / "ck"))
    scope = [k for k in Checkpoint(prefix).entries if k.startswith("model/w/")]
    assert len(scope) == 3  # the variable and its two Adam slots
    assert sorted(CheckpointEditor(prefix).delete("model/w")) == sorted(scope)


def test_integer_to_float16_overflow_is_refused_with_a_count_and_a_sample(tmp_path):
    prefix = str(tmp_path / "src" / "m")
    with BundleWriter(prefix) as w:
        w.add("count", np.array([1, 70000, -70000], np.int32))
    ed = CheckpointEditor(prefix)
    ed.cast("count", "float16")
    with pytest.raises(EditError, match=r"'count'.*2 values \(e\.g\. 70000 -> inf\)"):
        ed.save(tmp_path / "out" / "m")
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------ overwrite removes exactly the old output


@pytest.mark.parametrize(
    "target, neighbour",
    [("model[1].ckpt", "model1.ckpt"), ("ckpt-1?", "ckpt-10")],
    ids=["brackets-in-the-prefix", "question-mark-in-the-prefix"],
)
@pytest.mark.parametrize("compact", [False, True], ids=["reused-shards", "compacted"])
def test_overwrite_removes_only_the_old_outputs_files_never_a_neighbours(small_checkpoint, tmp_path, target,
                                                                          neighbour, compact):
    prefix = small_checkpoint[0]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    CheckpointEditor(prefix).save(out_dir / neighbour)  # a neighbour a glob of the target's name would match
    old = CheckpointEditor(prefix)
    old.add("extra", np.arange(3, dtype=np.float32))
    old.save(out_dir / target)  # the output to replace: two shards
    before = digest(str(out_dir / neighbour))
    assert len(before) == 2
    ed = CheckpointEditor(prefix)
    ed.rename("dense/bias", "b")
    ed.save(out_dir / target, overwrite=True, compact=compact)
    assert digest(str(out_dir / neighbour)) == before  # byte-identical, nothing removed
    assert "b" in Checkpoint(str(out_dir / target)) and "extra" not in Checkpoint(str(out_dir / target))
    # the old output's two shards are gone (a rename alone reuses the source's one shard)
    assert visible(out_dir) == sorted([f"{neighbour}.index", f"{neighbour}.data-00000-of-00001",
                                       f"{target}.index", f"{target}.data-00000-of-00001"])
    tf.train.load_checkpoint(str(out_dir / neighbour)).get_tensor("dense/bias")  # TF still reads the neighbour


# ------------------------------------------------------------------ every save checks the bytes it keeps


def _flip_one_bit(prefix, name):
    ckpt = Checkpoint(prefix)
    entry = ckpt.bundle_entry(name)
    with open(ckpt.data_file(entry.shard_id), "r+b") as f:
        f.seek(entry.offset + 2)
        byte = f.read(1)[0]
        f.seek(entry.offset + 2)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize(
    "edit",
    [lambda ed: ed.rename("dense/bias", "b"),
     lambda ed: ed.strip_optimizer_slots(),
     lambda ed: ed.set("dense/bias", np.zeros(3, np.float32)),
     lambda ed: ed.cast("dense/kernel", "bfloat16")],
    ids=["rename", "strip", "set-another-tensor", "cast-another-tensor"],
)
def test_a_flipped_bit_in_a_kept_tensor_fails_the_save_and_writes_nothing(small_checkpoint, tmp_path, edit):
    prefix = small_checkpoint[0]
    _flip_one_bit(prefix, "logits/kernel")  # TF wrote it; no edit touches it
    before = digest(prefix)
    ed = CheckpointEditor(prefix)
    edit(ed)
    out = tmp_path / "out"
    with pytest.raises(ChecksumMismatchError, match="'logits/kernel'"):
        ed.save(out / "m")
    assert not out.exists() or os.listdir(out) == []  # not even a hidden staging directory
    with pytest.raises(ChecksumMismatchError, match="'logits/kernel'"):
        ed.save_in_place()
    assert digest(prefix) == before  # the source is as it was
    assert sorted(os.listdir(os.path.dirname(prefix))) == sorted([*before, "checkpoint"])


def _bad_metadata(tmp_path, how):
    """A checkpoint whose entry 'bad' has bytes that its index metadata cannot describe."""
    prefix = str(tmp_path / "bad" / "m")
    with BundleWriter(prefix) as writer:
        entry = writer.add("good", np.arange(4, dtype=np.float32))
        writer.add("other", np.ones(2, np.float32))
        writer.add_entry_only("bad", entry.replace(dtype=0) if how == "dtype-0" else entry.replace(shape=(5,)))
    return prefix


@pytest.mark.parametrize("how", ["dtype-0", "size-off-its-shape"])
@pytest.mark.parametrize(
    "save",
    [lambda ed, out: ed.save(out, compact=True),
     lambda ed, out: (ed.cast("bad", "float64"), ed.save(out)),
     lambda ed, out: (ed.rename("other", "o"), ed.save(out))],
    ids=["compact", "cast-it", "rename-another"],
)
def test_an_entry_whose_metadata_cannot_be_right_is_never_copied(tmp_path, how, save):
    ed = CheckpointEditor(_bad_metadata(tmp_path, how))
    out = tmp_path / "out"
    with pytest.raises(CorruptCheckpointError, match="'bad'.*the checkpoint index is corrupt"):
        save(ed, out / "m")
    assert not out.exists() or os.listdir(out) == []


# ------------------------------------------------------------------ one writer at a time (issue 11 item 3)

def test_save_waits_for_no_one_a_second_writer_gets_output_exists(small_checkpoint, tmp_path):
    from restorekit._bundle.locking import output_lock

    import threading

    prefix, _ = small_checkpoint
    out = str(tmp_path / "out" / "model")
    os.makedirs(os.path.dirname(out))
    ready, stop = threading.Event(), threading.Event()

    def other_writer():  # between its exists-check and its rename (the thread that holds a lock may retake it)
        with output_lock(out):
            ready.set()
            stop.wait(60)

    holder = threading.Thread(target=other_writer)
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(OutputExistsError, match="another restorekit process") as info:
            CheckpointEditor(prefix).save(out)
    finally:
        stop.set()
        holder.join(30)
    assert info.value.path == out
    assert not os.path.exists(out + ".index")
    CheckpointEditor(prefix).save(out)  # free again
    assert Checkpoint(out).verify().ok


@pytest.mark.slow  # two writer processes, each importing TensorFlow
def test_two_saves_to_one_new_output_from_two_processes_leave_one_whole_checkpoint(small_checkpoint, tmp_path):
    import multiprocessing

    prefix, values = small_checkpoint
    out = str(tmp_path / "race" / "model")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.starmap(_save_or_exists, [(prefix, out, 1.0), (prefix, out, 2.0)])
    assert sorted(r[0] for r in results) == ["exists", "saved"]
    saved = next(r[1] for r in results if r[0] == "saved")
    ckpt = Checkpoint(out)
    assert ckpt.verify().ok
    np.testing.assert_array_equal(ckpt.read("dense/bias"), np.full(3, saved, np.float32))


def _save_or_exists(prefix, out, value):
    import numpy as np

    from restorekit import CheckpointEditor, OutputExistsError

    editor = CheckpointEditor(prefix)
    editor.set("dense/bias", np.full(3, value, np.float32))
    try:
        editor.save(out)
        return "saved", value
    except OutputExistsError:
        return "exists", value


def test_save_in_place_refuses_to_drop_an_edit_saved_since_it_opened(small_checkpoint):
    prefix, values = small_checkpoint
    first, second = CheckpointEditor(prefix), CheckpointEditor(prefix)
    first.set("dense/bias", np.zeros(3, np.float32))
    second.set("logits/bias", np.zeros(5, np.float32))
    second.list()  # both have read the source
    first.save_in_place()
    with pytest.raises(OutputError, match="changed since this editor read it"):
        second.save_in_place()
    after = Checkpoint(prefix)
    np.testing.assert_array_equal(after.read("dense/bias"), np.zeros(3, np.float32))  # the first edit stands
    np.testing.assert_array_equal(after.read("logits/bias"), values["logits/bias"])


def test_a_copied_directory_whose_state_file_names_the_original_warns_and_refuses_in_place_edits(tmp_path):
    import shutil

    from conftest import save_variables

    original = tmp_path / "original"
    prefix = save_variables(original / "model.ckpt", {"v": np.float32([1, 2])})  # state file: absolute paths
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    with pytest.warns(RestoreKitWarning, match="outside that directory"):
        editor = CheckpointEditor(str(copy))
    assert editor.prefix == prefix  # as TF's latest_checkpoint resolves it
    editor.set("v", np.float32([9, 9]))
    with pytest.raises(OutputError, match="opened through a 'checkpoint' state file"):
        editor.save_in_place()
    np.testing.assert_array_equal(Checkpoint(prefix).read("v"), [1, 2])  # the original is untouched
    exact = CheckpointEditor(str(copy / "model.ckpt"))  # the exact prefix edits the copy
    exact.set("v", np.float32([9, 9]))
    exact.save_in_place()
    np.testing.assert_array_equal(Checkpoint(str(copy / "model.ckpt")).read("v"), [9, 9])
    np.testing.assert_array_equal(Checkpoint(prefix).read("v"), [1, 2])


def test_rename_of_a_variable_with_slots_says_the_slots_stay_and_how_to_move_them(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    editor = CheckpointEditor(prefix)
    with pytest.warns(RestoreKitWarning, match=r"slots 'dense/kernel/Momentum' keep the old name") as caught:
        editor.rename("dense/kernel", "encoder/kernel")
    hint = str(caught[0].message)
    rule = hint[hint.index("rename_all(") + len("rename_all("):hint.index("]) moves") + 1]
    again = CheckpointEditor(prefix)
    again.rename_all(eval(rule))  # the suggested rule moves the variable and its slot together
    assert {"encoder/kernel", "encoder/kernel/Momentum"} <= set(e.name for e in again.list(".*"))


def test_copy_rows_counts_negative_rows_from_the_end_and_says_the_range(small_checkpoint):
    prefix, values = small_checkpoint
    editor = CheckpointEditor(prefix)
    editor.copy_rows("dense/kernel", [-1], [0])
    np.testing.assert_array_equal(editor.get("dense/kernel")[0], values["dense/kernel"][-1])
    with pytest.raises(EditError, match=r"must be integers from -4 to 3"):
        editor.copy_rows("dense/kernel", [4], [0])


def test_check_kept_false_keeps_a_rename_index_only_and_the_bad_bytes_still_fail_on_read(small_checkpoint, tmp_path,
                                                                                         monkeypatch):
    import shutil

    import restorekit.edit._save_tf as save_tf_module

    prefix, values = small_checkpoint
    copy = tmp_path / "src"
    shutil.copytree(os.path.dirname(prefix), copy)
    src = str(copy / os.path.basename(prefix))
    entry = Checkpoint(src).bundle_entry("logits/kernel")
    with open(src + ".data-00000-of-00001", "r+b") as f:
        f.seek(entry.offset)
        first = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([first[0] ^ 1]))
    reads = []
    monkeypatch.setattr(save_tf_module, "_start_check", lambda *a, **k: reads.append(a))
    editor = CheckpointEditor(src)
    editor.rename("dense/bias", "encoder/bias")
    out = editor.save(tmp_path / "out" / "model", check_kept=False)
    assert reads == []  # no kept tensor was read at save time
    np.testing.assert_array_equal(Checkpoint(out).read("encoder/bias"), values["dense/bias"])
    with pytest.raises(ChecksumMismatchError):
        Checkpoint(out).read("logits/kernel")  # checked lazily, when read
    monkeypatch.undo()
    with pytest.raises(ChecksumMismatchError):  # the default still refuses at save time
        CheckpointEditor(src).save(tmp_path / "out2" / "model")
