"""TorchView: a checkpoint seen as the tensors a torch.nn module tree loads, for the format writers."""

from __future__ import annotations

import copy
from types import MappingProxyType

import numpy as np

from restorekit.layouts import _ops as _ops
from restorekit.layouts._kinds import Part
from restorekit.layouts._plan import plan_checkpoint
from restorekit.layouts._record import LayoutRecord, collision


def torch_view(checkpoint, layout: str | None = "torch", *, forget_bias: float = 1.0, layer_kinds: dict | None = None,
               model=None, flatten_channels: dict | None = None):
    """``checkpoint`` as layout 'torch' stores it (``layout`` None: ``checkpoint`` itself).

    The format writers take the view where they take a ``Checkpoint``
    (``safetensors.write_checkpoint(torch_view(ckpt), path, layout='torch')``): its
    entries are the stored tensors under their torch names, decoded on demand (split,
    gate-reordered, reshaped, added), or copied as raw shard bytes when a tensor
    keeps its bytes. What it cannot map is warned about once, by name.

    Args:
        checkpoint: a ``restorekit.Checkpoint``.
        layout: 'torch', or None for no view.
        forget_bias: what tf.compat.v1 ``LSTMCell``/``BasicLSTMCell`` add to the forget
            gate at run time (their constructor argument; 1.0 unless the model set
            another). It is stored in ``bias_hh_l0``.
        layer_kinds: ``{layer path: Keras class name}`` for layers whose kind the
            tensors leave open (``'DepthwiseConv2D'``, ``'Conv2DTranspose'``,
            ``'EinsumDense'``, ``'Conv1D'``).
        model: the live Keras model a TF2 checkpoint was written from
            (``tf.train.Checkpoint(model=model)``). Its object graph names the layers of
            functional and Sequential models only by position (``_operations/1``); with
            the model, each variable is named by the layers on its way
            (``block_a.fc.weight``), as a torch twin of the same tree names it. Without it,
            layers whose Keras paths collide (nested functional blocks each with an ``fc``)
            keep those positions, and a warning says so. Its config also shows which
            Dense layers read a flattened feature map (see below).
        flatten_channels: ``{Dense layer path or name: channels}`` for a Dense that reads a
            feature map flattened by Keras or tf-slim (``[*spatial, C]``, position first),
            whose columns are reordered to torch's channel-first ``nn.Flatten`` order; None
            for a Dense that reads no flattened map. A Keras file's config or ``model=``
            shows this by itself; a bare checkpoint cannot, and a Dense whose input size is a
            multiple of a convolution's channels is then warned about by name.

    Raises:
        InvalidArgumentError: a ``flatten_channels`` key naming no Dense layer, or channels
            that do not divide its inputs.
    """
    if layout != "torch":
        return checkpoint
    return TorchView(checkpoint, forget_bias=forget_bias, layer_kinds=layer_kinds, model=model,
                     flatten_channels=flatten_channels)


