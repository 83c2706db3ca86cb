"""Checkpoints to and from PyTorch ``state_dict`` files, safetensors and npz.

One module per format, with the same verbs (``write``, ``read``)::

    restorekit.export.safetensors   streaming writer and reader of .safetensors
    restorekit.export.torch         torch.save / torch.load(weights_only=True)
    restorekit.export.npz           streaming numpy .npz writer
    restorekit.export.layout        TF <-> PyTorch names and axes (layout='torch')

and three functions over them: :func:`export_checkpoint` (TF checkpoint -> file),
:func:`import_checkpoint` (file -> TF checkpoint) and :func:`convert` (any -> any).
Importing this package never imports torch or safetensors.

Round trips are bit-exact (names, dtypes including bfloat16, values), with or
without ``layout='torch'``: what an export did is recorded inside the file. String
tensors (such as TF2's ``_CHECKPOINTABLE_OBJECT_GRAPH``), which neither safetensors
nor torch can hold, travel in that record too (base64), up to 64 MiB in all;
npz stores them as fixed-width bytes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

# atomic_output is imported from here by the format modules.
from restorekit.bundle.atomic import atomic_output  # noqa: F401
from restorekit.errors import (
    InvalidArgumentError,
    OutputExistsError,
)
from restorekit.report import format_bytes

__all__ = [
    "FORMATS",
    "ExportResult",
    "convert",
    "export_checkpoint",
    "import_checkpoint",
    "source_format",
]

FORMATS = ("tf", "torch", "safetensors", "npz")
_EXTENSIONS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch", ".npz": "npz"}
STRINGS_LIMIT = 64 << 20


@dataclass(frozen=True)
class ExportResult:
    """What one export or import wrote.

    ``permuted`` and ``kept`` hold TF names: the tensors whose axes ``layout='torch'``
    permuted, and the optimizer state of an object-based checkpoint that it left in TF
    axes on purpose (see ``restorekit.export.layout``).
    """

    path: str
    format: str
    count: int
    nbytes: int
    layout: str | None = None
    permuted: tuple = ()
    strings: tuple = ()
    kept: tuple = ()

    def __str__(self) -> str:
        text = f"wrote {self.count} tensors ({format_bytes(self.nbytes)}) to {self.path!r} as {self.format}"
        if self.layout:
            kept = f"; {len(self.kept)} optimizer tensors left in TF layout" if self.kept else ""
            text += f", layout {self.layout!r} ({len(self.permuted)} permuted{kept})"
        if self.strings:
            text += f"; string tensors carried in metadata: {', '.join(repr(s) for s in self.strings)}"
        return text


# ------------------------------------------------------------------ shared helpers

def progress_bar(total: int, enabled: bool, desc: str):
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


def tf_dtype_of(array: np.ndarray) -> str:
    """The TF dtype name of a numpy array ('bfloat16', 'string', ...)."""
    from restorekit.bundle.format import dtype_enum, dtype_name

    try:
        return dtype_name(dtype_enum(array.dtype))
    except ValueError:
        raise InvalidArgumentError(f"dtype {array.dtype} has no TensorFlow equivalent") from None


def layout_tensors(tensors, record):
    """Put each tensor in the output layout: yield ``(out_name, array, tf_dtype, permuted)``.

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
    return memoryview(array.reshape(-1).view(np.uint8))


def source_format(path) -> str:
    """Which format a path holds: 'tf', 'torch', 'safetensors' or 'npz'.

    Decided by the file's first bytes where it is a file, else by its extension; a
    prefix, directory, ``.index`` or ``.data-*`` path is a TF checkpoint.
    """
    path = os.fspath(path)
    if os.path.isfile(path) and not path.endswith(".index") and ".data-" not in os.path.basename(path):
        with open(path, "rb") as f:
            head = f.read(9)
        ext = os.path.splitext(path)[1].lower()
        if head.startswith(b"PK"):
            return "npz" if ext == ".npz" else "torch"
        if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20):
            return "safetensors"
        if head[:1] == b"\x80":  # a bare pickle: torch's legacy format
            return "torch"
        if ext in _EXTENSIONS:
            return _EXTENSIONS[ext]
    elif not os.path.exists(path):
        return _EXTENSIONS.get(os.path.splitext(path)[1].lower(), "tf")
    return "tf"


def target_format(path, to: str | None) -> str:
    if to is None:
        ext = os.path.splitext(os.fspath(path))[1].lower()
        to = _EXTENSIONS.get(ext, "tf")
    if to not in FORMATS:
        raise InvalidArgumentError(f"unknown format {to!r}; choose one of {', '.join(FORMATS)}")
    return to


def _tf_files(prefix: str) -> list[str]:
    import glob

    return [prefix + ".index"] + sorted(glob.glob(glob.escape(prefix) + ".data-*"))


