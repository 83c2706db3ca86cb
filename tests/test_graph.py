"""Tests for restorekit/graph/: inspect, freeze and unfreeze on real tf-slim networks."""

import json
import os
import types

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim
from google.protobuf import text_format

from restorekit import graph as rkgraph
from restorekit._checkpoint import Checkpoint
from restorekit.errors import (
    CheckpointNotFoundError,
    GraphError,
    GraphTooLargeError,
    IncompleteRestoreError,
    NoMatchError,
    OutputExistsError,
)
from restorekit.graph import freeze, inspect_graph, unfreeze
from conftest import save_variables

tf1 = tf.compat.v1

MODEL = ["net/conv1/biases", "net/conv1/weights", "net/fc/biases", "net/fc/weights"]
SHAPES = {
    "net/conv1/weights": (3, 3, 3, 4),
    "net/conv1/biases": (4,),
    "net/fc/weights": (256, 5),
    "net/fc/biases": (5,),
}


def _build(use_resource: bool):
    """A tiny tf-slim conv net with a Momentum train op; returns the named tensors."""
    x = tf1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
    with tf1.variable_scope("net", use_resource=use_resource):
        net = slim.conv2d(x, 4, [3, 3], scope="conv1")
        net = slim.flatten(net)
        net = slim.fully_connected(net, 5, activation_fn=None, scope="fc")
    y = tf.identity(net, name="y")
    global_step = tf1.train.get_or_create_global_step()
    loss = tf.reduce_sum(tf.square(y), name="loss")
    train_op = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, global_step=global_step)
    return x, y, train_op


def make_net(use_resource: bool, directory):
    """A trained-for-one-step checkpoint with its .meta, plus the outputs on fixed inputs."""
    inputs = np.random.RandomState(0).randn(2, 8, 8, 3).astype(np.float32)
    with tf.Graph().as_default() as g:
        x, y, train_op = _build(use_resource)
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train_op, {x: inputs})  # fills the Momentum slots with non-zeros
            prefix = saver.save(sess, str(directory / "model.ckpt"), global_step=1)
            outputs = sess.run(y, {x: inputs})
            values = {v.op.name: v for v in tf1.global_variables()}
            values = dict(zip(values, sess.run(list(values.values()))))
        graph_def = g.as_graph_def()
    return types.SimpleNamespace(
        use_resource=use_resource,
        dir=directory,
        prefix=prefix,
        meta=prefix + ".meta",
        graph_def=graph_def,
        inputs=inputs,
        outputs=outputs,
        values=values,
        variable_op="VarHandleOp" if use_resource else "VariableV2",
    )


def make_frozen(net):
    """The net frozen into a .pb."""
    path = str(net.dir / "frozen.pb")
    graph_def = freeze(net.prefix, net.meta, ["y"], out=path)
    return types.SimpleNamespace(path=path, graph_def=graph_def)


@pytest.fixture(scope="module", params=[True, False], ids=["resource", "ref"])
def net(request, tmp_path_factory):
    return make_net(request.param, tmp_path_factory.mktemp("resource" if request.param else "ref"))


@pytest.fixture(scope="module")
def frozen(net):
    return make_frozen(net)


def _run(graph_def, inputs, output="y:0"):
    with tf.Graph().as_default():
        tf.import_graph_def(graph_def, name="")
        with tf1.Session() as sess:
            return sess.run(output, {"x:0": inputs})


