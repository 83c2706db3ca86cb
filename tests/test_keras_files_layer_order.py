"""Every built-in Keras 3 layer's variables, read from a bare ``.weights.h5``, carry the names the layer gives them."""

from __future__ import annotations

import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import restorekit  # noqa: E402
from restorekit._compare import diff_checkpoints  # noqa: E402

L = keras.layers


def _one(layer, shape):
    def build():
        inp = keras.Input(shape)
        return keras.Model(inp, layer()(inp))
    return build


def _attention(**kwargs):
    def build():
        inp = keras.Input((3, 4))
        return keras.Model(inp, L.MultiHeadAttention(2, 2, **kwargs)(inp, inp))
    return build


def _dot_attention(**kwargs):
    def build():
        q, v = keras.Input((3, 4)), keras.Input((5, 4))
        return keras.Model([q, v], L.Attention(**kwargs)([q, v]))
    return build


def _quantized(layer, shape, mode):
    def build():
        inp = keras.Input(shape)
        model = keras.Model(inp, layer()(inp))
        model.quantize(mode)
        return model
    return build


# (id, model builder): each layer with and without its optional variables.
LAYERS = [
    ("Dense", _one(lambda: L.Dense(3), (4,))),
    ("Dense(use_bias=False)", _one(lambda: L.Dense(3, use_bias=False), (4,))),
    ("EinsumDense", _one(lambda: L.EinsumDense("ab,bc->ac", output_shape=3, bias_axes="c"), (4,))),
    ("EinsumDense(no bias)", _one(lambda: L.EinsumDense("ab,bc->ac", output_shape=3), (4,))),
    ("Conv1D", _one(lambda: L.Conv1D(3, 2), (6, 2))),
    ("Conv2D(use_bias=False)", _one(lambda: L.Conv2D(3, 2, use_bias=False), (6, 6, 2))),
    ("Conv3D", _one(lambda: L.Conv3D(2, 2), (4, 4, 4, 1))),
    ("Conv1DTranspose", _one(lambda: L.Conv1DTranspose(3, 2), (6, 2))),
    ("Conv2DTranspose", _one(lambda: L.Conv2DTranspose(3, 2), (6, 6, 2))),
    ("Conv2DTranspose(use_bias=False)", _one(lambda: L.Conv2DTranspose(3, 2, use_bias=False), (6, 6, 2))),
    ("DepthwiseConv2D", _one(lambda: L.DepthwiseConv2D(3), (6, 6, 2))),
    ("DepthwiseConv2D(use_bias=False)", _one(lambda: L.DepthwiseConv2D(3, use_bias=False), (6, 6, 2))),
    ("DepthwiseConv1D(use_bias=False)", _one(lambda: L.DepthwiseConv1D(3, use_bias=False), (6, 2))),
    ("SeparableConv2D", _one(lambda: L.SeparableConv2D(4, 3), (6, 6, 2))),
    ("SeparableConv2D(use_bias=False)", _one(lambda: L.SeparableConv2D(4, 3, use_bias=False), (6, 6, 2))),
    ("SeparableConv1D(use_bias=False)", _one(lambda: L.SeparableConv1D(4, 3, use_bias=False), (6, 2))),
    ("BatchNormalization", _one(lambda: L.BatchNormalization(), (5,))),
    ("BatchNormalization(center=False, scale=False)",
     _one(lambda: L.BatchNormalization(center=False, scale=False), (5,))),
    ("LayerNormalization", _one(lambda: L.LayerNormalization(), (5,))),
    ("GroupNormalization", _one(lambda: L.GroupNormalization(2), (4,))),
    ("RMSNormalization", _one(lambda: L.RMSNormalization(), (4,))),
    ("PReLU", _one(lambda: L.PReLU(), (3,))),
    ("Embedding", _one(lambda: L.Embedding(10, 4), (3,))),
    ("LSTM", _one(lambda: L.LSTM(4), (3, 2))),
    ("LSTM(use_bias=False)", _one(lambda: L.LSTM(4, use_bias=False), (3, 2))),
    ("GRU", _one(lambda: L.GRU(4), (3, 2))),
    ("GRU(reset_after=False)", _one(lambda: L.GRU(4, reset_after=False), (3, 2))),
    ("SimpleRNN(use_bias=False)", _one(lambda: L.SimpleRNN(4, use_bias=False), (3, 2))),
    ("Bidirectional(LSTM)", _one(lambda: L.Bidirectional(L.LSTM(3)), (3, 2))),
    ("ConvLSTM2D", _one(lambda: L.ConvLSTM2D(2, 3), (2, 6, 6, 1))),
    ("TimeDistributed(Dense)", _one(lambda: L.TimeDistributed(L.Dense(3)), (3, 2))),
    ("MultiHeadAttention", _attention()),
    ("MultiHeadAttention(use_bias=False)", _attention(use_bias=False)),
    ("Attention(score_mode='concat', use_scale=True)", _dot_attention(score_mode="concat", use_scale=True)),
    ("BatchNormalization(renorm=True)", _one(lambda: L.BatchNormalization(renorm=True), (5,))),
    ("STFTSpectrogram", _one(lambda: L.STFTSpectrogram(frame_length=16, frame_step=8), (64, 1))),
    ("Dense quantized int8", _quantized(lambda: L.Dense(3), (4,), "int8")),
    ("Dense(use_bias=False) quantized int8", _quantized(lambda: L.Dense(3, use_bias=False), (4,), "int8")),
    ("Dense quantized int4", _quantized(lambda: L.Dense(3), (4,), "int4")),
    ("Dense quantized float8", _quantized(lambda: L.Dense(3), (4,), "float8")),
    ("EinsumDense quantized int8",
     _quantized(lambda: L.EinsumDense("ab,bc->ac", output_shape=3, bias_axes="c"), (4,), "int8")),
    ("Embedding quantized int8", _quantized(lambda: L.Embedding(10, 4), (3,), "int8")),
    ("Embedding quantized int4", _quantized(lambda: L.Embedding(10, 4), (3,), "int4")),
]

