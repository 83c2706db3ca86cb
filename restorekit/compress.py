"""Compress a trained model for inference (TFLite / LiteRT fp16 or int8), checked against the original.

``compress`` takes a frozen ``.pb``, a checkpoint plus its graph (frozen on the way with
``freeze``) or a SavedModel, converts it, runs the original and the compressed model on
the same inputs, and writes the result only when it computes what the original did.
TensorFlow and LiteRT load inside the functions that use them.
"""

from __future__ import annotations

import math
import os
import re
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from restorekit.bundle import atomic
from restorekit.errors import (
    CheckpointNotFoundError,
    CompressionError,
    GraphError,
    InvalidArgumentError,
    MissingDependencyError,
    NoMatchError,
    OutputExistsError,
    RestoreKitWarning,
    format_names,
)

__all__ = ["BACKENDS", "PRECISIONS", "CompressResult", "compress"]

PRECISIONS = ("fp16", "int8", "dynamic-int8", "fp32")
BACKENDS = ("tflite", "tensorrt")
_RANDOM_SAMPLES = 16
_EXTRA = "pip install 'restorekit[compress]'"


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass(frozen=True)
class CompressResult:
    """What ``compress`` wrote and how far the compressed outputs moved from the original.

    ``max_abs_error[name]`` is the largest ``|original - compressed|`` over every element
    of every sample; ``max_rel_error[name]`` is that divided by the largest ``|original|``
    (the error as a fraction of the output's range, which stays meaningful where single
    elements are near zero). Latencies are the mean milliseconds per sample on this
    machine (one warm-up run first); a value, not a benchmark.
    """

    source: str
    out: str
    backend: str
    precision: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    size_before: int
    size_after: int
    max_abs_error: dict = field(default_factory=dict)
    max_rel_error: dict = field(default_factory=dict)
    latency_before_ms: float = 0.0
    latency_after_ms: float = 0.0
    samples: int = 0
    sample_source: str = "random"

    @property
    def ratio(self) -> float:
        """Size after / size before."""
        return self.size_after / self.size_before if self.size_before else math.nan

    @property
    def max_error(self) -> float:
        """The largest absolute error over all outputs."""
        return max(self.max_abs_error.values(), default=0.0)

    def to_dict(self) -> dict:
        """Plain JSON-ready data."""
        return {
            "source": self.source, "out": self.out, "backend": self.backend, "precision": self.precision,
            "inputs": list(self.inputs), "outputs": list(self.outputs),
            "size_before": self.size_before, "size_after": self.size_after, "ratio": self.ratio,
            "max_abs_error": dict(self.max_abs_error), "max_rel_error": dict(self.max_rel_error),
            "latency_before_ms": self.latency_before_ms, "latency_after_ms": self.latency_after_ms,
            "samples": self.samples, "sample_source": self.sample_source,
        }

    def __str__(self) -> str:
        head = (f"restorekit: {self.source} -> {self.out} ({self.backend} {self.precision}, "
                f"{self.samples} {self.sample_source} samples)")
        rows = [
            ("", "original", "compressed", ""),
            ("size", _format_bytes(self.size_before), _format_bytes(self.size_after), f"{self.ratio:.2f}x"),
            ("latency", f"{self.latency_before_ms:.3f} ms", f"{self.latency_after_ms:.3f} ms", "per sample"),
        ]
        errors = [("output", "max abs error", "max rel error", "")]
        errors += [(name, f"{self.max_abs_error[name]:.3g}", f"{self.max_rel_error[name]:.3g}", "")
                   for name in self.outputs]
        lines = [head]
        for block in (rows, errors):
            widths = [max(len(r[i]) for r in rows + errors) for i in range(4)]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in block]
        return "\n".join(lines)


# ---------------------------------------------------------------- the models being compared


def _tf():
    import tensorflow as tf

    return tf


@dataclass(frozen=True)
class _Spec:
    """One input: its key (a tensor name, or a SavedModel signature key), dtype and shape."""

    key: str
    dtype: str
    shape: tuple | None