def _files(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ---------------------------------------------------------------- inspect


def test_inspect_meta_lists_inputs_outputs_and_every_variable(net):
    summary = inspect_graph(net.meta)

    assert summary.kind == "MetaGraph"
    assert [(t.name, t.dtype, t.shape, t.op) for t in summary.inputs] == [
        ("x:0", "float32", (None, 8, 8, 3), "Placeholder")
    ]
    # y feeds the loss, so the loss is the graph's one sink; the train op, saver,
    # initializers and gradients are machinery, not outputs.
    assert [t.name for t in summary.outputs] == ["loss:0"]
    by_name = {v.name: v for v in summary.variables}
    for name in MODEL:
        assert by_name[name].shape == SHAPES[name]
        assert by_name[name].dtype == "float32"
        assert by_name[name].op == net.variable_op
        assert by_name[name].trainable is True
        assert by_name[name].slot is None
        slot = by_name[f"{name}/Momentum"]
        assert (slot.slot, slot.shape, slot.trainable) == ("Momentum", SHAPES[name], False)
    assert by_name["global_step"].dtype == "int64"
    assert len(summary.variables) == 9
    assert summary.op_counts["SaveV2"] == 1
    assert summary.op_counts["Conv2D"] == 1
    assert summary.repaired == ()
    assert summary.unknown_ops == ()


def test_inspect_summary_prints_a_table_and_round_trips_json(net):
    summary = inspect_graph(net.meta)

    text = str(summary)
    assert "x:0" in text and "[?, 8, 8, 3]" in text
    assert "net/fc/weights/Momentum" in text and "slot of Momentum" in text
    assert "4 optimizer slots" in text
    assert f"{3 * 3 * 3 * 4 + 4 + 256 * 5 + 5} model parameters" in text
    data = json.loads(json.dumps(summary.to_dict()))
    assert data["inputs"][0] == {
        "name": "x:0",
        "dtype": "float32",
        "shape": [None, 8, 8, 3],
        "op": "Placeholder",
        "signature": None,
        "key": None,
    }
    assert {v["name"] for v in data["variables"]} == set(net.values)


def test_inspect_frozen_pb_binary_and_text_agree(net, frozen, tmp_path):
    text_path = tmp_path / "frozen.pbtxt"
    text_path.write_text(text_format.MessageToString(frozen.graph_def))

    binary = inspect_graph(frozen.path)
    text = inspect_graph(str(text_path))

    assert binary.kind == text.kind == "GraphDef"
    assert [(t.name, t.shape) for t in binary.outputs] == [("y:0", (None, 5))]
    assert binary.variables == ()
    assert binary.op_counts["Const"] == 5  # four weights and the flatten shape
    weight_bytes = sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    assert weight_bytes <= binary.const_bytes <= weight_bytes + 64
    assert (binary.inputs, binary.outputs, binary.op_counts, binary.const_bytes) == (
        text.inputs,
        text.outputs,
        text.op_counts,
        text.const_bytes,
    )


@pytest.mark.parametrize("form", ["graph_def", "tf_graph"], ids=["GraphDef", "tf.Graph"])
def test_inspect_in_memory_graphs(net, form):
    if form == "graph_def":
        summary = inspect_graph(net.graph_def)
    else:
        with tf.Graph().as_default() as g:
            tf.import_graph_def(net.graph_def, name="")
        summary = inspect_graph(g)

    assert [t.name for t in summary.inputs] == ["x:0"]
    assert {v.name for v in summary.variables} == set(net.values)
    # Without a MetaGraph there are no collections to tell trainable variables by.
    assert {v.trainable for v in summary.variables} == {None}


class _Dense(tf.Module):
    """A TF2 module: y = x @ kernel + bias, with a serving signature."""

    def __init__(self):
        super().__init__()
        self.kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="kernel")
        self.bias = tf.Variable(np.array([0.5, -1.0], np.float32), name="bias")

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="inp")])
    def __call__(self, x):
        return {"out": tf.matmul(x, self.kernel) + self.bias}


@pytest.fixture(scope="module")
def tf2_saved_model(tmp_path_factory):
    model = _Dense()
    path = str(tmp_path_factory.mktemp("tf2") / "saved")
    tf.saved_model.save(model, path, signatures={"serving_default": model.__call__})
    return path


def test_inspect_tf2_saved_model_signatures_and_variables(tf2_saved_model):
    path = tf2_saved_model
    summary = inspect_graph(path)

    assert summary.kind == "SavedModel"
    assert summary.signatures == ("serving_default",)
    assert [(t.signature, t.key, t.dtype, t.shape, t.op) for t in summary.inputs] == [
        ("serving_default", "inp", "float32", (None, 3), "Placeholder")
    ]
    assert [(t.signature, t.key, t.dtype, t.shape) for t in summary.outputs] == [
        ("serving_default", "out", "float32", (None, 2))
    ]
    assert {(v.name, v.shape, v.checkpoint_name, v.trainable) for v in summary.variables} == {
        ("kernel", (3, 2), "kernel/.ATTRIBUTES/VARIABLE_VALUE", True),
        ("bias", (2,), "bias/.ATTRIBUTES/VARIABLE_VALUE", True),
    }
    # The object-graph keys are the ones the SavedModel's checkpoint really holds.
    held = set(Checkpoint(path).entries)
    assert {v.checkpoint_name for v in summary.variables} <= held


