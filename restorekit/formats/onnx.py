"""The ONNX format, read: a model's stored tensors (initializers and Constant nodes, subgraphs included) as a Source.

The protobuf is parsed by the ``onnx`` package (the optional extra ``restorekit[onnx]``,
imported only inside these functions), with ``load_external_data=False``. onnx is the
reference parser of ``ModelProto`` and ``numpy_helper.to_array`` the reference decoder of
its typed fields (float16 and bfloat16 bits in ``int32_data``, packed int4), and protobuf
already bounds a model file to 2 GiB; a reader of our own would re-implement all of that
and drift as the IR grows. What ``onnx.load`` does not do as a reader of untrusted files
must is external data: it follows whatever location a tensor names and reads it whole.
So external data is read here: each location must be a relative path inside the model's
own directory (no ``..`` part, not absolute, no symlink out of it; else
``ExternalDataError``, as for shard names), its offset and length are checked against
the file and the tensor's shape when the model is opened, before any tensor is read, and
then one tensor is read at a time, exactly its bytes.

What is listed, under stable names: every initializer and sparse initializer (under its
name), and every ``Constant`` node's tensor (under the node's output name), in the main
graph and in every subgraph (``If`` branches, ``Loop`` and ``Scan`` bodies, nested), in
file order; a name already taken is qualified with its subgraph's path
(``node/then_branch/name``). Values keep their stored dtypes: float16, bfloat16, float8,
int8 and the scales and zero points of Q/DQ nodes come back as stored, bit for bit.
Functions (``model.functions``) are templates, not weights, and are not listed.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError, ExternalDataError, MissingDependencyError
from restorekit.formats.files import FileReader, FileView
from restorekit.formats._reading import boundary, check_output_size, regular_file
from restorekit._registry import BY_BYTES, BY_NAME, Probe, register

__all__ = ["FORMAT", "SUFFIXES", "OnnxReader", "Stored", "import_onnx", "op_counts", "recognizes"]

FORMAT = "onnx"
SUFFIXES = (".onnx",)
_WHAT = "ONNX model"
_EXTRA = "pip install 'restorekit[onnx]'"
# ModelProto's fields in the order protobuf writes them: ir_version (1) first, then the tag of field 2 to 8.
_SECOND_TAGS = frozenset({0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42})


def import_onnx():
    """The ``onnx`` module, or ``MissingDependencyError`` naming the extra."""
    try:
        import onnx
    except ImportError:
        raise MissingDependencyError(f"reading an ONNX model needs onnx: {_EXTRA}.") from None
    return onnx


def recognizes(head: bytes, suffix: str) -> bool:
    """True for a file named ``.onnx`` whose first bytes are a ModelProto's (``ir_version`` first)."""
    return suffix == ".onnx" and len(head) >= 3 and head[0] == 0x08 and 0 < head[1] < 0x40 and head[2] in _SECOND_TAGS


@dataclass(frozen=True)
class Stored:
    """One stored tensor of a model, from its proto alone: what ``inspect`` lists and a conversion plans with."""

    name: str
    shape: tuple
    dtype: np.dtype  # as onnx decodes it: ml_dtypes for bfloat16, float8, int4; object for strings
    nbytes: int  # decoded (a packed int4 tensor counts one byte an element, as numpy holds it)
    kind: str  # 'initializer', 'sparse initializer' or 'Constant'
    scope: str  # '' in the main graph, else the subgraph's path ('cond/then_branch/')
    load: Callable[[], np.ndarray]


def _graphs(graph, scope: str = "") -> Iterator[tuple]:
    """(graph, scope) of ``graph`` and of every subgraph in it, depth first in file order."""
    onnx = import_onnx()
    yield graph, scope
    for node in graph.node:
        owner = node.name or (node.output[0] if node.output else node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g, f"{scope}{owner}/{attr.name}/")
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for i, sub in enumerate(attr.graphs):
                    yield from _graphs(sub, f"{scope}{owner}/{attr.name}/{i}/")