def _check_output(out: str, fmt: str, sources: list[str], overwrite: bool) -> None:
    """Refuse an output that is one of the source files, or that exists (unless overwrite)."""
    targets = _tf_files(out) if fmt == "tf" else [out]
    real = {os.path.realpath(s) for s in sources}
    for t in targets:
        if os.path.realpath(t) in real:
            raise OutputExistsError(f"output {out!r} would overwrite its own source; choose another path")
    if not overwrite:
        existing = [t for t in targets if os.path.exists(t)]
        if existing:
            raise OutputExistsError(f"output {existing[0]!r} exists; pass overwrite=True (--overwrite) to replace it")


def _source_files(src: str, fmt: str) -> tuple[str, list[str]]:
    """(resolved source, the files it consists of)."""
    if fmt == "tf":
        from restorekit.checkpoint import resolve_prefix

        prefix = resolve_prefix(src)
        return prefix, _tf_files(prefix)
    if not os.path.isfile(src):
        from restorekit.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"no file at {src!r}", src)
    return src, [src]


# ------------------------------------------------------------------ public functions

def export_checkpoint(
    checkpoint,
    path,
    *,
    format: str | None = None,
    layout: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> ExportResult:
    """Write a TF checkpoint as a PyTorch ``state_dict``, a ``.safetensors`` or an ``.npz`` file.

    Streams tensor by tensor; numeric tensors that need no permutation are copied as
    raw bytes from the data shards (crc32c checked), so memory stays at one buffer
    (safetensors, npz) or at memory-mapped views of the shards (torch).

        export_checkpoint('train/model.ckpt-1000', 'model.safetensors', layout='torch')

    Args:
        checkpoint: a path (anything ``Checkpoint`` accepts) or a ``Checkpoint``.
        path: the output file.
        format: 'torch', 'safetensors' or 'npz'; by default from the extension.
        layout: None (TF names and axes) or 'torch' (see ``restorekit.export.layout``;
            object-based checkpoints are named from their readable paths, and their
            optimizer state keeps TF axes).
        overwrite: replace an existing output file.
        progress: show a progress bar on stderr (when it is a terminal).

    Returns:
        An ExportResult.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: the source.
        OutputExistsError: the output exists, or is the source.
        NameCollisionError: the layout maps two names onto one.
        MissingDependencyError: torch is needed and not installed.
    """
    from restorekit.checkpoint import Checkpoint
    from restorekit.export.layout import check_layout

    check_layout(layout)
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    path = os.fspath(path)
    fmt = target_format(path, format)
    if fmt == "tf":
        raise InvalidArgumentError("export_checkpoint writes torch, safetensors or npz; use CheckpointEditor.save for tf")
    _check_output(path, fmt, _tf_files(ckpt.prefix), overwrite)
    if fmt == "safetensors":
        from restorekit.export import safetensors

        return safetensors.write_checkpoint(ckpt, path, layout=layout, progress=progress)
    if fmt == "torch":
        from restorekit.export import torch

        return torch.write_checkpoint(ckpt, path, layout=layout, progress=progress)
    from restorekit.export import npz

    if layout is not None:
        raise InvalidArgumentError("npz keeps TF names and axes; layout='torch' applies to torch and safetensors")
    return npz.write(path, ((name, ckpt.read(name)) for name in ckpt.entries), progress=progress)


def _open_source(src: str, fmt: str, layout: str | None):
    """(names and shapes, iterator of (stored name, array), LayoutRecord) of a non-TF file."""
    from restorekit.export.layout import LayoutRecord, guess_tf_names

    if fmt == "safetensors":
        from restorekit.export import safetensors

        header = safetensors.read_header(src)
        shapes = {name: info.shape for name, info in header.tensors.items()}
        record = header.record
        arrays = safetensors.read(src)
    elif fmt == "torch":
        from restorekit.export import torch

        state, record = torch.load(src)
        shapes = {name: tuple(t.shape) for name, t in state.items()}
        arrays = ((name, torch.to_numpy(t)) for name, t in state.items())
    elif fmt == "npz":
        from restorekit.export import npz

        shapes, arrays = npz.read_shapes(src), npz.read(src)
        record = None
    else:  # pragma: no cover - callers dispatch tf elsewhere
        raise InvalidArgumentError(f"not a file format: {fmt!r}")
    if record is None:
        record = guess_tf_names(shapes) if layout == "torch" else LayoutRecord()
    return shapes, arrays, record


def _tf_tensors(arrays, record):
    """(TF name, array, TF dtype name or None) for every tensor of a source, strings last."""
    from restorekit.export.layout import restore_dtype

    for stored, array in arrays:
        name, array, dtype = record.restore(stored, array)
        yield name, restore_dtype(array, dtype), dtype
    for name, array in record.string_tensors():
        yield name, array, "string"


def import_checkpoint(
    src,
    out_prefix,
    *,
    layout: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> ExportResult:
    """Write a ``.safetensors``, PyTorch (``.pt``) or ``.npz`` file as a TF checkpoint.

    What a restorekit export recorded in the file is undone exactly (names, axes,
    dtypes, string tensors). For files from elsewhere, ``layout='torch'`` maps PyTorch
    names and axes to TF ones by rule (``restorekit.export.layout.guess_tf_names``);
    ``layout=None`` keeps their names. ``.pt`` files are read with
    ``torch.load(weights_only=True)`` only: a pickle that wants to run code is refused.

        import_checkpoint('model.safetensors', 'converted/model.ckpt')

    Raises:
        CheckpointNotFoundError: no file at ``src``.
        CorruptCheckpointError: the file is malformed, or an unsafe pickle.
        OutputExistsError: the output exists (without overwrite) or is the source.
        MissingDependencyError: a .pt file without torch installed.
    """
    from restorekit.export.layout import check_layout

    check_layout(layout)
    src, out_prefix = os.fspath(src), os.fspath(out_prefix)
    fmt = source_format(src)
    if fmt == "tf":
        from restorekit.checkpoint import resolve_prefix

        resolve_prefix(src)  # CheckpointNotFoundError when there is nothing at all
        raise InvalidArgumentError(f"{src!r} is a TF checkpoint; import_checkpoint reads torch, safetensors or npz files")
    src, files = _source_files(src, fmt)
    _check_output(out_prefix, "tf", files, overwrite)
    shapes, arrays, record = _open_source(src, fmt, layout)
    permuted = tuple(record.tf_name(n) for n, note in record.tensors.items() if "perm" in note)
    return _write_tf(out_prefix, _tf_tensors(arrays, record), layout=record.layout, permuted=permuted, progress=progress)


def _write_tf(out_prefix: str, tensors, *, layout=None, permuted=(), total=None, progress=False) -> ExportResult:
    from restorekit.bundle.writer import BundleWriter, array_chunks

    count = nbytes = 0
    strings = []
    with progress_bar(total, progress, "tf") as bar, BundleWriter(out_prefix) as writer:
        for name, array, dtype in tensors:
            if dtype == "string":
                strings.append(name)
            if dtype is not None and dtype != "string":
                # add_stream keeps dtypes numpy cannot name (qint8 stored as int8, ...).
                writer.add_stream(name, dtype, array.shape, array_chunks(array))
            else:
                writer.add(name, array)
            count += 1
            size = array.nbytes if array.dtype != object else 0
            nbytes += size
            bar.update(size)
    return ExportResult(out_prefix, "tf", count, nbytes, layout, tuple(permuted), tuple(strings))


def convert(src, out, *, to: str | None = None, layout: str | None = None, overwrite: bool = False, progress: bool = False) -> ExportResult:
    """Convert between TF checkpoints, PyTorch files, safetensors and npz.

    The source format is read from the file; the target from ``to`` or else the
    output's extension (no known extension: a TF checkpoint prefix).

        convert('train/model.ckpt-1000', 'model.pt', layout='torch')
        convert('model.safetensors', 'back/model.ckpt')

    Raises:
        InvalidArgumentError: an unknown ``to`` or layout.
        OutputExistsError: the output is the source, or exists without overwrite.
    """
    from restorekit.export.layout import check_layout

    check_layout(layout)
    src, out = os.fspath(src), os.fspath(out)
    to = target_format(out, to)
    fmt = source_format(src)
    if fmt == "tf":
        if to == "tf":
            if layout is not None:
                raise InvalidArgumentError(
                    f"layout={layout!r} applies when writing or reading PyTorch, safetensors or npz files, "
                    "not in a TF-to-TF copy"
                )
            return _copy_tf(src, out, overwrite=overwrite, progress=progress)
        return export_checkpoint(src, out, format=to, layout=layout, overwrite=overwrite, progress=progress)
    if to == "tf":
        return import_checkpoint(src, out, layout=layout, overwrite=overwrite, progress=progress)
    # file -> file: back to TF names first, then out in the target's conventions.
    src, files = _source_files(src, fmt)
    _check_output(out, to, files, overwrite)
    shapes, arrays, record = _open_source(src, fmt, layout if fmt != "npz" else None)
    # An object graph carried along names the tensors as the export from TF did.
    graph = record.object_graph() if layout == "torch" and to != "npz" else None
    tensors = _tf_tensors(arrays, record)
    if to == "safetensors":
        from restorekit.export import safetensors

        return safetensors.write(out, tensors, layout=layout, graph=graph)
    if to == "torch":
        from restorekit.export import torch

        return torch.write(out, tensors, layout=layout, graph=graph)
    from restorekit.export import npz

    return npz.write(out, tensors, progress=progress)


def _copy_tf(src: str, out: str, *, overwrite: bool, progress: bool) -> ExportResult:
    from restorekit.checkpoint import Checkpoint

    ckpt = Checkpoint(src)
    _check_output(out, "tf", _tf_files(ckpt.prefix), overwrite)
    entries = ckpt.entries
    tensors = ((name, ckpt.read(name), entries[name].dtype) for name in entries)
    return _write_tf(out, tensors, progress=progress)
