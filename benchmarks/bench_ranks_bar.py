"""Benchmark for issue 38's bar: 1, 2 and 4 gloo ranks on localhost convert a TF checkpoint of more than 2 GB to
Hugging Face safetensors shards, and average three such checkpoints; outputs byte-identical to one process.

    python benchmarks/bench_ranks_bar.py [--gb 2.2] [--ranks 1 2 4] [--shard 200MB]
                                                             [--lock FILE] [--keep]

Three TF checkpoints of ``--gb`` GB of float32 each (64 tensors, one data shard) are written with restorekit's
BundleWriter under ``benchmarks/data/bench_ranks_bar/`` (git-ignored), after checking the disk holds them, the
two outputs and 5 GB more. Then, holding ``--lock`` (``flock``) while timing:

- the disk's own rates: the first source's data shard read with O_DIRECT (past the page cache), and 1 GB written
  from memory and fsync'd; the disk-bound time of a command is its source bytes / read rate + its output bytes /
  write rate (one device does both);
- for each rank count N, ``python -m restorekit convert SRC OUT --max-shard-size SHARD`` and ``python -m restorekit
  average SRC0 SRC1 SRC2 OUT --max-shard-size SHARD``: N = 1 as a plain command, N > 1 as N processes started
  with the variables torchrun gives its ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so
  that each rank's peak resident memory (``ru_maxrss`` from ``wait4``, which counts the pages of files it maps,
  such as a shard whose crc32c it checks) is its own, beside its peak anonymous memory (``RssAnon`` sampled). The sources' pages are dropped
  from the page cache (``posix_fadvise(DONTNEED)``) before each command, so each reads them from the disk.

Every output's files are hashed (sha256) and must equal the one-process output's. Times are wall-clock from the
first process started to the last one ended, start-up included. The start-up is measured in the same run: N idle
ranks that start Python, import the CLI and torch.distributed and form the gloo group (one process: ``python -m
restorekit --help``); "work" is a command's time less its rank count's start-up, compared with the disk-bound
time. Generated data is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "benchmarks", "data", "bench_ranks_bar")
COUNT = 64  # tensors per checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_source(prefix: str, gb: float, k: int) -> int:
    from restorekit._bundle.writer import BundleWriter

    cols = 1024
    rows = max(1, int(gb * 1e9 / 4 / cols / COUNT))
    block = np.random.default_rng(k).standard_normal((rows, cols), dtype=np.float32)
    with BundleWriter(prefix) as writer:
        for i in range(COUNT):
            writer.add(f"layer_{i:02d}/kernel", block + np.float32(i))
    return COUNT * block.nbytes


def _data_file(prefix: str) -> str:
    return prefix + ".data-00000-of-00001"


def _read_rate(path: str) -> float:
    """MB/s reading ``path`` with O_DIRECT (the disk, not the page cache)."""
    chunk = 16 << 20
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total, start = 0, time.perf_counter()
    try:
        while (n := os.readv(fd, [buffer])) > 0:
            total += n
    finally:
        os.close(fd)
    return total / 1e6 / (time.perf_counter() - start)


def _write_rate(directory: str, nbytes: int = 1 << 30) -> float:
    """MB/s writing ``nbytes`` from memory into a new file and fsync'ing it (what a writer's commit waits for)."""
    block = np.random.default_rng(9).bytes(16 << 20)
    path = os.path.join(directory, "write-probe")
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    os.remove(path)
    return nbytes / 1e6 / elapsed


def _drop_cache(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (clean pages only: they were fsync'd), so the next read is cold."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# What a rank does before its work: start Python, import the CLI and torch.distributed, form the gloo group.
IDLE_RANK = ("import restorekit.cli, restorekit.export, torch.distributed as d; d.init_process_group('gloo'); "
             "d.barrier(); d.destroy_process_group()")


def _idle(ranks: int) -> list[str]:
    """The command line of a rank (one process: the command) that starts as the commands do and does nothing."""
    return ["-m", "restorekit", "--help"] if ranks == 1 else ["-c", IDLE_RANK]


def _anon_mb(pid: int) -> float:
    """The process's resident anonymous memory (heap, arrays; not mapped file pages) in MB, 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _running(pid: int) -> bool:
    """True while child ``pid`` has not exited; it is not reaped (WNOWAIT), so ``wait4`` still gets its usage."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def _run(args: list[str], ranks: int, env: dict) -> tuple[float, list[float], list[float]]:
    """``python ARGS`` as ``ranks`` processes (``args`` after ``-m restorekit`` unless it starts with ``-``):
    (seconds, peak RSS of each rank in MB, peak anonymous RSS of each rank in MB sampled every 20 ms)."""
    argv = args if args[0].startswith("-") else ["-m", "restorekit", *args]
    port = _free_port()
    procs, logs = [], []
    start = time.perf_counter()
    for rank in range(ranks):
        extra = {} if ranks == 1 else {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = tempfile.TemporaryFile()
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env={**env, **extra},
                                      stdout=subprocess.DEVNULL, stderr=log))
        logs.append(log)
    anon = [0.0] * ranks
    while any(_running(proc.pid) for proc in procs):
        anon = [max(a, _anon_mb(proc.pid)) for a, proc in zip(anon, procs)]
        time.sleep(0.02)
    peaks, failed = [], []
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        peaks.append(usage.ru_maxrss / 1024)  # KiB on Linux
        if proc.returncode != 0:
            log.seek(0)
            failed.append(f"rank {rank} exited {proc.returncode}:\n{log.read().decode()[-3000:]}")
    elapsed = time.perf_counter() - start
    if failed:
        raise SystemExit(f"restorekit {' '.join(args)} failed:\n" + "\n".join(failed))
    return elapsed, peaks, anon


def _hashes(directory: str) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


@contextlib.contextmanager
def _locked(path: str | None):
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shard", default="200MB")
    parser.add_argument("--lock", help="a file to hold an exclusive flock on while timing")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if args.ranks[0] != 1:
        raise SystemExit("--ranks starts with 1: the one-process reference")

    need = 5 * args.gb * 1e9  # three sources, two outputs at a time
    os.makedirs(DATA, exist_ok=True)
    free = shutil.disk_usage(DATA).free
    if free < need + 5e9:
        raise SystemExit(f"{free / 1e9:.1f} GB free; this needs {need / 1e9:.1f} GB and leaves 5 GB: pass a smaller --gb")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RESTOREKIT_CRASH_HOOK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    try:
        prefixes = [os.path.join(DATA, f"src{k}", "model.ckpt") for k in range(3)]
        nbytes = [_write_source(prefix, args.gb, k) for k, prefix in enumerate(prefixes)][0]
        data = [_data_file(p) for p in prefixes]
        commands = {"convert": ["convert", prefixes[0]], "average": ["average", *prefixes]}
        reads = {"convert": nbytes, "average": 3 * nbytes}
        with _locked(args.lock):
            _drop_cache(data)
            read_rate = _read_rate(data[0])
            write_rate = _write_rate(DATA)
            idle = {ranks: _run(_idle(ranks), ranks, env)[:2] for ranks in args.ranks}
            rows = []
            for op, command in commands.items():
                reference = None
                for ranks in args.ranks:
                    out = os.path.join(DATA, f"{op}-{ranks}")
                    _drop_cache(data)
                    seconds, peaks, anon = _run([*command, out, "--max-shard-size", args.shard, "-q"], ranks, env)
                    written = _size(out)
                    hashes = _hashes(out)
                    shutil.rmtree(out)
                    bound = reads[op] / 1e6 / read_rate + written / 1e6 / write_rate
                    work = seconds - idle[ranks][0]
                    if ranks == 1:
                        reference = (seconds, hashes, work)
                    rows.append((op, ranks, seconds, reference[0] / seconds, work, reference[2] / work, bound,
                                 work / bound, peaks, anon, hashes == reference[1], len(hashes) - 1, written))
            load = os.getloadavg()[0]
        print(f"sources: 3 TF checkpoints of {nbytes / 1e9:.2f} GB (float32, {COUNT} tensors) -> HF shards of <= "
              f"{args.shard}; cpus: {os.cpu_count()}, load average after the run {load:.1f}")
        print(f"disk: read {read_rate:.0f} MB/s (O_DIRECT), write {write_rate:.0f} MB/s (fsync'd)")
        print("start-up, idle ranks (python, the imports, the gloo group; nothing to do): " + ", ".join(
            f"{ranks} rank{'s' if ranks > 1 else ''} {seconds:.1f} s, peak RSS {max(peaks):.0f} MB"
            for ranks, (seconds, peaks) in idle.items()))
        print("| command | ranks | time (s) | speed-up | work = time - start-up (s) | speed-up of the work "
              "| disk-bound time (s) | work / disk-bound | peak RSS per rank (MB) | of it anonymous (MB) "
              "| byte-identical to 1 process |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
        for op, ranks, seconds, speed, work, work_speed, bound, ratio, peaks, anon, same, shards, written in rows:
            print(f"| {op} ({shards} shards, {written / 1e9:.2f} GB out) | {ranks} | {seconds:.1f} | {speed:.2f}x "
                  f"| {work:.1f} | {work_speed:.2f}x | {bound:.1f} | {ratio:.2f}x | "
                  f"{', '.join(f'{p:.0f}' for p in peaks)} | {', '.join(f'{a:.0f}' for a in anon)} "
                  f"| {'yes' if same else 'NO'} |")
        if not all(row[10] for row in rows):
            raise SystemExit("outputs differ from one process's")
    finally:
        if not args.keep:
            shutil.rmtree(DATA, ignore_errors=True)


if __name__ == "__main__":
    main()
