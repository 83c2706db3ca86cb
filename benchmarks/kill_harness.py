"""kill -9 harness: every restorekit writer, SIGKILLed at each crash point and at random times (issue 11).

    python benchmarks/kill_harness.py [--width N] [--random K] [--only WRITER] [--signal INT] [--keep]

Each writer runs in a child process (``python -c``, importing TensorFlow only where the
writer needs it). The child is killed either where ``crashpoints.crash_point`` pauses it
(``$RESTOREKIT_CRASH_HOOK``) or after a random delay once it has started writing.
Then, for every kill:

1. the source is byte-identical (sha256); for ``save_in_place`` the checkpoint at the
   prefix verifies and holds either the old or the new values, never a mix;
2. the output is absent or complete: a checkpoint that verifies (crc of every tensor)
   with the expected values, or a single file that its own library loads fully with the
   expected values (for an overwrite: absent, the old output, or the new one);
3. a ``checkpoint`` state file, where one is written, parses and names a complete checkpoint;
4. after the next restorekit write into each directory involved, nothing is left: no
   ``.restorekit-tmp-*``, no lock file, no visible shard (or ``.meta``) that no index names.

``tests/test_kill.py`` runs a fixed subset of the same cases in CI; this script sweeps
every crash point each writer reaches (found by a traced run) plus K random kills per
writer, on bigger tensors, and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

HOOK = "RESTOREKIT_CRASH_HOOK"
TRACE = "KILL_HARNESS_TRACE"
CHILD_TIMEOUT = 180.0

# ---------------------------------------------------------------- the children

# Run before each writer's body: reads its arguments; in a traced run, records every
# crash point reached instead of pausing (to list the points a writer has).
_PROLOGUE = """
import json, os, signal, sys
# Ctrl-C as a terminal delivers it: a KeyboardInterrupt. A child of a background job inherits SIGINT ignored
# (and Python then installs no handler), which would make the SIGINT cases test nothing.
signal.signal(signal.SIGINT, signal.default_int_handler)
args = json.loads(sys.argv[1])
if os.environ.get("KILL_HARNESS_TRACE"):
    import atexit
    from restorekit._bundle import crashpoints
    _seen = []
    crashpoints.crash_point = _seen.append
    atexit.register(lambda: open(os.environ["KILL_HARNESS_TRACE"], "w").write("\\n".join(_seen)))


def ready():
    # The writing starts now: a random-time kill counts its delay from here.
    sys.stdout.write("ready\\n")
    sys.stdout.flush()

