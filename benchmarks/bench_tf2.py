"""Benchmark for issue 6: TF2 partial restore of a BERT-base-sized checkpoint into a Keras 3 model.

    python benchmarks/bench_tf2.py [--data DIR] [--repeats N] [--keep]

A Keras model the size of BERT-base (a 30522x768 embedding and 12 blocks of
768x768 x4 and 768/3072 dense layers, ~110M parameters, ~440 MB) is saved with
``tf.train.Checkpoint(model=...)``. A second model of the same architecture plus a
new classifier head (not in the checkpoint) is then restored, side by side:

  (a) ``tf.train.Checkpoint(model=m).restore(path).expect_partial()``;
  (b) ``restorekit.scan(path, m)`` + ``restorekit._tf2.restore(report)``
      (batched ``tf.raw_ops.RestoreV2`` reads, then assigns);
  (c) for the record, the per-tensor alternative: ``Checkpoint.read`` (numpy,
      crc-checked) + assign, one variable at a time.

Runs alternate after one warm-up of each (the data shard is then in the page
cache for all); the median of each is reported. Goal: (b) / (a) <= 1.2. Values
are checked equal after (b). Generated data is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from restorekit import _tf2 as tf2  # noqa: E402
from restorekit._checkpoint import Checkpoint  # noqa: E402
from restorekit._scan import scan  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 30522, 768, 3072, 12


def bert_sized_model(*, head: int | None = None) -> keras.Model:
    """Same layer names every call, so paths match; ``head`` adds a new classifier."""
    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embeddings")(ids)
    for i in range(LAYERS):
        for part in ("query", "key", "value", "attention_output"):
            x = keras.layers.Dense(HIDDEN, name=f"layer_{i}_{part}")(x)
        x = keras.layers.Dense(INTERMEDIATE, name=f"layer_{i}_intermediate")(x)
        x = keras.layers.Dense(HIDDEN, name=f"layer_{i}_output")(x)
    if head is not None:
        x = keras.layers.Dense(head, name="classifier")(x)
    return keras.Model(ids, x)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(HERE, "data", "bench_tf2"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = parser.parse_args(argv)

    os.makedirs(args.data, exist_ok=True)
    try:
        source = bert_sized_model()
        params = sum(int(np.prod(v.shape)) for v in source.variables)
        start = time.perf_counter()
        path = tf.train.Checkpoint(model=source).save(os.path.join(args.data, "ckpt"))
        print(f"saved {params / 1e6:.1f}M parameters ({Checkpoint(path).nbytes / 1e6:.0f} MB) "
              f"in {time.perf_counter() - start:.1f} s")
        expected = {v.path: v.numpy() for v in source.variables}
        del source

        target = bert_sized_model(head=2)

        def plain():
            tf.train.Checkpoint(model=target).restore(path).expect_partial()

        def ours():
            tf2.restore(scan(path, target))

        def per_tensor():
            report = scan(path, target)
            ckpt = Checkpoint(path)
            for r in report.matched:
                report._handles[r.variable_name].assign(ckpt.read(r.checkpoint_name), read_value=False)

        report = scan(path, target)
        print(f"scan: {len(report.matched)} matched, {len(report.missing)} missing "
              f"({', '.join(r.variable_name for r in report.missing)}), {len(report.unused)} unused")
        scan_times = [timed(lambda: scan(path, target)) for _ in range(args.repeats)]

        runs = {"plain": plain, "restorekit": ours, "per_tensor": per_tensor}
        times = {name: [] for name in runs}
        for fn in runs.values():  # warm-up: page cache, tf.function tracing
            fn()
        for _ in range(args.repeats):
            for name, fn in runs.items():
                times[name].append(timed(fn))

        for v in target.variables:
            if v.path in expected:
                np.testing.assert_array_equal(v.numpy(), expected[v.path])

        median = {name: statistics.median(t) for name, t in times.items()}
        print(f"scan alone                         {statistics.median(scan_times) * 1000:8.1f} ms")
        for name, label in [
            ("plain", "(a) tf.train.Checkpoint.restore"),
            ("restorekit", "(b) scan + tf2.restore"),
            ("per_tensor", "(c) scan + numpy read per tensor"),
        ]:
            spread = ", ".join(f"{t:.2f}" for t in times[name])
            print(f"{label:<34} {median[name] * 1000:8.1f} ms   runs: {spread} s")
        ratio = median["restorekit"] / median["plain"]
        print(f"ratio (b)/(a) = {ratio:.2f}   goal <= 1.20   {'OK' if ratio <= 1.2 else 'OVER'}")
        print(f"ratio (c)/(a) = {median['per_tensor'] / median['plain']:.2f}")
        return 0 if ratio <= 1.2 else 1
    finally:
        if not args.keep:
            shutil.rmtree(args.data, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
