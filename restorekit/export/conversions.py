"""export_checkpoint, import_checkpoint and convert: TF checkpoints to and from every format in the registry.

Each conversion is planned from names and shapes first (``restorekit.export.options``:
``weights_only``, ``ema``, ``rules``), so a bad request fails before anything is
written, then streamed tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from restorekit.bundle import atomic
from restorekit.bundle.writer import balance, check_num_shards
from restorekit.keras_files import KerasCheckpoint, is_keras_path
from restorekit.errors import InvalidArgumentError, OutputExistsError
from restorekit.bundle import files as bundle_files
from restorekit.bundle.files import check_parent, check_space, output_prefix
from restorekit.export import formats, keras, sharded
from restorekit.export.targets import target_format
from restorekit.export.base import (
    ExportResult,
    PlannedCheckpoint,
    WithObjectGraph,
    checkpoint_files,
    refuse,
)
from restorekit.export.layout import check_layout
from restorekit.export.layouts import TorchView, torch_view
from restorekit.export.options import OBJECT_GRAPH_KEY, OutputPlan, out_shape, plan_output
from restorekit.export import rawimport, sources
from restorekit.export.tfwrite import write_tf
from restorekit.export.sources import (file_plan, file_sizes, open_source, shard_set, source_nbytes, tf_shapes,
                                       tf_sizes, tf_tensors)

__all__ = ["convert", "export_checkpoint", "import_checkpoint", "source_format", "target_format", "write_tf"]


def source_format(path) -> str:
    """Which format a path holds: 'tf' or a file format ('torch', 'safetensors', 'npz', ...).

    Decided by the file's first bytes where it is a file, else by its extension; a
    prefix, directory, ``.index`` or ``.data-*`` path is a TF checkpoint, except a
    directory of safetensors shards (or with one ``model.safetensors``) and a
    ``*.safetensors.index.json``, which are 'safetensors'.
    """
    path = os.fspath(path)
    if shard_set(path) is not None:
        return "safetensors"
    if os.path.isfile(path) and not path.endswith(".index") and ".data-" not in os.path.basename(path):
        return formats.sniff(path) or formats.TF
    if not os.path.exists(path):
        return formats.by_suffix(path) or formats.TF
    return formats.TF


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


def _check_sharded_output(out: str, sources: list[str], overwrite: bool) -> None:
    directory = os.path.realpath(sharded.output_files(out, 1)[0])
    if any(os.path.dirname(os.path.realpath(s)) == directory for s in sources) and sharded.previous_files(out):
        raise OutputExistsError(f"output {out!r} would overwrite its own source; choose another path",
                                path=out, is_source=True)
    sharded.check_output(out, overwrite=overwrite)


def _out_dir(out: str) -> str:
    return bundle_files.dirname(out) if bundle_files.is_remote(out) else os.path.dirname(os.path.abspath(out))


def _planned_nbytes(ckpt, plan: OutputPlan | None) -> int:
    """The bytes of the entries a conversion of ``ckpt`` writes: what the free-space check asks for."""
    entries = ckpt.entries
    return sum(entries[name].nbytes for name in (plan.names.values() if plan is not None else entries) if name in entries)


def _source_files(src: str, fmt: str) -> tuple[str, list[str]]:
    """(resolved source, the files it consists of)."""
    if fmt == formats.TF:
        from restorekit.checkpoint import resolve_prefix

        prefix = resolve_prefix(src)
        return prefix, checkpoint_files(prefix)
    reader = sources.reader(src, fmt)
    return src, list(reader.files)


@dataclasses.dataclass(frozen=True)
class _Options:
    """What a conversion does besides changing format; checked before anything is read."""

    layout: str | None = None
    rules: object = None
    weights_only: bool = False
    ema: object = None
    max_shard_size: object = None
    config: object = None
    num_shards: int | None = None  # TF outputs: data shards balanced by bytes

    @property
    def planned(self) -> bool:
        return self.rules is not None or self.weights_only or (self.ema is not None and self.ema is not False)

    def ruleset(self):
        from restorekit.export.hf import RuleSet, rule_set

        if isinstance(self.rules, (str, RuleSet)):
            return rule_set(self.rules)
        return None


def _options(layout, rules, weights_only, ema, max_shard_size, config, num_shards=None) -> _Options:
    check_layout(layout)
    if num_shards is not None:
        num_shards = check_num_shards(num_shards)
    options = _Options(layout, rules, bool(weights_only), ema, max_shard_size, config, num_shards)
    ruleset = options.ruleset()
    if ruleset is not None and layout is not None:
        if ruleset.target != "hf":
            raise InvalidArgumentError(f"rule set {ruleset.name!r} sets names and axes itself (TF's, not PyTorch's "
                                       f"as layout={layout!r} asks); leave layout=None")
        # The rule set writes Hugging Face (PyTorch) names and axes: exactly what layout='torch' asks for.
        options = dataclasses.replace(options, layout=None)
    if config and (ruleset is None or ruleset.model is None):
        raise InvalidArgumentError("config= writes a Hugging Face config.json: use it with rules='bert-tf-to-hf' "
                                   "or 'gpt2-tf-to-hf'")
    if config is not None and config is not True and config is not False and not isinstance(config, dict):
        raise InvalidArgumentError(f"config= is True or a dict of config.json values, got {config!r}")
    if max_shard_size is not None:
        sharded.parse_size(max_shard_size)
    return options


def _config(options: _Options, plan: OutputPlan, shapes: dict, directory: str, overwrite: bool):
    """{config.json path: its text} to publish with the weights, or None; checked before anything is written."""
    if not options.config:
        return None
    atomic.sweep_stale(directory)  # a dead conversion's config.json, renamed ahead of weights that never landed
    from restorekit.export.hf import config_text, hf_config

    out_shapes = {out: out_shape(plan, out, shapes[src]) for out, src in plan.names.items() if src in shapes}
    text = config_text(hf_config(options.ruleset(), out_shapes, options.config if isinstance(options.config, dict) else None))
    path = os.path.join(directory, "config.json")
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(path=path)
    return {path: text}


def _parts(options: _Options, sizes) -> tuple | None:
    """``write_tf``'s ``parts``: the names in ``options.num_shards`` runs balanced by bytes, or None for one shard."""
    return None if options.num_shards is None else balance(sizes, options.num_shards)


