"""Off TensorFlow (issue 24): scan + restore of a BERT-base TF1 checkpoint into Keras 3 on JAX and into torch.

    python benchmarks/bench_backends.py [--data DIR] [--layers N] [--repeats N] [--keep]

A BERT-base-sized TF1 checkpoint with Adam slots (``make_bert_checkpoint.py``, 1.32 GB) is
restored, each measurement in a fresh process with TensorFlow never imported:

  keras-jax  (a) ``model.load_weights('m.weights.h5')`` of the same 206 weights  vs
             (b) ``restorekit.scan(ckpt, model, assignment_map=...)`` + ``restorekit.restore``.  Goal (b)/(a) <= 1.2.
  torch      (c) ``model.load_state_dict(safetensors.torch.load_file('model.safetensors'))``  vs
             (d) ``restorekit.scan(ckpt, BertForPreTraining(config), rules='bert-tf-to-hf')`` + restore.  Goal <= 1.2.
             (c') the same as (c) from ``tf_axes.safetensors``: the tensors in TF's axes, the 74 Dense kernels
             passed as transposed views (``t.T``), so load_state_dict's ``copy_`` transposes them as (d) must.
             (c) loads kernels already transposed when the file was written; (c') is the same work as (d)
             without reading through restorekit and without the crc32c checks.

The Keras model holds the 206 weights under their checkpoint names (``/`` as ``__``), so the
two sides assign the same tensors; the torch model is transformers' BertForPreTraining,
the safetensors file its weights as ``convert(..., rules='bert-tf-to-hf')`` writes them.
Every side builds its model first, untimed, in a fresh process (parameters allocated and
initialized); the files are in the page cache (written by the same run, or --keep'd in /dev/shm).
Each process reports its wall time and its peak RSS above the RSS with the model built (the
peak is reset after the build, which itself peaks higher); the cases alternate, --repeats
times (default 3), and medians are reported, with each round's ratio. Values are checked equal
after (b) and (d). Data goes to --data (default benchmarks/data/), deleted unless --keep (a
later run with the same --data reuses the kept files).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import make_bert_checkpoint  # noqa: E402

BLOCKER = os.path.join(ROOT, "tests", "blockers", "no_tensorflow")
CASES = ("jax-keras", "jax-restorekit", "torch-load_state_dict", "torch-load_state_dict-tf-axes", "torch-restorekit")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    # Building the model (transformers' init) peaks above the built model's RSS: start the peak from here.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux: the peak since the process started
        pass


def _peak() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _weights(prefix: str) -> dict:
    from restorekit import Checkpoint

    ckpt = Checkpoint(prefix)
    return {n: e.shape for n, e in ckpt.entries.items() if "adam_" not in n and n != "global_step"}


def _keras_model(shapes: dict):
    import keras

    class Holder(keras.Model):
        def __init__(self):
            super().__init__(name="holder")
            self.held = [self.add_weight(shape=s, name=n.replace("/", "__"), initializer="zeros") for n, s in shapes.items()]

        def call(self, x):
            return x

    model = Holder()
    model.built = True  # its weights exist from __init__; save_weights/load_weights refuse an unbuilt model
    return model


def _torch_model(layers: int):
    import transformers

    config = transformers.BertConfig(num_hidden_layers=layers)
    return transformers.BertForPreTraining(config).eval()


def child(case: str, data: str, layers: int) -> None:
    prefix = os.path.join(data, "bert_model.ckpt")
    import restorekit

    shapes = _weights(prefix)
    if case.startswith("jax"):
        model = _keras_model(shapes)
        base = _rss()
        _reset_peak()
        start = time.perf_counter()
        if case == "jax-keras":
            model.load_weights(os.path.join(data, "m.weights.h5"))
        else:
            names = {v.path: v.path.split("/", 1)[1].replace("__", "/") for v in model.variables}
            report = restorekit.scan(prefix, model, assignment_map=names.get)
            restorekit.restore(report)
        seconds = time.perf_counter() - start
        peak = _peak()
        ckpt = restorekit.Checkpoint(prefix)
        ok = all(np.array_equal(v.numpy(), ckpt.read(v.path.split("/", 1)[1].replace("__", "/"))) for v in model.variables[:20])
        size = sum(int(np.prod(s)) * 4 for s in shapes.values())
    else:
        import torch
        from safetensors.torch import load_file

        model = _torch_model(layers)
        with open(os.path.join(data, "transposed.json")) as f:
            transposed = set(json.load(f))
        base = _rss()
        _reset_peak()
        start = time.perf_counter()
        if case == "torch-load_state_dict":
            model.load_state_dict(load_file(os.path.join(data, "model.safetensors")), strict=False)
        elif case == "torch-load_state_dict-tf-axes":
            tensors = load_file(os.path.join(data, "tf_axes.safetensors"))
            model.load_state_dict({k: t.T if k in transposed else t for k, t in tensors.items()}, strict=False)
        else:
            restorekit.restore(restorekit.scan(prefix, model, rules="bert-tf-to-hf"))
        seconds = time.perf_counter() - start
        peak = _peak()
        ckpt = restorekit.Checkpoint(prefix)
        ok = bool(torch.equal(model.bert.encoder.layer[0].attention.self.query.weight,
                              torch.from_numpy(ckpt.read("bert/encoder/layer_0/attention/self/query/kernel").T.copy())))
        unique = {p.data_ptr(): p for p in model.state_dict().values()}  # tied weights once
        size = sum(p.numel() * p.element_size() for p in unique.values())
    print("RESULT " + json.dumps({"case": case, "seconds": seconds, "peak_above_model": peak - base,
                                  "model_bytes": size, "values_equal": ok,
                                  "tensorflow_imported": "tensorflow" in sys.modules}))


def _run(case: str, data: str, layers: int) -> dict:
    backend = "jax" if case.startswith("jax") else "torch"
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": os.pathsep.join([BLOCKER, ROOT]),
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__, "--child", case, "--data", data, "--layers", str(layers)],
                          env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{case} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def prepare(data: str, layers: int) -> None:
    """The checkpoint, and the same weights as a .weights.h5 (Keras on jax) and a safetensors file (torch)."""
    make_bert_checkpoint.LAYERS = layers
    made = [os.path.join(data, f) for f in ("bert_model.ckpt.index", "model.safetensors", "tf_axes.safetensors",
                                            "transposed.json", "m.weights.h5")]
    if all(os.path.exists(f) for f in made):  # kept by an earlier --keep run
        print(f"reusing the files in {data}")
        return
    prefix = make_bert_checkpoint.write(data)
    import restorekit

    restorekit.convert(prefix, os.path.join(data, "model.safetensors"), rules="bert-tf-to-hf", weights_only=True)
    # The same tensors under the torch names but in TF's axes: what load_state_dict gets if it is to transpose
    # the Dense kernels as restorekit must (the reference without restorekit's reading and checks).
    from safetensors.numpy import save_file

    from restorekit.export._hf import rule_set
    from restorekit._torch_target import RuleSetSource

    view = RuleSetSource(restorekit.Checkpoint(prefix), rule_set("bert-tf-to-hf"))
    tf_axes, transposed = {}, []
    for source, name in view.plan.names.items():
        if view.plan.transforms.get(source) == "transpose":
            tf_axes[name] = view.checkpoint.read(source)
            transposed.append(name)
        else:
            tf_axes[name] = view.plan.apply(source, view.checkpoint.read(source))
    save_file(tf_axes, os.path.join(data, "tf_axes.safetensors"))
    with open(os.path.join(data, "transposed.json"), "w") as f:
        json.dump(transposed, f)
    script = (
        "import sys; sys.path[:0] = [%r, %r]\n"
        "import bench_backends as b, restorekit\n"
        "m = b._keras_model(b._weights(%r))\n"
        "ck = restorekit.Checkpoint(%r)\n"
        "[v.assign(ck.read(v.path.split('/', 1)[1].replace('__', '/'))) for v in m.variables]\n"
        "m.save_weights(%r)\n"
    ) % (HERE, ROOT, prefix, prefix, os.path.join(data, "m.weights.h5"))
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": os.pathsep.join([BLOCKER, ROOT]), "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(HERE, "data", "backends"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--child")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.data, args.layers)
        return 0
    try:
        prepare(args.data, args.layers)
        runs: dict = {}
        for _ in range(args.repeats):
            for c in CASES:
                runs.setdefault(c, []).append(_run(c, args.data, args.layers))
        results = {c: {**r[0], "seconds": statistics.median(x["seconds"] for x in r),
                       "peak_above_model": statistics.median(x["peak_above_model"] for x in r),
                       "values_equal": all(x["values_equal"] for x in r),
                       "tensorflow_imported": any(x["tensorflow_imported"] for x in r)} for c, r in runs.items()}
    finally:
        if not args.keep:
            shutil.rmtree(args.data, ignore_errors=True)
    for case, r in results.items():
        print(f"{case:30s} {r['seconds']:7.2f} s   peak above model {r['peak_above_model'] / 2**20:8.1f} MiB "
              f"(model {r['model_bytes'] / 2**20:.0f} MiB)   values equal: {r['values_equal']}   "
              f"tensorflow imported: {r['tensorflow_imported']}")
    for ours, theirs in (("jax-restorekit", "jax-keras"), ("torch-restorekit", "torch-load_state_dict"),
                         ("torch-restorekit", "torch-load_state_dict-tf-axes")):
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(runs[ours], runs[theirs])]
        print(f"{ours} / {theirs}: {results[ours]['seconds'] / results[theirs]['seconds']:.2f} (ratio of medians), "
              f"{statistics.median(ratios):.2f} (median of the rounds' ratios: {', '.join(f'{r:.2f}' for r in ratios)})"
              + ("" if theirs.endswith("tf-axes") else " (goal <= 1.2)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
