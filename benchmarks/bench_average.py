"""Checkpoint averaging (issue 25): peak memory and time of ``restorekit.average`` against load-all-and-average.

Three generated TF checkpoints of one BERT-base-like model (default about 0.4 GB each,
1.2 GB in all: a 94 MB embedding table, 32 [768, 3072] float32 matrices, a few bfloat16
and integer entries), written with restorekit's BundleWriter under the git-ignored
``benchmarks/data/`` and deleted afterwards; shrunk when the disk has less than 3x their
size free (the disk is shared). Each run is its own Python process; time excludes
interpreter start and imports; peak memory is VmHWM minus VmRSS just before the run.

- ours: ``restorekit.average(sources, out)``, tensor by tensor.
- reference: every tensor of every source read into memory with
  ``tf.train.load_checkpoint``, then per tensor ``np.average`` in float64, cast back, and
  written with the same BundleWriter (the plain numpy way).

Rounds alternate which runs first; the figures are medians over rounds and the ratio is
the median of the paired ratios ours / reference. Both outputs are checked equal.

    python benchmarks/bench_average.py [--gb 1.2] [--repeat 1] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_edit import REPO, run  # noqa: E402 - one operation per process, timed with its peak memory

sys.path.insert(0, REPO)

OURS = ("import restorekit\nsources = sys.argv[1].split(os.pathsep)\nout = sys.argv[2]",
        "restorekit.average(sources, out)")
REFERENCE = (
    "import numpy as np\nimport tensorflow as tf\nfrom restorekit._bundle.writer import BundleWriter\n"
    "sources = sys.argv[1].split(os.pathsep)\nout = sys.argv[2]",
    """readers = [tf.train.load_checkpoint(s) for s in sources]
names = sorted(readers[0].get_variable_to_shape_map())
loaded = [{n: r.get_tensor(n) for n in names} for r in readers]
with BundleWriter(out) as writer:
    for n in names:
        first = loaded[0][n]
        if first.dtype.kind == 'f' or first.dtype.name == 'bfloat16':
            value = np.average(np.stack([m[n].astype(np.float64) for m in loaded]), axis=0).astype(first.dtype)
        else:
            value = first
        writer.add(n, value)""",
)


def make_checkpoints(directory: str, total_bytes: int) -> tuple[list, int]:
    """Three checkpoints of one model, ``total_bytes`` in all; (prefixes, largest tensor's bytes)."""
    import ml_dtypes

    from restorekit._bundle.writer import BundleWriter

    per = total_bytes // 3
    embedding = (30522, 768) if per > 200e6 else (max(1000, per // 4 // 768 // 4), 768)
    matrix_bytes = 768 * 3072 * 4
    matrices = max(1, int((per - np.prod(embedding) * 4) // matrix_bytes))
    prefixes = []
    for k in range(3):
        rng = np.random.default_rng(k)
        prefix = os.path.join(directory, f"run{k}", "model.ckpt")
        os.makedirs(os.path.dirname(prefix))
        with BundleWriter(prefix) as writer:
            writer.add("bert/embeddings/word_embeddings", rng.standard_normal(embedding, np.float32))
            for i in range(matrices):
                writer.add(f"bert/encoder/layer_{i}/intermediate/dense/kernel", rng.standard_normal((768, 3072), np.float32))
                writer.add(f"bert/encoder/layer_{i}/intermediate/dense/bias",
                           rng.standard_normal(3072, np.float32).astype(ml_dtypes.bfloat16))
            writer.add("bert/embeddings/token_type_ids", np.arange(512, dtype=np.int64))
        prefixes.append(prefix)
    return prefixes, int(np.prod(embedding) * 4)


def same_outputs(a: str, b: str) -> bool:
    from restorekit._checkpoint import Checkpoint

    x, y = Checkpoint(a), Checkpoint(b)
    return set(x.entries) == set(y.entries) and all(np.array_equal(x.read(n), y.read(n)) for n in x.entries)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "benchmarks", "data", "average"))
    parser.add_argument("--gb", type=float, default=1.2, help="total size of the three sources")
    parser.add_argument("--repeat", type=int, default=1, help="paired rounds (median; each adds about 30 s)")
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    args = parser.parse_args(argv)

    os.makedirs(args.data, exist_ok=True)
    free = shutil.disk_usage(args.data).free
    total = int(args.gb * 1e9)
    if free < 3 * total:  # sources + two outputs + room for others on the shared disk
        total = max(int(50e6), free // 4)
        print(f"only {free / 1e9:.1f} GB free: sources shrunk to {total / 1e9:.2f} GB", file=sys.stderr)
    try:
        sources, largest = make_checkpoints(args.data, total)
        size = sum(os.path.getsize(os.path.join(os.path.dirname(p), f)) for p in sources
                   for f in os.listdir(os.path.dirname(p)))
        print(f"3 sources, {size / 1e9:.2f} GB in all; largest tensor {largest / 2**20:.1f} MiB")
        joined = os.pathsep.join(sources)
        rows = {"ours": [], "reference": []}
        for r in range(args.repeat):
            order = [("ours", OURS), ("reference", REFERENCE)]
            for label, (setup, body) in order if r % 2 == 0 else order[::-1]:
                out = os.path.join(args.data, f"out-{label}", "model.ckpt")
                shutil.rmtree(os.path.dirname(out), ignore_errors=True)
                os.makedirs(os.path.dirname(out))
                rows[label].append(run(setup, body, joined, out))
        equal = same_outputs(os.path.join(args.data, "out-ours", "model.ckpt"),
                             os.path.join(args.data, "out-reference", "model.ckpt"))
        ours, ref = rows["ours"], rows["reference"]
        peak = statistics.median(m["peak"] for m in ours)
        ref_peak = statistics.median(m["peak"] for m in ref)
        ratio = statistics.median(a["seconds"] / b["seconds"] for a, b in zip(ours, ref))
        print(f"ours:      {statistics.median(m['seconds'] for m in ours):6.2f} s, peak {peak / 2**20:7.1f} MiB above "
              f"baseline = {peak / largest:.1f}x the largest tensor, {peak / size:.3f}x the sources")
        print(f"reference: {statistics.median(m['seconds'] for m in ref):6.2f} s, peak {ref_peak / 2**20:7.1f} MiB above "
              f"baseline = {ref_peak / largest:.1f}x the largest tensor, {ref_peak / size:.3f}x the sources")
        print(f"time ours / reference: {ratio:.2f} (median of {args.repeat} paired rounds); outputs equal: {equal}")
        return 0 if equal else 1
    finally:
        if not args.keep:
            shutil.rmtree(args.data, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