def _refuse_num_shards(options: _Options, to: str) -> None:
    if options.num_shards is not None:
        raise InvalidArgumentError(f"num_shards= applies to TF checkpoint outputs; {to} files take no shard count "
                                   "(max_shard_size= splits safetensors)")


def _single(write, path: str, config):
    """``write(path)``, or with a config.json: both staged and published in one commit (config first)."""
    if config is None:
        return write(path)
    return sharded.publish_file(path, write, texts=config)


def _finish(result: ExportResult, plan: OutputPlan | None) -> ExportResult:
    """The result, with what the plan left out."""
    if plan is None:
        return result
    return dataclasses.replace(result, dropped=plan.dropped, fallback=plan.fallback, renamed=plan.renamed)


# ------------------------------------------------------------------ TF checkpoint -> file
def _tf_plan(ckpt, options: _Options) -> OutputPlan | None:
    """The plan of an export of ``ckpt``, or None when it writes every entry as it is."""
    if not options.planned:
        return None
    graph = ckpt.object_graph if ckpt.is_object_based and (options.weights_only or options.ema) else None
    shapes = {name: tuple(entry.shape) for name, entry in ckpt.entries.items()}
    return plan_output(shapes, graph=graph, graph_bytes=lambda: ckpt.read(OBJECT_GRAPH_KEY).item(),
                       rules=options.rules, weights_only=options.weights_only, ema=options.ema)


