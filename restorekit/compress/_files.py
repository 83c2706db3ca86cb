"""Look inside a compressed model file (``.tflite``, ``.onnx``): inputs, outputs, ops, tensors, sizes; verify it."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from restorekit.errors import GraphError, InvalidArgumentError

__all__ = ["ModelSummary", "inspect_model", "is_model_file", "verify_model"]

_FORMATS = {".tflite": "tflite", ".onnx": "onnx"}


def _format_of(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    kind = _FORMATS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        with open(path, "rb") as f:
            head = f.read(8)
        kind = "tflite" if head[4:8] == b"TFL3" else None  # the flatbuffer's file identifier
    return kind


def is_model_file(path) -> bool:
    """Whether ``path`` is a ``.tflite`` or ``.onnx`` file (by its suffix, or TFLite's file identifier)."""
    return isinstance(path, (str, os.PathLike)) and _format_of(os.fspath(path)) is not None


@dataclass(frozen=True)
class Tensor:
    """One tensor of a model file: an input, an output, or a stored one (weights, constants)."""

    name: str
    shape: tuple
    dtype: str
    nbytes: int = 0


@dataclass(frozen=True)
class ModelSummary:
    """What a ``.tflite`` or ``.onnx`` file holds. ``ops`` counts the nodes of each op type (of the main graph;
    ``subgraph_ops`` those of an ONNX model's subgraphs)."""

    path: str
    format: str
    size: int
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    ops: dict = field(default_factory=dict)
    tensors: tuple[Tensor, ...] = ()
    opset: int | None = None
    subgraph_ops: dict = field(default_factory=dict)  # ONNX: the ops of If / Loop / Scan bodies, counted apart

    def to_dict(self) -> dict:
        def rows(items):
            return [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "nbytes": t.nbytes} for t in items]

        return {"path": self.path, "format": self.format, "size": self.size, "opset": self.opset,
                "inputs": rows(self.inputs), "outputs": rows(self.outputs), "ops": dict(self.ops),
                "subgraph_ops": dict(self.subgraph_ops), "tensors": rows(self.tensors)}

    def __str__(self) -> str:
        from restorekit._report import format_bytes, format_shape

        opset = f", opset {self.opset}" if self.opset else ""
        lines = [f"{self.path}: {self.format}{opset}, {format_bytes(self.size)}"]
        for title, items in (("inputs", self.inputs), ("outputs", self.outputs)):
            lines.append(f"  {title}:")
            lines += [f"    {t.name}  {format_shape(t.shape)}  {t.dtype}" for t in items]
        lines.append("  ops: " + ", ".join(f"{op} x{n}" for op, n in sorted(self.ops.items())))
        if self.subgraph_ops:
            lines.append("  ops in subgraphs: " + ", ".join(f"{op} x{n}" for op, n in sorted(self.subgraph_ops.items())))
        stored = sum(t.nbytes for t in self.tensors)
        lines.append(f"  tensors: {len(self.tensors)}, {format_bytes(stored)}")
        width = max((len(t.name) for t in self.tensors), default=0)
        lines += [f"    {t.name.ljust(width)}  {format_shape(t.shape)}  {t.dtype}  {format_bytes(t.nbytes)}"
                  for t in self.tensors]
        return "\n".join(lines)


def _onnx_tensor(value, onnx) -> Tensor:
    kind = value.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in kind.shape.dim)
    return Tensor(value.name, dims, onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type).name)


def _load_onnx(path: str):
    from restorekit.formats.onnx import import_onnx

    onnx = import_onnx()
    try:
        return onnx, onnx.load_model(path)
    except Exception as e:  # protobuf's DecodeError, onnx's own errors
        raise GraphError(f"{path!r} is not a readable ONNX model: {' '.join(str(e).split())[:300]}") from None


