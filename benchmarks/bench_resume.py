"""Benchmark for resuming a TF run in PyTorch (issue 36): BERT-base with its Adam slots into a torch module + AdamW.

    python benchmarks/bench_resume.py [--data DIR] [--repeats N] [--keep] [--profile]

The checkpoint is ``make_bert_checkpoint.py``'s: Google-BERT names and BERT's own optimizer
state (``adam_m`` / ``adam_v`` slots of ``AdamWeightDecayOptimizer``, no bias correction, no
beta powers; ~1.3 GB), which restorekit carries into ``torch.optim.AdamW`` exactly (the step is
set where torch's bias corrections are 1.0; ``tests/test_optimizer_state.py`` checks the
resumed losses against BERT's optimizer run in TensorFlow). The target is
``transformers.BertForPreTraining`` (bert-base-uncased's config) and ``AdamW`` over its
parameters. Per round, each side starts from a freshly built model and optimizer (built
outside the timing):

(a) the reference: torch's own files of the same state, saved once beforehand with
    ``torch.save`` (``model.state_dict()`` and ``optimizer.state_dict()``), read back with
    ``torch.load`` and put in with ``model.load_state_dict`` + ``optimizer.load_state_dict``;
(b) restorekit: ``scan(ckpt, model, rules='bert-tf-to-hf', optimizer=opt)`` + ``restore``.

Rounds alternate which side goes first; round 0 warms the page cache and is dropped; the
ratio is the median of the per-round (b)/(a). Goal: <= 1.2. Both sides' weights and
optimizer state are compared for equality once. ``--profile`` prints a cProfile of (b).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import transformers  # noqa: E402

import restorekit  # noqa: E402

NEEDED_GB = 3.5  # the checkpoint (~1.3 GB), torch's two files (~1.3 GB), headroom


def build():
    """BERT-base (uncased) for pre-training and an AdamW over its parameters, as a training script makes them."""
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    model = transformers.BertForPreTraining(transformers.BertConfig())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, eps=1e-6)


def ours(prefix: str, model, optimizer):
    report = restorekit.scan(prefix, model, rules="bert-tf-to-hf", optimizer=optimizer)
    restorekit.restore(report)
    return report


def reference(directory: str, model, optimizer) -> None:
    model.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    optimizer.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt")))


def same(a, b) -> None:
    (ma, oa), (mb, ob) = a, b
    for (name, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(x, y), name
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        sa, sb = oa.state[pa], ob.state[pb]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), sa.keys()
    assert oa.param_groups[0]["eps"] == ob.param_groups[0]["eps"]


def run(data: str, repeats: int, profile: bool) -> dict:
    import make_bert_checkpoint

    prefix = make_bert_checkpoint.write(os.path.join(data, "bert"))
    torch_dir = os.path.join(data, "torch")
    os.makedirs(torch_dir, exist_ok=True)
    first = build()
    report = ours(prefix, *first)
    assert len(report.optimizer.carried) == len(list(first[0].parameters())) and not report.optimizer.reset
    torch.save(first[0].state_dict(), os.path.join(torch_dir, "model.pt"))
    torch.save(first[1].state_dict(), os.path.join(torch_dir, "optimizer.pt"))
    check = build()
    reference(torch_dir, *check)
    same(first, check)
    del first, check
    if profile:
        target = build()
        profiler = cProfile.Profile()
        profiler.enable()
        ours(prefix, *target)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        del target
    times: dict = {"reference": [], "restorekit": []}
    for i in range(repeats + 1):
        order = ("reference", "restorekit") if i % 2 else ("restorekit", "reference")
        for side in order:
            target = build()
            gc.collect()
            start = time.perf_counter()
            if side == "reference":
                reference(torch_dir, *target)
            else:
                ours(prefix, *target)
            elapsed = time.perf_counter() - start
            del target
            if i:
                times[side].append(elapsed)
    size = sum(os.path.getsize(os.path.join(torch_dir, f)) for f in os.listdir(torch_dir))
    return {
        "torch files GB": round(size / 1e9, 2),
        "(a) torch.load + load_state_dict s (median)": round(statistics.median(times["reference"]), 3),
        "(b) scan + restore s (median)": round(statistics.median(times["restorekit"]), 3),
        "(b)/(a) (median of paired rounds)": round(statistics.median(
            b / a for a, b in zip(times["reference"], times["restorekit"])), 3),
        "rounds": repeats,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="where to write the data (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one restorekit restore")
    args = parser.parse_args(argv)
    data = args.data or tempfile.mkdtemp(prefix="bench_resume_")
    os.makedirs(data, exist_ok=True)
    free = shutil.disk_usage(data).free / 1e9
    if free < NEEDED_GB:
        print(f"only {free:.1f} GB free under {data}; this benchmark needs {NEEDED_GB} GB")
        return 1
    try:
        print(run(data, args.repeats, args.profile))
    finally:
        if not args.keep:
            shutil.rmtree(data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
