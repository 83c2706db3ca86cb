"""Tests for restorekit/_distribute.py: ShardedVariables (ParameterServerStrategy) and MultiWorkerMirroredStrategy.

Sharded variables are built by hand in this process for the quick cases. The real
strategies run in subprocesses: connecting to a cluster changes the eager context for
the whole process (the other tests' devices), so the parameter-server cluster (2 ps +
2 workers as in-process ``tf.distribute.Server``s on loopback ports, the chief being
the coordinator) runs in one child process, and MultiWorkerMirroredStrategy in two
worker processes. Each prints JSON that the tests read.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import _distribute as distribute
from restorekit._checkpoint import Checkpoint
from restorekit.errors import IncompleteRestoreError, InvalidArgumentError
from restorekit._targets import collect, flat_variables

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together so none repeats)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_child(args: list, *, env=None, timeout=240) -> subprocess.Popen:
    """This file as a child process (``python tests/test_distribute.py ...``) with the worktree importable."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_json(proc: subprocess.Popen, timeout=240) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


# ====================================================================== in this process: hand-built shards

def sharded(name: str, value, rows: list, *, fill=0.0):
    """A ShardedVariable named like ParameterServerStrategy names one (``name/part_i``), shards of ``rows`` rows."""
    value = np.asarray(value, np.float32)
    parts = [tf.Variable(np.full((n,) + value.shape[1:], fill, np.float32), name=f"{name}/part_{i}")
             for i, n in enumerate(rows)]
    return tf.__internal__.distribute.ShardedVariable(parts)


@pytest.fixture
def source(tmp_path):
    """An unsharded tf.Module checkpoint: emb [7, 4], dense/kernel [4, 3], dense/bias [3]."""
    rng = np.random.RandomState(1)
    values = {"emb": rng.randn(7, 4).astype(np.float32), "dense/kernel": rng.randn(4, 3).astype(np.float32),
              "dense/bias": rng.randn(3).astype(np.float32)}
    prefix = tf.train.Checkpoint(model=module_net(tf, values)).write(str(tmp_path / "plain" / "ckpt"))
    return prefix, values


def sharded_net(rows=(4, 3)):
    net = tf.Module()
    net.emb = sharded("emb", np.zeros((sum(rows), 4)), list(rows))
    net.dense = tf.Module()
    net.dense.kernel = sharded("dense/kernel", np.zeros((4, 3)), [2, 2])
    net.dense.bias = tf.Variable(np.zeros(3, np.float32), name="dense/bias")
    return net


def test_a_sharded_variable_is_one_target_under_its_logical_name():
    net = sharded_net()
    assert sorted(v.name for v in net.variables)[:2] == ["dense/bias:0", "dense/kernel/part_0:0"]  # TF lists shards
    targets = {t.variable_name: t for t in collect(net)}
    assert sorted(targets) == ["dense/bias", "dense/kernel", "emb"]
    emb = targets["emb"]
    assert emb.shape == (7, 4) and emb.dtype == "float32" and emb.handle is net.emb
    assert [p.name for p in emb.parts] == ["emb/part_0:0", "emb/part_1:0"]
    assert flat_variables([net.emb]) == list(net.emb.variables)
    # a list of ShardedVariables and a Saver-style dict name them the same way
    assert [t.variable_name for t in collect([net.emb])] == ["emb"]
    assert collect({"model/emb/.ATTRIBUTES/VARIABLE_VALUE": net.emb})[0].parts == emb.parts


def test_restore_cuts_the_logical_value_into_each_shard(source):
    prefix, values = source
    net = sharded_net()
    report = restorekit.scan(prefix, net)
    restorekit.restore(report)
    assert sorted(r.variable_name for r in report.matched) == ["dense/bias", "dense/kernel", "emb"]
    assert "part_" not in str(report)
    np.testing.assert_array_equal(net.emb.variables[0].numpy(), values["emb"][:4])
    np.testing.assert_array_equal(net.emb.variables[1].numpy(), values["emb"][4:])
    np.testing.assert_array_equal(tf.convert_to_tensor(net.dense.kernel).numpy(), values["dense/kernel"])


