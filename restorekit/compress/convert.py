"""``compress``: check the arguments, convert, run both models on the same samples, write."""

from __future__ import annotations

import os
import re
import time

import numpy as np

from restorekit.bundle import atomic
from restorekit.compress.models import _Lite, _open_source, _quiet_native, _Spec, _tf
from restorekit.compress.result import CompressResult
from restorekit.compress.samples import _concrete_shape, _random_feeds, _sample_feeds
from restorekit.errors import (
    CompressionError,
    InvalidArgumentError,
    MissingDependencyError,
    OutputExistsError,
    format_names,
)

PRECISIONS = ("fp16", "int8", "dynamic-int8", "fp32")
BACKENDS = ("tflite", "tensorrt")
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


def _check_tensorrt() -> None:
    """TF-TRT needs a TensorFlow built with TensorRT and a visible GPU; say which is missing."""
    tf = _tf()
    missing = []
    if not tf.sysconfig.get_build_info().get("is_tensorrt_build", False):
        missing.append(f"this TensorFlow ({tf.__version__}) is not built with TensorRT (TF 2.18+ wheels are not)")
    if not tf.config.list_physical_devices("GPU"):
        missing.append("no GPU is visible")
    if missing:
        raise MissingDependencyError(
            f"backend='tensorrt' needs TensorRT and a GPU: {'; '.join(missing)}. Use backend='tflite' here.")
    raise CompressionError(  # pragma: no cover - no TensorRT build exists to test against
        "backend='tensorrt' is not implemented yet in restorekit; use backend='tflite'.")


def _check_arguments(out: str, precision: str, backend: str, representative_data, max_error, overwrite: bool,
                     source) -> None:
    if precision not in PRECISIONS:
        raise InvalidArgumentError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}.")
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
        raise OutputExistsError(f"out {out!r} is a directory; name a file such as 'model.tflite'.", path=out)
    if os.path.exists(out) and not overwrite:
        raise OutputExistsError(path=out)


def compress(source, out, *, outputs=None, inputs=None, precision: str = "fp16", representative_data=None,
             backend: str = "tflite", max_error: float | None = None, overwrite: bool = False, graph=None,
             signature: str = "serving_default", samples: int = _RANDOM_SAMPLES) -> CompressResult:
    """Convert a model to a smaller one for inference, check it against the original, write it.

        result = restorekit.compress('frozen.pb', 'model.tflite', precision='fp16', max_error=1e-2)
        print(result)        # sizes, latencies, and the max error of every output

    The original (a TF session on the frozen graph, or the SavedModel signature) and the
    compressed model (LiteRT's interpreter) run on the same samples: ``representative_data``
    when given, else ``samples`` seeded random inputs of the inputs' shapes and dtypes (an
    unknown batch dimension becomes 1). The model is written (atomically) only after that.

    Args:
        source: a frozen ``.pb``/``.pbtxt`` or GraphDef; a checkpoint prefix or directory
            (frozen on the way with ``restorekit.freeze``; its graph is ``graph`` or the
            prefix's ``.meta``); or a SavedModel directory.
        out: the ``.tflite`` file to write.
        outputs: output tensor or node names (signature keys for a SavedModel); default
            what ``inspect_graph`` finds. Required for a checkpoint.
        inputs: input names; default the graph's placeholders (the signature's inputs).
        precision: ``'fp16'`` (float16 weights), ``'dynamic-int8'`` (int8 weights, float
            activations), ``'int8'`` (weights and activations, calibrated on
            ``representative_data``), or ``'fp32'``.
        representative_data: an array (one input) or a dict / ``.npz`` of arrays holding
            samples along the first axis, or an iterable of feeds (dicts, or lists in input
            order). Required for ``'int8'``.
        backend: ``'tflite'``, or ``'tensorrt'`` (needs a TensorRT build of TF and a GPU).
        max_error: refuse (write nothing) when any output's max absolute error is larger.
        overwrite: replace an existing ``out``.
        graph: the graph of a checkpoint ``source`` (a ``.meta``, ``.pb`` or GraphDef).
        signature: the SavedModel signature to convert.
        samples: how many random samples to compare on when no data is given.

    Returns:
        A CompressResult: names, sizes, per-output max absolute and relative error, latencies.

    Raises:
        InvalidArgumentError: an unknown precision or backend, ``int8`` without data, bad data.
        OutputExistsError: ``out`` exists (without ``overwrite``) or is the source.
        NoMatchError: an output or input that is not in the model (``closest`` has near misses).
        GraphError: the source is not a usable graph, or is not frozen.
        CompressionError: the converter refuses the model (``ops`` names the ops it has no
            kernel for), or an output moved more than ``max_error`` (``result`` has the numbers).
        MissingDependencyError: TensorRT or a GPU for ``backend='tensorrt'``.
    """
    out = os.fspath(out)
    _check_arguments(out, precision, backend, representative_data, max_error, overwrite, source)
    if backend == "tensorrt":
        _check_tensorrt()
    model, name, size_before = _open_source(source, graph, inputs, outputs, signature)
    try:
        if representative_data is not None:
            feeds, sample_source = _sample_feeds(representative_data, model.inputs), "representative"
        else:
            feeds, sample_source = _random_feeds(model.inputs, samples), "random"
        shapes = {s.key: _concrete_shape(_Spec(s.key, s.dtype, feeds[0][s.key].shape)) for s in model.inputs}
        content = _convert(model, precision, shapes, feeds)
        lite = _Lite(content, model)
        before, latency_before = _timed(model.run, feeds)
        after, latency_after = _timed(lite.run, feeds)
    finally:
        model.close()
    abs_err, rel_err = _errors(model.outputs, before, after)
    result = CompressResult(
        source=name, out=out, backend=backend, precision=precision,
        inputs=tuple(s.key for s in model.inputs), outputs=tuple(model.outputs),
        size_before=size_before, size_after=len(content), max_abs_error=abs_err, max_rel_error=rel_err,
        latency_before_ms=latency_before, latency_after_ms=latency_after, samples=len(feeds),
        sample_source=sample_source,
    )
    if max_error is not None and result.max_error > max_error:
        worst = max(abs_err, key=abs_err.get)
        raise CompressionError(
            f"the {precision} model moved output {worst!r} by up to {abs_err[worst]:.3g}, over max_error="
            f"{max_error:g} ({len(feeds)} {sample_source} samples), so nothing was written.", result=result)
    atomic.write_bytes(out, content)
    return result