"""

_EDITOR = """
import numpy as np
from restorekit.edit import CheckpointEditor
ed = CheckpointEditor(args["src"])
"""


@dataclasses.dataclass(frozen=True)
class Writer:
    """One writing command: the child's code, what it writes and what the output must hold.

    ``expect(sources)`` gives the output's values; ``old(sources)`` the values an
    overwritten output (or an in-place source) held before. ``output`` is ``'tf'`` (a
    checkpoint prefix), ``'in-place'``, a file format (``'safetensors'``, ``'npz'``, ``'torch'``,
    ``'keras'`` for a ``.weights.h5``), or ``'hf'`` (Hugging Face shards + index, and a
    ``config.json`` where ``config(sources)`` gives one).
    """

    name: str
    body: str
    output: str
    source: str  # which prepared source the child reads: 'ckpt', 'safetensors', 'many', 'frozen'
    expect: Callable
    out: str = "out/model.ckpt"  # relative to the case directory
    old: Callable | None = None
    state_file: bool = False
    needs: str = ""  # 'torch' or 'tensorflow' when the child imports it
    config: Callable | None = None


def _edited(values: dict, **changes) -> dict:
    result = dict(values)
    for name in changes.pop("drop", ()):
        del result[name]
    for old, new in changes.pop("renames", {}).items():
        result[new] = result.pop(old)
    result.update(changes.pop("sets", {}))
    return result


BIAS = "layer0/bias"
FIVES = "np.full(args['width'], 5, np.float32)"


def _fives(s) -> dict:
    return {BIAS: np.full(s.width, 5, np.float32)}


def _keras_fives(s) -> dict:
    return {"layers/dense_1/vars/1": np.full(s.width, 5, np.float32)}


def _cast(values: dict) -> dict:
    import ml_dtypes

    return {n: (v.astype(ml_dtypes.bfloat16) if re.match(r"layer\d/kernel(/|$)", n) else v) for n, v in values.items()}


def _renamed_all(values: dict) -> dict:
    return {re.sub(r"^layer", "block", n): v for n, v in values.items()}


WRITERS = [
    Writer("save-linked", _EDITOR + f"ed.set({BIAS!r}, {FIVES})\nready()\ned.save(args['out'])\n",
           "tf", "ckpt", lambda s: _edited(s.values, sets=_fives(s))),
    Writer("save-compact",
           _EDITOR + f"ed.set({BIAS!r}, {FIVES})\ned.rename('layer1/kernel', 'head/kernel')\n"
           "ready()\ned.save(args['out'], compact=True)\n",
           "tf", "ckpt", lambda s: _edited(s.values, sets=_fives(s), renames={"layer1/kernel": "head/kernel"})),
    Writer("save-cast", _EDITOR + "ed.cast(r'layer\\d/kernel', 'bfloat16')\nready()\ned.save(args['out'])\n",
           "tf", "ckpt", lambda s: _cast(s.values)),
    Writer("save-rename-all", _EDITOR + "ed.rename_all([(r'^layer', 'block')])\nready()\ned.save(args['out'])\n",
           "tf", "ckpt", lambda s: _renamed_all(s.values)),
    Writer("save-strip-slots", _EDITOR + "ed.strip_optimizer_slots()\nready()\ned.save(args['out'])\n",
           "tf", "ckpt", lambda s: {n: v for n, v in s.values.items() if not n.endswith("/Momentum")}),
    Writer("save-overwrite",
           _EDITOR + f"ed.set({BIAS!r}, {FIVES})\nready()\ned.save(args['out'], compact=True, overwrite=True)\n",
           "tf", "ckpt", lambda s: _edited(s.values, sets=_fives(s)), old=lambda s: s.values),
    Writer("save-in-place", _EDITOR + f"ed.set({BIAS!r}, {FIVES})\nready()\ned.save_in_place()\n",
           "in-place", "ckpt", lambda s: _edited(s.values, sets=_fives(s)), out="src/model.ckpt",
           old=lambda s: s.values),
    Writer("save-in-place-compact",
           _EDITOR + f"ed.set({BIAS!r}, {FIVES})\ned.delete('global_step')\nready()\ned.save_in_place(compact=True)\n",
           "in-place", "ckpt", lambda s: _edited(s.values, sets=_fives(s), drop=["global_step"]),
           out="src/model.ckpt", old=lambda s: s.values),
    Writer("save-state-file",
           _EDITOR + f"ed.set({BIAS!r}, {FIVES})\nready()\ned.save(args['out'], update_state_file=True)\n",
           "tf", "ckpt", lambda s: _edited(s.values, sets=_fives(s)), out="src/model.ckpt-2", state_file=True),
    Writer("save-as-safetensors",
           _EDITOR + f"ed.set({BIAS!r}, {FIVES})\nready()\ned.save(args['out'], format='safetensors')\n",
           "safetensors", "ckpt", lambda s: _edited(s.values, sets=_fives(s)), out="out/model.safetensors"),
    Writer("convert-safetensors", "import restorekit\nready()\nrestorekit.convert(args['src'], args['out'])\n",
           "safetensors", "ckpt", lambda s: s.values, out="out/model.safetensors"),
    Writer("convert-npz", "import restorekit\nready()\nrestorekit.convert(args['src'], args['out'])\n",
           "npz", "ckpt", lambda s: s.values, out="out/model.npz"),
    Writer("convert-torch", "import restorekit, torch\nready()\nrestorekit.convert(args['src'], args['out'])\n",
           "torch", "ckpt", lambda s: s.values, out="out/model.pt", needs="torch"),
    Writer("convert-hf-shards",
           "import restorekit\nready()\nrestorekit.convert(args['src'], args['out'], max_shard_size=600)\n",
           "hf", "ckpt", lambda s: s.values, out="out/shards/model.safetensors"),
    Writer("convert-hf-rules",
           "import restorekit\nready()\nrestorekit.convert(args['src'], args['out'], rules='gpt2-tf-to-hf', "
           "max_shard_size=1500, config={'n_head': 2})\n",
           "hf", "gpt2", lambda s: s.hf_values, out="out/hf/model.safetensors", config=lambda s: s.hf_config),
    Writer("convert-hf-overwrite",
           "import restorekit\nready()\nrestorekit.convert(args['src'], args['out'], rules='gpt2-tf-to-hf', "
           "max_shard_size=1500, config={'n_head': 2}, overwrite=True)\n",
           "hf", "gpt2", lambda s: s.hf_values, out="out/hf/model.safetensors", config=lambda s: s.hf_config,
           old=lambda s: s.values),
    Writer("convert-weights-h5", "import restorekit\nready()\nrestorekit.convert(args['src'], args['out'])\n",
           "keras", "keras", lambda s: s.keras_values, out="out/model.weights.h5"),
    # A Keras 3 sharded set edited in place: new shards take the old names (Keras opens NAME_00000 first),
    # so the old set is re-published under free names before they land; old or new whole at every point.
    Writer("keras-sharded-in-place",
           _EDITOR + "ed.set('layers/dense_1/vars/1', np.full(args['width'], 5, np.float32))\nready()\n"
           "ed.save_in_place()\n",
           "keras-in-place", "keras-sharded", lambda s: _edited(s.keras_values, sets=_keras_fives(s)),
           out="src/model.weights.json", old=lambda s: s.keras_values),
    Writer("import-safetensors",
           "import restorekit\nready()\nrestorekit.import_checkpoint(args['src'], args['out'])\n",
           "tf", "safetensors", lambda s: s.values),
    Writer("bundle-writer",
           "import numpy as np\nfrom restorekit._bundle.writer import BundleWriter\n"
           "data = np.load(args['src'])\nready()\n"
           "with BundleWriter(args['out']) as w:\n    for name in sorted(data.files):\n        w.add(name, data[name])\n",
           "tf", "many", lambda s: s.many_values),
    Writer("unfreeze",
           "import tensorflow\nfrom restorekit.graph import unfreeze\nready()\n"
           "unfreeze(args['src'], args['out'], trainable_graph=True)\n",
           "tf", "frozen", lambda s: s.frozen_values, needs="tensorflow"),
]
BY_NAME = {w.name: w for w in WRITERS}


# ---------------------------------------------------------------- the sources


@dataclasses.dataclass(frozen=True)
class Sources:
    """What the writers read, made once: a TF-written checkpoint (two shards where TF
    has two devices), the same tensors as ``.safetensors``, many small tensors in an
    ``.npz``, and a frozen graph."""

    root: str
    width: int
    values: dict
    many_values: dict
    frozen_values: dict
    keras_values: dict
    hf_values: dict  # what an unkilled gpt2-tf-to-hf conversion writes, and its config.json
    hf_config: dict

    def path(self, source: str) -> str:
        return {
            "ckpt": os.path.join(self.root, "ckpt", "model.ckpt"),
            "gpt2": os.path.join(self.root, "gpt2", "model.ckpt"),
            "keras": os.path.join(self.root, "keras", "model.weights.h5"),
            "keras-sharded": os.path.join(self.root, "keras-sharded", "model.weights.json"),
            "safetensors": os.path.join(self.root, "safetensors", "model.safetensors"),
            "many": os.path.join(self.root, "many", "many.npz"),
            "frozen": os.path.join(self.root, "frozen", "frozen.pb"),
        }[source]


def make_sources(root: str, *, width: int = 8, layers: int = 4, many: int = 40) -> Sources:
    """Write the sources under ``root`` (imports TensorFlow: TF writes the checkpoint and the graph)."""
    from safetensors.numpy import save_file

    rng = np.random.RandomState(0)
    values = {}
    for i in range(layers):
        values[f"layer{i}/kernel"] = rng.randn(width, width).astype(np.float32)
        values[f"layer{i}/bias"] = rng.randn(width).astype(np.float32)
        if i < 2:
            values[f"layer{i}/kernel/Momentum"] = rng.randn(width, width).astype(np.float32)
    values["global_step"] = np.array(1000, np.int64)
    _tf_checkpoint(os.path.join(root, "ckpt", "model.ckpt"), values)
    os.makedirs(os.path.join(root, "safetensors"))
    save_file(values, os.path.join(root, "safetensors", "model.safetensors"))
    many_values = {f"t{i:03d}": rng.randn(1 + i % 7, width).astype(np.float32) for i in range(many)}
    os.makedirs(os.path.join(root, "many"))
    np.savez(os.path.join(root, "many", "many.npz"), **many_values)
    frozen_values = _frozen_graph(os.path.join(root, "frozen", "frozen.pb"), rng, width)
    keras_values = _keras_weights(os.path.join(root, "keras", "model.weights.h5"), rng, width)
    _keras_sharded(os.path.join(root, "keras-sharded", "model.weights.json"), keras_values)
    hf_values, hf_config = _gpt2(os.path.join(root, "gpt2", "model.ckpt"), rng, width)
    return Sources(root, width, values, many_values, frozen_values, keras_values, hf_values, hf_config)


def _keras_weights(path: str, rng, width: int) -> dict:
    """A Keras 3 ``.weights.h5`` (two Dense layers and Adam state), written with h5py in Keras' layout."""
    import h5py

    values = {}
    for layer in ("dense", "dense_1"):
        values[f"layers/{layer}/vars/0"] = rng.randn(width, width).astype(np.float32)
        values[f"layers/{layer}/vars/1"] = rng.randn(width).astype(np.float32)
    values["optimizer/vars/0"] = np.array(3, np.int64)
    for i in range(1, 5):
        values[f"optimizer/vars/{i}"] = rng.randn(width).astype(np.float32)
    os.makedirs(os.path.dirname(path))
    with h5py.File(path, "w") as f:
        for key, value in values.items():
            f.create_dataset(key, data=value)
        for layer in ("dense", "dense_1"):
            f[f"layers/{layer}/vars"].attrs["name"] = layer
    return values


