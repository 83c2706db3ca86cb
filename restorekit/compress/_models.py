"""The models ``compress`` compares: a frozen graph or SavedModel (TensorFlow) and the .tflite (LiteRT)."""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

from restorekit._tensorflow import import_tensorflow, native_stderr_silenced
from restorekit.errors import (
    CheckpointNotFoundError,
    GraphError,
    InvalidArgumentError,
    MissingDependencyError,
    NoMatchError,
    RestoreKitWarning,
    format_names,
)

_EXTRA = "pip install 'restorekit[compress]'"


def _tf():
    return import_tensorflow()  # the first import of TensorFlow keeps its native log lines off the CLI


def _quiet_native():
    """Silence the native stderr while a converter or runtime sets up (always: library and CLI).

    LiteRT prints "INFO: Created TensorFlow Lite XNNPACK delegate for CPU." and the int8
    calibrator "fully_quantize: 0, ..." straight to fd 2, whatever ``TF_CPP_MIN_LOG_LEVEL``
    says; neither is about the user's model. Their failures still raise Python errors.
    """
    return native_stderr_silenced()


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
        # The signature's own graph holds only a call; the ops sit in the functions of its library.
        graph_def = self.function.graph.as_graph_def()
        nodes = list(graph_def.node)
        for function in graph_def.library.function:
            nodes.extend(function.node_def)
        return list(dict.fromkeys(n.name for n in nodes if n.op in ops))

    def close(self) -> None:
        pass


class _Lite:
    """The compressed model, run by LiteRT's interpreter (TF's deprecated one if LiteRT is missing)."""

    def __init__(self, content: bytes, original):
        interpreter = _interpreter_class()  # outside: its warning goes to Python's stderr
        with _quiet_native():
            self.interpreter = interpreter(model_content=content)
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
        interpreter = _tf().lite.Interpreter
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
    from restorekit._checkpoint import resolve_prefix

    if path.endswith((".pb", ".pbtxt", ".meta")) and os.path.isfile(path):
        return None
    try:
        return resolve_prefix(path)
    except (CheckpointNotFoundError, OSError, ValueError):
        return None


class _KerasModel(_SavedModel):
    """A Keras ``.keras`` / ``.h5`` model file, exported (``model.export``) to a scratch SavedModel first.

    Keras 3 models go through their own SavedModel export because the converters'
    direct Keras entries (``from_keras``) fail on Keras 3 tensors.
    """

    def __init__(self, path: str, signature: str, outputs):
        import shutil
        import tempfile

        _tf()
        import keras

        try:
            loaded = keras.models.load_model(path, compile=False)
        except Exception as e:  # Keras' own errors for a file it cannot read
            raise GraphError(f"Keras cannot load the model file {path!r}: {' '.join(str(e).split())[:300]}") from None
        self._scratch = tempfile.mkdtemp(prefix="restorekit-keras-export-")
        try:
            exported = os.path.join(self._scratch, "saved_model")
            with _quiet_native():
                loaded.export(exported, verbose=False)
            super().__init__(exported, signature, outputs)
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._scratch, ignore_errors=True)


def _is_keras_model(path: str) -> bool:
    if path.endswith(".weights.h5") and os.path.isfile(path):
        raise InvalidArgumentError(
            f"{path!r} holds weights only; compress needs the model too: save it with model.save('model.keras'), "
            f"or pass a SavedModel from model.export().")
    return path.endswith((".keras", ".h5")) and os.path.isfile(path)


def _open_source(source, graph, inputs, outputs, signature):
    """(model, display name, size of the uncompressed model in bytes)."""
    tf = _tf()
    if isinstance(source, tf.compat.v1.GraphDef):
        return _frozen_graph(source, "<GraphDef>", inputs, outputs), "<GraphDef>", source.ByteSize()
    path = os.fspath(source)
    if _is_keras_model(path):
        return _KerasModel(path, signature, outputs), path, os.path.getsize(path)
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
