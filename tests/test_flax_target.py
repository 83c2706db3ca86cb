"""Flax NNX modules as weight targets, restored with TensorFlow blocked, and optax partitions (issue 36 item 3).

TensorFlow writes a TF1 graph-mode conv/BN/dense net and Keras 3 (TensorFlow backend) the
same net as a TF2 checkpoint, a ``.weights.h5`` and a ``.keras`` file, with their outputs on
one input; one subprocess (``tests/flax_cases.py``, TensorFlow hidden by
``tests/blockers/no_tensorflow``) builds the Flax NNX twin, scans and restores it from each,
and computes its outputs. The rest runs here.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCKER = os.path.join(HERE, "blockers", "no_tensorflow")
SOURCES = {"tf1": "tf1/model.ckpt", "tf2": "tf2/ckpt-1", "h5": "model.weights.h5", "keras": "model.keras"}
RESTORED = ["bn/bias", "bn/mean", "bn/scale", "bn/var", "conv/bias", "conv/kernel"]
REASON = "Flax NNX targets need flax and optax installed (pip install 'restorekit[flax]')"


def _flax():
    pytest.importorskip("flax", reason=REASON)
    pytest.importorskip("optax", reason=REASON)


def _net_values():
    rng = np.random.default_rng(3)
    return {
        "conv/kernel": rng.standard_normal((3, 3, 3, 4)).astype("float32"),
        "conv/bias": rng.standard_normal(4).astype("float32"),
        "bn/gamma": rng.uniform(0.5, 1.5, 4).astype("float32"),
        "bn/beta": rng.standard_normal(4).astype("float32"),
        "bn/moving_mean": rng.standard_normal(4).astype("float32"),
        "bn/moving_variance": rng.uniform(0.5, 2.0, 4).astype("float32"),
        # outputs of a few units, so float32 sums in another order stay well within 1e-5 (at ~100 they move 3e-5)
        "fc/kernel": (0.05 * rng.standard_normal((100, 7))).astype("float32"),
        "fc/bias": rng.standard_normal(7).astype("float32"),
    }


def _write_tf1(tf, directory, values, x):
    """The net in TF1 graph mode under tf-slim's names (weights, biases), a Momentum slot and global_step."""
    slim = {k.replace("/kernel", "/weights").replace("conv/bias", "conv/biases").replace("fc/bias", "fc/biases"): v
            for k, v in values.items()}
    with tf.Graph().as_default():
        v = {name: tf.compat.v1.get_variable(name, initializer=value) for name, value in slim.items()}
        slot = tf.compat.v1.get_variable("conv/weights/Momentum", initializer=np.zeros((3, 3, 3, 4), "float32"))
        step = tf.compat.v1.train.get_or_create_global_step()
        h = tf.nn.conv2d(tf.constant(x), v["conv/weights"], 1, "SAME") + v["conv/biases"]
        h = tf.nn.batch_normalization(h, v["bn/moving_mean"], v["bn/moving_variance"], v["bn/beta"], v["bn/gamma"], 1e-3)
        y = tf.matmul(tf.reshape(tf.nn.relu(h), [2, -1]), v["fc/weights"]) + v["fc/biases"]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver([*v.values(), slot, step]).save(sess, os.path.join(directory, SOURCES["tf1"]))
            return sess.run(y)