def _keras_sharded(index: str, values: dict) -> None:
    """The same weights as a Keras 3 sharded set, one shard per top group (as Keras' ShardedH5IOStore lays it
    out: ``model_0000N.weights.h5`` and ``model.weights.json`` naming each ``vars`` group's shard), with h5py."""
    import h5py

    os.makedirs(os.path.dirname(index))
    groups = {"layers/dense/vars": 0, "layers/dense_1/vars": 1, "optimizer/vars": 2}
    weight_map = {}
    for group, k in groups.items():
        name = f"model_{k:05d}.weights.h5"
        with h5py.File(os.path.join(os.path.dirname(index), name), "w") as f:
            for key, value in values.items():
                if key.startswith(group + "/"):
                    f.create_dataset(key, data=value)
            if group.startswith("layers/"):
                f[group].attrs["name"] = group.split("/")[1]
        weight_map["/" + group] = name
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": float(sum(v.nbytes for v in values.values()))},
                   "weight_map": weight_map}, f, indent=4)


def _gpt2(prefix: str, rng, width: int) -> tuple[dict, dict]:
    """A tiny OpenAI GPT-2 TF checkpoint; (the tensors, the config.json) an unkilled conversion to HF writes."""
    import restorekit

    h = width
    values = {"model/wte": rng.randn(16, h), "model/wpe": rng.randn(8, h), "model/ln_f/g": rng.randn(h),
              "model/ln_f/b": rng.randn(h)}
    for p, shapes in (("model/h0/", {"ln_1/g": (h,), "ln_1/b": (h,), "attn/c_attn/w": (1, h, 3 * h),
                                     "attn/c_attn/b": (3 * h,), "attn/c_proj/w": (1, h, h), "attn/c_proj/b": (h,),
                                     "ln_2/g": (h,), "ln_2/b": (h,), "mlp/c_fc/w": (1, h, 4 * h),
                                     "mlp/c_fc/b": (4 * h,), "mlp/c_proj/w": (1, 4 * h, h), "mlp/c_proj/b": (h,)}),):
        values.update({p + n: rng.randn(*shape) for n, shape in shapes.items()})
    _tf_checkpoint(prefix, {n: v.astype(np.float32) for n, v in values.items()})
    reference = os.path.join(os.path.dirname(prefix), "reference", "model.safetensors")
    restorekit.convert(prefix, reference, rules="gpt2-tf-to-hf", max_shard_size=1500, config={"n_head": 2})
    got = _load_hf(os.path.dirname(reference))
    with open(os.path.join(os.path.dirname(reference), "config.json")) as f:
        config = json.load(f)
    shutil.rmtree(os.path.dirname(reference))
    return got, config


