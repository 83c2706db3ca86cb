"""``compress``: check the arguments, convert, run both models on the same samples, write."""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING

import numpy as np

from restorekit._bundle.staging import write_bytes
from restorekit.compress._models import _Lite, _open_source, _quiet_native, _Spec, _tf
from restorekit.compress._result import CompressResult
from restorekit.compress._samples import _concrete_shape, _random_feeds, _sample_feeds
from restorekit.errors import (
    CompressionError,
    InvalidArgumentError,
    OutputExistsError,
    format_names,
)

if TYPE_CHECKING:  # the ONNX backend is imported only when chosen
    from restorekit.compress._onnx_backend import _OnnxRuntime

PRECISIONS = ("fp16", "int8", "dynamic-int8", "fp32")
BACKENDS = ("tflite", "onnx", "tensorrt")
_SUFFIX = {"tflite": ".tflite", "onnx": ".onnx", "tensorrt": ".onnx"}
_RANDOM_SAMPLES = 16


def _converter_ops(error: Exception) -> list[str]:
    """The TF op types a converter error complains about (its structured errors, else its text)."""
    found = [getattr(getattr(item, "operator", None), "name", "") for item in getattr(error, "errors", None) or ()]
    for line in str(error).splitlines():
        if "not supported" in line or "neither a custom op nor a flex op" in line or "failed to legalize" in line:
            found += re.findall(r"\btf\.(\w+)", line)
    ops = []
    for op in found:
        op = op.removeprefix("tf.")
        if op and op not in ops:
            ops.append(op)
    return ops


def _convert(model, precision: str, shapes: dict, feeds: list[dict]) -> bytes:
    tf = _tf()
    converter = model.converter(shapes)
    if precision != "fp32":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if precision == "fp16":
        converter.target_spec.supported_types = [tf.float16]
    elif precision == "int8":
        converter.representative_dataset = model.calibration(feeds)
        # Every op in int8: an op without an int8 kernel is an error, not a silent float island.
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    try:
        with _quiet_native():  # the int8 calibrator prints "fully_quantize: 0, ..." to the native stderr
            return converter.convert()
    except Exception as e:  # the converter's own errors (ConverterError, RuntimeError, ValueError)
        ops = _converter_ops(e)
        if not ops:
            text = " ".join(str(e).split())[:400] or type(e).__name__
            raise CompressionError(f"the TFLite converter refuses the model at {precision}: {text}") from None
        nodes = model.nodes_of(ops)
        where = f" (nodes {format_names(nodes)})" if nodes else ""
        hint = (" precision='dynamic-int8' or 'fp16' keeps float kernels where int8 ones are missing."
                if precision == "int8" else " Replace them in the model, or keep the TensorFlow graph.")
        raise CompressionError(
            f"the TFLite converter has no {'int8' if precision == 'int8' else 'builtin'} kernel for some ops of "
            f"the model{where}.{hint}", ops=ops
        ) from None


def _timed(run, feeds: list[dict]) -> tuple[list[dict], float]:
    run(feeds[0])  # warm-up: allocation and graph setup are not the model's latency
    results, start = [], time.perf_counter()
    for feed in feeds:
        results.append(run(feed))
    return results, (time.perf_counter() - start) * 1000 / len(feeds)


def _errors(outputs: list[str], before: list[dict], after: list[dict]) -> tuple[dict, dict]:
    abs_err, rel_err = {}, {}
    for name in outputs:
        a = [np.asarray(r[name], dtype=np.float64) for r in before]
        b = [np.asarray(r[name], dtype=np.float64) for r in after]
        diff = max((float(np.max(np.abs(x - y))) if x.size else 0.0) for x, y in zip(a, b))
        scale = max((float(np.max(np.abs(x))) if x.size else 0.0) for x in a)
        abs_err[name] = diff
        rel_err[name] = diff / scale if scale > 0 else diff
    return abs_err, rel_err


def _check_arguments(out: str, precision: str, backend: str, representative_data, max_error, overwrite: bool,
                     source) -> None:
    if precision not in PRECISIONS:
        raise InvalidArgumentError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}.")
    if backend != "tflite" and precision == "dynamic-int8":
        raise InvalidArgumentError(
            f"backend={backend!r} does not serve precision='dynamic-int8': ONNX Runtime runs dynamically "
            f"quantized convolutions (ConvInteger) 6-8x slower than fp32 on CPU, and TensorRT reads int8 only "
            f"from explicit Q/DQ nodes. Use precision='int8' with representative_data, or 'fp16'.")
    if precision == "int8" and representative_data is None:
        raise InvalidArgumentError(
            "precision='int8' quantizes activations too, which needs representative_data: about 100 typical "
            "inputs (an array, a dict of arrays or an .npz with samples along the first axis). Without data, "
            "use precision='dynamic-int8' (int8 weights, float activations)."
        )
    if max_error is not None and not max_error >= 0:
        raise InvalidArgumentError(f"max_error must be a number >= 0; got {max_error!r}.")
    if isinstance(source, (str, os.PathLike)) and os.path.exists(out) and os.path.exists(os.fspath(source)):
        if os.path.samefile(out, os.fspath(source)):
            raise OutputExistsError(f"out {out!r} is the model being compressed; pick another path.",
                                    path=out, is_source=True)
    if os.path.isdir(out):
        raise OutputExistsError(f"out {out!r} is a directory; name a file such as "
                              f"'model{_SUFFIX[backend]}'.", path=out)
    if os.path.exists(out) and not overwrite:
        raise OutputExistsError(path=out)


def _next_step(backend: str, out: str, content: bytes) -> str:
    if backend != "tensorrt":
        return ""
    from restorekit.compress._onnx_backend import tensorrt_step

    return (f"build the TensorRT engine on the target GPU (TensorRT 10+; not built here): "
            f"{tensorrt_step(out, content)}")


