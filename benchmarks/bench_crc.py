"""Checking kept bytes (issue 22): a checked rename against one two-thread crc32c pass over the same bytes.

    python benchmarks/bench_crc.py [--data DIR] [--repeat N] [--keep]

The BERT-base + Adam checkpoint of make_bert_checkpoint.py (~1.3 GB; written into
``DIR/crc/`` when missing, after checking free space, and deleted afterwards unless
``--keep``). Every round times, in one process with the shard in the page cache:

- two references, neither of them restorekit code:
  - **in memory**: crc32c of every entry's bytes on two threads (cut into the pieces
    ``crc.file_crcs`` cuts) over a copy of the data shard already in this process's
    memory, with the fastest crc32c installed. No pass over a file reaches it: the file's
    bytes must first be mapped (or copied), which costs page-table work per 4 KiB page the
    page cache holds in small pages;
  - **over the file**: the shard mapped (``mmap``), its two halves crc32c'd on two threads,
    unmapped: a plain pass over the same bytes where the page cache holds them;
- the in-memory pass with google-crc32c, and on one thread;
- ``crc.file_crcs`` of the shard (what a checked save runs);
- "rename every variable" + ``save`` with the default check of kept bytes (mapped under
  a read lease), with the check forced onto ``preadv`` reads (no lease), with one
  thread, and with ``check_kept=False`` (index only).

Each case runs right next to both references (order rotating); results are medians,
ratios the median of the paired ratios. The page cache's state moves the mapped passes
(a shard in 2 MiB pages maps ~10x cheaper than one in 4 KiB pages), so the run prints
how much of the shard is in 2 MiB pages; ``--readback`` first drops the shard from the
page cache and reads it back sequentially (the state after reading it from disk).
Goals: checked rename <= 1.3x a two-thread crc32c pass; unchecked rename < 0.05 s.
Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import crc32c as crc32c_package  # noqa: E402
import google_crc32c  # noqa: E402
import numpy as np  # noqa: E402

from restorekit._bundle import crc  # noqa: E402
from restorekit._bundle.table import mask_crc  # noqa: E402
from restorekit._checkpoint import Checkpoint  # noqa: E402
from restorekit.edit import CheckpointEditor  # noqa: E402


def in_memory_pass(memory: np.ndarray, ranges, extend, threads: int) -> list[int]:
    """crc32c of each range of ``memory``, cut into the pieces file_crcs cuts a file into, on ``threads`` threads."""
    items = crc.work_items(ranges)

    def work(item):
        return [extend(0, memory[o : o + n]) for _, o, n in item]

    results = crc._Workers(work, items, threads).join() if threads > 1 else [work(item) for item in items]
    return crc._join(items, results, [0] * len(ranges))


def file_pass(path: str) -> list[int]:
    """The plain pass over the file: mapped, each half crc32c'd on a thread of its own, unmapped."""
    size = os.path.getsize(path)
    half = size // 2 // mmap.PAGESIZE * mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            with ThreadPoolExecutor(2) as pool:
                return list(pool.map(lambda lo, hi: crc32c_package.crc32c(view[lo:hi]), (0, half), (half, size)))
        finally:
            view.release()


def in_2mib_pages(path: str) -> float | None:
    """The share of ``path``'s bytes the page cache holds in 2 MiB pages (Linux; None elsewhere)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
            mapped.madvise(22, 0, size)  # MADV_POPULATE_READ: map every page the page cache holds
            address = np.frombuffer(mapped, np.uint8).ctypes.data
            lines = open("/proc/self/smaps").read().splitlines()
            for k, line in enumerate(lines):
                if line.startswith(f"{address:x}-"):
                    for field in lines[k + 1 :]:
                        if field.startswith("FilePmdMapped:"):
                            return int(field.split()[1]) * 1024 / size
    except (OSError, AttributeError, ValueError):
        return None
    return None


def read_back(path: str) -> None:
    """Drop ``path`` from the page cache and read it back sequentially (as a first read from disk does)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while os.read(fd, 8 << 20):
            pass
    finally:
        os.close(fd)


def rename(src: str, out_dir: str, **save) -> None:
    editor = CheckpointEditor(src)
    editor.rename_all(lambda n: "renamed/" + n)
    editor.save(os.path.join(out_dir, "model.ckpt"), **save)
    shutil.rmtree(out_dir)


class _NoLease:
    """Force file_crcs onto its preadv path (as for a file another process holds open for writing)."""

    def __enter__(self):
        self.saved, crc._LINUX = crc._LINUX, False

    def __exit__(self, *exc):
        crc._LINUX = self.saved