def test_a_checkpoint_saved_in_three_shards_restores_into_two(source, tmp_path):
    prefix, values = source
    three = tf.Module()
    three.emb = sharded("emb", values["emb"], [3, 2, 2])
    restorekit.restore(restorekit.scan(prefix, three))
    three_prefix = tf.train.Checkpoint(model=three).write(str(tmp_path / "three" / "ckpt"))
    ckpt = Checkpoint(three_prefix)
    # TF writes one logical tensor whose three shards are slices of it
    assert ckpt.is_partitioned("model/emb/.ATTRIBUTES/VARIABLE_VALUE")
    assert ckpt.entries["model/emb/.ATTRIBUTES/VARIABLE_VALUE"].shape == (7, 4)
    assert ckpt.readable_name("model/emb/.ATTRIBUTES/VARIABLE_VALUE") == "model/emb"  # not 'ShardedVariable'
    two = tf.Module()
    two.emb = sharded("emb", values["emb"], [4, 3])
    report = restorekit.scan(three_prefix, two)
    restorekit.restore(report)
    assert [r.variable_name for r in report.matched] == ["emb"]
    np.testing.assert_array_equal(tf.convert_to_tensor(two.emb).numpy(), values["emb"])


def test_shards_saved_as_separate_variables_restore_shard_for_shard_through_a_dict(tmp_path):
    # Not how TF saves a ShardedVariable (see above), but how a list of its shards saves:
    # one key per shard. A {checkpoint_name: shard} dict restores each shard as itself.
    saved = sharded("emb", np.zeros((7, 4)), [4, 3])
    rows = np.arange(28, dtype=np.float32).reshape(7, 4)
    distribute.assign(saved, rows)
    prefix = tf.train.Checkpoint(shards=list(saved.variables)).write(str(tmp_path / "shards" / "ckpt"))
    live = sharded("emb", np.zeros((7, 4)), [4, 3])
    keys = {f"shards/{i}/.ATTRIBUTES/VARIABLE_VALUE": part for i, part in enumerate(live.variables)}
    report = restorekit.scan(prefix, keys)
    restorekit.restore(report)
    assert sorted(r.variable_name for r in report.matched) == ["emb/part_0", "emb/part_1"]
    np.testing.assert_array_equal(tf.convert_to_tensor(live).numpy(), rows)


def test_a_grown_embedding_keeps_the_saved_rows_across_shards(source):
    prefix, values = source
    net = tf.Module()
    net.emb = sharded("emb", np.zeros((10, 4)), [5, 5], fill=9.0)
    report = restorekit.scan(prefix, net, shape_policy="slice_or_pad", include=["emb"])
    restorekit.restore(report)
    emb = tf.convert_to_tensor(net.emb).numpy()
    np.testing.assert_array_equal(emb[:7], values["emb"])
    assert (emb[7:] == 9.0).all()


def test_only_some_shards_of_a_variable_is_an_error(source):
    net = sharded_net()
    with pytest.raises(InvalidArgumentError, match=r"'emb' is a ShardedVariable of 2 shards but \['emb/part_1'\]"):
        restorekit.scan(source[0], [net.emb.variables[0], net.dense.bias])


def test_a_lone_sharded_variable_is_taken_like_a_partitioned_one(source):
    net = sharded_net()
    report = restorekit.scan(source[0], net.emb)
    restorekit.restore(report)
    assert [r.variable_name for r in report.matched] == ["emb"]
    np.testing.assert_array_equal(tf.convert_to_tensor(net.emb).numpy(), source[1]["emb"])


