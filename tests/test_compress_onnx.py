"""Tests for restorekit/compress/_onnx_backend.py and files.py: tf2onnx conversion checked on ONNX Runtime,
fp16 / int8 Q/DQ, the TensorRT-ready file, Keras model files as sources, inspect of .tflite / .onnx."""

import contextlib
import io
import json
import os
import sys
import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tensorflow as tf
from onnx import numpy_helper

import restorekit
from restorekit.cli import main
from restorekit.compress._files import inspect_model, verify_model
from restorekit.errors import CompressionError, GraphError, InvalidArgumentError, MissingDependencyError
from test_compress import INT8_REL_TOLERANCE, _files, _images, _tf_run, convnet  # noqa: F401 (a fixture)

# An ONNX file carries a few KB that no precision halves: the graph's node and tensor names, and at
# fp16 the Cast nodes that keep the inputs and outputs float32.
STRUCTURE = 4096
# fp32: tf2onnx folds batch norm into the conv and ONNX Runtime sums in another order (measured 1.6e-7).
FP32_TOLERANCE = 1e-5
# fp16: 11-bit mantissas through ~5 layers (measured 1e-4 abs on softmax outputs).
FP16_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def keras_model(tmp_path_factory):
    """A small Keras functional model (conv, batch norm, pool, conv, dense 64, dense 10:
    27k parameters), fitted
    three steps so batch norm's moving statistics are not their initial values; saved as .keras and .h5."""
    import keras

    directory = tmp_path_factory.mktemp("keras")
    keras.utils.set_random_seed(2)
    image = keras.Input((16, 16, 3), name="image")
    net = keras.layers.Conv2D(8, 3, name="conv1")(image)
    net = keras.layers.BatchNormalization(name="bn1")(net)
    net = keras.layers.ReLU()(net)
    net = keras.layers.MaxPooling2D()(net)
    net = keras.layers.Conv2D(16, 3, activation="relu", name="conv2")(net)
    net = keras.layers.Flatten()(net)
    net = keras.layers.Dense(64, activation="relu", name="fc1")(net)
    logits = keras.layers.Dense(10, name="logits")(net)
    model = keras.Model(image, logits)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(5)
    images, labels = _images(rng, 96)
    model.fit(images, labels, batch_size=32, epochs=1, verbose=0)
    model.save(str(directory / "model.keras"))
    with contextlib.redirect_stderr(io.StringIO()):  # Keras' "HDF5 is legacy" notice
        model.save(str(directory / "model.h5"))
    calibration, _ = _images(rng, 100)  # ~100, as for LiteRT: fewer clip held-out activations
    held_out, _ = _images(rng, 8)
    return types.SimpleNamespace(path=str(directory / "model.keras"), h5=str(directory / "model.h5"), model=model,
                                 calibration=calibration, held_out=held_out)


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _ort_run(path, feed):
    session = _session(path)
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    return np.concatenate([session.run([out.name], {inp.name: v[None]})[0] for v in feed]), session


def _dequantize_nodes(model):
    stored = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return [(n, stored) for n in model.graph.node if n.op_type == "DequantizeLinear"], stored


def _case(request, convnet, keras_model):  # noqa: F811 (the fixture)
    if request.param == "tf1-frozen":
        return types.SimpleNamespace(source=convnet.frozen, calibration=convnet.calibration, held_out=convnet.held_out,
                                     output="probs:0", reference=lambda v: _tf_run(convnet.graph_def, v))
    return types.SimpleNamespace(source=keras_model.path, calibration=keras_model.calibration,
                                 held_out=keras_model.held_out, output="output_0",
                                 reference=lambda v: keras_model.model(v, training=False).numpy())


@pytest.fixture(params=["tf1-frozen", "keras-functional"])
def case(request, convnet, keras_model):  # noqa: F811
    return _case(request, convnet, keras_model)


