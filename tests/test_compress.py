"""Tests for restorekit/compress/: real TF1 nets, frozen with restorekit.freeze, compressed and run by LiteRT."""

import contextlib
import io
import json
import os
import types

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim
from ai_edge_litert.interpreter import Interpreter

import restorekit
from restorekit.cli import main
from restorekit.errors import (
    CompressionError,
    GraphError,
    InvalidArgumentError,
    NoMatchError,
    OutputExistsError,
)
from restorekit.graph import freeze
from test_graph import _build, _build_training_batch_norm

tf1 = tf.compat.v1

# TFLite's flatbuffer carries a fixed few KB (tensor table with fused names, op codes,
# signature, metadata) that no precision shrinks; on a 540 KB net that alone is the
# 0.2-0.4% by which fp16 lands above exactly half.
STRUCTURE = 4096
# Full int8: every activation is requantized to 255 levels of the range seen in
# calibration, half a step (0.2% of that range) per layer, compounding through ~5 layers,
# with the weights per channel in int8 too. Measured: about 2% of the output's range.
# 5% leaves room for the seed while a broken calibration (wrong input scale, too few
# samples) moves outputs by tens of percent.
INT8_REL_TOLERANCE = 0.05


def _convnet(is_training: bool):
    """conv-bn-relu, pool, conv-bn-relu, fc 64, logits 10: about 137k parameters, 540 KB in float32."""
    x = tf1.placeholder(tf.float32, [None, 16, 16, 3], name="x")
    bn = {"is_training": is_training, "updates_collections": None, "fused": True, "scale": True}
    with slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm, normalizer_params=bn):
        net = slim.conv2d(x, 16, [3, 3], scope="conv1")
        net = slim.max_pool2d(net, [2, 2])
        net = slim.conv2d(net, 32, [3, 3], scope="conv2")
    net = slim.flatten(net)
    net = slim.fully_connected(net, 64, scope="fc1")
    logits = slim.fully_connected(net, 10, activation_fn=None, scope="logits")
    return x, logits, tf.nn.softmax(logits, name="probs")


def _images(rng, n):
    # Images with a class-dependent mean, so a few steps of training find something to learn.
    labels = rng.randint(0, 10, n)
    images = rng.rand(n, 16, 16, 3).astype(np.float32) * 0.5 + (labels / 20.0)[:, None, None, None]
    return images.astype(np.float32), labels.astype(np.int32)


@pytest.fixture(scope="module")
def convnet(tmp_path_factory):
    """Trained 30 Adam steps in graph mode, saved; the eval graph (batch norm on moving averages)
    exported as a .meta and frozen with restorekit.freeze."""
    directory = tmp_path_factory.mktemp("convnet")
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        x, logits, _ = _convnet(is_training=True)
        labels = tf1.placeholder(tf.int32, [None])
        loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
        train = tf1.train.AdamOptimizer(1e-3).minimize(loss, global_step=tf1.train.get_or_create_global_step())
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(30):
                images, classes = _images(rng, 32)
                sess.run(train, {x: images, labels: classes})
            prefix = saver.save(sess, str(directory / "model.ckpt"), global_step=30)
    with tf.Graph().as_default():
        _convnet(is_training=False)
        tf1.train.get_or_create_global_step()
        tf1.train.export_meta_graph(str(directory / "eval.meta"))
    frozen = str(directory / "frozen.pb")
    graph_def = freeze(prefix, str(directory / "eval.meta"), ["probs"], out=frozen)
    calibration, _ = _images(rng, 100)
    held_out, _ = _images(rng, 8)
    return types.SimpleNamespace(dir=directory, prefix=prefix, meta=str(directory / "eval.meta"), frozen=frozen,
                                 graph_def=graph_def, calibration=calibration, held_out=held_out)