def test_strict_refuses_a_mismatched_shard_layout_before_any_assign(source):
    prefix, _ = source
    net = tf.Module()
    net.emb = sharded("emb", np.zeros((8, 4)), [4, 4], fill=3.0)
    net.dense = tf.Module()
    net.dense.bias = tf.Variable(np.zeros(3, np.float32), name="dense/bias")
    report = restorekit.scan(prefix, net)
    assert [r.variable_name for r in report.shape_mismatched] == ["emb"]
    with pytest.raises(IncompleteRestoreError, match="emb"):
        restorekit.restore(report, strict=True)
    assert (tf.convert_to_tensor(net.emb).numpy() == 3.0).all()
    assert not net.dense.bias.numpy().any()


def test_assign_refuses_a_value_that_does_not_cover_the_shards():
    with pytest.raises(InvalidArgumentError, match=r"cannot fill the sharded variable 'emb' of shape \[7, 4\]"):
        distribute.assign(sharded("emb", np.zeros((7, 4)), [4, 3]), np.zeros((6, 4), np.float32))
    assert distribute.shard_bounds(sharded("emb", np.zeros((7, 4)), [4, 3])) == [(0, 4), (4, 7)]
    assert distribute.shard_bounds(tf.Variable([1.0])) == []


def test_without_a_cluster_this_task_is_the_chief(tmp_path):
    assert distribute.is_chief()
    assert distribute.write_directory(str(tmp_path)) == str(tmp_path)


# ====================================================================== ParameterServerStrategy (child process)

@pytest.fixture(scope="module")
def ps(tmp_path_factory):
    """Every parameter-server scenario, run once in a child process on a loopback cluster."""
    return child_json(run_child(["ps", str(tmp_path_factory.mktemp("ps"))]))


SOURCES = ["from_plain", "from_three", "from_tf1"]


