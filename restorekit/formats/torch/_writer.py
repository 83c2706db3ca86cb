"""PyTorch ``state_dict`` files, written with ``torch.save``; the reader (``torch.load(weights_only=True)``) is ``restorekit.formats.torch``.

torch is imported only inside these functions. A ``.pt`` file is a pickle, so it is
only ever loaded with ``weights_only=True``: a file that asks to run code is refused
with ``CorruptCheckpointError`` before anything runs. What an export did (names,
axes, dtype stand-ins, string tensors) is recorded in the state_dict's ``_metadata``
attribute under ``'__restorekit__'``, where ``load_state_dict`` never looks at it.
"""

from __future__ import annotations

import collections
import os
from typing import Iterable

import numpy as np

from restorekit._bundle import files
from restorekit.errors import InvalidArgumentError
from restorekit.formats._sink import ExportResult, atomic_output, check_strings, checkpoint_entries, contiguous, layout_tensors, progress_bar, refuse, tf_dtype_of
from restorekit.layouts import STORED_AS, LayoutRecord, check_layout
from restorekit.formats._rawcopy import copy_raw
from restorekit.formats._dtypes import TORCH_DTYPES
from restorekit.formats.torch._reader import FORMAT, _BITS, RECORD_KEY, _torch

__all__ = ["LAYOUTS", "from_numpy", "write", "write_checkpoint"]

LAYOUTS = (None, "torch")  # the layout= values write and write_checkpoint accept



def from_numpy(array: np.ndarray, tf_dtype: str | None = None):
    """A torch tensor sharing ``array``'s memory where it can (bfloat16/float8 included)."""
    torch = _torch()
    tf_dtype = tf_dtype or tf_dtype_of(array)
    if tf_dtype in _BITS:
        int_name, int_type = _BITS[tf_dtype]
        return torch.from_numpy(contiguous(array).view(int_type)).view(getattr(torch, TORCH_DTYPES[tf_dtype]))
    if tf_dtype in TORCH_DTYPES or tf_dtype in STORED_AS:
        if not array.flags.writeable:
            array = array.copy()
        return torch.from_numpy(contiguous(array))
    raise InvalidArgumentError(f"dtype {tf_dtype!r} has no PyTorch equivalent")


def _save(path: str, state: collections.OrderedDict, record: LayoutRecord) -> None:
    torch = _torch()
    check_strings(record, "the state_dict metadata")
    # torch's state_dict convention: its metadata is an attribute of the OrderedDict (torch.load keeps it),
    # which typeshed's OrderedDict does not declare
    state._metadata = {RECORD_KEY: record.to_json()}  # type: ignore[attr-defined]
    with atomic_output(path) as tmp:
        torch.save(state, tmp)


def write(path, tensors: Iterable, *, layout: str | None = None, metadata: dict | None = None, graph=None,
          progress: bool = False) -> ExportResult:
    """Write ``(name, ndarray)`` pairs as a PyTorch ``state_dict`` file (``torch.save``).

    ``torch.save`` pickles one dict, so every tensor is held in memory until the file
    is written (``write_checkpoint`` maps a checkpoint's shards instead). Tensors share
    memory with the arrays given; the file appears at ``path`` only when complete.

    Args:
        path: the output file (replaced if it exists).
        tensors: an iterable of ``(TF name, ndarray)``; a third item, a TF dtype
            name, keeps dtypes numpy cannot name (``'qint8'``).
        layout: None, or 'torch' for PyTorch names and axes (``restorekit.layouts``).
        metadata: refused (a state_dict has no place for free-form metadata).
        graph: the object graph of the tensors' checkpoint (``Checkpoint.object_graph``),
            so that layout 'torch' names them from their readable paths.
        progress: show a byte counter on stderr while tensors are gathered.

    Raises:
        MissingDependencyError: torch is not installed.
        NameCollisionError: the layout maps two names onto one (nothing is written).
        InvalidArgumentError: ``metadata`` given.
    """
    check_layout(layout)
    refuse(FORMAT, metadata=metadata)
    _torch()
    record = LayoutRecord(layout, graph=graph)
    state = collections.OrderedDict()
    permuted = []
    nbytes = 0
    with progress_bar(None, progress, "torch") as bar:
        for name, out, array, tf_dtype, was_permuted in layout_tensors(tensors, record):
            if was_permuted:
                permuted.append(name)
            if tf_dtype in STORED_AS:
                record.note_dtype(out, tf_dtype)
            state[out] = from_numpy(array, tf_dtype)
            nbytes += array.nbytes
            bar.update(array.nbytes)
    path = os.fspath(path)
    _save(path, state, record)
    return ExportResult(path, "torch", len(state), nbytes, layout, tuple(permuted), tuple(record.strings), record.kept,
                        unmapped=tuple(record.unmapped))


