"""Keras 3 ``use_ema`` averages: scan/restore, resume_or_warm_start and convert agree on them."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit._ema import keras_averages, scoped_shadows


def _model(head="head", units=2):
    i = keras.Input((4,))
    return keras.Model(i, keras.layers.Dense(units, name=head)(keras.layers.Dense(5, name="enc")(i)))


def _train(model, optimizer, steps=3):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype("f"), rng.normal(size=(16, 2)).astype("f")
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)


@pytest.fixture(scope="module")
def ema_checkpoint(tmp_path_factory):
    """A custom loop with use_ema, saved by tf.train.Checkpoint: (prefix, {path: raw}, {path: average})."""
    keras.utils.set_random_seed(0)
    model = _model()
    opt = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=None)
    _train(model, opt)
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path_factory.mktemp("kema") / "ck"))
    raw = {v.path: v.numpy() for v in model.trainable_variables}
    average = {v.path: a.numpy() for v, a in zip(model.trainable_variables, opt._model_variables_moving_average)}
    assert all(not np.array_equal(raw[p], average[p]) for p in raw)  # the test can tell them apart
    return prefix, raw, average


def _values(model):
    return {v.path: v.numpy() for v in model.weights}


def test_scan_with_ema_restores_the_keras_averages(ema_checkpoint):
    prefix, raw, average = ema_checkpoint
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", restorekit.RestoreKitWarning)
        report = restorekit.scan(prefix, model, ema=True)
    restorekit.restore(report)
    for path, value in _values(model).items():
        np.testing.assert_array_equal(value, average[path])
    assert {r.reason for r in report.matched} == {"ema"}
    ckpt = restorekit.Checkpoint(prefix)
    for record in report.matched:
        assert ckpt.readable_name(record.checkpoint_name).endswith("_average")
    # the averages restored are not listed as skipped optimizer slots; the raw weights are skipped as replaced
    skipped = {ckpt.readable_name(r.checkpoint_name): r.reason for r in report.skipped}
    assert not any(p.endswith("_average") for p in skipped)
    assert sorted(p for p, why in skipped.items() if why.startswith("raw weights")) == sorted(raw)
    assert not report.hints


def test_scan_without_ema_restores_the_raw_weights(ema_checkpoint):
    prefix, raw, _ = ema_checkpoint
    model = _model()
    report = restorekit.scan(prefix, model)
    restorekit.restore(report)
    for path, value in _values(model).items():
        np.testing.assert_array_equal(value, raw[path])
    ckpt = restorekit.Checkpoint(prefix)
    averages = [r for r in report.skipped if (ckpt.readable_name(r.checkpoint_name) or "").endswith("_average")]
    assert len(averages) == 4 and all(r.reason.startswith("optimizer slot") for r in averages)


def test_ema_averages_restore_around_a_new_head(ema_checkpoint):
    prefix, _, average = ema_checkpoint
    keras.utils.set_random_seed(1)
    model = _model(head="new_head", units=3)
    fresh = model.get_layer("new_head").kernel.numpy()
    report = restorekit.scan(prefix, model, ema=True)
    restorekit.restore(report)
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), average["enc/kernel"])
    np.testing.assert_array_equal(model.get_layer("enc").bias.numpy(), average["enc/bias"])
    np.testing.assert_array_equal(model.get_layer("new_head").kernel.numpy(), fresh)
    assert sorted(r.variable_name for r in report.matched) == ["enc/bias", "enc/kernel"]


def test_resume_or_warm_start_passes_ema_to_the_averages(ema_checkpoint, tmp_path):
    prefix, _, average = ema_checkpoint
    model = _model()
    restorekit.resume_or_warm_start(str(tmp_path / "run"), prefix, model=model, ema=True)
    for path, value in _values(model).items():
        np.testing.assert_array_equal(value, average[path])


def test_convert_with_ema_writes_the_averages_under_the_weights_own_keys(ema_checkpoint, tmp_path):
    from safetensors.numpy import load_file

    prefix, _, average = ema_checkpoint
    ckpt = restorekit.Checkpoint(prefix)
    restorekit.convert(prefix, str(tmp_path / "e.safetensors"), ema=True, weights_only=True)
    written = load_file(str(tmp_path / "e.safetensors"))
    # each weight's key stays (the object graph reached the weights through the optimizer first)
    assert sorted(written) == sorted(ckpt.object_paths[p] for p in average)
    for path, value in average.items():
        np.testing.assert_array_equal(written[ckpt.object_paths[path]], value)


def test_scan_and_convert_share_one_average_lookup(ema_checkpoint):
    prefix, _, average = ema_checkpoint
    ckpt = restorekit.Checkpoint(prefix)
    found = keras_averages(ckpt.entries, ckpt.object_graph)
    named = {ckpt.readable_name(k): ckpt.readable_name(v) for k, v in found.items()}
    assert sorted(named) == sorted(average)
    # Keras numbers optimizer names per process ('sgd', 'sgd_1'), so only the tail is fixed
    assert all(v.startswith("optimizer/sgd") and v.endswith("/" + k.replace("/", "_") + "_average")
               for k, v in named.items())
    assert keras_averages(ckpt.entries, None) == {}


def test_scoped_shadows_skip_a_shadow_of_a_present_base_and_ambiguous_tails():
    names = ["w", "a/w", "a/w/ExponentialMovingAverage", "s/b/ExponentialMovingAverage",
             "t/c/ExponentialMovingAverage", "u/c/ExponentialMovingAverage"]
    assert scoped_shadows(names) == {"b": "s/b/ExponentialMovingAverage"}


def test_weights_h5_after_fit_warns_accurately(tmp_path):
    keras.utils.set_random_seed(0)
    model = _model()
    opt = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
    model.compile(opt, "mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(16, 4)).astype("f"), rng.normal(size=(16, 2)).astype("f"), epochs=2, verbose=0)
    # fit copies the averages into the weights at the end of training
    for v, a in zip(model.trainable_variables, opt._model_variables_moving_average):
        np.testing.assert_array_equal(v.numpy(), a.numpy())
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    fresh = _model()
    with pytest.warns(restorekit.RestoreKitWarning, match="optimizer variables by position only"):
        report = restorekit.scan(path, fresh, ema=True)
    restorekit.restore(report)
    for v, w in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy())
