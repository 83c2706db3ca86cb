"""Tests for restorekit/export/_targets.py: the output format a name and ``to`` ask for, and names refused."""

import os

import numpy as np
import pytest

from restorekit._checkpoint import Checkpoint
from restorekit.cli import main
from restorekit.errors import InvalidArgumentError
from restorekit.export import convert, export_checkpoint, target_format
from restorekit.export._targets import OutputNameError
from conftest import write_bundle


@pytest.fixture
def prefix(tmp_path):
    return write_bundle(tmp_path / "src" / "m", {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                                                 "global_step": np.int64(5)})


def _listing(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


@pytest.mark.parametrize(
    "name, to",
    [("x.safetensors", "torch"), ("x.safetensors", "tf"), ("x.pt", "safetensors"), ("x.npz", "torch"),
     ("x.weights.h5", "safetensors")],
    ids=["safetensors-name-to-torch", "safetensors-name-to-tf", "pt-name-to-safetensors", "npz-name-to-torch",
         "keras-weights-name-to-safetensors"],
)
def test_a_to_that_contradicts_the_extension_is_refused_and_nothing_written(prefix, tmp_path, name, to):
    out = tmp_path / "out" / name
    with pytest.raises(OutputNameError, match=rf"names a .* file .* but to={to!r} asks for {to}") as info:
        convert(prefix, out, to=to)
    assert isinstance(info.value, InvalidArgumentError) and info.value.path == str(out)
    assert _listing(tmp_path / "out") == []


def test_export_checkpoint_names_the_target_option_to_as_every_verb_does(prefix, tmp_path):
    with pytest.raises(OutputNameError, match="to='npz'"):
        export_checkpoint(prefix, tmp_path / "x.pt", to="npz")
    assert not os.path.exists(tmp_path / "x.pt")


@pytest.mark.parametrize(
    "suffix, hint",
    [(".keras", "'*.weights.h5'"), (".npy", "'.npz'"),
     (".st", "Did you mean '.safetensors'?"), (".safetensor", "Did you mean '.safetensors'?"),
     (".safetensorss", "Did you mean '.safetensors'?"), (".SafeTensor", "Did you mean '.safetensors'?"),
     (".npzz", "Did you mean '.npz'?"), (".onnx", "Nothing was written")],
    ids=["keras", "npy", "st", "safetensor", "safetensorss", "upper-case", "npzz", "onnx"],
)
def test_an_odd_or_mistyped_extension_is_refused_with_a_hint_and_nothing_written(prefix, tmp_path, suffix, hint):
    out = tmp_path / "out" / f"model{suffix}"
    with pytest.raises(OutputNameError) as info:
        convert(prefix, out)
    message = str(info.value)
    assert f"does not write {suffix.lower()!r} files" in message and hint in message and "to='tf'" in message
    assert _listing(tmp_path / "out") == []


@pytest.mark.parametrize("suffix", [".h5", ".hdf5", ".H5"], ids=["h5", "hdf5", "upper-case"])
def test_a_legacy_keras_h5_is_refused_from_a_tf_checkpoint_with_nothing_written(prefix, tmp_path, suffix):
    out = tmp_path / "out" / f"model{suffix}"
    with pytest.raises(OutputNameError) as info:
        convert(prefix, out)
    message = str(info.value)
    assert "only from a legacy Keras 2 .h5 file" in message and "is a TF checkpoint" in message
    assert "'*.weights.h5'" in message and "to='tf'" in message
    with pytest.raises(OutputNameError, match="only from a legacy Keras 2 .h5 file"):
        target_format(out, None)
    assert _listing(tmp_path / "out") == []


@pytest.mark.parametrize("name", ["model.ckpt", "model.ckpt-1000", "model.best", "run.v2", "model"],
                         ids=["ckpt", "ckpt-step", "word", "version", "no-dot"])
def test_tf_prefixes_with_dots_still_convert(prefix, tmp_path, name):
    assert target_format(name, None) == "tf"
    out = tmp_path / "out" / name
    convert(prefix, out)
    assert Checkpoint(str(out)).read("a").tolist() == [[0, 1, 2], [3, 4, 5]]


def test_known_extensions_pick_their_format_and_an_explicit_to_tf_overrides_an_odd_one(prefix, tmp_path):
    assert [target_format(n, None) for n in ("a.pt", "a.PTH", "a.bin", "a.safetensors", "a.npz", "a.weights.h5")] == [
        "torch", "torch", "torch", "safetensors", "npz", "keras"]
    assert target_format("a.safetensors", "safetensors") == "safetensors"
    convert(prefix, tmp_path / "model.h5", to="tf")  # asked for by name: a TF prefix 'model.h5'
    assert Checkpoint(str(tmp_path / "model.h5")).read("a").shape == (2, 3)


def test_cli_words_the_refusals_with_its_flags(capsys, prefix, tmp_path):
    code = main(["convert", prefix, str(tmp_path / "s" / "x.safetensors"), "--to", "torch"])
    err = capsys.readouterr().err
    assert code == 3 and "--to torch" in err and "to='torch'" not in err and "Traceback" not in err
    code = main(["convert", prefix, str(tmp_path / "s" / "x.safetensor")])
    err = capsys.readouterr().err
    assert code == 3 and "Did you mean '.safetensors'?" in err and "--to tf" in err and "to='tf'" not in err
    assert _listing(tmp_path / "s") == []


def test_cli_convert_words_an_existing_output_with_its_flag(capsys, prefix, tmp_path):
    out = tmp_path / "x.safetensors"
    assert main(["-q", "convert", prefix, str(out)]) == 0
    capsys.readouterr()
    assert main(["convert", prefix, str(out)]) == 3
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err


def test_cli_convert_help_lists_the_keras_sources(capsys):
    assert main(["convert", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(s in text for s in (".weights.h5", ".keras", ".weights.json", ".safetensors", ".npz", ".pt"))


def test_cli_reference_usage_lines_name_the_options_the_commands_take():
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
    text = open(os.path.join(docs, "cli.md")).read()
    cast = next(line for line in text.splitlines() if line.startswith("restorekit cast "))
    assert "[--no-check]" in cast and "[--link]" in cast


def test_a_keras_sharded_output_is_refused_by_convert_with_the_editor_named(tmp_path):
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    model.save_weights(str(tmp_path / "k.weights.h5"))
    with pytest.raises(OutputNameError, match=r"CheckpointEditor\(src\)\.save\(out, max_shard_size="):
        convert(str(tmp_path / "k.weights.h5"), str(tmp_path / "m.weights.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.weights.h5"]
