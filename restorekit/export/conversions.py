"""export_checkpoint, import_checkpoint and convert: TF checkpoints to and from every format in the registry."""

from __future__ import annotations

import os

from restorekit.bundle import atomic
from restorekit.errors import CheckpointNotFoundError, InvalidArgumentError, OutputExistsError
from restorekit.export import formats
from restorekit.export.base import ExportResult, checkpoint_files, progress_bar
from restorekit.export.layout import check_layout

__all__ = ["convert", "export_checkpoint", "import_checkpoint", "source_format", "target_format"]


def source_format(path) -> str:
    """Which format a path holds: 'tf' or a file format ('torch', 'safetensors', 'npz', ...).

    Decided by the file's first bytes where it is a file, else by its extension; a
    prefix, directory, ``.index`` or ``.data-*`` path is a TF checkpoint.
    """
    path = os.fspath(path)
    if os.path.isfile(path) and not path.endswith(".index") and ".data-" not in os.path.basename(path):
        return formats.sniff(path) or formats.TF
    if not os.path.exists(path):
        return formats.by_suffix(path) or formats.TF
    return formats.TF


def target_format(path, to: str | None) -> str:
    """``to``, checked, or the format ``path``'s extension names ('tf' when none does)."""
    if to is None:
        return formats.by_suffix(path) or formats.TF
    if to != formats.TF:
        formats.module(to)  # InvalidArgumentError for an unknown name
    return to


def _check_output(out: str, fmt: str, sources: list[str], overwrite: bool) -> None:
    """Refuse an output that is one of the source files, or that exists (unless overwrite)."""
    targets = (checkpoint_files(out) or [out + ".index"]) if fmt == formats.TF else [out]
    real = {os.path.realpath(s) for s in sources}
    for t in targets:
        if os.path.realpath(t) in real:
            raise OutputExistsError(f"output {out!r} would overwrite its own source; choose another path",
                                    path=out, is_source=True)
    if not overwrite:
        existing = [t for t in targets if os.path.exists(t)]
        if existing:
            raise OutputExistsError(path=existing[0])


