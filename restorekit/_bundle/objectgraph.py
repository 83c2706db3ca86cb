"""The TF2 object graph (``_CHECKPOINTABLE_OBJECT_GRAPH``), decoded and re-encoded without TensorFlow.

TF's generated ``trackable_object_graph_pb2`` classes import all of TensorFlow; listing
or editing an object-based checkpoint must not. We read only the three fields we need
(children, attributes, slot variables) and, when an edit renames or drops keys, rewrite
just the attribute keys while every other byte of the record is copied verbatim, so
nothing TF wrote is lost (registered savers, Python state, future fields).
"""

from __future__ import annotations

import re

from collections import deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from restorekit._bundle.protos import iter_fields, put_field
from restorekit.errors import CorruptCheckpointError
from restorekit._names import optimizer_slot_kind

__all__ = [
    "OBJECT_GRAPH_KEY",
    "ObjectGraph",
    "TrackedVariable",
    "VALUE_SUFFIX",
    "decode_object_graph",
    "rewrite_keys",
]

# The entry holding the serialized TrackableObjectGraph in an object-based checkpoint.
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
_VALUE_SUFFIX = VALUE_SUFFIX
_SHARDED_DEFAULT_NAME = "ShardedVariable"  # the name ParameterServerStrategy gives every ShardedVariable
# tf.Variable's own name when none is given: says less than the attribute it is saved under
_DEFAULT_VARIABLE_NAME = re.compile(r"^Variable(_\d+)?$")


@dataclass(frozen=True)
class _Node:
    children: tuple  # ((node_id, local_name), ...)
    attributes: tuple  # ((name, full_name, checkpoint_key), ...)
    slot_variables: tuple  # ((original_node_id, slot_name, slot_node_id), ...)


@dataclass(frozen=True)
class TrackedVariable:
    """One tensor of an object-based checkpoint, seen through its object graph.

    ``key`` is the raw checkpoint key; ``path`` the readable path (the Keras
    ``variable.path`` for Keras checkpoints, ``optimizer/...`` for optimizer state,
    ``save_counter``); ``kind`` is ``'variable'``, ``'optimizer'`` or ``'save_counter'``.
    """

    key: str
    path: str
    object_path: str
    full_name: str
    node_id: int
    kind: str


def _str(value: bytes, what: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"object graph: {what} is not UTF-8") from None


def _decode_node(buf: bytes) -> _Node:
    children, attributes, slots = [], [], []
    for number, wire, value, _, _ in iter_fields(buf):
        if number == 1 and wire == 2:
            node_id, local = 0, ""
            for n2, w2, v2, _, _ in iter_fields(value):
                if n2 == 1 and w2 == 0:
                    node_id = v2
                elif n2 == 2 and w2 == 2:
                    local = _str(v2, "a child name")
            children.append((node_id, local))
        elif number == 2 and wire == 2:
            attr = {1: "", 2: "", 3: ""}
            for n2, w2, v2, _, _ in iter_fields(value):
                if n2 in attr and w2 == 2:
                    attr[n2] = _str(v2, "an attribute name")
            attributes.append((attr[1], attr[2], attr[3]))
        elif number == 3 and wire == 2:
            ref = {1: 0, 2: "", 3: 0}
            for n2, w2, v2, _, _ in iter_fields(value):
                if n2 in (1, 3) and w2 == 0:
                    ref[n2] = v2
                elif n2 == 2 and w2 == 2:
                    ref[2] = _str(v2, "a slot name")
            slots.append((ref[1], ref[2], ref[3]))
    return _Node(tuple(children), tuple(attributes), tuple(slots))


def _is_optimizer(node: _Node, local_name: str) -> bool:
    # Optimizers are recognized by their conventional name, by owning slot
    # variables (TF and Keras 2 optimizers), or by an iteration counter child
    # ('_iterations' in Keras 3, 'iter' in Keras 2).
    names = {name for _, name in node.children}
    return local_name == "optimizer" or bool(node.slot_variables) or bool(names & {"_iterations", "iter"})


