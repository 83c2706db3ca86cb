"""Saving an edited checkpoint in another format (torch, safetensors, npz) through the export modules."""

from __future__ import annotations

import importlib
import os

from restorekit.bundle import atomic
from restorekit.checkpoint import OBJECT_GRAPH_KEY
from restorekit.edit.plan import Item
from restorekit.edit.save_tf import check_space
from restorekit.edit.source import Source
from restorekit.errors import MissingDependencyError, OutputError, OutputExistsError

EXPORTERS = {
    "torch": "restorekit.export.torch",
    "safetensors": "restorekit.export.safetensors",
    "npz": "restorekit.export.npz",
}


def save_export(source: Source, plan: dict[str, Item], out: str, format: str, *, overwrite: bool) -> str:
    try:
        module = importlib.import_module(EXPORTERS[format])
    except ImportError as e:
        raise MissingDependencyError(f"format={format!r} needs {EXPORTERS[format]!r}: {e}") from None
    if os.path.exists(out) and not overwrite:
        raise OutputExistsError(path=out)
    directory = os.path.dirname(out)
    check_space(directory, sum(source.nbytes(it) for it in plan.values()))
    tensors = ((name, source.value(it)) for name, it in plan.items() if name != OBJECT_GRAPH_KEY)
    # Only renames, deletions and subsets: the exporter copies raw shard bytes itself.
    raw = OBJECT_GRAPH_KEY not in plan and all(it.stored for it in plan.values())
    with atomic.Staging(directory) as staging:
        tmp = staging.path(out)
        if raw and hasattr(module, "write_checkpoint"):
            module.write_checkpoint(source.checkpoint, tmp, names={name: it.origin for name, it in plan.items()})
        elif format == "npz":
            module.write(tmp, tensors)
        else:
            module.write(tmp, tensors, layout=None)
        if not os.path.exists(tmp):
            raise OutputError(f"the {format} exporter wrote nothing at {tmp!r}")
        staging.commit()
    return out