# Layers whose variables a bare weights file cannot name: their count fits two configs that write the same file
# (same groups, shapes and dtypes; only the values differ) and the file keeps no config, so they keep their indices;
# scan still restores them completely, each variable paired by position inside its layer, as Keras' load_weights
# pairs it (a .keras file's config names them), and diff pairs them by the names the other side gives the layer.
AMBIGUOUS = [
    ("Attention(use_scale=True)", _dot_attention(use_scale=True)),
    ("GroupNormalization(center=False)", _one(lambda: L.GroupNormalization(2, center=False), (4,))),
    ("LayerNormalization(center=False)", _one(lambda: L.LayerNormalization(center=False), (5,))),
    ("BatchNormalization(scale=False)", _one(lambda: L.BatchNormalization(scale=False), (5,))),
    ("BatchNormalization(center=False)", _one(lambda: L.BatchNormalization(center=False), (5,))),
    ("LayerNormalization(scale=False)", _one(lambda: L.LayerNormalization(scale=False), (5,))),
    ("Attention(score_mode='concat')", _dot_attention(score_mode="concat")),
    ("BatchNormalization(renorm=True, center=False)", _one(lambda: L.BatchNormalization(renorm=True, center=False), (5,))),
]


# A fixed cross-section (dense, conv, norm, recurrent, wrapper, attention) runs by default; the rest are
# marked slow and run with ``-m slow`` (CI runs both).
FAST = {"Dense", "Conv2D(use_bias=False)", "BatchNormalization", "GRU", "Bidirectional(LSTM)", "MultiHeadAttention",
        "Attention(use_scale=True)", "BatchNormalization(scale=False)"}


def _cases(table):
    return [pytest.param(b, id=i, marks=() if i in FAST else pytest.mark.slow) for i, b in table]


