"""Shared test setup: one TensorFlow per process, real tiny checkpoints written by TF.

TF1 tests build their graphs under ``tf.Graph().as_default()``; eager stays on for the
TF2 tests in the same process. Three logical CPUs let MirroredStrategy run here.

torch is an optional extra: a case that needs it carries ``@requires_torch`` (or calls
``import_torch()``) and is skipped, with the reason, where torch cannot be imported.
"""

import functools
import os
import threading

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

pytest_plugins = ["skip_summary"]  # skips summed up by reason at the end of a run

# ---------------------------------------------------------------- the optional torch extra

TORCH_WHEEL = "torch==2.13.0"  # the CPU wheel CI installs (.ci/run)


@functools.cache
def torch_missing() -> str | None:
    """Why torch cannot be used here (``None`` when it can), found once, by importing it.

    A real import, not ``importlib.util.find_spec``: an installed torch can still fail to
    import (a broken wheel, or CI's ``.ci/no_torch`` blocker), and then the cases skip too.
    """
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return f"torch cannot be imported ({exc}); it is an optional extra: pip install {TORCH_WHEEL}"
    return None


requires_torch = pytest.mark.torch  # registered in pyproject.toml; skipped below where torch is missing


def import_torch():
    """``torch``, or skip the calling test (or module) with the reason it cannot be imported."""
    reason = torch_missing()
    if reason:
        pytest.skip(reason, allow_module_level=True)
    import torch

    return torch


def pytest_collection_modifyitems(config, items):
    """Skip every ``@requires_torch`` case where torch cannot be imported (torch imported only if one is selected)."""
    marked = [item for item in items if item.get_closest_marker("torch") is not None]
    if marked and torch_missing():
        skip = pytest.mark.skip(reason=torch_missing())
        for item in marked:
            item.add_marker(skip)


def write_bundle(prefix, values: dict) -> str:
    """Write ``values`` (name -> array, in this order) with restorekit's BundleWriter; return the prefix."""
    from restorekit._bundle.writer import BundleWriter

    prefix = str(prefix)
    with BundleWriter(prefix) as writer:
        for name, value in values.items():
            writer.add(name, value)
    return prefix


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


# ---------------------------------------------------------------- tf-slim resnet_v1_50

RESNET_INPUT = (2, 64, 64, 3)


def resnet_features(images, *, num_classes=None, is_training=True):
    """tf-slim resnet_v1_50 with fused batch norm (the non-fused path is broken on TF 2.16+)."""
    import tf_slim as slim
    from tf_slim.nets import resnet_v1

    bn = {"decay": 0.9, "epsilon": 1e-5, "scale": True, "updates_collections": None, "fused": True}
    with slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm, normalizer_params=bn, activation_fn=tf.nn.relu):
        with slim.arg_scope([slim.max_pool2d], padding="SAME"):
            return resnet_v1.resnet_v1_50(images, num_classes=num_classes, is_training=is_training)


def resnet_batch(seed=0):
    rng = np.random.RandomState(seed)
    return rng.rand(*RESNET_INPUT).astype(np.float32), rng.randint(0, 10, RESNET_INPUT[0]).astype(np.int32)


@pytest.fixture(scope="session")
def resnet_checkpoint(tmp_path_factory):
    """A resnet_v1_50 at 1000 classes trained one Momentum step; returns its prefix."""
    directory = tmp_path_factory.mktemp("resnet1000")
    images, labels = resnet_batch()
    with tf.Graph().as_default():
        logits, _ = resnet_features(tf.constant(images), num_classes=1000)
        loss = tf1.losses.sparse_softmax_cross_entropy(labels, tf.reshape(logits, [-1, 1000]))
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, global_step=step)
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train)
            return saver.save(sess, str(directory / "model.ckpt"), global_step=step, write_meta_graph=False)


# ------------------------------------------------------------------ a FIFO that tells whether it was opened


class Sentinel:
    """A FIFO that records whether anything opened it for reading, and never blocks that reader for long.

    A thread waits to open the FIFO's write end: a reader's open completes it, the thread
    notes it and closes at once (the reader sees an empty file, so old code fails instead
    of hanging). ``close`` unblocks the thread by opening the read end itself, after
    marking that open as its own.
    """

    def __init__(self, path):
        self.path, self.opened, self._closing = str(path), False, False
        os.mkfifo(self.path)
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self):
        while True:
            fd = os.open(self.path, os.O_WRONLY)  # blocks until a reader opens the other end
            os.close(fd)
            if self._closing:
                return
            self.opened = True

    def close(self):
        self._closing = True
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._thread.join(5)
        os.close(fd)


@pytest.fixture
def fifo(tmp_path):
    """A ``Sentinel`` FIFO at ``tmp_path/elsewhere.fifo``; the test fails if anything opened it for reading."""
    sentinel = Sentinel(tmp_path / "elsewhere.fifo")
    yield sentinel
    sentinel.close()
    assert not sentinel.opened, f"something opened {sentinel.path!r} for reading"


# ---------------------------------------------------------------- a small disk that can be filled


@pytest.fixture
def small_tmpfs(tmp_path):
    """A fresh 8 MiB tmpfs mounted at ``tmp_path/disk`` (unmounted at teardown): a disk that a test can fill
    for real (ENOSPC) without touching the machine's own. Mounting needs root (CI runs as root); elsewhere
    the case is skipped with that reason."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a small tmpfs needs root: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill_disk(directory) -> str:
    """Fill the file system holding ``directory`` to the last byte (a file ``filler`` there), as another program
    filling the disk would; returns the filler's path (remove it to free the space)."""
    filler = os.path.join(os.fspath(directory), "filler")
    with open(filler, "ab", buffering=0) as f:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                if e.errno != 28:  # ENOSPC
                    raise
    return filler