def op_counts(model) -> tuple[Counter, Counter]:
    """(op type -> count in the main graph, op type -> count in all its subgraphs)."""
    main: Counter = Counter()
    sub: Counter = Counter()
    for graph, scope in _graphs(model.graph):
        (sub if scope else main).update(n.op_type for n in graph.node)
    return main, sub


class OnnxReader(FileReader):
    """An ``.onnx`` model's stored tensors, as stored: initializers and Constant nodes of every graph.

    Opening parses the model (its external data left where it is) and checks every external
    location, offset and length; ``files`` is the model and the data files it names.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        CorruptCheckpointError: not a readable ONNX model, or external data that does not fit its tensor.
        ExternalDataError: external data named outside the model's directory (nothing is read from it).
        MissingDependencyError: onnx is not installed.
    """

    fmt = FORMAT
    checks = ("ONNX carries no checksum: verified means every stored tensor (initializers, Constant nodes, "
              "external data inside the model's directory) reads back and decodes")

    def __init__(self, path):
        super().__init__(path)
        self._onnx = import_onnx()
        self._size = regular_file(self.path, _WHAT)
        self._external: dict[tuple, tuple[str, int, int]] = {}  # (name, role) -> (file, offset, length)
        with boundary(self.path, _WHAT):
            self.model = self._load()
            self.tensors: dict[str, Stored] = self._list()
        extra = sorted({f for f, _, _ in self._external.values()})
        self.files = (self.path, *extra)
        self._input_bytes = self._size + sum(os.path.getsize(f) for f in extra)

    # -- the verbs of a FileReader
    def read(self, max_output_bytes: int | None = None):
        check_output_size(self.path, self._input_bytes, {n: s.nbytes for n, s in self.tensors.items()},
                          max_output_bytes)
        return self._arrays()

    def _arrays(self):
        for name in self.tensors:
            with boundary(self.path, _WHAT):
                array = self.read_tensor(name)
            yield name, array

    def read_shapes(self) -> dict:
        return {name: s.shape for name, s in self.tensors.items()}

    def stored_tensors(self) -> dict:
        return {name: (s.shape, s.dtype, s.load) for name, s in self.tensors.items()}

    def read_tensor(self, name: str) -> np.ndarray:
        """One stored tensor as numpy, exactly as stored."""
        with boundary(self.path, _WHAT):
            return self.tensors[name].load()

    # -- parsing
    def _load(self):
        try:
            model = self._onnx.load_model(self.path, load_external_data=False)
        except Exception as e:  # protobuf's DecodeError, onnx's own errors
            detail = " ".join(str(e).split())[:200]
            raise CorruptCheckpointError(f"{self.path!r} is not a readable ONNX model ({type(e).__name__}: "
                                         f"{detail})") from None
        if not model.HasField("graph") or not model.ir_version:
            raise CorruptCheckpointError(f"{self.path!r} is not a readable ONNX model: it holds no graph and no "
                                         "ir_version")
        return model

    def _list(self) -> dict[str, Stored]:
        out: dict[str, Stored] = {}
        for graph, scope in _graphs(self.model.graph):
            items = [("initializer", t.name, t) for t in graph.initializer]
            items += [("sparse initializer", s.values.name, s) for s in graph.sparse_initializer]
            for node in graph.node:
                if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                    if len(node.attribute) != 1 or len(node.output) != 1:
                        raise self._bad(f"Constant node {node.name or node.output[:1]!r} has "
                                        f"{len(node.attribute)} values and {len(node.output)} outputs, not one")
                    items.append(("Constant", node.output[0], node.attribute[0]))
            for kind, name, proto in items:
                if not name:
                    raise self._bad(f"a {kind} in {scope or 'the main graph'!r} has no name")
                key = name if name not in out else f"{scope}{name}"
                if key in out:
                    raise self._bad(f"two {kind}s in {scope or 'the main graph'!r} are both named {name!r}")
                if kind == "Constant":
                    out[key] = self._constant(key, proto, scope)
                elif kind == "sparse initializer":
                    out[key] = self._sparse(key, proto, scope)
                else:
                    out[key] = self._tensor(key, proto, kind, scope)
        return out

    def _tensor(self, name: str, tensor, kind: str, scope: str) -> Stored:
        shape, dtype = self._meta(name, tensor)
        return Stored(name, shape, dtype, _nbytes(shape, dtype), kind, scope, functools.partial(self._decode, name, tensor))

    def _bad(self, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path!r} is not a readable ONNX model: {why}")

    def _meta(self, name: str, tensor, role: str = "") -> tuple[tuple, np.dtype]:
        """(shape, numpy dtype) of a TensorProto; its external data checked now."""
        onnx = self._onnx
        shape = tuple(int(d) for d in tensor.dims)
        if any(d < 0 for d in shape):
            raise self._bad(f"tensor {name!r} has the negative dims {list(shape)}")
        if tensor.data_type == onnx.TensorProto.STRING:
            dtype = np.dtype(object)
        else:
            try:
                dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            except (KeyError, ValueError, TypeError):
                raise self._bad(f"tensor {name!r} has the unknown data type {tensor.data_type}") from None
        if tensor.HasField("segment"):
            raise self._bad(f"tensor {name!r} is a segment of a larger tensor, which restorekit does not read")
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            self._external[name, role] = self._check_external(name, tensor, shape, dtype)
        return shape, dtype

    def _check_external(self, name: str, tensor, shape: tuple, dtype: np.dtype) -> tuple[str, int, int]:
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        file = _inside(self.path, name, location)
        try:
            size = regular_file(file, "ONNX external data file")
        except CheckpointNotFoundError:
            raise self._bad(f"tensor {name!r} keeps its data in {location!r}, which is not beside the model") from None
        try:
            offset = int(info.get("offset", "0"))
            length = int(info["length"]) if "length" in info else size - offset
        except ValueError:
            raise self._bad(f"tensor {name!r}: external data offset {info.get('offset')!r} or length "
                            f"{info.get('length')!r} is not a number") from None
        need = _stored_bytes(self._onnx, tensor.data_type, shape, dtype)
        if offset < 0 or length < 0 or offset + length > size:
            raise self._bad(f"tensor {name!r}: bytes {offset}..{offset + length} of {location!r} lie outside its "
                            f"{size} bytes")
        if length != need:
            raise self._bad(f"tensor {name!r} ({dtype} {list(shape)}) needs {need} bytes; its external data in "
                            f"{location!r} holds {length}")
        return file, offset, length

    def _decode(self, name: str, tensor, role: str = "") -> np.ndarray:
        onnx = self._onnx
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            file, offset, length = self._external[name, role]
            data = bytearray(length)
            with open(file, "rb") as f:
                f.seek(offset)
                if f.readinto(data) != length:
                    raise self._bad(f"tensor {name!r}: {file!r} is shorter than when the model was opened")
            if _packed(onnx, tensor.data_type):  # sub-byte types: unpacked by onnx's own decoder
                copy = onnx.TensorProto()
                copy.CopyFrom(tensor)
                del copy.external_data[:]
                copy.data_location = onnx.TensorProto.DEFAULT
                copy.raw_data = bytes(data)
                return onnx.numpy_helper.to_array(copy)
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            return np.frombuffer(data, dtype=dtype).reshape(tuple(tensor.dims))  # ONNX stores little-endian, as we run
        if tensor.data_type == onnx.TensorProto.STRING:
            return _strings(list(tensor.string_data), tuple(tensor.dims))
        return onnx.numpy_helper.to_array(tensor)

    def _sparse(self, name: str, sparse, scope: str, kind: str = "sparse initializer") -> Stored:
        shape = tuple(int(d) for d in sparse.dims)
        _, dtype = self._meta(name, sparse.values, "values")
        self._meta(name, sparse.indices, "indices")
        if any(d < 0 for d in shape):
            raise self._bad(f"sparse tensor {name!r} has the negative dims {list(shape)}")

        def load():
            values = self._decode(name, sparse.values, "values").reshape(-1)
            indices = self._decode(name, sparse.indices, "indices").astype(np.int64)
            dense = np.zeros(shape, dtype=values.dtype)
            if values.size:
                if indices.ndim == 1:
                    dense.reshape(-1)[indices] = values
                else:
                    dense[tuple(indices.T)] = values
            return dense

        return Stored(name, shape, dtype, _nbytes(shape, dtype), kind, scope, load)

    def _constant(self, name: str, attr, scope: str) -> Stored:
        """A Constant node's value (``value``, ``sparse_value`` or one of the ``value_*`` attributes)."""
        kinds = self._onnx.AttributeProto
        if attr.type == kinds.TENSOR:
            return self._tensor(name, attr.t, "Constant", scope)
        if attr.type == kinds.SPARSE_TENSOR:
            return self._sparse(name, attr.sparse_tensor, scope, "Constant")
        values = {kinds.FLOAT: (np.float32, attr.f, ()), kinds.FLOATS: (np.float32, list(attr.floats), None),
                  kinds.INT: (np.int64, attr.i, ()), kinds.INTS: (np.int64, list(attr.ints), None),
                  kinds.STRING: (object, attr.s, ()), kinds.STRINGS: (object, list(attr.strings), None)}
        if attr.type not in values:
            raise self._bad(f"Constant {name!r} holds its value in the attribute {attr.name!r} of type {attr.type}")
        kind, value, rank = values[attr.type]
        shape: tuple = (len(value),) if rank is None else ()
        dtype = np.dtype(kind)
        # an attribute's few values are in memory with the node already: the array is made now
        array = _strings(value if rank is None else [value], shape) if dtype.hasobject else np.array(value, dtype)
        return Stored(name, shape, dtype, _nbytes(shape, dtype), "Constant", scope, array.copy)


