"""Casts that would change values (overflow, wrap-around, inexact integers) are refused on save, nothing written."""

import os

import ml_dtypes
import numpy as np
import pytest

from restorekit._bundle.writer import BundleWriter
from restorekit._checkpoint import Checkpoint
from restorekit.cli import main
from restorekit.edit import CheckpointEditor
from restorekit.errors import EditError


def _source(tmp_path, values):
    prefix = str(tmp_path / "src" / "m")
    with BundleWriter(prefix) as w:
        for name, value in values.items():
            w.add(name, value)
    return prefix


def _written(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


@pytest.mark.parametrize(
    "value, dtype, shown",
    [
        (np.int64(100001), "float16", "100001 -> inf"),
        (np.int64(100001), "int8", "100001 -> -95"),
        (np.int64(100001), "bfloat16", "100001 -> 99840"),
        (np.int64(2**53 + 1), "float64", f"{2**53 + 1} -> "),
        (np.int64(-1), "uint8", "-1 -> 255"),
        (np.int32(2**31 - 1), "float32", f"{2**31 - 1} -> "),
    ],
    ids=["int-to-float16-overflows", "int-to-int8-wraps", "int-to-bfloat16-inexact", "int64-to-float64-inexact",
         "negative-to-unsigned", "int32-max-to-float32"],
)
@pytest.mark.parametrize("path", ["streamed", "edited-in-memory"])
def test_an_integer_cast_that_changes_the_value_is_refused_and_nothing_written(tmp_path, value, dtype, shown, path):
    prefix = _source(tmp_path, {"global_step": value, "k": np.ones(3, np.float32)})
    ed = CheckpointEditor(prefix)
    if path == "edited-in-memory":
        ed.set("global_step", value)  # a value held in memory: cast (and refused) at the call
    with pytest.raises(EditError) as info:
        ed.cast("global_step", dtype)
        ed.save(tmp_path / "out" / "m")
    message = str(info.value)
    assert "'global_step'" in message and dtype in message and shown in message
    assert _written(tmp_path / "out") == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float_overflow_to_inf_is_refused_but_rounding_passes(tmp_path, dtype):
    big = np.array([1.0, 7e4 if dtype == "float16" else 4e38, 2.5], np.float64)
    prefix = _source(tmp_path, {"big": big, "fine": np.array([0.1, 1e-9, np.inf, np.nan, 65519.0], np.float32)})
    ed = CheckpointEditor(prefix)
    ed.cast("big", dtype)
    with pytest.raises(EditError, match="'big'.*1 value") as info:
        ed.save(tmp_path / "out" / "m")
    assert "-> inf" in str(info.value)
    assert _written(tmp_path / "out") == []

    ed = CheckpointEditor(prefix)
    ed.cast("fine", dtype)  # rounding, underflow to 0, and inf/nan that were already there all pass
    got = Checkpoint(ed.save(tmp_path / "ok" / "m")).read("fine")
    target = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    expected = np.array([0.1, 1e-9, np.inf, np.nan, 65519.0], np.float32).astype(target)
    assert got.dtype == target
    np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))


def test_casts_that_keep_every_value_pass(tmp_path):
    prefix = _source(tmp_path, {"step": np.int64(100001), "small": np.array([-128, 0, 127], np.int64)})
    ed = CheckpointEditor(prefix)
    ed.cast("step", "float32")
    ed.cast("small", "int8")
    ckpt = Checkpoint(ed.save(tmp_path / "out" / "m"))
    assert ckpt.read("step") == np.float32(100001) and ckpt.read("step").dtype == np.float32
    assert ckpt.read("small").tolist() == [-128, 0, 127] and ckpt.read("small").dtype == np.int8


def test_a_cast_to_safetensors_that_overflows_is_refused_and_nothing_written(tmp_path):
    prefix = _source(tmp_path, {"global_step": np.int64(100001)})
    ed = CheckpointEditor(prefix)
    ed.cast("global_step", "float16")
    with pytest.raises(EditError, match="100001 -> inf"):
        ed.save(tmp_path / "out" / "m.safetensors")
    assert _written(tmp_path / "out") == []


def test_cli_cast_that_overflows_exits_3_and_writes_nothing(capsys, tmp_path):
    prefix = _source(tmp_path, {"global_step": np.int64(100001)})
    code = main(["cast", prefix, str(tmp_path / "out" / "m"), "--dtype", "float16", "--filter", "global_step"])
    err = capsys.readouterr().err
    assert code == 3
    assert err.strip().splitlines()[-1].startswith("restorekit: error: ") and "100001 -> inf" in err
    assert "Traceback" not in err
    assert _written(tmp_path / "out") == []
