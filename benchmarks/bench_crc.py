"""Checking kept bytes (issue 22): a checked rename against one two-thread crc32c pass over the same bytes.

    python benchmarks/bench_crc.py [--data DIR] [--repeat N] [--keep]

The BERT-base + Adam checkpoint of make_bert_checkpoint.py (~1.3 GB; written into
``DIR/crc/`` when missing, after checking free space, and deleted afterwards unless
``--keep``). Every round times, in one process with the shard in the page cache:

- the reference: crc32c of every entry's bytes on two threads (``crc.file_crcs``'s
  split) over a copy of the data shard already in memory, with the fastest crc32c
  installed; and the same pass with google-crc32c, and on one thread;
- "rename every variable" + ``save`` with the default check of kept bytes (mapped under
  a read lease), with the check forced onto ``preadv`` reads (no lease), with one
  thread, and with ``check_kept=False`` (index only).

Each case runs right next to a reference pass (order alternating); results are medians,
ratios the median of those paired ratios.
Goals: checked rename <= 1.3x the reference; unchecked rename < 0.05 s. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import google_crc32c  # noqa: E402
import numpy as np  # noqa: E402

from restorekit._bundle import crc  # noqa: E402
from restorekit._bundle.table import mask_crc  # noqa: E402
from restorekit._checkpoint import Checkpoint  # noqa: E402
from restorekit.edit import CheckpointEditor  # noqa: E402


def in_memory_pass(memory: np.ndarray, ranges, extend, threads: int) -> list[int]:
    """crc32c of each range of ``memory``, cut into the pieces file_crcs cuts a file into, on ``threads`` threads."""
    items = crc.work_items(ranges)
    results = crc._run(lambda item: [extend(0, memory[o : o + n]) for _, o, n in item], items, threads)
    return crc._join(items, results, [0] * len(ranges))


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
        memory = np.fromfile(data, np.uint8)
        memory.flags.writeable = False
        kept = sum(s for _, s in ranges)
        out = os.path.join(directory, "out")
        fast = crc.extend
        cases = {
            "reference: crc32c pass, 2 threads, bytes in memory": lambda: in_memory_pass(memory, ranges, fast, 2),
            "crc32c pass, 1 thread, bytes in memory": lambda: in_memory_pass(memory, ranges, fast, 1),
            "google-crc32c pass, 2 threads, bytes in memory": lambda: in_memory_pass(
                memory, ranges, google_crc32c.extend, 2),
            "file_crcs of the shard (mapped, 2 threads)": lambda: _file_pass(data, ranges),
            "checked rename (default: mapped under a lease)": lambda: rename(prefix, out),
            "checked rename, preadv reads (no lease)": lambda: _with(_NoLease(), rename, prefix, out),
            "checked rename, 1 thread": lambda: _with(_Threads(1), rename, prefix, out),
            "unchecked rename (check_kept=False)": lambda: rename(prefix, out, check_kept=False),
        }
        reference = next(iter(cases))
        names = list(cases)
        want = [e.crc32c for e in entries]
        got = [mask_crc(v) for v in in_memory_pass(memory, ranges, fast, 2)]
        assert got == want, "the reference pass computed wrong crcs"
        # Each case is paired with a reference pass right next to it (order alternating): the machine is shared.
        times = {name: [] for name in cases}
        ratios = {name: [] for name in cases}
        for round_ in range(args.repeat + 1):
            for name in names[1:]:
                pair = [reference, name] if round_ % 2 else [name, reference]
                timed = {}
                for step in pair:
                    start = time.perf_counter()
                    cases[step]()
                    timed[step] = time.perf_counter() - start
                if round_:  # round 0 warms the page cache and the imports
                    times[name].append(timed[name])
                    times[reference].append(timed[reference])
                    ratios[name].append(timed[name] / timed[reference])
        ratios[reference] = [1.0]
        print(f"crc32c implementation: {crc.IMPLEMENTATION}; {crc.THREADS} threads; {os.cpu_count()} cores; "
              f"{kept / 1e9:.2f} GB checked; load average {os.getloadavg()[0]:.1f}")
        for name, ts in times.items():
            shown = ", ".join(f"{r:.2f}" for r in ratios[name]) if name != reference else "-"
            print(f"{name:52s} {statistics.median(ts) * 1e3:8.1f} ms  {kept / statistics.median(ts) / 1e9:5.1f} GB/s"
                  f"  {statistics.median(ratios[name]):5.2f}x reference  (paired rounds: {shown})")
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
