"""Tests for restorekit/export/layouts/_live.py: layout 'torch' names from a live Keras model.

A Keras 3 functional model whose nested functional blocks hold layers of one name
(``block_a/fc``, ``block_b/fc``) and a Sequential ``block_c``, saved with
``tf.train.Checkpoint(model=m)``: the checkpoint names those layers only by position
(``model/_operations/1/_operations/2/_kernel``) and their Keras paths collide (``fc/kernel``
twice). With the model, the export loads into a torch twin of the same tree.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import import_torch, requires_torch
from restorekit._checkpoint import Checkpoint
from restorekit.errors import RestoreKitWarning
from restorekit.export import export_checkpoint
from restorekit.layouts import torch_view
from restorekit.layouts._live import model_paths

L = keras.layers

TWIN_NAMES = sorted(
    [f"{b}.{layer}.{leaf}" for b in ("block_a", "block_b") for layer in ("pre", "fc") for leaf in ("weight", "bias")]
    + ["block_c.fc.weight", "block_c.fc.bias", "block_c.bn.weight", "block_c.bn.bias", "block_c.bn.running_mean",
       "block_c.bn.running_var", "block_c.bn.num_batches_tracked", "head.weight", "head.bias"]
)


def _block(name, width, units):
    inp = keras.Input((width,))
    return keras.Model(inp, L.Dense(units, name="fc")(L.Dense(units, activation="tanh", name="pre")(inp)), name=name)


def nested_model():
    keras.utils.clear_session()
    inp = keras.Input((4,))
    x = _block("block_a", 4, 5)(inp)
    x = _block("block_b", 5, 6)(x)
    x = keras.Sequential([L.Dense(3, name="fc"), L.BatchNormalization(name="bn")], name="block_c")(x)
    model = keras.Model(inp, L.Dense(2, name="head")(x))
    rng = np.random.default_rng(0)
    for v in model.weights:  # BatchNorm statistics away from 0 and 1, so a swapped tensor shows
        value = rng.standard_normal(v.shape).astype(np.float32)
        v.assign(np.abs(value) + 0.5 if "variance" in v.path else value)
    return model


@pytest.fixture
def saved(tmp_path):
    model = nested_model()
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    return model, prefix


def test_the_checkpoint_alone_names_the_blocks_by_position_and_says_so(saved):
    _, prefix = saved
    with pytest.warns(RestoreKitWarning, match=r"model=<the Keras model>"):
        view = torch_view(Checkpoint(prefix))
    assert any("_operations" in name for name in view.entries)


def test_with_the_model_each_variable_is_named_by_the_layers_on_its_way(saved):
    model, prefix = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error", RestoreKitWarning)
        view = torch_view(Checkpoint(prefix), model=model)
    assert sorted(n for n in view.entries if n != "_CHECKPOINTABLE_OBJECT_GRAPH") == TWIN_NAMES
    # the checkpoint's root may also be the model itself: its object paths then start at the model's attributes
    ckpt = Checkpoint(prefix)
    paths = {t.object_path: t for t in ckpt.object_graph.by_key.values() if t.kind == "variable"}
    rooted = model_paths(model, [p.removeprefix("model/") for p in paths])
    assert rooted == {p.removeprefix("model/"): v for p, v in model_paths(model, paths).items()}
    assert rooted["_operations/2/_operations/2/_kernel"] == "block_b/fc/kernel"


def _twin(torch):
    """The torch.nn twin of ``nested_model``: ``block_a.fc.weight``, ``block_c.bn.running_var``, ..."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, width, units):
            super().__init__()
            self.pre, self.fc = nn.Linear(width, units), nn.Linear(units, units)

        def forward(self, x):
            return self.fc(torch.tanh(self.pre(x)))

    class BlockC(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(6, 3), nn.BatchNorm1d(3, eps=1e-3)

        def forward(self, x):
            return self.bn(self.fc(x))

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.block_a, self.block_b, self.block_c, self.head = Block(4, 5), Block(5, 6), BlockC(), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.block_c(self.block_b(self.block_a(x))))

    return Twin().eval()


def _twin_computes_what_keras_computes(torch, model, safetensors_path) -> None:
    from safetensors.numpy import load_file

    state = {k: torch.from_numpy(v) for k, v in load_file(str(safetensors_path)).items()}
    twin = _twin(torch)
    twin.load_state_dict(state, strict=True)
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    with torch.no_grad():
        out = twin(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, np.asarray(model(x, training=False)), atol=1e-5, rtol=0)


@requires_torch
def test_the_torch_twin_loads_the_export_and_computes_what_keras_computes(saved, tmp_path):
    torch = import_torch()
    model, prefix = saved
    result = export_checkpoint(torch_view(Checkpoint(prefix), model=model), tmp_path / "m.safetensors")
    assert not result.unmapped
    _twin_computes_what_keras_computes(torch, model, tmp_path / "m.safetensors")


@requires_torch
@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_the_models_keras_files_convert_to_the_twins_names_without_the_model(tmp_path, name):
    # A Keras file names each layer's group (block_a, block_b): the paths the two blocks share ('fc/kernel')
    # read through the block names, so the torch layout needs no live model.
    from restorekit.cli import main

    torch = import_torch()
    model = nested_model()
    model.save(tmp_path / name) if name.endswith(".keras") else model.save_weights(tmp_path / name)
    out = tmp_path / "m.safetensors"
    assert main(["convert", str(tmp_path / name), str(out), "--layout", "torch"]) == 0
    _twin_computes_what_keras_computes(torch, model, out)
