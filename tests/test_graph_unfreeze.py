"""Tests for restorekit/graph/_unfreezing.py: frozen constants back to a checkpoint and a trainable graph."""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

from restorekit._checkpoint import Checkpoint
from restorekit.errors import GraphError, InsufficientSpaceError, NoMatchError, OutputError, OutputExistsError
from restorekit.graph import freeze, inspect_graph, unfreeze
from conftest import save_variables
from test_graph import MODEL, SHAPES, _Dense, _files, _run, make_frozen, make_net

tf1 = tf.compat.v1


@pytest.fixture(scope="module", params=[True, False], ids=["resource", "ref"])
def net(request, tmp_path_factory):
    return make_net(request.param, tmp_path_factory.mktemp("resource" if request.param else "ref"))


@pytest.fixture(scope="module")
def frozen(net):
    return make_frozen(net)


def test_freeze_then_unfreeze_gives_back_the_variables_bit_for_bit(net, frozen, tmp_path):
    result = unfreeze(frozen.path, str(tmp_path / "out" / "model.ckpt"))

    pattern = "resource" if net.use_resource else "variable"
    assert {(c.node, c.name, c.shape, c.dtype, c.pattern) for c in result.converted} == {
        (name, name, SHAPES[name], "float32", pattern) for name in MODEL
    }
    assert result.meta_graph is None
    assert result.aligned == ()
    ckpt = Checkpoint(result.checkpoint)
    assert sorted(ckpt.entries) == MODEL
    for name in MODEL:
        restored = ckpt.read(name)
        assert restored.dtype == net.values[name].dtype
        assert restored.tobytes() == net.values[name].tobytes()
    assert _files(tmp_path / "out") == ["model.ckpt.data-00000-of-00001", "model.ckpt.index"]
    assert "net/fc/weights" in str(result)


def test_unfreeze_trainable_graph_restores_and_trains(net, frozen, tmp_path):
    result = unfreeze(frozen.path, str(tmp_path / "model.ckpt"), trainable_graph=True)
    assert result.meta_graph == str(tmp_path / "model.ckpt.meta")

    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(result.meta_graph)
        variables = {v.op.name: v for v in tf1.trainable_variables()}
        assert sorted(variables) == MODEL
        assert {v.op.type for v in variables.values()} == {net.variable_op}
        y = tf1.get_default_graph().get_tensor_by_name("y:0")
        loss = tf.reduce_sum(tf.square(y - 1.0))
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf1.Session() as sess:
            saver.restore(sess, result.checkpoint)
            np.testing.assert_array_equal(sess.run(y, {"x:0": net.inputs}), _run(frozen.graph_def, net.inputs))
            before = sess.run(variables)
            sess.run(train_op, {"x:0": net.inputs})
            after = sess.run(variables)
    for name in MODEL:
        np.testing.assert_array_equal(before[name], net.values[name])
        assert not np.array_equal(after[name], before[name]), name


def test_unfreeze_aligns_names_against_a_reference_checkpoint(net, frozen, tmp_path):
    reference = {
        "net/conv1/weights": np.zeros(SHAPES["net/conv1/weights"], np.float32),
        "net/conv1/biases": np.zeros([4], np.float32),
        "head/kernel": np.zeros([256, 5], np.float32),  # renamed: a unique shape
        "net/fc/biases": np.zeros([6], np.float32),  # same name, another shape
        "net/fc/biases/Momentum": np.zeros([5], np.float32),  # slots never take a name
    }
    reference_prefix = save_variables(tmp_path / "ref" / "model.ckpt", reference)

    result = unfreeze(frozen.path, str(tmp_path / "out" / "model.ckpt"), reference=reference_prefix)

    aligned = {a.old: (a.new, a.reason) for a in result.aligned}
    assert aligned["net/conv1/weights"] == ("net/conv1/weights", "same name and shape")
    assert aligned["net/fc/weights"] == ("head/kernel", "unique shape match [256, 5]")
    assert aligned["net/fc/biases"][0] == "net/fc/biases"
    assert "kept its name" in aligned["net/fc/biases"][1]
    ckpt = Checkpoint(result.checkpoint)
    assert sorted(ckpt.entries) == ["head/kernel", "net/conv1/biases", "net/conv1/weights", "net/fc/biases"]
    assert ckpt.read("head/kernel").tobytes() == net.values["net/fc/weights"].tobytes()
    assert "head/kernel" in str(result)


