"""restorekit inspect, verify and diff over safetensors, .pt and .npz files and across formats (diff --by)."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from restorekit.cli import main
from restorekit.export import convert
from conftest import requires_torch, save_variables

VALUES = {"dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "dense/bias": np.array([1, -2, 3], np.int64)}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _write(path):
    """``path`` written by its format's own library (safetensors.numpy, torch.save, np.savez)."""
    if path.suffix == ".safetensors":
        import safetensors.numpy

        safetensors.numpy.save_file(VALUES, str(path))
    elif path.suffix == ".pt":
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in VALUES.items()}, path)
    else:
        np.savez(path, **VALUES)
    return path


SUFFIXES = [pytest.param(".safetensors", id="safetensors"), pytest.param(".pt", id="torch", marks=requires_torch),
            pytest.param(".npz", id="npz")]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_inspect_lists_a_file_of_another_format(capsys, tmp_path, suffix):
    path = _write(tmp_path / f"m{suffix}")
    code, out, err = run(capsys, "inspect", path)
    assert code == 0, err
    assert out.splitlines()[0].split() == ["NAME", "SHAPE", "DTYPE", "SIZE"]
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:-1]}
    assert rows["dense/kernel"] == ["[3,", "4]", "float32", "48", "B"]
    assert rows["dense/bias"] == ["[3]", "int64", "24", "B"]
    assert out.splitlines()[-1].startswith("2 tensors, 72 B in ")
    code, out, _ = run(capsys, "inspect", path, "--json", "--filter", "dense/kernel")
    data = json.loads(out)
    assert data["format"] == {".safetensors": "safetensors", ".pt": "torch", ".npz": "npz"}[suffix]
    assert [(e["name"], e["path"], e["shape"], e["dtype"]) for e in data["entries"]] == [
        ("dense/kernel", "dense/kernel", [3, 4], "float32")]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_inspect_tensor_prints_its_values(capsys, tmp_path, suffix):
    path = _write(tmp_path / f"m{suffix}")
    code, out, _ = run(capsys, "inspect", path, "--tensor", "dense/bias", "--json")
    assert code == 0 and json.loads(out)["values"] == [1, -2, 3]
    code, out, err = run(capsys, "inspect", path, "--tensor", "dense/bais")
    assert code == 3 and "Closest: 'dense/bias'" in err


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_verify_reads_every_tensor_and_says_what_the_format_can_check(capsys, tmp_path, suffix):
    path = _write(tmp_path / f"m{suffix}")
    code, out, _ = run(capsys, "verify", path)
    assert code == 0
    assert out.splitlines()[0].endswith("2 tensors, 72 bytes checked: ok")
    assert "no checksum" in out or "no per-tensor checksum" in out
    code, out, _ = run(capsys, "verify", path, "--json")
    data = json.loads(out)
    assert data["ok"] and data["tensors"] == 2 and "reads back" in data["checks"]


@requires_torch
def test_verify_of_a_damaged_torch_record_exits_1(capsys, tmp_path):
    import struct

    path = _write(tmp_path / "m.pt")
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and "1 with problems" in out and "fails its CRC-32" in out


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_diff_a_checkpoint_and_its_conversion(capsys, tmp_path, suffix):
    prefix = save_variables(tmp_path / "tf" / "m", VALUES)
    convert(prefix, tmp_path / f"c{suffix}")
    code, out, err = run(capsys, "diff", prefix, tmp_path / f"c{suffix}")
    assert code == 0, out + err
    assert out.splitlines()[-1].startswith("equal: 2 tensors identical") and "paired by key" in out


def test_diff_two_conversions_and_a_torch_layout_one(capsys, tmp_path):
    prefix = save_variables(tmp_path / "tf" / "m", VALUES)
    convert(prefix, tmp_path / "c.safetensors")
    convert(prefix, tmp_path / "c.npz")
    assert run(capsys, "diff", tmp_path / "c.safetensors", tmp_path / "c.npz")[0] == 0
    convert(prefix, tmp_path / "t.safetensors", layout="torch")  # torch axes inside; the record undoes them
    assert run(capsys, "diff", prefix, tmp_path / "t.safetensors")[0] == 0


