"""Name and axis conventions between TensorFlow and PyTorch, in both directions.

``layout='torch'`` renames and permutes each tensor the way PyTorch modules expect:

=========================  ==========================  ==============================
TensorFlow                 PyTorch                     axes
=========================  ==========================  ==============================
``dense/kernel`` [in,out]  ``dense.weight`` [out,in]   transposed
``conv/weights`` HWIO      ``conv.weight`` OIHW        (3, 2, 0, 1); 1-D/3-D convs too
``bn/gamma``, ``bn/beta``  ``bn.weight``, ``bn.bias``  unchanged
``moving_mean/variance``   ``running_mean/var``        unchanged
``bias``/``biases``        ``bias``                    unchanged
``embeddings``             ``weight``                  unchanged (same layout)
=========================  ==========================  ==============================

plus ``/`` -> ``.`` and TF2's ``/.ATTRIBUTES/VARIABLE_VALUE`` suffix dropped.

Object-based (TF2, Keras) checkpoints are planned from each variable's readable path
(``Checkpoint.readable_name``: the Keras ``variable.path`` such as ``conv/kernel``, or
the path under the model such as ``model/encoder/kernel``), not from its key, which
may name no layer at all (``optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE``,
``model/_operations/1/_kernel/...``). Optimizer state (slots such as Adam's
``momentum``, ``iteration``, ``learning_rate``) and ``save_counter`` keep their TF axes
and leaf names and are only named by their readable path with dots
(``optimizer.adam.conv_kernel_momentum``, ``model.dense.kernel.OPTIMIZER_SLOT.optimizer.m``):
Keras 3 optimizers record no link from a slot to its variable (only a name, which
repeats for plain ``tf.Variable``s), factored slots (Adafactor) have other shapes, and
PyTorch optimizers key their state by parameter index, not by name, so there is no
PyTorch layout to convert them to. ``ExportResult.kept`` lists them. Name-based (TF1)
checkpoints follow the table for every name; their slots (``dense/kernel/Adam``) end
in a leaf the table leaves alone, so they too keep their axes.

The mapping loses information (``kernel`` and ``gamma`` both become ``weight``), so
every export records what it did in a :class:`LayoutRecord` stored inside the file
(safetensors ``__metadata__``, the ``_metadata`` of a torch ``state_dict``); the import
replays it backwards and is bit-exact. Files written by other tools carry no record:
:func:`guess_tf_names` then maps PyTorch names back by name and rank (Keras names).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

import numpy as np

from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, NameCollisionError

__all__ = [
    "LAYOUTS",
    "LayoutRecord",
    "check_layout",
    "guess_tf_names",
    "invert",
    "restore_dtype",
    "torch_name",
    "torch_permutation",
]

LAYOUTS = (None, "torch")
METADATA_KEY = "restorekit"
_TF2_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
_LEAVES = {
    "kernel": "weight",
    "weights": "weight",
    "bias": "bias",
    "biases": "bias",
    "gamma": "weight",
    "beta": "bias",
    "moving_mean": "running_mean",
    "moving_variance": "running_var",
    "embeddings": "weight",
}
# Kernel axes TF -> PyTorch by rank: Dense [in, out] -> [out, in]; Conv{1,2,3}D
# [spatial..., in, out] -> [out, in, spatial...]. Conv2DTranspose stores
# [H, W, out, in] and PyTorch's ConvTranspose2d [in, out, H, W]: the same permutation.
_KERNEL_PERMS = {2: (1, 0), 3: (2, 1, 0), 4: (3, 2, 0, 1), 5: (4, 3, 0, 1, 2)}
_KERNEL_LEAVES = ("kernel", "weights")


def check_layout(layout) -> str | None:
    """Validate a ``layout`` argument (None or 'torch').

    Raises:
        InvalidArgumentError: any other value.
    """
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"unknown layout {layout!r}; use None (names and axes as stored) or 'torch'")
    return layout


def _leaf(name: str) -> tuple[str, str]:
    if name.endswith(_TF2_SUFFIX):
        name = name[: -len(_TF2_SUFFIX)]
    scope, _, leaf = name.rpartition("/")
    return scope, leaf


def torch_name(name: str) -> str:
    """'block1/conv/weights' -> 'block1.conv.weight'."""
    scope, leaf = _leaf(name)
    leaf = _LEAVES.get(leaf, leaf)
    return f"{scope}/{leaf}".replace("/", ".") if scope else leaf


def torch_permutation(name: str, rank: int) -> tuple[int, ...] | None:
    """The axes permutation taking a TF tensor to PyTorch layout, or None to keep it."""
    _, leaf = _leaf(name)
    if leaf in _KERNEL_LEAVES:
        return _KERNEL_PERMS.get(rank)
    return None


def _dotted(path: str) -> str:
    """'model/kernel/.OPTIMIZER_SLOT/optimizer/m' -> 'model.kernel.OPTIMIZER_SLOT.optimizer.m'."""
    return ".".join(part.lstrip(".") or part for part in path.split("/"))


def invert(perm) -> tuple[int, ...]:
    """The permutation undoing ``perm``."""
    return tuple(int(i) for i in np.argsort(perm))


@dataclass
class LayoutRecord:
    """What an export did to each tensor, so that an import can undo it exactly.

    ``tensors`` maps a stored name to a dict with any of ``name`` (the TF name, when
    it differs), ``dtype`` (the TF dtype, when the stored dtype does not say it, such
    as ``qint8`` stored as int8 or ``complex128`` stored as float64 pairs) and
    ``perm`` (the axes permutation applied). ``strings`` holds string tensors, which
    neither safetensors nor torch can store, as base64. ``graph``, the object graph of
    an object-based checkpoint (``Checkpoint.object_graph``), makes ``plan`` work from
    readable paths; it is not stored, since every stored name maps back to its key.
    """

    layout: str | None = None
    tensors: dict = field(default_factory=dict)
    strings: dict = field(default_factory=dict)
    graph: object = field(default=None, repr=False, compare=False)
    _owners: dict = field(default_factory=dict, repr=False)
    _kept: list = field(default_factory=list, repr=False)

    @classmethod
    def for_checkpoint(cls, checkpoint, layout: str | None) -> "LayoutRecord":
        """An empty record for exporting ``checkpoint``; with layout 'torch', planned from its object graph.

        Raises:
            CorruptCheckpointError: layout 'torch' and an unreadable object graph.
        """
        return cls(layout, graph=checkpoint.object_graph if layout == "torch" else None)

    @property
    def kept(self) -> tuple:
        """TF names of the optimizer state that layout 'torch' left in TF axes (object-based checkpoints)."""
        return tuple(self._kept)

    # -- export side
    def plan(self, name: str, shape: tuple, layout: str | None = None) -> tuple[str, tuple | None]:
        """Decide the stored name and permutation of one tensor and record them.

        Raises:
            NameCollisionError: two TF names map to one stored name.
        """
        layout = self.layout if layout is None else layout
        tracked = self.graph.by_key.get(name) if layout == "torch" and self.graph is not None else None
        if layout != "torch":
            out, perm = name, None
        elif tracked is None:  # name-based, or a key the object graph does not name
            out, perm = torch_name(name), torch_permutation(name, len(shape))
        elif tracked.kind == "variable":
            out, perm = torch_name(tracked.path), torch_permutation(tracked.path, len(shape))
        else:  # optimizer state and save_counter: see the module docstring
            out, perm = _dotted(tracked.path), None
        if out in self._owners:
            raise NameCollisionError(
                f"layout {layout!r} maps both {self._owners[out]!r} and {name!r} to {out!r}; "
                f"rename one first (CheckpointEditor.rename) or export without layout"
            )
        self._owners[out] = name
        if tracked is not None and tracked.kind == "optimizer":
            self._kept.append(name)
        self.note_tensor(out, name, perm)
        return out, perm

    def note_tensor(self, stored: str, name: str, perm) -> None:
        """Record that ``stored`` holds TF tensor ``name``, permuted by ``perm`` (None: not)."""
        note = {}
        if stored != name:
            note["name"] = name
        if perm is not None:
            note["perm"] = list(perm)
        if note:
            self.tensors[stored] = note

    def note_dtype(self, stored_name: str, tf_dtype: str) -> None:
        self.tensors.setdefault(stored_name, {})["dtype"] = tf_dtype

    def add_string(self, name: str, array: np.ndarray) -> None:
        flat = [v.encode() if isinstance(v, str) else bytes(v) for v in np.asarray(array, dtype=object).ravel()]
        self.strings[name] = {
            "shape": list(np.shape(array)),
            "values": [base64.b64encode(v).decode("ascii") for v in flat],
        }

    def to_json(self) -> str:
        return json.dumps(
            {"version": 1, "layout": self.layout, "tensors": self.tensors, "strings": self.strings},
            separators=(",", ":"),
            sort_keys=True,
        )

    # -- import side
    @classmethod
    def from_json(cls, text: str, where: str = "file") -> "LayoutRecord":
        """Parse a record written by :meth:`to_json`.

        Raises:
            CorruptCheckpointError: the text is not a restorekit layout record.
        """
        try:
            data = json.loads(text)
            record = cls(data.get("layout"), dict(data.get("tensors", {})), dict(data.get("strings", {})))
            if data.get("version") != 1 or record.layout not in LAYOUTS:
                raise ValueError(f"version {data.get('version')!r}, layout {record.layout!r}")
        except (ValueError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: unreadable restorekit layout record ({e})") from None
        return record

    def tf_name(self, stored: str) -> str:
        return self.tensors.get(stored, {}).get("name", stored)

    def restore(self, stored: str, array: np.ndarray) -> tuple[str, np.ndarray, str | None]:
        """Undo the export of one tensor: (TF name, array in TF layout, TF dtype or None)."""
        note = self.tensors.get(stored, {})
        perm = note.get("perm")
        if perm is not None:
            array = np.ascontiguousarray(np.transpose(array, invert(perm)))
        return note.get("name", stored), array, note.get("dtype")

    def object_graph(self):
        """The object graph among the string tensors carried along, or None.

        Raises:
            CorruptCheckpointError: it is there but does not decode.
        """
        from restorekit.checkpoint import OBJECT_GRAPH_KEY
        from restorekit.tf2 import decode_object_graph

        for name, array in self.string_tensors():
            if name == OBJECT_GRAPH_KEY and array.shape == ():
                return decode_object_graph(array.item())
        return None

    def string_tensors(self):
        """Yield (TF name, object array of bytes) for the string tensors carried along."""
        for name, item in self.strings.items():
            values = [base64.b64decode(v) for v in item["values"]]
            out = np.empty(len(values), dtype=object)
            out[:] = values
            yield name, out.reshape(item["shape"])


def guess_tf_names(shapes: dict) -> LayoutRecord:
    """A record mapping PyTorch-style names of a foreign file back to TF (Keras) names.

    Rules, by name and rank: ``.`` -> ``/``; ``weight`` of rank >= 2 -> ``kernel`` with
    the inverse kernel permutation; ``weight`` of rank 1 -> ``gamma``, and its sibling
    ``bias`` -> ``beta``; ``running_mean``/``running_var`` -> ``moving_mean``/
    ``moving_variance``. A rank-2 ``weight`` without a ``bias`` whose module is named
    like an embedding (``*embeddings``, ``*embedding``, ``embed``, ``embed_tokens``,
    ``embed_positions``, ``wte``, ``wpe``, ``shared``; not ``embed_out`` or
    ``embed_proj``) is a table: it becomes ``embeddings``, untransposed, as Keras names it.
    Other embedding tables cannot be told from Dense weights and come back transposed
    as ``kernel``: rename them after. Depthwise convolutions (``groups`` > 1) cannot be
    told from their weights either.

    Args:
        shapes: stored name -> shape, for every tensor in the file.

    Raises:
        NameCollisionError: two stored names map to one TF name.
    """
    record = LayoutRecord(layout="torch")
    norm_scopes = {n.rpartition(".")[0] for n, s in shapes.items() if n.endswith("weight") and len(s) == 1}
    norm_scopes |= {n.rpartition(".")[0] for n in shapes if n.endswith(("running_mean", "running_var"))}
    with_bias = {n.rpartition(".")[0] for n in shapes if n.endswith("bias")}
    owners: dict[str, str] = {}
    for stored, shape in shapes.items():
        scope, _, leaf = stored.rpartition(".")
        perm = None
        if leaf == "weight":
            if len(shape) == 2 and scope not in with_bias and _is_embedding(scope):
                leaf = "embeddings"
            elif len(shape) >= 2 and len(shape) in _KERNEL_PERMS:
                leaf, perm = "kernel", _KERNEL_PERMS[len(shape)]
            elif len(shape) == 1:
                leaf = "gamma"
        elif leaf == "bias" and scope in norm_scopes:
            leaf = "beta"
        else:
            leaf = {"running_mean": "moving_mean", "running_var": "moving_variance"}.get(leaf, leaf)
        name = f"{scope.replace('.', '/')}/{leaf}" if scope else leaf
        if name in owners:
            raise NameCollisionError(f"{owners[name]!r} and {stored!r} both map back to {name!r}")
        owners[name] = stored
        record.note_tensor(stored, name, perm)
    return record


def _is_embedding(scope: str) -> bool:
    module = scope.rpartition(".")[2].lower()
    # not 'embed_out' (GPT-NeoX's LM head), 'embed_proj' or 'unembed': those are Linear
    return module.endswith(("embeddings", "embedding")) or module in ("embed", "embed_tokens", "embed_positions", "wte", "wpe", "shared")


# TF dtypes a file format stores as another dtype; the record names the TF one.
STORED_AS = {"qint8": "int8", "quint8": "uint8", "qint16": "int16", "quint16": "uint16", "qint32": "int32"}


def restore_dtype(array: np.ndarray, dtype: str | None) -> np.ndarray:
    """Undo a dtype stand-in: complex128 comes back from float64 pairs; the rest as is."""
    if dtype == "complex128" and array.dtype == np.float64:
        if not array.shape or array.shape[-1] != 2:
            raise CorruptCheckpointError(f"a complex128 tensor stored as float64 pairs has shape {list(array.shape)}")
        return np.ascontiguousarray(array).view(np.complex128).reshape(array.shape[:-1])
    return array