def _tf_stream(ckpt, plan: OutputPlan):
    """(output name, array, TF dtype) for every tensor of the plan, read one at a time."""
    for out, source in plan.names.items():
        dtype = ckpt.entries[source].dtype
        if source == OBJECT_GRAPH_KEY and plan.graph is not None:
            yield out, np.array(plan.graph, dtype=object), dtype
        else:
            yield out, plan.apply(out, ckpt.read(source)), dtype


def _metadata(options: _Options, fmt: str) -> dict | None:
    ruleset = options.ruleset()
    # Hugging Face reads a safetensors file only when its metadata says 'pt'.
    return {"format": "pt"} if fmt == "safetensors" and ruleset is not None and ruleset.model else None


def _export_source(ckpt, plan: OutputPlan | None, layout: str | None):
    """(what the writer reads, its ``names=``) for an export without axis transforms.

    Layout 'torch' maps whole layers, so the writer gets ``torch_view`` of the planned
    checkpoint (renames, subsets and EMA values applied first); otherwise the checkpoint
    with the plan as ``names``. Both copy raw shard bytes for tensors that keep them.
    """
    if isinstance(ckpt, TorchView):  # the caller's view, with its layer hints
        return ckpt, None
    if layout == "torch":
        if plan is not None and not plan.identity:
            ckpt = PlannedCheckpoint(ckpt, plan.names, graph=plan.graph)
        return torch_view(ckpt, layout), None
    source = WithObjectGraph(ckpt, plan.graph) if plan is not None and plan.graph is not None else ckpt
    return source, None if plan is None or plan.identity else plan.names


def _export(ckpt, path: str, fmt: str, options: _Options, *, overwrite: bool, progress: bool) -> ExportResult:
    plan = _tf_plan(ckpt, options)
    module = formats.module(fmt)
    layout, metadata = options.layout, _metadata(options, fmt)
    if layout not in module.LAYOUTS:
        refuse(fmt, layout=layout)  # before a view is planned (it warns about what it cannot map)
    shard = options.max_shard_size
    directory = sharded.output_files(path, 1)[0] if shard is not None else os.path.dirname(os.path.abspath(path))
    shapes = {n: e.shape for n, e in ckpt.entries.items()}
    config = _config(options, plan, shapes, directory, overwrite) if plan is not None else None
    check_space(directory, _planned_nbytes(ckpt, plan))
    if plan is not None and plan.transforms:
        # Only a rule set transforms axes, and a rule set takes no layout (see _options).
        tensors = _tf_stream(ckpt, plan)
        if shard is not None:
            sizes = [(out, out_shape(plan, out, ckpt.entries[src].shape), ckpt.entries[src].nbytes)
                     for out, src in plan.names.items() if ckpt.entries[src].dtype != "string"]
            result = sharded.write(path, tensors, sizes=sizes, metadata=metadata, max_shard_size=shard,
                                   overwrite=overwrite, progress=progress, texts=config)
        else:
            result = _single(lambda p: module.write(p, tensors, metadata=metadata, progress=progress), path, config)
        return _finish(result, plan)
    source, names = _export_source(ckpt, plan, layout)
    if shard is not None:
        result = sharded.write_checkpoint(source, path, names=names, layout=layout, metadata=metadata,
                                          max_shard_size=shard, overwrite=overwrite, progress=progress, texts=config)
    else:
        result = _single(lambda p: module.write_checkpoint(source, p, names=names, layout=layout, metadata=metadata,
                                                           progress=progress), path, config)
    if layout == "torch" and shard is not None:
        # every shard's record starts from the view's: each lists all of the unmapped and kept names
        result = dataclasses.replace(result, unmapped=tuple(source.layout_record.unmapped),
                                     kept=tuple(dict.fromkeys(result.kept)))
    return _finish(result, plan)