def _write_keras(tf, keras, directory, values, x):
    """The net in Keras 3 (TensorFlow backend), as a TF2 checkpoint, a .weights.h5 and a .keras file."""
    inputs = keras.Input((5, 5, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(epsilon=1e-3, name="bn")(h))
    model = keras.Model(inputs, keras.layers.Dense(7, name="fc")(keras.layers.Flatten()(h)))
    for variable in model.variables:
        variable.assign(values[variable.path])
    tf.train.Checkpoint(model=model).write(os.path.join(directory, SOURCES["tf2"]))
    model.save_weights(os.path.join(directory, SOURCES["h5"]))
    model.save(os.path.join(directory, SOURCES["keras"]))
    return np.asarray(model(x, training=False))


def _corrupt(directory):
    """A copy of the TF1 checkpoint with one byte flipped in the tensor stored last."""
    import restorekit

    prefix = os.path.join(directory, SOURCES["tf1"])
    corrupt = os.path.join(directory, "tf1_corrupt", "model.ckpt")
    os.makedirs(os.path.dirname(corrupt))
    stored = restorekit.Checkpoint(prefix)
    last = max((n for n in stored.entries if n in ("conv/weights", "conv/biases") or n.startswith("bn/")),
               key=lambda n: stored.bundle_entry(n).offset)
    for suffix in (".index", ".data-00000-of-00001"):
        data = bytearray(open(prefix + suffix, "rb").read())
        if suffix != ".index":
            data[stored.bundle_entry(last).offset] ^= 0x01
        with open(corrupt + suffix, "wb") as f:
            f.write(bytes(data))


@pytest.fixture(scope="module")
def flax_run(tmp_path_factory):
    """The checkpoints and TF's outputs written here; the Flax twin restored from them with TensorFlow blocked."""
    _flax()
    tf = pytest.importorskip("tensorflow", reason="the checkpoints are written with TensorFlow")
    import keras

    if keras.config.backend() != "tensorflow":
        pytest.skip("the checkpoints are written with Keras on the TensorFlow backend")
    directory = str(tmp_path_factory.mktemp("flax"))
    values = _net_values()
    x = np.random.default_rng(4).standard_normal((2, 5, 5, 3)).astype("float32")
    expected = {"tf1": _write_tf1(tf, directory, values, x)}
    expected["tf2"] = expected["h5"] = expected["keras"] = _write_keras(tf, keras, directory, values, x)
    _corrupt(directory)
    np.savez(os.path.join(directory, "io.npz"), x=x, conv=values["conv/kernel"], **{f"y_{k}": y for k, y in expected.items()})
    with open(os.path.join(directory, "spec.json"), "w") as f:
        json.dump({"io": SOURCES}, f)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([BLOCKER, os.path.dirname(HERE)])}
    done = subprocess.run([sys.executable, os.path.join(HERE, "flax_cases.py"), directory], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return directory, expected, json.loads(line[-1][len("RESULT "):])


def test_tensorflow_is_never_imported(flax_run):
    assert flax_run[2]["tensorflow_imported"] is False


@pytest.mark.parametrize("case", list(SOURCES), ids=[f"from a {c} source" for c in SOURCES])
def test_the_flax_twin_computes_tensorflows_outputs(flax_run, case):
    directory, expected, result = flax_run
    report = result["outputs"][case]
    assert sorted(r["variable_name"] for r in report["matched"]) == sorted(RESTORED + ["fc/bias", "fc/kernel"])
    assert report["missing"] == report["shape_mismatched"] == report["dtype_mismatched"] == report["unused"] == []
    got = np.load(os.path.join(directory, f"flax-{case}.npy"))
    assert 1 < np.abs(expected[case]).max() < 20  # outputs of a few units: 1e-5 is a few float32 steps
    np.testing.assert_allclose(got, expected[case], rtol=0, atol=1e-5)


def test_the_tf1_optimizer_slot_and_global_step_are_skipped(flax_run):
    skipped = {r["checkpoint_name"]: r["how"] for r in flax_run[2]["outputs"]["tf1"]["skipped"]}
    assert skipped == {"conv/weights/Momentum": ["optimizer"], "global_step": ["counter"]}


def test_a_mismatched_head_is_reported_not_written(flax_run):
    head = flax_run[2]["mismatched_head"]
    report = head["report"]
    assert sorted(r["variable_name"] for r in report["matched"]) == RESTORED
    assert sorted((r["variable_name"], r["checkpoint_name"], r["shape"], r["checkpoint_shape"])
                  for r in report["shape_mismatched"]) == [
        ("fc/bias", "fc/biases", [5], [7]), ("fc/kernel", "fc/weights", [100, 5], [100, 7])]
    assert "'fc/bias' differs only in shape (checkpoint [7], model [5])" in head["text"]
    assert head["strict"] == "IncompleteRestoreError" and head["untouched_by_strict"]
    assert head["head_untouched"] and head["conv_restored"]


def test_tf_leaf_names_without_the_rule_set_are_missing_with_a_hint_naming_it(flax_run):
    plain = flax_run[2]["mismatched_head"]["plain"]
    assert plain["matched"] == [] and {r["variable_name"] for r in plain["missing"]} >= {"bn/scale", "conv/kernel"}
    assert any("pass rules=restorekit.FLAX_FROM_TF" in h and "'bn/bias' as 'bn/beta'" in h for h in plain["hints"])


def test_bad_values_leave_the_module_untouched(flax_run):
    bad = flax_run[2]["bad_values"]
    assert bad["dtype_mismatched"] == ["conv/bias", "conv/kernel"] and bad["float16_conv_untouched"]
    assert bad["cast"] == ["float16", True]
    assert bad["corrupt"] == ["ChecksumMismatchError", True]
    assert bad["bad_policy"] == ["InvalidArgumentError", True]


def test_optax_partitions_freeze_the_backbone_and_scale_the_head(flax_run):
    parts = flax_run[2]["partitions"]
    assert parts["conv_unchanged"] and parts["batch_stats_unchanged"]
    assert parts["rate"]["fc/kernel"] == pytest.approx(-1.0, rel=1e-4)  # sgd(0.1 * 10)
    assert parts["rate"]["bn/scale"] == pytest.approx(-0.1, rel=1e-4)  # the default group: sgd(0.1)
    assert parts["labels"] == {"bn/bias": "(default)", "bn/scale": "(default)", "conv/bias": "'conv'",
                               "conv/kernel": "'conv'", "fc/bias": "'fc'", "fc/kernel": "'fc'"}


# ------------------------------------------------------------------ in this process (flax, no checkpoint from TF)

def _module():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)])
            self.norm = nnx.LayerNorm(2, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.tied = self.layers[0]  # one Variable under two paths: restored once, under its first

    return Block(nnx.Rngs(0))


def test_a_module_s_weights_are_targets_named_by_path_without_rng_state():
    _flax()
    from restorekit._targets import collect

    targets = collect(_module())
    assert [(t.variable_name, t.shape, t.dtype, t.trainable) for t in targets] == [
        ("layers/0/bias", (4,), "float32", True), ("layers/0/kernel", (3, 4), "float32", True),
        ("layers/1/bias", (2,), "float32", True), ("layers/1/kernel", (4, 2), "float32", True),
        ("norm/bias", (2,), "float32", True), ("norm/scale", (2,), "float32", True)]


def test_a_keras_weights_file_restores_by_path_and_group_rules_see_the_same_names(tmp_path):
    _flax()
    from conftest import save_variables

    import restorekit

    module = _module()
    rng = np.random.default_rng(0)
    values = {"layers/0/kernel": rng.standard_normal((3, 4)).astype("float32"), "layers/1/kernel": np.ones((4, 3), "float32"),
              "norm/gamma": rng.standard_normal(2).astype("float32"), "norm/beta": rng.standard_normal(2).astype("float32")}
    prefix = save_variables(tmp_path / "ckpt" / "model.ckpt", values)
    report = restorekit.scan(prefix, module, rules=restorekit.FLAX_FROM_TF)
    assert [r.variable_name for r in report.matched] == ["layers/0/kernel", "norm/bias", "norm/scale"]
    assert [r.variable_name for r in report.missing] == ["layers/0/bias", "layers/1/bias"]
    assert [r.variable_name for r in report.shape_mismatched] == ["layers/1/kernel"]
    restorekit.restore(report)
    np.testing.assert_array_equal(np.asarray(module.tied.kernel[...]), values["layers/0/kernel"])
    np.testing.assert_array_equal(np.asarray(module.norm.scale[...]), values["norm/gamma"])
    groups = restorekit.group_variables({"layers/0": 0, "norm": 2.0}, module)
    assert groups.group_of("layers/0/kernel").frozen and groups.multiplier("norm/scale") == 2.0
    with pytest.raises(restorekit.NoMatchError, match="'neck'"):
        restorekit.optax_partitions(module, {"neck": 0})
    with pytest.raises(restorekit.InvalidArgumentError, match="Flax nnx.Module"):
        restorekit.optax_partitions([], {"layers": 0})


def test_flax_from_tf_gives_tf_leaf_names_only_where_the_checkpoint_has_them():
    from restorekit import FLAX_FROM_TF

    mapping = FLAX_FROM_TF.mapping(
        ["bn/scale", "bn/bias", "bn/mean", "bn/var", "fc/kernel", "fc/bias", "emb/embedding", "dense/kernel"],
        ["bn/gamma", "bn/beta", "bn/moving_mean", "bn/moving_variance", "fc/weights", "fc/biases", "emb/embeddings",
         "dense/kernel", "dense/weights"])
    assert mapping == {"bn/scale": "bn/gamma", "bn/bias": "bn/beta", "bn/mean": "bn/moving_mean",
                       "bn/var": "bn/moving_variance", "fc/kernel": "fc/weights", "fc/bias": "fc/biases",
                       "emb/embedding": "emb/embeddings", "dense/kernel": "dense/kernel"}
