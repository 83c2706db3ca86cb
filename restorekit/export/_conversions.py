"""export_checkpoint, import_checkpoint and convert: any checkpoint format to any other, as open -> plan -> write.

Each verb opens its source once (``restorekit.formats.open``, or takes one already open),
checks its options once against the one table of what applies where
(``restorekit.export._request.OPTIONS``), then hands the open source down: a TF checkpoint
or Keras file to ``from_checkpoint``, a safetensors / PyTorch / npz file's reader to
``from_files``. Each plans from names and shapes first (``restorekit.export._options``:
``weights_only``, ``ema``, ``rules``), so a bad request fails before anything is written,
then streams tensor by tensor.
"""

from __future__ import annotations

import os

from restorekit._bundle.files import check_parent, output_prefix
from restorekit.errors import InvalidArgumentError
from restorekit.export import _from_checkpoint as from_checkpoint, _from_files as from_files, _keras as keras
from restorekit.formats import _sinks as formats
from restorekit.formats._sink import ExportResult
from restorekit.layouts import TorchView
from restorekit.export._outputs import check_output
from restorekit.export._request import KERAS, Request, given, renamed_keywords, request
from restorekit.export import _sources as sources
from restorekit.export._sources import shard_set
from restorekit.export._targets import legacy_h5_refused, target_format
from restorekit.formats.tf._writer import write_tf

__all__ = ["convert", "export_checkpoint", "import_checkpoint", "open_source", "source_format", "target_format",
           "write_tf"]


def source_format(path) -> str:
    """Which format a path holds: 'tf' or a file format ('torch', 'safetensors', 'npz', ...).

    Decided by the file's first bytes where it is a file, else by its extension; a
    prefix, directory, ``.index`` or ``.data-*`` path is a TF checkpoint, except a
    directory of safetensors shards (or with one ``model.safetensors``) and a
    ``*.safetensors.index.json``, which are 'safetensors'. (The verbs here open their
    sources with ``restorekit.formats.open``, which also tells Keras files apart.)
    """
    path = os.fspath(path)
    if shard_set(path) is not None:
        return "safetensors"
    if os.path.isfile(path) and not path.endswith(".index") and ".data-" not in os.path.basename(path):
        return formats.sniff(path) or formats.TF
    if not os.path.exists(path):
        return formats.by_suffix(path) or formats.TF
    return formats.TF


def open_source(src):
    """(the open Source, its format name) of ``src``: a path opened once by ``restorekit.formats.open``, or a
    Source (``Checkpoint``, ``KerasCheckpoint``, ``FileView``, a ``torch_view``) taken as it is."""
    from restorekit.formats import detect, open_source as open_path
    from restorekit.formats.files import FileView
    from restorekit.keras_files import KerasCheckpoint

    if isinstance(src, (str, os.PathLike)):
        fmt = detect(src)
        return open_path(src, fmt), fmt
    if isinstance(src, KerasCheckpoint):
        return src, KERAS
    if isinstance(src, FileView):
        return src, src.format
    return src, formats.TF


def _files(source, fmt: str) -> tuple:
    """The files a source consists of: what its output must never be."""
    from restorekit.formats._sink import checkpoint_files

    if fmt == formats.TF:
        return tuple(checkpoint_files(source.prefix))
    return tuple(source.files) if fmt == KERAS else tuple(source.reader.files)


def _target(out: str, to: str | None, options: Request) -> str:
    """The output format: ``to``, else the name's; a name that says nothing plus ``max_shard_size`` is a directory
    of safetensors shards (pass ``to='tf'`` for a TF checkpoint in data shards of that size)."""
    if keras.is_keras_target(out, to):
        return KERAS
    if keras.is_legacy_target(out, to):
        return keras.KERAS_LEGACY
    fmt = target_format(out, to)
    if to is None and fmt == formats.TF and options.max_shard_size is not None:
        return "safetensors"
    return fmt


