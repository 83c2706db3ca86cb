"""The runs of tests/test_optimizer_state_keras.py: TensorFlow's own continuations, and Keras 3 resuming them.

``python keras_optimizer_runs.py tf OUT`` (Keras on the TensorFlow backend): the TF1 runs of
``tf1_optimizer_runs`` (trained 5 steps, saved, continued 20) for ``TF1_RUNS``, and a Keras 3
model fit one epoch (5 batches) with Adam, saved as ``.keras``, ``.weights.h5`` and a
``tf.train.Checkpoint``, then continued 20 steps by Keras itself; every loss to ``OUT/losses.json``.

``python keras_optimizer_runs.py resume OUT`` (``KERAS_BACKEND`` jax or torch, TensorFlow
blocked): each case restored into a Keras 3 twin with ``optimizer=`` (and, the control, without),
continued 20 steps on the same batches; the losses and reports to ``OUT/<backend>.json``.
"""

import json
import os
import sys

from tf1_optimizer_runs import AFTER, BEFORE, BATCH, batches, initial_weights, run as tf1_run

TF1_RUNS = ["adam", "momentum", "rmsprop"]
# case: (source file under OUT, the Keras optimizer that resumes it)
CASES = {
    "tf1_adam": ("adam/model.ckpt", ("Adam", {"learning_rate": 0.01, "epsilon": 1e-8})),
    "tf1_momentum": ("momentum/model.ckpt", ("SGD", {"learning_rate": 0.05, "momentum": 0.9})),
    "tf1_rmsprop": ("rmsprop/model.ckpt", ("RMSprop", {"learning_rate": 0.01, "rho": 0.9, "momentum": 0.5,
                                                       "epsilon": 1e-10})),
    "keras_file": ("keras/model.keras", ("Adam", {"learning_rate": 0.01})),
    "keras_weights": ("keras/model.weights.h5", ("Adam", {"learning_rate": 0.01})),
    "keras_tf2": ("keras/tf2/ckpt-1", ("Adam", {"learning_rate": 0.01})),
}
# the warm starts with fresh optimizer state (the Keras file cases share one: the same weights, the same oracle)
CONTROLS = ["tf1_adam", "tf1_momentum", "tf1_rmsprop", "keras_file"]
ORACLE = {"tf1_adam": "adam", "tf1_momentum": "momentum", "tf1_rmsprop": "rmsprop", "keras_file": "keras",
          "keras_weights": "keras", "keras_tf2": "keras"}


def model(keras, classes: int = 3):
    """The Keras twin of the TF1 net: Dense 8 -> 16, relu, Dense 16 -> classes (logits), named as TF1 names them."""
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(classes, name="fc2")(hidden))


def compiled(keras, optimizer, classes: int = 3, eager: bool = False):
    net = model(keras, classes)
    # eager: 20 tiny steps run faster than they compile (a resume runs so on jax and torch)
    net.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                run_eagerly=eager)
    return net


def optimizer(keras, spec):
    cls, kwargs = spec
    return getattr(keras.optimizers, cls)(**kwargs)


def continue_run(net) -> list:
    """20 steps on the fixed batches after the first 5: each step's loss, as the step computes it."""
    xs, ys = batches()
    return [float(net.train_on_batch(xs[i], ys[i])) for i in range(BEFORE, BEFORE + AFTER)]


def keras_fit(out: str) -> list:
    """A Keras 3 model (TensorFlow backend) fit one epoch of 5 batches with Adam, saved three ways, continued."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    net = compiled(keras, keras.optimizers.Adam(0.01))
    for layer in ("fc1", "fc2"):
        weights = initial_weights()
        net.get_layer(layer).set_weights([weights[f"{layer}/kernel"], weights[f"{layer}/bias"]])
    xs, ys = batches()
    net.fit(xs[:BEFORE].reshape(-1, 8), ys[:BEFORE].reshape(-1), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    directory = os.path.join(out, "keras")
    os.makedirs(directory, exist_ok=True)
    net.save(os.path.join(directory, "model.keras"))
    net.save_weights(os.path.join(directory, "model.weights.h5"))
    tf.train.Checkpoint(model=net, optimizer=net.optimizer).write(os.path.join(directory, "tf2", "ckpt-1"))
    return continue_run(net)


def resume(directory: str, case: str, carry: bool, classes: int = 3):
    """Case ``case`` restored into a fresh Keras twin (optimizer state carried, or fresh), then 20 steps."""
    import keras

    import restorekit

    path, spec = CASES[case]
    keras.utils.set_random_seed(1)
    opt = optimizer(keras, spec)
    net = compiled(keras, opt, classes, eager=keras.config.backend() != "tensorflow")
    report = restorekit.scan(os.path.join(directory, path), net, optimizer=opt if carry else None)
    restorekit.restore(report)
    return continue_run(net), report


def resume_all(directory: str) -> dict:
    import keras

    out = {"losses": {}, "fresh": {}, "reports": {}}
    for case in CASES:
        losses, report = resume(directory, case, True)
        out["losses"][case] = losses
        out["reports"][case] = report.to_dict()["optimizer"]
        if case in CONTROLS:
            out["fresh"][case], _ = resume(directory, case, False)
    _, report = resume(directory, "keras_file", True, classes=5)  # a head for other classes
    out["head"] = report.to_dict()["optimizer"]
    out["tensorflow_imported"] = "tensorflow" in sys.modules
    with open(os.path.join(directory, f"{keras.config.backend()}.json"), "w") as f:
        json.dump(out, f)
    return out


def main(mode: str, out: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if mode == "tf":
        losses = {name: tf1_run(name, out) for name in TF1_RUNS}
        losses["keras"] = keras_fit(out)
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
    else:
        resume_all(out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2])
