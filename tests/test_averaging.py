"""Tests for restorekit/_averaging.py: average and interpolate, streamed over real TF checkpoints and files."""

import os

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from conftest import save_variables

from restorekit._averaging import average, interpolate
from restorekit.cli import main
from restorekit.errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    NoMatchError,
    OutputExistsError,
    SourceMismatchError,
)

BF16 = ml_dtypes.bfloat16
WEIGHTS = [1.0, 2.0, 5.0]


def _values(seed, step):
    rng = np.random.RandomState(seed)
    return {
        "dense/kernel": rng.randn(6, 4).astype(np.float32),
        "dense/bias": rng.randn(4).astype(np.float64),
        "emb/half": rng.randn(5, 3).astype(np.float16),
        "emb/brain": rng.randn(7).astype(BF16),
        "dense/kernel/Momentum": rng.randn(6, 4).astype(np.float32),
        "vocab/ids": np.arange(10, dtype=np.int32),
        "flags/use_bias": np.array(True),
        "global_step": np.array(step, np.int64),
    }


@pytest.fixture
def three(tmp_path):
    """Three TF1 checkpoints of one model, as TF's Saver wrote them, and their values."""
    values = [_values(seed, step) for seed, step in ((1, 1000), (2, 2000), (3, 3000))]
    paths = [save_variables(tmp_path / f"run{i}" / "model.ckpt", v) for i, v in enumerate(values)]
    return paths, values


def _reference(values, name, weights=None):
    """numpy's weighted mean in float64, cast to the stored dtype."""
    stack = np.stack([np.asarray(v[name]).astype(np.float64) for v in values])
    return np.average(stack, axis=0, weights=weights).astype(values[0][name].dtype)


def _nothing_at(path):
    directory = os.path.dirname(path)
    return not os.path.exists(directory) or os.listdir(directory) == []


# ------------------------------------------------------------------ values


def test_average_of_three_checkpoints_is_numpys_weighted_mean_per_tensor(three, tmp_path):
    paths, values = three
    out = str(tmp_path / "avg" / "model.ckpt")
    result = average(paths, out, weights=WEIGHTS)
    reader = tf.train.load_checkpoint(out)
    stored = reader.get_variable_to_dtype_map()
    assert set(stored) == {"dense/kernel", "dense/bias", "emb/half", "emb/brain", "vocab/ids", "flags/use_bias"}
    for name in ("dense/kernel", "dense/bias", "emb/half", "emb/brain"):
        got = reader.get_tensor(name)
        expected = _reference(values, name, WEIGHTS)
        assert got.dtype == expected.dtype, name
        np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64), err_msg=name)
    assert stored["emb/brain"] == tf.bfloat16 and stored["emb/half"] == tf.float16
    np.testing.assert_array_equal(reader.get_tensor("vocab/ids"), np.arange(10))
    assert reader.get_tensor("flags/use_bias") == True  # noqa: E712 (a numpy bool)
    assert set(result.averaged) == {"dense/kernel", "dense/bias", "emb/half", "emb/brain"}
    assert set(result.copied) == {"vocab/ids", "flags/use_bias"}
    assert set(result.dropped) == {"dense/kernel/Momentum", "global_step"}
    assert result.weights == pytest.approx([1 / 8, 2 / 8, 5 / 8])
    assert "averaged       4" in str(result)


def test_equal_weights_by_default_and_interpolate(three, tmp_path):
    paths, values = three
    out = str(tmp_path / "mean" / "model.ckpt")
    average(paths, out)
    np.testing.assert_array_equal(tf.train.load_checkpoint(out).get_tensor("dense/kernel"),
                                  _reference(values, "dense/kernel"))
    halfway = str(tmp_path / "wise" / "model.ckpt")
    interpolate(paths[0], paths[2], 0.25, halfway)
    np.testing.assert_array_equal(tf.train.load_checkpoint(halfway).get_tensor("dense/bias"),
                                  _reference([values[0], values[2]], "dense/bias", [0.75, 0.25]))