def _tf_checkpoint(prefix: str, values: dict) -> None:
    import tensorflow as tf

    tf1 = tf.compat.v1
    os.makedirs(os.path.dirname(prefix))
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    with tf.Graph().as_default():
        variables = []
        for k, (name, value) in enumerate(values.items()):
            with tf.device(devices[k % len(devices)]):
                variables.append(tf1.get_variable(name, initializer=tf.constant(value), use_resource=True))
        saver = tf1.train.Saver(variables, sharded=len(devices) > 1)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            saver.save(sess, prefix, write_meta_graph=False)


def _frozen_graph(path: str, rng, width: int) -> dict:
    import tensorflow as tf

    tf1 = tf.compat.v1
    values = {f"net/fc{i}/weights": rng.randn(width, width).astype(np.float32) for i in range(3)}
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, width], name="x")
        h = x
        for name, value in values.items():
            h = tf.matmul(h, tf1.get_variable(name, initializer=tf.constant(value), use_resource=False))
        tf.identity(h, name="y")
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            frozen = tf1.graph_util.convert_variables_to_constants(sess, sess.graph.as_graph_def(), ["y"])
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(frozen.SerializeToString())
    return values


# ---------------------------------------------------------------- one kill


@dataclasses.dataclass
class Result:
    writer: str
    kill: str  # the crash point, or "random+12.3ms"
    outcome: str  # "killed" or "finished" (a random kill that came after the end)
    output: str  # "absent", "complete", "old" (an overwrite or in-place save that had not landed)
    problems: list


class HarnessError(RuntimeError):
    """The child failed on its own, or never reached the crash point it was given."""


def _child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (HOOK, TRACE)}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra)
    return env


def _spawn(writer: Writer, args: dict, case: str, **env) -> subprocess.Popen:
    code = _PROLOGUE + writer.body + "print('done')\n"
    stderr = open(os.path.join(case, "stderr.txt"), "wb")
    try:
        return subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], env=_child_env(**env), cwd=case,
                                stdout=subprocess.PIPE, stderr=stderr)
    finally:
        stderr.close()


def _stderr(case: str) -> str:
    with open(os.path.join(case, "stderr.txt"), "rb") as f:
        return f.read().decode(errors="replace")[-3000:]


