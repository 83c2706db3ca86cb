"""Shared test setup: one TensorFlow per process, real tiny checkpoints written by TF.

TF1 tests build their graphs under ``tf.Graph().as_default()``; eager stays on for the
TF2 tests in the same process. Three logical CPUs let MirroredStrategy run here.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

# Logical devices must be configured before the runtime starts.
try:
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
except RuntimeError:  # pragma: no cover - already initialised by a plugin
    pass

# tf-slim 1.1.0 checks isinstance(x, ops.Tensor); TF 2.16+ moved the class. Tests only.
from tensorflow.python.framework import ops as _ops  # noqa: E402

_ops.Tensor = tf.Tensor

tf1 = tf.compat.v1


def save_variables(prefix, values: dict, *, use_resource=True, dtype_map=None):
    """Write a name-based (TF1 Saver) checkpoint holding ``values`` and return its prefix."""
    with tf.Graph().as_default():
        variables = []
        for name, value in values.items():
            value = np.asarray(value)
            variables.append(
                tf1.get_variable(name, initializer=tf.constant(value), use_resource=use_resource)
            )
        saver = tf1.train.Saver(variables)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            return saver.save(sess, str(prefix), write_meta_graph=False)


@pytest.fixture
def small_checkpoint(tmp_path):
    """A tiny name-based checkpoint: two dense layers, a Momentum slot and global_step."""
    rng = np.random.RandomState(0)
    values = {
        "dense/kernel": rng.randn(4, 3).astype(np.float32),
        "dense/bias": rng.randn(3).astype(np.float32),
        "dense/kernel/Momentum": rng.randn(4, 3).astype(np.float32),
        "logits/kernel": rng.randn(3, 5).astype(np.float32),
        "logits/bias": rng.randn(5).astype(np.float32),
        "global_step": np.int64(7),
    }
    prefix = save_variables(tmp_path / "ckpt" / "model.ckpt", values)
    return prefix, values