# ---------------------------------------------------------------- the bar: fp32 / fp16 / int8 on two nets


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_onnx_file_runs_on_onnx_runtime_and_agrees_with_tensorflow(case, precision, tmp_path):
    out = tmp_path / "model.onnx"
    data = case.calibration if precision == "int8" else None

    result = restorekit.compress(case.source, str(out), backend="onnx", precision=precision, representative_data=data)

    assert result.backend == "onnx" and result.outputs == (case.output,)
    assert result.size_after == os.path.getsize(out) and result.next_step == ""
    assert result.latency_before_ms > 0 and result.latency_after_ms > 0
    # The file written is the model that was checked: on held-out inputs it agrees with TensorFlow too.
    got, session = _ort_run(out, case.held_out)
    want = case.reference(case.held_out)
    scale = float(np.max(np.abs(want)))
    if precision == "fp32":
        np.testing.assert_allclose(got, want, atol=FP32_TOLERANCE * max(scale, 1))
        assert result.max_error < FP32_TOLERANCE * max(scale, 1)
    elif precision == "fp16":
        assert float(np.max(np.abs(got - want))) / scale < FP16_TOLERANCE
        assert result.max_rel_error[case.output] < FP16_TOLERANCE
    else:
        assert float(np.max(np.abs(got - want))) / scale < INT8_REL_TOLERANCE
        assert result.max_rel_error[case.output] < INT8_REL_TOLERANCE
    # float32 in and out at every precision: a caller feeds the same arrays as to the original.
    assert session.get_inputs()[0].type == session.get_outputs()[0].type == "tensor(float)"
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {17}
    stored = {numpy_helper.to_array(i).dtype.name for i in model.graph.initializer if len(i.dims) >= 2}
    assert stored == {{"fp32": "float32", "fp16": "float16", "int8": "int8"}[precision]}


def test_fp16_is_half_the_fp32_onnx(case, tmp_path):
    fp32 = restorekit.compress(case.source, str(tmp_path / "fp32.onnx"), backend="onnx", precision="fp32", samples=2)
    fp16 = restorekit.compress(case.source, str(tmp_path / "fp16.onnx"), backend="onnx", precision="fp16", samples=2)

    assert fp32.size_after / 2 - STRUCTURE <= fp16.size_after <= fp32.size_after / 2 + STRUCTURE
    model = onnx.load(str(tmp_path / "fp16.onnx"))
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(casts) >= 2  # float32 -> float16 after the input, back before the output


def test_int8_is_symmetric_q_dq_with_per_channel_weights(case, tmp_path):
    out = tmp_path / "model.onnx"
    restorekit.compress(case.source, str(out), backend="onnx", precision="int8", representative_data=case.calibration)

    model = onnx.load(str(out))
    nodes, stored = _dequantize_nodes(model)
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert nodes and quantize
    zero_points = [stored[n.input[2]] for n in quantize + [n for n, _ in nodes] if len(n.input) > 2]
    assert zero_points and all(np.all(z == 0) for z in zero_points)  # symmetric: what TensorRT reads
    weights = [(n, stored[n.input[0]]) for n, _ in nodes if n.input[0] in stored and stored[n.input[0]].ndim >= 2]
    # The conv kernels and dense matrices, each with one scale per output channel.
    assert len(weights) == 4
    for node, weight in weights:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        assert stored[node.input[1]].shape == (weight.shape[axis],) and weight.shape[axis] > 1


# ---------------------------------------------------------------- TensorRT: the file, and the step that remains


def test_tensorrt_writes_the_onnx_and_names_the_engine_build(convnet, tmp_path):  # noqa: F811
    out = tmp_path / "model.onnx"

    result = restorekit.compress(convnet.frozen, str(out), backend="tensorrt", precision="int8",
                                 representative_data=convnet.calibration)

    assert result.backend == "tensorrt" and result.out == str(out)
    assert f"trtexec --onnx={out} --saveEngine={tmp_path / 'model.plan'} --shapes=x:1x16x16x3" in result.next_step
    assert "not built here" in result.next_step and f"next: {result.next_step}" in str(result)
    assert _files(tmp_path) == ["model.onnx"]  # no engine claimed, none written
    assert onnx.load(str(out)).graph.input[0].name == "x"


def test_cli_tensorrt_prints_the_remaining_step(convnet, tmp_path):  # noqa: F811
    out = tmp_path / "m.onnx"
    code, stdout, _ = _cli("compress", convnet.frozen, str(out), "--backend", "tensorrt", "--precision", "fp16")
    assert code == 0 and out.exists()
    assert "(tensorrt fp16, 16 random samples)" in stdout
    assert f"trtexec --onnx={out} --saveEngine={tmp_path / 'm.plan'}" in stdout
    code, stdout, _ = _cli("compress", convnet.frozen, str(tmp_path / "n.onnx"), "--backend", "tensorrt", "--json")
    assert code == 0 and json.loads(stdout)["next_step"].startswith("build the TensorRT engine")