# ---------------------------------------------------------------- repairs


def _corrupt_like_old_tf(meta_graph):
    """Stale shapes, an attr this TF does not define, colocation with a removed node."""
    for node in meta_graph.graph_def.node:
        if node.name == "net/fc/MatMul":
            del node.attr["_output_shapes"].list.shape[:]
            shapes = node.attr["_output_shapes"].list.shape.add()
            shapes.dim.add().size = -1
            shapes.dim.add().size = 7  # the real output has 5 columns
            node.attr["use_cudnn_legacy"].b = True
        if node.name == "y":
            node.attr["_class"].list.s.append(b"loc:@net/removed_in_tf1_15")
    return meta_graph


def test_old_meta_is_repaired_and_says_how(net, tmp_path):
    from tensorflow.core.protobuf import meta_graph_pb2

    meta_graph = meta_graph_pb2.MetaGraphDef.FromString(open(net.meta, "rb").read())
    path = tmp_path / "old.meta"
    path.write_bytes(_corrupt_like_old_tf(meta_graph).SerializeToString())
    with tf.Graph().as_default(), pytest.raises(ValueError, match="_output_shapes|colocated"):
        tf1.train.import_meta_graph(str(path))

    summary = inspect_graph(str(path))

    repaired = "\n".join(summary.repaired)
    assert "stripped stale '_output_shapes' from 'net/fc/MatMul'" in repaired
    assert "'use_cudnn_legacy' of MatMul" in repaired
    assert "colocation" in repaired
    assert "repaired" in str(summary)
    assert {v.name for v in summary.variables} == set(net.values)

    # The repaired graph freezes and computes what the original computed.
    frozen_gd = freeze(net.prefix, str(path), ["y"])
    np.testing.assert_array_equal(_run(frozen_gd, net.inputs), net.outputs)
    # The caller's file is never rewritten.
    assert meta_graph_pb2.MetaGraphDef.FromString(path.read_bytes()) == meta_graph


# ---------------------------------------------------------------- freeze / unfreeze


def test_freeze_outputs_equal_the_unfrozen_graph(net, frozen):
    assert os.path.isfile(frozen.path)
    ops = {n.op for n in frozen.graph_def.node}
    assert not ops & {"VariableV2", "VarHandleOp", "ReadVariableOp", "SaveV2"}
    on_disk = tf1.GraphDef.FromString(open(frozen.path, "rb").read())
    assert on_disk == frozen.graph_def

    np.testing.assert_array_equal(_run(frozen.graph_def, net.inputs), net.outputs)
    # No temp file left beside the output.
    assert [f for f in _files(net.dir) if ".restorekit-tmp-" in f or f.endswith(".tmp")] == []


@pytest.mark.parametrize("form", ["graph_def", "tf_graph", "text_file"], ids=["GraphDef", "tf.Graph", "pbtxt"])
def test_freeze_accepts_every_graph_form(net, frozen, form, tmp_path):
    if form == "graph_def":
        graph = net.graph_def
    elif form == "tf_graph":
        with tf.Graph().as_default() as graph:
            tf.import_graph_def(net.graph_def, name="")
    else:
        graph = str(tmp_path / "graph.pbtxt")
        with open(graph, "w") as f:
            f.write(text_format.MessageToString(net.graph_def))

    out = tmp_path / "frozen.pbtxt"
    graph_def = freeze(net.prefix, graph, "y:0", out=str(out))

    np.testing.assert_array_equal(_run(graph_def, net.inputs), net.outputs)
    assert text_format.Parse(out.read_text(), tf1.GraphDef()) == graph_def  # .pbtxt: written as text



# ---------------------------------------------------------------- freeze a training graph


def _build_training_batch_norm(use_resource: bool):
    """A tf-slim conv net with fused batch norm in training mode, its moving-average updates
    inline (control dependencies of the logits), and a Momentum train op."""
    x = tf1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
    bn = {"is_training": True, "updates_collections": None, "fused": True, "decay": 0.9, "scale": True}
    with tf1.variable_scope("net", use_resource=use_resource):
        with slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm, normalizer_params=bn):
            net = slim.conv2d(x, 4, [3, 3], scope="conv1")
        net = tf.reduce_mean(net, [1, 2])
        logits = slim.fully_connected(net, 5, activation_fn=None, scope="logits")
    global_step = tf1.train.get_or_create_global_step()
    loss = tf.reduce_sum(tf.square(logits))
    train_op = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, global_step=global_step)
    return x, train_op


