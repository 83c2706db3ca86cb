"""Every readable format, written by its own framework, keeps one contract: the Mapping of a Source, one scan
report for the same weights, and one answer to "which entries are optimizer state" from strip, weights_only and scan.

The files are written by TensorFlow (TF1 bundles, TF2 object graphs), Keras 3 (``.weights.h5``,
sharded ``.weights.json``, ``.keras``), tf-keras (legacy Keras 2 ``.h5``), the safetensors
library and huggingface_hub's sharding (one file, a shard set by directory and by index),
torch.save and numpy; restorekit's own converters write the converted cases.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
k2 = pytest.importorskip("tf_keras")

import restorekit  # noqa: E402
from restorekit import formats  # noqa: E402
from restorekit.edit import CheckpointEditor  # noqa: E402
from restorekit.errors import EntryNotFoundError, InvalidArgumentError, NoMatchError  # noqa: E402
from restorekit.formats import Source  # noqa: E402

from conftest import import_torch, requires_torch, save_variables  # noqa: E402

tf1 = tf.compat.v1
X = np.random.RandomState(0).randn(8, 4).astype("float32")
Y = np.ones((8, 2), "float32")
SHARD_GB = 60 / 1024**3  # Keras' max_shard_size is in GB: a shard every few tensors


def _keras3(seed: int, *, trained: bool = False):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="enc"), keras.layers.Dense(2, name="head")],
                             name="net")
    if trained:  # Adam state and an iteration counter in every file that saves the optimizer
        model.compile(optimizer="adam", loss="mse")
        model.fit(X, Y, verbose=0)
    return model


def _tf_keras_twin(model):
    """The same layers and weights in tf-keras, compiled and trained one step, as Keras 2 users saved them."""
    twin = k2.Sequential([k2.Input((4,)), k2.layers.Dense(3, name="enc"), k2.layers.Dense(2, name="head")])
    twin.compile(optimizer="adam", loss="mse")
    twin.fit(X, Y, verbose=0)
    for layer in ("enc", "head"):
        twin.get_layer(layer).set_weights([np.array(w) for w in model.get_layer(layer).get_weights()])
    return twin


def _weights(model) -> dict:
    return {v.path: np.array(v.numpy()) for v in model.weights}


def _hf_shards(directory, tensors: dict) -> str:
    """A Hugging Face shard set as huggingface_hub splits it, each shard written by the safetensors library."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.numpy import save_file

    os.makedirs(directory)
    split = split_state_dict_into_shards_factory(tensors, get_storage_size=lambda a: a.nbytes, max_shard_size=50,
                                                 filename_pattern="model{suffix}.safetensors")
    assert split.is_sharded
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, os.path.join(directory, filename))
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f)
    return index


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (path, {name readable in the file: value}); every file holds the weights of one trained model."""
    from safetensors.numpy import save_file

    tmp = tmp_path_factory.mktemp("formats")
    model = _keras3(0, trained=True)
    weights = _weights(model)
    tf2 = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp / "tf2" / "ckpt"))
    model.save_weights(tmp / "m.weights.h5")
    (tmp / "set").mkdir()
    model.save_weights(tmp / "set" / "m.weights.json", max_shard_size=SHARD_GB)
    model.save(tmp / "m.keras")
    _tf_keras_twin(model).save(tmp / "legacy.h5")
    # files from elsewhere, under the Keras paths as their own names
    save_file(weights, str(tmp / "m.safetensors"))
    index = _hf_shards(str(tmp / "hf"), weights)
    np.savez(tmp / "m.npz", **weights)
    tf1_values = {"net/dense/kernel": np.arange(12, dtype=np.float32).reshape(4, 3), "global_step": np.int64(7)}
    tf1_prefix = save_variables(tmp / "tf1" / "model.ckpt", tf1_values)
    out = {
        "tf1_bundle": (tf1_prefix, tf1_values),
        "tf2_object_graph": (tf2, weights),
        "weights_h5": (str(tmp / "m.weights.h5"), weights),
        "sharded_weights_json": (str(tmp / "set" / "m.weights.json"), weights),
        "keras_archive": (str(tmp / "m.keras"), weights),
        "legacy_keras2_h5": (str(tmp / "legacy.h5"), weights),
        "safetensors": (str(tmp / "m.safetensors"), weights),
        "hf_shards_by_directory": (str(tmp / "hf"), weights),
        "hf_shards_by_index": (index, weights),
        "npz": (str(tmp / "m.npz"), weights),
    }
    for fmt, name in (("safetensors", "tf2.safetensors"), ("npz", "tf2.npz")):
        restorekit.convert(tf2, tmp / name)
        out[f"tf2_converted_to_{fmt}"] = (str(tmp / name), weights)
    restorekit.convert(tf2, tmp / "tf2_shards", max_shard_size=100)
    out["tf2_converted_to_hf_shards"] = (str(tmp / "tf2_shards"), weights)
    return model, out


@pytest.fixture(scope="module")
def torch_files(files, tmp_path_factory):
    torch = import_torch()
    model, by_name = files
    tmp = tmp_path_factory.mktemp("torch_formats")
    weights = _weights(model)
    torch.save({n: torch.from_numpy(v) for n, v in weights.items()}, tmp / "m.pt")
    restorekit.convert(by_name["tf2_object_graph"][0], tmp / "tf2.pt")
    return {"torch_save": (str(tmp / "m.pt"), weights), "tf2_converted_to_torch": (str(tmp / "tf2.pt"), weights)}


FILE_CASES = ["tf1_bundle", "tf2_object_graph", "weights_h5", "sharded_weights_json", "keras_archive",
              "legacy_keras2_h5", "safetensors", "hf_shards_by_directory", "hf_shards_by_index", "npz",
              "tf2_converted_to_safetensors", "tf2_converted_to_npz", "tf2_converted_to_hf_shards"]
TORCH_CASES = ["torch_save", "tf2_converted_to_torch"]
CASES = [pytest.param(c, id=c) for c in FILE_CASES] + [pytest.param(c, id=c, marks=requires_torch) for c in TORCH_CASES]


def _case(request, name: str):
    model, by_name = request.getfixturevalue("files")
    if name in TORCH_CASES:
        return model, request.getfixturevalue("torch_files")[name]
    return model, by_name[name]


# ---------------------------------------------------------------- the Mapping contract

@pytest.mark.parametrize("case", CASES)
def test_every_format_keeps_the_mapping_contract(request, case):
    _, (path, values) = _case(request, case)
    src = formats.open(path)
    assert isinstance(src, Source) and isinstance(src, restorekit.Checkpoint)
    assert type(restorekit.Checkpoint(path)) is type(src)  # Checkpoint() opens through the same registry
    names = list(src)
    assert names == list(src.entries) and len(src) == len(names) == len(src.entries) > 0
    first = names[0]
    assert first in src and src[first] == src.entries[first] == src.get(first)
    assert src.get("no/such/entry", None) is None and src.get("no/such/entry", 7) == 7
    assert "no/such/entry" not in src
    with pytest.raises(KeyError) as info:
        src["no/such/entry"]
    assert isinstance(info.value, EntryNotFoundError) and isinstance(info.value, NoMatchError)
    assert info.value.name == "no/such/entry"
    assert dict(src.items()) == dict(src.entries)  # the Mapping mixins work over the same entries
    for name, value in values.items():  # a TF name, or the readable path of a Keras or TF2 key
        np.testing.assert_array_equal(src.read(name), value, err_msg=name)


# ---------------------------------------------------------------- one report for the same weights

def _matched(report) -> list:
    return sorted((r.variable_name, tuple(r.shape), r.dtype) for r in report.matched)


@pytest.mark.parametrize("case", [c for c in CASES if c.id != "tf1_bundle"])
def test_scan_and_restore_give_the_same_report_and_weights_from_every_format(request, case):
    trained, (path, values) = _case(request, case)
    model = _keras3(5)
    report = restorekit.scan(path, model)
    reference = restorekit.scan(request.getfixturevalue("files")[1]["weights_h5"][0], _keras3(6))
    assert not report.missing and not report.shape_mismatched and not report.dtype_mismatched
    assert _matched(report) == _matched(reference) == sorted((v.path, tuple(v.shape), v.dtype) for v in model.weights)
    restorekit.restore(report, strict=True)
    for v in model.weights:
        np.testing.assert_array_equal(v.numpy(), values[v.path], err_msg=v.path)


# ---------------------------------------------------------------- one rule for optimizer state

@pytest.fixture(scope="module")
def tf1_momentum(tmp_path_factory):
    """A TF1 checkpoint trained with Momentum: two weights, their slots, global_step."""
    prefix = str(tmp_path_factory.mktemp("tf1_momentum") / "model.ckpt")
    with tf.Graph().as_default():
        _tf1_variables()
        step = tf1.train.get_or_create_global_step()
        loss = tf.add_n([tf.reduce_sum(v ** 2) for v in tf1.trainable_variables()])
        train = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train)
            tf1.train.Saver().save(sess, prefix)
    return prefix


def _tf1_variables():
    with tf1.variable_scope("net"):
        return [tf1.get_variable("w", [4, 3]), tf1.get_variable("b", [3])]


def _scan_kinds(path, model=None) -> tuple[set, set]:
    """(entries scan skips as optimizer state, entries it skips as counters or RNG state)."""
    if model is None:
        with tf.Graph().as_default():
            _tf1_variables()
            tf1.train.get_or_create_global_step()
            report = restorekit.scan(path)
    else:
        report = restorekit.scan(path, model)
    entries = [r for r in report.skipped if r.checkpoint_name is not None]  # not the model's own global_step
    optimizer = {r.checkpoint_name for r in entries if "optimizer" in r.how}
    counters = {r.checkpoint_name for r in entries if {"counter", "rng"} & set(r.how)}
    return optimizer, counters


def _dropped_by_weights_only(path, out) -> set:
    """The entries ``convert(weights_only=True)`` leaves out (a Keras file's are written under readable paths)."""
    restorekit.convert(path, out, weights_only=True)
    kept = set(formats.open(out))
    src = formats.open(path)
    return {k for k in src if k not in kept and src.readable_name(k) not in kept and not k.startswith("_CHECKPOINTABLE")}


STATE_CASES = ["tf1_momentum", "tf2_object_graph", "weights_h5", "sharded_weights_json", "keras_archive",
               "legacy_keras2_h5"]


@pytest.mark.parametrize("case", STATE_CASES, ids=STATE_CASES)
def test_strip_weights_only_and_scan_agree_on_what_is_optimizer_state(request, case, tmp_path):
    if case == "tf1_momentum":
        path, model = request.getfixturevalue("tf1_momentum"), None
    else:
        path, model = request.getfixturevalue("files")[1][case][0], _keras3(3)
    optimizer, counters = _scan_kinds(path, model)
    assert optimizer, "the file holds optimizer state"
    assert set(CheckpointEditor(path).strip_optimizer_slots()) == optimizer
    assert _dropped_by_weights_only(path, tmp_path / "weights.safetensors") == optimizer | counters
    if case == "tf1_momentum":
        assert counters == {"global_step"} and {n.rsplit("/", 1)[-1] for n in optimizer} == {"Momentum"}


@pytest.mark.parametrize("fmt", ["safetensors", "npz", pytest.param("torch", marks=requires_torch)])
def test_converted_files_keep_the_same_answer_and_strip_refuses_them_by_name(tf1_momentum, tmp_path, fmt):
    suffix = {"safetensors": ".safetensors", "npz": ".npz", "torch": ".pt"}[fmt]
    path = str(tmp_path / f"momentum{suffix}")
    restorekit.convert(tf1_momentum, path)
    optimizer, counters = _scan_kinds(path)
    assert (optimizer, counters) == _scan_kinds(tf1_momentum)
    assert _dropped_by_weights_only(path, tmp_path / "weights.safetensors") == optimizer | counters
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(InvalidArgumentError, match=f"is a {fmt} file; convert it first"):
        CheckpointEditor(path)
    assert sorted(os.listdir(tmp_path)) == before