class _FrozenGraph:
    """A frozen GraphDef: run in a TF session, converted by the TF1 converter."""

    def __init__(self, graph_def, inputs: list[_Spec], outputs: list[str]):
        tf = _tf()
        self.graph_def, self.inputs, self.outputs = graph_def, inputs, outputs
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
        self.session = tf.compat.v1.Session(graph=self.graph)

    def run(self, feed: dict) -> dict:
        values = self.session.run(self.outputs, {k: v for k, v in feed.items()})
        return dict(zip(self.outputs, values))

    def converter(self, shapes: dict):
        tf = _tf()
        tensors = [self.graph.get_tensor_by_name(s.key) for s in self.inputs]
        for spec, tensor in zip(self.inputs, tensors):
            tensor.set_shape(shapes[spec.key])
        outputs = [self.graph.get_tensor_by_name(name) for name in self.outputs]
        return tf.compat.v1.lite.TFLiteConverter.from_session(self.session, tensors, outputs)

    def calibration(self, feeds: list[dict]):
        return lambda: ([feed[s.key] for s in self.inputs] for feed in feeds)

    def nodes_of(self, ops) -> list[str]:
        return [n.name for n in self.graph_def.node if n.op in ops]

    def close(self) -> None:
        self.session.close()


class _SavedModel:
    """A SavedModel signature: run through ``tf.saved_model.load``, converted from the directory."""

    def __init__(self, path: str, signature: str, outputs: list[str] | None):
        tf = _tf()
        self.path, self.signature = path, signature
        loaded = tf.saved_model.load(path)
        if signature not in loaded.signatures:
            raise NoMatchError(f"{path!r} has no signature {signature!r}.", name=signature,
                               candidates=list(loaded.signatures))
        self.function = loaded.signatures[signature]
        self._loaded = loaded  # keeps the variables the signature captures alive
        specs = self.function.structured_input_signature[1]
        self.inputs = [_Spec(k, s.dtype.name, tuple(s.shape.as_list()) if s.shape.rank is not None else None)
                       for k, s in sorted(specs.items())]
        keys = sorted(self.function.structured_outputs)
        self.outputs = _pick(outputs, keys, f"signature {signature!r} of {path!r}", "output")

    def run(self, feed: dict) -> dict:
        result = self.function(**{k: _tf().constant(v) for k, v in feed.items()})
        return {name: result[name].numpy() for name in self.outputs}

    def converter(self, shapes: dict):
        return _tf().lite.TFLiteConverter.from_saved_model(self.path, signature_keys=[self.signature])

    def calibration(self, feeds: list[dict]):
        return lambda: (dict(feed) for feed in feeds)

    def nodes_of(self, ops) -> list[str]:
        return []

    def close(self) -> None:
        pass


class _Lite:
    """The compressed model, run by LiteRT's interpreter (TF's deprecated one if LiteRT is missing)."""

    def __init__(self, content: bytes, original):
        self.interpreter = _interpreter_class()(model_content=content)
        self.signature = getattr(original, "signature", None)
        if self.signature is not None:
            self.runner = self.interpreter.get_signature_runner(self.signature)
            return
        self.interpreter.allocate_tensors()
        details = self.interpreter.get_input_details()
        # The TF1 converter names tensors by their node names, in the order it was given.
        by_name = {d["name"]: d for d in details}
        self.input_details = [by_name.get(s.key.rsplit(":", 1)[0], d) for s, d in zip(original.inputs, details)]
        outs = self.interpreter.get_output_details()
        by_name = {d["name"]: d for d in outs}
        self.output_details = [by_name.get(n.rsplit(":", 1)[0], d) for n, d in zip(original.outputs, outs)]
        self.keys, self.outputs = [s.key for s in original.inputs], list(original.outputs)

    def run(self, feed: dict) -> dict:
        if self.signature is not None:
            return self.runner(**feed)
        resized = False
        for key, detail in zip(self.keys, self.input_details):
            if tuple(detail["shape"]) != feed[key].shape:  # another batch size than the converted one
                self.interpreter.resize_tensor_input(detail["index"], feed[key].shape)
                detail["shape"] = feed[key].shape
                resized = True
        if resized:
            self.interpreter.allocate_tensors()
        for key, detail in zip(self.keys, self.input_details):
            self.interpreter.set_tensor(detail["index"], feed[key])
        self.interpreter.invoke()
        return {n: self.interpreter.get_tensor(d["index"]).copy() for n, d in zip(self.outputs, self.output_details)}


def _interpreter_class():
    try:
        from ai_edge_litert.interpreter import Interpreter

        return Interpreter
    except ImportError:
        pass
    try:
        import tensorflow as tf

        interpreter = tf.lite.Interpreter
    except (ImportError, AttributeError):
        raise MissingDependencyError(
            f"running a compressed model needs the LiteRT runtime: {_EXTRA} (ai-edge-litert)."
        ) from None
    warnings.warn(f"LiteRT is not installed; running the compressed model with TensorFlow's deprecated "
                  f"tf.lite.Interpreter ({_EXTRA} installs LiteRT).", RestoreKitWarning, stacklevel=3)
    return interpreter


