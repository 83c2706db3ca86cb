"""Freeze a tf-slim checkpoint into a .pb, inspect it, and bring it back as a checkpoint and a trainable graph.

Run: python examples/freeze_unfreeze.py [WORK_DIR]
"""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from restorekit.graph import freeze, inspect_graph, unfreeze

tf1 = tf.compat.v1


def train_a_small_net(directory: str) -> tuple[str, np.ndarray, np.ndarray]:
    """A conv + dense net trained for a few steps; returns its checkpoint prefix and outputs."""
    # tf-slim 1.1.0 checks isinstance(x, ops.Tensor); TF 2.16+ moved the class.
    from tensorflow.python.framework import ops

    ops.Tensor = tf.Tensor
    import tf_slim as slim

    inputs = np.random.RandomState(0).randn(4, 8, 8, 3).astype(np.float32)
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
        net = slim.conv2d(x, 8, [3, 3], scope="conv1")
        net = slim.flatten(net)
        logits = slim.fully_connected(net, 10, activation_fn=None, scope="logits")
        tf.identity(logits, name="probabilities")
        loss = tf.reduce_mean(tf.square(logits))
        train_op = tf1.train.AdamOptimizer(1e-3).minimize(loss, global_step=tf1.train.get_or_create_global_step())
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(3):
                sess.run(train_op, {x: inputs})
            prefix = saver.save(sess, os.path.join(directory, "model.ckpt"), global_step=3)
            outputs = sess.run("probabilities:0", {x: inputs})
    return prefix, inputs, outputs


def main(directory: str) -> None:
    prefix, inputs, outputs = train_a_small_net(directory)

    # 1. Look inside the training graph: inputs, outputs, variables (Adam slots too).
    print(inspect_graph(prefix + ".meta"), end="\n\n")

    # 2. Freeze: the checkpoint's weights become constants of a serving graph.
    #    (overwrite=True: a second run into the same WORK_DIR replaces the first's files.)
    frozen_path = os.path.join(directory, "frozen.pb")
    frozen = freeze(prefix, prefix + ".meta", ["probabilities"], out=frozen_path, overwrite=True)
    print(inspect_graph(frozen_path), end="\n\n")

    # 3. Unfreeze: the constants become a checkpoint again, plus a trainable graph.
    result = unfreeze(
        frozen_path, os.path.join(directory, "unfrozen", "model.ckpt"), trainable_graph=True, overwrite=True
    )
    print(result, end="\n\n")

    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(result.meta_graph)
        probabilities = tf1.get_default_graph().get_tensor_by_name("probabilities:0")
        loss = tf.reduce_mean(tf.square(probabilities))
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf1.Session() as sess:
            saver.restore(sess, result.checkpoint)
            again = sess.run(probabilities, {"x:0": inputs})
            sess.run(train_op, {"x:0": inputs})
            after = sess.run(probabilities, {"x:0": inputs})
    print("unfrozen outputs equal the original:", np.array_equal(again, outputs))
    print("one training step changed them:     ", not np.array_equal(after, outputs))
    print("frozen graph nodes:", len(frozen.node))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.makedirs(sys.argv[1], exist_ok=True)
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tmp)