@pytest.mark.parametrize("suffix", [s for s in SUFFIXES if s.id != "safetensors"])
def test_diff_reports_a_changed_value_across_formats(capsys, tmp_path, suffix):
    import safetensors.numpy

    _write(tmp_path / f"m{suffix}")
    safetensors.numpy.save_file({**VALUES, "dense/kernel": VALUES["dense/kernel"] * 2}, str(tmp_path / "m.safetensors"))
    code, out, _ = run(capsys, "diff", tmp_path / f"m{suffix}", tmp_path / "m.safetensors")
    assert code == 1
    assert "values     dense/kernel: max abs diff 11 (11 elements differ)" in out
    assert out.splitlines()[-1].startswith("different: 1 tensors identical")


def _keras_pair(tmp_path):
    import keras
    from test_keras_files import write_legacy

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d1"), keras.layers.Dense(2, name="d2")],
                             name="seq")
    model.save_weights(tmp_path / "m.weights.h5")
    return tmp_path / "m.weights.h5", write_legacy(tmp_path / "legacy.h5", model)


def test_diff_pairs_keras_files_by_readable_path_and_by_can_force_keys(capsys, tmp_path):
    weights_h5, legacy = _keras_pair(tmp_path)
    code, out, _ = run(capsys, "diff", weights_h5, legacy)
    assert code == 0
    assert out.splitlines()[-1] == ("equal: 4 tensors identical, 0 only in A, 0 only in B, 0 changed shape/dtype, "
                                    "0 changed values; paired by readable path (the keys pair fewer tensors; "
                                    "--by key to pair by key)")
    code, out, _ = run(capsys, "diff", weights_h5, legacy, "--by", "key")
    assert code == 1 and out.splitlines()[-1].endswith("4 only in A, 4 only in B, 0 changed shape/dtype, "
                                                       "0 changed values; paired by key")
    code, out, _ = run(capsys, "diff", weights_h5, legacy, "--by", "path", "--json")
    assert code == 0 and json.loads(out)["paired_by"] == "path"
    assert run(capsys, "diff", weights_h5, legacy, "--by", "name")[0] == 2


# ------------------------------------------------------------------ refusals: one line, exit 3

def _truncated(tmp_path):
    path = _write(tmp_path / "m.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-7])
    return cut


def _not_torch(tmp_path):
    with zipfile.ZipFile(tmp_path / "m.pt", "w") as archive:
        archive.writestr("readme.txt", "hello")
    return tmp_path / "m.pt"


@pytest.mark.parametrize("make,message", [
    pytest.param(_truncated, "is not a valid safetensors file", id="truncated_safetensors"),
    pytest.param(_not_torch, "is a zip archive but not torch.save's", id="zip_not_torch", marks=requires_torch),
    pytest.param(lambda p: p / "absent.pt", "no file at", id="missing_pt"),
])
@pytest.mark.parametrize("command", ["inspect", "verify", "diff"])
def test_bad_input_is_one_line_and_exit_3(capsys, tmp_path, make, message, command):
    path = make(tmp_path)
    argv = [command, path] + ([_write(tmp_path / "ok.npz")] if command == "diff" else [])
    code, out, err = run(capsys, *argv)
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and err.startswith("restorekit: error: ") and message in err


@pytest.mark.parametrize("command", ["inspect", "convert", "verify", "diff"])
def test_an_existing_file_of_no_known_format_is_named_for_what_it_is_exit_3(capsys, tmp_path, command):
    """Issue 39 finding 2: `inspect pnet.lz4` said "no checkpoint at 'pnet.lz4' (looked for 'pnet.lz4.index')"."""
    path = tmp_path / "pnet.lz4"
    path.write_bytes(b"\x04\x22\x4d\x18\x64\x40\xa7" + bytes(40))  # an LZ4 frame, as joblib compress='lz4' writes
    out = tmp_path / "out"
    out.mkdir()
    argv = [command, path] + ([out / "m.safetensors"] if command == "convert" else [])
    argv += [_write(tmp_path / "ok.npz")] if command == "diff" else []
    code, stdout, err = run(capsys, *argv)
    assert code == 3 and stdout == "" and err.count("\n") == 1
    assert err.startswith(f"restorekit: error: {str(path)!r} is a file, but not a checkpoint restorekit can read: "
                          "it looks like an LZ4 frame")
    assert "looked for" not in err and "onnx" in err
    assert os.listdir(out) == []


def test_inspect_a_safetensors_file_as_a_subprocess(tmp_path):
    path = _write(tmp_path / "m.safetensors")
    done = subprocess.run([sys.executable, "-m", "restorekit", "inspect", str(path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dense/kernel" in done.stdout and "(safetensors)" in done.stdout