class ObjectGraph:
    """A decoded ``TrackableObjectGraph``: nodes, and every tensor with its readable path.

    Built by ``decode_object_graph``; ``Checkpoint.object_graph`` holds one for
    object-based checkpoints.
    """

    def __init__(self, nodes: list[_Node]):
        self.nodes = tuple(nodes)
        if not self.nodes:
            raise CorruptCheckpointError("object graph has no nodes")
        for i, node in enumerate(self.nodes):
            for child, _ in node.children:
                if child >= len(self.nodes):
                    raise CorruptCheckpointError(f"object graph node {i} names child {child} of {len(self.nodes)}")
            for original, _, slot in node.slot_variables:
                if max(original, slot) >= len(self.nodes):
                    raise CorruptCheckpointError(f"object graph node {i} has a slot variable out of range")
        self._variables = self._name_variables()
        self.by_key: Mapping[str, TrackedVariable] = MappingProxyType({v.key: v for v in self._variables})
        self.by_path: Mapping[str, TrackedVariable] = MappingProxyType({v.path: v for v in self._variables})

    @property
    def variables(self) -> tuple:
        """Every tensor the graph names (attributes), in checkpoint-key order."""
        return self._variables

    def _walk(self, skip_optimizers: bool) -> tuple[dict[int, str], set[int]]:
        """BFS from the root: node id -> object path, and the optimizer nodes met."""
        paths = {0: ""}
        optimizers = set()
        queue = deque([0])
        while queue:
            node_id = queue.popleft()
            for child, local in self.nodes[node_id].children:
                if child in paths:
                    continue
                if _is_optimizer(self.nodes[child], local):
                    optimizers.add(child)
                    if skip_optimizers:
                        continue
                base = paths[node_id]
                paths[child] = f"{base}/{local}" if base else local
                queue.append(child)
        return paths, optimizers

    def _name_variables(self) -> tuple:
        model_paths, _ = self._walk(skip_optimizers=True)
        all_paths, _ = self._walk(skip_optimizers=False)
        slot_of = {}
        for opt in range(len(self.nodes)):
            for original, slot_name, slot in self.nodes[opt].slot_variables:
                slot_of[slot] = (original, slot_name, opt)
        found = self._attributes(model_paths, slot_of)
        model_path_of = self._model_paths(found, model_paths)
        result = []
        taken = set(model_path_of.values())
        for key, full_name, object_path, node_id, kind, _ in found:
            path = self._path_of(kind, node_id, full_name, object_path, model_path_of, slot_of, all_paths)
            if kind != "variable" and path in taken:
                path = object_path if object_path not in taken else key
            taken.add(path)
            result.append(TrackedVariable(key, path, object_path, full_name, node_id, kind))
        result.sort(key=lambda v: v.key)
        return tuple(result)

    def _attributes(self, model_paths: dict, slot_of: dict) -> list:
        """Every saved attribute: [key, full_name, object_path, node_id, kind, attr_name]."""
        root_children = {child: local for child, local in self.nodes[0].children}
        found = []
        for node_id, node in enumerate(self.nodes):
            for attr_name, full_name, key in node.attributes:
                if not key:
                    continue
                object_path = key[: -len(_VALUE_SUFFIX)] if key.endswith(_VALUE_SUFFIX) else key
                if node_id in model_paths and node_id not in slot_of:
                    kind = "save_counter" if root_children.get(node_id) == "save_counter" else "variable"
                else:
                    kind = "optimizer"
                found.append([key, full_name, object_path, node_id, kind, attr_name])
        return found

    @staticmethod
    def _model_paths(found: list, model_paths: dict) -> dict:
        """node id -> readable path of each model variable."""
        # Keras writes its variable.path as full_name; TF variables write their
        # graph name, which may repeat ('Variable'). Use full_name when unique.
        # A ShardedVariable writes its container's default name, which says nothing.
        counts: dict[str, int] = {_SHARDED_DEFAULT_NAME: 2}
        for key, full_name, _, _, kind, _ in found:
            if kind == "variable" and full_name:
                counts[full_name] = counts.get(full_name, 0) + 1
        model_path_of = {}
        for key, full_name, object_path, node_id, kind, attr_name in found:
            if kind != "variable":
                continue
            if full_name and counts[full_name] == 1 and not _DEFAULT_VARIABLE_NAME.match(full_name):
                path = full_name
            else:
                path = model_paths.get(node_id) or object_path
            if attr_name and attr_name != "VARIABLE_VALUE":
                path = f"{path}/{attr_name}"
            model_path_of[node_id] = path

        return model_path_of

    @staticmethod
    def _path_of(kind, node_id, full_name, object_path, model_path_of, slot_of, all_paths) -> str:
        if kind == "variable":
            return model_path_of[node_id]
        if kind == "save_counter":
            return "save_counter"
        if node_id in slot_of and slot_of[node_id][0] in model_path_of:
            original, slot_name, opt = slot_of[node_id]
            opt_path = all_paths.get(opt, "optimizer")
            return f"{model_path_of[original]}/.OPTIMIZER_SLOT/{opt_path}/{slot_name}"
        path = f"optimizer/{full_name}" if full_name else object_path
        if optimizer_slot_kind(path) is None:
            path = f"optimizer/{path}"
        return path


