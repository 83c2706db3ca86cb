"""A training run's checkpoint directory: which checkpoint a restart resumes from.

``tf.train.latest_checkpoint`` trusts the ``checkpoint`` state file alone: when it
names a checkpoint that vanished, a restart starts from scratch and the next save
overwrites the run's older checkpoints; when the checkpoint it names is damaged, the
restore fails with TF's own error; when it names another directory, the run resumes
(and later deletes) another run's checkpoints. ``resume_point`` decides instead, for
every caller that resumes (``resume_or_warm_start``, ``easy_going_scaffold``).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

from restorekit._bundle import files, statefile
from restorekit._checkpoint import Checkpoint
from restorekit.errors import RestoreKitError, RestoreKitWarning, RunDirectoryError, format_names

__all__ = ["ResumePoint", "name_in_state_file", "resume_point"]

_NUMBER = re.compile(r"-(\d+)$")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a restart resumes from, and what was passed over to get there.

    ``prefix`` is complete and readable (its index parses, every tensor's bytes are
    there and pass their crc32c). ``skipped`` pairs each newer prefix passed over with
    why. ``named_by_state_file`` is True when the directory's ``checkpoint`` state
    file already names ``prefix`` as the latest, so TF's own lookups find it too.
    """

    prefix: str
    skipped: tuple[tuple[str, str], ...] = ()
    named_by_state_file: bool = True


def _by_age(prefixes: list[str]) -> list[str]:
    """Newest first: by the ``-N`` step or save count TF appends, then by modification time."""
    def age(prefix: str):
        m = _NUMBER.search(prefix)
        return (int(m.group(1)) if m else -1, files.mtime(prefix + ".index"), prefix)

    return sorted(prefixes, key=age, reverse=True)


def _candidates(directory: str) -> tuple[list[str], list[str]]:
    """The state file's prefixes (its latest, then the ones it keeps, newest first), then every other index."""
    state = statefile.read(directory)
    named: list[str] = []
    if state is not None:
        for name in (state.model_checkpoint_path, *reversed(state.all_model_checkpoint_paths)):
            path = statefile.resolve(directory, name)
            if path not in named:
                named.append(path)
    others = [p[: -len(".index")] for p in files.glob(directory, "*.index")]
    return named, _by_age([p for p in others if p not in named])


def _why_unreadable(prefix: str) -> str | None:
    """Why ``prefix`` cannot be resumed from, by restorekit's own reader; None when it is complete and readable."""
    if not files.exists(prefix + ".index"):
        return "missing (no .index)"
    try:
        result = Checkpoint(prefix).verify()
    except RestoreKitError as e:
        return f"unreadable: {e}"
    if not result.ok:
        first = result.problems[0]
        more = f" (and {len(result.problems) - 1} more)" if len(result.problems) > 1 else ""
        return f"damaged: {first.name!r}: {first.message}{more}"
    return None


def _state_file_exists(directory: str) -> bool:
    return files.exists(files.join(directory, statefile.STATE_FILE))


def _listed(skipped) -> str:
    return "\n".join(f"  {prefix!r}: {why}" for prefix, why in skipped)


def _same_prefix(prefix: str, other) -> bool:
    if other is None:
        return False
    other = getattr(other, "prefix", other)  # a Checkpoint, or a path
    other = str(other).removesuffix(".index")
    if files.is_remote(prefix) or files.is_remote(other):
        return prefix == other
    return os.path.realpath(prefix) == os.path.realpath(other)


def resume_point(directory, *, pretrained=None) -> ResumePoint | None:
    """The newest complete and readable checkpoint of the run in ``directory``; None for a fresh run.

    Considered newest first: the prefix the ``checkpoint`` state file names, the
    older ones it keeps, then any other ``*.index`` in the directory (a state file
    that was lost or never written), by their ``-N`` number. Each is checked with
    restorekit's reader (index, shards, every tensor's crc32c; this reads the
    checkpoint's bytes once), and the first that passes wins; a RestoreKitWarning
    names every newer one passed over and why.

    Args:
        directory: the run's checkpoint directory (it may not exist yet).
        pretrained: the checkpoint (or a list of them) a fresh run warm-starts from; when one lies in
            ``directory`` it is not the run's own and is never resumed from.

    Returns:
        A ``ResumePoint``, or None when ``directory`` holds no checkpoint and no state
        file naming one (a fresh run: warm-starting cannot overwrite anything).

    Raises:
        RunDirectoryError: the state file names a checkpoint outside ``directory``
            (resuming would read another run, and TF would later delete its files as
            this run's); or the directory holds checkpoints (or a state file naming
            some) but none is complete and readable. Starting from scratch there would
            overwrite them, so restorekit refuses rather than warm-starts.
    """
    directory = str(directory)
    if not files.isdir(directory):
        return None
    named, others = _candidates(directory)
    pretrained = pretrained if isinstance(pretrained, (list, tuple)) else [pretrained]  # several sources
    others = [p for p in others if not any(_same_prefix(p, x) for x in pretrained)]
    outside = [p for p in named if statefile.is_outside(directory, p)]
    if outside:
        raise RunDirectoryError(
            f"the 'checkpoint' state file in {directory!r} names {format_names(outside)}, outside that directory "
            f"(a copied run directory?). Resuming would read another run's checkpoint, and TF's CheckpointManager "
            f"or Saver would later delete its files as this run's. Delete or rewrite the state file: restorekit then "
            f"resumes from this directory's newest complete checkpoint.",
            directory, tuple((p, "outside the run directory") for p in outside),
        )
    skipped: list[tuple[str, str]] = []
    for prefix in named + others:
        why = _why_unreadable(prefix)
        if why is None:
            if skipped:
                warnings.warn(f"restorekit: resuming the run in {directory!r} from {prefix!r}, not from newer "
                              f"checkpoints that cannot be restored:\n{_listed(skipped)}", RestoreKitWarning,
                              stacklevel=3)
            elif not named:
                what = "names no checkpoint (it does not parse)" if _state_file_exists(directory) else "is missing"
                warnings.warn(f"restorekit: the 'checkpoint' state file in {directory!r} {what}; resuming from "
                              f"{prefix!r}, the newest checkpoint there", RestoreKitWarning, stacklevel=3)
            return ResumePoint(prefix, tuple(skipped), bool(named) and named[0] == prefix)
        skipped.append((prefix, why))
    if not skipped:
        return None
    raise RunDirectoryError(
        f"{directory!r} holds checkpoints of a run, but none is complete and readable:\n{_listed(skipped)}\n"
        f"Starting from scratch would overwrite them. Move the directory aside (or delete its files) to start "
        f"a fresh run, or restore a copy of a good checkpoint into it.",
        directory, tuple(skipped),
    )


def name_in_state_file(point: ResumePoint) -> None:
    """Make the directory's ``checkpoint`` state file name ``point.prefix`` as its latest (atomically).

    For callers that hand the resume to TF's own lookup (``MonitoredTrainingSession``
    reads the state file): the prefixes it keeps that still exist stay listed.
    """
    if not point.named_by_state_file:
        statefile.write(point.prefix)