def _kill_at(proc: subprocess.Popen, point: str, marker: str, case: str, sig: int = signal.SIGKILL) -> int:
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not os.path.exists(marker):
        if proc.poll() is not None:
            raise HarnessError(f"the writer exited ({proc.returncode}) without reaching {point!r}:\n{_stderr(case)}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise HarnessError(f"the writer did not reach {point!r} in {CHILD_TIMEOUT:.0f} s")
        time.sleep(0.002)
    # The marker is written before the pause begins; the pid in it is the writer's.
    os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise HarnessError(f"the writer did not exit after signal {sig} at {point!r}") from None
    return proc.returncode


def _wait_ready(proc: subprocess.Popen, case: str) -> None:
    line = b""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(proc.stdout.fileno(), 1) if ready else b""
        if not chunk:
            proc.kill()
            proc.wait()
            raise HarnessError(f"the writer never started writing:\n{_stderr(case)}")
        line += chunk


def _kill_after(proc: subprocess.Popen, delay: float, case: str) -> str:
    _wait_ready(proc, case)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)  # a no-op on a child that already exited
    proc.wait()
    if proc.returncode == 0:
        return "finished"
    if proc.returncode != -signal.SIGKILL:
        raise HarnessError(f"the writer failed ({proc.returncode}):\n{_stderr(case)}")
    return "killed"


def _args(sources: Sources, writer: Writer, case: str) -> dict:
    src_dir = os.path.join(case, "src")
    original = sources.path(writer.source)
    shutil.copytree(os.path.dirname(original), src_dir)
    return {"src": os.path.join(src_dir, os.path.basename(original)), "out": os.path.join(case, writer.out),
            "width": sources.width}


# The config.json of the old output a Hugging Face overwrite replaces (its weights: the 'ckpt' source's).
OLD_CONFIG = {"old": True}


def _prepare(sources: Sources, writer: Writer, args: dict) -> None:
    """An overwrite needs an old output in place first."""
    if writer.old is not None and writer.output == "tf":
        from restorekit.edit import CheckpointEditor

        CheckpointEditor(args["src"]).save(args["out"], compact=True)
    elif writer.old is not None and writer.output == "hf":
        import restorekit

        restorekit.convert(sources.path("ckpt"), args["out"], max_shard_size=600)
        with open(os.path.join(os.path.dirname(args["out"]), "config.json"), "w") as f:
            json.dump(OLD_CONFIG, f)


def run_case(sources: Sources, writer: Writer, case: str, *, point: str | None = None,
             delay: float | None = None, sig: int = signal.SIGKILL) -> Result:
    """Run ``writer`` in a child under ``case`` (a new directory), kill it, and check what it left.

    ``sig``: the signal sent at ``point``. After SIGINT (Ctrl-C: a KeyboardInterrupt in the
    writer) or SIGTERM (turned into the same cleanup while a write holds its lock) the writer
    itself must leave nothing behind, before any next write sweeps; SIGTERM must still end
    the process as SIGTERM does (killed by the signal, not an exit code).
    """
    os.makedirs(case)
    args = _args(sources, writer, case)
    _prepare(sources, writer, args)
    before = _digest(args["src"], writer)
    if point is not None:
        marker = os.path.join(case, "reached")
        code = _kill_at(_spawn(writer, args, case, **{HOOK: f"{point}:{marker}"}), point, marker, case, sig)
        kill, outcome = point if sig == signal.SIGKILL else f"{point}+{signal.Signals(sig).name}", "killed"
    else:
        outcome = _kill_after(_spawn(writer, args, case), delay, case)
        kill = f"random+{delay * 1000:.1f}ms"
    problems: list[str] = []
    if point is not None and sig == signal.SIGTERM and code != -signal.SIGTERM:
        problems.append(f"after SIGTERM the writer exited with {code}, not killed by SIGTERM:\n{_stderr(case)}")
    if sig in (signal.SIGINT, signal.SIGTERM):
        shown = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
        for directory in sorted({os.path.dirname(args["src"]), os.path.dirname(args["out"])}):
            if os.path.isdir(directory):
                problems.extend(f"after {shown}: {p}" for p in leftovers(directory))
    output = check(sources, writer, args, before, problems)
    return Result(writer.name, kill, outcome, output, problems)