def export_checkpoint(
    checkpoint,
    path,
    *,
    format: str | None = None,
    layout: str | None = None,
    rules=None,
    weights_only: bool = False,
    ema=None,
    max_shard_size=None,
    config=None,
    overwrite: bool = False,
    progress: bool = False,
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
            ``restorekit.export.layouts.torch_view`` of one to give layout 'torch' hints
            (``forget_bias``, ``layer_kinds``); a view means ``layout='torch'`` and takes
            no ``rules``, ``weights_only`` or ``ema`` (they choose the tensors the view maps).
        path: the output file; with ``max_shard_size``, a directory (or ``DIR/NAME.safetensors``).
        format: 'torch', 'safetensors' or 'npz'; by default from the extension.
        layout: None (TF names and axes) or 'torch': each layer as its ``torch.nn``
            counterpart loads it (names, axes, gate order, split and added tensors; see
            ``restorekit.export.layouts``). Object-based checkpoints are named from their
            readable paths, and their optimizer state keeps TF axes. What cannot be mapped
            is stored with TF names and axes, warned about and listed in ``ExportResult.unmapped``.
        rules: a rule set of ``restorekit.export.hf`` (``'bert-tf-to-hf'``, ``'gpt2-tf-to-hf'``,
            ...; names and axes) or a rename rule as ``CheckpointEditor.rename_all`` takes.
        weights_only: leave out optimizer state, ``global_step`` and ``save_counter``.
        ema: True (or a shadow suffix, or an ``ExponentialMovingAverage``): write each
            weight's moving average as the weight; weights without one keep their raw
            values and are listed in ``ExportResult.fallback`` (see ``restorekit.export.options``).
        max_shard_size: write Hugging Face-style safetensors shards of at most this size
            (``'5GB'``, ``'500MiB'``, bytes) with a ``model.safetensors.index.json``.
        config: with a Hugging Face rule set, True or a dict of values: write
            ``config.json`` beside the output, sizes read from the shapes (see ``hf.hf_config``).
        overwrite: replace an existing output file.
        progress: show a progress bar on stderr (when it is a terminal).

    Returns:
        An ExportResult.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: the source.
        OutputExistsError: the output exists, or is the source.
        NameCollisionError: the layout or the rules map two names onto one.
        InvalidArgumentError: a layout the format cannot honour (npz keeps TF names and axes),
            a name no rule of the rule set covers, ``ema`` without shadows.
        MissingDependencyError: torch is needed and not installed.
    """
    from restorekit.checkpoint import Checkpoint

    if isinstance(checkpoint, TorchView):
        if layout not in (None, "torch"):
            raise InvalidArgumentError(f"a torch_view is exported with layout 'torch', not layout={layout!r}")
        if rules is not None or weights_only or (ema is not None and ema is not False):
            raise InvalidArgumentError("rules=, weights_only= and ema= choose the tensors a torch_view maps: "
                                       "pass them with the checkpoint itself (export_checkpoint(ckpt, ..., "
                                       "layout='torch', ...)), not with a view of it")
        layout = "torch"
    options = _options(layout, rules, weights_only, ema, max_shard_size, config)
    ckpt = checkpoint if isinstance(checkpoint, (Checkpoint, TorchView)) else Checkpoint(checkpoint)
    sources_of = checkpoint_files(ckpt.prefix)
    if isinstance(ckpt, KerasCheckpoint):  # named by readable path; read through h5py
        sources_of = list(ckpt.files)  # a sharded set: the index and every shard
        ckpt = sources.keras_source(ckpt, weights_only=weights_only)
    path = os.fspath(path)
    fmt = _target(path, format, options, option="format")
    if fmt == formats.TF:
        raise InvalidArgumentError("export_checkpoint writes torch, safetensors or npz; use CheckpointEditor.save for tf")
    with _locked(path, options):
        if options.max_shard_size is not None:
            _check_sharded_output(path, sources_of, overwrite)
        else:
            _check_output(path, fmt, sources_of, overwrite)
        return _export(ckpt, path, fmt, options, overwrite=overwrite, progress=progress)


def _target(path: str, to: str | None, options: _Options, *, option: str = "to") -> str:
    """The output format; ``max_shard_size`` means safetensors shards."""
    if options.max_shard_size is None:
        return target_format(path, to, option=option)
    if to not in (None, "safetensors"):
        raise InvalidArgumentError(f"max_shard_size= writes safetensors shards, not {to}")
    return "safetensors"


# ------------------------------------------------------------------ file -> TF checkpoint or file
def import_checkpoint(
    src,
    out_prefix,
    *,
    layout: str | None = None,
    rules=None,
    weights_only: bool = False,
    ema=None,
    overwrite: bool = False,
    progress: bool = False,
    max_output_bytes: int | None = None,
    num_shards: int | None = None,
) -> ExportResult:
    """Write a ``.safetensors`` (or a directory of shards, or their ``*.index.json``), PyTorch (``.pt``)
    or ``.npz`` file as a TF checkpoint.

    What a restorekit export recorded in the file is undone exactly (names, axes,
    dtypes, string tensors). For files from elsewhere, ``layout='torch'`` maps PyTorch
    names and axes to TF ones by rule (``restorekit.export.layout.guess_tf_names``),
    and ``rules`` applies a rule set (``'bert-hf-to-tf'``, ``'gpt2-hf-to-tf'``) or a
    rename rule; ``layout=None`` keeps their names. ``weights_only`` and ``ema`` are
    as in ``export_checkpoint``. ``.pt`` files are read with
    ``torch.load(weights_only=True)`` only: a pickle that wants to run code is refused.
    With ``overwrite``, exactly the old checkpoint's files are replaced (its ``.index``
    and ``.data-NNNNN-of-MMMMM`` shards, matched by name literally). ``max_output_bytes``
    bounds what a ``.pt`` or ``.npz`` may expand to (stride-0 views, deflated members);
    the default is the larger of 1 GiB and 64 times the file. ``num_shards`` writes
    that many data shards, balanced by bytes in write order (as ``CheckpointEditor.save``).

        import_checkpoint('model.safetensors', 'converted/model.ckpt')
        import_checkpoint('hf-model/', 'tf/model.ckpt', rules='bert-hf-to-tf')

    Raises:
        CheckpointNotFoundError: no file at ``src``.
        CorruptCheckpointError: the file is malformed, or an unsafe pickle; a shard
            missing from a set (nothing is written).
        OutputExistsError: the output exists (without overwrite) or is the source.
        OutputError: the tensors would expand past ``max_output_bytes``.
        InvalidArgumentError: ``num_shards`` is not a positive int (nothing is written).
        MissingDependencyError: a .pt file without torch installed.
    """
    options = _options(layout, rules, weights_only, ema, None, None, num_shards)
    src, out_prefix = os.fspath(src), os.fspath(out_prefix)
    fmt = source_format(src)
    if fmt == formats.TF:
        from restorekit.checkpoint import resolve_prefix

        resolve_prefix(src)  # CheckpointNotFoundError when there is nothing at all
        raise InvalidArgumentError(f"{src!r} is a TF checkpoint; import_checkpoint reads torch, safetensors or npz files")
    reader = sources.reader(src, fmt)
    with _locked(out_prefix, options):
        return _import(reader, out_prefix, options, layout=layout, overwrite=overwrite, progress=progress,
                       max_output_bytes=max_output_bytes)


def _import(reader, out_prefix: str, options: _Options, *, layout, overwrite: bool, progress: bool,
            max_output_bytes) -> ExportResult:
    _check_output(out_prefix, formats.TF, list(reader.files), overwrite)
    arrays, record = open_source(reader, layout, max_output_bytes)
    plan = file_plan(reader, record, options)
    check_space(_out_dir(out_prefix), source_nbytes(reader))
    if plan is None:
        # tensors whose stored bytes are their TF bytes are copied as they lie (rawimport)
        arrays = rawimport.source_arrays(reader, record, max_output_bytes) or arrays
    permuted = tuple(record.tf_name(n) for n, note in record.tensors.items() if "perm" in note)
    parts = _parts(options, tf_sizes(reader, record, plan)) if options.num_shards else None
    result = write_tf(out_prefix, tf_tensors(arrays, record, plan), layout=record.layout, permuted=permuted,
                      progress=progress, parts=parts)
    return _finish(dataclasses.replace(result, unmapped=tuple(record.unmapped)), plan)


def convert(src, out, *, to: str | None = None, layout: str | None = None, rules=None, weights_only: bool = False,
            ema=None, max_shard_size=None, config=None, overwrite: bool = False,
            progress: bool = False, max_output_bytes: int | None = None, num_shards: int | None = None) -> ExportResult:
    """Convert between TF checkpoints, PyTorch files, safetensors (one file or shards) and npz.

    The source format is read from the file; the target from ``to`` or else the
    output's extension (no known extension: a TF checkpoint prefix; with
    ``max_shard_size``: a directory of safetensors shards). ``rules``,
    ``weights_only``, ``ema``, ``max_shard_size`` and ``config`` are as in
    :func:`export_checkpoint`; ``rules`` applies to TF-side names (after a restorekit
    file's record is undone) and ``config`` needs a Hugging Face rule set. ``num_shards``
    writes a TF checkpoint output as that many data shards balanced by bytes (refused
    for other outputs).

        convert('train/model.ckpt-1000', 'model.pt', layout='torch')
        convert('model.safetensors', 'back/model.ckpt')
        convert('bert_model.ckpt', 'hf/model.safetensors', rules='bert-tf-to-hf', weights_only=True, config=True)
        convert('hf/', 'tf/model.ckpt', rules='bert-hf-to-tf')       # a directory of shards too

    Raises:
        InvalidArgumentError: an unknown ``to``, layout or rule set, a layout the target
            cannot honour, a name the rule set does not cover; ``num_shards`` that is not a
            positive int, or given for an output that is not a TF checkpoint.
        OutputExistsError: the output is the source, or exists without overwrite.
    """
    options = _options(layout, rules, weights_only, ema, max_shard_size, config, num_shards)
    src, out = os.fspath(src), os.fspath(out)
    if keras.is_keras_target(out, to) or is_keras_path(src):
        return _convert_keras(src, out, to, options, overwrite=overwrite, progress=progress)
    to = _target(out, to, options)
    if to != formats.TF:
        _refuse_num_shards(options, to)
    fmt = source_format(src)
    if to == formats.TF:
        # Like the editor: into an existing directory (or 'OUT/'), under the source's name.
        out = output_prefix(out, _base_name(src, fmt))
        check_parent(out)
    if fmt == formats.TF:
        if to == formats.TF:
            if layout is not None:
                raise InvalidArgumentError(
                    f"layout={layout!r} applies when writing or reading PyTorch, safetensors or npz files, "
                    "not in a TF-to-TF copy"
                )
            return _copy_tf(src, out, options, overwrite=overwrite, progress=progress)
        return export_checkpoint(src, out, format=to, layout=layout, rules=rules, weights_only=weights_only, ema=ema,
                                 max_shard_size=max_shard_size, config=config, overwrite=overwrite, progress=progress)
    if to == formats.TF:
        if options.config:
            raise InvalidArgumentError("config= writes config.json beside a Hugging Face output, not a TF checkpoint")
        return import_checkpoint(src, out, layout=layout, rules=rules, weights_only=weights_only, ema=ema,
                                 overwrite=overwrite, progress=progress, max_output_bytes=max_output_bytes,
                                 num_shards=num_shards)
    return _convert_files(src, out, fmt, to, options, overwrite=overwrite, progress=progress,
                          max_output_bytes=max_output_bytes)


def _convert_files(src: str, out: str, fmt: str, to: str, options: _Options, *, overwrite: bool,
                   progress: bool, max_output_bytes: int | None = None) -> ExportResult:
    """File -> file: back to TF names first, then out in the target's conventions."""
    with _locked(out, options):
        return _convert_files_locked(src, out, fmt, to, options, overwrite=overwrite, progress=progress,
                                     max_output_bytes=max_output_bytes)


def _convert_files_locked(src: str, out: str, fmt: str, to: str, options: _Options, *, overwrite: bool,
                          progress: bool, max_output_bytes: int | None = None) -> ExportResult:
    target = formats.module(to)
    reader = sources.reader(src, fmt)
    shard = options.max_shard_size
    if shard is not None:
        _check_sharded_output(out, list(reader.files), overwrite)
    else:
        _check_output(out, to, list(reader.files), overwrite)
    # A layout names the conventions of the side that has them: a .pt in PyTorch layout
    # converted to npz (which keeps TF names and axes) is read with it and written without.
    layout = options.layout
    read_layout = layout if layout in reader.module.LAYOUTS else None
    write_layout = layout if layout in target.LAYOUTS else None
    if layout is not None and read_layout is None and write_layout is None:
        raise InvalidArgumentError(f"layout={layout!r} applies to neither {fmt} nor {to} files")
    arrays, record = open_source(reader, read_layout, max_output_bytes)
    plan = file_plan(reader, record, options)
    directory = sharded.output_files(out, 1)[0] if shard is not None else os.path.dirname(os.path.abspath(out))
    config = _config(options, plan, tf_shapes(reader.read_shapes(), record), directory, overwrite) if plan else None
    check_space(directory, source_nbytes(reader))
    metadata = _metadata(options, to)
    if write_layout == "torch":
        # The file as the TF checkpoint it holds, mapped layer by layer as an export from TF maps it.
        source = sources.FileCheckpoint(reader, record)
        if plan is not None and not plan.identity:
            source = PlannedCheckpoint(source, plan.names, graph=plan.graph)
        view = torch_view(source)
        if shard is not None:
            result = sharded.write_checkpoint(view, out, layout=write_layout, metadata=metadata, max_shard_size=shard,
                                              overwrite=overwrite, progress=progress, texts=config)
            result = dataclasses.replace(result, kept=tuple(dict.fromkeys(result.kept)))
        else:
            result = _single(lambda p: target.write_checkpoint(view, p, layout=write_layout, metadata=metadata,
                                                               progress=progress), out, config)
        return _finish(dataclasses.replace(result, unmapped=tuple(view.layout_record.unmapped)), plan)
    tensors = tf_tensors(arrays, record, plan)
    if shard is not None:
        result = sharded.write(out, tensors, sizes=file_sizes(reader, record, plan), metadata=metadata,
                               max_shard_size=shard, overwrite=overwrite, progress=progress, texts=config)
    else:
        result = _single(lambda p: target.write(p, tensors, metadata=metadata, progress=progress), out, config)
    return _finish(result, plan)


def _convert_keras(src: str, out: str, to: str | None, options: _Options, *, overwrite: bool,
                   progress: bool) -> ExportResult:
    """From a Keras file to any format (readable paths as names), or to a ``.weights.h5`` from a Keras 3 file."""
    from restorekit.checkpoint import Checkpoint

    if keras.is_keras_target(out, to):
        _refuse_num_shards(options, "a .weights.h5")
        if options.layout or options.rules is not None or options.ema or options.max_shard_size or options.config:
            raise InvalidArgumentError("a .weights.h5 keeps Keras' own names and layout; of the options it takes "
                                       "weights_only= and overwrite= only")
        if not is_keras_path(src):
            from restorekit.checkpoint import resolve_prefix

            if os.path.isfile(src) and source_format(src) != formats.TF:
                raise InvalidArgumentError(
                    f"{src!r} is a {source_format(src)} file: a .weights.h5 holds variables by position under Keras "
                    f"layer groups, which only a Keras 3 .weights.h5 or .keras file has. Restore it into the model "
                    f"and call model.save_weights('model.weights.h5')"
                )
            resolve_prefix(src)  # CheckpointNotFoundError when there is nothing at all
        return keras.copy_weights(Checkpoint(src), out, weights_only=options.weights_only, overwrite=overwrite)
    if os.path.exists(out):  # being the source (a shard of a set) outranks a name that contradicts ``to``
        _check_output(out, "file", list(Checkpoint(src).files), overwrite=True)
    to = _target(out, to, options)
    if to != formats.TF:
        _refuse_num_shards(options, to)
        return export_checkpoint(src, out, format=to, layout=options.layout, rules=options.rules,
                                 weights_only=options.weights_only, ema=options.ema,
                                 max_shard_size=options.max_shard_size, config=options.config, overwrite=overwrite,
                                 progress=progress)
    if options.layout is not None or options.max_shard_size is not None or options.config:
        raise InvalidArgumentError("layout=, max_shard_size= and config= apply to torch and safetensors outputs, "
                                   "not a TF checkpoint")
    keras_ckpt = Checkpoint(src)
    source = sources.keras_source(keras_ckpt, weights_only=options.weights_only)
    with _locked(out, options):
        _check_output(out, formats.TF, list(keras_ckpt.files), overwrite)
        plan = _tf_plan(source, options)
        check_space(_out_dir(out), _planned_nbytes(source, plan))
        parts = _parts(options, _entry_sizes(source, plan))
        if plan is None:
            tensors = ((name, source.read(name), entry.dtype) for name, entry in source.entries.items())
            return write_tf(out, tensors, progress=progress, parts=parts)
        return _finish(write_tf(out, _tf_stream(source, plan), progress=progress, parts=parts), plan)


def _base_name(src: str, fmt: str) -> str:
    """The name an output takes inside a directory: the source prefix's, or the file's without its extension."""
    if fmt == formats.TF:
        from restorekit.checkpoint import resolve_prefix

        return os.path.basename(resolve_prefix(src))
    name = os.path.basename(os.path.normpath(src))
    return os.path.splitext(name)[0] or "model"


def _copy_tf(src: str, out: str, options: _Options, *, overwrite: bool, progress: bool) -> ExportResult:
    from restorekit.checkpoint import Checkpoint

    if options.max_shard_size is not None or options.config:
        raise InvalidArgumentError("max_shard_size= and config= apply to safetensors outputs, not a TF checkpoint")
    ckpt = Checkpoint(src)
    with _locked(out, options):
        _check_output(out, formats.TF, checkpoint_files(ckpt.prefix), overwrite)
        plan = _tf_plan(ckpt, options)
        check_space(_out_dir(out), _planned_nbytes(ckpt, plan))
        parts = _parts(options, _entry_sizes(ckpt, plan))
        if plan is None:
            entries = ckpt.entries
            tensors = ((name, ckpt.read(name), entries[name].dtype) for name in entries)
            return write_tf(out, tensors, progress=progress, parts=parts)
        return _finish(write_tf(out, _tf_stream(ckpt, plan), progress=progress, parts=parts), plan)


def _locked(out: str, options: _Options):
    """The output's lock (``atomic.output_lock``), held from the exists-check to the last rename: the name the
    commit itself locks (a sharded output's single-file name), so no other writer lands in between."""
    if options.max_shard_size is not None:
        out = sharded.output_files(out, 1)[1][0]
    return atomic.output_lock(out)


def _entry_sizes(ckpt, plan: OutputPlan | None) -> list:
    """(output name, bytes) of a checkpoint-like source's entries, in the order they are written."""
    entries = ckpt.entries
    if plan is None:
        return [(name, entry.nbytes) for name, entry in entries.items()]
    return [(out, entries[src].nbytes) for out, src in plan.names.items() if src in entries]