def _by_path(source, fmt: str, options: Request):
    """A Keras file as the checkpoint it holds under readable paths (``layouts._planned.keras_source``, read through h5py,
    its optimizer group left out for ``weights_only``); any other source as it is."""
    if fmt != KERAS:
        return source
    from restorekit.layouts._planned import keras_source

    return keras_source(source, weights_only=options.weights_only)


# ------------------------------------------------------------------ TF checkpoint (or Keras file) -> file
@renamed_keywords(path="out", format="to")
def export_checkpoint(
    checkpoint,
    out,
    *,
    to: str | None = None,
    layout: str | None = None,
    rules=None,
    weights_only: bool = False,
    ema=None,
    max_shard_size=None,
    config=None,
    overwrite: bool = False,
    progress: bool = False,
    model=None,
    flatten_channels: dict | None = None,
) -> ExportResult:
    """Write a TF checkpoint as a PyTorch ``state_dict``, a ``.safetensors`` or an ``.npz`` file.

    Streams tensor by tensor; numeric tensors that need no permutation are copied as
    raw bytes from the data shards (crc32c checked), so memory stays at one buffer
    (safetensors, npz) or at memory-mapped views of the shards (torch).

        export_checkpoint('train/model.ckpt-1000', 'model.safetensors', layout='torch')
        export_checkpoint('bert_model.ckpt', 'hf/model.safetensors', rules='bert-tf-to-hf',
                          weights_only=True, config=True)

    Args:
        checkpoint: a path (anything ``Checkpoint`` accepts), a ``Checkpoint``, or a
            ``restorekit.layouts.torch_view`` of one to give layout 'torch' hints
            (``forget_bias``, ``layer_kinds``); a view means ``layout='torch'`` and takes
            no ``rules``, ``weights_only`` or ``ema`` (they choose the tensors the view maps).
        out: the output file; with ``max_shard_size``, a directory (or ``DIR/NAME.safetensors``).
            (Its old name ``path=`` still works, with a DeprecationWarning.)
        to: 'torch', 'safetensors' or 'npz'; by default from the extension (old name: ``format=``).
        layout: None (TF names and axes) or 'torch': each layer as its ``torch.nn``
            counterpart loads it (names, axes, gate order, split and added tensors; see
            ``restorekit.layouts``). Object-based checkpoints are named from their
            readable paths, and their optimizer state keeps TF axes. What cannot be mapped
            is stored with TF names and axes, warned about and listed in ``ExportResult.unmapped``.
        rules: a rule set of ``restorekit.export._hf`` (``'bert-tf-to-hf'``, ``'gpt2-tf-to-hf'``,
            ...; names and axes) or a rename rule as ``CheckpointEditor.rename_all`` takes.
        weights_only: leave out optimizer state, ``global_step`` and ``save_counter``.
        ema: True (or a shadow suffix, or an ``ExponentialMovingAverage``): write each
            weight's moving average as the weight; weights without one keep their raw
            values and are listed in ``ExportResult.fallback`` (see ``restorekit.export._options``).
        max_shard_size: write Hugging Face-style safetensors shards of at most this size
            (``'5GB'``, ``'500MiB'``, bytes) with a ``model.safetensors.index.json``.
        config: with a Hugging Face rule set, True or a dict of values: write
            ``config.json`` beside the output, sizes read from the shapes (see ``hf.hf_config``).
        overwrite: replace an existing output file.
        progress: show a progress bar on stderr (when it is a terminal).
        model: with ``layout='torch'``, the live Keras model a TF2 checkpoint was written
            from: layers named by the layers on their way, and Dense layers behind a
            Flatten reordered (``restorekit.layouts.torch_view``).
        flatten_channels: with ``layout='torch'``, ``{Dense layer: channels}`` of the
            flattened feature map each reads (None: none), as ``torch_view`` takes it.

    Returns:
        An ExportResult.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: the source.
        OutputExistsError: the output exists, or is the source.
        NameCollisionError: the layout or the rules map two names onto one.
        OptionNotApplicableError: an option the target does not take (``restorekit.export._request.OPTIONS``:
            a layout for npz, ``max_shard_size`` for torch, ...); nothing is written.
        InvalidArgumentError: a name no rule of the rule set covers, ``ema`` without shadows.
        MissingDependencyError: torch is needed and not installed.
    """
    if isinstance(checkpoint, TorchView):
        if layout not in (None, "torch"):
            raise InvalidArgumentError(f"a torch_view is exported with layout 'torch', not layout={layout!r}")
        if rules is not None or weights_only or given(ema) or model is not None or flatten_channels is not None:
            raise InvalidArgumentError("rules=, weights_only=, ema=, model= and flatten_channels= choose the tensors "
                                       "a torch_view maps: pass them with the checkpoint itself "
                                       "(export_checkpoint(ckpt, ..., layout='torch', ...)), not with a view of it")
        layout = "torch"
    options = request(layout, rules, weights_only, ema, max_shard_size, config, model=model,
                      flatten_channels=flatten_channels)
    out = os.fspath(out)
    fmt = _target(out, to, options)
    if fmt in (formats.TF, KERAS):
        raise InvalidArgumentError(f"export_checkpoint writes torch, safetensors or npz; use convert for {fmt}")
    source, source_fmt = open_source(checkpoint)
    return _export(source, source_fmt, out, fmt, options, overwrite=overwrite, progress=progress)