def _inside(model: str, name: str, location: str) -> str:
    """The external data file ``location`` names, refused unless it lies inside the model's directory."""
    base = os.path.dirname(os.path.abspath(model))
    parts = re.split(r"[/\\]", location)
    outside = (not location or "\0" in location or os.path.isabs(location) or location[:1] in "/\\"
               or re.match(r"[A-Za-z]:", location) is not None or ".." in parts)
    file = os.path.join(base, *[p for p in parts if p not in ("", ".")]) if not outside else ""
    if not outside:
        real, root = os.path.realpath(file), os.path.realpath(base)
        outside = os.path.commonpath([real, root]) != root
    if outside:
        raise ExternalDataError(
            f"{model!r}: tensor {name!r} keeps its data in {location!r}, which is not a file inside the model's "
            f"directory {base!r}; restorekit reads external data only from there (nothing was read)")
    return file


def _packed(onnx, data_type: int) -> bool:
    """Whether ONNX stores elements of ``data_type`` packed, several to a byte (int4, uint4, float4, int2...)."""
    names = ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    return any(getattr(onnx.TensorProto, n, None) == data_type for n in names)


def _stored_bytes(onnx, data_type: int, shape: tuple, dtype: np.dtype) -> int:
    count = math.prod(shape)
    if not _packed(onnx, data_type):
        return count * dtype.itemsize
    per_byte = 4 if onnx.TensorProto.DataType.Name(data_type).endswith("2") else 2
    return -(-count // per_byte)


def _nbytes(shape: tuple, dtype: np.dtype) -> int:
    return 0 if dtype.hasobject else math.prod(shape) * dtype.itemsize


def _strings(values: list, shape: tuple) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = [bytes(v) for v in values]
    return out.reshape(shape)


def detect(probe: Probe) -> int:
    if probe.is_dir or probe.suffix not in SUFFIXES:
        return 0
    return BY_BYTES if recognizes(probe.head, probe.suffix) else BY_NAME


register(FORMAT, detect=detect, open=lambda path: FileView(path, OnnxReader(path)), order=40)
