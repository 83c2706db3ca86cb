"""Checkpoint averaging and interpolation: a weighted mean of several checkpoints, streamed tensor by tensor.

``average`` is the ``linear`` merge over the pipeline every merge shares
(``restorekit._merging._pipeline``): everything is decided from the sources' indexes
and their non-float entries before anything is written; then each float tensor is read
from every source a chunk of elements at a time (``_merging._stream``), accumulated in
float64 and written into the output tensor in its source dtype, so memory stays at one
tensor and a few chunks, never the model.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import numpy as np

from restorekit.errors import InvalidArgumentError, format_names
from restorekit._merging import _pipeline as pipeline
from restorekit._merging._methods import METHODS, TensorParams, run
from restorekit._merging._stream import Stream
from restorekit._report import summary_row

__all__ = ["AverageResult", "average", "interpolate"]

FLOAT_DTYPES = pipeline.FLOAT_DTYPES
MISMATCH = pipeline.MISMATCH


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


def average(sources, out, *, weights=None, layout: str | None = None, rules=None, include=None, exclude=None,
            weights_only: bool = True, intersection: bool = False, mismatch: str = "error", to: str | None = None, max_shard_size=None,
            overwrite: bool = False, progress: bool = False, distributed: bool = False) -> AverageResult:
    """Write the weighted mean of several checkpoints, tensor by tensor.

    Float tensors (float16, bfloat16, float32, float64) are accumulated in float64 and
    written in their stored dtype. Integer, boolean and string entries (step counters,
    vocabularies) must be equal in every source, or ``mismatch`` says whose to take.
    Each tensor is read from every source a chunk at a time: memory holds the output
    tensor and a few chunks, not the model (a torch output excepted: ``torch.save`` pickles one dict). The output appears
    whole or not at all (the format's writer commits it).

        average(['run/ckpt-1000', 'run/ckpt-2000', 'run/ckpt-3000'], 'avg/model.ckpt')
        average(['a.safetensors', 'b.safetensors'], 'mean.safetensors', weights=[3, 1])

    Args:
        sources: two or more paths: TF checkpoints (prefix, directory, ``.index``),
            Keras files, or any file ``convert`` reads (safetensors, npz, torch), read
            under their TF names; they may be of different formats.
        out: the output; its format is ``to`` or else its extension (no known
            extension: a TF checkpoint prefix, or inside an existing directory under
            the first source's name); with ``max_shard_size``, a directory of safetensors shards.
        weights: one number per source (default: equal); normalized by their sum,
            which must be positive (a negative weight extrapolates).
        layout: 'torch' to pair the sources by PyTorch names and axes, as ``merge(layout='torch')`` does
            (a TF checkpoint and a PyTorch state dict of the same model then average together).
        rules: a rule set (``'bert-tf-to-hf'``, ... or a ``RuleSet``) every source is seen through, as
            ``merge(rules=...)`` and a restore see it. Not with ``layout``.
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
        max_shard_size: the largest safetensors shard (``'2GB'``, bytes): Hugging Face-style shards plus an index.
        overwrite: replace an existing output.
        progress: a progress bar on stderr (when it is a terminal).
        distributed: average across the ranks of a torch.distributed process group, as
            ``convert(distributed=True)``: a safetensors shard set only; each rank computes the tensors of
            its own shards, rank 0 publishes them in one commit, byte-identical to one process's output
            (docs/cluster.md).

    Returns:
        An AverageResult.

    Raises:
        InvalidArgumentError: fewer than two sources, bad weights (wrong length, not
            finite, a sum that is not positive), an unknown ``mismatch`` or format; a layout
            other than 'torch', an unknown rule set, or both.
        SourceMismatchError: the sources differ in names, shapes or dtypes, or their
            non-float entries differ (``problems`` lists them all).
        NoMatchError: an include/exclude pattern matches no entry.
        CheckpointNotFoundError, CorruptCheckpointError: a source.
        OutputExistsError: the output exists (without ``overwrite``) or is a source.
        OptionNotApplicableError: ``distributed`` for an output that is not a safetensors shard set.
        RankFailedError: with ``distributed``, a rank failed or was killed (it is named); nothing was published.

    Nothing is written when any of these is raised.
    """
    if isinstance(sources, (str, bytes)) or hasattr(sources, "__fspath__"):
        raise InvalidArgumentError("sources is a list of two or more checkpoint paths, got one path")
    sources = [os.fspath(s) for s in sources]
    weights = _check_weights(weights, len(sources))
    if mismatch not in pipeline.MISMATCH:
        raise InvalidArgumentError(f"mismatch is one of {pipeline.MISMATCH}, got {mismatch!r}")
    options = dict(layout=layout, rules=rules, include=include, exclude=exclude, weights_only=weights_only, intersection=intersection,
                   mismatch=mismatch, to=to, max_shard_size=max_shard_size, overwrite=overwrite, progress=progress)
    return pipeline.across_ranks(out, to, sources[0], lambda ranks: _average(sources, out, weights, ranks, **options),
                                 max_shard_size=max_shard_size, hf_directory=False, distributed=distributed)


def _average(sources: list, out, weights: tuple, ranks, *, layout, rules, include, exclude, weights_only, intersection, mismatch, to,
             max_shard_size, overwrite: bool, progress: bool) -> AverageResult:
    srcs = [pipeline.open_source(s, bool(weights_only), layout=layout, rules=rules) for s in sources]
    target = pipeline.output(out, to, srcs, max_shard_size=max_shard_size, overwrite=overwrite, hf_directory=False)
    plan = pipeline.plan(srcs, target, include=include, exclude=exclude, intersection=intersection,
                         mismatch=mismatch)
    total = sum(weights)
    linear = METHODS["linear"]

    def mean(name: str) -> np.ndarray:
        # linear, streamed: every source's tensor read in chunks into a float64 chunk, the output filled in place
        streams = [Stream(src.ckpt, name) for src in srcs]
        out = np.empty(streams[0].shape, pipeline.numpy_dtype(plan.dtypes[name]))
        return run(linear, streams, None, TensorParams(name, weight=tuple(weights)), out)

    pipeline.write(plan, mean, progress=progress, ranks=ranks)
    return AverageResult(target.path, target.format, tuple(s.path for s in srcs), tuple(w / total for w in weights),
                         plan.merged, tuple(plan.chosen), tuple(plan.taken), srcs[0].dropped, tuple(plan.skipped),
                         plan.nbytes)


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
