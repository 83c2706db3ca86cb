"""Benchmarks for the core (issue 2): partial-restore overhead and scan scaling.

    python benchmarks/bench_restore.py [--data DIR] [--repeats N] [--keep]

1. Restore overhead: a BERT-base-sized checkpoint with Adam slots (~1.3 GB, generated
   with benchmarks/make_bert_checkpoint.py). The model variables (no slots) are
   restored (a) by a hand-built ``tf.compat.v1.train.Saver`` over exactly those
   variables, and (b) by ``restorekit.scan`` + ``restorekit.partial_saver``. Both
   include building their Saver; runs alternate, the median of each is compared.
   Goal: (b) / (a) <= 1.10.
2. Scan scaling: ``scan`` of N variables against an N-entry checkpoint for N = 5k,
   10k, 20k. Goal: under 1 s at 20k, and linear growth.
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
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import restorekit  # noqa: E402
from restorekit._bundle.writer import BundleWriter  # noqa: E402

tf1 = tf.compat.v1


def restore_overhead(data: str, repeats: int) -> dict:
    import make_bert_checkpoint

    directory = os.path.join(data, "restore")
    prefix = os.path.join(directory, "bert_model.ckpt")
    if not os.path.exists(prefix + ".index"):
        os.makedirs(directory, exist_ok=True)
        prefix = make_bert_checkpoint.write(directory)
    ckpt = restorekit.Checkpoint(prefix)
    model = {n: e for n, e in ckpt.entries.items() if restorekit._names.optimizer_slot_kind(n) is None
             and not restorekit._names.is_global_step(n)}
    gbytes = sum(e.nbytes for e in model.values()) / 2**30
    plain, ours = [], []

    def trial(method: str) -> float:
        # A fresh graph and session per trial, as in a real training script: a
        # session that already ran other Savers' ops pays more to prune a larger graph.
        with tf.Graph().as_default():
            variables = {n: tf1.get_variable(n, e.shape, initializer=tf1.zeros_initializer()) for n, e in model.items()}
            with tf1.Session() as sess:
                sess.run(tf1.global_variables_initializer())
                start = time.perf_counter()
                if method == "plain":
                    tf1.train.Saver(variables).restore(sess, prefix)
                else:
                    report = restorekit.scan(prefix, list(variables.values()))
                    restorekit.partial_saver(report).restore(sess, prefix)
                elapsed = time.perf_counter() - start
                if method == "ours":
                    assert len(report.matched) == len(model)
                    name = "bert/encoder/layer_11/output/dense/kernel"
                    np.testing.assert_array_equal(sess.run(variables[name]), ckpt.read(name))
        return elapsed

    for i in range(repeats + 1):  # round 0 warms the page cache and is dropped
        # Alternate which goes first, so neither always meets a warmer cache.
        order = ("plain", "ours") if i % 2 else ("ours", "plain")
        times = {method: trial(method) for method in order}
        if i:
            plain.append(times["plain"])
            ours.append(times["ours"])
    return {
        "variables": len(model),
        "GiB restored": round(gbytes, 2),
        "entries in checkpoint": len(ckpt),
        "plain Saver s (median)": round(statistics.median(plain), 3),
        "scan + partial_saver s (median)": round(statistics.median(ours), 3),
        # Paired per round, so load from other processes hits both sides alike.
        "ratio (median of paired rounds)": round(statistics.median(o / p for o, p in zip(ours, plain)), 3),
    }


def scan_scaling(data: str) -> list[dict]:
    rows = []
    for n in (5000, 10000, 20000):
        prefix = os.path.join(data, f"scan{n}", "model.ckpt")
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        with BundleWriter(prefix) as writer:
            for i in range(n):
                writer.add(f"layer_{i // 10}/unit_{i % 10}/weights", np.zeros(2, np.float32))
        with tf.Graph().as_default():
            variables = [
                tf1.get_variable(f"layer_{i // 10}/unit_{i % 10}/weights", [2]) for i in range(n)
            ]
            times = []
            for _ in range(3):
                start = time.perf_counter()
                report = restorekit.scan(prefix, variables)
                times.append(time.perf_counter() - start)
            assert len(report.matched) == n
        rows.append({"N": n, "scan s (best of 3)": round(min(times), 3), "us per variable": round(min(times) / n * 1e6, 1)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(HERE, "data"))
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep generated checkpoints")
    args = parser.parse_args(argv)
    os.makedirs(args.data, exist_ok=True)
    try:
        print("scan scaling:")
        for row in scan_scaling(args.data):
            print("  ", row)
        print("restore overhead:")
        print("  ", restore_overhead(args.data, args.repeats))
    finally:
        if not args.keep:
            for sub in ("restore", "scan5000", "scan10000", "scan20000"):
                shutil.rmtree(os.path.join(args.data, sub), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