@pytest.mark.slow  # the parameter-server cluster child (module fixture ps)
def test_tf_saves_a_sharded_variable_as_one_logical_tensor_sliced_per_shard(ps):
    saved = ps["three_saved"]
    assert saved["shards"]["emb"] == [[3, 4], [2, 4], [2, 4]]
    assert saved["entries"]["model/emb/.ATTRIBUTES/VARIABLE_VALUE"] == [7, 4]
    assert len(saved["sliced"]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("case", SOURCES, ids=["unsharded-tf2", "three-shards-tf2", "tf1-partitioned-in-three"])
def test_restored_values_equal_the_source_in_two_shards_on_two_ps(ps, case):
    result = ps[case]
    assert result["matched"] == ["dense/bias", "dense/kernel", "emb"]
    assert result["equal"] == {"emb": True, "dense/kernel": True, "dense/bias": True}
    assert result["shards"]["emb"] == [[4, 4], [3, 4]]
    assert result["devices"] == ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    assert "part_" not in result["report"]


@pytest.mark.slow
def test_tf_restore_into_the_same_module_agrees(ps):
    assert ps["tf_restore_equal"] == {"emb": True, "dense/kernel": True, "dense/bias": True}


@pytest.mark.slow
def test_a_grown_sharded_embedding_keeps_the_saved_rows(ps):
    grown = ps["grown_emb"]
    assert grown["kept"] and grown["fresh"] and grown["shards"] == [[5, 4], [4, 4]]
    assert "1 via slice_or_pad" in grown["report"]


@pytest.mark.slow
def test_keras_model_restores_by_logical_paths_and_its_optimizer_stays_fresh(ps):
    same = ps["keras"]["same"]
    assert same["matched"] == ["net/body/bias", "net/body/kernel", "net/head/bias", "net/head/kernel"]
    assert all(same["equal"].values())
    assert same["shards"]["net/body/kernel"] == [[2, 6], [2, 6]]
    assert same["skipped_slots"] == 10 and same["optimizer_fresh"]
    assert "part_" not in same["report"]


@pytest.mark.slow
def test_keras_model_with_a_new_head_restores_the_body_only(ps):
    new_head = ps["keras"]["new_head"]
    assert new_head["matched"] == ["net/body/bias", "net/body/kernel"]
    assert new_head["mismatched"] == ["net/head/bias", "net/head/kernel"]
    assert new_head["body_equal"] and new_head["head_untouched"]


@pytest.mark.slow
def test_resume_or_warm_start_resumes_sharded_keras_variables_which_tf_cannot_restore(ps):
    resume = ps["resume"]
    assert resume["how"] == "resumed" and resume["checkpoint"] == "ckpt-1" and resume["sharded"] == 4
    assert resume["step"] == 5 and resume["step_variable"] == 5 and resume["iterations"] == 1
    assert resume["save_counter"] == 1  # the manager's next save is ckpt-2
    assert resume["model_equal"] == [True] * 4
    assert len(resume["optimizer_equal"]) == 10 and all(resume["optimizer_equal"])  # Adam built, then restored


@pytest.mark.slow
def test_a_sharded_resume_into_a_changed_model_is_refused_before_any_assign(ps):
    assert ps["resume"]["changed_model"] == "IncompleteRestoreError"
    assert ps["resume"]["changed_model_untouched"]


# ====================================================================== MultiWorkerMirroredStrategy (2 worker processes)

def run_workers(pretrained: str, train_dir: str) -> list[dict]:
    ports = free_ports(2)
    procs = [run_child(["mwms", str(i), json.dumps(ports), pretrained, train_dir]) for i in range(2)]
    try:
        return [child_json(p, timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_multi_worker_mirrored_workers_restore_alike_only_the_chief_writes_and_a_restart_resumes(tmp_path):
    import keras

    source = keras_net(keras)
    pretrained = tf.train.Checkpoint(model=source).write(str(tmp_path / "pretrained" / "ckpt"))
    expected = {v.path: v.numpy().tolist() for v in source.trainable_variables}
    train_dir = str(tmp_path / "train")

    first = run_workers(pretrained, train_dir)
    assert [w["how"] for w in first] == ["warm-started"] * 2
    assert [w["chief"] for w in first] == [True, False]
    assert first[0]["started"] == first[1]["started"] == expected
    assert first[0]["trained"] == first[1]["trained"] != expected
    # the chief's checkpoint is the only thing written
    assert sorted(os.listdir(train_dir)) == ["checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]

    second = run_workers(pretrained, train_dir)
    assert [w["how"] for w in second] == ["resumed"] * 2
    assert second[0]["started"] == second[1]["started"] == first[0]["trained"]
    assert [w["iterations"] for w in second] == [2, 2]
    assert sorted(os.listdir(train_dir)) == ["checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index",
                                             "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
    assert second[0]["saved"] == "ckpt-2" and tf.train.latest_checkpoint(train_dir).endswith("ckpt-2")


# ====================================================================== child: parameter-server cluster

class SwitchablePartitioner:
    """FixedShardsPartitioner(n) with n chosen per variable, to save a 3-shard source on the same cluster."""

    def __init__(self, tf, shards: int):
        self.tf, self.shards = tf, shards

    def __call__(self, shape, dtype, axis=0):
        return self.tf.distribute.experimental.partitioners.FixedShardsPartitioner(self.shards)(shape, dtype, axis)


def ps_cluster(tf, partitioner):
    """2 ps + 2 workers as in-process servers on loopback; this process is the chief (coordinator)."""
    ps, workers, chief = free_ports(2), free_ports(2), free_ports(1)
    spec = tf.train.ClusterSpec({
        "ps": [f"localhost:{p}" for p in ps],
        "worker": [f"localhost:{p}" for p in workers],
        "chief": [f"localhost:{p}" for p in chief],
    })
    servers = [tf.distribute.Server(spec, job_name=job, task_index=i, protocol="grpc", start=True)
               for job in ("ps", "worker") for i in range(2)]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    return strategy, servers


def module_net(tf, values: dict):
    """A tf.Module with an embedding and a dense layer, variables named as a TF1 graph would name them."""
    net = tf.Module()
    net.emb = tf.Variable(values["emb"], name="emb")
    net.dense = tf.Module()
    net.dense.kernel = tf.Variable(values["dense/kernel"], name="dense/kernel")
    net.dense.bias = tf.Variable(values["dense/bias"], name="dense/bias")
    return net


def keras_net(keras, head=3):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="body"),
                             keras.layers.Dense(head, name="head")], name="net")


def module_values(net) -> dict:
    return {"emb": net.emb, "dense/kernel": net.dense.kernel, "dense/bias": net.dense.bias}


def shard_shapes(handle) -> list:
    from restorekit._distribute import shards

    return [list(p.shape) for p in shards(handle)]


def write_sources(tf, keras, out: str, rng) -> dict:
    """The unsharded sources, written before the cluster exists: a tf.Module, a trained Keras model + Adam, a TF1 partitioned one."""
    values = {"emb": rng.randn(7, 4).astype(np.float32), "dense/kernel": rng.randn(4, 3).astype(np.float32),
              "dense/bias": rng.randn(3).astype(np.float32)}
    plain = tf.train.Checkpoint(model=module_net(tf, values)).write(os.path.join(out, "plain", "ckpt"))

    model = keras_net(keras)
    optimizer = keras.optimizers.Adam(0.1)
    x = rng.randn(8, 4).astype(np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    trained = tf.train.Checkpoint(model=model, optimizer=optimizer).write(os.path.join(out, "keras", "ckpt"))
    keras_values = {v.path: v.numpy() for v in model.variables}

    with tf.Graph().as_default():
        tf1 = tf.compat.v1
        made = [tf1.get_variable(name, initializer=tf.constant(value), use_resource=True,
                                 partitioner=tf1.fixed_size_partitioner(3) if name == "emb" else None)
                for name, value in values.items()]
        saver = tf1.train.Saver(made)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            partitioned = saver.save(sess, os.path.join(out, "tf1", "model.ckpt"), write_meta_graph=False)
    return {"values": values, "plain": plain, "keras": trained, "keras_values": keras_values, "tf1": partitioned}


def restored_module(tf, restorekit, prefix, values, **scan_options) -> dict:
    """scan + restore a checkpoint into a fresh zero-initialized tf.Module built in the current strategy scope."""
    net = module_net(tf, {k: np.zeros_like(v) for k, v in values.items()})
    report = restorekit.scan(prefix, net, **scan_options)
    restorekit.restore(report)
    live = module_values(net)
    return {
        "matched": sorted(r.variable_name for r in report.matched),
        "report": str(report),
        "equal": {k: bool(np.array_equal(tf.convert_to_tensor(v).numpy(), values[k])) for k, v in live.items()},
        "shards": {k: shard_shapes(v) for k, v in live.items()},
        "devices": sorted({p.device for v in live.values() for p in getattr(v, "variables", [v])}),
    }


def ps_main(out: str) -> dict:
    """Every parameter-server scenario in one process; returns what the tests assert on."""
    import keras
    import tensorflow as tf

    import restorekit
    from restorekit._checkpoint import Checkpoint

    rng = np.random.RandomState(0)
    src = write_sources(tf, keras, out, rng)
    run = write_run(tf, keras, os.path.join(out, "run"), rng)
    values = src["values"]
    partitioner = SwitchablePartitioner(tf, 3)
    strategy, _servers = ps_cluster(tf, partitioner)
    result = {}

    with strategy.scope():
        three = module_net(tf, values)
    three_prefix = tf.train.Checkpoint(model=three).write(os.path.join(out, "three", "ckpt"))
    ckpt = Checkpoint(three_prefix)
    result["three_saved"] = {
        "shards": {k: shard_shapes(v) for k, v in module_values(three).items()},
        "entries": {k: list(e.shape) for k, e in ckpt.entries.items() if k != "_CHECKPOINTABLE_OBJECT_GRAPH"},
        "sliced": sorted(k for k in ckpt.entries if ckpt.is_partitioned(k)),
    }

    partitioner.shards = 2
    with strategy.scope():
        result["from_plain"] = restored_module(tf, restorekit, src["plain"], values)
        result["from_three"] = restored_module(tf, restorekit, three_prefix, values)
        result["from_tf1"] = restored_module(tf, restorekit, src["tf1"], values)
        # TF's own restore into the same kind of module, for comparison
        reference = module_net(tf, {k: np.zeros_like(v) for k, v in values.items()})
    tf.train.Checkpoint(model=reference).restore(src["plain"]).expect_partial()
    result["tf_restore_equal"] = {k: bool(np.array_equal(tf.convert_to_tensor(v).numpy(), values[k]))
                                  for k, v in module_values(reference).items()}

    with strategy.scope():
        grown = module_net(tf, {"emb": np.full((9, 4), 5.0, np.float32), "dense/kernel": np.zeros((4, 3), np.float32),
                                "dense/bias": np.zeros(3, np.float32)})
    report = restorekit.scan(src["plain"], grown, shape_policy="slice_or_pad")
    restorekit.restore(report)
    emb = tf.convert_to_tensor(grown.emb).numpy()
    result["grown_emb"] = {"kept": bool(np.array_equal(emb[:7], values["emb"])), "fresh": bool((emb[7:] == 5.0).all()),
                           "shards": shard_shapes(grown.emb), "report": str(report)}

    result["keras"] = keras_case(tf, keras, restorekit, strategy, src)
    result["resume"] = resume_case(tf, keras, restorekit, strategy, src, run)
    return result


def write_run(tf, keras, run: str, rng) -> dict:
    """A run's checkpoint (Keras model, Adam after one step, step=5) by CheckpointManager, before the cluster exists."""
    model, optimizer, step = keras_net(keras), keras.optimizers.Adam(0.1), tf.Variable(5, dtype=tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(rng.randn(8, 4).astype(np.float32)) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer, step=step), run, 3).save()
    return {"dir": run, "model": [v.numpy() for v in model.variables],
            "optimizer": [v.numpy() for v in optimizer.variables]}


def resume_case(tf, keras, restorekit, strategy, src, run) -> dict:
    """resume_or_warm_start under the strategy: Keras variables are ShardedVariables, which TF cannot restore."""
    with strategy.scope():  # as documented: inside the scope, where the unbuilt optimizer can be built
        model, optimizer, step = keras_net(keras), keras.optimizers.Adam(0.1), tf.Variable(0, dtype=tf.int64)
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer, step=step),
                                             run["dir"], 3)
        start = restorekit.resume_or_warm_start(manager, src["keras"], model=model, optimizer=optimizer, step=step)

    def now(v):
        return np.asarray(tf.convert_to_tensor(v.value))

    out = {
        "how": start.how, "checkpoint": os.path.basename(start.checkpoint), "step": start.step,
        "step_variable": int(step.numpy()), "iterations": int(optimizer.iterations.numpy()),
        "save_counter": int(manager.checkpoint.save_counter.numpy()),
        "model_equal": [bool(np.array_equal(now(v), w)) for v, w in zip(model.variables, run["model"])],
        "optimizer_equal": [bool(np.array_equal(now(v), w)) for v, w in zip(optimizer.variables, run["optimizer"])],
        "sharded": sum(1 for v in model.variables if restorekit._distribute.is_sharded(v.value)),
    }
    with strategy.scope():
        other, other_optimizer = keras_net(keras, head=5), keras.optimizers.Adam(0.1)
        before = [now(v) for v in other.variables]
        try:
            restorekit.resume_or_warm_start(run["dir"], src["keras"], model=other, optimizer=other_optimizer)
            out["changed_model"] = "no error"
        except restorekit.RestoreKitError as e:
            out["changed_model"] = type(e).__name__
    out["changed_model_untouched"] = all(np.array_equal(now(v), b) for v, b in zip(other.variables, before))
    return out