# ---------------------------------------------------------------- sources


def test_saved_model_keeps_its_signature_names(tmp_path):
    class Net(tf.Module):
        def __init__(self):
            self.w = tf.Variable(np.random.RandomState(1).randn(32, 4).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 32], tf.float32)])
        def __call__(self, features):
            return {"scores": tf.nn.relu(tf.matmul(features, self.w))}

    net = Net()
    tf.saved_model.save(net, str(tmp_path / "sm"), signatures=net.__call__)
    out = tmp_path / "m.onnx"

    result = restorekit.compress(str(tmp_path / "sm"), str(out), backend="onnx", precision="fp32")

    assert result.inputs == ("features",) and result.outputs == ("scores",) and result.max_error < 1e-5
    session = _session(out)
    assert [i.name for i in session.get_inputs()] == ["features"] and session.get_outputs()[0].name == "scores"


def test_checkpoint_plus_graph_to_onnx(convnet, tmp_path):  # noqa: F811
    result = restorekit.compress(convnet.prefix, str(tmp_path / "m.onnx"), graph=convnet.meta, outputs="probs",
                                 backend="onnx", precision="fp32", samples=2)
    assert result.size_before == convnet.graph_def.ByteSize() and result.max_error < FP32_TOLERANCE


@pytest.mark.parametrize("backend,precision", [("tflite", "fp16"), ("onnx", "fp32")])
def test_keras_h5_model_file_compresses(keras_model, backend, precision, tmp_path):
    out = tmp_path / f"m.{'tflite' if backend == 'tflite' else 'onnx'}"

    result = restorekit.compress(keras_model.h5, str(out), backend=backend, precision=precision, samples=4)

    assert result.source == keras_model.h5 and result.outputs == ("output_0",)
    assert result.max_rel_error["output_0"] < FP16_TOLERANCE and out.exists()
    assert _files(tmp_path) == [out.name]


def test_keras_weights_file_is_refused_with_what_to_pass(keras_model, tmp_path):
    weights = tmp_path / "only.weights.h5"
    keras_model.model.save_weights(str(weights))
    with pytest.raises(InvalidArgumentError, match="weights only.*model.save"):
        restorekit.compress(str(weights), str(tmp_path / "out" / "m.onnx"), backend="onnx")
    assert _files(tmp_path / "out") == []


# ---------------------------------------------------------------- refusals: an error, nothing written


def test_max_error_exceeded_writes_no_onnx(convnet, tmp_path):  # noqa: F811
    with pytest.raises(CompressionError) as info:
        restorekit.compress(convnet.frozen, str(tmp_path / "m.onnx"), backend="onnx", precision="int8",
                            representative_data=convnet.calibration, max_error=1e-9)
    assert info.value.result.max_error > 1e-9 and "nothing was written" in str(info.value)
    assert info.value.result.backend == "onnx" and _files(tmp_path) == []


@pytest.mark.parametrize("backend", ["onnx", "tensorrt"])
def test_dynamic_int8_is_refused_with_the_reason(convnet, backend, tmp_path):  # noqa: F811
    with pytest.raises(InvalidArgumentError, match="ConvInteger.*explicit Q/DQ.*precision='int8'"):
        restorekit.compress(convnet.frozen, str(tmp_path / "m.onnx"), backend=backend, precision="dynamic-int8")
    assert _files(tmp_path) == []


def test_op_tf2onnx_cannot_map_is_named(tmp_path):
    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        tf.identity(tf.linalg.svd(tf.reshape(x, [-1, 2, 2]), compute_uv=False), name="y")
    out = tmp_path / "out"

    with pytest.raises(CompressionError) as info:
        restorekit.compress(g.as_graph_def(), str(out / "m.onnx"), backend="onnx", precision="fp32")

    assert info.value.ops == ("Svd",) and "no ONNX (opset 17) equivalent" in str(info.value)
    assert _files(out) == []


def test_missing_tf2onnx_names_the_extra(convnet, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "tf2onnx", None)  # what an environment without it imports
    with pytest.raises(MissingDependencyError, match=r"restorekit\[onnx\]"):
        restorekit.compress(convnet.frozen, str(tmp_path / "m.onnx"), backend="onnx")
    assert _files(tmp_path) == []