def _tf_run(graph_def, feed, output="probs:0"):
    with tf.Graph().as_default():
        tf1.import_graph_def(graph_def, name="")
        with tf1.Session() as sess:
            return np.concatenate([sess.run(output, {"x:0": v[None]}) for v in feed])


def _lite_run(path, feed):
    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()
    results = []
    for v in feed:
        interpreter.set_tensor(inp["index"], v[None])
        interpreter.invoke()
        results.append(interpreter.get_tensor(out["index"]).copy())
    return np.concatenate(results), interpreter


def _files(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ---------------------------------------------------------------- the bar, on a trained conv net


def test_fp16_is_half_the_float32_size_and_within_1e_2(convnet, tmp_path):
    out = tmp_path / "model.tflite"

    result = restorekit.compress(convnet.frozen, str(out), precision="fp16")

    assert result.size_before == os.path.getsize(convnet.frozen) and result.size_after == os.path.getsize(out)
    assert result.size_after <= result.size_before / 2 + STRUCTURE
    assert result.inputs == ("x:0",) and result.outputs == ("probs:0",)
    assert result.samples == 16 and result.sample_source == "random"
    assert 0 <= result.max_abs_error["probs:0"] < 1e-2
    assert isinstance(result.latency_before_ms, float) and isinstance(result.latency_after_ms, float)
    # The file written is the model that was checked: held-out inputs agree the same way.
    lite, interpreter = _lite_run(out, convnet.held_out)
    np.testing.assert_allclose(lite, _tf_run(convnet.graph_def, convnet.held_out), atol=1e-2)
    assert {d["dtype"] for d in interpreter.get_tensor_details()} >= {np.float16}


def test_dynamic_int8_is_about_a_quarter(convnet, tmp_path):
    out = tmp_path / "model.tflite"

    result = restorekit.compress(convnet.frozen, str(out), precision="dynamic-int8")

    assert 0.2 <= result.ratio <= 0.3
    assert result.max_rel_error["probs:0"] < INT8_REL_TOLERANCE
    assert os.path.getsize(out) == result.size_after


def test_full_int8_with_100_representative_samples(convnet, tmp_path):
    out = tmp_path / "model.tflite"

    result = restorekit.compress(convnet.frozen, str(out), precision="int8", representative_data=convnet.calibration)

    assert result.samples == 100 and result.sample_source == "representative"
    assert 0.2 <= result.ratio <= 0.3
    assert result.max_rel_error["probs:0"] < INT8_REL_TOLERANCE
    _, interpreter = _lite_run(out, convnet.held_out[:1])
    kinds = {d["dtype"] for d in interpreter.get_tensor_details()}
    assert np.int8 in kinds and np.float16 not in kinds  # activations too, not only weights


def test_checkpoint_is_frozen_on_the_way_like_freeze_then_compress(convnet, tmp_path):
    out = tmp_path / "model.tflite"

    result = restorekit.compress(convnet.prefix, str(out), graph=convnet.meta, outputs="probs", precision="fp16")

    assert result.source == convnet.prefix and result.outputs == ("probs:0",)
    assert result.size_before == convnet.graph_def.ByteSize()
    assert result.max_abs_error["probs:0"] < 1e-2
    assert result.size_after == os.path.getsize(out)


def test_saved_model_signature(tmp_path):
    class Net(tf.Module):
        def __init__(self):
            rng = np.random.RandomState(1)
            self.w = tf.Variable(rng.randn(32, 64).astype(np.float32))
            self.v = tf.Variable(rng.randn(64, 4).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 32], tf.float32)])
        def __call__(self, features):
            return {"scores": tf.matmul(tf.nn.relu(tf.matmul(features, self.w)), self.v)}

    net = Net()
    tf.saved_model.save(net, str(tmp_path / "sm"), signatures=net.__call__)

    result = restorekit.compress(str(tmp_path / "sm"), str(tmp_path / "model.tflite"), precision="fp16")

    assert result.inputs == ("features",) and result.outputs == ("scores",)
    assert result.max_rel_error["scores"] < 1e-2
    assert result.size_after < result.size_before