def _export(source, source_fmt: str, out: str, to: str, options: Request, *, overwrite: bool,
            progress: bool, ranks=None) -> ExportResult:
    """An open TF checkpoint or Keras file -> a ``to`` file: options checked, then planned and written."""
    options.check(to, source_fmt)
    return from_checkpoint.write_file(_by_path(source, source_fmt, options), _files(source, source_fmt), out, to,
                                      options, overwrite=overwrite, progress=progress, ranks=ranks)


# ------------------------------------------------------------------ file -> TF checkpoint
@renamed_keywords(out_prefix="out")
def import_checkpoint(
    src,
    out,
    *,
    layout: str | None = None,
    rules=None,
    weights_only: bool = False,
    ema=None,
    overwrite: bool = False,
    progress: bool = False,
    max_output_bytes: int | None = None,
    num_shards: int | None = None,
    max_shard_size=None,
) -> ExportResult:
    """Write a ``.safetensors`` (or a directory of shards, or their ``*.index.json``), PyTorch (``.pt``)
    or ``.npz`` file as a TF checkpoint.

    What a restorekit export recorded in the file is undone exactly (names, axes,
    dtypes, string tensors). For files from elsewhere, ``layout='torch'`` maps PyTorch
    names and axes to TF ones by rule (``restorekit.layouts.guess_tf_names``),
    and ``rules`` applies a rule set (``'bert-hf-to-tf'``, ``'gpt2-hf-to-tf'``) or a
    rename rule; ``layout=None`` keeps their names. ``weights_only`` and ``ema`` are
    as in ``export_checkpoint``. ``.pt`` files are read with
    ``torch.load(weights_only=True)`` only: a pickle that wants to run code is refused.
    With ``overwrite``, exactly the old checkpoint's files are replaced (its ``.index``
    and ``.data-NNNNN-of-MMMMM`` shards, matched by name literally). ``max_output_bytes``
    bounds what a ``.pt`` or ``.npz`` may expand to (stride-0 views, deflated members);
    the default is the larger of 1 GiB and 64 times the file. ``num_shards`` writes
    that many data shards, balanced by bytes in write order, and ``max_shard_size`` data shards
    of at most that size (``'500MB'``, bytes), as ``CheckpointEditor.save``. ``out`` is the
    output prefix (its old name ``out_prefix=`` still works, with a DeprecationWarning).

        import_checkpoint('model.safetensors', 'converted/model.ckpt')
        import_checkpoint('hf-model/', 'tf/model.ckpt', rules='bert-hf-to-tf')

    Raises:
        CheckpointNotFoundError: no file at ``src``.
        CorruptCheckpointError: the file is malformed, or an unsafe pickle; a shard
            missing from a set (nothing is written).
        OutputExistsError: the output exists (without overwrite) or is the source.
        OutputError: the tensors would expand past ``max_output_bytes``.
        InvalidArgumentError: ``num_shards`` is not a positive int, the source is a TF checkpoint (nothing is written).
        OptionNotApplicableError: an option a TF checkpoint output does not take (``config``, a layout of
            an npz source); nothing is written.
        MissingDependencyError: a .pt file without torch installed.
    """
    options = request(layout, rules, weights_only, ema, max_shard_size, None, num_shards)
    source, fmt = open_source(src)
    if fmt in (formats.TF, KERAS):
        raise InvalidArgumentError(f"{source.prefix!r} is a {'TF checkpoint' if fmt == formats.TF else 'Keras file'}; "
                                   "import_checkpoint reads torch, safetensors or npz files (convert reads any)")
    return _import(source, fmt, os.fspath(out), options, overwrite=overwrite, progress=progress,
                   max_output_bytes=max_output_bytes)