# ---------------------------------------------------------------- sources


def _tensor_name(name: str) -> str:
    name = name.strip()
    return name if re.search(r":\d+$", name) else f"{name}:0"


def _pick(names, available: list[str], where: str, what: str) -> list[str]:
    """The requested names (all ``available`` when None), each checked to exist."""
    if names is None:
        return list(available)
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    picked = []
    for name in names:
        if name not in available:
            raise NoMatchError(f"{what} {name!r} is not in {where}.", name=name, candidates=available)
        picked.append(name)
    return picked


def _graph_tensors(graph_def, names, where: str, what: str) -> list[str]:
    tensors = {f"{n.name}:0" for n in graph_def.node}
    result = []
    for name in [n for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]:
        tensor = _tensor_name(name)
        node = tensor.rsplit(":", 1)[0]
        if f"{node}:0" not in tensors:
            raise NoMatchError(f"{what} {name.strip()!r} is not a node of {where} ({len(tensors)} nodes).",
                               name=node, candidates=[t[:-2] for t in sorted(tensors)])
        result.append(tensor)
    if not result:
        raise InvalidArgumentError(f"no {what}s given for {where}.")
    return result


def _require_frozen(summary, where: str) -> None:
    if summary.variables or summary.kind != "GraphDef":
        raise GraphError(
            f"{where!r} is a {summary.kind} with {len(summary.variables)} variables, so it is not frozen. Pass "
            f"its checkpoint as the source with graph={where!r}, or freeze it first (restorekit.freeze)."
        )


def _frozen_graph(graph_def, where: str, inputs, outputs, summary=None) -> _FrozenGraph:
    from restorekit.graph import inspect_graph

    summary = summary or inspect_graph(graph_def)
    _require_frozen(summary, where)
    if outputs is None:
        outputs = [t.name for t in summary.outputs]
    output_names = _graph_tensors(graph_def, outputs, repr(where), "output")
    if inputs is None:
        specs = [_Spec(t.name, t.dtype, t.shape) for t in summary.inputs]
    else:
        known = {t.name: t for t in summary.inputs}
        specs = []
        for name in _graph_tensors(graph_def, inputs, repr(where), "input"):
            t = known.get(name)
            specs.append(_Spec(name, t.dtype, t.shape) if t else _Spec(name, "", None))
    model = _FrozenGraph(graph_def, specs, output_names)
    # Inputs named by hand may be inner tensors: read their dtype and shape from the graph.
    model.inputs = [
        s if s.dtype else _Spec(s.key, model.graph.get_tensor_by_name(s.key).dtype.name,
                                 _shape(model.graph.get_tensor_by_name(s.key).shape))
        for s in specs
    ]
    return model


def _shape(tf_shape) -> tuple | None:
    return None if tf_shape.rank is None else tuple(tf_shape.as_list())


def _read_graph_def(path: str):
    tf = _tf()
    from google.protobuf import text_format

    data = open(path, "rb").read()
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(data)
        if graph_def.node:
            return graph_def
    except Exception:  # protobuf's DecodeError: try text
        pass
    return text_format.Parse(data.decode("utf-8"), tf.compat.v1.GraphDef())


def _is_saved_model(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, n)) for n in ("saved_model.pb", "saved_model.pbtxt"))


def _checkpoint_prefix(path: str) -> str | None:
    from restorekit.checkpoint import resolve_prefix

    if path.endswith((".pb", ".pbtxt", ".meta")) and os.path.isfile(path):
        return None
    try:
        return resolve_prefix(path)
    except (CheckpointNotFoundError, OSError, ValueError):
        return None