def test_unfreeze_aligned_trainable_graph_uses_the_new_names(net, frozen, tmp_path):
    reference = {"head/kernel": np.zeros([256, 5], np.float32)}
    reference_prefix = save_variables(tmp_path / "ref" / "model.ckpt", reference)

    result = unfreeze(
        frozen.path, str(tmp_path / "model.ckpt"), reference=reference_prefix, trainable_graph=True
    )

    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(result.meta_graph)
        names = sorted(v.op.name for v in tf1.global_variables())
        with tf1.Session() as sess:
            saver.restore(sess, result.checkpoint)
            outputs = sess.run("y:0", {"x:0": net.inputs})
    assert names == sorted(["head/kernel", "net/conv1/biases", "net/conv1/weights", "net/fc/biases"])
    np.testing.assert_array_equal(outputs, _run(frozen.graph_def, net.inputs))


@pytest.mark.parametrize(
    "weights, expected",
    [
        ("large", ["net/fc/weights"]),
        (lambda node: node.name.endswith("biases"), ["net/conv1/biases", "net/fc/biases"]),
        (["net/conv1/weights"], ["net/conv1/weights"]),
    ],
    ids=["large-floats-only", "callable-on-node", "list-of-names"],
)
def test_unfreeze_weight_choices(net, frozen, tmp_path, weights, expected):
    result = unfreeze(frozen.path, str(tmp_path / "model.ckpt"), weights=weights, trainable_graph=True)

    assert sorted(c.name for c in result.converted) == expected
    assert sorted(Checkpoint(result.checkpoint).entries) == expected
    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(result.meta_graph)
        assert sorted(v.op.name for v in tf1.global_variables()) == expected
        with tf1.Session() as sess:
            saver.restore(sess, result.checkpoint)
            np.testing.assert_array_equal(sess.run("y:0", {"x:0": net.inputs}), net.outputs)


def test_unfreeze_large_constants_of_a_graph_without_variable_patterns(tmp_path):
    weights = np.random.RandomState(1).randn(64, 8).astype(np.float32)
    with tf.Graph().as_default() as g:
        x = tf1.placeholder(tf.float32, [None, 64], name="x")
        w = tf.constant(weights, name="dense/w")
        tf.matmul(x, w, name="out")
    with pytest.raises(GraphError, match="no weight constants"):
        unfreeze(g.as_graph_def(), str(tmp_path / "auto" / "model.ckpt"))
    assert _files(tmp_path / "auto") == []

    result = unfreeze(g.as_graph_def(), str(tmp_path / "model.ckpt"), weights="large", trainable_graph=True)

    assert [(c.name, c.shape, c.pattern) for c in result.converted] == [("dense/w", (64, 8), "large")]
    inputs = np.random.RandomState(2).randn(2, 64).astype(np.float32)
    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(result.meta_graph)
        with tf1.Session() as sess:
            saver.restore(sess, result.checkpoint)
            outputs = sess.run("out:0", {"x:0": inputs})
    np.testing.assert_array_equal(outputs, _run(g.as_graph_def(), inputs, "out:0"))
    np.testing.assert_allclose(outputs, inputs @ weights, rtol=1e-5, atol=1e-5)


