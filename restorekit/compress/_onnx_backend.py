"""The ONNX backend of ``compress``: tf2onnx conversion, fp16 and int8 (Q/DQ) rewrites, ONNX Runtime.

The ONNX file this writes is also what TensorRT builds engines from: TensorRT 11 takes
its precision from the graph itself (float16 tensors, explicit symmetric Q/DQ nodes), so
``backend='tensorrt'`` writes the same file and names the engine build that remains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings

from restorekit.compress._models import _quiet_native, _tf
from restorekit.errors import CompressionError, MissingDependencyError, format_names

OPSET = 17  # tf2onnx 1.17 refuses 19; 17 is what TensorRT 8.6+ and ONNX Runtime 1.14+ all read
_EXTRA = "pip install 'restorekit[onnx]'"


def require():
    _tf()  # tf2onnx imports TensorFlow: through restorekit's one import point, so its start-up lines stay quiet
    try:
        with _quiet_native():
            import onnx
            import onnxruntime
            import tf2onnx
    except ImportError as e:
        raise MissingDependencyError(
            f"backend='onnx' needs tf2onnx, onnx and onnxruntime ({e.name} is missing): {_EXTRA}.") from None
    return tf2onnx, onnx, onnxruntime


@contextlib.contextmanager
def _quiet():
    """tf2onnx's and TF's Python log lines (deprecations inside tf2onnx's freezing) and their warnings.

    They describe tf2onnx's internals, not the user's model; errors still raise.
    """
    loggers = [logging.getLogger(n) for n in ("tensorflow", "tf2onnx", "onnxruntime")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), _quiet_native():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _plain_name(name: str) -> str:
    return name[:-2] if name.endswith(":0") else name


def to_onnx(model, opset: int = OPSET):
    """The float32 ONNX ModelProto of ``model`` (a frozen graph or a SavedModel signature).

    Tensors are renamed for the people who load the file: a frozen graph's ``x:0`` becomes
    ``x``, a SavedModel's inputs and outputs take their signature keys.
    """
    tf2onnx, _, _ = require()
    from tf2onnx import tf_loader

    with _quiet():
        if getattr(model, "signature", None) is not None:
            graph_def, inputs, outputs, rename = tf_loader.from_saved_model(
                model.path, None, None, tag=["serve"], signatures=[model.signature], return_tensors_to_rename=True)
        else:
            graph_def, inputs = model.graph_def, [s.key for s in model.inputs]
            outputs = list(model.outputs)
            rename = {t: _plain_name(t) for t in inputs + outputs}
            if len(set(rename.values())) != len(rename):
                rename = {}
        try:
            proto, _ = tf2onnx.convert.from_graph_def(graph_def, input_names=inputs, output_names=outputs,
                                                      opset=opset, tensors_to_rename=rename)
        except Exception as e:  # tf2onnx raises ValueError/KeyError/RuntimeError for ops it cannot map
            text = " ".join(str(e).split())[:400] or type(e).__name__
            raise CompressionError(f"tf2onnx cannot convert the model to ONNX (opset {opset}): {text}") from None
    _check_ops(proto, opset)
    return proto, rename


def _check_ops(proto, opset: int) -> None:
    """tf2onnx logs the TF ops it cannot map and leaves them in the graph as they were: refuse those."""
    import onnx

    unknown = [n for n in proto.graph.node if not onnx.defs.has(n.op_type, n.domain)]
    if unknown:
        ops = list(dict.fromkeys(n.op_type for n in unknown))
        nodes = [n.name for n in unknown]
        raise CompressionError(
            f"tf2onnx has no ONNX (opset {opset}) equivalent for some ops of the model (nodes "
            f"{format_names(nodes)}). Replace them in the model, or keep the TensorFlow graph.", ops=ops)


def _step(what: str, run, *args):
    """Run an ONNX Runtime tool; its failures (bare Exceptions, some of them) become a CompressionError."""
    try:
        return run(*args)
    except Exception as e:
        text = " ".join(str(e).split())[:400] or type(e).__name__
        raise CompressionError(f"ONNX Runtime's {what} fails on the converted model: {text}") from None


def to_fp16(proto):
    """float16 weights and compute, float32 inputs and outputs (Casts at the edges).

    ONNX Runtime ships the converter (``onnxruntime.transformers.float16``, the one
    onnxconverter-common maintains), so no library is added for it.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    with _quiet():
        converted = OnnxModel(convert_float_to_float16(proto, keep_io_types=True))
        converted.topological_sort()  # the converter appends the input Casts last; ONNX wants them first
    return converted.model


def optimized(proto):
    """The graph after ONNX Runtime's pre-processing: shape inference and its basic, provider-independent
    rewrites (batch norm folded into the conv before it, MatMul + Add into Gemm, constants folded).

    The result is plain ONNX (any runtime, TensorRT too); quantizing it calibrates the fused
    ops, which ONNX Runtime's quantization guide asks for.
    """
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(prefix="restorekit-onnx-") as tmp, _quiet():
        # quant_pre_process reads and writes files; these are scratch copies, never the output.
        source, target = os.path.join(tmp, "in.onnx"), os.path.join(tmp, "out.onnx")
        onnx.save_model(proto, source)
        _step("pre-processing (shape inference, graph optimization)", quant_pre_process, source, target)
        return onnx.load_model(target)


class _Feeds:
    """An ONNX Runtime CalibrationDataReader over restorekit feeds (keys renamed to the ONNX inputs)."""

    def __init__(self, feeds, names):
        self._items = iter([{names[k]: v for k, v in feed.items()} for feed in feeds])

    def get_next(self):
        return next(self._items, None)


def to_int8(proto, feeds: list[dict], names: dict):
    """Explicit symmetric Q/DQ int8: per-channel weights, per-tensor activations, every zero point 0.

    Calibrated (min/max) on ``feeds``. Symmetric int8 on both sides is what TensorRT
    accepts for explicit quantization, and what ONNX Runtime's CPU kernels run fast.

    The weights use 7 of the 8 bits (``reduce_range``: integers in [-64, 64]). On x86 CPUs
    without VNNI (AVX2 only), ONNX Runtime fuses the Q/DQ pairs into QLinearConv / QGemm with
    the activations moved to uint8, and its u8 x s8 kernels add products pairwise in int16:
    255 * 127 * 2 overflows, 255 * 64 * 2 does not. With full-range weights those sums clip
    there and outputs move by tens of percent. ``quantize_static``'s own guide asks for
    ``reduce_range`` on such CPUs, above all with per-channel weights; a file may be run on
    any CPU, so it always gives up that bit.
    """
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    reader = type("_Reader", (_Feeds, CalibrationDataReader), {})(feeds, names)
    with tempfile.TemporaryDirectory(prefix="restorekit-onnx-") as tmp, _quiet():
        # quantize_static reads and writes files; these are scratch copies, never the output.
        source, target = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "int8.onnx")
        onnx.save_model(proto, source)
        _step("int8 quantization", lambda: quantize_static(
            source, target, reader, quant_format=QuantFormat.QDQ, per_channel=True, reduce_range=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True}))
        return onnx.load_model(target)


