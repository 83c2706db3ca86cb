"""Keras 2 era files (written by tf-keras, edited with h5py where tf-keras cannot write the layer) warm-start
Keras 3 models; the oracle is tf-keras loading the same file."""

from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
k2 = pytest.importorskip("tf_keras")

import restorekit  # noqa: E402
from restorekit._compare import diff_checkpoints  # noqa: E402
from restorekit.errors import RestoreKitWarning  # noqa: E402
from conftest import import_torch  # noqa: E402

L3, L2 = keras.layers, k2.layers
UNITS = 5
RNG = np.random.default_rng(0)


class Attention2(k2.layers.Layer):
    """A Keras 2 custom attention layer: its weights are named after the layer, as Keras 2.0 code did."""

    def build(self, shape):
        self.w = self.add_weight(name=f"{self.name}_W", shape=(shape[-1], 1))
        self.b = self.add_weight(name=f"{self.name}_b", shape=(1,))

    def call(self, x):
        scores = tf.nn.softmax(tf.squeeze(tf.tensordot(x, self.w, 1) + self.b, -1))
        return tf.reduce_sum(x * scores[..., None], 1)


class Attention3(keras.layers.Layer):
    """The same layer in Keras 3, its variables named otherwise (``w``, ``b``): paired by position."""

    def build(self, shape):
        self.w = self.add_weight(name="w", shape=(shape[-1], 1))
        self.b = self.add_weight(name="b", shape=(1,))

    def call(self, x):
        scores = keras.ops.softmax(keras.ops.squeeze(keras.ops.tensordot(x, self.w, 1) + self.b, -1))
        return keras.ops.sum(x * scores[..., None], 1)


def char_rnn(layers, attention, classes: int):
    """conv -> BN -> two LSTMs -> custom attention -> head, the same in tf-keras and Keras 3."""
    inp = layers.Input((6, 3))
    x = layers.Conv1D(8, 3, padding="same", name="conv1d_1")(inp)
    x = layers.BatchNormalization(name="batch_normalization_1")(x)
    x = layers.LSTM(UNITS, return_sequences=True, name="rnn_1")(x)
    x = layers.LSTM(UNITS, return_sequences=True, name="rnn_2")(x)
    x = attention(name="attention")(x)
    out = layers.Dense(classes, name="head")(x)
    model_cls = k2.Model if layers is L2 else keras.Model
    return model_cls(inp, out)


def cudnn_lstm(inputs: int) -> list:
    """A CuDNNLSTM layer's weights as Keras 2 saves them: kernel [in, 4u], recurrent [u, 4u], bias [8u]."""
    return [RNG.normal(size=(inputs, 4 * UNITS)).astype("float32"), RNG.normal(size=(UNITS, 4 * UNITS)).astype("float32"),
            RNG.normal(size=(8 * UNITS,)).astype("float32")]


def set_layer(path, layer: str, names: list, values: list) -> None:
    """Replace a layer's weights in a Keras 2 HDF5 file (weights or whole model), as Keras 2 lays them out."""
    with h5py.File(path, "r+") as f:
        root = f["model_weights"] if "model_weights" in f else f
        group = root[layer]
        for key in list(group):
            del group[key]
        for name, value in zip(names, values):
            group.create_dataset(name, data=value)
        group.attrs["weight_names"] = np.array([n.encode() for n in names])
        root.attrs["keras_version"] = b"2.1.6"


def nest_scopes(path, layer: str) -> None:
    """Rename a layer's weights as Keras 2.0 did, its scope repeated: ``conv1d_1/conv1d_1_1/kernel:0``."""
    with h5py.File(path, "r") as f:
        root = f["model_weights"] if "model_weights" in f else f
        names = [n.decode() if isinstance(n, bytes) else n for n in root[layer].attrs["weight_names"]]
        values = [np.asarray(root[layer][n]) for n in names]
    nested = [f"{layer}/{layer}_1/{n.rsplit('/', 1)[-1]}" for n in names]
    set_layer(path, layer, nested, values)