def test_unfreeze_tf2_frozen_function_recovers_names_from_a_reference(tmp_path):
    # TF2 has no public freezing API; this is what TF's own converters and users call.
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    model = _Dense()
    reference = tf.train.Checkpoint(model=model).write(str(tmp_path / "tf2" / "ckpt"))
    function = convert_variables_to_constants_v2(model.__call__.get_concrete_function())
    frozen_gd = function.graph.as_graph_def()
    inputs = np.random.RandomState(3).randn(4, 3).astype(np.float32)

    result = unfreeze(frozen_gd, str(tmp_path / "model.ckpt"), reference=reference, trainable_graph=True)

    assert {c.pattern for c in result.converted} == {"resource (TF2)"}
    # readable paths, not raw '.ATTRIBUTES' keys that mean nothing without an object graph
    assert {a.new: a.reason for a in result.aligned} == {
        "kernel": "unique shape match [3, 2]",
        "bias": "unique shape match [2]",
    }
    ckpt = Checkpoint(result.checkpoint)
    assert sorted(ckpt.entries) == ["bias", "kernel"]
    np.testing.assert_array_equal(ckpt.read("kernel"), model.kernel.numpy())
    np.testing.assert_array_equal(ckpt.read("bias"), model.bias.numpy())
    # and a model of the same architecture restores from it by name
    import restorekit

    fresh = _Dense()
    report = restorekit.scan(result.checkpoint, fresh)
    assert report.is_complete
    restorekit.restore(report)
    np.testing.assert_array_equal(fresh.kernel.numpy(), model.kernel.numpy())
    output = [n.name for n in frozen_gd.node][-1]
    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(result.meta_graph)
        with tf1.Session() as sess:
            saver.restore(sess, result.checkpoint)
            outputs = sess.run(f"{output}:0", {"inp:0": inputs})
    np.testing.assert_array_equal(outputs, model(inputs)["out"].numpy())


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_partitioned_variable_round_trips_as_slices_of_one_entry(tmp_path, use_resource):
    ids = np.array([0, 3, 9, 4], np.int32)
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.int32, [None], name="ids")
        emb = tf1.get_variable(
            "emb", [10, 4], partitioner=tf1.fixed_size_partitioner(3), use_resource=use_resource
        )
        tf.identity(tf.nn.embedding_lookup(emb, x), name="y")
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            prefix = saver.save(sess, str(tmp_path / "train" / "model.ckpt"))
            outputs = sess.run("y:0", {x: ids})
    summary = inspect_graph(prefix + ".meta")
    assert [(v.name, v.shape, v.checkpoint_name) for v in summary.variables] == [
        ("emb/part_0", (4, 4), "emb"),
        ("emb/part_1", (3, 4), "emb"),
        ("emb/part_2", (3, 4), "emb"),
    ]

    frozen_gd = freeze(prefix, prefix + ".meta", ["y"])
    result = unfreeze(frozen_gd, str(tmp_path / "out" / "model.ckpt"), trainable_graph=True)

    with tf.Graph().as_default():
        tf.import_graph_def(frozen_gd, name="")
        with tf1.Session() as sess:
            np.testing.assert_array_equal(sess.run("y:0", {"ids:0": ids}), outputs)
    assert [(c.name, c.full_name, c.full_shape, c.offset) for c in result.converted] == [
        ("emb/part_0", "emb", (10, 4), (0, 0)),
        ("emb/part_1", "emb", (10, 4), (4, 0)),
        ("emb/part_2", "emb", (10, 4), (7, 0)),
    ]
    original, unfrozen = Checkpoint(prefix), Checkpoint(result.checkpoint)
    assert list(unfrozen.entries) == ["emb"]
    assert unfrozen.read("emb").tobytes() == original.read("emb").tobytes()
    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(result.meta_graph)
        y = tf1.get_default_graph().get_tensor_by_name("y:0")
        train_op = tf1.train.GradientDescentOptimizer(0.5).minimize(tf.reduce_sum(y))
        with tf1.Session() as sess:
            saver.restore(sess, result.checkpoint)
            np.testing.assert_array_equal(sess.run(y, {"ids:0": ids}), outputs)
            sess.run(train_op, {"ids:0": ids})
            assert not np.array_equal(sess.run(y, {"ids:0": ids}), outputs)


def test_unfreeze_of_a_graph_that_is_not_frozen_says_so(net, tmp_path):
    with pytest.raises(GraphError, match="not frozen"):
        unfreeze(net.meta, str(tmp_path / "out" / "model.ckpt"))
    assert _files(tmp_path / "out") == []


def test_unfreeze_weight_name_not_in_graph(frozen, tmp_path):
    with pytest.raises(NoMatchError) as info:
        unfreeze(frozen.path, str(tmp_path / "out" / "model.ckpt"), weights=["net/fc/weight"])
    assert "net/fc/weights" in info.value.closest
    assert _files(tmp_path / "out") == []


# ---------------------------------------------------------------- the checkpoint writer


def _const(graph_def, name, value=None, *, dtype=None, shape=None, listed=None, read=True):
    """Add a Const (read through '<name>/read', as a frozen variable is) to ``graph_def``."""
    node = graph_def.node.add()
    node.name, node.op = name, "Const"
    if value is not None:
        tensor = tf.make_tensor_proto(value)
    else:  # a splat: ``listed`` values standing for the whole ``shape``
        tensor = tf.make_tensor_proto(listed, dtype=dtype, shape=shape, verify_shape=False)
        assert not tensor.tensor_content
    node.attr["dtype"].type = tensor.dtype
    node.attr["value"].tensor.CopyFrom(tensor)
    if read:
        reader = graph_def.node.add()
        reader.name, reader.op = f"{name}/read", "Identity"
        reader.input.append(name)
        reader.attr["T"].type = tensor.dtype
    return node


