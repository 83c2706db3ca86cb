"""Saving an edited checkpoint in another format (torch, safetensors, npz, ...) through the export registry."""

from __future__ import annotations

import os

from restorekit.bundle import atomic
from restorekit.checkpoint import OBJECT_GRAPH_KEY
from restorekit.edit.plan import Item
from restorekit.edit.save_tf import check_space
from restorekit.edit.source import Source
from restorekit.errors import OutputError, OutputExistsError
from restorekit.export import formats


def save_export(source: Source, plan: dict[str, Item], out: str, format: str, *, overwrite: bool) -> str:
    """Write ``plan`` to the file ``out`` in ``format``; see ``CheckpointEditor.save``."""
    module = formats.module(format)
    if os.path.exists(out) and not overwrite:
        raise OutputExistsError(path=out)
    directory = os.path.dirname(out)
    check_space(directory, sum(source.nbytes(it) for it in plan.values()))
    with atomic.Staging(directory) as staging:
        tmp = staging.path(out)
        if OBJECT_GRAPH_KEY not in plan and all(it.stored for it in plan.values()):
            # Only renames, deletions and subsets: the format copies raw shard bytes itself.
            module.write_checkpoint(source.checkpoint, tmp, names={name: it.origin for name, it in plan.items()})
        else:
            tensors = ((name, source.value(it)) for name, it in plan.items() if name != OBJECT_GRAPH_KEY)
            module.write(tmp, tensors)
        if not os.path.exists(tmp):
            raise OutputError(f"the {format} exporter wrote nothing at {tmp!r}")
        staging.commit()
    return out
