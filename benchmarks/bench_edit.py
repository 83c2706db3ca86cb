"""Checkpoint surgery benchmarks (issue 4): time and peak memory of CheckpointEditor saves on BERT-base + Adam.

Each operation runs in its own Python process; its time excludes interpreter start and
imports, and its peak memory is the process's VmHWM minus its VmRSS just before the
operation (after imports). ``cp`` baselines run side by side in the same session.

    python benchmarks/make_bert_checkpoint.py           # ~1.3 GB into benchmarks/data/
    python benchmarks/bench_edit.py [--data DIR] [--skip-naive]
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

_DRIVER = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
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

OPERATIONS = {
    "rename every variable (hard links)": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.rename_all(lambda n: 'renamed/' + n)\ned.save(out)",
    ),
    "strip optimizer slots (index only)": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.strip_optimizer_slots()\ned.save(out)",
    ),
    "strip optimizer slots, compact=True": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.strip_optimizer_slots()\ned.save(out, compact=True)",
    ),
    "set one tensor (94 MB; links + 1 new shard)": (
        EDITOR + "\nvalue = np.zeros((30522, 768), np.float32)",
        "ed = CheckpointEditor(src)\ned.set('bert/embeddings/word_embeddings', value)\ned.save(out)",
    ),
    "set one tensor (94 MB), compact=True": (
        EDITOR + "\nvalue = np.zeros((30522, 768), np.float32)",
        "ed = CheckpointEditor(src)\ned.set('bert/embeddings/word_embeddings', value)\ned.save(out, compact=True)",
    ),
    "cast all floats to bfloat16 (streamed), compact=True": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.cast('.*', 'bfloat16')\ned.save(out, compact=True)",
    ),
    "export to safetensors": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.save(out + '.safetensors', format='safetensors')",
    ),
    "rename every variable + export to safetensors": (
        EDITOR,
        "ed = CheckpointEditor(src)\ned.rename_all(lambda n: 'renamed/' + n)\n"
        "ed.save(out + '.safetensors', format='safetensors')",
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
)


def run(setup: str, body: str, src: str, out: str) -> dict:
    code = _DRIVER.format(repo=REPO, setup=setup, body=body)
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
    parser.add_argument("--repeat", type=int, default=3, help="runs per fast operation (median)")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--only", help="run only operations whose name contains this")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from restorekit.checkpoint import Checkpoint
    from restorekit.names import optimizer_slot_kind

    src = os.path.join(args.data, "bert_model.ckpt")
    ckpt = Checkpoint(src)
    data = ckpt.data_file(0)
    kept = sum(e.nbytes for n, e in ckpt.entries.items() if not optimizer_slot_kind(n))
    work = tempfile.mkdtemp(prefix="bench-", dir=args.data)
    results = {}
    try:
        kept_file = os.path.join(work, "kept.bin")
        with open(data, "rb") as f, open(kept_file, "wb") as g:
            g.write(f.read(kept))
        cp = {
            "cp data file": statistics.median(timed_cp(data, os.path.join(work, "c"), fsync=False) for _ in range(args.repeat)),
            "cp data file + fsync": statistics.median(timed_cp(data, os.path.join(work, "c"), fsync=True) for _ in range(args.repeat)),
            "cp kept bytes + fsync": statistics.median(timed_cp(kept_file, os.path.join(work, "c"), fsync=True) for _ in range(args.repeat)),
        }
        os.remove(kept_file)
        for name, seconds in cp.items():
            results[name] = {"seconds": seconds, "peak": None}
            print(f"{name:55s} {seconds:8.3f} s", flush=True)
        operations = dict(OPERATIONS)
        if not args.skip_naive:
            operations["naive rename: numpy -> tf.Variables -> Saver.save"] = NAIVE
        for name, (setup, body) in operations.items():
            if args.only and args.only not in name:
                continue
            runs = []
            repeat = 1 if name.startswith("naive") else args.repeat
            for _ in range(repeat):
                out_dir = os.path.join(work, "out")
                runs.append(run(setup, body, src, os.path.join(out_dir, "model.ckpt")))
                shutil.rmtree(out_dir, ignore_errors=True)
            results[name] = {"seconds": statistics.median(r["seconds"] for r in runs),
                             "peak": max(r["peak"] for r in runs)}
            print(f"{name:55s} {results[name]['seconds']:8.3f} s  peak +{results[name]['peak'] / 2**20:7.1f} MiB",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"data_bytes": os.path.getsize(data), "kept_bytes": kept, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
