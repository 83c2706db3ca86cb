"""The CLI words an error's advice as its own flags and commands, never as Python calls (issue 39)."""

import os
import re

import keras
import numpy as np
import pytest

from restorekit.cli import EXIT_ERROR, main
from restorekit.edit import CheckpointEditor
from restorekit.errors import InvalidArgumentError, OptionNotApplicableError, OutputNameError, SourceMismatchError
from conftest import import_torch, requires_torch, save_variables

PYTHON_ADVICE = re.compile(r"\w+=(True|False|None|'|\d)|restorekit\.\w+\(|CheckpointEditor|pass to=")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err):
    lines = err.strip().splitlines()
    assert lines[-1].startswith("restorekit: error: ") and "Traceback" not in err
    text = lines[-1]
    assert not PYTHON_ADVICE.search(text), text
    return text


@pytest.fixture
def keras_archive(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    path = tmp_path / "m.keras"
    model.save(path)
    return path


def test_strip_to_a_keras_name_names_no_to_flag(capsys, keras_archive, tmp_path):
    # strip has no --to: the advice must not name one (it said "pass to='tf'").
    code, _, err = run(capsys, "strip", keras_archive, tmp_path / "out.keras")
    text = error_line(err)
    assert code == EXIT_ERROR
    assert "'.keras'" in text and ".weights.h5" in text and "--to" not in text
    assert not (tmp_path / "out.keras").exists()


def test_convert_to_a_keras_name_names_the_to_flag(capsys, small_checkpoint, tmp_path):
    code, _, err = run(capsys, "convert", small_checkpoint[0], tmp_path / "out.keras")
    assert code == EXIT_ERROR
    assert "pass --to tf to write a TF checkpoint" in error_line(err)
    assert not (tmp_path / "out.keras").exists()


def test_the_python_api_keeps_its_keyword_advice(keras_archive, tmp_path):
    with pytest.raises(OutputNameError, match=r"pass to='tf' to write a TF checkpoint"):
        CheckpointEditor(keras_archive).save(tmp_path / "out.keras")


@requires_torch
def test_cast_of_a_torch_file_names_the_convert_command(capsys, tmp_path):
    torch = import_torch()
    path = tmp_path / "pnet.pt"
    torch.save({"w": torch.ones(2, 3)}, path)
    code, _, err = run(capsys, "cast", path, tmp_path / "out", "--dtype", "float16")
    text = error_line(err)
    assert code == EXIT_ERROR
    assert f"convert it first (restorekit convert {path} model.ckpt)" in text
    assert "restorekit rename, strip and cast edit TF checkpoints" in text
    assert os.listdir(tmp_path) == ["pnet.pt"]
    with pytest.raises(InvalidArgumentError, match=re.escape(f"restorekit.convert({str(path)!r}, 'model.ckpt')")):
        CheckpointEditor(path)


def test_an_option_that_does_not_apply_is_named_as_a_flag(capsys, small_checkpoint, tmp_path):
    code, _, err = run(capsys, "convert", small_checkpoint[0], tmp_path / "x.npz", "--num-shards", "2")
    assert code == EXIT_ERROR
    text = error_line(err)
    assert text.startswith("restorekit: error: --num-shards 2 does not apply to npz outputs")
    assert text.endswith("--max-shard-size splits the other formats that shard.")
    assert not (tmp_path / "x.npz").exists()
    with pytest.raises(OptionNotApplicableError, match=r"^num_shards=2 does not apply.* max_shard_size= splits"):
        from restorekit import convert
        convert(small_checkpoint[0], tmp_path / "x.npz", num_shards=2)


def test_a_to_that_contradicts_the_name_is_named_as_a_flag(capsys, small_checkpoint, tmp_path):
    code, _, err = run(capsys, "convert", small_checkpoint[0], tmp_path / "x.safetensors", "--to", "npz")
    text = error_line(err)
    assert code == EXIT_ERROR
    assert "but --to npz asks for npz" in text and "leave out --to npz to write safetensors" in text


def test_average_of_sources_that_differ_names_the_intersection_flag(capsys, tmp_path):
    a = save_variables(tmp_path / "a" / "m.ckpt", {"w": np.ones(3, np.float32), "b": np.ones(2, np.float32)})
    b = save_variables(tmp_path / "b" / "m.ckpt", {"w": np.ones(3, np.float32)})
    code, _, err = main_err = run(capsys, "average", a, b, tmp_path / "out.npz")
    assert code == EXIT_ERROR, main_err
    assert "Pass --intersection to average only the entries they share alike." in err
    assert "intersection=True" not in err
    assert not (tmp_path / "out.npz").exists()
    from restorekit import average
    with pytest.raises(SourceMismatchError, match=r"Pass intersection=True"):
        average([a, b], tmp_path / "out.npz")


def test_exists_errors_name_the_overwrite_flag_only_where_the_command_has_one():
    from restorekit.errors import OutputExistsError

    error = OutputExistsError(path="out.npz")
    assert str(error) == "'out.npz' exists; pass overwrite=True to replace it"
    assert str(error.for_cli({"overwrite"})) == "'out.npz' exists; pass --overwrite to replace it"
    assert str(error.for_cli(set())) == "'out.npz' exists; remove it first"
    again = error.for_cli({"overwrite"})
    assert isinstance(again, OutputExistsError) and again.path == "out.npz" and str(error).endswith("overwrite=True to replace it")


def test_unfreeze_onto_an_existing_checkpoint_names_the_overwrite_flag(capsys, small_checkpoint, tmp_path):
    import tensorflow as tf

    pb = tmp_path / "f.pb"
    with tf.Graph().as_default() as graph:
        tf.identity(tf.constant(np.ones([3, 3], np.float32)), name="out")
    pb.write_bytes(graph.as_graph_def().SerializeToString())
    prefix = small_checkpoint[0]
    before = sorted(os.listdir(os.path.dirname(prefix)))
    code, _, err = run(capsys, "unfreeze", pb, prefix, "--weights", "large")
    assert code == EXIT_ERROR
    text = error_line(err)
    assert "exists" in text and "pass --overwrite to replace it" in text, text
    assert sorted(os.listdir(os.path.dirname(prefix))) == before


def test_an_output_another_writer_holds_is_not_reworded_as_exists(capsys, small_checkpoint, tmp_path):
    # The lock's message stays a lock's (it was reworded "exists; pass --overwrite"), and names no wait=True.
    import threading

    from restorekit._bundle import locking

    out = tmp_path / "out.npz"
    stop, ready = threading.Event(), threading.Event()

    def hold():
        with locking.output_lock(str(out)):
            ready.set()
            stop.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert ready.wait(30)
        code, _, err = run(capsys, "convert", small_checkpoint[0], out)
    finally:
        stop.set()
        thread.join(30)
    text = error_line(err)
    assert code == EXIT_ERROR
    assert "another restorekit process" in text and "is writing" in text and "wait" in text, text
    assert "--overwrite" not in text and not out.exists()