def compress(source, out, *, outputs=None, inputs=None, precision: str = "fp16", representative_data=None,
             backend: str = "tflite", max_error: float | None = None, overwrite: bool = False, graph=None,
             signature: str = "serving_default", samples: int = _RANDOM_SAMPLES) -> CompressResult:
    """Convert a model to a smaller one for inference, check it against the original, write it.

        result = restorekit.compress('frozen.pb', 'model.tflite', precision='fp16', max_error=1e-2)
        print(result)        # sizes, latencies, and the max error of every output

    The original (a TF session on the frozen graph, or the SavedModel signature) and the
    compressed model (LiteRT's interpreter, or ONNX Runtime's CPU provider) run on the same samples: ``representative_data``
    when given, else ``samples`` seeded random inputs of the inputs' shapes and dtypes (an
    unknown batch dimension becomes 1). The model is written (atomically) only after that.

    Args:
        source: a frozen ``.pb``/``.pbtxt`` or GraphDef; a checkpoint prefix or directory
            (frozen on the way with ``restorekit.freeze``; its graph is ``graph`` or the
            prefix's ``.meta``); a SavedModel directory; or a Keras ``.keras`` / ``.h5`` model
            file (exported with ``model.export()`` to a scratch SavedModel first).
        out: the ``.tflite`` (backend ``'tflite'``) or ``.onnx`` file to write.
        outputs: output tensor or node names (signature keys for a SavedModel); default
            what ``inspect_graph`` finds. Required for a checkpoint.
        inputs: input names; default the graph's placeholders (the signature's inputs).
        precision: ``'fp16'`` (float16 weights), ``'dynamic-int8'`` (int8 weights, float
            activations), ``'int8'`` (weights and activations, calibrated on
            ``representative_data``), or ``'fp32'``. For ONNX: ``fp16`` is float16 weights and
            compute with float32 inputs and outputs; ``int8`` is explicit symmetric Q/DQ (per-channel
            weights, every zero point 0); ``dynamic-int8`` is refused.
        representative_data: an array (one input) or a dict / ``.npz`` of arrays holding
            samples along the first axis, or an iterable of feeds (dicts, or lists in input
            order). Required for ``'int8'``.
        backend: ``'tflite'`` (LiteRT); ``'onnx'`` (tf2onnx, opset 17, checked on ONNX Runtime);
            ``'tensorrt'``: the same ONNX file, TensorRT-ready, with ``result.next_step`` naming
            the engine build (``trtexec``) that remains on the target GPU.
        max_error: refuse (write nothing) when any output's max absolute error is larger.
        overwrite: replace an existing ``out``.
        graph: the graph of a checkpoint ``source`` (a ``.meta``, ``.pb`` or GraphDef).
        signature: the SavedModel signature to convert.
        samples: how many random samples to compare on when no data is given.

    Returns:
        A CompressResult: names, sizes, per-output max absolute and relative error, latencies,
        and the step that remains (``next_step``).

    Raises:
        InvalidArgumentError: an unknown precision or backend, ``int8`` without data, bad data,
            a precision the backend does not serve.
        OutputExistsError: ``out`` exists (without ``overwrite``) or is the source.
        NoMatchError: an output or input that is not in the model (``closest`` has near misses).
        GraphError: the source is not a usable graph, or is not frozen.
        CompressionError: the converter refuses the model (``ops`` names the ops it has no
            kernel for), or an output moved more than ``max_error`` (``result`` has the numbers).
        MissingDependencyError: tf2onnx / onnx / onnxruntime for the ONNX backends
            (``pip install 'restorekit[onnx]'``), LiteRT for ``'tflite'``.
    """
    out = os.fspath(out)
    _check_arguments(out, precision, backend, representative_data, max_error, overwrite, source)
    if backend != "tflite":
        from restorekit.compress import _onnx_backend as onnx_backend

        onnx_backend.require()  # before loading the model: a missing extra is the first thing to say
    model, name, size_before = _open_source(source, graph, inputs, outputs, signature)
    try:
        if representative_data is not None:
            feeds, sample_source = _sample_feeds(representative_data, model.inputs), "representative"
        else:
            feeds, sample_source = _random_feeds(model.inputs, samples), "random"
        shapes = {s.key: _concrete_shape(_Spec(s.key, s.dtype, feeds[0][s.key].shape)) for s in model.inputs}
        compressed: _Lite | _OnnxRuntime
        if backend == "tflite":
            content = _convert(model, precision, shapes, feeds)
            compressed = _Lite(content, model)
        else:
            from restorekit.compress import _onnx_backend as onnx_backend

            content, compressed = onnx_backend.convert(model, precision, feeds)
        before, latency_before = _timed(model.run, feeds)
        after, latency_after = _timed(compressed.run, feeds)
    finally:
        model.close()
    abs_err, rel_err = _errors(model.outputs, before, after)
    result = CompressResult(
        source=name, out=out, backend=backend, precision=precision,
        inputs=tuple(s.key for s in model.inputs), outputs=tuple(model.outputs),
        size_before=size_before, size_after=len(content), max_abs_error=abs_err, max_rel_error=rel_err,
        latency_before_ms=latency_before, latency_after_ms=latency_after, samples=len(feeds),
        sample_source=sample_source, next_step=_next_step(backend, out, content),
    )
    if max_error is not None and result.max_error > max_error:
        worst = max(abs_err, key=abs_err.__getitem__)
        raise CompressionError(
            f"the {precision} model moved output {worst!r} by up to {abs_err[worst]:.3g}, over max_error="
            f"{max_error:g} ({len(feeds)} {sample_source} samples), so nothing was written.", result=result)
    write_bytes(out, content)
    return result
