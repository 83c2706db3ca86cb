"""Benchmark for issue 15: scan + restore into a ParameterServerStrategy tf.Module vs tf.train.Checkpoint.restore.

    python benchmarks/bench_distribute.py [--mb MB] [--rounds N] [--data DIR] [--keep]

A tf.Module holding an embedding table and a stack of dense layers (about ``--mb``
MB of float32, default 400) is saved unsharded with ``tf.train.Checkpoint``. An
in-process cluster (2 ps + 2 workers as ``tf.distribute.Server``s on loopback ports,
this process the chief) then builds the same module under ``ParameterServerStrategy``
with ``FixedShardsPartitioner(2)``, so every variable is a ShardedVariable of two
shards, one per parameter server. Into that one module, side by side:

  (a) ``tf.train.Checkpoint(model=m).restore(path).expect_partial()``;
  (b) ``restorekit.scan(path, m)`` + ``restorekit.restore(report)``.

Each timing ends with a read of one row of every shard, so both wait for their
assigns on the parameter servers. One warm-up of each, then ``--rounds`` rounds
alternating which goes first; medians and the median of the paired ratios are
printed. Goal: (b) / (a) <= 1.2. Values are checked equal to the source after each.
Generated data is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import restorekit  # noqa: E402
from restorekit._checkpoint import Checkpoint  # noqa: E402

WIDTH = 512


def shapes_for(mb: int) -> dict[str, tuple]:
    """Half the bytes in an embedding table, half in WIDTH x WIDTH dense layers (with biases)."""
    floats = mb * (1 << 20) // 4
    layers = max(1, floats // 2 // (WIDTH * WIDTH))
    shapes = {"embedding/table": (max(2, floats // 2 // WIDTH), WIDTH)}
    for i in range(layers):
        shapes[f"dense_{i}/kernel"] = (WIDTH, WIDTH)
        shapes[f"dense_{i}/bias"] = (WIDTH,)
    return shapes


def zeros(shape):
    """An initial value the strategy can build shard by shard (no full tensor on the coordinator)."""
    def initial_value(partition_shape=None, partition_offset=None):
        return tf.zeros(partition_shape or shape)
    return initial_value


def build(shapes: dict, values: dict | None = None) -> tf.Module:
    """The module; attributes follow the names, so tf.train.Checkpoint and restorekit both find them."""
    root = tf.Module()
    for name, shape in shapes.items():
        scope, attr = name.split("/")
        if not hasattr(root, scope):
            setattr(root, scope, tf.Module())
        init = values[name] if values is not None else zeros(shape)
        setattr(getattr(root, scope), attr, tf.Variable(init, shape=shape, dtype=tf.float32, name=name))
    return root


def variables_of(root, shapes) -> dict:
    return {name: getattr(getattr(root, name.split("/")[0]), name.split("/")[1]) for name in shapes}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ps_strategy():
    """2 ps + 2 workers in this process on loopback; this process is the chief."""
    ps, workers, chief = free_ports(2), free_ports(2), free_ports(1)
    spec = tf.train.ClusterSpec({"ps": [f"localhost:{p}" for p in ps], "worker": [f"localhost:{p}" for p in workers],
                                 "chief": [f"localhost:{p}" for p in chief]})
    servers = [tf.distribute.Server(spec, job_name=job, task_index=i, protocol="grpc", start=True)
               for job in ("ps", "worker") for i in range(2)]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0, rpc_layer="grpc")
    partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    return tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner), servers


def settle(variables: dict) -> None:
    """Read one row of every shard: the assigns on each parameter server are then done."""
    for v in variables.values():
        for part in v.variables:
            part[:1].numpy()


def check(variables: dict, expected: dict, what: str) -> None:
    for name, v in variables.items():
        if not np.array_equal(tf.convert_to_tensor(v).numpy(), expected[name]):
            raise SystemExit(f"{what}: {name} differs from the checkpoint")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="model size in MB (float32)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--data", default=os.path.join(HERE, "data", "bench_distribute"))
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = parser.parse_args(argv)

    os.makedirs(args.data, exist_ok=True)
    free = shutil.disk_usage(args.data).free
    if free < 3 * args.mb * (1 << 20):
        raise SystemExit(f"{args.data}: {free >> 20} MB free, need 3x {args.mb} MB; pass a smaller --mb")
    try:
        shapes = shapes_for(args.mb)
        rng = np.random.default_rng(0)
        expected = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
        path = tf.train.Checkpoint(model=build(shapes, expected)).write(os.path.join(args.data, "ckpt"))
        print(f"checkpoint: {len(shapes)} variables, {Checkpoint(path).nbytes / 1e6:.0f} MB, unsharded")

        strategy, _servers = ps_strategy()
        with strategy.scope():
            model = build(shapes)
        variables = variables_of(model, shapes)
        parts = sum(len(v.variables) for v in variables.values())
        print(f"model: {len(variables)} ShardedVariables in {parts} shards on 2 ps")

        def tf_restore():
            tf.train.Checkpoint(model=model).restore(path).expect_partial()
            settle(variables)

        def restorekit_restore():
            restorekit.restore(restorekit.scan(path, model), strict=True)
            settle(variables)

        def timed(fn, what):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            check(variables, expected, what)
            return elapsed

        timed(tf_restore, "tf.train.Checkpoint.restore")
        timed(restorekit_restore, "restorekit")
        a, b = [], []
        for i in range(args.rounds):
            order = [(tf_restore, a, "tf"), (restorekit_restore, b, "restorekit")]
            for fn, out, what in order if i % 2 == 0 else order[::-1]:
                out.append(timed(fn, what))
        ratios = [y / x for x, y in zip(a, b)]
        print()
        print("| restore into a ParameterServerStrategy tf.Module | median | min | max |")
        print("| --- | ---: | ---: | ---: |")
        print(f"| (a) tf.train.Checkpoint.restore | {statistics.median(a):.3f} s | {min(a):.3f} s | {max(a):.3f} s |")
        print(f"| (b) restorekit.scan + restore | {statistics.median(b):.3f} s | {min(b):.3f} s | {max(b):.3f} s |")
        print(f"| (b)/(a), paired over {args.rounds} rounds | {statistics.median(ratios):.2f} | {min(ratios):.2f} "
              f"| {max(ratios):.2f} |")
        verdict = "met" if statistics.median(ratios) <= 1.2 else "NOT met"
        print(f"\ngoal (b)/(a) <= 1.2: {verdict}")
    finally:
        if not args.keep:
            shutil.rmtree(args.data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
