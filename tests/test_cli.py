"""Tests for restorekit/cli.py: every command in-process, bad input, and once as a subprocess."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from restorekit._checkpoint import Checkpoint
from restorekit.cli import COMMANDS, main, register
from conftest import requires_torch, save_variables

tf1 = tf.compat.v1


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out)


def _listing(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _assert_error_line(err):
    lines = err.strip().splitlines()
    assert lines[-1].startswith("restorekit: error: ")
    assert "Traceback" not in err


# ------------------------------------------------------------------ inspect

def test_inspect_prints_a_table(capsys, small_checkpoint):
    prefix, values = small_checkpoint
    code, out, err = run(capsys, "inspect", prefix)
    assert code == 0
    assert out.splitlines()[0].split() == ["NAME", "SHAPE", "DTYPE", "SIZE"]
    assert any(line.split()[:5] == ["dense/kernel", "[4,", "3]", "float32", "48"] for line in out.splitlines())
    assert "6 tensors" in out


def test_inspect_json_with_stats_and_filter(capsys, small_checkpoint):
    prefix, values = small_checkpoint
    code, data = run_json(capsys, "inspect", prefix, "--stats", "--filter", "dense")
    assert code == 0
    assert [e["name"] for e in data["entries"]] == ["dense/bias", "dense/kernel", "dense/kernel/Momentum"]
    kernel = data["entries"][1]
    assert kernel["shape"] == [4, 3] and kernel["dtype"] == "float32" and kernel["nbytes"] == 48
    assert kernel["stats"]["min"] == float(values["dense/kernel"].min())
    assert kernel["stats"]["max"] == float(values["dense/kernel"].max())
    assert kernel["stats"]["nans"] == 0


def test_inspect_stats_count_nans(capsys, tmp_path):
    prefix = save_variables(tmp_path / "m", {"w": np.array([1.0, np.nan, 3.0, np.nan], np.float32)})
    code, data = run_json(capsys, "inspect", prefix, "--stats")
    stats = data["entries"][0]["stats"]
    assert (stats["nans"], stats["min"], stats["max"], stats["mean"]) == (2, 1.0, 3.0, 2.0)


def test_inspect_filter_matching_nothing_is_an_error(capsys, small_checkpoint):
    code, out, err = run(capsys, "inspect", small_checkpoint[0], "--filter", "nothing_here")
    assert code == 3 and out == ""
    _assert_error_line(err)


# ------------------------------------------------------------------ diff

@pytest.fixture
def keras_tf2_checkpoint(tmp_path):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="enc1"), keras.layers.Dense(2, name="head")],
                             name="net")
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "tf2" / "ckpt"))
    return prefix, model


def test_inspect_tf2_shows_readable_paths_and_filters_on_them(capsys, keras_tf2_checkpoint):
    prefix, model = keras_tf2_checkpoint
    code, out, _ = run(capsys, "inspect", prefix, "--filter", "net/enc1")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["PATH", "NAME"]
    assert sorted(line.split()[0] for line in lines[1:-1]) == ["net/enc1/bias", "net/enc1/kernel"]
    assert all(".ATTRIBUTES/VARIABLE_VALUE" in line.split()[1] for line in lines[1:-1])
    code, data = run_json(capsys, "inspect", prefix, "--filter", ".*enc1.*")
    paths = {e["path"]: e["name"] for e in data["entries"]}
    assert {"net/enc1/kernel", "net/enc1/bias"} <= set(paths)  # optimizer slots of enc1 too
    assert all(name.endswith("/.ATTRIBUTES/VARIABLE_VALUE") for name in paths.values())


def test_inspect_filter_matching_nothing_counts_each_entry_once_and_suggests_a_path(capsys, keras_tf2_checkpoint):
    prefix, _ = keras_tf2_checkpoint
    entries = len(Checkpoint(prefix).entries)
    code, out, err = run(capsys, "inspect", prefix, "--filter", "net/enc2")
    assert code == 3 and out == ""
    assert f"among {entries}." in err and "net/enc1/" in err, err


def test_inspect_tensor_prints_values_by_name_or_path(capsys, keras_tf2_checkpoint, small_checkpoint):
    prefix, model = keras_tf2_checkpoint
    code, data = run_json(capsys, "inspect", prefix, "--tensor", "net/head/kernel")
    assert code == 0 and data["shape"] == [4, 2]
    np.testing.assert_array_equal(np.array(data["values"], np.float32), model.get_layer("head").kernel.numpy())
    small, values = small_checkpoint
    code, out, _ = run(capsys, "inspect", small, "--tensor", "dense/bias")
    assert out.splitlines()[0] == "dense/bias [3] float32"
    assert f"{values['dense/bias'][0]:.4f}"[:5] in out
    code, out, err = run(capsys, "inspect", small, "--tensor", "dense/bais")
    assert code == 3 and "Closest: 'dense/bias'" in err


def test_diff_equal_exits_0(capsys, small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    assert run(capsys, "convert", prefix, tmp_path / "copy", "--to", "tf")[0] == 0
    code, out, err = run(capsys, "diff", prefix, tmp_path / "copy")
    assert code == 0 and out.startswith("equal: 6 tensors identical")


def test_diff_reports_names_shapes_and_values_and_exits_1(capsys, small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    changed = dict(values)
    del changed["global_step"]
    changed["dense/bias"] = values["dense/bias"] + np.float32(0.5)
    changed["logits/bias"] = np.zeros(6, np.float32)
    changed["extra"] = np.ones(2, np.float32)
    other = save_variables(tmp_path / "other", changed)
    code, data = run_json(capsys, "diff", prefix, other)
    assert code == 1 and data["equal"] is False
    assert data["only_in_a"] == ["global_step"] and data["only_in_b"] == ["extra"]
    assert data["changed"] == [
        {"name": "logits/bias", "a": {"shape": [5], "dtype": "float32"}, "b": {"shape": [6], "dtype": "float32"}}
    ]
    [value] = data["values"]
    assert value["name"] == "dense/bias" and value["differing"] == 3
    assert value["max_abs_diff"] == pytest.approx(0.5, abs=1e-6)
    code, out, err = run(capsys, "diff", prefix, other)
    assert code == 1 and "values     dense/bias: max abs diff 0.5" in out
    assert run(capsys, "diff", prefix, other, "--atol", "1")[0] == 1  # names still differ


# ------------------------------------------------------------------ scan

def _meta_graph(path, shapes):
    with tf.Graph().as_default():
        for name, shape in shapes.items():
            tf1.get_variable(name, shape=shape, dtype=tf.float32)
        tf1.train.export_meta_graph(filename=str(path))
    return path


def test_scan_prints_the_report_and_json(capsys, small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    meta = _meta_graph(tmp_path / "full.meta", {"dense/kernel": [4, 3], "dense/bias": [3]})
    code, out, err = run(capsys, "scan", prefix, "--meta-graph", meta)
    assert code == 0 and "matched" in out
    code, data = run_json(capsys, "scan", prefix, "--meta-graph", meta)
    assert code == 0 and data["is_complete"] is True
    assert sorted(r["variable_name"] for r in data["matched"]) == ["dense/bias", "dense/kernel"]


def test_scan_incomplete_exits_1(capsys, small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    meta = _meta_graph(tmp_path / "head.meta", {"dense/kernel": [4, 3], "logits/kernel": [3, 10]})
    code, data = run_json(capsys, "scan", prefix, "--meta-graph", meta)
    assert code == 1 and data["is_complete"] is False
    assert [r["variable_name"] for r in data["shape_mismatched"]] == ["logits/kernel"]


def test_scan_bad_meta_graph_is_an_error(capsys, small_checkpoint, tmp_path):
    bad = tmp_path / "bad.meta"
    bad.write_bytes(b"\x00not a meta graph")
    for meta in [bad, tmp_path / "missing.meta"]:
        code, out, err = run(capsys, "scan", small_checkpoint[0], "--meta-graph", meta)
        assert code == 3 and out == ""
        _assert_error_line(err)


# ------------------------------------------------------------------ edits

def test_rename_with_rules(capsys, small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    code, out, err = run(capsys, "rename", prefix, tmp_path / "out" / "m", "--rule", "^dense/=fc/", "--rule", "kernel=w")
    assert code == 0
    ckpt = Checkpoint(tmp_path / "out" / "m")
    assert "fc/w" in ckpt and "fc/w/Momentum" in ckpt and "logits/w" in ckpt
    np.testing.assert_array_equal(ckpt.read("fc/w"), values["dense/kernel"])


def test_rename_with_a_json_map(capsys, small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"logits/kernel": "head/kernel", "logits/bias": "head/bias"}))
    assert run(capsys, "rename", prefix, tmp_path / "m", "--map", mapping)[0] == 0
    ckpt = Checkpoint(tmp_path / "m")
    assert "logits/kernel" not in ckpt and "dense/kernel" in ckpt
    assert ckpt.read("head/kernel").tobytes() == values["logits/kernel"].tobytes()


@pytest.mark.parametrize(
    "extra",
    [[], ["--rule", "no-equals-sign"], ["--rule", "a=b", "--map", "x.json"]],
    ids=["no-rule", "rule-without-equals", "rule-and-map"],
)
def test_rename_usage_errors_exit_2(capsys, small_checkpoint, tmp_path, extra):
    code, out, err = run(capsys, "rename", small_checkpoint[0], tmp_path / "out" / "m", *extra)
    assert code == 2
    _assert_error_line(err)
    assert _listing(tmp_path / "out") == []


def test_strip_drops_optimizer_slots(capsys, small_checkpoint, tmp_path):
    assert run(capsys, "strip", small_checkpoint[0], tmp_path / "m")[0] == 0
    names = list(Checkpoint(tmp_path / "m").entries)
    assert "dense/kernel/Momentum" not in names and "dense/kernel" in names


def test_cast_to_bfloat16_with_filter(capsys, small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    assert run(capsys, "cast", prefix, tmp_path / "m", "--dtype", "bfloat16", "--filter", "dense")[0] == 0
    ckpt = Checkpoint(tmp_path / "m")
    assert ckpt.entries["dense/kernel"].dtype == "bfloat16"
    assert ckpt.entries["logits/kernel"].dtype == "float32"
    expected = values["dense/kernel"].astype(ml_dtypes.bfloat16)
    assert ckpt.read("dense/kernel").dtype == ml_dtypes.bfloat16
    assert ckpt.read("dense/kernel").tobytes() == expected.tobytes()
    reader = tf.train.load_checkpoint(str(tmp_path / "m"))  # TensorFlow's own reader agrees
    assert reader.get_tensor("dense/kernel").dtype == ml_dtypes.bfloat16
    assert reader.get_tensor("dense/kernel").tobytes() == expected.tobytes()
    assert reader.get_tensor("logits/kernel").tobytes() == values["logits/kernel"].tobytes()


# ------------------------------------------------------------------ convert

@pytest.mark.parametrize("layout", [[], ["--layout", "torch"]], ids=["tf-layout", "torch-layout"])
@pytest.mark.parametrize("suffix", ["safetensors", pytest.param("pt", marks=requires_torch)])
def test_convert_round_trip_then_diff_is_equal(capsys, small_checkpoint, tmp_path, suffix, layout):
    prefix, _ = small_checkpoint
    out = tmp_path / f"m.{suffix}"
    code, text, err = run(capsys, "-q", "convert", prefix, out, *layout)
    assert code == 0 and text == "" and out.exists()
    code, text, err = run(capsys, "convert", out, tmp_path / "back" / "m", "--to", "tf")
    assert code == 0 and "wrote 6 tensors" in text
    assert run(capsys, "diff", prefix, tmp_path / "back" / "m")[0] == 0


def test_convert_to_npz(capsys, small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    assert run(capsys, "convert", prefix, tmp_path / "m.npz")[0] == 0
    with np.load(tmp_path / "m.npz") as data:
        assert data["logits/kernel"].tobytes() == values["logits/kernel"].tobytes()


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{missing}"],
        ["diff", "{missing}", "{src}"],
        ["convert", "{missing}", "{out}/m.safetensors"],
        ["strip", "{missing}", "{out}/m"],
        ["cast", "{missing}", "{out}/m", "--dtype", "float16"],
        ["rename", "{missing}", "{out}/m", "--rule", "a=b"],
    ],
    ids=["inspect", "diff", "convert", "strip", "cast", "rename"],
)
def test_missing_checkpoint_exits_3_and_writes_nothing(capsys, small_checkpoint, tmp_path, argv):
    fill = {"missing": tmp_path / "no" / "model.ckpt", "src": small_checkpoint[0], "out": tmp_path / "out"}
    code, out, err = run(capsys, *[a.format(**fill) for a in argv])
    assert code == 3 and out == ""
    _assert_error_line(err)
    assert "no checkpoint at" in err or "no file at" in err
    assert _listing(tmp_path / "out") == []


def test_corrupt_checkpoint_exits_3(capsys, small_checkpoint, tmp_path):
    bad = tmp_path / "bad" / "model.ckpt"
    bad.parent.mkdir()
    (tmp_path / "bad" / "model.ckpt.index").write_bytes(b"garbage" * 10)
    code, out, err = run(capsys, "convert", bad, tmp_path / "out" / "m.safetensors")
    assert code == 3 and out == ""
    _assert_error_line(err)
    assert _listing(tmp_path / "out") == []


@requires_torch
def test_unsafe_pt_exits_3_and_nothing_runs(capsys, tmp_path):
    from test_export import _evil_files

    marker, files = _evil_files(tmp_path)
    for path in files:
        code, out, err = run(capsys, "convert", path, tmp_path / "out" / "m")
        assert code == 3 and "refusing to load" in err
        _assert_error_line(err)
    assert not marker.exists() and _listing(tmp_path / "out") == []


def test_unknown_target_format_exits_2(capsys, small_checkpoint, tmp_path):
    code, out, err = run(capsys, "convert", small_checkpoint[0], tmp_path / "out" / "m", "--to", "onnx")
    assert code == 2 and "invalid choice: 'onnx'" in err
    assert _listing(tmp_path / "out") == []


def test_output_equal_to_source_exits_3(capsys, small_checkpoint):
    prefix, _ = small_checkpoint
    before = sorted(os.listdir(os.path.dirname(prefix)))
    for argv in (["convert", prefix, prefix, "--to", "tf", "--overwrite"], ["strip", prefix, prefix]):
        code, out, err = run(capsys, *argv)
        assert code == 3
        _assert_error_line(err)
    assert sorted(os.listdir(os.path.dirname(prefix))) == before
    assert len(Checkpoint(prefix)) == 6


def test_help_documents_exit_codes_and_usage_errors_exit_2(capsys):
    code, out, err = run(capsys, "--help")
    assert code == 0 and "exit codes" in out and "convert" in out
    assert run(capsys)[0] == 2
    assert run(capsys, "inspect")[0] == 2
    assert run(capsys, "frobnicate")[0] == 2


def test_register_adds_a_subcommand(capsys):
    def configure(parser):
        parser.add_argument("word")

    try:
        register("echo-test", help="echo a word", configure=configure)(lambda args: print(args.word) or 0)
        assert run(capsys, "echo-test", "hello")[:2] == (0, "hello\n")
    finally:
        COMMANDS.pop("echo-test", None)


def test_python_m_restorekit_runs_as_a_subprocess(small_checkpoint):
    prefix, _ = small_checkpoint
    done = subprocess.run(
        [sys.executable, "-m", "restorekit", "inspect", prefix, "--json"],
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["count"] == 6
    missing = subprocess.run(
        [sys.executable, "-m", "restorekit", "inspect", prefix + "-nope"], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 3 and missing.stderr.startswith("restorekit: error: no checkpoint at")


# ------------------------------------------------------------------ graphs


def _trained_graph(tmp_path):
    """A small dense net: its .meta, its checkpoint, and its output for a fixed input."""
    x_value = np.arange(8, dtype=np.float32).reshape(2, 4)
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("dense/kernel", [4, 3], initializer=tf1.random_normal_initializer(seed=1))
        b = tf1.get_variable("dense/bias", [3], initializer=tf1.constant_initializer(0.5))
        tf.identity(tf.matmul(x, w) + b, name="y")
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            expected = sess.run("y:0", {x: x_value})
            prefix = saver.save(sess, str(tmp_path / "net" / "model.ckpt"))
    return prefix, prefix + ".meta", x_value, expected


def test_graph_inspect_freeze_unfreeze_round_trip(capsys, tmp_path):
    prefix, meta, x_value, expected = _trained_graph(tmp_path)
    code, data = run_json(capsys, "graph", "inspect", meta)
    assert code == 0
    assert [i["name"] for i in data["inputs"]] == ["x:0"]
    assert {v["name"] for v in data["variables"]} == {"dense/kernel", "dense/bias"}

    frozen = tmp_path / "frozen.pb"
    code, out, _ = run(capsys, "freeze", prefix, meta, "--outputs", "y", "--out", frozen)
    assert code == 0 and frozen.exists() and "wrote" in out
    graph_def = tf1.GraphDef.FromString(frozen.read_bytes())
    with tf.Graph().as_default():
        tf1.import_graph_def(graph_def, name="")
        with tf1.Session() as sess:
            np.testing.assert_array_equal(sess.run("y:0", {"x:0": x_value}), expected)

    code, out, _ = run(capsys, "unfreeze", frozen, tmp_path / "back" / "model.ckpt")
    assert code == 0
    original, back = Checkpoint(prefix), Checkpoint(tmp_path / "back" / "model.ckpt")
    assert set(back) == set(original)
    for name in original:
        np.testing.assert_array_equal(back.read(name), original.read(name))


def test_freeze_with_an_unknown_output_exits_3_and_writes_nothing(capsys, tmp_path):
    prefix, meta, _, _ = _trained_graph(tmp_path)
    code, _, err = run(capsys, "freeze", prefix, meta, "--outputs", "why", "--out", tmp_path / "f.pb")
    assert code == 3 and not (tmp_path / "f.pb").exists()
    _assert_error_line(err)
    assert "'y'" in err  # the closest name


def test_graph_inspect_of_a_text_file_exits_3(capsys, tmp_path):
    bogus = tmp_path / "notes.pb"
    bogus.write_text("this is not a graph")
    code, _, err = run(capsys, "graph", "inspect", bogus)
    assert code == 3
    _assert_error_line(err)


def test_a_command_needing_missing_tensorflow_exits_3_with_the_install_hint(capsys, small_checkpoint, tmp_path, monkeypatch):
    import sys

    from restorekit._tensorflow import import_tensorflow
    from restorekit.errors import MissingDependencyError

    meta = _meta_graph(tmp_path / "m.meta", {"dense/kernel": [4, 3]})
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # as if TensorFlow were not installed
    with pytest.raises(MissingDependencyError, match=r"restorekit\[tf\]"):
        import_tensorflow()
    prefix, _ = small_checkpoint
    code, _, err = run(capsys, "scan", prefix, "--meta-graph", meta)
    assert code == 3
    _assert_error_line(err)
    assert "pip install 'restorekit[tf]'" in err
    code, out, _ = run(capsys, "inspect", prefix)  # listing never needs TensorFlow
    assert code == 0 and "dense/kernel" in out


# ------------------------------------------------------------------ edits: outputs, state file, messages

@pytest.mark.parametrize("command", [["strip"], ["rename", "--rule", "^dense/=fc/"], ["cast", "--dtype", "bfloat16"]])
def test_edit_commands_refuse_an_existing_output_until_overwrite(capsys, small_checkpoint, tmp_path, command):
    prefix, values = small_checkpoint
    out = tmp_path / "out" / "model.ckpt"
    name, *options = command
    assert run(capsys, name, prefix, out, *options)[0] == 0
    code, _, err = run(capsys, name, prefix, out, *options)
    assert code == 3 and "--overwrite" in err and "overwrite=True" not in err
    _assert_error_line(err)
    code, out_text, _ = run(capsys, name, prefix, out, *options, "--overwrite")
    assert code == 0 and f"wrote {str(out)!r}" in out_text


def test_edit_command_into_a_directory_reports_the_prefix_and_can_update_the_state_file(capsys, small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    directory = tmp_path / "stripped"
    directory.mkdir()
    code, out, err = run(capsys, "strip", prefix, directory, "--update-state-file")
    written = str(directory / os.path.basename(prefix))
    assert code == 0 and f"wrote {written!r}" in out
    assert tf.train.latest_checkpoint(str(directory)) == written
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = run(capsys, "inspect", directory)
    assert code == 0 and not caught  # no fallback warning: the state file names the checkpoint


def test_source_as_output_names_the_problem_in_cli_terms(capsys, small_checkpoint):
    prefix, _ = small_checkpoint
    code, _, err = run(capsys, "strip", prefix, prefix)
    assert code == 3 and "is the source checkpoint" in err and "save_in_place" not in err


def test_warnings_print_as_one_line(small_checkpoint, tmp_path):
    import shutil

    prefix, _ = small_checkpoint
    directory = tmp_path / "no_state"
    directory.mkdir()
    for f in os.listdir(os.path.dirname(prefix)):
        if f.startswith(os.path.basename(prefix)):
            shutil.copy(os.path.join(os.path.dirname(prefix), f), directory)
    # a subprocess: pytest records warnings in-process instead of printing them
    done = subprocess.run([sys.executable, "-m", "restorekit", "inspect", str(directory)],
                          capture_output=True, text=True, timeout=120)
    code, err = done.returncode, done.stderr
    assert code == 0
    assert err.strip().splitlines() == [
        f"restorekit: warning: {str(directory)!r} has no 'checkpoint' state file; using {str(directory / os.path.basename(prefix))!r}"
    ]


def test_cast_to_an_integer_exits_3_and_writes_nothing(capsys, small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    code, _, err = run(capsys, "cast", prefix, tmp_path / "out" / "m", "--dtype", "int8")
    assert code == 3 and "truncate" in err
    assert _listing(tmp_path / "out") == []


def test_negative_atol_is_a_usage_error(capsys, small_checkpoint):
    prefix, _ = small_checkpoint
    assert run(capsys, "diff", prefix, prefix, "--atol", "-1")[0] == 2


def test_output_cut_short_by_the_reader_exits_quietly(tmp_path):
    from restorekit._bundle.writer import BundleWriter

    prefix = str(tmp_path / "many" / "m")
    with BundleWriter(prefix) as w:
        for i in range(4000):
            w.add(f"layer_{i:05d}/a_rather_long_variable_name/kernel", np.zeros(1, np.float32))
    proc = subprocess.Popen([sys.executable, "-m", "restorekit", "inspect", prefix],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""


def test_diff_names_nans_in_different_places_and_says_within_tolerance(capsys, tmp_path):
    a = save_variables(tmp_path / "a" / "m", {"x": np.array([1.0, np.nan, 3.0], np.float32), "y": np.float32(1.0)})
    b = save_variables(tmp_path / "b" / "m", {"x": np.array([1.0, 2.0, np.nan], np.float32), "y": np.float32(1.001)})
    code, out, _ = run(capsys, "diff", a, b, "--atol", "0.01")
    assert code == 1
    assert "values     x: NaNs in different places (2 elements differ)" in out
    assert "1 tensors equal within 0.01" in out


# ------------------------------------------------------------------ one line, whatever fails (issue 14 items 14, 15)

def test_graph_without_a_subcommand_is_a_usage_error(capsys):
    code, out, err = run(capsys, "graph")
    assert code == 2 and "needs a subcommand" in err and "Traceback" not in err


def _raising_command(exc):
    register("raise-test", help="raise")(lambda args: (_ for _ in ()).throw(exc))


@pytest.mark.parametrize("exc", [
    tf.errors.FailedPreconditionError(None, None, "Error executing an HTTP request: could not resolve host"),
    MemoryError("cannot allocate 4 TiB"),
    UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
], ids=["tensorflow-op-error", "memory-error", "decode-error"])
def test_bad_input_from_below_is_one_line_with_exit_3(capsys, exc):
    try:
        _raising_command(exc)
        code, _, err = run(capsys, "raise-test")
    finally:
        COMMANDS.pop("raise-test", None)
    assert code == 3
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"restorekit: error: {type(exc).__name__}: ")


def test_a_bug_still_shows_its_traceback(capsys):
    try:
        _raising_command(KeyError("a bug"))
        with pytest.raises(KeyError):
            main(["raise-test"])
    finally:
        COMMANDS.pop("raise-test", None)


@pytest.mark.slow
def test_commands_that_load_tensorflow_print_no_native_log_lines(tmp_path):
    prefix, meta, _, _ = _trained_graph(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "restorekit", "scan", prefix, "--meta-graph", meta],
        capture_output=True, text=True, timeout=180, cwd=os.path.dirname(os.path.dirname(__file__)), env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("restorekit: ")
    assert done.stderr == ""


def test_strip_writes_only_what_is_kept_unless_link_is_asked(capsys, resnet_checkpoint, tmp_path):
    source_bytes = sum(os.path.getsize(os.path.join(os.path.dirname(resnet_checkpoint), n))
                       for n in os.listdir(os.path.dirname(resnet_checkpoint))
                       if n.startswith(os.path.basename(resnet_checkpoint) + ".data-"))
    code, out, _ = run(capsys, "strip", resnet_checkpoint, tmp_path / "small" / "model")
    assert code == 0
    shards = [n for n in os.listdir(tmp_path / "small") if ".data-" in n]
    compact = sum(os.path.getsize(tmp_path / "small" / n) for n in shards)
    assert compact < 0.6 * source_bytes  # Momentum slots are about half of the bytes
    assert "on disk)" in out
    kept = Checkpoint(str(tmp_path / "small" / "model"))
    assert all("Momentum" not in n for n in kept.entries)
    name = "resnet_v1_50/conv1/weights"
    np.testing.assert_array_equal(kept.read(name), Checkpoint(resnet_checkpoint).read(name))
    code, _, _ = run(capsys, "strip", resnet_checkpoint, tmp_path / "linked" / "model", "--link")
    linked = sum(os.path.getsize(tmp_path / "linked" / n) for n in os.listdir(tmp_path / "linked") if ".data-" in n)
    assert code == 0 and linked == source_bytes


def test_verify_exits_0_when_sound_and_1_naming_a_flipped_tensor(capsys, small_checkpoint, tmp_path):
    import shutil

    prefix, _ = small_checkpoint
    code, data = run_json(capsys, "verify", prefix)
    assert code == 0 and data["ok"] and data["tensors"] == 6
    copy = tmp_path / "copy"
    shutil.copytree(os.path.dirname(prefix), copy)
    bad = str(copy / os.path.basename(prefix))
    entry = Checkpoint(bad).bundle_entry("logits/kernel")
    with open(bad + ".data-00000-of-00001", "r+b") as f:
        f.seek(entry.offset + 3)
        byte = f.read(1)
        f.seek(entry.offset + 3)
        f.write(bytes([byte[0] ^ 0x10]))
    code, out, _ = run(capsys, "verify", bad)
    assert code == 1 and "logits/kernel" in out
    code, data = run_json(capsys, "verify", bad)
    assert [(p["name"], p["kind"]) for p in data["problems"]] == [("logits/kernel", "checksum")]


def test_diff_of_tf2_checkpoints_prints_readable_paths(capsys, tmp_path):
    import keras

    def model(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head")], name="net")

    a = tf.train.Checkpoint(model=model(0)).write(str(tmp_path / "a" / "ckpt"))
    b = tf.train.Checkpoint(model=model(1)).write(str(tmp_path / "b" / "ckpt"))
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith("values")]
    assert any(line.startswith("values     net/head/kernel (") and ".ATTRIBUTES/VARIABLE_VALUE)" in line
               for line in lines)
    code, data = run_json(capsys, "diff", a, b)
    assert "net/head/kernel" in data["paths"].values()


# ------------------------------------------------------------------ output paths (issue 14 items 13, 14)

def test_convert_into_an_existing_directory_or_a_trailing_slash_writes_inside(capsys, small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    st = tmp_path / "model.safetensors"
    assert run(capsys, "convert", prefix, st)[0] == 0
    existing = tmp_path / "existing"
    existing.mkdir()
    assert run(capsys, "convert", st, existing)[0] == 0
    assert os.path.exists(existing / "model.index")  # inside, under the source's name
    assert not os.path.exists(str(existing) + ".index")
    assert run(capsys, "convert", prefix, str(tmp_path / "fresh") + "/")[0] == 0
    assert os.path.exists(tmp_path / "fresh" / (os.path.basename(prefix) + ".index"))
    np.testing.assert_array_equal(Checkpoint(str(existing / "model")).read("dense/bias"), values["dense/bias"])


def test_an_unknown_output_extension_is_refused_not_written_as_a_tf_checkpoint(capsys, small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run(capsys, "convert", prefix, out / "model.onnx")
    assert code == 3 and "does not write '.onnx' files" in err
    assert os.listdir(out) == []
    assert run(capsys, "convert", prefix, out / "model.onnx", "--to", "tf")[0] == 0  # when asked, it does


def test_saving_under_a_path_whose_parent_is_a_file_is_one_clear_error(capsys, small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    (tmp_path / "afile").write_text("x")
    code, _, err = run(capsys, "strip", prefix, tmp_path / "afile" / "sub" / "model")
    assert code == 3 and "is a file, not a directory" in err and "Traceback" not in err
    from restorekit.edit import CheckpointEditor
    from restorekit.errors import OutputError

    with pytest.raises(OutputError, match="is a file, not a directory"):
        CheckpointEditor(prefix).save(tmp_path / "afile" / "model")
    assert sorted(os.listdir(tmp_path)) == ["afile", "ckpt"]


def test_editor_save_to_a_trailing_slash_writes_inside_the_new_directory(small_checkpoint, tmp_path):
    from restorekit.edit import CheckpointEditor

    prefix, _ = small_checkpoint
    out = CheckpointEditor(prefix).save(str(tmp_path / "newdir") + "/")
    assert out == str(tmp_path / "newdir" / os.path.basename(prefix))
    assert not os.path.exists(str(tmp_path / "newdir") + ".index")


def test_a_remote_path_tensorflow_cannot_reach_is_one_error_line_naming_it(capsys, monkeypatch):
    # What `inspect gs://no-such-bucket/x` meets offline, raised here without the network (and its 20 s of retries):
    # TF's first line names neither the path nor the bucket.
    def unreachable(path):
        raise tf.errors.FailedPreconditionError(
            None, None, "Error executing an HTTP request: libcurl code 6 meaning 'Could not resolve hostname'\n"
                        f"\t when reading metadata of {path}")

    monkeypatch.setattr(tf.io.gfile, "exists", unreachable)
    code, out, err = run(capsys, "inspect", "gs://no-such-bucket/x")
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and err.startswith("restorekit: error: cannot read 'gs://no-such-bucket/x")
    assert "FailedPreconditionError" in err and "Could not resolve hostname" in err
