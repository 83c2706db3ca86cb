"""Multi-shard checkpoints at disk speed (issue 15, item 3): editor saves and sharded safetensors on N shards.

A generated checkpoint (default about 6 GB in 8 shards: float32 variables, each with
Adam ``m`` and ``v`` slots in its shard, as TF's sharded Saver lays them out) under
the git-ignored ``benchmarks/data/``, deleted afterwards. It is shrunk when the disk
has less than 3x its size free (the disk is shared). Each operation runs in its own
Python process; time excludes interpreter start and imports; peak memory is VmHWM
minus VmRSS just before the operation. Each round runs the operation next to its
``cp -r`` baseline, which copies the operation's own output directory (exactly the
bytes it wrote) and then fsyncs every copied file (``sync FILE...``), because our
multi-file outputs fsync every file before the index makes them visible; the ratio is
the median over rounds of ours / cp. Warm page cache throughout.

    python benchmarks/bench_scale.py [--gb 6] [--shards 8] [--repeat 3] [--only TEXT] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_edit import DRIVER  # noqa: E402 - one operation per process, timed with its peak memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = """import numpy as np
import restorekit.edit._save_tf as save_tf
from restorekit.edit import CheckpointEditor
from restorekit.export import convert
src, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
st = os.path.join(os.path.dirname(os.path.dirname(src)), "st")  # the sharded safetensors
if workers:
    save_tf.WORKERS = workers"""

# name -> (body, paired with cp of the output)
OPERATIONS = {
    "rename every variable": ("ed = CheckpointEditor(src)\ned.rename_all(lambda n: 'renamed/' + n)\ned.save(out)", False),
    # The default checks the crc32c of every kept byte (issue 11); check_kept=False leaves that to reads.
    "rename every variable, check_kept=False": (
        "ed = CheckpointEditor(src)\ned.rename_all(lambda n: 'renamed/' + n)\ned.save(out, check_kept=False)", False),
    "strip optimizer slots, compact=True (8 shards out)": (
        "ed = CheckpointEditor(src)\ned.strip_optimizer_slots()\ned.save(out, compact=True, num_shards=8)", True),
    "strip optimizer slots, compact=True (1 shard out)": (
        "ed = CheckpointEditor(src)\ned.strip_optimizer_slots()\ned.save(out, compact=True)", True),
    "cast floats to bfloat16, compact=True (8 shards out)": (
        "ed = CheckpointEditor(src)\ned.cast('.*', 'bfloat16')\ned.save(out, num_shards=8)", True),
    "export to sharded safetensors (max_shard_size=1GB)": (
        "convert(src, st, max_shard_size='1GB')", True),
    "import sharded safetensors to a TF checkpoint": ("convert(st, out)", True),
}


def make_checkpoint(prefix: str, total: int, shards: int) -> dict:
    """Variables of 16 MiB (and small biases), each with Adam m and v beside it, round-robin over the shards."""
    import numpy as np

    from restorekit._bundle.writer import BundleWriter

    rng = np.random.default_rng(0)
    base = rng.standard_normal(4 << 20, dtype=np.float32)  # one 16 MiB block, offset per tensor
    count = max(shards, total // (3 * base.nbytes))
    kept = 0
    with BundleWriter(prefix, num_shards=shards, shard_id=None) as writer:
        for i in range(count):
            shard = writer.shard(i % shards)
            kernel = base.reshape(1024, 4096) + np.float32(i)
            for name in (f"layer_{i:04d}/kernel", f"layer_{i:04d}/kernel/Adam", f"layer_{i:04d}/kernel/Adam_1"):
                shard.add(name, kernel)
            shard.add(f"layer_{i:04d}/bias", np.full(4096, i, np.float32))
            kept += kernel.nbytes + 4096 * 4
        writer.shard(0).add("global_step", np.int64(1000))
    return {"variables": count, "kept_bytes": kept}


def run(body: str, src: str, out: str, workers: int) -> dict:
    code = DRIVER.format(code=REPO, setup=SETUP, body=body)
    proc = subprocess.run([sys.executable, "-c", code, src, out, str(workers)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed_cp(directory: str, copy: str, *, fsync: bool = True) -> float:
    """``cp -r`` of a directory, then (``fsync``) an fsync of every copied file."""
    start = time.perf_counter()
    subprocess.run(["cp", "-r", directory, copy], check=True)
    if fsync:
        subprocess.run(["sync", *[os.path.join(copy, n) for n in os.listdir(copy)]], check=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(copy)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "benchmarks", "data"))
    parser.add_argument("--gb", type=float, default=6.0, help="checkpoint size (shrunk to a third of the free disk)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="paired rounds per operation (median)")
    parser.add_argument("--workers", type=int, default=0, help="override the shard thread pool size (0: default)")
    parser.add_argument("--only", help="run only operations whose name contains this")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    os.makedirs(args.data, exist_ok=True)
    free = shutil.disk_usage(args.data).free
    total = int(min(args.gb * 1e9, free / 3))
    if total < args.gb * 1e9:
        print(f"only {free / 1e9:.1f} GB free: generating {total / 1e9:.1f} GB instead of {args.gb} GB", flush=True)
    work = tempfile.mkdtemp(prefix="bench-scale-", dir=args.data)
    results = {}
    try:
        src_dir = os.path.join(work, "src")
        os.makedirs(src_dir)
        src = os.path.join(src_dir, "model.ckpt")
        start = time.perf_counter()
        info = make_checkpoint(src, total, args.shards)
        info["bytes"] = du(src_dir)
        print(f"generated {info['bytes'] / 1e9:.2f} GB in {args.shards} shards, {info['variables']} variables "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        for name, (body, paired) in OPERATIONS.items():
            if args.only and args.only not in name:
                continue
            if name.startswith("import") and not os.path.isdir(os.path.join(work, "st")):
                run(OPERATIONS["export to sharded safetensors (max_shard_size=1GB)"][0], src,
                    os.path.join(work, "out", "model.ckpt"), args.workers)
            runs, ratios, cps, plain = [], [], [], []
            for round_ in range(args.repeat):
                out_dir = os.path.join(work, "out")
                keep_st = name.startswith("export") and round_ == args.repeat - 1
                if name.startswith("export"):
                    shutil.rmtree(os.path.join(work, "st"), ignore_errors=True)
                result = run(body, src, os.path.join(out_dir, "model.ckpt"), args.workers)
                runs.append(result)
                written = os.path.join(work, "st") if name.startswith("export") else out_dir
                if paired:
                    plain.append(timed_cp(written, os.path.join(work, "copy"), fsync=False))
                    cps.append(timed_cp(written, os.path.join(work, "copy")))
                    ratios.append(result["seconds"] / cps[-1])
                result["bytes"] = du(written)
                shutil.rmtree(out_dir, ignore_errors=True)
                if name.startswith("export") and not keep_st:
                    shutil.rmtree(written, ignore_errors=True)
            results[name] = {
                "seconds": statistics.median(r["seconds"] for r in runs),
                "peak_mib": max(r["peak"] for r in runs) / 2**20,
                "bytes": runs[-1]["bytes"],
                "cp_seconds": statistics.median(cps) if cps else None,
                "ratio": statistics.median(ratios) if ratios else None,
                "ratio_rounds": [round(x, 2) for x in ratios],
                "cp_plain_seconds": statistics.median(plain) if plain else None,
                "ratio_plain": statistics.median(r["seconds"] / p for r, p in zip(runs, plain)) if plain else None,
            }
            r = results[name]
            shown = (f"{r['ratio']:5.2f}x cp -r + fsync ({r['cp_seconds']:.2f} s), {r['ratio_plain']:5.2f}x plain cp -r "
                     f"({r['cp_plain_seconds']:.2f} s)") if r["ratio"] else ""
            print(f"{name:55s} {r['seconds']:8.3f} s  {r['bytes'] / 1e9:6.2f} GB  peak +{r['peak_mib']:6.1f} MiB  {shown}",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"checkpoint": info, "workers": args.workers, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
