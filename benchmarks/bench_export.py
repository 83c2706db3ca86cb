"""Export to safetensors vs plain `cp`, in paired rounds on the BERT-base + Adam checkpoint.

    python benchmarks/bench_export.py [--rounds N] [--data DIR] [--keep] [--code DIR]

Each round times `cp` of the data shard and ``restorekit.formats.safetensors.
write_checkpoint`` of the same checkpoint (order rotating between rounds). Before each
timed operation both outputs are deleted, then `sync` and a short pause. The export
runs in a worker process that imported restorekit once, so its time excludes imports.
``--code DIR`` adds a second worker running another checkout (before/after).

Reported: every time, each operation's median and minimum, the median of the paired
ratios export / cp, the ratio of the medians and the ratio of the minimums. On the VMs
this was measured on, a copy of 1.3 GB takes either ~0.35 s or 1-2.5 s, at random,
for `cp` and the export alike (the host hands freed guest memory back and faults it in
again; see benchmarks/README.md), so single paired ratios swing widely and the three
summaries together tell more than any one. Goal (issue 4): at most 2x `cp`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

_WORKER = """
import sys, time
sys.path.insert(0, {root!r})
import restorekit
from restorekit.formats import safetensors  # reader and writer in one package
if not hasattr(safetensors, "write_checkpoint"):  # a checkout from before the format packages (--code)
    from restorekit.export import safetensors
ckpt = restorekit.Checkpoint({prefix!r})
for _ in sys.stdin:
    start = time.perf_counter()
    safetensors.write_checkpoint(ckpt, {out!r})
    print(time.perf_counter() - start, flush=True)
"""


class Worker:
    """A process that exports the checkpoint each time it is asked, and reports the time."""

    def __init__(self, root: str, prefix: str, out: str):
        code = _WORKER.format(root=root, prefix=prefix, out=out)
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self) -> float:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("export worker died")
        return float(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data", default=os.path.join(HERE, "data", "export"))
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    parser.add_argument("--code", help="another restorekit checkout to time beside this one")
    args = parser.parse_args(argv)
    import make_bert_checkpoint

    os.makedirs(args.data, exist_ok=True)
    workers = {}
    try:
        prefix = os.path.join(args.data, "bert_model.ckpt")
        if not os.path.exists(prefix + ".index"):
            prefix = make_bert_checkpoint.write(args.data)
        source = prefix + ".data-00000-of-00001"
        out = os.path.join(args.data, "out.bin")
        workers["export"] = Worker(ROOT, prefix, out)
        if args.code:
            workers["other"] = Worker(os.path.abspath(args.code), prefix, out)

        def cp() -> float:
            start = time.perf_counter()
            subprocess.run(["cp", source, out], check=True)
            return time.perf_counter() - start

        ops = {"cp": cp, **workers}
        names = list(ops)
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.rounds):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                if os.path.exists(out):
                    os.remove(out)
                os.sync()
                time.sleep(0.5)
                times[name].append(ops[name]())
            print(f"round {i}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in names), flush=True)
        if os.path.exists(out):
            os.remove(out)
        for name in names:
            t = times[name]
            print(f"{name:7s} median {statistics.median(t):.3f} s, min {min(t):.3f} s")
        for name in names[1:]:
            paired = [a / b for a, b in zip(times[name], times["cp"])]
            print(
                f"{name} / cp: paired median {statistics.median(paired):.2f}x, "
                f"ratio of medians {statistics.median(times[name]) / statistics.median(times['cp']):.2f}x, "
                f"ratio of minimums {min(times[name]) / min(times['cp']):.2f}x"
            )
    finally:
        for worker in workers.values():
            worker.close()
        if not args.keep:
            shutil.rmtree(args.data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