def _import(source, fmt: str, out: str, options: Request, *, overwrite: bool, progress: bool,
            max_output_bytes) -> ExportResult:
    options.check(formats.TF, fmt)
    return from_files.write_tf_checkpoint(sources.of_view(source), out, options, overwrite=overwrite, progress=progress,
                                          max_output_bytes=max_output_bytes)


# ------------------------------------------------------------------ any -> any
def convert(src, out, *, to: str | None = None, layout: str | None = None, rules=None, weights_only: bool = False,
            ema=None, max_shard_size=None, config=None, overwrite: bool = False,
            progress: bool = False, max_output_bytes: int | None = None, num_shards: int | None = None,
            model=None, flatten_channels: dict | None = None, distributed: bool = False) -> ExportResult:
    """Convert between TF checkpoints, PyTorch files, safetensors (one file or shards), npz and Keras weights files.

    The source is opened once (``restorekit.formats.open``; an open Source is taken as
    it is) and its format read from its bytes; the target is ``to`` or else the output's
    extension (no known extension: a TF checkpoint prefix; with ``max_shard_size`` and no
    ``to``: a directory of safetensors shards). ``rules``, ``weights_only``, ``ema`` and
    ``config`` are as in :func:`export_checkpoint`; ``rules`` applies to TF-side names
    (after a restorekit file's record is undone) and ``config`` needs a Hugging Face rule
    set; ``model`` and ``flatten_channels`` are the hints of ``layout='torch'`` (as in
    :func:`export_checkpoint`). ``distributed=True`` writes safetensors shards across the ranks of a
    torch.distributed process group (the caller's, else one started from torchrun's or SLURM's variables;
    a group of one writes alone): call it on every rank alike; each rank writes the shards assigned to it,
    balanced by bytes, and rank 0 publishes them in one commit, byte-identical to one process's output
    (docs/cluster.md). ``max_shard_size`` is the largest shard of the output: safetensors shards, or
    with ``to='tf'`` TF data shards; ``num_shards`` writes a TF checkpoint output as that
    many data shards balanced by bytes. Which option applies to which format is one
    table, ``restorekit.export._request.OPTIONS``. A Keras 3 ``*.weights.h5`` is written from a
    Keras 3 file, a legacy Keras 2 ``*.h5`` / ``*.hdf5`` from a legacy one (its structure kept,
    ``weights_only`` dropping ``optimizer_weights``); any other source named so is refused.

        convert('train/model.ckpt-1000', 'model.pt', layout='torch')
        convert('model.safetensors', 'back/model.ckpt')
        convert('bert_model.ckpt', 'hf/model.safetensors', rules='bert-tf-to-hf', weights_only=True, config=True)
        convert('hf/', 'tf/model.ckpt', rules='bert-hf-to-tf')       # a directory of shards too

    Raises:
        OptionNotApplicableError: an option that applies to neither the source's nor the target's
            format (``num_shards`` for a safetensors output, a layout from npz to npz, ...).
        InvalidArgumentError: an unknown ``to``, layout or rule set, a name the rule set does not
            cover; ``num_shards`` that is not a positive int.
        OutputExistsError: the output is the source, or exists without overwrite.
        RankFailedError: with ``distributed``, a rank failed or was killed (it is named); nothing was published.
        MissingDependencyError: ``distributed=True`` without torch.
    """
    options = request(layout, rules, weights_only, ema, max_shard_size, config, num_shards, model, flatten_channels)
    out = os.fspath(out)
    if distributed:
        from restorekit._bundle.ranks import distribute

        to = _target(out, to, options)
        return distribute(out, lambda ranks: _convert(src, out, to, options, overwrite=overwrite, progress=progress,
                                                      max_output_bytes=max_output_bytes, ranks=ranks),
                          to=to, sharded=options.max_shard_size is not None)
    return _convert(src, out, to, options, overwrite=overwrite, progress=progress, max_output_bytes=max_output_bytes)