def trace(sources: Sources, writer: Writer, case: str) -> tuple[list[str], float]:
    """Run ``writer`` to the end with crash points recorded: (points in order reached, seconds writing)."""
    os.makedirs(case)
    args = _args(sources, writer, case)
    _prepare(sources, writer, args)
    before = _digest(args["src"], writer)
    points_file = os.path.join(case, "points.txt")
    proc = _spawn(writer, args, case, **{TRACE: points_file})
    _wait_ready(proc, case)
    start = time.monotonic()
    out, _ = proc.communicate(timeout=CHILD_TIMEOUT)
    seconds = time.monotonic() - start
    if proc.returncode != 0 or b"done" not in out:
        raise HarnessError(f"{writer.name} failed unkilled ({proc.returncode}):\n{_stderr(case)}")
    problems: list[str] = []
    if check(sources, writer, args, before, problems) != "complete" or problems:
        raise HarnessError(f"{writer.name} unkilled left a bad output: {problems}")
    with open(points_file) as f:
        points = list(dict.fromkeys(f.read().split()))
    return points, seconds


# ---------------------------------------------------------------- the checks


def _source_files(src: str, writer: Writer) -> list[str]:
    if writer.source not in ("ckpt", "gpt2"):
        return [src]
    directory, base = os.path.split(src)
    return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                  if n == base + ".index" or re.fullmatch(re.escape(base) + r"\.data-\d{5}-of-\d{5}", n))


