"""Writing an open safetensors, PyTorch or npz source (its ``sources.Reader``) as a TF checkpoint or another file.

Both take the reader of the source already opened (``FileView.reader``) and a ``Request``
already checked against the formats: plan (``sources.file_plan``), then write.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from restorekit._bundle.files import check_space
from restorekit.export import _sources as sources
from restorekit.formats import _sinks as formats
from restorekit.formats.safetensors import _shards as sharded
from restorekit.formats.tf import _rawimport as rawimport
from restorekit.formats._sink import ExportResult
from restorekit.layouts._planned import PlannedCheckpoint
from restorekit.layouts import torch_view
from restorekit.export._outputs import config_files, finish, locked_output, metadata, out_dir, single
from restorekit.export._request import Request
from restorekit.export._sources import (file_plan, file_sizes, mapped_arrays, open_source, source_nbytes, tf_shapes,
                                       tf_sizes, tf_tensors)
from restorekit.formats.tf._writer import data_parts, write_tf

__all__ = ["write_file", "write_tf_checkpoint"]


def write_tf_checkpoint(reader, out: str, options: Request, *, overwrite: bool, progress: bool,
                        max_output_bytes, extra=None) -> ExportResult:
    """The file behind ``reader`` as the TF checkpoint ``out`` (its layout record undone, or names guessed).

    ``extra(reader, record)`` (optimizer state written beside the weights: ``restorekit._optim._tf1_target``)
    returns ``(tensors, fields)``: more ``(TF name, array, TF dtype or None)`` to write after the weights, in the
    same commit, and fields of the result to set. It runs before anything is written, so what it refuses leaves
    no output.
    """
    with locked_output(out, formats.TF, reader.files, options, overwrite=overwrite):
        arrays, record = open_source(reader, options.layout, max_output_bytes, options.flatten_channels)
        plan = file_plan(reader, record, options)
        more, fields = extra(reader, record) if extra is not None else ((), {})
        check_space(out_dir(out), source_nbytes(reader))
        if plan is None:
            # tensors whose stored bytes are their TF bytes are copied as they lie (rawimport)
            arrays = rawimport.source_arrays(reader, record, max_output_bytes) or arrays
        permuted = record.permuted()
        parts = None
        if options.num_shards is not None or options.max_shard_size is not None:
            parts = data_parts(tf_sizes(reader, record, plan), num_shards=options.num_shards,
                               max_shard_size=options.max_shard_size)
        result = write_tf(out, itertools.chain(tf_tensors(arrays, record, plan), more), layout=record.layout,
                          permuted=permuted, progress=progress, parts=parts)
        return finish(dataclasses.replace(result, unmapped=tuple(record.unmapped), **fields), plan)


def write_file(reader, out: str, to: str, options: Request, *, overwrite: bool, progress: bool,
               max_output_bytes: int | None = None, ranks=None) -> ExportResult:
    """File -> file: back to TF names first, then out in the target's conventions (with ``ranks``: safetensors
    shards, each rank its share, its source tensors memory-mapped so that it reads only those)."""
    with locked_output(out, to, reader.files, options, overwrite=overwrite, ranks=ranks):
        return _write_file(reader, out, to, options, overwrite=overwrite, progress=progress,
                           max_output_bytes=max_output_bytes, ranks=ranks)


def _write_file(reader, out: str, to: str, options: Request, *, overwrite: bool, progress: bool,
                max_output_bytes: int | None, ranks=None) -> ExportResult:
    target = formats.module(to)
    shard = options.max_shard_size
    # A layout names the conventions of the side that has them: a .pt in PyTorch layout
    # converted to npz (which keeps TF names and axes) is read with it and written without
    # (request.OPTIONS has refused a layout neither side has).
    layout = options.layout
    read_layout = layout if layout in reader.layouts else None
    write_layout = layout if layout in target.LAYOUTS else None
    arrays, record = open_source(reader, read_layout, max_output_bytes, options.flatten_channels)
    plan = file_plan(reader, record, options)
    directory = sharded.output_files(out, 1)[0] if shard is not None else os.path.dirname(os.path.abspath(out))
    config = config_files(options, plan, tf_shapes(reader.read_shapes(), record), directory, overwrite) if plan else None
    check_space(directory, source_nbytes(reader))
    meta = metadata(options, to)
    if write_layout == "torch":
        # The file as the TF checkpoint it holds, mapped layer by layer as an export from TF maps it.
        source: sources.FileCheckpoint | PlannedCheckpoint = sources.FileCheckpoint(reader.source, record)
        if plan is not None and not plan.identity:
            source = PlannedCheckpoint(source, plan.names, graph=plan.graph)
        view = torch_view(source)
        if shard is not None:
            result = sharded.write_checkpoint(view, out, layout=write_layout, metadata=meta, max_shard_size=shard,
                                              overwrite=overwrite, progress=progress, texts=config, ranks=ranks)
            result = dataclasses.replace(result, kept=tuple(dict.fromkeys(result.kept)))
        else:
            result = single(lambda p: target.write_checkpoint(view, p, layout=write_layout, metadata=meta,
                                                              progress=progress), out, config)
        return finish(dataclasses.replace(result, unmapped=tuple(view.layout_record.unmapped)), plan)
    if shard is not None:
        sizes = file_sizes(reader, record, plan)
        only = sharded.rank_names(sizes, shard, ranks)
        if only is not None:
            arrays = mapped_arrays(reader)  # each rank touches the bytes of its own tensors only
        result = sharded.write(out, tf_tensors(arrays, record, plan, only), sizes=sizes, metadata=meta,
                               max_shard_size=shard, overwrite=overwrite, progress=progress, texts=config, ranks=ranks)
    else:
        tensors = tf_tensors(arrays, record, plan)
        result = single(lambda p: target.write(p, tensors, metadata=meta, progress=progress), out, config)
    return finish(result, plan)
