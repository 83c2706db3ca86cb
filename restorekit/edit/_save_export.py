"""Saving an edited checkpoint in another format (torch, safetensors, npz, ...) through the export registry,
and the plan options every save takes (``weights_only``, ``ema``)."""

from __future__ import annotations

import functools
import os
import warnings

from restorekit._bundle.staging import Staging
from restorekit._bundle.format import dtype_name
from restorekit._checkpoint import OBJECT_GRAPH_KEY
from restorekit.edit._plan import Item
from restorekit.edit._renames import optimizer_state
from restorekit.edit._save_tf import check_space, final_plan
from restorekit.edit._source import Source
from restorekit.errors import OutputError, OutputExistsError, RestoreKitWarning, format_names
from restorekit.formats import _sinks as formats
from restorekit.layouts._planned import PlannedCheckpoint, WithObjectGraph
from restorekit._names import is_weight


def with_options(source: Source, plan: dict[str, Item], *, weights_only: bool, ema) -> dict[str, Item]:
    """``plan`` without optimizer state, ``global_step`` and ``save_counter`` (``weights_only``), and
    with each weight's EMA shadow as its value (``ema``; see ``restorekit.export._options.select``)."""
    ckpt = source.checkpoint
    if ema is not None and ema is not False:
        from restorekit.export._options import select

        by_origin = {it.origin: name for name, it in plan.items() if it.stored}
        graph = ckpt.object_graph if ckpt.is_object_based else None
        selection = select(list(by_origin), graph=graph, ema=ema)
        shadows = set(selection.dropped)
        edited = {}
        for name, it in plan.items():
            if it.stored and it.origin in shadows:
                continue
            shadow = selection.names.get(it.read_name, it.read_name) if it.stored else None
            if shadow is not None and shadow != it.origin:
                # The weight keeps its key (and its place in a TF2 object graph); its value is the shadow's.
                entry = ckpt.bundle_entry(shadow)
                it = Item(it.origin, entry.dtype, tuple(entry.shape), base=functools.partial(source.load, shadow))
            edited[name] = it
        plan = edited
        if selection.fallback:
            warnings.warn(f"ema: no moving-average shadow for {format_names(selection.fallback)}; their raw values are saved",
                          RestoreKitWarning, stacklevel=4)
    if weights_only:
        tracked = ckpt.object_graph.by_key if ckpt.is_object_based else {}
        state = set(optimizer_state(plan, ckpt))
        state |= {n for n, it in plan.items() if n != OBJECT_GRAPH_KEY and not is_weight(
            n, tracked=tracked[it.origin].kind if it.origin in tracked else None)}
        plan = {n: it for n, it in plan.items() if n not in state}
    return plan


def edited_checkpoint(source: Source, plan: dict[str, Item]) -> PlannedCheckpoint:
    """The edited checkpoint as a whole, Checkpoint-like: stored tensors read (or raw-copied) from the
    source under their new names, edited values computed on demand, the object graph as rewritten."""
    names, computed = {}, {}
    graph = None
    for name, it in plan.items():
        names[name] = it.origin if name != OBJECT_GRAPH_KEY else name
        if name == OBJECT_GRAPH_KEY:
            if not it.stored:
                graph = source.value(it).item()
        elif not it.stored:
            computed[name] = (dtype_name(it.dtype), tuple(it.shape), source.nbytes(it), lambda it=it: source.value(it))
    return PlannedCheckpoint(source.checkpoint, names, graph=graph, computed=computed)


def save_export(source: Source, plan: dict[str, Item], out: str, format: str, *, overwrite: bool,
                layout: str | None = None, progress: bool = False) -> str:
    """Write ``plan`` to the file ``out`` in ``format``; see ``CheckpointEditor.save``.

    Keeps what ``convert`` keeps: the TF2 object graph goes along (rewritten to the
    plan's renames and deletions), so importing the file back restores with
    ``tf.train.Checkpoint.read``.
    """
    module = formats.module(format)  # a layout it cannot take was refused by CheckpointEditor.save (request.OPTIONS)
    if os.path.exists(out) and not overwrite:
        raise OutputExistsError(path=out)
    plan = final_plan(source, plan)
    directory = os.path.dirname(out)
    check_space(directory, sum(source.nbytes(it) for it in plan.values()))
    graph_item = plan.get(OBJECT_GRAPH_KEY)
    with Staging(directory, output=out) as staging:
        tmp = staging.path(out)
        if layout == "torch":
            # Layout 'torch' maps whole layers (gates, splits, added tensors): the view of the edited checkpoint.
            from restorekit.layouts import torch_view

            module.write_checkpoint(torch_view(edited_checkpoint(source, plan)), tmp, layout=layout, progress=progress)
        elif all(it.stored for name, it in plan.items() if name != OBJECT_GRAPH_KEY):
            # Only renames, deletions and subsets: the format copies raw shard bytes itself.
            checkpoint = source.checkpoint
            if graph_item is not None and not graph_item.stored:
                checkpoint = WithObjectGraph(checkpoint, source.value(graph_item).item())
            names = {name: (it.origin if name != OBJECT_GRAPH_KEY else name) for name, it in plan.items()}
            module.write_checkpoint(checkpoint, tmp, names=names, layout=layout, progress=progress)
        else:
            tensors = ((name, source.value(it), dtype_name(it.dtype)) for name, it in plan.items())
            module.write(tmp, tensors, layout=layout, progress=progress)
        if not os.path.exists(tmp):
            raise OutputError(f"the {format} exporter wrote nothing at {tmp!r}")
        staging.commit()
    return out