def test_keep_optimizer_state_averages_slots_and_needs_agreeing_counters(three, tmp_path):
    paths, values = three
    out = str(tmp_path / "all" / "model.ckpt")
    with pytest.raises(SourceMismatchError, match=r"'global_step' \(int64\): source 0 differs from source 1, 2") as e:
        average(paths, out, weights_only=False)
    assert e.value.names == ("global_step",)
    assert _nothing_at(out)
    average(paths, out, weights_only=False, mismatch="last")
    reader = tf.train.load_checkpoint(out)
    assert reader.get_tensor("global_step") == 3000
    np.testing.assert_array_equal(reader.get_tensor("dense/kernel/Momentum"), _reference(values, "dense/kernel/Momentum"))


def test_integer_entries_that_differ_fail_naming_them(tmp_path):
    a, b = _values(1, 1), _values(2, 1)
    b["vocab/ids"] = b["vocab/ids"][::-1].copy()
    paths = [save_variables(tmp_path / n / "model.ckpt", v) for n, v in (("a", a), ("b", b))]
    out = str(tmp_path / "out" / "model.ckpt")
    with pytest.raises(SourceMismatchError, match=r"'vocab/ids' \(int32\): source 0 differs from source 1"):
        average(paths, out)
    assert _nothing_at(out)
    average(paths, out, mismatch="first")
    np.testing.assert_array_equal(tf.train.load_checkpoint(out).get_tensor("vocab/ids"), np.arange(10))


def test_include_and_exclude_choose_the_entries(three, tmp_path):
    paths, _ = three
    out = str(tmp_path / "dense" / "model.ckpt")
    result = average(paths, out, include=["dense"], exclude=["dense/bias"])
    assert set(tf.train.load_checkpoint(out).get_variable_to_shape_map()) == {"dense/kernel"}
    assert result.averaged == ("dense/kernel",)
    with pytest.raises(NoMatchError, match="include pattern 'encoder'"):
        average(paths, str(tmp_path / "none" / "model.ckpt"), include=["encoder"])
    assert _nothing_at(str(tmp_path / "none" / "model.ckpt"))


# ------------------------------------------------------------------ differing sources


def test_names_and_shapes_that_differ_fail_with_the_full_list_or_average_the_intersection(tmp_path):
    a, b = _values(1, 1), _values(2, 1)
    del b["emb/half"]
    b["dense/kernel"] = np.zeros((6, 5), np.float32)
    b["extra/w"] = np.ones(3, np.float32)
    paths = [save_variables(tmp_path / n / "model.ckpt", v) for n, v in (("a", a), ("b", b))]
    out = str(tmp_path / "out" / "model.ckpt")
    with pytest.raises(SourceMismatchError) as e:
        average(paths, out)
    assert set(e.value.names) == {"emb/half", "dense/kernel", "extra/w"}
    message = str(e.value)
    assert "'emb/half': not in source 1" in message and "'extra/w': not in source 0" in message
    assert "'dense/kernel': [6, 4] float32, [6, 5] float32" in message and "intersection=True" in message
    assert _nothing_at(out)
    result = average(paths, out, intersection=True)
    assert set(result.skipped) == {"emb/half", "dense/kernel", "extra/w"}
    assert set(tf.train.load_checkpoint(out).get_variable_to_shape_map()) == {
        "dense/bias", "emb/brain", "vocab/ids", "flags/use_bias"}


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"weights": [1.0, 2.0]}, InvalidArgumentError, "2 numbers for 3 sources"),
        ({"weights": [1.0, -2.0, -1.0]}, InvalidArgumentError, "sum must be positive"),
        ({"weights": [1.0, float("nan"), 1.0]}, InvalidArgumentError, "finite"),
        ({"mismatch": "mean"}, InvalidArgumentError, "mismatch is one of"),
        ({"to": "onnx"}, InvalidArgumentError, "onnx"),
    ],
    ids=["weights-of-wrong-length", "weights-summing-negative", "a-nan-weight", "unknown-mismatch", "unknown-format"],
)
def test_bad_arguments_fail_before_anything_is_written(three, tmp_path, kwargs, error, message):
    paths, _ = three
    out = str(tmp_path / "bad" / "model.ckpt")
    with pytest.raises(error, match=message):
        average(paths, out, **kwargs)
    assert _nothing_at(out)