def keras_case(tf, keras, restorekit, strategy, src) -> dict:
    """A Keras model + Adam under the strategy, from a trained unsharded Keras checkpoint; and one with a new head."""
    out = {}
    with strategy.scope():
        model = keras_net(keras)
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.build(model.trainable_variables)
    report = restorekit.scan(src["keras"], model)
    restorekit.restore(report)
    out["same"] = {
        "matched": sorted(r.variable_name for r in report.matched),
        "skipped_slots": sum(1 for r in report.skipped if r.reason.startswith("optimizer slot")),
        "report": str(report),
        "equal": {v.path: bool(np.array_equal(np.asarray(tf.convert_to_tensor(v.value)), src["keras_values"][v.path]))
                  for v in model.variables},
        "shards": {v.path: shard_shapes(v.value) for v in model.variables},
        "optimizer_fresh": all(not np.asarray(tf.convert_to_tensor(v.value)).any() for v in optimizer.variables
                               if v.path.split("/")[-1] != "learning_rate"),
    }
    with strategy.scope():
        new_head = keras_net(keras, head=5)
    before = {v.path: np.asarray(tf.convert_to_tensor(v.value)) for v in new_head.variables}
    report = restorekit.scan(src["keras"], new_head)
    restorekit.restore(report)
    out["new_head"] = {
        "matched": sorted(r.variable_name for r in report.matched),
        "mismatched": sorted(r.variable_name for r in report.shape_mismatched),
        "report": str(report),
        "body_equal": all(np.array_equal(np.asarray(tf.convert_to_tensor(v.value)), src["keras_values"][v.path])
                          for v in new_head.variables if v.path.startswith("net/body/")),
        "head_untouched": all(np.array_equal(np.asarray(tf.convert_to_tensor(v.value)), before[v.path])
                              for v in new_head.variables if v.path.startswith("net/head/")),
    }
    return out


