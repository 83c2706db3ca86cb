"""Benchmark for issue 38: ``restorekit convert`` to Hugging Face safetensors shards, one process vs N gloo ranks.

    python benchmarks/bench_distribute_convert.py [--gb 1.0] [--ranks 2] [--shard 100MB] [--keep]

A TF checkpoint of about ``--gb`` GB of float32 (64 tensors, one data shard) is written with
restorekit's BundleWriter under ``benchmarks/data/bench_distribute_convert/`` (git-ignored),
after checking the disk has three times that free. Then, in one run, each as a fresh command:

  (a) ``python -m restorekit convert SRC one --max-shard-size SHARD`` (one process);
  (b) ``python -m torch.distributed.run --nproc-per-node N -m restorekit convert SRC many ...``.

The outputs are compared file by file (they must be byte-identical) and the speed-up
(a) / (b) printed beside the disk's own read rate: the source's data shard read once with
O_DIRECT, past the page cache, which the conversions themselves read from (the source was
just written). Command times include starting Python, torch and the gloo group, printed
separately (``--help`` and a group of N with nothing to do are not measured: the start-up
line is one ``python -c 'import restorekit.export, torch.distributed'``). (Not named
``bench_distribute.py``: that one is issue 15's ParameterServerStrategy restore.)
Generated data is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "benchmarks", "data", "bench_distribute_convert")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_source(prefix: str, gb: float) -> int:
    from restorekit._bundle.writer import BundleWriter

    count = 64
    cols = 1024
    rows = max(1, int(gb * 1e9 / 4 / cols / count))
    rng = np.random.default_rng(0)
    block = rng.standard_normal((rows, cols), dtype=np.float32)
    with BundleWriter(prefix) as writer:
        for i in range(count):
            writer.add(f"layer_{i:02d}/kernel", block + np.float32(i))
    return count * block.nbytes


def _direct_read_rate(path: str) -> float | None:
    """MB/s reading ``path`` with O_DIRECT (the disk, not the page cache); None where O_DIRECT is refused."""
    chunk = 16 << 20
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return None
    total = 0
    start = time.perf_counter()
    try:
        while True:
            n = os.readv(fd, [buffer])
            total += n
            if n < chunk:
                break
    except OSError:
        return None
    finally:
        os.close(fd)
    return total / 1e6 / (time.perf_counter() - start)


def _timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    return elapsed


def _same(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    for name in names:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            while True:
                x, y = fa.read(16 << 20), fb.read(16 << 20)
                if x != y:
                    return False
                if not x:
                    break
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shard", default="100MB")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()

    need = 3.2 * args.gb * 1e9
    os.makedirs(DATA, exist_ok=True)
    free = shutil.disk_usage(DATA).free
    if free < need + 5e9:
        raise SystemExit(f"{free / 1e9:.1f} GB free; this needs {need / 1e9:.1f} GB and leaves 5 GB: pass a smaller --gb")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "RESTOREKIT_CRASH_HOOK"):
        env.pop(key, None)
    try:
        prefix = os.path.join(DATA, "src", "model.ckpt")
        nbytes = _write_source(prefix, args.gb)
        shard = prefix + ".data-00000-of-00001"
        disk = _direct_read_rate(shard)
        start_up = _timed([sys.executable, "-c", "import restorekit.export, torch.distributed"], env)
        one, many = os.path.join(DATA, "one"), os.path.join(DATA, "many")
        convert = ["-m", "restorekit", "convert", prefix]
        t_one = _timed([sys.executable, *convert, one, "--max-shard-size", args.shard, "-q"], env)
        t_many = _timed([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
                         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                         *convert, many, "--max-shard-size", args.shard, "-q"], env)
        identical = _same(one, many)
        shards = len(os.listdir(one)) - 1
        print(f"source: {nbytes / 1e9:.2f} GB TF checkpoint -> {shards} HF shards of <= {args.shard}; "
              f"cpus: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
        print(f"disk read rate (O_DIRECT, past the page cache): "
              f"{'refused' if disk is None else f'{disk:.0f} MB/s'}")
        print(f"start-up (python + restorekit + torch.distributed imports): {start_up:.2f} s")
        print(f"1 process:  {t_one:6.2f} s  ({nbytes / 1e6 / t_one:5.0f} MB/s end to end)")
        print(f"{args.ranks} ranks:    {t_many:6.2f} s  ({nbytes / 1e6 / t_many:5.0f} MB/s end to end)")
        print(f"speed-up 1 process / {args.ranks} ranks: {t_one / t_many:.2f}x; outputs byte-identical: {identical}")
        if not identical:
            raise SystemExit("outputs differ")
    finally:
        if not args.keep:
            shutil.rmtree(DATA, ignore_errors=True)


if __name__ == "__main__":
    main()