# ---------------------------------------------------------------- native log lines


def test_compress_keeps_native_log_lines_off_stderr(convnet, tmp_path, capfd):  # noqa: F811
    restorekit.compress(convnet.frozen, str(tmp_path / "m.tflite"), precision="int8",
                        representative_data=convnet.calibration[:10])
    restorekit.compress(convnet.frozen, str(tmp_path / "m.onnx"), backend="onnx", precision="int8",
                        representative_data=convnet.calibration[:10])
    err = capfd.readouterr().err
    assert "XNNPACK" not in err and "fully_quantize" not in err
    assert "deprecated" not in err and "tf2onnx" not in err


@pytest.mark.slow  # a fresh process imports TensorFlow, tf2onnx and ONNX Runtime: ~10-20 s here
def test_cli_process_prints_nothing_on_stderr(convnet, tmp_path):  # noqa: F811
    import subprocess

    npz = tmp_path / "samples.npz"
    np.savez(npz, x=convnet.calibration[:20])
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(restorekit.__file__)))}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    done = subprocess.run(
        [sys.executable, "-m", "restorekit", "compress", convnet.frozen, str(tmp_path / "m.onnx"), "--backend", "onnx",
         "--precision", "int8", "--representative", str(npz)], capture_output=True, text=True, env=env, timeout=300)

    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and "(onnx int8, 20 representative samples)" in done.stdout


# ---------------------------------------------------------------- inspect / verify of .tflite and .onnx


def _cli(*argv):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(argv))
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def model_files(convnet, tmp_path_factory):  # noqa: F811
    directory = tmp_path_factory.mktemp("model-files")
    lite, onnx_path = str(directory / "m.tflite"), str(directory / "m.onnx")
    restorekit.compress(convnet.frozen, lite, precision="fp16", samples=1)
    restorekit.compress(convnet.frozen, onnx_path, backend="onnx", precision="int8",
                        representative_data=convnet.calibration[:20])
    return types.SimpleNamespace(dir=directory, tflite=lite, onnx=onnx_path)


def test_inspect_shows_an_onnx(model_files):
    code, stdout, _ = _cli("inspect", model_files.onnx)

    assert code == 0
    assert stdout.splitlines()[0].startswith(f"{model_files.onnx}: onnx, opset 17, ")
    assert "    x  [" in stdout and ", 16, 16, 3]  float32" in stdout and "    probs  [" in stdout
    assert "Conv x2" in stdout and "QuantizeLinear x" in stdout and "DequantizeLinear x" in stdout
    summary = inspect_model(model_files.onnx)
    kernel = next(t for t in summary.tensors if t.shape == (32, 16, 3, 3))
    assert kernel.dtype == "int8" and kernel.nbytes == 32 * 16 * 9
    code, stdout, _ = _cli("inspect", model_files.onnx, "--json")
    data = json.loads(stdout)
    assert data["format"] == "onnx" and data["inputs"][0]["name"] == "x" and data["ops"]["Conv"] == 2


def test_inspect_shows_a_tflite(model_files):
    code, stdout, _ = _cli("inspect", model_files.tflite)

    assert code == 0 and stdout.splitlines()[0].startswith(f"{model_files.tflite}: tflite, ")
    assert "    x  [1, 16, 16, 3]  float32" in stdout and "    probs  [1, 10]  float32" in stdout
    assert "CONV_2D x2" in stdout and "FULLY_CONNECTED x2" in stdout and "DELEGATE" not in stdout
    summary = inspect_model(model_files.tflite)
    assert any(t.dtype == "float16" and t.shape == (64, 2048) for t in summary.tensors)  # fc1's kernel


def test_verify_passes_sound_files_and_fails_a_truncated_onnx(model_files, tmp_path):
    assert _cli("verify", model_files.onnx)[0] == 0 and _cli("verify", model_files.tflite)[0] == 0
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(open(model_files.onnx, "rb").read()[:5000])

    code, stdout, _ = _cli("verify", str(broken), "--json")

    assert code == 1 and json.loads(stdout)["ok"] is False
    with pytest.raises(GraphError, match="not a readable ONNX model"):
        inspect_model(str(broken))
    assert verify_model(model_files.onnx) == []