def test_result_prints_a_table_and_round_trips_json(convnet, tmp_path):
    result = restorekit.compress(convnet.frozen, str(tmp_path / "m.tflite"), precision="fp16", samples=2)
    text = str(result)
    assert text.splitlines()[0] == f"restorekit: {convnet.frozen} -> {tmp_path / 'm.tflite'} (tflite fp16, 2 random samples)"
    assert "size" in text and "latency" in text and "probs:0" in text and "0.50x" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert data["max_abs_error"] == {"probs:0": result.max_abs_error["probs:0"]}


# ---------------------------------------------------------------- the real TF 1.x graphs test_graph freezes


@pytest.fixture(scope="module", params=["slim-momentum-ref", "slim-training-batch-norm"])
def tf1_graph(request, tmp_path_factory):
    """test_graph's tf-slim nets (VariableV2, a Momentum step; fused batch norm in training
    mode with its updates inline), one step trained, frozen with restorekit.freeze."""
    directory = tmp_path_factory.mktemp(request.param)
    rng = np.random.RandomState(4)
    with tf.Graph().as_default():
        if request.param == "slim-momentum-ref":
            x, _, train_op = _build(use_resource=False)
            output = "y"
        else:
            x, train_op = _build_training_batch_norm(use_resource=False)
            output = "net/logits/BiasAdd"
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train_op, {x: rng.randn(4, 8, 8, 3).astype(np.float32)})
            prefix = saver.save(sess, str(directory / "model.ckpt"), global_step=1)
    frozen = str(directory / "frozen.pb")
    freeze(prefix, prefix + ".meta", [output], out=frozen)
    return types.SimpleNamespace(frozen=frozen, output=f"{output}:0",
                                 calibration=rng.randn(100, 8, 8, 3).astype(np.float32))


@pytest.mark.parametrize("precision", ["fp16", "dynamic-int8", pytest.param("int8", marks=pytest.mark.slow)])
def test_real_tf1_graph_converts_and_stays_close(tf1_graph, precision, tmp_path):
    data = tf1_graph.calibration if precision == "int8" else None

    result = restorekit.compress(tf1_graph.frozen, str(tmp_path / "m.tflite"), precision=precision,
                                 representative_data=data)

    assert result.outputs == (tf1_graph.output,)
    tolerance = 1e-2 if precision == "fp16" else INT8_REL_TOLERANCE
    assert result.max_rel_error[tf1_graph.output] < tolerance
    # No size bar here: these nets hold ~1.4k and ~0.2k parameters, so TFLite's few KB of fixed
    # structure decide the size (docs/deploy.md lists the numbers).
    assert result.size_after == os.path.getsize(tmp_path / "m.tflite")


# ---------------------------------------------------------------- bad input: an error, nothing written


def test_op_the_converter_refuses_is_named(tmp_path):
    with tf.Graph().as_default() as g:
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        tf.identity(tf.math.erfinv(tf.tanh(x)), name="y")
    out = tmp_path / "out"

    with pytest.raises(CompressionError) as info:
        restorekit.compress(g.as_graph_def(), str(out / "m.tflite"))

    assert info.value.ops == ("Erfinv",)
    assert "'Erfinv'" in str(info.value) and "'erfinv/Erfinv'" in str(info.value)
    assert _files(out) == []


