"""A conversion's output: the checks before anything is written (exists, is the source, free space), its lock,
the config.json that may go beside it, and what the result reports of the plan."""

from __future__ import annotations

import contextlib
import dataclasses
import os

from restorekit._bundle.locking import output_lock
from restorekit._bundle.sweep import sweep_stale
from restorekit._bundle import files as bundle_files
from restorekit.errors import OutputExistsError
from restorekit.formats import _sinks as formats
from restorekit.formats.safetensors import _shards as sharded
from restorekit.formats._sink import ExportResult, checkpoint_files
from restorekit.export._options import OutputPlan, out_shape
from restorekit.export._request import Request

__all__ = ["check_output", "config_files", "entry_sizes", "finish", "locked_output", "out_dir", "planned_nbytes",
           "single"]


def check_output(out: str, fmt: str, sources: list[str], overwrite: bool) -> None:
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


@contextlib.contextmanager
def locked_output(out: str, to: str, sources, options: Request, *, overwrite: bool, ranks=None):
    """Hold the output's lock (``locking.output_lock``) from the exists-check to the last rename, and check it there.

    Of several ranks writing one output (``ranks``), rank 0 holds the lock and checks; the others write
    into its staging directory under it.

    The lock is on the name the commit itself locks (a safetensors shard set's single-file
    name), so no other writer lands in between; the check refuses an output that is one of
    ``sources`` (the source's files), or that exists without ``overwrite``.
    """
    shards = to == "safetensors" and options.max_shard_size is not None
    if ranks is not None and ranks.rank != 0:
        yield
        return
    with output_lock(sharded.output_files(out, 1)[1][0] if shards else out):
        if shards:
            _check_sharded_output(out, list(sources), overwrite)
        else:
            check_output(out, to, list(sources), overwrite)
        yield


def out_dir(out: str) -> str:
    return bundle_files.dirname(out) if bundle_files.is_remote(out) else os.path.dirname(os.path.abspath(out))


def planned_nbytes(ckpt, plan: OutputPlan | None) -> int:
    """The bytes of the entries a conversion of ``ckpt`` writes: what the free-space check asks for."""
    entries = ckpt.entries
    return sum(entries[name].nbytes for name in (plan.names.values() if plan is not None else entries) if name in entries)


def entry_sizes(ckpt, plan: OutputPlan | None) -> list:
    """(output name, bytes) of a checkpoint-like source's entries, in the order they are written."""
    entries = ckpt.entries
    if plan is None:
        return [(name, entry.nbytes) for name, entry in entries.items()]
    return [(out, entries[src].nbytes) for out, src in plan.names.items() if src in entries]


def config_files(options: Request, plan: OutputPlan, shapes: dict, directory: str, overwrite: bool):
    """{config.json path: its text} to publish with the weights, or None; checked before anything is written."""
    if not options.config:
        return None
    sweep_stale(directory)  # a dead conversion's config.json, renamed ahead of weights that never landed
    from restorekit.export._hf import config_text, hf_config

    out_shapes = {out: out_shape(plan, out, shapes[src]) for out, src in plan.names.items() if src in shapes}
    text = config_text(hf_config(options.ruleset(), out_shapes, options.config if isinstance(options.config, dict) else None))
    path = os.path.join(directory, "config.json")
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(path=path)
    return {path: text}


def single(write, path: str, config):
    """``write(path)``, or with a config.json: both staged and published in one commit (config first)."""
    if config is None:
        return write(path)
    return sharded.publish_file(path, write, texts=config)


def finish(result: ExportResult, plan: OutputPlan | None) -> ExportResult:
    """The result, with what the plan left out."""
    if plan is None:
        return result
    return dataclasses.replace(result, dropped=plan.dropped, fallback=plan.fallback, renamed=plan.renamed)


def metadata(options: Request, fmt: str) -> dict | None:
    """The safetensors metadata a conversion writes: Hugging Face reads a file only when it says 'pt'."""
    ruleset = options.ruleset()
    return {"format": "pt"} if fmt == "safetensors" and ruleset is not None and ruleset.model else None