def write_checkpoint(checkpoint, path, *, names: dict | None = None, layout: str | None = None,
                     metadata: dict | None = None, progress: bool = False) -> ExportResult:
    """Write every tensor of a TF checkpoint as a ``state_dict`` file.

    ``names``: as in ``safetensors.write_checkpoint`` (a renamed subset, in order).

    Tensors that need no permutation are memory-mapped from the data shards (after a
    crc32c check), so ``torch.save`` reads them from the page cache instead of
    holding them all in memory; permuted kernels are materialised.

    Raises:
        MissingDependencyError: torch is not installed.
        NameCollisionError, InvalidArgumentError: before anything is written.
        ChecksumMismatchError, CorruptCheckpointError: a bad shard (no output left).
    """
    check_layout(layout)
    refuse(FORMAT, metadata=metadata)
    _torch()
    record = LayoutRecord.for_checkpoint(checkpoint, layout)
    plan = []
    for name, source in checkpoint_entries(checkpoint, names):
        entry = checkpoint.entries[source]
        if entry.dtype == "string":
            record.add_string(name, checkpoint.read(source))
            continue
        if entry.dtype not in TORCH_DTYPES and entry.dtype not in STORED_AS:
            raise InvalidArgumentError(f"checkpoint entry {source!r} has dtype {entry.dtype!r}, which torch cannot hold")
        out, perm = record.plan(name, entry.shape)
        if entry.dtype in STORED_AS:
            record.note_dtype(out, entry.dtype)
        plan.append((source, out, perm))
    state = collections.OrderedDict()
    handles: dict = {}
    shards: dict = {}
    nbytes = sum(checkpoint.entries[name].nbytes for name, _, _ in plan)
    path = os.fspath(path)
    local = not files.is_remote(checkpoint.prefix)  # remote shards are read whole, not mapped
    try:
        with progress_bar(nbytes, progress, "torch") as bar:
            for name, out, perm in plan:
                entry = checkpoint.entries[name]
                if local and perm is None and not checkpoint.is_partitioned(name) and entry.nbytes:
                    raw = checkpoint.bundle_entry(name)
                    copy_raw(checkpoint, name, raw, _Discard(), handles, bar)  # crc check only
                    state[out] = _mapped(shards, checkpoint.data_file(raw.shard_id), raw, entry)
                    continue
                array = checkpoint.read(name)
                if perm is not None:
                    array = np.ascontiguousarray(np.transpose(array, perm))
                bar.update(entry.nbytes)
                state[out] = from_numpy(array, STORED_AS.get(entry.dtype, entry.dtype))
            _save(path, state, record)
    finally:
        for handle in handles.values():
            handle.close()
    permuted = record.permuted()
    return ExportResult(path, "torch", len(state), nbytes, layout, permuted, tuple(record.strings), record.kept,
                        unmapped=tuple(record.unmapped))


class _Discard:
    def write(self, data) -> int:
        return len(data)


def _mapped(shards: dict, path: str, raw, entry):
    """A tensor over ``raw``'s bytes in a private (copy-on-write) mapping of its data shard.

    One mapping per shard, and it holds no file descriptor (numpy's memmap holds one
    each, so a mapping per tensor ran into ``ulimit -n`` past about 1,000 tensors);
    nothing is ever written to the source shard.
    """
    torch = _torch()
    shard = shards.get(path)
    if shard is None:
        shard = shards[path] = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
    dtype = getattr(torch, TORCH_DTYPES[STORED_AS.get(entry.dtype, entry.dtype)])
    tensor = torch.empty(0, dtype=dtype).set_(shard[raw.offset : raw.offset + raw.size])
    return tensor.view(tuple(entry.shape))


