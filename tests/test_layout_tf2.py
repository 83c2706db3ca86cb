"""Tests for restorekit/layouts on object-based (TF2, Keras 3) checkpoints: layout='torch'."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import requires_torch
from restorekit._checkpoint import Checkpoint
from restorekit.export import convert, export_checkpoint, import_checkpoint
from restorekit.formats import safetensors as st_format

FORMATS = ["safetensors", pytest.param("pt", marks=requires_torch)]


def keras_model():
    """Conv2D -> BatchNormalization -> pooling -> Dense, with the layer names the torch side uses."""
    inp = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3, name="conv")(inp)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(2, name="fc")(x), name="net")


class Linear(tf.Module):
    def __init__(self, n_in, n_out, seed):
        super().__init__()
        rng = np.random.RandomState(seed)
        self.kernel = tf.Variable(rng.randn(n_in, n_out).astype(np.float32), name="kernel")
        self.bias = tf.Variable(rng.randn(n_out).astype(np.float32), name="bias")

    def __call__(self, x):
        return x @ self.kernel + self.bias


class TwoLayers(tf.Module):
    """Plain tf.Variables: both layers' variables are named 'kernel' and 'bias'."""

    def __init__(self):
        super().__init__()
        self.a = Linear(3, 5, seed=1)
        self.b = Linear(5, 2, seed=2)

    def __call__(self, x):
        return self.b(tf.nn.relu(self.a(x)))


def train_one_step(model, x, optimizer):
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x, training=True) if isinstance(model, keras.Model) else model(x)))
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))


def images(seed=0):
    return np.random.RandomState(seed).rand(2, 6, 6, 3).astype(np.float32)


@pytest.fixture(scope="module")
def keras_checkpoint(tmp_path_factory):
    """A trained Keras 3 model with its Adam slots, saved with tf.train.Checkpoint(model=..., optimizer=...)."""
    keras.utils.set_random_seed(0)
    model, optimizer = keras_model(), keras.optimizers.Adam(0.1)
    train_one_step(model, images(), optimizer)  # also moves the BN statistics off 0 and 1
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path_factory.mktemp("keras") / "ckpt"))
    return prefix, model


@pytest.fixture(scope="module")
def module_checkpoint(tmp_path_factory):
    model, optimizer = TwoLayers(), keras.optimizers.Adam(0.1)
    train_one_step(model, np.ones((2, 3), np.float32), optimizer)
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path_factory.mktemp("module") / "ckpt"))
    return prefix, model


def stored(path):
    if str(path).endswith(".pt"):
        import torch

        return {k: v.numpy() for k, v in torch.load(path, weights_only=True).items()}
    return dict(st_format.read(path))


def assert_same_checkpoint(a, b):
    a, b = Checkpoint(a), Checkpoint(b)
    assert list(a.entries) == list(b.entries)
    for name, entry in a.entries.items():
        assert (b.entries[name].dtype, b.entries[name].shape) == (entry.dtype, entry.shape), name
        x, y = a.read(name), b.read(name)
        assert x.tolist() == y.tolist() if x.dtype == object else x.tobytes() == y.tobytes(), name


# ------------------------------------------------------------------ what the file holds

@pytest.mark.parametrize("fmt", FORMATS)
def test_keras_model_weights_get_torch_names_and_axes(keras_checkpoint, tmp_path, fmt):
    prefix, model = keras_checkpoint
    result = export_checkpoint(prefix, tmp_path / f"m.{fmt}", layout="torch")
    tensors = stored(tmp_path / f"m.{fmt}")
    conv, bn, fc = (model.get_layer(n) for n in ("conv", "bn", "fc"))
    # Keras 3 reaches these through 'optimizer/_trainable_variables/N'; the names come
    # from the variables' Keras paths instead.
    assert tensors["fc.weight"].shape == (2, 4)
    np.testing.assert_array_equal(tensors["fc.weight"], fc.kernel.numpy().T)
    assert tensors["conv.weight"].shape == (4, 3, 3, 3)  # OIHW
    np.testing.assert_array_equal(tensors["conv.weight"], np.transpose(conv.kernel.numpy(), (3, 2, 0, 1)))
    np.testing.assert_array_equal(tensors["conv.bias"], conv.bias.numpy())
    for torch_leaf, keras_variable in [
        ("weight", bn.gamma), ("bias", bn.beta), ("running_mean", bn.moving_mean), ("running_var", bn.moving_variance)
    ]:
        np.testing.assert_array_equal(tensors[f"bn.{torch_leaf}"], keras_variable.numpy())
    assert sorted(Checkpoint(prefix).readable_name(k) for k in result.permuted) == ["conv/kernel", "fc/kernel"]