def _source_files(src: str, fmt: str) -> tuple[str, list[str]]:
    """(resolved source, the files it consists of)."""
    if fmt == formats.TF:
        from restorekit.checkpoint import resolve_prefix

        prefix = resolve_prefix(src)
        return prefix, checkpoint_files(prefix)
    if not os.path.isfile(src):
        raise CheckpointNotFoundError(f"no file at {src!r}", src)
    return src, [src]


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
        InvalidArgumentError: a layout the format cannot honour (npz keeps TF names and axes).
        MissingDependencyError: torch is needed and not installed.
    """
    from restorekit.checkpoint import Checkpoint

    check_layout(layout)
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    path = os.fspath(path)
    fmt = target_format(path, format)
    if fmt == formats.TF:
        raise InvalidArgumentError("export_checkpoint writes torch, safetensors or npz; use CheckpointEditor.save for tf")
    module = formats.module(fmt)
    _check_output(path, fmt, checkpoint_files(ckpt.prefix), overwrite)
    return module.write_checkpoint(ckpt, path, layout=layout, progress=progress)


def _open_source(src: str, fmt: str, layout: str | None, max_output_bytes: int | None = None):
    """(iterator of (stored name, array), LayoutRecord) of a non-TF file."""
    from restorekit.export.layout import LayoutRecord, guess_tf_names

    module = formats.module(fmt)
    record = module.read_record(src)
    if record is None:
        record = guess_tf_names(module.read_shapes(src)) if layout == "torch" else LayoutRecord()
    # Passed only when set, so a format whose read takes no limit still reads by default.
    limit = {} if max_output_bytes is None else {"max_output_bytes": max_output_bytes}
    return module.read(src, **limit), record


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
    max_output_bytes: int | None = None,
) -> ExportResult:
    """Write a ``.safetensors``, PyTorch (``.pt``) or ``.npz`` file as a TF checkpoint.

    What a restorekit export recorded in the file is undone exactly (names, axes,
    dtypes, string tensors). For files from elsewhere, ``layout='torch'`` maps PyTorch
    names and axes to TF ones by rule (``restorekit.export.layout.guess_tf_names``);
    ``layout=None`` keeps their names. ``.pt`` files are read with
    ``torch.load(weights_only=True)`` only: a pickle that wants to run code is refused.
    With ``overwrite``, exactly the old checkpoint's files are replaced (its ``.index``
    and ``.data-NNNNN-of-MMMMM`` shards, matched by name literally).

        import_checkpoint('model.safetensors', 'converted/model.ckpt')

    ``max_output_bytes`` bounds what the file may expand to (default: the larger of
    1 GiB and 64 times the file): a ``.pt`` view with stride 0 or an ``.npz`` of
    deflated zeros claiming more is refused before anything is read or written.

    Raises:
        CheckpointNotFoundError: no file at ``src``.
        CorruptCheckpointError: the file is malformed, or an unsafe pickle.
        OutputExistsError: the output exists (without overwrite) or is the source.
        OutputError: the tensors would exceed ``max_output_bytes``.
        MissingDependencyError: a .pt file without torch installed.
    """
    check_layout(layout)
    src, out_prefix = os.fspath(src), os.fspath(out_prefix)
    fmt = source_format(src)
    if fmt == formats.TF:
        from restorekit.checkpoint import resolve_prefix

        resolve_prefix(src)  # CheckpointNotFoundError when there is nothing at all
        raise InvalidArgumentError(f"{src!r} is a TF checkpoint; import_checkpoint reads torch, safetensors or npz files")
    src, files = _source_files(src, fmt)
    _check_output(out_prefix, formats.TF, files, overwrite)
    arrays, record = _open_source(src, fmt, layout, max_output_bytes)
    permuted = tuple(record.tf_name(n) for n, note in record.tensors.items() if "perm" in note)
    return _write_tf(out_prefix, _tf_tensors(arrays, record), layout=record.layout, permuted=permuted, progress=progress)


def _write_tf(out_prefix: str, tensors, *, layout=None, permuted=(), total=None, progress=False) -> ExportResult:
    """Write ``(name, array, TF dtype or None)`` as the checkpoint ``out_prefix``, replacing exactly its old files."""
    from restorekit.bundle.writer import BundleWriter, array_chunks

    count = nbytes = 0
    strings = []
    old = checkpoint_files(out_prefix)  # the .index first: the old checkpoint stops existing at once
    with atomic.Staging(os.path.dirname(os.path.abspath(out_prefix))) as staging:
        writer = BundleWriter(out_prefix, staging=staging)
        try:
            with progress_bar(total, progress, "tf") as bar:
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
            writer.finish(commit=False)
        except BaseException:
            writer.abort()
            raise
        staging.commit(remove_before=old)
    return ExportResult(out_prefix, formats.TF, count, nbytes, layout, tuple(permuted), tuple(strings))


def convert(src, out, *, to: str | None = None, layout: str | None = None, overwrite: bool = False,
            progress: bool = False, max_output_bytes: int | None = None) -> ExportResult:
    """Convert between TF checkpoints, PyTorch files, safetensors and npz.

    The source format is read from the file; the target from ``to`` or else the
    output's extension (no known extension: a TF checkpoint prefix).

        convert('train/model.ckpt-1000', 'model.pt', layout='torch')
        convert('model.safetensors', 'back/model.ckpt')

    Raises:
        InvalidArgumentError: an unknown ``to`` or layout, or a layout the target cannot honour.
        OutputExistsError: the output is the source, or exists without overwrite.
        OutputError: a file source would expand past ``max_output_bytes`` (see ``import_checkpoint``).
    """
    check_layout(layout)
    src, out = os.fspath(src), os.fspath(out)
    to = target_format(out, to)
    fmt = source_format(src)
    if fmt == formats.TF:
        if to == formats.TF:
            if layout is not None:
                raise InvalidArgumentError(
                    f"layout={layout!r} applies when writing or reading PyTorch, safetensors or npz files, "
                    "not in a TF-to-TF copy"
                )
            return _copy_tf(src, out, overwrite=overwrite, progress=progress)
        return export_checkpoint(src, out, format=to, layout=layout, overwrite=overwrite, progress=progress)
    if to == formats.TF:
        return import_checkpoint(src, out, layout=layout, overwrite=overwrite, progress=progress,
                                 max_output_bytes=max_output_bytes)
    # file -> file: back to TF names first, then out in the target's conventions.
    target = formats.module(to)
    src, files = _source_files(src, fmt)
    _check_output(out, to, files, overwrite)
    # A layout names the conventions of the side that has them: a .pt in PyTorch layout
    # converted to npz (which keeps TF names and axes) is read with it and written without.
    source = formats.module(fmt)
    read_layout = layout if layout in source.LAYOUTS else None
    write_layout = layout if layout in target.LAYOUTS else None
    if layout is not None and read_layout is None and write_layout is None:
        raise InvalidArgumentError(f"layout={layout!r} applies to neither {fmt} nor {to} files")
    arrays, record = _open_source(src, fmt, read_layout, max_output_bytes)
    # An object graph carried along names the tensors as the export from TF did.
    graph = record.object_graph() if write_layout == "torch" else None
    return target.write(out, _tf_tensors(arrays, record), layout=write_layout, graph=graph, progress=progress)


def _copy_tf(src: str, out: str, *, overwrite: bool, progress: bool) -> ExportResult:
    from restorekit.checkpoint import Checkpoint

    ckpt = Checkpoint(src)
    _check_output(out, formats.TF, checkpoint_files(ckpt.prefix), overwrite)
    entries = ckpt.entries
    tensors = ((name, ckpt.read(name), entries[name].dtype) for name in entries)
    return _write_tf(out, tensors, progress=progress)