class TorchView:
    """The stored tensors of a layout-'torch' export of a checkpoint; duck-types what writers read of a ``Checkpoint``."""

    def __init__(self, checkpoint, *, forget_bias: float = 1.0, layer_kinds: dict | None = None, model=None,
                 flatten_channels: dict | None = None):
        from restorekit._checkpoint import Entry
        from restorekit.layouts._planned import keras_source
        from restorekit.keras_files import KerasCheckpoint

        self.checkpoint = checkpoint  # as given (its check_shards, files)
        if isinstance(checkpoint, KerasCheckpoint):  # layers are told by readable paths (enc1/kernel), not by keys
            checkpoint = keras_source(checkpoint)
        self._source = checkpoint
        self.prefix = checkpoint.prefix
        self.object_graph = None  # names are decided; the record below carries them
        plan = plan_checkpoint(checkpoint, forget_bias=forget_bias, layer_kinds=layer_kinds, model=model,
                               flatten_channels=flatten_channels)
        self.unsure = MappingProxyType(dict(plan.unsure))
        record = LayoutRecord("torch")
        record.unmapped.update(plan.unmapped)
        record._kept.extend(plan.kept)
        self._parts: dict[str, Part] = {}
        entries = {}
        seen = set()
        for part in plan.parts:
            if part.stored in self._parts:
                raise collision("torch", self._parts[part.stored].key, part.key, part.stored)
            self._parts[part.stored] = part
            entries[part.stored] = Entry(part.stored, part.shape, part.dtype, self._nbytes(part))
            if part.dtype == "string":
                continue
            note = part.note(first=part.key not in seen)
            seen.add(part.key)
            if note:
                record.tensors[part.stored] = note
            record._planned[part.stored] = (part.stored, None)
        self.entries = MappingProxyType(entries)
        self._record = record
        record.warn_unmapped(stacklevel=4)
        if plan.internal:
            _warn_internal(plan.internal)
        if plan.unsure:
            _warn_unsure(plan.unsure)


    @property
    def added(self) -> tuple:
        """Stored names with no TF tensor behind them (a BatchNorm's ``num_batches_tracked``), in file order."""
        return tuple(name for name, part in self._parts.items() if part.key is None)

    @property
    def layout_record(self) -> LayoutRecord:
        """A fresh copy of the planned record (each export fills its own)."""
        return copy.deepcopy(self._record)

    def _nbytes(self, part) -> int:
        if part.key is None:
            from restorekit._bundle.format import dtype_enum, numpy_dtype

            return int(np.prod(part.shape, dtype=np.int64)) * numpy_dtype(dtype_enum(part.dtype)).itemsize
        source = self._source.entries[part.key]
        whole = int(np.prod(source.shape, dtype=np.int64)) if source.shape else 1
        count = int(np.prod(part.shape, dtype=np.int64)) if part.shape else 1
        return source.nbytes if count == whole else source.nbytes * count // max(whole, 1)

    def _passes_bytes(self, part) -> bool:
        return part.key is not None and not part.ops and not part.extra

    def is_partitioned(self, name: str) -> bool:
        """True when the stored tensor must be decoded (not copied as raw shard bytes)."""
        part = self._parts[name]
        return not self._passes_bytes(part) or self._source.is_partitioned(part.key)

    def bundle_entry(self, name: str):
        return self._source.bundle_entry(self._parts[name].key)

    def data_file(self, shard_id: int) -> str:
        return self._source.data_file(shard_id)

    def read(self, name: str) -> np.ndarray:
        """The stored tensor ``name``, computed from its TF tensor."""
        from restorekit._bundle.format import dtype_enum, numpy_dtype

        part = self._parts[name]
        if part.key is None:
            return np.full(part.shape, part.extra["fill"], dtype=numpy_dtype(dtype_enum(part.dtype)))
        array = self._source.read(part.key)
        if "sum" in part.extra:
            return _ops.constants(part.extra["sum"], np.zeros(part.shape, dtype=array.dtype))
        return _ops.forward(part.ops, array) if part.ops else array

    def stored_entry(self, name: str) -> tuple | None:
        """(the source's key, its stored shape) that ``name`` is computed from; None for a tensor added for PyTorch."""
        part = self._parts.get(name)
        if part is None or part.key is None:
            return None
        return part.key, tuple(self._source.entries[part.key].shape)

    def backward(self, name: str):
        """(the source key stored tensor ``name`` is computed from, a function taking an array in ``name``'s
        layout to the key's), or None where ``name`` is not one whole source tensor (a piece, a sum, an addition).
        The function is linear (axes, gate order, reshapes), so it takes a difference as it takes a value."""
        part = self._parts.get(name)
        if part is None or part.key is None or part.extra or "take" in part.ops:
            return None
        return part.key, lambda array: _ops.backward(part.ops, array, name)

    def like(self, name: str, array: np.ndarray) -> np.ndarray | None:
        """``array``, shaped as the TF tensor ``name`` is computed from (an optimizer slot of that weight), through
        the steps that make ``name`` of it; None where ``name`` is no such plain image (added for PyTorch, or a sum)."""
        part = self._parts.get(name)
        if part is None or part.key is None or part.extra:
            return None
        return _ops.forward(part.ops, array) if part.ops else array

    def readable_name(self, name: str) -> str:
        part = self._parts.get(name)
        return part.key if part is not None and part.key is not None else name


def _warn_unsure(unsure: dict) -> None:
    import warnings

    from restorekit.errors import RestoreKitWarning

    lines = "; ".join(f"{scope!r}: {why}" for scope, why in list(unsure.items())[:4])
    more = f" ... and {len(unsure) - 4} more" if len(unsure) > 4 else ""
    example = next(iter(unsure)).rpartition("/")[2]
    warnings.warn(
        f"layout 'torch': {len(unsure)} Dense layer(s) may read a flattened feature map ({lines}{more}). Keras and "
        f"tf-slim flatten [height, width, channels] position first, torch.nn.Flatten after a Conv2d channel first, "
        f"so behind a Flatten these columns are in the wrong order for a torch twin and nothing else would show it. "
        f"Pass model=<the Keras model> (or convert from its .keras file), or flatten_channels={{{example!r}: "
        f"<channels of the flattened map>}} to reorder them, or flatten_channels={{{example!r}: None}} if no "
        f"Flatten precedes it",
        RestoreKitWarning,
        stacklevel=5,
    )


def _warn_internal(paths: list) -> None:
    import warnings

    from restorekit.errors import RestoreKitWarning

    shown = ", ".join(repr(p) for p in paths[:3]) + (f" ... and {len(paths) - 3} more" if len(paths) > 3 else "")
    warnings.warn(
        f"layout 'torch': {len(paths)} variable(s) are named by Keras' internal attributes ({shown}): the "
        f"checkpoint records their layers only by position and their Keras paths collide (nested functional "
        f"blocks with layers of one name); pass torch_view(checkpoint, model=<the Keras model>) to name them "
        f"by their layers",
        RestoreKitWarning,
        stacklevel=5,
    )
