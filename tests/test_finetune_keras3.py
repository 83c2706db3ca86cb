"""Tests for restorekit/finetune/_keras3.py: grouped_keras_optimizer with fit, custom steps, checkpoints, strategies."""

import numpy as np
import pytest
import tensorflow as tf

from restorekit.errors import GroupError, InvalidArgumentError
from restorekit.finetune import group_variables, grouped_keras_optimizer

tf1 = tf.compat.v1


# ---------------------------------------------------------------- Keras 3


def _keras_model():
    import keras

    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, name="body"), keras.layers.Dense(6, name="neck"),
         keras.layers.Dense(1, name="head")],
        name="net",
    )


def test_keras_fit_freezes_and_scales_per_group():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    assert groups.names == ("net/body/kernel", "net/body/bias", "net/neck/kernel", "net/neck/bias",
                            "net/head/kernel", "net/head/bias")
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    assert opt.learning_rates == pytest.approx({10.0: 0.1, 1.0: 0.01})
    model.compile(opt, "mse")
    before = [v.numpy() for v in model.trainable_variables]
    x = np.random.RandomState(0).rand(32, 4).astype(np.float32)
    model.fit(x, x.sum(axis=1, keepdims=True), epochs=2, batch_size=8, verbose=0)
    after = [v.numpy() for v in model.trainable_variables]
    assert before[0].tobytes() == after[0].tobytes() and before[1].tobytes() == after[1].tobytes()
    assert all(not np.array_equal(b, a) for b, a in zip(before[2:], after[2:]))
    assert int(opt.iterations.numpy()) == 8
    assert [int(o.iterations.numpy()) for o in opt.group_optimizers.values()] == [8, 8]


def _assert_one_sgd_step(model, opt, base_rate, multipliers):
    """One ``opt.apply`` on a fixed batch moves each variable by ``-base_rate * multiplier * grad``."""
    x = np.ones((2, 4), np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    opt.apply(grads, model.trainable_variables)
    for v, b, g, m in zip(model.trainable_variables, before, grads, multipliers):
        np.testing.assert_allclose(v.numpy(), b - base_rate * m * g.numpy(), rtol=1e-5, atol=1e-7)


def test_keras_custom_step_applies_each_group_learning_rate():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    _assert_one_sgd_step(model, opt, 0.01, [0, 0, 1, 1, 10, 10])


def test_keras_optimizer_state_round_trips_with_tf_train_checkpoint(tmp_path):
    import keras

    def build():
        model = _keras_model()
        groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
        opt = grouped_keras_optimizer(lambda m: keras.optimizers.Adam(0.001 * m), groups)
        return model, opt

    model, opt = build()
    model.compile(opt, "mse")
    x = np.random.RandomState(1).rand(16, 4).astype(np.float32)
    model.fit(x, x[:, :1], epochs=1, batch_size=4, verbose=0)
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    keys = [k for k, _ in tf.train.list_variables(prefix)]
    assert "optimizer/group_0/_iterations/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert "optimizer/group_1/_variables/2/.ATTRIBUTES/VARIABLE_VALUE" in keys

    model2, opt2 = build()
    status = tf.train.Checkpoint(model=model2, optimizer=opt2).restore(prefix)
    opt2.build(model2.trainable_variables)  # restoring before build is deferred to it
    status.assert_existing_objects_matched()
    saved, restored = opt.variables, opt2.variables
    # Own iteration and learning rate; per Adam the same two plus m and v for its 2 variables.
    assert len(saved) == len(restored) == 2 + 2 * (2 + 2 * 2)
    for a, b in zip(saved, restored):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert int(opt2.group_optimizers[10.0].iterations.numpy()) == 4
    assert np.abs(opt2.group_optimizers[10.0].variables[2].numpy()).sum() > 0


def test_keras_unknown_variable_is_a_group_error():
    import keras

    model = _keras_model()
    groups = group_variables({"net/head": 10.0}, model)
    other = _keras_model()  # same paths, other variables
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    with pytest.raises(GroupError, match="not the variable these groups were built with"):
        opt.build(other.trainable_variables)
    with pytest.raises(InvalidArgumentError, match="not a Keras optimizer"):
        grouped_keras_optimizer(lambda m: tf1.train.GradientDescentOptimizer(m), groups)


# ---------------------------------------------------------------- Keras 3: one base learning rate


def _fit_with_callback(model, opt, callback, epochs):
    """Fit the _keras_model on a fixed problem with one callback; the History of the fit."""
    model.compile(opt, "mse")
    x = np.random.RandomState(0).rand(32, 4).astype(np.float32)
    return model.fit(x, x.sum(axis=1, keepdims=True), epochs=epochs, batch_size=8, verbose=0, callbacks=[callback])


def test_keras_learning_rate_scheduler_sets_each_group_to_the_schedule_times_its_multiplier():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    body = [v.numpy().tobytes() for v in model.get_layer("body").weights]
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5**epoch)
    history = _fit_with_callback(model, opt, schedule, epochs=2)
    # The callback logs the base rate it reads back at the end of each epoch.
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05])
    assert opt.learning_rates == pytest.approx({10.0: 0.5, 1.0: 0.05})
    assert [v.numpy().tobytes() for v in model.get_layer("body").weights] == body
    assert int(opt.iterations.numpy()) == 8