@pytest.fixture(scope="module")
def keras2_files(tmp_path_factory):
    """A Keras 2 weights file and full-model file of the char-RNN, its LSTMs CuDNNLSTMs, its scopes Keras 2.0's."""
    tmp = tmp_path_factory.mktemp("keras2")
    k2.utils.set_random_seed(1)
    model = char_rnn(L2, Attention2, 3)
    for w in model.weights:
        w.assign(RNG.normal(size=w.shape).astype("float32") if "variance" not in w.name
                 else RNG.uniform(0.5, 2.0, size=w.shape).astype("float32"))
    paths = {"weights": tmp / "char_rnn_weights.h5", "model": tmp / "char_rnn.h5"}
    model.save_weights(str(paths["weights"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tf-keras calls HDF5 legacy
        model.save(str(paths["model"]))
    rnn_1, rnn_2 = cudnn_lstm(8), cudnn_lstm(UNITS)
    for path in paths.values():
        for layer in ("conv1d_1", "batch_normalization_1"):
            nest_scopes(path, layer)
        for layer, values in (("rnn_1", rnn_1), ("rnn_2", rnn_2)):  # CuDNNLSTM names its weights without a cell
            set_layer(path, layer, [f"{layer}/kernel:0", f"{layer}/recurrent_kernel:0", f"{layer}/bias:0"], values)
        with h5py.File(path, "r") as f:
            root = f["model_weights"] if "model_weights" in f else f
            att = [np.asarray(root["attention"][n]) for n in root["attention"].attrs["weight_names"]]
        set_layer(path, "attention", ["attention/attention_W:0", "attention/attention_b:0"], att)
    return paths


def keras2_features(path, full: bool, x):
    """What tf-keras computes up to the attention layer from the file (it converts the CuDNN weights itself)."""
    if full:
        model = k2.models.load_model(str(path), custom_objects={"Attention2": Attention2}, compile=False)
    else:
        model = char_rnn(L2, Attention2, 3)
        model.load_weights(str(path))
    shared = k2.Model(model.input, model.get_layer("attention").output)
    return shared(x, training=False).numpy()


@pytest.mark.parametrize("which", ["weights", "model"], ids=["keras2 weights .h5", "keras2 full-model .h5"])
def test_a_keras2_file_with_cudnn_lstms_and_a_custom_layer_warm_starts_a_keras3_model_with_a_new_head(
        keras2_files, which):
    path = keras2_files[which]
    x = RNG.normal(size=(2, 6, 3)).astype("float32")
    expected = keras2_features(path, which == "model", x)

    model = char_rnn(L3, Attention3, 4)  # a new head: 4 classes instead of 3
    report = restorekit.scan(str(path), model.weights)
    head = {"head/kernel", "head/bias"}
    assert {r.variable_name for r in report.matched} == {v.path for v in model.weights} - head, str(report)
    assert {r.variable_name for r in report.shape_mismatched} == head and not report.missing, str(report)
    reasons = {r.variable_name: r.reason for r in report.matched}
    assert "CuDNNLSTM bias converted" in reasons["rnn_1/lstm_cell/bias"]
    assert "CuDNNLSTM kernel converted" in reasons["rnn_2/lstm_cell/kernel"]
    assert "by position in layer 'attention'" in reasons["attention/w"]
    assert all("head" in h for h in report.hints), report.hints  # nothing hints at the RNNs' or other weights
    restorekit.restore(report)
    shared = keras.Model(model.inputs, model.get_layer("attention").output)
    np.testing.assert_allclose(np.asarray(shared(x, training=False)), expected, atol=1e-5, rtol=0)


def test_keras2_nested_scopes_read_as_the_layer_path(keras2_files):
    ckpt = restorekit.Checkpoint(str(keras2_files["model"]))
    paths = {ckpt.readable_name(k) for k in ckpt.entries}
    assert {"conv1d_1/kernel", "conv1d_1/bias", "batch_normalization_1/gamma",
            "batch_normalization_1/moving_variance"} <= paths
    assert not any("conv1d_1_1" in p or "batch_normalization_1_1" in p for p in paths)


def test_cudnn_weights_without_a_fitting_lstm_are_refused_by_name_and_never_hinted_a_slice(keras2_files):
    inp = keras.Input((6, 8))
    model = keras.Model(inp, L3.LSTM(UNITS + 1, name="rnn_2")(inp))  # the file's LSTM has UNITS units
    report = restorekit.scan(str(keras2_files["weights"]), model.weights)
    refused = {r.variable_name: r.reason for r in report.shape_mismatched}
    assert set(refused) >= {"rnn_2/lstm_cell/bias"} and "CuDNNLSTM weights (units 5)" in refused["rnn_2/lstm_cell/bias"]
    assert not any(r.variable_name.startswith("rnn_2") for r in report.matched), str(report)
    assert not any("slice_or_pad" in h for h in report.hints), report.hints


def _cudnn_file(path, layer: str, inputs: int, gates: int):
    """A Keras 2 weights file of one CuDNNLSTM (4 gates) or CuDNNGRU (3) layer: its bias [2 * gates * u]."""
    values = [RNG.normal(size=(inputs, gates * UNITS)).astype("float32"),
              RNG.normal(size=(UNITS, gates * UNITS)).astype("float32"),
              RNG.normal(size=(2 * gates * UNITS,)).astype("float32")]
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([layer.encode()])
        f.attrs["backend"], f.attrs["keras_version"] = b"tensorflow", b"2.1.6"
        group = f.create_group(layer)
        names = [f"{layer}/kernel:0", f"{layer}/recurrent_kernel:0", f"{layer}/bias:0"]
        for name, value in zip(names, values):
            group.create_dataset(name, data=value)
        group.attrs["weight_names"] = np.array([n.encode() for n in names])


def test_a_cudnn_gru_restores_into_a_reset_after_gru_as_tf_keras_loads_it(tmp_path):
    _cudnn_file(tmp_path / "gru.h5", "gru_1", 3, 3)
    x = RNG.normal(size=(2, 4, 3)).astype("float32")
    inp = k2.Input((4, 3))
    oracle = k2.Model(inp, L2.GRU(UNITS, reset_after=True, name="gru_1")(inp))
    oracle.load_weights(str(tmp_path / "gru.h5"))
    inp = keras.Input((4, 3))
    model = keras.Model(inp, L3.GRU(UNITS, name="gru_1")(inp))
    report = restorekit.restore(restorekit.scan(str(tmp_path / "gru.h5"), model.weights), strict=True)
    assert all("CuDNNGRU" in r.reason for r in report.matched)
    np.testing.assert_allclose(np.asarray(model(x)), oracle(x).numpy(), atol=1e-5, rtol=0)

    inp = keras.Input((4, 3))
    before = keras.Model(inp, L3.GRU(UNITS, reset_after=False, name="gru_1")(inp))
    report = restorekit.scan(str(tmp_path / "gru.h5"), before.weights)
    assert not report.matched and len(report.shape_mismatched) == 3, str(report)
    assert all("GRU(reset_after=True)" in r.reason for r in report.shape_mismatched)
    assert not any("slice_or_pad" in h for h in report.hints), report.hints


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_cudnn_rnn_exported_in_the_torch_layout_computes_what_tf_keras_computes(tmp_path, kind):
    torch = import_torch()
    from safetensors.numpy import load_file

    from restorekit.export import import_checkpoint

    path = tmp_path / "rnn.h5"
    _cudnn_file(path, "rnn_1", 3, 4 if kind == "LSTM" else 3)
    x = RNG.normal(size=(2, 4, 3)).astype("float32")
    inp = k2.Input((4, 3))
    layer = L2.LSTM(UNITS, name="rnn_1") if kind == "LSTM" else L2.GRU(UNITS, reset_after=True, name="rnn_1")
    oracle = k2.Model(inp, layer(inp))
    oracle.load_weights(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RestoreKitWarning)  # every tensor mapped
        result = restorekit.convert(str(path), tmp_path / "m.safetensors", layout="torch")
    assert result.unmapped == ()
    twin = getattr(torch.nn, kind)(3, UNITS, batch_first=True)
    twin.load_state_dict({k.removeprefix("rnn_1."): torch.from_numpy(v)
                          for k, v in load_file(tmp_path / "m.safetensors").items()}, strict=True)
    with torch.no_grad():
        out = twin(torch.from_numpy(x))[0][:, -1].numpy()
    np.testing.assert_allclose(out, oracle(x).numpy(), atol=1e-5, rtol=0)
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")  # and back, bit-exact
    back, ckpt = restorekit.Checkpoint(str(tmp_path / "back" / "ckpt")), restorekit.Checkpoint(str(path))
    for key in ckpt.entries:
        np.testing.assert_array_equal(back.read(ckpt.readable_name(key)), ckpt.read(key))


def _keras2_classifier(layers, model_cls):
    """A Keras 2.0-style conv / separable / BN / residual classifier, named as Keras 2 numbers layers."""
    inp = layers.Input((8, 8, 3))
    x = layers.Conv2D(6, 3, padding="same", name="conv2d_1")(inp)
    x = layers.BatchNormalization(name="batch_normalization_1")(x)
    y = layers.SeparableConv2D(6, 3, padding="same", use_bias=False, name="separable_conv2d_1")(x)
    y = layers.BatchNormalization(scale=False, name="batch_normalization_2")(y)
    x = layers.Add(name="add_1")([x, y])
    x = layers.GlobalAveragePooling2D(name="global_average_pooling2d_1")(x)
    return model_cls(inp, layers.Dense(4, name="dense_1")(x))


def test_a_keras2_0_classifier_with_nested_scopes_restores_the_same_architecture_in_keras3(tmp_path):
    model2 = _keras2_classifier(L2, k2.Model)
    for w in model2.weights:
        w.assign(RNG.uniform(0.5, 1.5, size=w.shape).astype("float32") if "variance" in w.name
                 else 0.3 * RNG.normal(size=w.shape).astype("float32"))
    path = tmp_path / "classifier.h5"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model2.save(str(path))
    for layer in ("conv2d_1", "batch_normalization_1", "separable_conv2d_1", "batch_normalization_2", "dense_1"):
        nest_scopes(path, layer)
    x = RNG.normal(size=(2, 8, 8, 3)).astype("float32")
    expected = k2.models.load_model(str(path), compile=False)(x, training=False).numpy()

    model3 = _keras2_classifier(L3, keras.Model)
    report = restorekit.restore(restorekit.scan(str(path), model3), strict=True)
    assert len(report.matched) == len(model3.weights) and not report.unused, str(report)
    np.testing.assert_allclose(np.asarray(model3(x, training=False)), expected, atol=1e-5, rtol=0)
    restorekit.convert(str(path), tmp_path / "classifier.safetensors", layout="torch")
    from safetensors.numpy import load_file

    names = set(load_file(tmp_path / "classifier.safetensors"))
    assert {"conv2d_1.weight", "separable_conv2d_1.depthwise.weight"} <= names and not any("_1_1" in n for n in names)
    model3.save(tmp_path / "classifier.keras")  # its config names BatchNormalization(scale=False)'s variables
    tf.train.Checkpoint(model=model3).write(str(tmp_path / "tf2" / "ckpt"))
    for other in ("classifier.keras", "tf2/ckpt"):
        d = diff_checkpoints(str(path), str(tmp_path / other), by="path")
        assert d["equal"] and d["same"] == len(model3.weights), {k: d[k] for k in ("only_in_a", "only_in_b", "values")}


def test_keras_numbering_of_a_keras2_file_is_paired_by_the_keras2_rule_set_when_no_name_matches(tmp_path):
    """Keras 2 numbered layers from 1 (dense_1, dense_2), Keras 3 from 0 (dense, dense_1)."""
    path = tmp_path / "w.h5"
    values = [RNG.normal(size=s).astype("float32") for s in ((4, 3), (3,), (3, 2), (2,))]
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"dense_1", b"dense_2"])
        f.attrs["backend"], f.attrs["keras_version"] = b"tensorflow", b"2.2.4"
        for layer, (kernel, bias) in (("dense_1", values[:2]), ("dense_2", values[2:])):
            group = f.create_group(layer)
            group.create_dataset(f"{layer}/kernel:0", data=kernel)
            group.create_dataset(f"{layer}/bias:0", data=bias)
            group.attrs["weight_names"] = np.array([f"{layer}/kernel:0".encode(), f"{layer}/bias:0".encode()])
    inp = keras.Input((4,))  # named as Keras 3 names them in a new process
    model = keras.Model(inp, L3.Dense(2, name="dense_1")(L3.Dense(3, name="dense")(inp)))
    report = restorekit.restore(restorekit.scan(str(path), model), strict=True)
    assert any("KERAS_FROM_KERAS2" in h for h in report.hints), report.hints
    for v, value in zip(model.weights, values):
        np.testing.assert_array_equal(v.numpy(), value)


def test_a_scope_level_more_or_less_is_hinted_and_the_hint_restores(tmp_path):
    """A TF checkpoint of an LSTM saved without the cell's scope: the hint's rules restore every weight."""
    prefix = str(tmp_path / "ckpt")
    values = {"rnn_1/kernel": (3, 4 * UNITS), "rnn_1/recurrent_kernel": (UNITS, 4 * UNITS), "rnn_1/bias": (4 * UNITS,)}
    values = {k: RNG.normal(size=s).astype("float32") for k, s in values.items()}
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=list(values), shape_and_slices=[""] * 3,
                      tensors=list(values.values()))
    inp = keras.Input((4, 3))
    model = keras.Model(inp, L3.LSTM(UNITS, name="rnn_1")(inp))
    report = restorekit.scan(prefix, model.weights)
    assert len(report.missing) == 3
    hint = next(h for h in report.hints if "one scope level apart" in h)
    assert "3 of the 3 missing" in hint and "Rules(scope_levels=True)" in hint
    report = restorekit.restore(restorekit.scan(prefix, model.weights, rules=restorekit.Rules(scope_levels=True)),
                                strict=True)
    for v in model.weights:
        np.testing.assert_array_equal(v.numpy(), values[v.path.replace("/lstm_cell", "")])