class _OnnxRuntime:
    """The converted model on ONNX Runtime's CPU provider, fed and read by the original's names."""

    def __init__(self, content: bytes, original, rename: dict):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: its graph-optimizer notes are not the user's business
        with _quiet():
            self.session = ort.InferenceSession(content, options, providers=["CPUExecutionProvider"])
        self.inputs = {s.key: rename.get(s.key, s.key) for s in original.inputs}
        self.outputs = {n: rename.get(n, n) for n in original.outputs}

    def run(self, feed: dict) -> dict:
        values = self.session.run(list(self.outputs.values()), {self.inputs[k]: v for k, v in feed.items()})
        return dict(zip(self.outputs, values))


def convert(model, precision: str, feeds: list[dict]) -> tuple[bytes, _OnnxRuntime]:
    """(the ONNX file's bytes, a runner of them); checked by ``onnx.checker`` on the way."""
    _, onnx, _ = require()
    proto, rename = to_onnx(model)
    proto = optimized(proto)
    names = {s.key: rename.get(s.key, s.key) for s in model.inputs}
    if precision == "fp16":
        proto = to_fp16(proto)
    elif precision == "int8":
        proto = to_int8(proto, feeds, names)
    proto.producer_name = "restorekit (tf2onnx)"
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:  # pragma: no cover - a converter bug, not a user error
        raise CompressionError(f"the {precision} ONNX model fails onnx.checker: {e}") from None
    content = proto.SerializeToString()
    return content, _OnnxRuntime(content, model, rename)


def tensorrt_step(out: str, content: bytes) -> str:
    """The command that builds the TensorRT engine from ``out`` on the target GPU (not run here)."""
    import onnx

    proto = onnx.load_model_from_string(content)
    initializers = {i.name for i in proto.graph.initializer}
    shapes = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in value.type.tensor_type.shape.dim]
        if any(d <= 0 for d in dims):  # a dynamic dimension: build the engine for batch 1, the shape checked
            shapes.append(f"{value.name}:{'x'.join(str(d if d > 0 else 1) for d in dims)}")
    plan = os.path.splitext(out)[0] + ".plan"
    line = f"trtexec --onnx={out} --saveEngine={plan}"
    if shapes:
        line += f" --shapes={','.join(shapes)}"
    return line