def test_bad_sources_and_outputs(three, tmp_path):
    paths, _ = three
    out = str(tmp_path / "x" / "model.ckpt")
    with pytest.raises(InvalidArgumentError, match="two or more"):
        average(paths[:1], out)
    with pytest.raises(CheckpointNotFoundError):
        average([paths[0], str(tmp_path / "nowhere" / "model.ckpt")], out)
    with pytest.raises(InvalidArgumentError, match="alpha"):
        interpolate(paths[0], paths[1], float("inf"), out)
    assert _nothing_at(out)
    with pytest.raises(OutputExistsError) as e:
        average(paths, paths[0])
    assert e.value.is_source
    average(paths, out)
    with pytest.raises(OutputExistsError):
        average(paths, out)
    into = tmp_path / "into"
    into.mkdir()
    assert average(paths, str(into)).path == str(into / "model.ckpt")  # a directory: the source's name inside
    average(paths, out, overwrite=True, weights=[0, 0, 1])
    np.testing.assert_array_equal(tf.train.load_checkpoint(out).get_tensor("dense/kernel"),
                                  tf.train.load_checkpoint(paths[2]).get_tensor("dense/kernel"))


# ------------------------------------------------------------------ formats


def test_tf2_keras_checkpoints_average_into_a_checkpoint_keras_restores(tmp_path):
    def model():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])

    x = np.random.RandomState(0).rand(16, 3).astype(np.float32)
    y = np.random.RandomState(1).rand(16, 2).astype(np.float32)
    net, optimizer = model(), keras.optimizers.Adam(0.05)
    net.compile(optimizer=optimizer, loss="mse")
    ckpt = tf.train.Checkpoint(model=net, optimizer=optimizer)
    paths, kernels = [], []
    for i in range(3):
        net.fit(x, y, epochs=1, verbose=0)
        paths.append(ckpt.save(str(tmp_path / "tf2" / "ckpt")))
        kernels.append(net.layers[0].kernel.numpy())
    out = str(tmp_path / "avg" / "ckpt")
    result = average(paths, out)
    assert any("optimizer" in n for n in result.dropped) and "save_counter/.ATTRIBUTES/VARIABLE_VALUE" in result.dropped
    fresh = model()
    tf.train.Checkpoint(model=fresh).restore(out).assert_existing_objects_matched()
    np.testing.assert_array_equal(fresh.layers[0].kernel.numpy(),
                                  np.mean(np.stack(kernels).astype(np.float64), axis=0).astype(np.float32))


def test_safetensors_sources_average_into_safetensors_and_npz(tmp_path):
    from safetensors.numpy import load_file, save_file

    values = [{"w": np.random.RandomState(i).randn(3, 2).astype(np.float32), "n": np.array([4, 2], np.int64)}
              for i in range(2)]
    paths = []
    for i, v in enumerate(values):
        paths.append(str(tmp_path / f"m{i}.safetensors"))
        save_file(v, paths[-1])
    average(paths, str(tmp_path / "mean.safetensors"), weights=[1, 3])
    got = load_file(str(tmp_path / "mean.safetensors"))
    np.testing.assert_array_equal(got["w"], _reference(values, "w", [1, 3]))
    np.testing.assert_array_equal(got["n"], [4, 2])
    average(paths, str(tmp_path / "mean.npz"))
    with np.load(str(tmp_path / "mean.npz")) as npz:
        np.testing.assert_array_equal(npz["w"], _reference(values, "w"))


def test_npz_sources_average_bfloat16_as_bfloat16(tmp_path):
    # restorekit's npz files keep bfloat16 as its uint16 bits plus a note only the npz reader reads:
    # the average reads them through that reader, so it takes the mean of the values, not of the bits
    from safetensors.numpy import load_file, save_file

    values = [{"w": np.random.RandomState(i).randn(4, 3).astype(BF16), "n": np.array([4, 2], np.int64)}
              for i in range(2)]
    paths = []
    for i, v in enumerate(values):
        save_file(v, str(tmp_path / f"m{i}.safetensors"))
        paths.append(str(tmp_path / f"m{i}.npz"))
        restorekit.convert(str(tmp_path / f"m{i}.safetensors"), paths[-1])
    with np.load(paths[0]) as npz:
        assert npz["w"].dtype == np.uint16  # the bits, as the file stores them
    average(paths, str(tmp_path / "mean.safetensors"), weights=[1, 3])
    got = load_file(str(tmp_path / "mean.safetensors"))
    assert got["w"].dtype == BF16
    np.testing.assert_array_equal(got["w"], _reference(values, "w", [1, 3]))
    np.testing.assert_array_equal(got["n"], [4, 2])