@pytest.mark.parametrize("build", _cases(LAYERS))
def test_a_bare_weights_file_names_each_layers_variables_as_the_layer_does(tmp_path, build):
    keras.utils.clear_session()  # the twin below gets the same auto names
    model = build()
    for v in model.weights:
        v.assign(tf.random.normal(v.shape, seed=1) if v.dtype == "float32" else v)
    model.save_weights(tmp_path / "m.weights.h5")
    model.save(tmp_path / "m.keras")
    tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))

    ckpt = restorekit.Checkpoint(str(tmp_path / "m.weights.h5"))
    assert sorted(ckpt.readable_name(k) for k in ckpt.entries) == sorted(v.path for v in model.weights)

    keras.utils.clear_session()
    twin = build()
    report = restorekit.scan(str(tmp_path / "m.weights.h5"), twin.weights)
    assert report.is_complete and len(report.matched) == len(model.weights), str(report)
    assert all("by position" not in (r.reason or "") for r in report.matched), str(report)

    for other in ("m.keras", "ckpt"):
        d = diff_checkpoints(str(tmp_path / "m.weights.h5"), str(tmp_path / other), by="path")
        assert d["equal"] and d["same"] == len(model.weights), d


@pytest.mark.parametrize("build", _cases(AMBIGUOUS))
def test_a_layer_whose_variable_count_fits_two_configs_restores_by_position(tmp_path, build):
    keras.utils.clear_session()
    model = build()
    for v in model.weights:
        v.assign(tf.random.normal(v.shape, seed=2))
    model.save_weights(tmp_path / "m.weights.h5")
    ckpt = restorekit.Checkpoint(str(tmp_path / "m.weights.h5"))
    layer = model.weights[0].path.rpartition("/")[0]
    assert sorted(ckpt.readable_name(k) for k in ckpt.entries) == [f"{layer}/{i}" for i in range(len(model.weights))]
    model.save(tmp_path / "m.keras")
    archive = restorekit.Checkpoint(str(tmp_path / "m.keras"))
    assert sorted(archive.readable_name(k) for k in archive.entries) == sorted(v.path for v in model.weights)
    keras.utils.clear_session()
    twin = build()
    report = restorekit.scan(str(tmp_path / "m.weights.h5"), twin.weights)
    assert report.is_complete and len(report.matched) == len(model.weights), str(report)
    assert any("by position" in r.reason for r in report.matched), str(report)
    restorekit.restore(report)
    for a, b in zip(model.weights, twin.weights):
        assert (a.numpy() == b.numpy()).all(), a.path
    # the file lists the sets of names that fit; a side that names them says which, so diff pairs them all
    assert list(ckpt.undecided) == [layer] and len(ckpt.undecided[layer]) == 2, ckpt.undecided
    tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    for other in ("m.keras", "ckpt"):
        for x, y in (("m.weights.h5", other), (other, "m.weights.h5")):
            d = diff_checkpoints(str(tmp_path / x), str(tmp_path / y), by="path")
            assert d["equal"] and d["same"] == len(model.weights), d


def test_spectral_normalizations_own_copy_of_its_layers_kernel_keeps_its_key(tmp_path):
    """SpectralNormalization saves its layer's kernel twice (its own ``vars/0`` and the layer's): the copy is no
    variable of its own, so only ``vector_u`` is named under the wrapper and the copy keeps its file key."""
    build = _one(lambda: L.SpectralNormalization(L.Dense(3)), (4,))
    keras.utils.clear_session()
    model = build()
    for v in model.weights:
        v.assign(tf.random.normal(v.shape, seed=3))
    model.save_weights(tmp_path / "m.weights.h5")
    ckpt = restorekit.Checkpoint(str(tmp_path / "m.weights.h5"))
    names = {ckpt.readable_name(k): k for k in ckpt.entries}
    assert sorted(n for n in names if n != names[n]) == sorted(v.path for v in model.weights)
    assert [n for n in names if n == names[n]] == ["layers/spectral_normalization/vars/0"]
    keras.utils.clear_session()
    twin = build()
    report = restorekit.scan(str(tmp_path / "m.weights.h5"), twin.weights)
    assert report.is_complete and len(report.matched) == len(model.weights), str(report)
    restorekit.restore(report)
    for a, b in zip(model.weights, twin.weights):
        assert (a.numpy() == b.numpy()).all(), a.path