def _digest(src: str, writer: Writer) -> dict | None:
    if writer.output in ("in-place", "keras-in-place"):
        return None
    result = {}
    for path in _source_files(src, writer):
        with open(path, "rb") as f:
            result[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return result


def check(sources: Sources, writer: Writer, args: dict, before: dict | None, problems: list) -> str:
    """Check the source, the output and the state file, run the next write in each directory,
    then look for leftovers. Appends what is wrong to ``problems``; returns the output's state."""
    if writer.output == "in-place":
        output = _check_checkpoint(args["src"], writer.expect(sources), writer.old(sources), problems,
                                   must_exist=True)
    elif writer.output == "keras-in-place":
        output = _check_keras_set(args["src"], writer.expect(sources), writer.old(sources), problems)
    else:
        after = _digest(args["src"], writer)
        if after != before:
            problems.append(f"the source changed: {sorted(set(before.items()) ^ set(after.items()))}")
        old = writer.old(sources) if writer.old is not None else None
        if writer.output == "tf":
            output = _check_checkpoint(args["out"], writer.expect(sources), old, problems)
        elif writer.output == "hf":
            config = writer.config(sources) if writer.config is not None else None
            output = _check_hf(os.path.dirname(args["out"]), writer.expect(sources), config, problems, old)
        else:
            output = _check_file(args["out"], writer.output, writer.expect(sources), problems)
        if writer.name == "unfreeze" and output == "complete" and not os.path.exists(args["out"] + ".meta"):
            problems.append("the checkpoint appeared without its .meta")
    if writer.state_file:
        _check_state_file(os.path.dirname(args["src"]), problems)
    for directory in sorted({os.path.dirname(args["src"]), os.path.dirname(args["out"])}):
        if os.path.isdir(directory):
            next_write(sources, directory)
            problems.extend(leftovers(directory))
    return output


def _equal(got: dict, want: dict) -> str | None:
    if sorted(got) != sorted(want):
        return f"names {sorted(set(got) ^ set(want))} differ"
    for name, value in want.items():
        value = np.asarray(value)
        g = np.asarray(got[name])
        if g.dtype != value.dtype or g.shape != value.shape or g.tobytes() != value.tobytes():
            return f"{name!r} differs ({g.dtype} {g.shape} vs {value.dtype} {value.shape})"
    return None


def _check_checkpoint(prefix: str, want: dict, old: dict | None, problems: list, *, must_exist=False) -> str:
    from restorekit._checkpoint import Checkpoint

    if not os.path.exists(prefix + ".index"):
        if must_exist:
            problems.append(f"{prefix!r} is gone")
        return "absent"
    try:
        ckpt = Checkpoint(prefix)
        verified = ckpt.verify()
        got = {name: ckpt.read(name) for name in ckpt}
    except Exception as e:  # any failure to read a visible output is what the harness looks for
        problems.append(f"{prefix!r} does not read: {type(e).__name__}: {e}")
        return "broken"
    if not verified.ok:
        problems.append(f"{prefix!r} fails verify: {verified.problems}")
        return "broken"
    differs = _equal(got, want)
    if differs is None:
        return "complete"
    if old is not None and _equal(got, old) is None:
        return "old"
    problems.append(f"{prefix!r} holds neither the new nor the old values: {differs}")
    return "mixed"


def _check_keras_set(index: str, want: dict, old: dict, problems: list) -> str:
    """A Keras sharded set edited in place: its index there, every shard it names whole (and the
    ``NAME_00000.weights.h5`` Keras' loader opens first), holding the old values or the new ones."""
    from restorekit._checkpoint import Checkpoint

    if not os.path.exists(index):
        problems.append(f"{index!r} is gone")
        return "absent"
    first = index[: -len(".weights.json")] + "_00000.weights.h5"
    if not os.path.exists(first):
        problems.append(f"{os.path.basename(first)!r}, which Keras opens first, is gone")
    try:
        ckpt = Checkpoint(index)
        got = {key: ckpt.read(key) for key in ckpt.entries}
    except Exception as e:  # a visible set that does not read is what the harness looks for
        problems.append(f"{index!r} does not read: {type(e).__name__}: {e}")
        return "broken"
    if _equal(got, want) is None:
        return "complete"
    if _equal(got, old) is None:
        return "old"
    problems.append(f"{index!r} holds neither the new nor the old values: {_equal(got, want)}")
    return "mixed"


def _load_hf(directory: str) -> dict:
    """Every tensor of the Hugging Face shards its ``model.safetensors.index.json`` names, loaded."""
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    got = {}
    for shard in shards:
        got.update(load_file(os.path.join(directory, shard)))
    return got


def _check_hf(directory: str, want: dict, config: dict | None, problems: list, old: dict | None = None) -> str:
    """Shards + index absent, complete, or (an overwrite) the old ones; visible weights come with their
    own config.json, whole, where one is expected (never the new weights with the old config, or the reverse).

    A config.json without the index is allowed here (it is renamed just before the
    weights); the next write's sweep must remove it (``leftovers``).
    """
    index = os.path.join(directory, "model.safetensors.index.json")
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(index):
        return "absent"
    try:
        got = _load_hf(directory)
    except Exception as e:  # a visible index whose shards do not load is what the harness looks for
        problems.append(f"{directory!r} does not load: {type(e).__name__}: {e}")
        return "broken"
    state = "complete" if _equal(got, want) is None else "old" if old is not None and _equal(got, old) is None else None
    if state is None:
        problems.append(f"{directory!r}: {_equal(got, want)}")
        return "mixed"
    expected = config if state == "complete" else OLD_CONFIG
    if config is not None:
        if not os.path.exists(config_path):
            problems.append(f"the {state} weights are visible without config.json")
            return "broken"
        with open(config_path) as f:
            if json.load(f) != expected:
                problems.append(f"config.json beside the {state} weights is not theirs")
                return "mixed"
    return state


def _load_file(path: str, fmt: str) -> dict:
    if fmt == "keras":
        import h5py

        got = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, obj: got.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        return got
    if fmt == "safetensors":
        from safetensors.numpy import load_file

        return load_file(path)
    if fmt == "npz":
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    import torch

    return {name: t.numpy() for name, t in torch.load(path, weights_only=True).items()}


def _check_file(path: str, fmt: str, want: dict, problems: list) -> str:
    if not os.path.exists(path):
        return "absent"
    try:
        got = _load_file(path, fmt)
    except Exception as e:  # a visible file its library cannot load is what the harness looks for
        problems.append(f"{path!r} does not load: {type(e).__name__}: {e}")
        return "broken"
    differs = _equal(got, want)
    if differs is not None:
        problems.append(f"{path!r}: {differs}")
        return "mixed"
    return "complete"


def _check_state_file(directory: str, problems: list) -> None:
    from restorekit._bundle import statefile
    from restorekit._checkpoint import Checkpoint

    path = os.path.join(directory, statefile.STATE_FILE)
    with open(path, "rb") as f:
        state = statefile.parse(f.read())
    if state is None:
        problems.append("the state file names no checkpoint")
        return
    named = statefile.resolve(directory, state.model_checkpoint_path)
    try:
        if not Checkpoint(named).verify().ok:
            problems.append(f"the state file names {named!r}, which fails verify")
    except Exception as e:  # the named checkpoint must open
        problems.append(f"the state file names {named!r}, which does not open: {type(e).__name__}: {e}")


def next_write(sources: Sources, directory: str) -> None:
    """What a user does next in that directory: another save (it sweeps what dead writers left)."""
    from restorekit.edit import CheckpointEditor

    CheckpointEditor(sources.path("ckpt")).save(os.path.join(directory, "next-save"), compact=True)


_SHARD = re.compile(r"(.+)\.data-(\d{5})-of-(\d{5})")
_HF_SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}\.safetensors")
_KERAS_SHARD = re.compile(r"(.+)_(\d{5})\.weights\.h5")


def _keras_orphans(directory: str, names: set) -> list[str]:
    """Keras shards that no ``*.weights.json`` beside them lists (but ``NAME_00000``, which Keras opens first)."""
    found = []
    for name in sorted(names):
        match = _KERAS_SHARD.fullmatch(name)
        if match is None:
            continue
        index = match.group(1) + ".weights.json"
        listed = set()
        if index in names:
            if match.group(2) == "00000":
                continue
            with open(os.path.join(directory, index)) as f:
                for value in json.load(f)["weight_map"].values():
                    listed.update(value if isinstance(value, list) else [value])
        if name not in listed:
            found.append(f"orphan {name}")
    return found