def test_unfreeze_writes_thousands_of_constants_one_by_one(tmp_path):
    rng = np.random.RandomState(5)
    graph_def = tf1.GraphDef()
    values = {f"layer_{i:04d}/w": rng.randn(3).astype(np.float32) for i in range(3000)}
    for name, value in values.items():
        _const(graph_def, name, value)

    result = unfreeze(graph_def, str(tmp_path / "model.ckpt"))

    assert len(result.converted) == 3000
    ckpt = Checkpoint(result.checkpoint)
    assert sorted(ckpt.entries) == sorted(values)
    for name in ("layer_0000/w", "layer_1234/w", "layer_2999/w"):
        assert ckpt.read(name).tobytes() == values[name].tobytes()
    assert _files(tmp_path) == ["model.ckpt.data-00000-of-00001", "model.ckpt.index"]


def test_unfreeze_writes_splat_and_padded_constants_as_tensorflow_reads_them(tmp_path):
    graph_def = tf1.GraphDef()
    splat = _const(graph_def, "splat", dtype=tf.float32, shape=[300, 70], listed=[0.25])
    padded = _const(graph_def, "padded", dtype=tf.int64, shape=[1000], listed=[1, 2, 3])
    empty = _const(graph_def, "zeros", dtype=tf.float16, shape=[4, 5], listed=[])

    result = unfreeze(graph_def, str(tmp_path / "model.ckpt"))

    ckpt = Checkpoint(result.checkpoint)
    for node in (splat, padded, empty):
        expected = tf.make_ndarray(node.attr["value"].tensor)
        assert ckpt.read(node.name).tobytes() == expected.tobytes()
        assert ckpt.read(node.name).shape == expected.shape


def _splat_pb(path, shape):
    """A tiny .pb whose one Const lists one float for ``shape`` (2**31 floats: 8 GiB)."""
    graph_def = tf1.GraphDef()
    _const(graph_def, "big", dtype=tf.float32, shape=shape, listed=[1.0])
    path.write_bytes(graph_def.SerializeToString())
    return str(path)


def test_a_tiny_graph_claiming_gigabytes_is_refused_before_anything_is_read(tmp_path):
    path = _splat_pb(tmp_path / "splat.pb", [2**31])
    assert os.path.getsize(path) < 120

    with pytest.raises(OutputError) as info:
        unfreeze(path, str(tmp_path / "out" / "model.ckpt"), trainable_graph=True)

    message = str(info.value)
    assert "'big'" in message and "8.0 GiB" in message and "[2147483648]" in message
    assert "max_output_bytes" in message
    assert _files(tmp_path / "out") == []


def test_max_output_bytes_bounds_the_output(tmp_path):
    path = _splat_pb(tmp_path / "splat.pb", [1000])

    with pytest.raises(OutputError, match="4000 bytes|3.9 KiB"):
        unfreeze(path, str(tmp_path / "out" / "model.ckpt"), max_output_bytes=3999)
    assert _files(tmp_path / "out") == []

    result = unfreeze(path, str(tmp_path / "out" / "model.ckpt"), max_output_bytes=4000)
    np.testing.assert_array_equal(Checkpoint(result.checkpoint).read("big"), np.ones(1000, np.float32))


def test_output_over_the_free_disk_is_refused(tmp_path, monkeypatch):
    path = _splat_pb(tmp_path / "splat.pb", [1000])
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=2000))

    with pytest.raises(InsufficientSpaceError, match="'big'"):
        unfreeze(path, str(tmp_path / "out" / "model.ckpt"))
    assert _files(tmp_path / "out") == []


def test_unfreeze_refuses_an_existing_checkpoint_unless_overwrite(frozen, tmp_path):
    prefix = str(tmp_path / "model.ckpt")
    unfreeze(frozen.path, prefix, weights=["net/fc/biases"])
    before = {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)}

    with pytest.raises(OutputExistsError) as info:
        unfreeze(frozen.path, prefix)
    assert info.value.path == prefix and not info.value.is_source
    assert {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)} == before

    unfreeze(frozen.path, prefix, overwrite=True)
    assert sorted(Checkpoint(prefix).entries) == MODEL