def _open_source(source, graph, inputs, outputs, signature):
    """(model, display name, size of the uncompressed model in bytes)."""
    tf = _tf()
    if isinstance(source, tf.compat.v1.GraphDef):
        return _frozen_graph(source, "<GraphDef>", inputs, outputs), "<GraphDef>", source.ByteSize()
    path = os.fspath(source)
    if _is_saved_model(path):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        return _SavedModel(path, signature, outputs), path, size
    prefix = _checkpoint_prefix(path)
    if prefix is None:
        from restorekit.graph import inspect_graph

        summary = inspect_graph(path)  # the graph module's errors for missing, truncated or foreign files
        _require_frozen(summary, path)
        graph_def = _read_graph_def(path)
        return _frozen_graph(graph_def, path, inputs, outputs, summary), path, os.path.getsize(path)
    from restorekit.graph import freeze, inspect_graph

    graph = graph if graph is not None else prefix + ".meta"
    if outputs is None:
        candidates = [t.name for t in inspect_graph(graph).outputs]
        raise InvalidArgumentError(
            f"compressing the checkpoint {path!r} freezes it first, which needs outputs=. Tensors nothing in "
            f"the graph consumes: {format_names(candidates)}."
        )
    names = [n for n in (outputs.split(",") if isinstance(outputs, str) else outputs) if n.strip()]
    graph_def = freeze(prefix, graph, [_tensor_name(n).rsplit(":", 1)[0] for n in names])
    return _frozen_graph(graph_def, path, inputs, names), path, graph_def.ByteSize()


# ---------------------------------------------------------------- samples


def _concrete_shape(spec: _Spec) -> tuple:
    if spec.shape is None:
        raise InvalidArgumentError(
            f"input {spec.key!r} has an unknown rank; pass representative_data so its shape is known.")
    shape = tuple(1 if (d is None or d < 0) and i == 0 else d for i, d in enumerate(spec.shape))
    if any(d is None or d < 0 for d in shape):
        raise InvalidArgumentError(
            f"input {spec.key!r} has unknown dimensions {list(spec.shape)} beyond the batch; pass "
            f"representative_data so its shape is known.")
    return shape


def _random_feeds(specs: list[_Spec], n: int) -> list[dict]:
    rng = np.random.RandomState(0)
    feeds = []
    for _ in range(n):
        feed = {}
        for spec in specs:
            shape, dtype = _concrete_shape(spec), np.dtype(spec.dtype)
            if dtype.kind == "f":
                feed[spec.key] = rng.standard_normal(shape).astype(dtype)
            elif dtype.kind in "iu":
                feed[spec.key] = rng.randint(0, 10, shape).astype(dtype)
            elif dtype.kind == "b":
                feed[spec.key] = rng.rand(*shape) > 0.5
            else:
                raise InvalidArgumentError(f"input {spec.key!r} has dtype {spec.dtype}; pass representative_data.")
        feeds.append(feed)
    return feeds


def _key_of(name: str, specs: list[_Spec]) -> str:
    keys = [s.key for s in specs]
    for key in (name, _tensor_name(name)):
        if key in keys:
            return key
    raise NoMatchError(f"representative_data names {name!r}, which is not an input.", name=name, candidates=keys)


def _feed(item, specs: list[_Spec]) -> dict:
    if isinstance(item, dict):
        feed = {_key_of(k, specs): v for k, v in item.items()}
    elif isinstance(item, (list, tuple)):
        feed = dict(zip([s.key for s in specs], item))
    else:
        feed = {specs[0].key: item}
    missing = [s.key for s in specs if s.key not in feed]
    if missing or len(feed) != len(specs):
        raise InvalidArgumentError(f"a representative sample feeds {sorted(feed)}; the inputs are "
                                   f"{[s.key for s in specs]}.")
    return {s.key: np.asarray(feed[s.key], dtype=np.dtype(s.dtype)) for s in specs}


def _sample_feeds(data, specs: list[_Spec]) -> list[dict]:
    """One feed per sample. Arrays (and a dict or .npz of arrays) hold samples along their first
    axis, each run as a batch of one; any other iterable yields whole feeds."""
    if isinstance(data, (str, os.PathLike)):
        with np.load(os.fspath(data)) as npz:
            data = {k: npz[k] for k in npz.files}
    if isinstance(data, np.ndarray) or (isinstance(data, dict) and all(isinstance(v, np.ndarray)
                                                                        for v in data.values())):
        arrays = data if isinstance(data, dict) else {specs[0].key: data}
        arrays = {_key_of(k, specs): v for k, v in arrays.items()}
        counts = {len(v) for v in arrays.values()}
        if len(counts) != 1:
            raise InvalidArgumentError(f"representative arrays hold different sample counts: {sorted(counts)}.")
        feeds = [_feed({k: v[i:i + 1] for k, v in arrays.items()}, specs) for i in range(counts.pop())]
    else:
        feeds = [_feed(item, specs) for item in data]
    if not feeds:
        raise InvalidArgumentError("representative_data holds no samples.")
    return feeds


# ---------------------------------------------------------------- convert and compare


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