def test_keras_reduce_lr_on_plateau_reduces_every_group_by_the_factor():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model, default=0.1)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    # No loss improves by 1e9: every epoch after the first one reduces.
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9)
    history = _fit_with_callback(model, opt, plateau, epochs=3)
    assert history.history["learning_rate"] == pytest.approx([0.01, 0.01, 0.005])
    assert opt.learning_rates == pytest.approx({10.0: 0.025, 0.1: 0.00025})


@pytest.mark.parametrize(
    "default, factory_rates, base",
    [(1.0, {10.0: 0.3, 1.0: 0.01}, 0.01), (0.1, {10.0: 0.2, 0.1: 0.05}, 0.02)],
    # The factory's rates do not follow the multipliers, so the base shows which group it comes from.
    ids=["is-the-1x-group-rate", "without-a-1x-group-is-the-first-group-rate-over-its-multiplier"],
)
def test_keras_learning_rate_base(default, factory_rates, base):
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model, default=default)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(factory_rates[m]), groups)
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == pytest.approx(base)

    opt.learning_rate = 0.02
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == pytest.approx(0.02)
    assert opt.learning_rates == pytest.approx({10.0: 0.2, default: 0.02 * default})
    # The next step uses the new rates.
    _assert_one_sgd_step(model, opt, 0.02, [0, 0, default, default, 10, 10])

    opt.learning_rate = tf.constant(0.04, tf.float64)  # a tensor is scaled as well
    assert opt.learning_rates == pytest.approx({10.0: 0.4, default: 0.04 * default})


def test_keras_learning_rate_cannot_be_set_when_a_group_has_a_schedule():
    import keras

    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(decay if m == 10.0 else 0.01), groups)
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == pytest.approx(0.01)  # reading works
    with pytest.raises(InvalidArgumentError, match=r"the 10x group has a learning-rate schedule.*Nothing was changed"):
        opt.learning_rate = 0.5
    assert opt.learning_rates == pytest.approx({10.0: 0.1, 1.0: 0.01})
    # Keras callbacks meet the same error, before the first step.
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1)
    with pytest.raises(InvalidArgumentError, match="10x group has a learning-rate schedule"):
        _fit_with_callback(model, opt, schedule, epochs=1)
    assert opt.learning_rates == pytest.approx({10.0: 0.1, 1.0: 0.01})
    assert int(opt.iterations.numpy()) == 0


@pytest.mark.parametrize("case", ["negative", "nan", "a-schedule", "a-string"])
def test_keras_learning_rate_rejects_a_bad_value_and_changes_nothing(case):
    import keras

    value = {
        "negative": -0.1,
        "nan": float("nan"),
        "a-schedule": keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5),
        "a-string": "0.1",
    }[case]
    model = _keras_model()
    groups = group_variables({"net/body": 0, "net/head": 10.0}, model)
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups)
    with pytest.raises(InvalidArgumentError, match="learning_rate must be"):
        opt.learning_rate = value
    assert opt.learning_rates == pytest.approx({10.0: 0.1, 1.0: 0.01})


# ---------------------------------------------------------------- Keras 3 under MirroredStrategy

