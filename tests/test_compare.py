"""compare: diff_checkpoints and tensor_stats over real checkpoints, and over corrupt ones that must raise."""

import math

import numpy as np
import pytest

from conftest import save_variables, write_bundle
from restorekit.bundle.format import DT_FLOAT, encode_slice_key
from restorekit.bundle.protos import BundleEntry
from restorekit.bundle.writer import BundleWriter
from restorekit.compare import diff_checkpoints, tensor_stats
from restorekit.errors import CorruptCheckpointError


def test_a_checkpoint_equals_itself_and_a_changed_value_is_reported(tmp_path):
    values = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": np.int64(3)}
    a = save_variables(tmp_path / "a" / "m", values)
    b = save_variables(tmp_path / "b" / "m", {**values, "w": values["w"] + np.float32(0.5)})
    same = diff_checkpoints(a, a)
    assert same["equal"] and same["same"] == 2
    changed = diff_checkpoints(a, b)
    assert not changed["equal"]
    assert changed["values"] == [{"name": "w", "max_abs_diff": 0.5, "differing": 6}]
    assert diff_checkpoints(a, b, atol=0.5)["equal"]


def test_tensor_stats_of_floats_with_a_nan():
    stats = tensor_stats(np.array([1.0, math.nan, -3.0], np.float32))
    assert stats == {"min": -3.0, "max": 1.0, "mean": -1.0, "nans": 1}


def _claims_a_trillion_elements(prefix):
    """A partitioned float32 entry of shape [10**6, 10**6] whose two slices say they hold 4 TB in a tiny shard."""
    rows = 500_000
    with BundleWriter(prefix) as w:
        w.add("small", np.zeros(2, np.float32))
        for start in (0, rows):
            w.add_entry_only(encode_slice_key("huge", ((start, rows), (0, -1))),
                             BundleEntry(dtype=DT_FLOAT, shape=(rows, 10**6), offset=start * 4 * 10**6, size=4 * rows * 10**6))
        w.add_entry_only("huge", BundleEntry(dtype=DT_FLOAT, shape=(10**6, 10**6), slices=(b"", b"")))
    return prefix


def test_diff_of_a_checkpoint_claiming_a_trillion_elements_raises_before_allocating(tmp_path):
    import tracemalloc

    prefix = _claims_a_trillion_elements(str(tmp_path / "m"))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=r"'huge' of shape \[1000000, 1000000\] claims 4000000000000 bytes"):
            diff_checkpoints(prefix, prefix)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20


def test_diff_of_a_damaged_shard_raises_instead_of_reporting_differences(tmp_path):
    prefix = write_bundle(tmp_path / "m", {"w": np.arange(4, dtype=np.float32)})
    with open(prefix + ".data-00000-of-00001", "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        diff_checkpoints(prefix, prefix)
