"""Fine-tune a Keras 3 model with a new head from a ``.weights.h5`` file; interrupt the run and resume it.

1. A "pretrained" model (``encoder``, a 3-class ``head``) is trained and saved with
   ``model.save_weights('pretrained.weights.h5')``.
2. A new model shares the encoder and has a 5-class ``new_head``. ``model.fit`` runs with
   ``keras.callbacks.BackupAndRestore`` and ``restorekit.WarmStart``: before the first
   batch the encoder is restored from the file (the head stays initialized) and the
   report is printed once. The run is interrupted after its second epoch.
3. The run is started again, as after a preemption. The pretrained file is gone by now:
   ``BackupAndRestore`` resumes from its backup, ``WarmStart`` says so and reads nothing.

Run: python examples/keras_fit_warm_start.py [WORK_DIR]
"""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import restorekit

EPOCHS = 4


def data(classes: int, seed: int):
    rng = np.random.RandomState(seed)
    x = rng.randn(64, 8).astype("float32")
    return x, (np.abs(x[:, :classes]).argmax(axis=1)).astype("int64")


def make_model(head: str, classes: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", name="encoder")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(classes, name=head)(x))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def save_pretrained(directory: str) -> str:
    model = make_model("head", 3, seed=0)
    model.fit(*data(3, seed=1), epochs=3, verbose=0)
    path = os.path.join(directory, "pretrained.weights.h5")
    model.save_weights(path)
    return path


class StopAfterEpoch(keras.callbacks.Callback):
    """Stands in for a preemption: the process dies at the end of an epoch."""

    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"interrupted after epoch {epoch}")


def fine_tune(pretrained: str, backup: str, extra=()):
    """One launch of the fine-tuning job (the same code on every restart)."""
    model = make_model("new_head", 5, seed=2)
    warm = restorekit.WarmStart(pretrained, backup_dir=backup)
    callbacks = [keras.callbacks.BackupAndRestore(backup), warm, *extra]
    history = model.fit(*data(5, seed=3), epochs=EPOCHS, batch_size=16, verbose=0, callbacks=callbacks)
    return model, warm, history


def main(directory: str):
    pretrained = save_pretrained(directory)
    backup = os.path.join(directory, "backup")
    source = restorekit.Checkpoint(pretrained)
    print(f"pretrained: {source.kind}, layers {', '.join(source.layer_names)}")

    try:
        fine_tune(pretrained, backup, [StopAfterEpoch(1)])
    except KeyboardInterrupt as stop:
        print(f"first launch: {stop}")

    os.remove(pretrained)  # a resumed run must not need it
    model, warm, history = fine_tune(pretrained, backup)
    print(f"second launch: {warm.start.how}, ran epochs {history.epoch}")
    print(f"new_head has {model.get_layer('new_head').kernel.shape[-1]} classes")
    return warm.start, history


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="restorekit-warm-start-"))