def _hf_orphans(directory: str, names: set) -> list[str]:
    """Hugging Face shards that no ``*.safetensors.index.json`` beside them lists."""
    found = []
    for name in sorted(names):
        match = _HF_SHARD.fullmatch(name)
        if match is None:
            continue
        index = match.group(1) + ".safetensors.index.json"
        listed = set()
        if index in names:
            with open(os.path.join(directory, index)) as f:
                listed = set(json.load(f)["weight_map"].values())
        if name not in listed:
            found.append(f"orphan {name}")
    return found


def _orphan_config(names: set) -> list[str]:
    """A config.json with no weights beside it (renamed ahead of weights that never landed)."""
    weights = any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names)
    return ["orphan config.json"] if "config.json" in names and not weights else []


def leftovers(directory: str) -> list[str]:
    """Temporaries, lock files, visible shards or ``.meta`` files that no index names, a config.json without weights."""
    from restorekit._checkpoint import Checkpoint

    found = []
    names = set(os.listdir(directory))
    counts: dict[str, int | None] = {}
    for name in sorted(names):
        shard = _SHARD.fullmatch(name)
        prefix = shard.group(1) if shard else name[: -len(".meta")] if name.endswith(".meta") else None
        if name.startswith(".restorekit-tmp-") or name.endswith(".restorekit-lock"):
            found.append(f"leftover {name}")
        elif prefix is not None:
            if prefix not in counts:
                counts[prefix] = (Checkpoint(os.path.join(directory, prefix)).header.num_shards
                                  if prefix + ".index" in names else None)
            if counts[prefix] is None or (shard and int(shard.group(3)) != counts[prefix]):
                found.append(f"orphan {name}")
    return found + _hf_orphans(directory, names) + _keras_orphans(directory, names) + _orphan_config(names)


# ---------------------------------------------------------------- the sweep


def sweep(sources: Sources, root: str, writers, *, randoms: int, seed: int = 0, log=print,
          sig: int = signal.SIGKILL) -> list[Result]:
    results = []
    rng = random.Random(seed)
    for writer in writers:
        points, seconds = trace(sources, writer, os.path.join(root, writer.name, "trace"))
        log(f"{writer.name}: {len(points)} crash points, {seconds * 1000:.1f} ms writing")
        for k, point in enumerate(points):
            results.append(run_case(sources, writer, os.path.join(root, writer.name, f"p{k}"), point=point, sig=sig))
        for k in range(randoms):
            delay = rng.uniform(0, seconds)
            results.append(run_case(sources, writer, os.path.join(root, writer.name, f"r{k}"), delay=delay))
        bad = [r for r in results if r.writer == writer.name and r.problems]
        for r in bad:
            log(f"  PROBLEM at {r.kill}: {r.problems}")
    return results


def table(results: list[Result]) -> str:
    rows = ["| writer | crash points | random kills (landed) | output absent / complete / old | problems |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for name in dict.fromkeys(r.writer for r in results):
        mine = [r for r in results if r.writer == name]
        named = [r for r in mine if not r.kill.startswith("random")]
        rand = [r for r in mine if r.kill.startswith("random")]
        landed = sum(r.outcome == "killed" for r in rand)
        states = "/".join(str(sum(r.output == s for r in mine)) for s in ("absent", "complete", "old"))
        rows.append(f"| {name} | {len(named)} | {len(rand)} ({landed}) | {states} | "
                    f"{sum(bool(r.problems) for r in mine)} |")
    total = sum(not r.kill.startswith("random") for r in results)
    rows.append(f"| **all** | {total} | {len(results) - total} | | {sum(bool(r.problems) for r in results)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512, help="tensor width (a kernel is width x width float32)")
    parser.add_argument("--random", type=int, default=10, help="random-time kills per writer")
    parser.add_argument("--only", action="append", choices=sorted(BY_NAME), help="only this writer (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--signal", choices=["KILL", "INT", "TERM"], default="KILL",
                        help="the signal sent at each crash point (INT: Ctrl-C, which must leave nothing itself)")
    parser.add_argument("--keep", action="store_true", help="keep the case directories")
    opts = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.makedirs(os.path.join(HERE, "data"), exist_ok=True)
    root = tempfile.mkdtemp(prefix="kill_harness-", dir=os.path.join(HERE, "data"))
    try:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        start = time.monotonic()
        sources = make_sources(os.path.join(root, "sources"), width=opts.width)
        writers = [BY_NAME[n] for n in opts.only] if opts.only else WRITERS
        results = sweep(sources, os.path.join(root, "cases"), writers, randoms=opts.random, seed=opts.seed,
                        sig=getattr(signal, "SIG" + opts.signal))
        print()
        print(table(results))
        print(f"\n{len(results)} kills in {time.monotonic() - start:.0f} s (width {opts.width}, seed {opts.seed})")
        return 1 if any(r.problems for r in results) else 0
    finally:
        if opts.keep:
            print(f"cases kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