def _convert(src, out: str, to: str | None, options: Request, *, overwrite: bool, progress: bool,
             max_output_bytes: int | None, ranks=None) -> ExportResult:
    source, fmt = open_source(src)
    if fmt == KERAS and os.path.exists(out):  # being the source (a shard of a set) outranks a name that contradicts to
        check_output(out, "file", list(source.files), overwrite=True)
    to = _target(out, to, options)
    if to == KERAS:
        return _keras_weights(source, fmt, out, options, overwrite=overwrite)
    if to == keras.KERAS_LEGACY:
        return _keras_legacy(source, fmt, out, options, overwrite=overwrite)
    if to == formats.TF:
        # Like the editor: into an existing directory (or 'OUT/'), under the source's name.
        out = output_prefix(out, _base_name(source, fmt))
        check_parent(out)
        if fmt in (formats.TF, KERAS):
            options.check(formats.TF, fmt)
            return from_checkpoint.write_tf_checkpoint(_by_path(source, fmt, options), _files(source, fmt), out,
                                                       options, overwrite=overwrite, progress=progress)
        return _import(source, fmt, out, options, overwrite=overwrite, progress=progress,
                       max_output_bytes=max_output_bytes)
    if fmt in (formats.TF, KERAS):
        return _export(source, fmt, out, to, options, overwrite=overwrite, progress=progress, ranks=ranks)
    options.check(to, fmt)
    return from_files.write_file(sources.of_view(source), out, to, options, overwrite=overwrite, progress=progress,
                                 max_output_bytes=max_output_bytes, ranks=ranks)


def _keras_weights(source, fmt: str, out: str, options: Request, *, overwrite: bool) -> ExportResult:
    """Any source -> a Keras 3 ``.weights.h5``: only from a Keras 3 file, which has the layer groups it needs."""
    options.check(KERAS, fmt)
    if fmt != KERAS:
        raise InvalidArgumentError(
            f"{source.prefix!r} is a {'TF checkpoint' if fmt == formats.TF else fmt + ' file'}: a .weights.h5 holds "
            "variables by position under Keras layer groups, which only a Keras 3 .weights.h5 or .keras file has. "
            "Restore it into the model and call model.save_weights('model.weights.h5')"
        )
    return keras.copy_weights(source, out, weights_only=options.weights_only, overwrite=overwrite)


def _keras_legacy(source, fmt: str, out: str, options: Request, *, overwrite: bool) -> ExportResult:
    """Any source -> a legacy Keras 2 ``.h5``: only from a legacy Keras 2 ``.h5``, whose structure it keeps."""
    if fmt != KERAS:
        raise legacy_h5_refused(out, "TF checkpoint" if fmt == formats.TF else f"{fmt} file")
    options.check(keras.KERAS_LEGACY, fmt)
    return keras.copy_legacy(source, out, weights_only=options.weights_only, overwrite=overwrite)


def _base_name(source, fmt: str) -> str:
    """The name an output takes inside a directory: the source prefix's, or the file's without its extension."""
    name = os.path.basename(os.path.normpath(source.prefix))
    return name if fmt == formats.TF else (os.path.splitext(name)[0] or "model")