@pytest.fixture(scope="module", params=[True, False], ids=["resource", "ref"])
def training_net(request, tmp_path_factory):
    """A training-mode batch-norm net after one step, and its logits from one run of the
    original graph restored from the checkpoint (before any update changes a variable)."""
    directory = tmp_path_factory.mktemp("bn_resource" if request.param else "bn_ref")
    rng = np.random.RandomState(4)
    with tf.Graph().as_default():
        x, train_op = _build_training_batch_norm(request.param)
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train_op, {x: rng.randn(4, 8, 8, 3).astype(np.float32)})  # moving averages move off 0 / 1
            prefix = saver.save(sess, str(directory / "model.ckpt"), global_step=1)
    inputs = rng.randn(3, 8, 8, 3).astype(np.float32)
    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(prefix + ".meta")
        with tf1.Session() as sess:
            saver.restore(sess, prefix)
            outputs = sess.run("net/logits/BiasAdd:0", {"x:0": inputs})
    return types.SimpleNamespace(prefix=prefix, meta=prefix + ".meta", inputs=inputs, outputs=outputs)


def test_freeze_training_batch_norm_drops_the_updates_and_computes_one_run(training_net, tmp_path):
    out = tmp_path / "frozen.pb"

    graph_def = freeze(training_net.prefix, training_net.meta, ["net/logits/BiasAdd"], out=str(out))

    on_disk = tf1.GraphDef.FromString(out.read_bytes())
    assert on_disk == graph_def
    with tf.Graph().as_default() as g:
        tf1.import_graph_def(on_disk, name="")
        with tf1.Session() as sess:
            outputs = sess.run("net/logits/BiasAdd:0", {"x:0": training_net.inputs})
    np.testing.assert_allclose(outputs, training_net.outputs, rtol=0, atol=1e-6)
    # Nothing is left that writes, or even takes, a variable.
    resource = tf.resource.as_datatype_enum
    takes_variable = [
        (op.name, op.type)
        for op in g.get_operations()
        if any(a.is_ref or a.type == resource for a in op.op_def.input_arg)
    ]
    assert takes_variable == []
    ops = {n.op for n in graph_def.node}
    assert "FusedBatchNormV3" in ops
    assert not {op for op in ops if "Assign" in op or "Apply" in op or op in ("VariableV2", "VarHandleOp", "NoOp")}
    assert not [n.name for n in graph_def.node if "Momentum" in n.name or "AssignMovingAvg" in n.name]
    # restorekit's own unfreeze takes it back: the model variables, no moving averages
    # (training-mode batch norm normalizes with the batch statistics).
    result = unfreeze(str(out), str(tmp_path / "back" / "model.ckpt"))
    assert sorted(c.name for c in result.converted) == [
        "net/conv1/BatchNorm/beta",
        "net/conv1/BatchNorm/gamma",
        "net/conv1/weights",
        "net/logits/biases",
        "net/logits/weights",
    ]


def test_frozen_graph_that_does_not_import_raises_and_writes_nothing(training_net, tmp_path, monkeypatch):
    # Keep the updates, as freeze did before it dropped them: a writer left on a constant.
    monkeypatch.setattr(rkgraph._freezing, "_variable_writers", lambda graph_def, names: [])
    out = tmp_path / "frozen.pb"

    with pytest.raises(GraphError) as info:
        freeze(training_net.prefix, training_net.meta, ["net/logits/BiasAdd"], out=str(out))

    message = str(info.value)
    assert "does not import" in message and "nothing was written" in message
    assert "net/conv1/BatchNorm/AssignMovingAvg" in message
    assert "AssignSub" in message
    assert _files(tmp_path) == []


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_freeze_refuses_an_output_that_uses_an_updated_value(tmp_path, use_resource):
    # y = x * (counter += 1): the frozen graph cannot compute it, and must not silently
    # compute x * counter instead.
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None], name="x")
        counter = tf1.get_variable("counter", initializer=2.0, use_resource=use_resource)
        tf.multiply(x, counter.assign_add(1.0), name="y")
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            prefix = saver.save(sess, str(tmp_path / "train" / "model.ckpt"))
    out = tmp_path / "frozen.pb"

    with pytest.raises(GraphError, match=r"use values written by variable updates.*: '.+' reads 'AssignAdd\w*'"):
        freeze(prefix, prefix + ".meta", ["y"], out=str(out))
    update = "AssignAddVariableOp" if use_resource else "AssignAdd"
    with pytest.raises(GraphError, match=f"outputs '{update}' \\({update}\\) are variable updates"):
        freeze(prefix, prefix + ".meta", [update], out=str(out))
    assert not out.exists()


