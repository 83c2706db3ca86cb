"""compare: diff_checkpoints and tensor_stats over real checkpoints, and over corrupt ones that must raise."""

import math

import numpy as np
import pytest

from conftest import requires_torch, save_variables, write_bundle
from restorekit._bundle.format import DT_FLOAT, encode_slice_key
from restorekit._bundle.protos import BundleEntry
from restorekit._bundle.writer import BundleWriter
from restorekit._compare import diff_checkpoints, tensor_stats
from restorekit.errors import ChecksumMismatchError, CorruptCheckpointError


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
    with pytest.raises(ChecksumMismatchError, match="'w'"):
        diff_checkpoints(prefix, prefix)


# ------------------------------------------------------------------ pairing by readable path

def _keras_files(tmp_path, seed=0):
    """One Keras model as Keras 3 .weights.h5, a legacy Keras 2 .h5 (h5py, Keras 2 layout) and a TF2 checkpoint."""
    import keras
    import tensorflow as tf

    from test_keras_files import write_legacy

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d1"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2, name="d2")], name="seq")
    model.save_weights(tmp_path / "m.weights.h5")
    write_legacy(tmp_path / "legacy.h5", model)
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "tf2" / "ckpt"))
    return model, str(tmp_path / "m.weights.h5"), str(tmp_path / "legacy.h5"), prefix


@pytest.fixture(scope="module")
def keras_files(tmp_path_factory):
    return _keras_files(tmp_path_factory.mktemp("keras"))


@pytest.mark.parametrize("pair", [(1, 2), (2, 1), (0, 1), (1, 0), (0, 2)],
                         ids=["weights_h5_vs_legacy", "legacy_vs_weights_h5", "tf2_vs_weights_h5",
                              "weights_h5_vs_tf2", "tf2_vs_legacy"])
def test_the_same_keras_model_in_two_formats_pairs_by_readable_path(keras_files, pair):
    model, weights_h5, legacy, prefix = keras_files
    files = [prefix, weights_h5, legacy]
    result = diff_checkpoints(files[pair[0]], files[pair[1]])
    assert result["paired_by"] == "path"
    assert result["equal"] and result["same"] == 8  # 2 dense x (kernel, bias) + 4 batch norm
    assert result["only_in_a"] == result["only_in_b"] == []  # the object graph has no counterpart: left out


def test_keys_alone_pair_nothing_across_keras_formats(keras_files):
    _, weights_h5, legacy, prefix = keras_files
    by_key = diff_checkpoints(weights_h5, legacy, by="key")
    assert by_key["paired_by"] == "key" and by_key["same"] == 0 and len(by_key["only_in_a"]) == 8
    assert diff_checkpoints(prefix, prefix)["paired_by"] == "key"  # keys pair everything: keys win a tie


def test_a_changed_value_is_reported_under_its_readable_path(keras_files, tmp_path):
    import h5py

    model, weights_h5, legacy, prefix = keras_files
    changed = tmp_path / "changed.h5"
    changed.write_bytes(open(legacy, "rb").read())
    with h5py.File(changed, "r+") as f:
        f["d2/d2/bias:0"][1] += 0.25
    result = diff_checkpoints(prefix, str(changed))
    assert result["paired_by"] == "path" and not result["equal"] and result["same"] == 7
    [value] = result["values"]
    assert value["name"] == "seq/d2/bias"  # A's path; the scope 'seq' the legacy file lacks is forgiven
    assert value["keys"] == {"a": "model/_functional/_operations/3/bias/.ATTRIBUTES/VARIABLE_VALUE", "b": "d2/d2/bias:0"}
    assert value["max_abs_diff"] == pytest.approx(0.25) and value["differing"] == 1
    assert diff_checkpoints(prefix, str(changed), atol=0.5)["equal"]


def test_a_shape_change_under_a_readable_path(keras_files, tmp_path):
    import keras

    _, weights_h5, _, _ = keras_files
    keras.utils.set_random_seed(0)
    wider = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, name="d1"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2, name="d2")], name="seq")
    wider.save_weights(tmp_path / "wider.weights.h5")
    result = diff_checkpoints(weights_h5, tmp_path / "wider.weights.h5", by="path")
    changed = {c["name"]: (c["a"]["shape"], c["b"]["shape"]) for c in result["changed"]}
    assert changed["d1/kernel"] == ([3, 4], [3, 5]) and changed["d2/kernel"] == ([4, 2], [5, 2])
    assert len(changed) == 7 and result["same"] == 1  # d2/bias alone keeps its shape (zeros in both)


def test_ambiguous_scopes_stay_unpaired(tmp_path):
    """'a/d/kernel' and 'b/d/kernel' both end in 'd/kernel': neither pairs with it."""
    a = save_variables(tmp_path / "a" / "m", {"d/kernel": np.ones(2, np.float32)})
    b = save_variables(tmp_path / "b" / "m", {"x/d/kernel": np.ones(2, np.float32), "y/d/kernel": np.ones(2, np.float32)})
    result = diff_checkpoints(a, b, by="path")
    assert result["same"] == 0 and result["only_in_a"] == ["d/kernel"]
    assert sorted(result["only_in_b"]) == ["x/d/kernel", "y/d/kernel"]
    single = save_variables(tmp_path / "c" / "m", {"x/d/kernel": np.ones(2, np.float32)})
    assert diff_checkpoints(a, single, by="path")["same"] == 1


def test_by_must_be_key_path_or_auto(tmp_path):
    from restorekit.errors import InvalidArgumentError

    a = write_bundle(tmp_path / "m", {"w": np.zeros(2, np.float32)})
    with pytest.raises(InvalidArgumentError, match="by='name'"):
        diff_checkpoints(a, a, by="name")


# ------------------------------------------------------------------ files of other formats

@requires_torch
def test_diff_across_formats_by_name_and_value(tmp_path):
    import safetensors.numpy
    import torch

    values = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], np.int64)}
    safetensors.numpy.save_file(values, str(tmp_path / "m.safetensors"))
    torch.save({k: torch.from_numpy(v) for k, v in values.items()}, tmp_path / "m.pt")
    np.savez(tmp_path / "m.npz", **{**values, "w": values["w"] + np.float32(1)})
    prefix = write_bundle(tmp_path / "tf" / "m", values)
    assert diff_checkpoints(tmp_path / "m.safetensors", tmp_path / "m.pt")["equal"]
    assert diff_checkpoints(prefix, tmp_path / "m.safetensors")["equal"]
    result = diff_checkpoints(tmp_path / "m.pt", tmp_path / "m.npz")
    assert result["same"] == 1 and result["values"] == [{"name": "w", "max_abs_diff": 1.0, "differing": 6}]
