"""Checkpoint surgery benchmarks (issue 4): time and peak memory of CheckpointEditor saves on BERT-base + Adam.

Each operation runs in its own Python process; its time excludes interpreter start and
imports, and its peak memory is the process's VmHWM minus its VmRSS just before the
operation (after imports). The machine is shared and noisy, so every round runs an
operation next to its ``cp`` baselines (order alternating between rounds) and the
result is the median over rounds of the paired ratio ours / cp. ``cp`` + fsync copies
a file holding exactly the bytes the operation writes (``sync FILE`` is the fsync, as
our saves fsync their output). Warm page cache throughout.

    python benchmarks/make_bert_checkpoint.py           # ~1.3 GB into benchmarks/data/
    python benchmarks/bench_edit.py [--data DIR] [--repeat N] [--skip-naive] [--only TEXT] [--code DIR]
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One operation in a fresh process: seconds and peak memory above the RSS before it (bench_scale uses it too).
DRIVER = """
import json, os, sys, time
sys.path.insert(0, {code!r})
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

{setup}
try:  # reset VmHWM to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
base = status("VmRSS:")
start = time.perf_counter()
{body}
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "peak": status("VmHWM:") - base}}))
"""

EDITOR = "import numpy as np\nfrom restorekit.edit import CheckpointEditor\nsrc, out = sys.argv[1], sys.argv[2]"

CP_DATA, CP_DATA_SYNC, CP_KEPT_SYNC = "cp data file", "cp data file + fsync", "cp kept bytes + fsync"

# name -> (setup, body, baselines the operation is paired with)
OPERATIONS = {
    "rename every variable, check_kept=False (index only)": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.rename_all(lambda n: 'renamed/' + n)\ned.save(out, check_kept=False)",
        (CP_DATA_SYNC,),
    ),
    "rename every variable (hard links)": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.rename_all(lambda n: 'renamed/' + n)\ned.save(out)",
        (CP_DATA_SYNC,),
    ),
    "strip optimizer slots (index only)": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.strip_optimizer_slots()\ned.save(out)",
        (),
    ),
    "strip optimizer slots, compact=True": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.strip_optimizer_slots()\ned.save(out, compact=True)",
        (CP_KEPT_SYNC,),
    ),
    "set one tensor (94 MB; links + 1 new shard)": (
        EDITOR + "\nvalue = np.zeros((30522, 768), np.float32)",
        "ed = CheckpointEditor(src)\ned.set('bert/embeddings/word_embeddings', value)\ned.save(out)",
        (CP_DATA_SYNC,),
    ),
    "set one tensor (94 MB), compact=True": (
        EDITOR + "\nvalue = np.zeros((30522, 768), np.float32)",
        "ed = CheckpointEditor(src)\ned.set('bert/embeddings/word_embeddings', value)\ned.save(out, compact=True)",
        (CP_DATA_SYNC,),
    ),
    "cast all floats to bfloat16 (streamed), compact=True": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.cast('.*', 'bfloat16')\ned.save(out, compact=True)",
        (CP_DATA_SYNC,),
    ),
    "concat two 94 MB tensors along axis 0 (links + 1 new shard)": (
        EDITOR,
        "ed = CheckpointEditor(src)\n"
        "ed.concat(['bert/embeddings/word_embeddings'] * 2, 0, 'bert/embeddings/doubled')\ned.save(out)",
        (CP_DATA_SYNC,),
    ),
    "export to safetensors": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.save(out + '.safetensors', format='safetensors')",
        (CP_DATA, CP_DATA_SYNC),
    ),
    "strip optimizer slots + export to safetensors": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.strip_optimizer_slots()\n"
        "ed.save(out + '.safetensors', format='safetensors')",
        (CP_KEPT_SYNC,),
    ),
    "rename every variable + export to safetensors": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.rename_all(lambda n: 'renamed/' + n)\n"
        "ed.save(out + '.safetensors', format='safetensors')",
        (CP_DATA, CP_DATA_SYNC),
    ),
}

NAIVE = (
    "import numpy as np\nimport tensorflow as tf\ntf1 = tf.compat.v1\nsrc, out = sys.argv[1], sys.argv[2]",
    """reader = tf.train.load_checkpoint(src)