# ---------------------------------------------------------------- bad input


@pytest.fixture
def not_a_graph(tmp_path):
    path = tmp_path / "notes.pb"
    path.write_text("these are my notes, not a graph\n")
    return str(path)


@pytest.fixture
def truncated(frozen, tmp_path):
    data = open(frozen.path, "rb").read()
    path = tmp_path / "truncated.pb"
    path.write_bytes(data[: len(data) // 2])
    return str(path)


@pytest.fixture
def truncated_by_one_byte(frozen, tmp_path):
    # Cut inside the last field's payload, fewer bytes than its length varint holds
    # beyond it: the truncation check must count the length from after that varint.
    data = open(frozen.path, "rb").read()
    path = tmp_path / "truncated_by_one_byte.pb"
    path.write_bytes(data[:-1])
    return str(path)


@pytest.mark.parametrize(
    "bad",
    ["not_a_graph", "truncated", "truncated_by_one_byte"],
    ids=["not-a-graph", "truncated-in-half", "truncated-by-one-byte"],
)
def test_bad_graph_files_raise_graph_error_and_write_nothing(net, bad, request, tmp_path):
    path = request.getfixturevalue(bad)
    out = tmp_path / "out"

    with pytest.raises(GraphError) as info:
        inspect_graph(path)
    assert repr(path) in str(info.value)
    assert ("truncated" in str(info.value)) == bad.startswith("truncated")
    with pytest.raises(GraphError):
        freeze(net.prefix, path, ["y"], out=str(out / "frozen.pb"))
    with pytest.raises(GraphError):
        unfreeze(path, str(out / "model.ckpt"), trainable_graph=True)
    assert _files(out) == []


def test_missing_graph_file_is_a_graph_error_naming_nearby_files(net, tmp_path):
    with pytest.raises(GraphError, match="no graph file at .*frozen.bp.*frozen.pb"):
        inspect_graph(str(net.dir / "frozen.bp"))


def test_graph_over_2gb_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.pb"
    with open(path, "wb") as f:
        f.truncate(2**31 + 16)  # sparse: no disk used, nothing to parse

    with pytest.raises(GraphTooLargeError, match="2 GB"):
        inspect_graph(str(path))
    with pytest.raises(GraphTooLargeError):
        unfreeze(str(path), str(tmp_path / "out" / "model.ckpt"))
    assert _files(tmp_path / "out") == []


def test_frozen_graph_over_the_limit_is_refused_before_writing(net, tmp_path, monkeypatch):
    # The net's graph is ~30 KB; its weights ~6 KB. Lower the limit between the two.
    monkeypatch.setattr(rkgraph, "MAX_PROTO_BYTES", len(net.graph_def.SerializeToString()) + 1000)
    out = tmp_path / "frozen.pb"

    with pytest.raises(GraphTooLargeError, match="2 GB limit"):
        freeze(net.prefix, net.graph_def, ["y"], out=str(out))
    assert not out.exists()
    assert _files(tmp_path) == []


def test_output_not_in_graph_lists_the_closest(net, tmp_path):
    out = tmp_path / "frozen.pb"

    with pytest.raises(NoMatchError) as info:
        freeze(net.prefix, net.meta, ["y", "net/fc/BiasAd"], out=str(out))

    assert "net/fc/BiasAdd" in info.value.closest
    assert "'net/fc/BiasAd'" in str(info.value)
    assert not out.exists()


@pytest.mark.parametrize(
    "values, problem",
    [
        ({"net/conv1/weights": np.zeros([3, 3, 3, 4], np.float32)}, "missing"),
        (
            {
                "net/conv1/weights": np.zeros([3, 3, 3, 4], np.float32),
                "net/conv1/biases": np.zeros([4], np.float32),
                "net/fc/weights": np.zeros([256, 6], np.float32),
                "net/fc/biases": np.zeros([5], np.float32),
            },
            "mismatched",
        ),
    ],
    ids=["checkpoint-lacks-variables", "checkpoint-has-other-shapes"],
)
def test_checkpoint_not_covering_the_graph_is_incomplete(net, tmp_path, values, problem):
    prefix = save_variables(tmp_path / "other" / "model.ckpt", values)
    out = tmp_path / "frozen.pb"

    with pytest.raises(IncompleteRestoreError) as info:
        freeze(prefix, net.meta, ["y"], out=str(out))

    report = info.value.report
    assert not report.is_complete
    message = str(info.value)
    if problem == "missing":
        assert sorted(r.variable_name for r in report.missing) == MODEL[:1] + MODEL[2:]
        assert "missing     net/fc/weights" in message
    else:
        assert [r.variable_name for r in report.shape_mismatched] == ["net/fc/weights"]
        assert "checkpoint [256, 6], model [256, 5]" in message
    assert "strict=False" not in message
    assert not out.exists()


def test_freeze_refuses_a_tf2_saved_model_and_says_what_to_use(tf2_saved_model, tmp_path):
    out = tmp_path / "frozen.pb"

    with pytest.raises(GraphError, match="TF2 SavedModel.*convert_variables_to_constants_v2"):
        freeze(tf2_saved_model, tf2_saved_model, ["StatefulPartitionedCall"], out=str(out))
    assert not out.exists()


def test_missing_checkpoint_raises_checkpoint_not_found(net, tmp_path):
    out = tmp_path / "frozen.pb"

    with pytest.raises(CheckpointNotFoundError):
        freeze(str(tmp_path / "nothing" / "model.ckpt"), net.meta, ["y"], out=str(out))
    assert not out.exists()


def test_freeze_refuses_an_existing_out_unless_overwrite(net, tmp_path):
    out = tmp_path / "frozen.pb"
    out.write_bytes(b"keep me")

    with pytest.raises(OutputExistsError) as info:
        freeze(net.prefix, net.meta, ["y"], out=str(out))
    assert info.value.path == str(out) and not info.value.is_source
    assert out.read_bytes() == b"keep me"
    assert _files(tmp_path) == ["frozen.pb"]

    graph_def = freeze(net.prefix, net.meta, ["y"], out=str(out), overwrite=True)
    assert tf1.GraphDef.FromString(out.read_bytes()) == graph_def


def test_freeze_never_writes_over_the_graph_it_reads(net, tmp_path):
    graph = tmp_path / "model.pb"
    graph.write_bytes(net.graph_def.SerializeToString())

    with pytest.raises(OutputExistsError) as info:
        freeze(net.prefix, str(graph), ["y"], out=str(graph), overwrite=True)
    assert info.value.is_source and info.value.path == str(graph)
    assert graph.read_bytes() == net.graph_def.SerializeToString()


def test_inspect_ranks_real_outputs_before_dangling_control_flow_and_labels_ema_shadows():
    tf1.disable_control_flow_v2()  # TF 1.x graphs: Switch/Merge and their switch_t/switch_f ends
    try:
        with tf.Graph().as_default() as graph:
            flag = tf1.placeholder(tf.bool, [], name="flag")
            x = tf1.placeholder(tf.float32, [None, 2], name="x")
            tf1.cond(flag, lambda: x * 2.0, lambda: x)  # unused: its ends dangle
            w = tf1.get_variable("w", [2, 2])
            tf.identity(tf.matmul(x, w), name="logits")
            ema = tf1.train.ExponentialMovingAverage(0.9)
            ema.apply([w])
            summary = inspect_graph(graph)
    finally:
        tf1.enable_control_flow_v2()
    names = [t.name for t in summary.outputs]
    assert names[0] == "logits:0"
    dangling = [n for n in names if n != "logits:0"]
    assert all(names.index(n) > 0 for n in dangling)
    shadows = [v.name for v in summary.variables if v.ema_shadow]
    assert shadows == ["w/ExponentialMovingAverage"]
    text = str(summary)
    assert "1 EMA shadows" in text and "EMA shadow" in [line for line in text.splitlines()
                                                         if line.strip().startswith("w/Exp")][0]