# ------------------------------------------------------------------ CLI


def test_cli_average(three, tmp_path, capsys):
    paths, values = three
    out = str(tmp_path / "cli" / "model.ckpt")
    assert main(["average", *paths, out, "--weights", "1", "2", "5"]) == 0
    assert "averaged 3 checkpoints" in capsys.readouterr().out
    np.testing.assert_array_equal(tf.train.load_checkpoint(out).get_tensor("dense/kernel"),
                                  _reference(values, "dense/kernel", WEIGHTS))
    assert main(["average", *paths, out]) == 3
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["average", paths[0], out]) == 2
    assert main(["average", *paths, str(tmp_path / "w" / "model.ckpt"), "--weights", "1"]) == 3
    assert _nothing_at(str(tmp_path / "w" / "model.ckpt"))
    assert restorekit.average is average


def test_layout_and_rules_pair_sources_of_different_naming_as_merge_does(tmp_path):
    """A TF checkpoint and a PyTorch-named safetensors file of the same Dense layer average together under
    layout='torch' (the kernel transposed to nn.Linear's [out, in]), through the API and the CLI; without it
    their names differ and nothing is written; a TF BERT checkpoint and its Hugging Face twin pair through
    rules='bert-tf-to-hf'. Both options are merge's (pipeline.open_source), refused alike."""
    from safetensors.numpy import load_file, save_file

    from restorekit.export import convert

    rng = np.random.RandomState(3)
    tf_values = {"dense/kernel": rng.randn(6, 4).astype(np.float32), "dense/bias": rng.randn(4).astype(np.float32)}
    pt_values = {"dense.weight": rng.randn(4, 6).astype(np.float32), "dense.bias": rng.randn(4).astype(np.float32)}
    tf_path = save_variables(tmp_path / "tf" / "model.ckpt", tf_values)
    st_path = str(tmp_path / "torch.safetensors")
    save_file(pt_values, st_path)
    out = str(tmp_path / "mean.safetensors")
    with pytest.raises(SourceMismatchError):
        average([tf_path, st_path], out)
    with pytest.raises(InvalidArgumentError, match="leave layout=None"):
        average([tf_path, st_path], out, layout="torch", rules="bert-tf-to-hf")
    assert not os.path.exists(out)
    result = average([tf_path, st_path], out, weights=[3, 1], layout="torch")
    got = load_file(out)
    assert set(got) == {"dense.weight", "dense.bias"} and len(result.averaged) == 2
    np.testing.assert_allclose(got["dense.weight"], (3 * tf_values["dense/kernel"].T + pt_values["dense.weight"]) / 4,
                               rtol=1e-6)
    np.testing.assert_allclose(got["dense.bias"], (3 * tf_values["dense/bias"] + pt_values["dense.bias"]) / 4,
                               rtol=1e-6)
    cli_out = str(tmp_path / "cli.safetensors")
    assert main(["average", tf_path, st_path, cli_out, "--layout", "torch", "-q"]) == 0
    np.testing.assert_allclose(load_file(cli_out)["dense.weight"],
                               (tf_values["dense/kernel"].T + pt_values["dense.weight"]) / 2, rtol=1e-6)

    kernel = "bert/encoder/layer_0/attention/self/query/kernel"
    bert_a = {kernel: rng.randn(8, 8).astype(np.float32)}
    bert_b = {kernel: rng.randn(8, 8).astype(np.float32)}
    tf_a = save_variables(tmp_path / "a" / "bert_model.ckpt", bert_a)
    tf_b = save_variables(tmp_path / "b" / "bert_model.ckpt", bert_b)
    hf_b = str(tmp_path / "hf_b.safetensors")
    convert(tf_b, hf_b, rules="bert-tf-to-hf", weights_only=True)
    bert_out = str(tmp_path / "bert.safetensors")
    interpolate(tf_a, hf_b, 0.25, bert_out, rules="bert-tf-to-hf")
    np.testing.assert_allclose(load_file(bert_out)["bert.encoder.layer.0.attention.self.query.weight"],
                               (0.75 * bert_a[kernel] + 0.25 * bert_b[kernel]).T, rtol=1e-6)