def test_unfreeze_refuses_an_existing_meta_graph_unless_overwrite(frozen, tmp_path):
    prefix = str(tmp_path / "model.ckpt")
    (tmp_path / "model.ckpt.meta").write_bytes(b"keep me")

    with pytest.raises(OutputExistsError) as info:
        unfreeze(frozen.path, prefix, trainable_graph=True)
    assert info.value.path == prefix + ".meta"
    assert _files(tmp_path) == ["model.ckpt.meta"]

    result = unfreeze(frozen.path, prefix, trainable_graph=True, overwrite=True)
    assert (tmp_path / "model.ckpt.meta").read_bytes() != b"keep me"
    assert result.meta_graph == prefix + ".meta"


# ---------------------------------------------------------------- statistics stay non-trainable


def test_trainable_graph_keeps_moving_statistics_and_shadows_non_trainable(tmp_path):
    inputs = np.random.RandomState(6).randn(2, 6, 6, 3).astype(np.float32)
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 6, 6, 3], name="x")
        bn = {"is_training": False, "scale": True, "fused": True, "updates_collections": None}
        with slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm, normalizer_params=bn):
            net = slim.conv2d(x, 4, [3, 3], scope="conv1")
        shadow = tf1.get_variable("scale/ExponentialMovingAverage", [], initializer=tf1.constant_initializer(0.5))
        tf.identity(net * shadow, name="y")
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            # Moving statistics off their initial 0 / 1, so a restore is visible.
            for v in tf1.global_variables():
                if "moving" in v.op.name:
                    sess.run(v.assign(v + 0.3))
            prefix = saver.save(sess, str(tmp_path / "train" / "model.ckpt"))
            outputs = sess.run("y:0", {x: inputs})
    frozen_gd = freeze(prefix, prefix + ".meta", ["y"])

    result = unfreeze(frozen_gd, str(tmp_path / "out" / "model.ckpt"), trainable_graph=True)

    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(result.meta_graph)
        trainable = sorted(v.op.name for v in tf1.trainable_variables())
        everything = sorted(v.op.name for v in tf1.global_variables())
        with tf1.Session() as sess:
            saver.restore(sess, result.checkpoint)
            np.testing.assert_array_equal(sess.run("y:0", {"x:0": inputs}), outputs)
    assert trainable == ["conv1/BatchNorm/beta", "conv1/BatchNorm/gamma", "conv1/weights"]
    assert sorted(set(everything) - set(trainable)) == [
        "conv1/BatchNorm/moving_mean",
        "conv1/BatchNorm/moving_variance",
        "scale/ExponentialMovingAverage",
    ]


@pytest.mark.parametrize("weights", ["auto", "large"])
def test_unfreeze_of_a_frozen_graph_without_weight_constants_is_an_error(tmp_path, weights):
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        tf.identity(x * 2.0 + 1.0, name="y")
        path = tmp_path / "no_weights.pb"
        path.write_bytes(graph.as_graph_def().SerializeToString())
    out = tmp_path / "out"
    with pytest.raises(GraphError, match="no weight constants found") as info:
        unfreeze(str(path), str(out / "model.ckpt"), weights=weights, trainable_graph=True)
    assert "no_weights.pb" in str(info.value)
    hint = "lower it, or pass a list of node names" if weights == "large" else "Pass weights='large'"
    assert hint in str(info.value)
    assert not out.exists() or os.listdir(out) == []


def test_unfreeze_refuses_an_output_another_writer_holds(frozen, tmp_path):
    """One writer per output (issue 22): unfreeze's commit takes the output's lock, as the editor's saves do."""
    import threading

    from restorekit._bundle.locking import output_lock

    prefix = str(tmp_path / "out" / "model.ckpt")
    ready, stop = threading.Event(), threading.Event()

    def hold():
        with output_lock(prefix):
            ready.set()
            stop.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(OutputExistsError, match="another restorekit process"):
            unfreeze(frozen.path, prefix, trainable_graph=True)
        assert _files(tmp_path / "out") == [".model.ckpt.restorekit-lock"]  # the holder's lock only
    finally:
        stop.set()
        holder.join(30)
