"""Checkpoint averaging and interpolation: a weighted mean of several checkpoints, streamed tensor by tensor.

Everything is decided from the sources' indexes (names, shapes, dtypes) and their
non-float entries before anything is written; then each float tensor is read from
every source in turn, accumulated in float64 and handed to the format's writer in its
source dtype, so memory stays at a few tensors, never the model.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import numpy as np

from restorekit.errors import InvalidArgumentError, SourceMismatchError, format_names
from restorekit._registry import Source
from restorekit._names import PatternSet
from restorekit._report import format_shape, summary_row

__all__ = ["AverageResult", "WeightsSource", "average", "base_name", "interpolate", "object_graph_kept", "open_weights"]

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
MISMATCH = ("error", "first", "last")
# Elements converted to float64 at a time: the temporaries of a tensor stay a few MB.
_CHUNK = 1 << 20


@dataclass(frozen=True)
class AverageResult:
    """What ``average`` wrote: ``averaged`` float tensors; ``copied`` non-float entries (equal in every source,
    or ``taken`` from one source under ``mismatch``); ``dropped`` optimizer state left out (``weights_only``);
    ``skipped`` entries not in every source alike (``intersection=True``)."""

    path: str
    format: str
    sources: tuple
    weights: tuple
    averaged: tuple
    copied: tuple = ()
    taken: tuple = ()
    dropped: tuple = ()
    skipped: tuple = ()
    nbytes: int = 0

    def __str__(self) -> str:
        weights = ", ".join(f"{w:.4g}" for w in self.weights)
        lines = [f"restorekit: averaged {len(self.sources)} checkpoints (weights {weights}) -> {self.path!r} "
                 f"({self.format})",
                 summary_row("averaged", len(self.averaged)),
                 summary_row("copied", len(self.copied), format_names(self.copied))]
        for label, names in (("taken", self.taken), ("dropped", self.dropped), ("skipped", self.skipped)):
            if names:
                lines.append(summary_row(label, len(names), format_names(names)))
        return "\n".join(lines)


@dataclass
class WeightsSource:
    path: str
    ckpt: Source
    files: list
    names: list  # the entries it offers for the average, in order
    dropped: tuple


def open_weights(path: str, weights_only: bool) -> WeightsSource:
    """A source as a checkpoint-like reader under TF names: a TF checkpoint, a Keras file, or any file convert reads."""
    from restorekit._checkpoint import Checkpoint
    from restorekit.layouts._planned import keras_source
    from restorekit.formats._sink import checkpoint_files
    from restorekit.formats.files import FileView
    from restorekit.export._options import OBJECT_GRAPH_KEY, select
    from restorekit.keras_files import KerasCheckpoint

    path = os.fspath(path)
    ckpt: Source = Checkpoint(path)  # the format decided by the file's bytes (restorekit.formats.open)
    if isinstance(ckpt, KerasCheckpoint):
        files, ckpt = list(ckpt.files), keras_source(ckpt, weights_only=weights_only)
    elif isinstance(ckpt, FileView):  # safetensors (a shard set too), torch, npz, onnx: every file its reader reads
        files = list(ckpt.reader.files)
    else:
        files = checkpoint_files(ckpt.prefix)
    names = list(ckpt.entries)
    graph = ckpt.object_graph if ckpt.is_object_based and weights_only else None
    # the one rule for "which entries are weights" (optimizer slots, beta powers, global_step, save_counter)
    selection = select(names, graph=graph, weights_only=weights_only)
    kept = [n for n in selection.names.values() if n != OBJECT_GRAPH_KEY]
    return WeightsSource(path, ckpt, files, kept, tuple(selection.dropped))


def _check_weights(weights, count: int) -> tuple:
    if count < 2:
        raise InvalidArgumentError(f"average takes two or more sources, got {count}")
    if weights is None:
        return (1.0,) * count
    try:
        weights = list(weights)
    except TypeError:
        raise InvalidArgumentError(f"weights is a list of {count} numbers, got {weights!r}") from None
    if len(weights) != count:
        raise InvalidArgumentError(f"weights has {len(weights)} numbers for {count} sources; give one per source")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise InvalidArgumentError(f"weights are finite numbers, got {w!r}")
    if sum(weights) <= 0:
        raise InvalidArgumentError(f"weights {weights} sum to {sum(weights)}; the sum must be positive")
    return tuple(float(w) for w in weights)


def _compare_entries(srcs: list, intersection: bool) -> tuple[list, list]:
    """(names every source holds alike, in the first source's order; names skipped), or SourceMismatchError."""
    held = [set(s.names) for s in srcs]
    everywhere = set.intersection(*held)
    problems, skipped = [], []
    for name in dict.fromkeys(n for s in srcs for n in s.names):
        if name not in everywhere:
            missing = [str(i) for i, h in enumerate(held) if name not in h]
            problems.append((name, f"{name!r}: not in source {', '.join(missing)}"))
            continue
        entries = [s.ckpt.entries[name] for s in srcs]
        kinds = {(tuple(e.shape), e.dtype) for e in entries}
        if len(kinds) > 1:
            seen = ", ".join(f"{format_shape(e.shape)} {e.dtype}" for e in entries)
            problems.append((name, f"{name!r}: {seen}"))
    if problems and not intersection:
        raise SourceMismatchError(f"the {len(srcs)} sources do not hold the same tensors alike", problems,
                                  lambda w: f"Pass {w.option('intersection')} to average only the entries they share alike.")
    skipped = [n for n, _ in problems]
    gone = set(skipped)
    return [n for n in srcs[0].names if n not in gone], skipped


def _values_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _compare_values(srcs: list, names: list, mismatch: str) -> tuple[dict, list]:
    """({non-float name: index of the source it is copied from}, names that differed), reading each entry once per source."""
    chosen, differing = {}, []
    for name in names:
        if srcs[0].ckpt.entries[name].dtype in FLOAT_DTYPES:
            continue
        first = srcs[0].ckpt.read(name)
        differs = [i for i, s in enumerate(srcs[1:], 1) if not _values_equal(first, s.ckpt.read(name))]
        chosen[name] = len(srcs) - 1 if (differs and mismatch == "last") else 0
        if differs:
            differing.append((name, differs))
    if differing and mismatch == "error":
        problems = [(n, f"{n!r} ({srcs[0].ckpt.entries[n].dtype}): source 0 differs from source {', '.join(map(str, d))}")
                    for n, d in differing]
        raise SourceMismatchError("integer, boolean or string entries differ between the sources and cannot be "
                                  "averaged", problems, "Pass mismatch='last' (or 'first') to take one source's value.")
    return chosen, [n for n, _ in differing]


def _mean(srcs: list, name: str, weights: tuple, total: float) -> np.ndarray:
    """The weighted mean of ``name`` over the sources, accumulated in float64, in the stored dtype."""
    acc: np.ndarray | None = None
    dtype = None
    for src, w in zip(srcs, weights):
        value = src.ckpt.read(name)
        if acc is None:
            acc, dtype = np.zeros(value.shape, np.float64), value.dtype
        flat_acc, flat = acc.reshape(-1), value.reshape(-1)
        for i in range(0, flat.size, _CHUNK):
            flat_acc[i:i + _CHUNK] += flat[i:i + _CHUNK].astype(np.float64) * w
        del value, flat
    assert acc is not None, "average takes two sources or more"
    acc /= total
    return acc.astype(dtype)


def object_graph_kept(src: WeightsSource, names: list):
    """The first source's object graph for the output (keys of entries left out removed), or None."""
    from restorekit._bundle.objectgraph import rewrite_keys
    from restorekit.export._options import OBJECT_GRAPH_KEY

    if OBJECT_GRAPH_KEY not in src.ckpt.entries:
        return None
    raw = src.ckpt.read(OBJECT_GRAPH_KEY).item()
    kept = set(names)
    gone = [n for n in src.ckpt.entries if n != OBJECT_GRAPH_KEY and n not in kept]
    return rewrite_keys(raw, {n: n for n in names}, gone) if gone else raw


def average(sources, out, *, weights=None, include=None, exclude=None, weights_only: bool = True,
            intersection: bool = False, mismatch: str = "error", to: str | None = None, overwrite: bool = False,
            progress: bool = False) -> AverageResult:
    """Write the weighted mean of several checkpoints, tensor by tensor.

    Float tensors (float16, bfloat16, float32, float64) are accumulated in float64 and
    written in their stored dtype. Integer, boolean and string entries (step counters,
    vocabularies) must be equal in every source, or ``mismatch`` says whose to take.
    Each tensor is read from each source in turn: memory holds a few tensors, not the
    model (a torch output excepted: ``torch.save`` pickles one dict). The output appears
    whole or not at all (the format's writer commits it).

        average(['run/ckpt-1000', 'run/ckpt-2000', 'run/ckpt-3000'], 'avg/model.ckpt')
        average(['a.safetensors', 'b.safetensors'], 'mean.safetensors', weights=[3, 1])

    Args:
        sources: two or more paths: TF checkpoints (prefix, directory, ``.index``),
            Keras files, or any file ``convert`` reads (safetensors, npz, torch), read
            under their TF names; they may be of different formats.
        out: the output; its format is ``to`` or else its extension (no known
            extension: a TF checkpoint prefix, or inside an existing directory under
            the first source's name).
        weights: one number per source (default: equal); normalized by their sum,
            which must be positive (a negative weight extrapolates).
        include: patterns over entry names (``restorekit._names``): only matching
            entries are averaged and written. A pattern that matches nothing is an error.
        exclude: patterns over entry names whose entries are left out.
        weights_only: leave out optimizer state, ``global_step`` and ``save_counter``
            (default), decided as ``convert(weights_only=True)`` decides it.
        intersection: average only the entries every source holds with the same
            shape and dtype (the rest are listed in ``skipped``); by default any
            difference is an error listing them all.
        mismatch: for non-float entries that differ: 'error' (default), 'first' or
            'last' (that source's value).
        to: the output format ('tf', 'safetensors', 'npz', 'torch').
        overwrite: replace an existing output.
        progress: a progress bar on stderr (when it is a terminal).

    Returns:
        An AverageResult.

    Raises:
        InvalidArgumentError: fewer than two sources, bad weights (wrong length, not
            finite, a sum that is not positive), an unknown ``mismatch`` or format.
        SourceMismatchError: the sources differ in names, shapes or dtypes, or their
            non-float entries differ (``problems`` lists them all).
        NoMatchError: an include/exclude pattern matches no entry.
        CheckpointNotFoundError, CorruptCheckpointError: a source.
        OutputExistsError: the output exists (without ``overwrite``) or is a source.

    Nothing is written when any of these is raised.
    """
    from restorekit._bundle.files import check_parent, check_space, output_prefix
    from restorekit.formats import _sinks as formats
    from restorekit.export._outputs import check_output as _check_output
    from restorekit.export._targets import target_format
    from restorekit.formats.tf._writer import write_tf

    if isinstance(sources, (str, bytes)) or hasattr(sources, "__fspath__"):
        raise InvalidArgumentError("sources is a list of two or more checkpoint paths, got one path")
    sources = [os.fspath(s) for s in sources]
    weights = _check_weights(weights, len(sources))
    if mismatch not in MISMATCH:
        raise InvalidArgumentError(f"mismatch is one of {MISMATCH}, got {mismatch!r}")
    out = os.fspath(out)
    fmt = target_format(out, to)
    srcs = [open_weights(s, bool(weights_only)) for s in sources]
    if fmt == formats.TF:
        # like convert: into an existing directory (or 'OUT/') under the first source's name
        out = output_prefix(out, base_name(srcs[0]))
        check_parent(out)
    _check_output(out, fmt, [f for s in srcs for f in s.files], overwrite)
    names, skipped = _compare_entries(srcs, intersection)
    names = _filtered(names, include, exclude)
    chosen, taken = _compare_values(srcs, names, mismatch)
    entries = srcs[0].ckpt.entries
    nbytes = sum(entries[n].nbytes for n in names)
    check_space(os.path.dirname(os.path.abspath(out)), nbytes)

    total = sum(weights)
    graph = object_graph_kept(srcs[0], names)

    def tensors():
        for name in names:
            entry = entries[name]
            if name in chosen:
                yield name, srcs[chosen[name]].ckpt.read(name), entry.dtype
            else:
                yield name, _mean(srcs, name, weights, total), entry.dtype
        if graph is not None:
            from restorekit.export._options import OBJECT_GRAPH_KEY

            yield OBJECT_GRAPH_KEY, np.array(graph, dtype=object), "string"

    if fmt == formats.TF:
        write_tf(out, tensors(), total=nbytes, progress=progress)
    else:
        formats.module(fmt).write(out, tensors(), progress=progress)
    return AverageResult(out, fmt, tuple(s.path for s in srcs), tuple(w / total for w in weights),
                         tuple(n for n in names if n not in chosen), tuple(chosen), tuple(taken),
                         srcs[0].dropped, tuple(skipped), nbytes)


def base_name(src: WeightsSource) -> str:
    """The name an output takes inside a directory: the source prefix's, or the file's without its extension."""
    prefix = getattr(src.ckpt, "prefix", None)
    if prefix and os.path.exists(prefix + ".index"):
        return os.path.basename(prefix)
    return os.path.splitext(os.path.basename(os.path.normpath(src.path)))[0] or "model"


def _filtered(names: list, include, exclude) -> list:
    includes = PatternSet(include, what="include pattern")
    excludes = PatternSet(exclude, what="exclude pattern")
    kept = [n for n in names if (not includes or includes.first_match(n) is not None)
            and excludes.first_match(n) is None]
    includes.check_all_used(names)
    excludes.check_all_used(names)
    return kept


def interpolate(a, b, alpha: float, out, **options) -> AverageResult:
    """Write ``(1 - alpha) * a + alpha * b`` for every float tensor (``alpha`` 0 is ``a``, 1 is ``b``).

    The usual trick between a pretrained and a fine-tuned model (WiSE-FT); ``alpha``
    outside [0, 1] extrapolates. Every other option is ``average``'s.

        interpolate('pretrained/', 'finetuned/', 0.5, 'wise/model.ckpt')

    Raises:
        InvalidArgumentError: ``alpha`` is not a finite number; and as ``average``.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha):
        raise InvalidArgumentError(f"alpha is a finite number, got {alpha!r}")
    if "weights" in options:
        raise InvalidArgumentError("interpolate sets the weights from alpha; use average for other weights")
    return average([a, b], out, weights=[1.0 - float(alpha), float(alpha)], **options)