# ====================================================================== child: one MultiWorkerMirroredStrategy worker

def mwms_worker(index: int, ports: list, pretrained: str, train_dir: str) -> dict:
    """Resume from ``train_dir`` or warm-start from ``pretrained``, train one step, save (only the chief's files stay)."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": index}})
    import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras_net(keras)
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    latest = tf.train.latest_checkpoint(train_dir)
    if latest:
        checkpoint.restore(latest).assert_existing_objects_matched()
        how = "resumed"
    else:
        report = restorekit.scan(pretrained, model)
        restorekit.restore(report, strict=True)
        how = "warm-started"
    started = {v.path: np.asarray(v.numpy()).tolist() for v in model.trainable_variables}

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    # each worker feeds its own batch; the all-reduce makes the update the same everywhere
    strategy.run(step, args=(tf.constant(np.random.RandomState(index).randn(4, 4).astype(np.float32)),))
    trained = {v.path: np.asarray(v.numpy()).tolist() for v in model.trainable_variables}
    directory = distribute.write_directory(train_dir, strategy)
    saved = checkpoint.save(os.path.join(directory, "ckpt"))
    if not distribute.is_chief(strategy):
        tf.io.gfile.rmtree(directory)
    return {"how": how, "chief": distribute.is_chief(strategy), "started": started, "trained": trained,
            "saved": os.path.relpath(saved, train_dir), "iterations": int(optimizer.iterations.numpy())}


if __name__ == "__main__":
    if sys.argv[1] == "ps":
        print(json.dumps(ps_main(sys.argv[2])))
    elif sys.argv[1] == "mwms":
        print(json.dumps(mwms_worker(int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5])))
