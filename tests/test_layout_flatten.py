"""layout='torch' for a Dense behind a Flatten: Keras flattens position first, torch.nn.Flatten channel first.

Each case builds the Keras (or tf-slim) model and its natural torch twin (Conv2d, MaxPool2d,
Flatten, Linear) with their own frameworks, and compares the twin's outputs after an export
and after a restore with the source framework's own outputs. The bare-checkpoint cases check
the warning that names the Dense, and that flatten_channels= settles it.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit.errors import InvalidArgumentError, RestoreKitWarning
from restorekit.layouts import torch_view
from restorekit.layouts._flatten import flatten_inputs
from conftest import import_torch, requires_torch

X = np.random.RandomState(0).randn(2, 6, 6, 3).astype("float32")


def _functional():
    inp = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3, name="conv")(inp)
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dropout(0.1, name="drop")(x)
    return keras.Model(inp, keras.layers.Dense(5, name="fc")(x))


def _sequential():
    return keras.Sequential([keras.Input((6, 6, 3)), keras.layers.Conv2D(4, 3, name="conv"),
                             keras.layers.MaxPooling2D(name="pool"), keras.layers.Flatten(name="flatten"),
                             keras.layers.Dense(5, name="fc")])


def _gap():
    inp = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3, name="conv")(inp)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inp, keras.layers.Dense(5, name="fc")(x))


def _twin(torch, fc_in=16, pool=True):
    nn = torch.nn

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.pool = nn.MaxPool2d(2) if pool else nn.Identity()
            self.flatten = nn.Flatten()
            self.fc = nn.Linear(fc_in, 5)

        def forward(self, x):
            return self.fc(self.flatten(self.pool(self.conv(x))))

    return Twin()


def _run(torch, twin, x=X):
    with torch.no_grad():
        return twin(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))).numpy()


def _load(torch, twin, path):
    from safetensors.torch import load_file

    twin.load_state_dict(load_file(str(path)), strict=True)
    return twin


def _no_unsure_warning(record):
    return [w for w in record if "flattened feature map" in str(w.message)]


# ------------------------------------------------------------------ which Dense reads a Flatten, from a config
@pytest.mark.parametrize("build", [_functional, _sequential], ids=["functional", "sequential"])
def test_a_config_shows_the_dense_behind_the_flatten_and_its_channels(build):
    model = build()
    found = flatten_inputs(model.get_config())
    assert set(found) == {"fc"} and found["fc"].channels == 4 and found["fc"].why is None


def test_a_dense_behind_global_pooling_reads_no_flattened_map():
    assert flatten_inputs(_gap().get_config()) == {}


def test_a_keras2_functional_config_is_followed_through_its_inbound_nodes():
    config = {"class_name": "Functional", "config": {"layers": [
        {"class_name": "InputLayer", "config": {"name": "in"}, "inbound_nodes": []},
        {"class_name": "Conv2D", "config": {"name": "c", "filters": 8, "data_format": "channels_last"},
         "inbound_nodes": [[["in", 0, 0, {}]]]},
        {"class_name": "MaxPooling2D", "config": {"name": "p", "data_format": "channels_last"},
         "inbound_nodes": [[["c", 0, 0, {}]]]},
        {"class_name": "Flatten", "config": {"name": "f", "data_format": "channels_last"},
         "inbound_nodes": [[["p", 0, 0, {}]]]},
        {"class_name": "Dense", "config": {"name": "d"}, "inbound_nodes": [[["f", 0, 0, {}]]]},
        {"class_name": "Dense", "config": {"name": "d2"}, "inbound_nodes": [[["d", 0, 0, {}]]]},
    ]}}
    found = flatten_inputs(config)
    assert set(found) == {"d"} and found["d"].channels == 8


def test_a_channels_first_map_flattened_as_stored_needs_no_reorder():
    config = {"class_name": "Sequential", "config": {"layers": [
        {"class_name": "Conv2D", "config": {"name": "c", "filters": 8, "data_format": "channels_first"}},
        {"class_name": "Flatten", "config": {"name": "f", "data_format": "channels_last"}},
        {"class_name": "Dense", "config": {"name": "d"}},
    ]}}
    assert flatten_inputs(config) == {}


# ------------------------------------------------------------------ export, then the torch twin computes Keras' outputs
@requires_torch
@pytest.mark.parametrize("build", [_functional, _sequential], ids=["functional", "sequential"])
def test_export_of_a_keras_file_reorders_the_dense_after_a_flatten(tmp_path, build):
    torch = import_torch()
    model = build()
    model.save(tmp_path / "m.keras")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        restorekit.convert(str(tmp_path / "m.keras"), str(tmp_path / "m.safetensors"), layout="torch")
    assert not _no_unsure_warning(record)
    twin = _load(torch, _twin(torch), tmp_path / "m.safetensors")
    np.testing.assert_allclose(_run(torch, twin), model(X).numpy(), atol=1e-5)


@requires_torch
def test_export_of_a_tf2_checkpoint_with_its_model_reorders_and_round_trips(tmp_path):
    torch = import_torch()
    model = _functional()
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ck" / "m"))
    out = tmp_path / "m.safetensors"
    restorekit.convert(prefix, str(out), layout="torch", model=model)
    twin = _load(torch, _twin(torch), out)
    np.testing.assert_allclose(_run(torch, twin), model(X).numpy(), atol=1e-5)
    # and back: the record undoes the reorder bit for bit
    restorekit.import_checkpoint(str(out), str(tmp_path / "back" / "m"))
    back, source = restorekit.Checkpoint(str(tmp_path / "back" / "m")), restorekit.Checkpoint(prefix)
    weights = [n for n in source.entries if "_kernel" in n or "bias" in n]
    assert len(weights) == 4 and set(weights) <= set(back.entries)
    for name in weights:
        np.testing.assert_array_equal(back.read(name), source.read(name))


@requires_torch
def test_a_tf2_checkpoint_without_its_model_warns_by_name_and_flatten_channels_settles_it(tmp_path):
    torch = import_torch()
    model = _functional()
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ck" / "m"))
    with pytest.warns(RestoreKitWarning, match=r"'fc'.*16 inputs are a multiple of the 4 channels of 'conv'"):
        restorekit.convert(prefix, str(tmp_path / "plain.safetensors"), layout="torch")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        restorekit.convert(prefix, str(tmp_path / "m.safetensors"), layout="torch", flatten_channels={"fc": 4})
    assert not _no_unsure_warning(record)
    twin = _load(torch, _twin(torch), tmp_path / "m.safetensors")
    np.testing.assert_allclose(_run(torch, twin), model(X).numpy(), atol=1e-5)
    # flatten_channels={'fc': None}: no Flatten there, the plain transpose, and no warning
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        restorekit.convert(prefix, str(tmp_path / "none.safetensors"), layout="torch", flatten_channels={"fc": None})
    assert not _no_unsure_warning(record)


def test_a_dense_behind_global_pooling_is_not_warned_about(tmp_path):
    model = _gap()
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ck" / "m"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        view = torch_view(restorekit.Checkpoint(prefix))
    assert not _no_unsure_warning(record) and not view.unsure


@requires_torch
def test_a_keras2_h5_model_file_is_reordered_from_its_model_config(tmp_path):
    torch = import_torch()
    tf_keras = pytest.importorskip("tf_keras")  # the test extra installs it
    layers = tf_keras.layers
    model = tf_keras.Sequential([layers.Conv2D(4, 3, name="conv", input_shape=(6, 6, 3)),
                                 layers.MaxPooling2D(name="pool"), layers.Flatten(name="flatten"),
                                 layers.Dense(5, name="fc")])
    model.save(str(tmp_path / "m.h5"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        restorekit.convert(str(tmp_path / "m.h5"), str(tmp_path / "m.safetensors"), layout="torch")
    assert not _no_unsure_warning(record)
    twin = _load(torch, _twin(torch), tmp_path / "m.safetensors")
    np.testing.assert_allclose(_run(torch, twin), model.predict(X, verbose=0), atol=1e-5)


# ------------------------------------------------------------------ restore into the torch twin
@requires_torch
def test_restore_of_a_keras_file_into_the_twin_computes_keras_outputs(tmp_path):
    torch = import_torch()
    model = _functional()
    model.save(tmp_path / "m.keras")
    twin = _twin(torch)
    report = restorekit.scan(str(tmp_path / "m.keras"), twin, layout="torch")
    assert len(report.matched) == 4
    restorekit.restore(report)
    np.testing.assert_allclose(_run(torch, twin), model(X).numpy(), atol=1e-5)


@requires_torch
def test_restore_of_a_tf2_checkpoint_through_a_view_with_its_model(tmp_path):
    torch = import_torch()
    model = _functional()
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ck" / "m"))
    twin = _twin(torch)
    report = restorekit.scan(torch_view(restorekit.Checkpoint(prefix), model=model), twin)
    assert len(report.matched) == 4
    restorekit.restore(report)
    np.testing.assert_allclose(_run(torch, twin), model(X).numpy(), atol=1e-5)


@requires_torch
def test_a_tf_slim_flatten_is_warned_about_and_reordered_with_flatten_channels(tmp_path):
    torch = import_torch()
    import tf_slim as slim

    tf1 = tf.compat.v1
    with tf.Graph().as_default():
        images = tf1.placeholder(tf.float32, [None, 6, 6, 3])
        net = slim.conv2d(images, 4, 3, padding="VALID", activation_fn=None, scope="conv")
        net = slim.max_pool2d(net, 2, scope="pool")
        logits = slim.fully_connected(slim.flatten(net), 5, activation_fn=None, scope="fc")
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            expected = sess.run(logits, {images: X})
            prefix = tf1.train.Saver().save(sess, str(tmp_path / "slim" / "model.ckpt"))
    with pytest.warns(RestoreKitWarning, match=r"'fc'.*flatten_channels"):
        torch_view(restorekit.Checkpoint(prefix))
    twin = _twin(torch)
    report = restorekit.scan(torch_view(restorekit.Checkpoint(prefix), flatten_channels={"fc": 4}), twin)
    restorekit.restore(report)
    np.testing.assert_allclose(_run(torch, twin), expected, atol=1e-5)


# ------------------------------------------------------------------ bad hints: refused before anything is written
@pytest.mark.parametrize("hint, match", [
    ({"nope": 4}, "names no Dense layer"),
    ({"fc": 3}, "not a multiple of the 3 channels"),
], ids=["a key naming no Dense", "channels that do not divide the inputs"])
def test_bad_flatten_channels_are_refused_and_nothing_is_written(tmp_path, hint, match):
    prefix = tf.train.Checkpoint(model=_functional()).write(str(tmp_path / "ck" / "m"))
    out = tmp_path / "m.safetensors"
    with pytest.raises(InvalidArgumentError, match=match):
        restorekit.convert(prefix, str(out), layout="torch", flatten_channels=hint)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_layout_hints_without_the_layout_are_refused(tmp_path):
    prefix = tf.train.Checkpoint(model=_functional()).write(str(tmp_path / "ck" / "m"))
    with pytest.raises(InvalidArgumentError, match="layout='torch'"):
        restorekit.convert(prefix, str(tmp_path / "m.safetensors"), flatten_channels={"fc": 4})
    assert not (tmp_path / "m.safetensors").exists()


# ------------------------------------------------------------------ the other way: a PyTorch file into Keras
@requires_torch
def test_a_pth_scanned_into_a_keras_model_points_at_layout_torch(tmp_path):
    torch = import_torch()
    torch.save(_twin(torch).state_dict(), tmp_path / "t.pth")
    report = restorekit.scan(str(tmp_path / "t.pth"), _functional())
    assert not report.matched and len(report.unused) == 4
    assert any("layout='torch'" in h and "'conv.weight' [4, 3, 3, 3]" in h for h in report.hints), report.hints


@requires_torch
def test_a_pth_restored_into_a_keras_model_with_layout_torch_computes_the_twins_outputs(tmp_path):
    torch = import_torch()
    twin = _twin(torch)
    torch.save(twin.state_dict(), tmp_path / "t.pth")
    model = _functional()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        report = restorekit.scan(str(tmp_path / "t.pth"), model, layout="torch")
    assert not _no_unsure_warning(record)  # the model's config shows the Flatten
    assert len(report.matched) == 4 and not report.unused
    restorekit.restore(report)
    np.testing.assert_allclose(model(X).numpy(), _run(torch, twin), atol=1e-5)


@requires_torch
def test_a_pth_converted_to_tf_warns_about_the_linear_and_flatten_channels_reorders_it(tmp_path):
    torch = import_torch()
    twin = _twin(torch)
    torch.save(twin.state_dict(), tmp_path / "t.pth")
    with pytest.warns(RestoreKitWarning, match=r"'fc.weight'.*16 inputs are a multiple of the 4 channels of 'conv'"):
        restorekit.convert(str(tmp_path / "t.pth"), str(tmp_path / "plain" / "m.ckpt"), layout="torch")
    restorekit.convert(str(tmp_path / "t.pth"), str(tmp_path / "tf" / "m.ckpt"), layout="torch",
                       flatten_channels={"fc": 4})
    model = _functional()
    report = restorekit.scan(str(tmp_path / "tf" / "m.ckpt"), model)
    assert len(report.matched) == 4
    restorekit.restore(report)
    np.testing.assert_allclose(model(X).numpy(), _run(torch, twin), atol=1e-5)


def _nested():
    """A backbone model's convolution, then a head model's Flatten and Dense: the walk crosses both models."""
    inp = keras.Input((6, 6, 3))
    backbone = keras.Model(inp, keras.layers.MaxPooling2D(name="pool")(keras.layers.Conv2D(4, 3, name="conv")(inp)),
                           name="backbone")
    head = keras.Sequential([keras.layers.Flatten(name="flatten"), keras.layers.Dense(5, name="fc")], name="head")
    outer = keras.Input((6, 6, 3))
    return keras.Model(outer, head(backbone(outer)))


def _reshaped():
    inp = keras.Input((6, 6, 3))
    x = keras.layers.MaxPooling2D(name="pool")(keras.layers.Conv2D(4, 3, name="conv")(inp))
    x = keras.layers.Reshape((-1,), name="reshape")(x)
    return keras.Model(inp, keras.layers.Dense(5, name="fc")(x))


@pytest.mark.parametrize("build", [_nested, _reshaped], ids=["across nested models", "a Reshape to one axis"])
def test_the_walk_finds_the_flatten_across_models_and_reshapes(build):
    found = flatten_inputs(build().get_config())
    assert set(found) == {"fc"} and found["fc"].channels == 4 and found["fc"].why is None


@requires_torch
@pytest.mark.parametrize("build", [_nested, _reshaped], ids=["across nested models", "a Reshape to one axis"])
def test_a_keras_file_across_models_or_with_a_reshape_exports_for_the_twin(tmp_path, build):
    torch = import_torch()
    model = build()
    model.save(tmp_path / "m.keras")
    restorekit.convert(str(tmp_path / "m.keras"), str(tmp_path / "m.safetensors"), layout="torch")
    from safetensors.torch import load_file

    # the Sequential head's layers are named inside it ('head.fc.weight'), as a twin with self.head would name them
    stored = {k.removeprefix("head."): v for k, v in load_file(str(tmp_path / "m.safetensors")).items()}
    twin = _twin(torch)
    twin.load_state_dict(stored, strict=True)
    np.testing.assert_allclose(_run(torch, twin), model(X).numpy(), atol=1e-5)