def decode_object_graph(raw: bytes) -> ObjectGraph:
    """Decode a serialized ``TrackableObjectGraph`` (the ``_CHECKPOINTABLE_OBJECT_GRAPH`` entry).

    Carries its own protobuf decoding, as ``restorekit._bundle.protos`` does, so
    listing an object-based checkpoint never imports TensorFlow.

    Raises:
        CorruptCheckpointError: the bytes are not a well-formed object graph.
    """
    if not isinstance(raw, (bytes, bytearray)):
        raise CorruptCheckpointError(f"object graph entry holds {type(raw).__name__}, not bytes")
    try:
        nodes = [_decode_node(value) for number, wire, value, _, _ in iter_fields(bytes(raw)) if number == 1 and wire == 2]
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"object graph is not a TrackableObjectGraph: {e}") from None
    return ObjectGraph(nodes)


# Field numbers of TrackableObjectGraph (nodes = 1), TrackableObject (attributes = 2)
# and SerializedTensor (checkpoint_key = 3).
_NODES, _ATTRIBUTES, _CHECKPOINT_KEY = 1, 2, 3


def _rewrite_attribute(raw: bytes, key_map: Mapping[str, str], drop) -> bytes | None:
    out = bytearray()
    for number, wire, value, start, stop in iter_fields(raw):
        if number == _CHECKPOINT_KEY and wire == 2:
            key = _str(value, "a checkpoint key")
            if key in drop:
                return None
            new = key_map.get(key, key)
            put_field(out, _CHECKPOINT_KEY, 2, new.encode("utf-8"))
        else:
            out += raw[start:stop]
    return bytes(out)


def _rewrite_node(raw: bytes, key_map: Mapping[str, str], drop) -> bytes:
    out = bytearray()
    for number, wire, value, start, stop in iter_fields(raw):
        if number == _ATTRIBUTES and wire == 2:
            attribute = _rewrite_attribute(value, key_map, drop)
            if attribute is not None:
                put_field(out, _ATTRIBUTES, 2, attribute)
        else:
            out += raw[start:stop]
    return bytes(out)


def rewrite_keys(raw: bytes, key_map: Mapping[str, str], drop=frozenset()) -> bytes:
    """Re-encode an object graph with attribute keys renamed by ``key_map`` and ``drop`` removed.

    Every other field is copied byte for byte, so the result is what TF would write
    for the same graph with the new keys.

    Raises:
        CorruptCheckpointError: ``raw`` is not a well-formed object graph.
    """
    decode_object_graph(raw)  # validates before anything is rebuilt
    raw = bytes(raw)
    drop = frozenset(drop)
    out = bytearray()
    for number, wire, value, start, stop in iter_fields(raw):
        if number == _NODES and wire == 2:
            put_field(out, _NODES, 2, _rewrite_node(value, key_map, drop))
        else:
            out += raw[start:stop]
    return bytes(out)
