"""Fine-tune a Keras 3 model from a TF1 name-based checkpoint, with a grown classifier head.

A TF1 graph (``dense/weights``, ``dense/biases``, a 3-class ``logits`` layer) is saved
with a Saver; a Keras model of the same body with a 4-class head restores from it:
names are mapped by ``restorekit.KERAS_FROM_TF1`` and the head keeps its 3 trained
classes through ``shape_policy='slice_or_pad'``.

Run: python examples/keras_from_tf1.py [WORK_DIR]
"""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import restorekit

tf1 = tf.compat.v1


def save_tf1_checkpoint(directory: str) -> str:
    """A TF1 graph with slim-style names, saved by a Saver."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        tf1.get_variable("dense/weights", initializer=rng.randn(8, 16).astype(np.float32))
        tf1.get_variable("dense/biases", initializer=rng.randn(16).astype(np.float32))
        tf1.get_variable("logits/weights", initializer=rng.randn(16, 3).astype(np.float32))
        tf1.get_variable("logits/biases", initializer=rng.randn(3).astype(np.float32))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            return tf1.train.Saver().save(sess, os.path.join(directory, "tf1", "model.ckpt"))


def main(directory: str) -> restorekit.RestoreReport:
    prefix = save_tf1_checkpoint(directory)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="dense"), keras.layers.Dense(4, name="logits")]
    )
    report = restorekit.scan(prefix, model, rules=restorekit.KERAS_FROM_TF1, shape_policy="slice_or_pad")
    print(report)
    restorekit.restore(report)

    ckpt = restorekit.Checkpoint(prefix)
    kernel, head = model.get_layer("dense").kernel, model.get_layer("logits").kernel
    assert np.array_equal(kernel.numpy(), ckpt.read("dense/weights"))
    assert np.array_equal(head.numpy()[:, :3], ckpt.read("logits/weights"))
    print("restored: dense kernel equal; head keeps its 3 trained classes, class 4 is new")
    return report


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="restorekit-keras-"))