def _inspect_onnx(path: str) -> ModelSummary:
    """The summary of an ``.onnx`` file, its tensors and ops as the ONNX format's one reader lists them
    (``restorekit.formats.onnx``: initializers and Constant nodes, in subgraphs too)."""
    from restorekit.errors import CorruptCheckpointError, ExternalDataError
    from restorekit.formats.onnx import OnnxReader, import_onnx, op_counts

    try:
        reader = OnnxReader(path)
    except ExternalDataError:
        raise
    except CorruptCheckpointError as e:
        raise GraphError(str(e)) from None
    onnx, graph = import_onnx(), reader.model.graph
    stored = {i.name for i in graph.initializer}
    tensors = tuple(Tensor(s.name, s.shape, "string" if s.dtype == object else s.dtype.name, s.nbytes)
                    for s in reader.tensors.values())
    main, sub = op_counts(reader.model)
    opset = next((o.version for o in reader.model.opset_import if o.domain in ("", "ai.onnx")), None)
    return ModelSummary(
        path=path, format="onnx", size=os.path.getsize(path),
        inputs=tuple(_onnx_tensor(v, onnx) for v in graph.input if v.name not in stored),
        outputs=tuple(_onnx_tensor(v, onnx) for v in graph.output),
        ops=dict(main), tensors=tensors, opset=opset, subgraph_ops=dict(sub))


def _interpreter(path: str):
    from restorekit.compress._models import _interpreter_class, _quiet_native

    interpreter_class = _interpreter_class()
    try:
        import importlib

        # Without the default delegates: XNNPACK would replace the model's ops by DELEGATE nodes.
        kind = importlib.import_module(interpreter_class.__module__).OpResolverType
        with _quiet_native():
            interpreter = interpreter_class(
                model_path=path, experimental_op_resolver_type=kind.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
            interpreter.allocate_tensors()
    except (ValueError, RuntimeError) as e:
        raise GraphError(f"{path!r} is not a loadable .tflite model: {' '.join(str(e).split())[:300]}") from None
    return interpreter


def _lite_tensor(detail) -> Tensor:
    import numpy as np

    shape = tuple(int(d) for d in detail["shape"])
    dtype = np.dtype(detail["dtype"])
    return Tensor(detail["name"], shape, dtype.name, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)


def _inspect_tflite(path: str) -> ModelSummary:
    interpreter = _interpreter(path)
    # No public API lists a .tflite's operators; the interpreter's _get_ops_details is the one
    # LiteRT's own analyzer uses.
    ops = Counter(op["op_name"] for op in interpreter._get_ops_details())
    return ModelSummary(
        path=path, format="tflite", size=os.path.getsize(path),
        inputs=tuple(_lite_tensor(d) for d in interpreter.get_input_details()),
        outputs=tuple(_lite_tensor(d) for d in interpreter.get_output_details()),
        ops=dict(ops), tensors=tuple(_lite_tensor(d) for d in interpreter.get_tensor_details()))


def inspect_model(path) -> ModelSummary:
    """Inputs, outputs, op counts and tensors of a ``.tflite`` or ``.onnx`` file.

        print(restorekit.compress.inspect_model("model.onnx"))

    Raises:
        InvalidArgumentError: ``path`` is not a ``.tflite`` or ``.onnx`` file.
        GraphError: the file does not parse as one.
        MissingDependencyError: onnx (``.onnx``) or LiteRT (``.tflite``) is not installed.
    """
    path = os.fspath(path)
    kind = _format_of(path)
    if kind is None:
        raise InvalidArgumentError(f"{path!r} is not a .tflite or .onnx file.")
    return _inspect_onnx(path) if kind == "onnx" else _inspect_tflite(path)


def verify_model(path) -> list[str]:
    """The problems of a model file; empty when it is sound.

    ``.onnx``: ``onnx.checker`` with full shape inference, then ONNX Runtime loads it.
    ``.tflite``: LiteRT loads it and allocates its tensors (the flatbuffer has no checksum).
    """
    path = os.fspath(path)
    if _format_of(path) != "onnx":
        try:
            inspect_model(path)
        except GraphError as e:
            return [str(e)]
        return []
    try:
        onnx, _ = _load_onnx(path)
    except GraphError as e:
        return [str(e)]
    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as e:  # onnx.checker.ValidationError, shape inference errors
        return [f"onnx.checker: {' '.join(str(e).split())[:300]}"]
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except ImportError:
        return []
    except Exception as e:  # ONNX Runtime's Fail / InvalidGraph errors
        return [f"onnxruntime: {' '.join(str(e).split())[:300]}"]
    return []