def test_a_custom_layer_of_a_keras3_archive_pairs_by_position_inside_its_layer(tmp_path):
    inp = keras.Input((6, 3))
    model = keras.Model(inp, Attention3(name="attention")(L3.Dense(4, name="proj")(inp)))
    for v in model.weights:
        v.assign(RNG.normal(size=v.shape).astype("float32"))
    model.save(tmp_path / "m.keras")
    ckpt = restorekit.Checkpoint(str(tmp_path / "m.keras"))
    # the config names a custom class: its variables keep their indices, nothing is guessed
    assert {"attention/0", "attention/1"} <= {ckpt.readable_name(k) for k in ckpt.entries}
    inp = keras.Input((6, 3))
    twin = keras.Model(inp, Attention3(name="attention")(L3.Dense(4, name="proj")(inp)))
    report = restorekit.restore(restorekit.scan(str(tmp_path / "m.keras"), twin), strict=True)
    assert {r.variable_name for r in report.matched if "by position" in r.reason} == {"attention/w", "attention/b"}
    for a, b in zip(model.weights, twin.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())



def test_an_edited_keras2_file_saved_as_h5_is_a_legacy_keras_file_not_a_tf_checkpoint(tmp_path):
    from restorekit.edit import CheckpointEditor

    _cudnn_file(tmp_path / "legacy.h5", "gru_1", 3, 3)
    editor = CheckpointEditor(str(tmp_path / "legacy.h5"))
    editor.save(str(tmp_path / "x.h5"))  # written as tf-keras writes it (tests/test_keras_legacy_write.py)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["legacy.h5", "x.h5"]
    before, after = restorekit.Checkpoint(tmp_path / "legacy.h5"), restorekit.Checkpoint(tmp_path / "x.h5")
    assert after.kind == before.kind and list(after) == list(before)
    for key in before:
        np.testing.assert_array_equal(after.read(key), before.read(key))
    with h5py.File(tmp_path / "legacy.h5", "r") as a, h5py.File(tmp_path / "x.h5", "r") as b:
        assert list(b.attrs["layer_names"]) == list(a.attrs["layer_names"])
    editor.save(str(tmp_path / "x.safetensors"))  # a name restorekit writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["legacy.h5", "x.h5", "x.safetensors"]