class _Threads:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.saved, crc.THREADS = crc.THREADS, self.n

    def __exit__(self, *exc):
        crc.THREADS = self.saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(HERE, "data"))
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--readback", action="store_true", help="drop the shard from the page cache and read it back first")
    args = parser.parse_args(argv)
    import make_bert_checkpoint

    directory = os.path.join(args.data, "crc")
    prefix = os.path.join(directory, "bert_model.ckpt")
    made = not os.path.exists(prefix + ".index")
    if made:
        os.makedirs(directory, exist_ok=True)
        free = shutil.disk_usage(directory).free
        if free < 4 * 2**30:  # the 1.3 GB checkpoint, 1.3 GB of it in memory, room left for others
            print(f"need 4 GiB free in {directory}, have {free / 2**30:.1f} GiB", file=sys.stderr)
            return 2
        prefix = make_bert_checkpoint.write(directory)
    try:
        ckpt = Checkpoint(prefix)
        entries = [ckpt.bundle_entry(n) for n in ckpt]
        ranges = [(e.offset, e.size) for e in entries]
        data = ckpt.data_file(0)
        if args.readback:
            read_back(data)
        memory = np.fromfile(data, np.uint8)
        memory.flags.writeable = False
        kept = sum(s for _, s in ranges)
        out = os.path.join(directory, "out")
        fast = crc.extend
        in_memory, over_file = "reference: crc32c pass, 2 threads, bytes in memory", \
            "reference: crc32c pass, 2 threads, file mapped"
        cases = {
            in_memory: lambda: in_memory_pass(memory, ranges, fast, 2),
            over_file: lambda: file_pass(data),
            "crc32c pass, 1 thread, bytes in memory": lambda: in_memory_pass(memory, ranges, fast, 1),
            "google-crc32c pass, 2 threads, bytes in memory": lambda: in_memory_pass(
                memory, ranges, google_crc32c.extend, 2),
            "file_crcs of the shard (mapped, 2 threads)": lambda: _file_pass(data, ranges),
            "checked rename (default: mapped under a lease)": lambda: rename(prefix, out),
            "checked rename, preadv reads (no lease)": lambda: _with(_NoLease(), rename, prefix, out),
            "checked rename, 1 thread": lambda: _with(_Threads(1), rename, prefix, out),
            "unchecked rename (check_kept=False)": lambda: rename(prefix, out, check_kept=False),
        }
        references = [in_memory, over_file]
        names = [name for name in cases if name not in references]
        want = [e.crc32c for e in entries]
        got = [mask_crc(v) for v in in_memory_pass(memory, ranges, fast, 2)]
        assert got == want, "the reference pass computed wrong crcs"
        whole = crc32c_package.crc32c(memory)
        halves = file_pass(data)
        assert crc.combine(halves[0], halves[1], len(memory) - len(memory) // 2 // mmap.PAGESIZE * mmap.PAGESIZE) \
            == whole, "the pass over the file computed wrong crcs"
        share = in_2mib_pages(data)
        # Each case is paired with both references right next to it (order rotating): the machine is shared.
        times: dict[str, list[float]] = {name: [] for name in cases}
        ratios: dict[str, dict[str, list[float]]] = {ref: {name: [] for name in cases} for ref in references}
        for round_ in range(args.repeat + 1):
            for name in names:
                steps = [name, *references]
                steps = steps[round_ % 3:] + steps[: round_ % 3]
                timed = {}
                for step in steps:
                    start = time.perf_counter()
                    cases[step]()
                    timed[step] = time.perf_counter() - start
                if round_:  # round 0 warms the page cache and the imports
                    for step in steps:
                        times[step].append(timed[step])
                    for ref in references:
                        for step in steps:
                            if step != ref:
                                ratios[ref][step].append(timed[step] / timed[ref])
        pages = "unknown" if share is None else f"{share:.0%}"
        print(f"crc32c implementation: {crc.IMPLEMENTATION}; {crc.THREADS} threads; {os.cpu_count()} cores; "
              f"{kept / 1e9:.2f} GB checked; shard in 2 MiB pages: {pages}"
              f"{' (read back from disk first)' if args.readback else ''}; load average {os.getloadavg()[0]:.1f}")
        print(f"{'':52s} {'median':>8s}  {'GB/s':>5s}  {'/ in memory':>11s}  {'/ over file':>11s}")
        for name, ts in times.items():
            shown = [f"{statistics.median(ratios[ref][name]):10.2f}x" if ratios[ref][name] else f"{'1':>10s}x"
                     for ref in references]
            print(f"{name:52s} {statistics.median(ts) * 1e3:5.1f} ms  {kept / statistics.median(ts) / 1e9:5.1f}  "
                  f"{shown[0]:>11s}  {shown[1]:>11s}")
    finally:
        if made and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


def _file_pass(path: str, ranges) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        crc.file_crcs(fd, ranges, path=path)
    finally:
        os.close(fd)


def _with(context, fn, *args):
    with context:
        return fn(*args)


if __name__ == "__main__":
    sys.exit(main())
