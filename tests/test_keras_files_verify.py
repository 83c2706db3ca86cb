"""Keras files checked: verify, the .keras weights member's zip CRC-32 before conversions, free disk for Keras outputs."""

import os
import shutil
from collections import namedtuple

import numpy as np
import pytest

import restorekit
from restorekit.cli import main
from restorekit.edit import CheckpointEditor
from restorekit.errors import ChecksumMismatchError, InsufficientSpaceError
from restorekit.export import convert
from conftest import requires_torch
from test_keras_files import functional, trained


@pytest.fixture
def saved(tmp_path):
    model = trained(functional(bn=True))
    model.save_weights(tmp_path / "m.weights.h5")
    model.save(tmp_path / "m.keras")
    return tmp_path


@pytest.fixture
def flipped(saved):
    """A copy of m.keras with one byte flipped inside a kernel's data, in the weights member."""
    bad = saved / "bad.keras"
    shutil.copyfile(saved / "m.keras", bad)
    ckpt = restorekit.Checkpoint(bad)
    key = ckpt.object_paths["enc1/kernel"]
    _, offset, size = ckpt.stored_range(key)
    with open(bad, "r+b") as f:
        f.seek(offset + size // 2)
        byte = f.read(1)
        f.seek(offset + size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    return bad, key


def _written(root):
    return sorted(n for n in os.listdir(root) if n not in ("m.keras", "m.weights.h5", "bad.keras"))


@pytest.mark.parametrize("name", ["m.keras", "m.weights.h5"], ids=["keras_archive", "weights_h5"])
def test_verify_a_sound_keras_file(saved, name):
    ckpt = restorekit.Checkpoint(saved / name)
    result = ckpt.verify()
    assert result.ok and result.tensors == len(ckpt) and result.nbytes == ckpt.nbytes > 0
    assert str(result).endswith(": ok")


def test_a_flipped_byte_reads_as_a_changed_value_and_verify_reports_it(saved, flipped, capsys):
    bad, key = flipped
    good = restorekit.Checkpoint(saved / "m.keras").read(key)
    assert not np.array_equal(restorekit.Checkpoint(bad).read(key), good)  # why the CRC must be checked
    result = restorekit.Checkpoint(bad).verify()
    assert not result.ok
    assert [(p.name, p.kind) for p in result.problems] == [("model.weights.h5", "checksum")]
    assert "CRC-32" in result.problems[0].message
    with pytest.raises(ChecksumMismatchError, match="model.weights.h5"):
        restorekit.Checkpoint(bad).check_crc()

    assert main(["verify", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "checksum" in out and "model.weights.h5" in out
    assert main(["verify", str(saved / "m.keras")]) == 0


@pytest.mark.parametrize("out, kwargs", [
    ("o.safetensors", {}), ("o.ckpt", {}), ("o.weights.h5", {}), ("o.npz", {}),
    pytest.param("o.pt", {}, marks=requires_torch), ("shards", {"max_shard_size": 64}),
], ids=["safetensors", "tf", "weights_h5", "npz", "pt", "hf_shards"])
def test_converting_a_corrupt_keras_archive_raises_with_nothing_written(saved, flipped, out, kwargs):
    bad, _ = flipped
    with pytest.raises(ChecksumMismatchError, match="CRC-32"):
        convert(bad, saved / out, **kwargs)
    assert _written(saved) == []
    convert(saved / "m.keras", saved / out, **kwargs)  # the sound archive converts


@pytest.mark.parametrize("out, format", [("e.weights.h5", "keras"), ("e.ckpt", "tf"), ("e.safetensors", "safetensors")],
                         ids=["weights_h5", "tf", "safetensors"])
def test_saving_an_edited_corrupt_keras_archive_raises_with_nothing_written(saved, flipped, out, format):
    bad, _ = flipped
    with pytest.raises(ChecksumMismatchError, match="CRC-32"):
        CheckpointEditor(bad).save(saved / out, format=format)
    assert _written(saved) == []


def test_cli_convert_of_a_corrupt_keras_archive_exits_3(saved, flipped, capsys):
    bad, _ = flipped
    assert main(["convert", str(bad), str(saved / "o.safetensors")]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("restorekit: error: ") and "CRC-32" in lines[0]
    assert _written(saved) == []


@pytest.mark.parametrize("src, out", [("m.weights.h5", "o.weights.h5"), ("m.keras", "o.weights.h5"),
                                      ("m.keras", "o.ckpt"), ("m.keras", "o.safetensors")],
                         ids=["weights_h5_copy", "keras_to_weights_h5", "keras_to_tf", "keras_to_safetensors"])
def test_a_full_disk_refuses_keras_conversions_with_nothing_written(saved, monkeypatch, src, out):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 100, 100))
    with pytest.raises(InsufficientSpaceError):
        convert(saved / src, saved / "out" / out)
    with pytest.raises(InsufficientSpaceError):
        CheckpointEditor(saved / src).save(saved / "out" / out, format="keras" if out.endswith(".h5") else
                                           "tf" if out.endswith(".ckpt") else "safetensors")
    assert not (saved / "out").exists()
    assert not [n for n in os.listdir(saved) if n.startswith(".restorekit-tmp-")]
