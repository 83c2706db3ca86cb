"""Export to safetensors vs plain `cp`, with the disk's write-back state equalized.

    python benchmarks/bench_export.py [--rounds N] [--data DIR] [--keep]

On this shared VM, 1.3 GB writes leave dirty pages whose write-back slows whatever
runs next, so unsynchronized pairs swing from 0.5x to 9x. Here every timed operation
starts from a clean slate: both outputs deleted, `sync`, a short pause. Each round
times `cp` of the data shard and ``restorekit.export.safetensors.write_checkpoint`` of
the same checkpoint (order alternating); the result is the median of the paired
ratios export / cp. Goal (issue 4): at most 2x.
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
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import restorekit  # noqa: E402
from restorekit.export import safetensors  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--data", default=os.path.join(HERE, "data", "export"))
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    import make_bert_checkpoint

    os.makedirs(args.data, exist_ok=True)
    try:
        prefix = os.path.join(args.data, "bert_model.ckpt")
        if not os.path.exists(prefix + ".index"):
            prefix = make_bert_checkpoint.write(args.data)
        ckpt = restorekit.Checkpoint(prefix)
        source = ckpt.data_file(0)
        copied, exported = os.path.join(args.data, "cp.bin"), os.path.join(args.data, "out.safetensors")
        ratios = []
        for i in range(args.rounds):
            times = {}
            for op in ("cp", "export") if i % 2 else ("export", "cp"):
                for path in (copied, exported):
                    if os.path.exists(path):
                        os.remove(path)
                os.sync()
                time.sleep(0.5)
                start = time.perf_counter()
                if op == "cp":
                    subprocess.run(["cp", source, copied], check=True)
                else:
                    safetensors.write_checkpoint(ckpt, exported)
                times[op] = time.perf_counter() - start
            ratios.append(times["export"] / times["cp"])
            print(f"round {i}: cp {times['cp']:.3f} s, export {times['export']:.3f} s, ratio {ratios[-1]:.2f}")
        print(f"median ratio export / cp: {statistics.median(ratios):.2f} over {len(ratios)} rounds")
    finally:
        if not args.keep:
            shutil.rmtree(args.data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
