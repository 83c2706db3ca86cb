"""Tests for restorekit/cli/_graphs.py and cli/compress.py: no TensorFlow log lines on the terminal, help texts."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from restorekit.cli import main

tf1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    """A small dense net: its checkpoint, its .meta and a frozen .pb of it."""
    directory = tmp_path_factory.mktemp("net")
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("dense/kernel", [4, 3], initializer=tf1.random_normal_initializer(seed=1))
        tf.identity(tf.matmul(x, w), name="y")
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            prefix = saver.save(sess, str(directory / "model.ckpt"))
    assert main(["-q", "freeze", prefix, prefix + ".meta", "--outputs", "y", "--out", str(directory / "f.pb")]) == 0
    return prefix, str(directory / "f.pb")


_NATIVE = ("absl::InitializeLog", "I0000", "W0000", "oneDNN", "cudart", "XNNPACK", "TensorFlow Lite",
           "fully_quantize")


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) for c in ("freeze", "unfreeze", "compress")]
                         + ["compress-int8"])  # one fresh TF process each: the int8 one by default, all in CI
def test_commands_that_load_tensorflow_print_no_native_log_lines(frozen, tmp_path, command):
    prefix, pb = frozen
    samples = tmp_path / "samples.npz"
    np.savez(samples, x=np.random.default_rng(0).standard_normal((20, 4)).astype(np.float32))
    argv = {
        "freeze": ["freeze", prefix, prefix + ".meta", "--outputs", "y", "--out", str(tmp_path / "g.pb")],
        "unfreeze": ["unfreeze", pb, str(tmp_path / "un" / "m")],
        "compress": ["compress", pb, str(tmp_path / "m.tflite"), "--outputs", "y"],
        # the int8 calibrator prints "fully_quantize: 0, inference_type: 6, ..." to the native stderr
        "compress-int8": ["compress", pb, str(tmp_path / "q.tflite"), "--outputs", "y", "--precision", "int8",
                          "--representative", str(samples), "--max-error", "10"],
    }[command]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-m", "restorekit", *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr.splitlines() if any(s in line for s in _NATIVE)], done.stderr
    assert done.stderr == ""


def test_graph_help_names_both_subcommands(capsys):
    assert main(["--help"]) == 0
    top = " ".join(capsys.readouterr().out.split())
    assert "graph inspect FILE" in top and "graph repair FILE OUT" in top


def test_compress_still_reads_back(frozen, tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    _, pb = frozen
    assert main(["-q", "compress", pb, str(tmp_path / "m.tflite"), "--outputs", "y"]) == 0
    interpreter = Interpreter(model_path=str(tmp_path / "m.tflite"))
    interpreter.allocate_tensors()
    assert np.prod(interpreter.get_output_details()[0]["shape"][1:]) == 3