# body frozen, neck in the default group (1x), head at 0.1x; in model.trainable_variables order.
MIRRORED_RULES = {"net/body": 0, "net/head": 0.1}
MIRRORED_MULTIPLIERS = [0, 0, 1, 1, 0.1, 0.1]
MIRRORED_LEARNING_RATE = 0.1


def _mirrored_grouped_model(optimizer_class, **kwargs):
    """_keras_model and its grouped optimizer under a 2-replica MirroredStrategy, and a batch of 8."""
    import keras

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = _keras_model()
        groups = group_variables(MIRRORED_RULES, model)
        opt = grouped_keras_optimizer(
            lambda m: getattr(keras.optimizers, optimizer_class)(MIRRORED_LEARNING_RATE * m, **kwargs), groups
        )
    x = np.random.RandomState(0).rand(8, 4).astype(np.float32)
    return strategy, model, opt, x, x.sum(axis=1, keepdims=True)


def _one_sgd_step_without_strategy(initial, x, y):
    """w - lr * multiplier * grad, where grad is the mean-squared-error gradient over the whole batch."""
    reference = _keras_model()
    reference.set_weights(initial)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(reference(x) - y))
    grads = tape.gradient(loss, reference.trainable_variables)
    return [w - MIRRORED_LEARNING_RATE * m * g.numpy() for w, g, m in zip(initial, grads, MIRRORED_MULTIPLIERS)]


def _assert_every_replica_took_the_step(strategy, model, initial, expected):
    for v, before, want, mult in zip(model.trainable_variables, initial, expected, MIRRORED_MULTIPLIERS):
        copies = strategy.experimental_local_results(v.value)
        assert len(copies) == 2, v.path
        for copy in copies:
            if mult == 0:
                assert copy.numpy().tobytes() == before.tobytes(), f"{v.path} on {copy.device} moved"
            else:
                # The step is far larger than the tolerance: a summed (2x) or per-replica
                # gradient, or another group's multiplier, fails here.
                assert np.abs(want - before).max() > 1e-3, v.path
                np.testing.assert_allclose(
                    copy.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"{v.path} on {copy.device}"
                )


def test_keras_fit_under_mirrored_strategy_matches_one_step_on_the_global_batch():
    strategy, model, opt, x, y = _mirrored_grouped_model("SGD")
    with strategy.scope():
        model.compile(opt, "mse")
    initial = [v.numpy() for v in model.trainable_variables]
    expected = _one_sgd_step_without_strategy(initial, x, y)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_every_replica_took_the_step(strategy, model, initial, expected)
    # One step in all: not one per replica, and not one per group optimizer on the wrapper.
    assert int(opt.iterations.numpy()) == 1
    assert [int(o.iterations.numpy()) for o in opt.group_optimizers.values()] == [1, 1]


@pytest.mark.parametrize(
    "optimizer_class, kwargs",
    [("SGD", {}), ("SGD", {"momentum": 0.9})],
    # The first momentum step equals plain SGD (m = -lr * grad), and it needs mirrored slots.
    ids=["sgd", "sgd-with-momentum-slots"],
)
def test_keras_custom_step_under_mirrored_strategy_matches_one_step_on_the_global_batch(optimizer_class, kwargs):
    strategy, model, opt, x, y = _mirrored_grouped_model(optimizer_class, **kwargs)
    with strategy.scope():
        opt.build(model.trainable_variables)  # slots are created under the scope, as Keras asks
    initial = [v.numpy() for v in model.trainable_variables]
    expected = _one_sgd_step_without_strategy(initial, x, y)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    x_batch, y_batch = next(iter(dataset))
    assert [t.shape[0] for t in strategy.experimental_local_results(x_batch)] == [4, 4]

    def replica_step(x_batch, y_batch):
        with tf.GradientTape() as tape:
            per_example = tf.square(model(x_batch) - y_batch)[:, 0]
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=8)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    tf.function(lambda a, b: strategy.run(replica_step, args=(a, b)))(x_batch, y_batch)
    _assert_every_replica_took_the_step(strategy, model, initial, expected)
    assert int(opt.iterations.numpy()) == 1
    assert [int(o.iterations.numpy()) for o in opt.group_optimizers.values()] == [1, 1]