values = {n: reader.get_tensor(n) for n in sorted(reader.get_variable_to_shape_map())}
with tf.Graph().as_default():
    variables = {n: tf1.get_variable('renamed/' + n, shape=v.shape, dtype=tf.as_dtype(v.dtype),
                                     initializer=tf1.zeros_initializer()) for n, v in values.items()}
    saver = tf1.train.Saver(list(variables.values()))
    with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for n, v in variables.items():
            v.load(values[n], sess)
        saver.save(sess, out, write_meta_graph=False)""",
    (),
)


def run(setup: str, body: str, src: str, out: str, code_dir: str = REPO) -> dict:
    code = DRIVER.format(code=code_dir, setup=setup, body=body)
    proc = subprocess.run([sys.executable, "-c", code, src, out], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def timed_cp(src: str, dst: str, *, fsync: bool) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", src, dst], check=True)
    if fsync:
        subprocess.run(["sync", dst], check=True)
    seconds = time.perf_counter() - start
    os.remove(dst)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "benchmarks", "data"))
    parser.add_argument("--repeat", type=int, default=5, help="paired rounds per operation (median)")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--only", help="run only operations whose name contains this")
    parser.add_argument("--code", default=REPO, help="restorekit checkout to time (e.g. an older one, for before/after)")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from restorekit._checkpoint import Checkpoint
    from restorekit._names import optimizer_slot_kind

    src = os.path.join(args.data, "bert_model.ckpt")
    ckpt = Checkpoint(src)
    data = ckpt.data_file(0)
    kept = [ckpt.bundle_entry(n) for n in ckpt if not optimizer_slot_kind(n)]
    work = tempfile.mkdtemp(prefix="bench-", dir=args.data)
    results = {}
    try:
        # Exactly the bytes compaction writes (the kept tensors, in order), made once.
        kept_file = os.path.join(work, "kept.bin")
        with open(data, "rb") as f, open(kept_file, "wb") as g:
            for entry in kept:
                f.seek(entry.offset)
                g.write(f.read(entry.size))
        copy = os.path.join(work, "c")
        baselines = {
            CP_DATA: lambda: timed_cp(data, copy, fsync=False),
            CP_DATA_SYNC: lambda: timed_cp(data, copy, fsync=True),
            CP_KEPT_SYNC: lambda: timed_cp(kept_file, copy, fsync=True),
        }
        cp_times = {name: [] for name in baselines}
        operations = dict(OPERATIONS)
        if not args.skip_naive:
            operations["naive rename: numpy -> tf.Variables -> Saver.save"] = NAIVE
        for name, (setup, body, paired) in operations.items():
            if args.only and args.only not in name:
                continue
            runs, ratios = [], {b: [] for b in paired}
            repeat = 1 if name.startswith("naive") else args.repeat
            for round_ in range(repeat):
                out_dir = os.path.join(work, "out")
                steps = [*paired, name] if round_ % 2 == 0 else [name, *paired]
                timed = {}
                for step in steps:
                    if step == name:
                        run_ = run(setup, body, src, os.path.join(out_dir, "model.ckpt"), args.code)
                        shutil.rmtree(out_dir, ignore_errors=True)
                        runs.append(run_)
                        timed[step] = run_["seconds"]
                    else:
                        timed[step] = baselines[step]()
                        cp_times[step].append(timed[step])
                for b in paired:
                    ratios[b].append(timed[name] / timed[b])
            results[name] = {
                "seconds": statistics.median(r["seconds"] for r in runs),
                "peak": max(r["peak"] for r in runs),
                "ratios": {b: statistics.median(r) for b, r in ratios.items()},
                "ratio_rounds": {b: [round(x, 2) for x in r] for b, r in ratios.items()},
            }
            shown = "  ".join(f"{r:5.2f}x {b}" for b, r in results[name]["ratios"].items())
            print(f"{name:55s} {results[name]['seconds']:8.3f} s  peak +{results[name]['peak'] / 2**20:7.1f} MiB  {shown}",
                  flush=True)
        for name, times in cp_times.items():
            if times:
                results[name] = {"seconds": statistics.median(times), "runs": len(times)}
                print(f"{name:55s} {results[name]['seconds']:8.3f} s  (median of {len(times)})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {"data_bytes": os.path.getsize(data), "kept_bytes": sum(e.size for e in kept), "results": results}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