def test_optimizer_slots_keep_tf_axes_under_their_readable_names(keras_checkpoint, tmp_path):
    prefix, model = keras_checkpoint
    ckpt = Checkpoint(prefix)
    result = export_checkpoint(ckpt, tmp_path / "m.safetensors", layout="torch")
    tensors = stored(tmp_path / "m.safetensors")
    # Keras numbers optimizer names per process ('adam', 'adam_1', ...): find this one's.
    scope = next(p for p in ckpt.object_paths if p.startswith("optimizer/") and p.endswith("/fc_kernel_momentum"))
    scope = scope[: -len("/fc_kernel_momentum")]
    dotted = scope.replace("/", ".")
    key = ckpt.object_paths[f"{scope}/fc_kernel_momentum"]
    np.testing.assert_array_equal(tensors[f"{dotted}.fc_kernel_momentum"], ckpt.read(key))
    assert tensors[f"{dotted}.conv_kernel_velocity"].shape == (3, 3, 3, 4)
    assert tensors[f"{dotted}.iteration"] == 1 and "save_counter" in tensors
    # Every optimizer tensor is listed as kept (Adam: 2 slots for each of 6 variables,
    # iteration, learning_rate), and none of them was permuted.
    assert set(result.kept) == {v.key for v in ckpt.object_graph.variables if v.kind == "optimizer"}
    assert len(result.kept) == 14 and not set(result.kept) & set(result.permuted)
    assert "2 permuted; 14 optimizer tensors left in TF layout" in str(result)


def test_tf_module_kernels_are_named_by_their_path_under_the_model(module_checkpoint, tmp_path):
    prefix, model = module_checkpoint
    result = export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    tensors = stored(tmp_path / "m.safetensors")
    assert {k for k in tensors if k.startswith("model.")} == {"model.a.weight", "model.a.bias", "model.b.weight", "model.b.bias"}
    np.testing.assert_array_equal(tensors["model.b.weight"], model.b.kernel.numpy().T)
    assert len(result.permuted) == 2 and len(result.kept) == 10


# ------------------------------------------------------------------ the file in PyTorch

@requires_torch
def test_torch_modules_loaded_from_the_file_compute_what_keras_computes(keras_checkpoint, tmp_path):
    import torch

    prefix, model = keras_checkpoint
    export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    tensors = {k: torch.from_numpy(v) for k, v in stored(tmp_path / "m.safetensors").items()}
    net = torch.nn.ModuleDict({
        "conv": torch.nn.Conv2d(3, 4, 3),
        "bn": torch.nn.BatchNorm2d(4, eps=model.get_layer("bn").epsilon),
        "fc": torch.nn.Linear(4, 2),
    })
    state = {k: v for k, v in tensors.items() if k.split(".")[0] in net}
    state["bn.num_batches_tracked"] = torch.tensor(0)  # torch-only bookkeeping; the rest must match exactly
    net.load_state_dict(state, strict=True)
    net.eval()
    x = images(seed=1)
    with torch.no_grad():
        h = net["bn"](net["conv"](torch.from_numpy(x).permute(0, 3, 1, 2)))
        out = net["fc"](h.mean(dim=(2, 3))).numpy()
    np.testing.assert_allclose(out, model(x, training=False).numpy(), atol=1e-5, rtol=1e-5)


