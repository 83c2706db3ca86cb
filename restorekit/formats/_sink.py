"""What every format's writer (its Sink side) shares: ExportResult, progress, dtype and byte helpers, argument checks.

The bottom of the writing side of ``restorekit.formats``: each format's writer imports
from here, never from another format's writer or from a layer above the formats.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

import numpy as np

from restorekit._bundle.staging import atomic_output  # noqa: F401  (format modules write through it)
from restorekit.errors import InvalidArgumentError, format_names
from restorekit._report import OptimizerSection, format_bytes

__all__ = [
    "STRINGS_LIMIT",
    "ExportResult",
    "atomic_output",
    "check_strings",
    "checkpoint_files",
    "contiguous",
    "layout_tensors",
    "little_endian",
    "progress_bar",
    "raw_bytes_view",
    "refuse",
    "tf_dtype_of",
]

STRINGS_LIMIT = 64 << 20


@dataclass(frozen=True)
class ExportResult:
    """What one export or import wrote.

    ``permuted`` and ``kept`` hold TF names: the tensors whose axes ``layout='torch'``
    permuted, and the optimizer state of an object-based checkpoint that it left in TF
    axes on purpose (see ``restorekit.layouts``). ``dropped`` holds the source
    names left out on purpose (``weights_only``, EMA shadows written under their
    weights' names, tied copies a rule set drops), ``fallback`` the weights ``ema=``
    found no shadow for (exported raw), ``renamed`` the rule set applied, ``files``
    every file written when there are several (shards, index, ``config.json``), ``added``
    the stored names layout 'torch' wrote with no TF tensor behind them (a BatchNorm's
    ``num_batches_tracked``): ``count`` counts them, as the file holds them. ``optimizer`` is the
    ``OptimizerSection`` of a TF1 training checkpoint written with optimizer slots (``tf1_training``).
    """

    path: str
    format: str
    count: int
    nbytes: int
    layout: str | None = None
    permuted: tuple = ()
    strings: tuple = ()
    kept: tuple = ()
    dropped: tuple = ()
    fallback: tuple = ()
    renamed: str | None = None
    files: tuple = ()
    unmapped: tuple = ()
    added: tuple = ()
    optimizer: OptimizerSection | None = None

    def __str__(self) -> str:
        text = f"wrote {self.count} tensors ({format_bytes(self.nbytes)}) to {self.path!r} as {self.format}"
        if self.layout:
            kept = f"; {len(self.kept)} optimizer tensors left in TF layout" if self.kept else ""
            text += f", layout {self.layout!r} ({len(self.permuted)} permuted{kept})"
        if self.added:
            text += f"; {len(self.added)} added for PyTorch with no TF tensor: {format_names(self.added)}"
        if self.strings:
            text += f"; string tensors carried in metadata: {', '.join(repr(s) for s in self.strings)}"
        if self.renamed:
            text += f"; names and axes by rule set {self.renamed!r}"
        if len(self.files) > 1:
            text += f"; {len(self.files)} files"
        if self.dropped:
            text += f"; left out {len(self.dropped)}: {format_names(self.dropped)}"
        if self.fallback:
            text += f"; no EMA shadow, raw values for {len(self.fallback)}: {format_names(self.fallback)}"
        if self.unmapped:
            text += f"; left in TF layout (not mapped) {len(self.unmapped)}: {format_names(self.unmapped)}"
        if self.optimizer is not None:
            text += "\n" + "\n".join(self.optimizer.lines())
        return text



def progress_bar(total: int | None, enabled: bool, desc: str):
    """A tqdm byte counter on stderr; silent unless enabled and stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        file=sys.stderr,
        disable=None if enabled else True,
        leave=False,
    )


def refuse(format: str, **arguments) -> None:
    """InvalidArgumentError for the first argument that is set which ``format`` cannot honour.

        refuse('npz', layout=layout, metadata=metadata)   # both must be None for npz
    """
    for name, value in arguments.items():
        if value is not None:
            raise InvalidArgumentError(f"{format} files cannot take {name}={value!r}; {_WHY.get(name, '')}".rstrip("; "))


_WHY = {
    "layout": "npz keeps TF names and axes; layout='torch' applies to torch and safetensors",
    "metadata": "free-form metadata (str -> str) is stored by safetensors only",
}


def tf_dtype_of(array: np.ndarray) -> str:
    """The TF dtype name of a numpy array ('bfloat16', 'string', ...)."""
    from restorekit._bundle.format import dtype_enum, dtype_name

    try:
        return dtype_name(dtype_enum(array.dtype))
    except ValueError:
        raise InvalidArgumentError(f"dtype {array.dtype} has no TensorFlow equivalent") from None


def layout_tensors(tensors, record):
    """Put each tensor in the output layout: yield ``(name, out_name, array, tf_dtype, permuted)``.

    The one loop behind every exporter: ``tensors`` are ``(TF name, ndarray)`` pairs
    (a third item, a TF dtype name, keeps dtypes numpy cannot name); string tensors
    go to ``record`` (carried in the file's metadata) and are not yielded; names and
    axes follow ``record``'s layout.
    """
    for name, array, *dtype in tensors:
        array = np.asarray(array)
        tf_dtype = dtype[0] if dtype and dtype[0] else tf_dtype_of(array)
        if tf_dtype == "string":
            record.add_string(name, array)
            continue
        out, perm = record.plan(name, array.shape)
        if perm is not None:
            array = np.ascontiguousarray(np.transpose(array, perm))
        yield name, out, array, tf_dtype, perm is not None


def checkpoint_entries(checkpoint, names: dict | None):
    """``(output name, checkpoint entry name)`` pairs: ``names`` (a renamed subset, in order) or every entry."""
    return names.items() if names is not None else ((n, n) for n in checkpoint.entries)


def check_strings(record, where: str) -> None:
    """Refuse string tensors too large to carry in a file's metadata (``where``)."""
    size = sum(len(v) for item in record.strings.values() for v in item["values"])
    if size > STRINGS_LIMIT:
        raise InvalidArgumentError(
            f"string tensors {', '.join(repr(n) for n in record.strings)} hold {size} bytes, too many to carry "
            f"in {where}; delete them (CheckpointEditor.delete) before exporting"
        )


def little_endian(array: np.ndarray) -> np.ndarray:
    """A C-contiguous, little-endian version of ``array`` (no copy when it already is)."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return contiguous(array)


def contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` in C order, copied only if needed (unlike np.ascontiguousarray, 0-d stays 0-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def raw_bytes_view(array: np.ndarray) -> memoryview:
    """The bytes of a contiguous array (works for ml_dtypes such as bfloat16)."""
    return array.reshape(-1).view(np.uint8).data


def checkpoint_files(prefix: str) -> list[str]:
    """The files of the local TF checkpoint ``prefix``: its ``.index`` (if any), then its data shards.

    Names are matched literally (``PREFIX.data-NNNNN-of-MMMMM``): a prefix such as
    ``model[1].ckpt`` or ``ckpt-1?`` must never take a neighbour's files
    (``model1.ckpt``, ``ckpt-10``), as a glob pattern would.
    """
    directory, base = os.path.split(os.path.abspath(os.fspath(prefix)))
    try:
        names = set(os.listdir(directory))
    except OSError:
        return []
    shard = re.compile(re.escape(base) + r"\.data-\d{5}-of-\d{5}")
    found = [os.path.join(directory, base + ".index")] if base + ".index" in names else []
    return found + sorted(os.path.join(directory, n) for n in names if shard.fullmatch(n))
