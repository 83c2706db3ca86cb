"""LiteRT vs ONNX Runtime: size, error and latency of every compressed model against the TF original, one run.

    python benchmarks/bench_compress.py [--size 96] [--samples 100] [--repeats 3] [--keep]

Builds a TF1 conv net (conv-BN-relu x3 with strides, global pool, dense 128, logits 10;
batch norm with non-trivial moving statistics, fused), freezes it with
``restorekit.freeze``, then ``restorekit.compress``es the same frozen graph to every
backend and precision. Every row is a ``CompressResult`` of that run: the original (a TF
session) and the compressed model run on the same ``--samples`` representative inputs
(also the int8 calibration data), mean latency per sample after one warm-up; with
``--repeats N`` every row is compressed N times and its latencies are the fastest of the N
(sizes and errors do not change between repeats), which keeps the shared machine's noise
down. Prints a
Markdown table (benchmarks/README.md, "Compress"). Latencies are a value of this machine,
measured in the same process one after another, not a goal.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

ROWS = [("tflite", "fp32"), ("tflite", "fp16"), ("tflite", "dynamic-int8"), ("tflite", "int8"),
        ("onnx", "fp32"), ("onnx", "fp16"), ("onnx", "int8")]


def build(directory: str, size: int) -> str:
    import restorekit
    from restorekit._tensorflow import import_tensorflow

    tf = import_tensorflow()  # after quiet_logs: TensorFlow's native start-up lines stay off stderr
    tf1 = tf.compat.v1
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, size, size, 3], name="x")
        net, channels = x, 3
        for i, (width, stride) in enumerate([(32, 2), (64, 2), (128, 2)]):
            kernel = tf1.get_variable(f"conv{i}/kernel", [3, 3, channels, width],
                                      initializer=tf1.initializers.he_normal(seed=i))
            net = tf.nn.conv2d(net, kernel, stride, "SAME")
            scale = tf1.get_variable(f"bn{i}/gamma", initializer=rng.uniform(0.5, 1.5, width).astype(np.float32))
            offset = tf1.get_variable(f"bn{i}/beta", initializer=rng.normal(0, 0.1, width).astype(np.float32))
            mean = tf1.get_variable(f"bn{i}/mean", initializer=rng.normal(0, 0.2, width).astype(np.float32))
            variance = tf1.get_variable(f"bn{i}/variance", initializer=rng.uniform(0.5, 2, width).astype(np.float32))
            net, _, _ = tf1.nn.fused_batch_norm(net, scale, offset, mean, variance, is_training=False)
            net, channels = tf.nn.relu(net), width
        net = tf.reduce_mean(net, [1, 2])
        for name, width in (("fc", 128), ("logits", 10)):
            w = tf1.get_variable(f"{name}/kernel", [channels, width], initializer=tf1.initializers.glorot_uniform(1))
            b = tf1.get_variable(f"{name}/bias", initializer=rng.normal(0, 0.1, width).astype(np.float32))
            net, channels = tf.matmul(net, w) + b, width
            net = tf.nn.relu(net) if name == "fc" else net
        tf.nn.softmax(net, name="probs")
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            prefix = saver.save(sess, os.path.join(directory, "model.ckpt"))
    frozen = os.path.join(directory, "frozen.pb")
    restorekit.freeze(prefix, prefix + ".meta", ["probs"], out=frozen)
    return frozen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=96, help="input height and width (default 96)")
    parser.add_argument("--samples", type=int, default=100, help="representative samples (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="compress every row N times, keep the fastest")
    parser.add_argument("--keep", action="store_true", help="keep benchmarks/data/compress")
    args = parser.parse_args(argv)

    from restorekit._tensorflow import quiet_logs

    quiet_logs()
    import restorekit

    directory = os.path.join(HERE, "data", "compress")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    try:
        frozen = build(directory, args.size)
        data = np.random.RandomState(1).rand(args.samples, args.size, args.size, 3).astype(np.float32)
        results = []
        for backend, precision in ROWS:
            out = os.path.join(directory, f"model-{precision}.{'tflite' if backend == 'tflite' else 'onnx'}")
            runs = [restorekit.compress(frozen, out, backend=backend, precision=precision, representative_data=data,
                                        overwrite=True) for _ in range(args.repeats)]
            results.append(dataclasses.replace(runs[0], latency_before_ms=min(r.latency_before_ms for r in runs),
                                               latency_after_ms=min(r.latency_after_ms for r in runs)))
        original = statistics.median(r.latency_before_ms for r in results)
        print(f"frozen graph: {results[0].size_before / 1024:.1f} KiB, TF session {original:.3f} ms per sample "
              f"(median of the rows), {args.samples} samples of {args.size}x{args.size}x3, fastest of "
              f"{args.repeats}\n")
        print("| runtime | precision | size | size / .pb | max abs error | max rel error | ms / sample | "
              "TF ms / sample (same call) |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in results:
            runtime = "LiteRT" if r.backend == "tflite" else "ONNX Runtime (CPU)"
            print(f"| {runtime} | {r.precision} | {r.size_after / 1024:.1f} KiB | {r.ratio:.2f} | {r.max_error:.2g} | "
                  f"{max(r.max_rel_error.values()):.2g} | {r.latency_after_ms:.3f} | {r.latency_before_ms:.3f} |")
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