@requires_torch
def test_torch_linear_loaded_from_a_tf_module_computes_what_it_computes(module_checkpoint, tmp_path):
    import torch

    prefix, model = module_checkpoint
    export_checkpoint(prefix, tmp_path / "m.pt", layout="torch")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 5), "b": torch.nn.Linear(5, 2)})
    net.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}, strict=True)
    x = np.random.RandomState(3).rand(4, 3).astype(np.float32)
    with torch.no_grad():
        out = net["b"](torch.relu(net["a"](torch.from_numpy(x)))).numpy()
    np.testing.assert_allclose(out, model(x).numpy(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ back to TF

@pytest.mark.parametrize("fmt", FORMATS)
def test_import_gives_back_the_checkpoint_bit_exactly_and_keras_restores_it(keras_checkpoint, tmp_path, fmt):
    prefix, model = keras_checkpoint
    export_checkpoint(prefix, tmp_path / f"m.{fmt}", layout="torch")
    import_checkpoint(tmp_path / f"m.{fmt}", tmp_path / "back" / "ckpt")
    assert_same_checkpoint(prefix, tmp_path / "back" / "ckpt")
    fresh = keras_model()
    tf.train.Checkpoint(model=fresh).restore(str(tmp_path / "back" / "ckpt")).assert_existing_objects_matched()
    for restored, original in zip(fresh.weights, model.weights, strict=True):
        np.testing.assert_array_equal(restored.numpy(), original.numpy(), err_msg=restored.path)


def test_tf_module_round_trip_restores_into_a_fresh_module(module_checkpoint, tmp_path):
    prefix, model = module_checkpoint
    export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    assert_same_checkpoint(prefix, tmp_path / "back" / "ckpt")
    fresh = TwoLayers()
    for v in fresh.variables:
        v.assign(tf.zeros_like(v))
    tf.train.Checkpoint(model=fresh).restore(str(tmp_path / "back" / "ckpt")).assert_existing_objects_matched()
    for restored, original in zip(fresh.variables, model.variables, strict=True):
        np.testing.assert_array_equal(restored.numpy(), original.numpy())


@requires_torch
def test_file_to_file_convert_names_tensors_as_the_export_does(keras_checkpoint, tmp_path):
    prefix, _ = keras_checkpoint
    export_checkpoint(prefix, tmp_path / "direct.safetensors", layout="torch")
    export_checkpoint(prefix, tmp_path / "plain.safetensors")  # TF keys, object graph in the metadata
    result = convert(tmp_path / "plain.safetensors", tmp_path / "converted.pt", layout="torch")
    direct, converted = stored(tmp_path / "direct.safetensors"), stored(tmp_path / "converted.pt")
    assert sorted(converted) == sorted(direct)
    for name, array in direct.items():
        assert converted[name].tobytes() == array.tobytes(), name
    assert len(result.permuted) == 2 and len(result.kept) == 14
    import_checkpoint(tmp_path / "converted.pt", tmp_path / "back" / "ckpt")
    assert_same_checkpoint(prefix, tmp_path / "back" / "ckpt")


def test_tf1_style_slots_of_a_tf_module_keep_tf_axes(tmp_path):
    """tf.compat.v1 optimizers record their slots in the object graph ('.OPTIMIZER_SLOT')."""
    model, optimizer = TwoLayers(), tf.compat.v1.train.MomentumOptimizer(0.1, momentum=0.9)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(np.ones((2, 3), np.float32)))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    result = export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    tensors = stored(tmp_path / "m.safetensors")
    slot = tensors["model.a.kernel.OPTIMIZER_SLOT.optimizer.momentum"]
    assert slot.shape == (3, 5) and tensors["model.a.weight"].shape == (5, 3)
    assert len(result.kept) == 4 and len(result.permuted) == 2
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    assert_same_checkpoint(prefix, tmp_path / "back" / "ckpt")
