"""Tests for restorekit/_policies.py's shape adapters: ResizePositions and AdaptInputChannels, planned and restored."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from conftest import save_variables

from restorekit.errors import InvalidArgumentError
from restorekit._policies import AdaptInputChannels, ResizePositions, resize_matrix, resolve_shape_policy
from restorekit._scan import scan

tf1 = tf.compat.v1

RNG = np.random.RandomState(7)
POSITIONS = RNG.randn(1, 1 + 14 * 14, 8).astype(np.float32)  # a class token + a 14 x 14 grid, width 8
KERNEL = RNG.randn(3, 3, 3, 5).astype(np.float32)  # an RGB first convolution


def _tf_resized(table, side, method):
    """The reference: the grid part resized by tf.image.resize, the class token kept."""
    grid = table[0, 1:].reshape(14, 14, -1)
    resized = tf.image.resize(grid, [side, side], method=method).numpy()
    return np.concatenate([table[:, :1], resized.reshape(1, side * side, -1)], axis=1)


# ------------------------------------------------------------------ the computations


@pytest.mark.parametrize("method", ["bilinear", "bicubic"], ids=["bilinear", "bicubic"])
def test_resize_positions_1_plus_14x14_to_1_plus_16x16_equals_tf_image_resize(method):
    got = ResizePositions(num_prefix_tokens=1, grid=True, method=method).adapt(POSITIONS, (1, 257, 8))
    assert got.shape == (1, 257, 8) and got.dtype == np.float32
    np.testing.assert_array_equal(got[:, :1], POSITIONS[:, :1])  # the class token as it was
    np.testing.assert_allclose(got, _tf_resized(POSITIONS, 16, method), rtol=1e-5, atol=1e-5)


def test_resize_positions_shrinks_a_grid_too():
    got = ResizePositions(method="bilinear").adapt(POSITIONS, (1, 1 + 7 * 7, 8))
    np.testing.assert_allclose(got, _tf_resized(POSITIONS, 7, "bilinear"), rtol=1e-5, atol=1e-5)


def test_resize_positions_of_a_table_without_a_batch_axis():
    np.testing.assert_array_equal(ResizePositions().adapt(POSITIONS[0], (257, 8)),
                                  ResizePositions().adapt(POSITIONS, (1, 257, 8))[0])


def test_resize_positions_of_a_sequence_is_linear_interpolation_with_half_pixel_centres():
    table = RNG.randn(10, 4).astype(np.float64)  # BERT-style [length, width], no prefix
    got = ResizePositions(num_prefix_tokens=0, grid=False).adapt(table, (25, 4))
    where = np.clip((np.arange(25) + 0.5) * 10 / 25 - 0.5, 0, 9)
    expected = np.stack([np.interp(where, np.arange(10), table[:, d]) for d in range(4)], axis=1)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_resize_matrix_rows_sum_to_one_and_the_identity_keeps_values():
    for method in ("linear", "cubic"):
        np.testing.assert_allclose(resize_matrix(14, 16, method).sum(axis=1), 1.0)
        np.testing.assert_allclose(resize_matrix(9, 9, method), np.eye(9), atol=1e-12)


def test_adapt_input_channels_3_to_1_is_the_sum_over_channels():
    got = AdaptInputChannels().adapt(KERNEL, (3, 3, 1, 5))
    np.testing.assert_allclose(got[:, :, 0], KERNEL.sum(axis=2), rtol=1e-6)
    assert got.dtype == np.float32


def test_adapt_input_channels_3_to_4_repeats_and_rescales():
    got = AdaptInputChannels().adapt(KERNEL, (3, 3, 4, 5))
    expected = KERNEL[:, :, [0, 1, 2, 0]] * (3 / 4)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # to a multiple of 3 channels, a constant image gives the same response as before
    six = AdaptInputChannels().adapt(KERNEL, (3, 3, 6, 5))
    np.testing.assert_allclose(six, np.concatenate([KERNEL, KERNEL], axis=2) / 2, rtol=1e-6)
    np.testing.assert_allclose(six.sum(axis=2), KERNEL.sum(axis=2), rtol=1e-5)


@pytest.mark.parametrize(
    "adapter, shape, stored, fits",
    [
        (ResizePositions(), (1, 257, 8), (1, 197, 8), True),
        (ResizePositions(), (1, 258, 8), (1, 197, 8), False),  # 257 is not 1 + a square
        (ResizePositions(), (1, 257, 6), (1, 197, 8), False),  # the width differs
        (ResizePositions(0, grid=False), (30, 8), (20, 8), True),
        (AdaptInputChannels(), (3, 3, 1, 5), (3, 3, 3, 5), True),
        (AdaptInputChannels(), (3, 3, 1, 6), (3, 3, 3, 5), False),  # output channels differ too
        (AdaptInputChannels(), (5, 5), (3, 5), False),  # not a convolution kernel
    ],
    ids=["grid-grows", "not-a-square", "width-differs", "sequence-grows", "rgb-to-gray", "outputs-differ",
         "a-matrix"],
)
def test_adapters_apply_only_where_they_fit(adapter, shape, stored, fits):
    assert adapter.applies(shape, stored) is fits


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ResizePositions(num_prefix_tokens=-1), "num_prefix_tokens"),
        (lambda: ResizePositions(method="nearest"), "method"),
        (lambda: ResizePositions(grid="yes"), "grid"),
        (lambda: AdaptInputChannels(axis=1.5), "axis"),
        (lambda: resolve_shape_policy("resize_position"), "resize_positions"),
    ],
    ids=["negative-prefix", "unknown-method", "grid-not-bool", "axis-not-int", "misspelt-name"],
)
def test_bad_adapter_arguments_are_refused(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()


def test_a_name_means_the_adapter_with_its_defaults():
    policies = resolve_shape_policy({"vit/pos_embed": "resize_positions", "conv1": "adapt_input_channels"})
    assert policies.for_name("vit/pos_embed") == ResizePositions(num_prefix_tokens=1, grid=True, method="bilinear")
    assert policies.for_name("conv1/kernel") == AdaptInputChannels(axis=-2)


# ------------------------------------------------------------------ restored, TF1 and Keras


@pytest.fixture
def vit_checkpoint(tmp_path):
    values = {"vit/pos_embed": POSITIONS, "vit/conv1/kernel": KERNEL, "vit/head/bias": np.arange(5, dtype=np.float32)}
    return save_variables(tmp_path / "vit" / "model.ckpt", values)


POLICY = {"vit/pos_embed": "resize_positions", "vit/conv1": "adapt_input_channels"}
EXPECTED_REASONS = {"vit/pos_embed": "resize_positions", "vit/conv1/kernel": "adapt_input_channels", "vit/head/bias": ""}


def test_tf1_graph_warm_starts_through_both_adapters(vit_checkpoint):
    with tf.Graph().as_default():
        with tf1.variable_scope("vit"):
            pos = tf1.get_variable("pos_embed", (1, 257, 8))
            kernel = tf1.get_variable("conv1/kernel", (3, 3, 1, 5))
            bias = tf1.get_variable("head/bias", (5,))
        report = scan(vit_checkpoint, shape_policy=POLICY)
        assert report.is_complete
        assert {r.variable_name: r.reason for r in report.matched} == EXPECTED_REASONS
        assert {r["variable_name"]: r["reason"] for r in report.to_dict()["matched"]} == EXPECTED_REASONS
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            got_pos, got_kernel, got_bias = sess.run([pos, kernel, bias])
    np.testing.assert_allclose(got_pos, _tf_resized(POSITIONS, 16, "bilinear"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_kernel[:, :, 0], KERNEL.sum(axis=2), rtol=1e-5)
    np.testing.assert_array_equal(got_bias, np.arange(5))


def test_tf1_scaffold_in_a_monitored_session_through_both_adapters(vit_checkpoint, tmp_path):
    with tf.Graph().as_default():
        with tf1.variable_scope("vit"):
            pos = tf1.get_variable("pos_embed", (1, 257, 8))
            kernel = tf1.get_variable("conv1/kernel", (3, 3, 1, 5))
            tf1.get_variable("head/bias", (5,))
        tf1.train.get_or_create_global_step()
        scaffold = restorekit.easy_going_scaffold(vit_checkpoint, shape_policy=POLICY)
        assert {r.variable_name: r.reason for r in scaffold.restore_report.matched} == EXPECTED_REASONS
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=str(tmp_path / "train"),
                                                save_checkpoint_secs=None) as sess:
            got_pos, got_kernel = sess.run([pos, kernel])
    np.testing.assert_allclose(got_pos, _tf_resized(POSITIONS, 16, "bilinear"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_kernel[:, :, 0], KERNEL.sum(axis=2), rtol=1e-5)


class _Vit(keras.Model):
    def __init__(self, tokens, channels, **kwargs):
        super().__init__(**kwargs)
        self.pos_embed = self.add_weight(name="pos_embed", shape=(1, tokens, 8), initializer="zeros")
        self.stem = self.add_weight(name="stem", shape=(3, 3, channels, 5), initializer="zeros")

    def call(self, x):
        return x


def test_keras_model_restores_through_both_adapters(tmp_path):
    old = _Vit(197, 3)
    old.pos_embed.assign(POSITIONS)
    old.stem.assign(KERNEL)
    prefix = tf.train.Checkpoint(model=old).save(str(tmp_path / "tf2" / "ckpt"))

    new = _Vit(257, 1)
    report = scan(prefix, new, shape_policy={".*pos_embed": "resize_positions", ".*stem": "adapt_input_channels"})
    assert report.is_complete
    # matched by position (the weights are unnamed in the model), through the adapters
    assert sorted(r.reason.split(";")[0] for r in report.matched) == ["adapt_input_channels", "resize_positions"]
    restorekit.restore(report)
    np.testing.assert_allclose(new.pos_embed.numpy(), _tf_resized(POSITIONS, 16, "bilinear"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new.stem.numpy()[:, :, 0], KERNEL.sum(axis=2), rtol=1e-5)


def test_a_policy_for_every_name_leaves_what_it_does_not_fit_mismatched(vit_checkpoint):
    with tf.Graph().as_default():
        with tf1.variable_scope("vit"):
            tf1.get_variable("pos_embed", (1, 257, 8))
            tf1.get_variable("conv1/kernel", (3, 3, 1, 5))
            tf1.get_variable("head/bias", (6,))
        report = scan(vit_checkpoint, shape_policy="resize_positions")
    assert [(r.variable_name, r.reason) for r in report.matched] == [("vit/pos_embed", "resize_positions")]
    assert sorted(r.variable_name for r in report.shape_mismatched) == ["vit/conv1/kernel", "vit/head/bias"]


def test_keras_functional_model_gray_input_from_an_rgb_checkpoint(tmp_path):
    def net(channels):
        x = inp = keras.Input((8, 8, channels))
        x = keras.layers.Conv2D(5, 3, name="stem")(x)
        x = keras.layers.Conv2D(4, 3, name="block")(x)
        return keras.Model(inp, x)

    old = net(3)
    old.get_layer("stem").kernel.assign(KERNEL)
    prefix = tf.train.Checkpoint(model=old).save(str(tmp_path / "rgb" / "ckpt"))
    new = net(1)
    hinted = scan(prefix, new)
    assert any("'adapt_input_channels'" in h and "stem" in h for h in hinted.hints)
    report = scan(prefix, new, shape_policy={"stem/kernel": "adapt_input_channels"})
    assert report.is_complete
    restorekit.restore(report)
    np.testing.assert_allclose(new.get_layer("stem").kernel.numpy()[:, :, 0], KERNEL.sum(axis=2), rtol=1e-5)
    np.testing.assert_array_equal(new.get_layer("block").kernel.numpy(), old.get_layer("block").kernel.numpy())
    images = np.random.RandomState(0).rand(2, 8, 8, 1).astype(np.float32)
    # a gray image through the adapted stem is the RGB image R = G = B through the old one
    np.testing.assert_allclose(new(images).numpy(), old(np.repeat(images, 3, axis=-1)).numpy(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ hints


def test_hints_suggest_each_adapter_only_where_it_fits(tmp_path):
    values = {
        "vit/pos_embed": POSITIONS,
        "vit/conv1/kernel": KERNEL,
        "vit/block/kernel": RNG.randn(3, 3, 64, 8).astype(np.float32),  # a later convolution
        "vit/head/kernel": RNG.randn(8, 10).astype(np.float32),
    }
    prefix = save_variables(tmp_path / "hints" / "model.ckpt", values)
    with tf.Graph().as_default():
        with tf1.variable_scope("vit"):
            tf1.get_variable("pos_embed", (1, 257, 8))
            tf1.get_variable("conv1/kernel", (3, 3, 1, 5))
            tf1.get_variable("block/kernel", (3, 3, 128, 8))
            tf1.get_variable("head/kernel", (8, 12))
        report = scan(prefix)
    hints = "\n".join(report.hints)
    assert len(report.shape_mismatched) == 4
    assert "'vit/pos_embed' is a position table" in hints and "ResizePositions(num_prefix_tokens=1, grid=True)" in hints
    assert "'vit/conv1/kernel' differs only in its input channels" in hints
    assert "vit/block/kernel" not in hints  # 64 -> 128 channels: not an image input
    assert "'vit/head/kernel' differs only in shape" in hints and "resize" not in hints.split("'vit/head/kernel'")[1]
