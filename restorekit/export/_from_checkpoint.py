"""Writing a checkpoint-like source (a TF checkpoint, a Keras file under readable paths) as a file or a TF checkpoint.

Both take a source that is already open and a ``Request`` already checked against the
formats: plan (``tf_plan``), then write (``write_file``, ``write_tf_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from restorekit._bundle.files import check_space
from restorekit.formats import _sinks as formats
from restorekit.formats.safetensors import _shards as sharded
from restorekit.formats._sink import ExportResult
from restorekit.layouts._planned import PlannedCheckpoint, WithObjectGraph
from restorekit.layouts import TorchView, torch_view
from restorekit.export._options import OBJECT_GRAPH_KEY, OutputPlan, out_shape, plan_output
from restorekit.export._outputs import (config_files, entry_sizes, finish, locked_output, metadata, out_dir,
                                       planned_nbytes, single)
from restorekit.export._request import Request
from restorekit.formats.tf._writer import data_parts, write_tf

__all__ = ["tf_plan", "write_file", "write_tf_checkpoint"]

# What a stream gives for a tensor another rank writes: never read, never written.
PLACEHOLDER = np.empty(0, dtype=np.uint8)


def tf_plan(ckpt, options: Request) -> OutputPlan | None:
    """The plan of a conversion of ``ckpt``, or None when it writes every entry as it is."""
    if not options.planned:
        return None
    graph = ckpt.object_graph if ckpt.is_object_based and (options.weights_only or options.ema) else None
    shapes = {name: tuple(entry.shape) for name, entry in ckpt.entries.items()}
    return plan_output(shapes, graph=graph, graph_bytes=lambda: ckpt.read(OBJECT_GRAPH_KEY).item(),
                       rules=options.rules, weights_only=options.weights_only, ema=options.ema)


def _tf_stream(ckpt, plan: OutputPlan, only: set | None = None):
    """(output name, array, TF dtype) for every tensor of the plan, read one at a time; a numeric tensor not
    in ``only`` (another rank's) as an unread placeholder."""
    for out, source in plan.names.items():
        dtype = ckpt.entries[source].dtype
        if only is not None and dtype != "string" and out not in only:
            yield out, PLACEHOLDER, dtype
        elif source == OBJECT_GRAPH_KEY and plan.graph is not None:
            yield out, np.array(plan.graph, dtype=object), dtype
        else:
            yield out, plan.apply(out, ckpt.read(source)), dtype


def write_tf_checkpoint(ckpt, files, out: str, options: Request, *, overwrite: bool, progress: bool) -> ExportResult:
    """Write ``ckpt`` (its files ``files``) as the TF checkpoint ``out``: every entry, or the plan's; in one data
    shard, ``num_shards`` balanced by bytes, or shards of at most ``max_shard_size``."""
    with locked_output(out, formats.TF, files, options, overwrite=overwrite):
        plan = tf_plan(ckpt, options)
        check_space(out_dir(out), planned_nbytes(ckpt, plan))
        parts = data_parts(entry_sizes(ckpt, plan), num_shards=options.num_shards,
                           max_shard_size=options.max_shard_size)
        if plan is None:
            entries = ckpt.entries
            tensors = ((name, ckpt.read(name), entries[name].dtype) for name in entries)
            return write_tf(out, tensors, progress=progress, parts=parts)
        return finish(write_tf(out, _tf_stream(ckpt, plan), progress=progress, parts=parts), plan)


def _export_source(ckpt, plan: OutputPlan | None, options: Request):
    """(what the writer reads, its ``names=``) for an export without axis transforms.

    Layout 'torch' maps whole layers, so the writer gets ``torch_view`` of the planned
    checkpoint (renames, subsets and EMA values applied first); otherwise the checkpoint
    with the plan as ``names``. Both copy raw shard bytes for tensors that keep them.
    """
    layout = options.layout
    if isinstance(ckpt, TorchView):  # the caller's view, with its layer hints
        return ckpt, None
    if layout == "torch":
        if plan is not None and not plan.identity:
            ckpt = PlannedCheckpoint(ckpt, plan.names, graph=plan.graph)
        return torch_view(ckpt, layout, model=options.model, flatten_channels=options.flatten_channels), None
    source = WithObjectGraph(ckpt, plan.graph) if plan is not None and plan.graph is not None else ckpt
    return source, None if plan is None or plan.identity else plan.names


def write_file(ckpt, files, path: str, fmt: str, options: Request, *, overwrite: bool, progress: bool,
               ranks=None) -> ExportResult:
    """Write ``ckpt`` (its files ``files``) as a ``fmt`` file (with ``max_shard_size``: safetensors shards;
    with ``ranks`` as well, each rank its share of them)."""
    with locked_output(path, fmt, files, options, overwrite=overwrite, ranks=ranks):
        return _write_file(ckpt, path, fmt, options, overwrite=overwrite, progress=progress, ranks=ranks)


def _write_file(ckpt, path: str, fmt: str, options: Request, *, overwrite: bool, progress: bool,
                ranks=None) -> ExportResult:
    plan = tf_plan(ckpt, options)
    module = formats.module(fmt)
    layout, meta = options.layout, metadata(options, fmt)  # a layout ``fmt`` cannot take: refused by request.OPTIONS
    shard = options.max_shard_size
    directory = sharded.output_files(path, 1)[0] if shard is not None else os.path.dirname(os.path.abspath(path))
    shapes = {n: e.shape for n, e in ckpt.entries.items()}
    config = config_files(options, plan, shapes, directory, overwrite) if plan is not None else None
    check_space(directory, planned_nbytes(ckpt, plan))
    if plan is not None and plan.transforms:
        # Only a rule set transforms axes, and a rule set takes no layout (see request.request).
        if shard is not None:
            sizes = [(out, out_shape(plan, out, ckpt.entries[src].shape), ckpt.entries[src].nbytes)
                     for out, src in plan.names.items() if ckpt.entries[src].dtype != "string"]
            tensors = _tf_stream(ckpt, plan, sharded.rank_names(sizes, shard, ranks))
            result = sharded.write(path, tensors, sizes=sizes, metadata=meta, max_shard_size=shard,
                                   overwrite=overwrite, progress=progress, texts=config, ranks=ranks)
        else:
            tensors = _tf_stream(ckpt, plan)
            result = single(lambda p: module.write(p, tensors, metadata=meta, progress=progress), path, config)
        return finish(result, plan)
    source, names = _export_source(ckpt, plan, options)
    if shard is not None:
        result = sharded.write_checkpoint(source, path, names=names, layout=layout, metadata=meta,
                                          max_shard_size=shard, overwrite=overwrite, progress=progress, texts=config,
                                          ranks=ranks)
    else:
        result = single(lambda p: module.write_checkpoint(source, p, names=names, layout=layout, metadata=meta,
                                                          progress=progress), path, config)
    if isinstance(source, TorchView):  # what the file holds beyond the checkpoint's tensors, named
        result = dataclasses.replace(result, added=source.added)
    if layout == "torch" and shard is not None:
        # every shard's record starts from the view's: each lists all of the unmapped and kept names
        result = dataclasses.replace(result, unmapped=tuple(source.layout_record.unmapped),
                                     kept=tuple(dict.fromkeys(result.kept)))
    return finish(result, plan)
