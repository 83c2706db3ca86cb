"""The TensorFlow side of tests/test_optimizer_state_keras2.py: tf-keras (Keras 2) runs that stop, save, and continue.

``python keras2_optimizer_runs.py OUT`` (tf-keras, in its own process so Keras 2 never shares one with
Keras 3): for every run in ``RUNS`` the net of ``tf1_optimizer_runs`` (Dense 8 -> 16, relu,
Dense 16 -> 3, the same initial weights and batches) trained ``BEFORE`` steps with a Keras 2
optimizer, saved as a TF2 checkpoint (``tf.train.Checkpoint(model=, optimizer=)``, or
``model.save_weights`` in the TF format), then continued ``AFTER`` steps by tf-keras itself;
the losses of the continuation go to ``OUT/losses.json``, with those of TF1's Adagrad run
(``tf1_optimizer_runs``, saved under ``OUT/tf1``) as ``tf1_adagrad``. The runs in ``REFUSED`` are trained
one step and saved only: optimizers whose state restorekit refuses by name.

``python keras2_optimizer_runs.py resume OUT`` (``KERAS_BACKEND`` jax or torch, TensorFlow
blocked): every run restored into a Keras 3 twin with ``optimizer=`` (and, the control,
without), continued 20 steps; the losses to ``OUT/<backend>.json``.
"""

import json
import os
import sys

from tf1_optimizer_runs import AFTER, BEFORE, batches, initial_weights, run as tf1_run

# name: (tf_keras.optimizers class path, its arguments, how it is saved); 'legacy.' is OptimizerV2
RUNS = {
    "adam": ("legacy.Adam", {"learning_rate": 0.01}, "checkpoint"),
    "amsgrad": ("legacy.Adam", {"learning_rate": 0.01, "amsgrad": True}, "checkpoint"),
    "sgd": ("legacy.SGD", {"learning_rate": 0.05, "momentum": 0.9}, "save_weights"),
    "nesterov": ("legacy.SGD", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}, "checkpoint"),
    "rmsprop": ("legacy.RMSprop", {"learning_rate": 0.01, "rho": 0.9, "momentum": 0.5, "epsilon": 1e-10}, "checkpoint"),
    "rmsprop_centered": ("legacy.RMSprop", {"learning_rate": 0.01, "rho": 0.9, "momentum": 0.5, "epsilon": 1e-10,
                                            "centered": True}, "checkpoint"),
    "adagrad": ("legacy.Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.1}, "checkpoint"),
    # tf-keras' default optimizers since TF 2.11 save their variables as Keras 3 does (optimizer/_variables/N)
    "adam_new": ("Adam", {"learning_rate": 0.01}, "checkpoint"),
}
# run: the Keras 3 optimizer that resumes it, with the tf-keras run's hyper-parameters
KERAS3 = {
    "adam": ("Adam", {"learning_rate": 0.01, "epsilon": 1e-7}),
    "amsgrad": ("Adam", {"learning_rate": 0.01, "epsilon": 1e-7, "amsgrad": True}),
    "sgd": ("SGD", {"learning_rate": 0.05, "momentum": 0.9}),
    "nesterov": ("SGD", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}),
    "rmsprop": ("RMSprop", {"learning_rate": 0.01, "rho": 0.9, "momentum": 0.5, "epsilon": 1e-10}),
    "rmsprop_centered": ("RMSprop", {"learning_rate": 0.01, "rho": 0.9, "momentum": 0.5, "epsilon": 1e-10,
                                     "centered": True}),
    "adagrad": ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.1, "epsilon": 1e-7}),
    "adam_new": ("Adam", {"learning_rate": 0.01}),
}
REFUSED = {
    "rmsprop_plain": ("legacy.RMSprop", {"learning_rate": 0.01}),
    "decay": ("legacy.Adam", {"learning_rate": 0.01, "decay": 0.01}),
}


def path(name: str) -> str:
    """Where run ``name`` is saved, under OUT."""
    return os.path.join(name, "weights" if RUNS.get(name, ("", {}, ""))[2] == "save_weights" else "ckpt-1")


def _model(tf_keras, cls: str, kwargs: dict):
    inputs = tf_keras.Input((8,))
    hidden = tf_keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    net = tf_keras.Model(inputs, tf_keras.layers.Dense(3, name="fc2")(hidden))
    for layer in ("fc1", "fc2"):
        weights = initial_weights()
        net.get_layer(layer).set_weights([weights[f"{layer}/kernel"], weights[f"{layer}/bias"]])
    make = tf_keras.optimizers
    for part in cls.split("."):
        make = getattr(make, part)
    # eager: 25 tiny steps run faster than they trace
    net.compile(optimizer=make(**kwargs), loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                run_eagerly=True)
    return net


def _save(tf, net, out: str, name: str, how: str) -> None:
    target = os.path.join(out, path(name))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if how == "save_weights":
        net.save_weights(target, save_format="tf")
    else:
        tf.train.Checkpoint(model=net, optimizer=net.optimizer).write(target)


def run(name: str, out: str) -> list:
    """Train run ``name`` ``BEFORE`` steps, save it, continue ``AFTER``; return the continuation's losses."""
    import tensorflow as tf
    import tf_keras

    cls, kwargs, how = RUNS[name]
    net = _model(tf_keras, cls, kwargs)
    xs, ys = batches()
    for i in range(BEFORE):
        net.train_on_batch(xs[i], ys[i])
    _save(tf, net, out, name, how)
    return [float(net.train_on_batch(xs[i], ys[i])) for i in range(BEFORE, BEFORE + AFTER)]


def keras3(name: str, directory: str, carry: bool, classes: int = 3):
    """Run ``name`` restored into a Keras 3 twin (optimizer state carried, or fresh): the optimizer and report,
    and the losses of 20 steps (None for a head of other ``classes``)."""
    import keras

    import restorekit
    from keras_optimizer_runs import compiled, continue_run, optimizer

    keras.utils.set_random_seed(1)
    opt = optimizer(keras, KERAS3[name])
    net = compiled(keras, opt, classes, eager=keras.config.backend() != "tensorflow")
    report = restorekit.scan(os.path.join(directory, path(name)), net, optimizer=opt if carry else None)
    restorekit.restore(report)
    return (continue_run(net) if classes == 3 else None), report, opt


def resume_all(out: str) -> None:
    """Every run resumed by Keras 3 on ``KERAS_BACKEND`` (TensorFlow blocked), carried and fresh, to OUT/<backend>.json."""
    import keras

    found: dict = {"losses": {}, "fresh": {}, "sources": {}}
    for name in RUNS:
        found["losses"][name], report, _ = keras3(name, out, True)
        found["sources"][name] = [report.optimizer.source, report.optimizer.step, len(report.optimizer.carried)]
        found["fresh"][name], _, _ = keras3(name, out, False)
    found["tensorflow_imported"] = "tensorflow" in sys.modules
    with open(os.path.join(out, f"{keras.config.backend()}.json"), "w") as f:
        json.dump(found, f)


def main(out: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import tf_keras

    losses = {name: run(name, out) for name in RUNS}
    losses["tf1_adagrad"] = tf1_run("adagrad", os.path.join(out, "tf1"))  # TF1's Adagrad, for Keras 3's
    xs, ys = batches()
    for name, (cls, kwargs) in REFUSED.items():
        net = _model(tf_keras, cls, kwargs)
        net.train_on_batch(xs[0], ys[0])
        _save(tf, net, out, name, "checkpoint")
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1] == "resume":
        resume_all(sys.argv[2])
    else:
        main(sys.argv[1])