def test_op_the_converter_refuses_in_a_saved_model_is_named(tmp_path):
    class Net(tf.Module):
        def __init__(self):
            self.w = tf.Variable(np.eye(4, dtype=np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def __call__(self, features):
            return {"y": tf.math.erfinv(tf.tanh(tf.matmul(features, self.w)))}

    net = Net()
    tf.saved_model.save(net, str(tmp_path / "sm"), signatures=net.__call__)
    out = tmp_path / "out"

    with pytest.raises(CompressionError) as info:
        restorekit.compress(str(tmp_path / "sm"), str(out / "m.tflite"))

    assert info.value.ops == ("Erfinv",)
    assert "'Erfinv'" in str(info.value) and "(nodes 'erfinv/Erfinv')" in str(info.value)
    assert _files(out) == []


def test_output_that_does_not_exist_names_close_ones(convnet, tmp_path):
    with pytest.raises(NoMatchError) as info:
        restorekit.compress(convnet.frozen, str(tmp_path / "m.tflite"), outputs=["prob"])

    assert "probs" in info.value.closest and "Closest: " in str(info.value)
    assert _files(tmp_path) == []


def test_int8_without_data_is_refused_before_converting(convnet, tmp_path):
    with pytest.raises(InvalidArgumentError, match="representative_data.*dynamic-int8"):
        restorekit.compress(convnet.frozen, str(tmp_path / "m.tflite"), precision="int8")
    assert _files(tmp_path) == []


def test_existing_output_is_kept(convnet, tmp_path):
    out = tmp_path / "m.tflite"
    out.write_bytes(b"keep me")

    with pytest.raises(OutputExistsError) as info:
        restorekit.compress(convnet.frozen, str(out))

    assert info.value.path == str(out) and "overwrite=True" in str(info.value)
    assert out.read_bytes() == b"keep me" and _files(tmp_path) == ["m.tflite"]
    restorekit.compress(convnet.frozen, str(out), overwrite=True, samples=1)
    assert out.read_bytes()[4:8] == b"TFL3"


def test_max_error_exceeded_writes_nothing_and_carries_the_numbers(convnet, tmp_path):
    with pytest.raises(CompressionError) as info:
        restorekit.compress(convnet.frozen, str(tmp_path / "m.tflite"), precision="dynamic-int8", max_error=1e-9)

    result = info.value.result
    assert result.max_error > 1e-9 and "nothing was written" in str(info.value)
    assert _files(tmp_path) == []


def test_checkpoint_without_outputs_lists_candidates(convnet, tmp_path):
    with pytest.raises(InvalidArgumentError, match="needs outputs=.*'probs:0'"):
        restorekit.compress(convnet.prefix, str(tmp_path / "m.tflite"), graph=convnet.meta)
    assert _files(tmp_path) == []


def test_unfrozen_graph_is_a_graph_error(convnet, tmp_path):
    with pytest.raises(GraphError, match="not frozen"):
        restorekit.compress(convnet.meta, str(tmp_path / "m.tflite"))
    assert _files(tmp_path) == []


# ---------------------------------------------------------------- CLI


def _cli(*argv):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(argv))
    return code, stdout.getvalue(), stderr.getvalue()


def test_cli_compress_int8_with_an_npz_prints_the_table(convnet, tmp_path):
    npz = tmp_path / "samples.npz"
    np.savez(npz, x=convnet.calibration)
    out = tmp_path / "m.tflite"

    code, stdout, _ = _cli("compress", convnet.frozen, str(out), "--precision", "int8", "--representative",
                           str(npz), "--max-error", "0.5")

    assert code == 0 and out.exists()
    assert "(tflite int8, 100 representative samples)" in stdout and "probs:0" in stdout


def test_cli_json_and_errors(convnet, tmp_path):
    out = tmp_path / "m.tflite"
    code, stdout, _ = _cli("compress", convnet.frozen, str(out), "--outputs", "probs", "--json")
    assert code == 0 and json.loads(stdout)["outputs"] == ["probs:0"]

    code, _, stderr = _cli("compress", convnet.frozen, str(out))
    assert code == 3 and stderr.startswith("restorekit: error: ") and "--overwrite" in stderr

    code, _, stderr = _cli("compress", convnet.frozen, str(tmp_path / "n.tflite"), "--precision", "int4")
    assert code == 2 and "int4" in stderr
    assert _files(tmp_path) == ["m.tflite"]
