"""``restorekit.merge``: a recipe's merge method run over any mix of sources, one output tensor at a time."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from restorekit.errors import InvalidArgumentError, format_names
from restorekit._merging import _pipeline as pipeline
from restorekit._merging._methods import METHODS, Linear, TensorParams, run
from restorekit._merging._stream import Stream
from restorekit._merging._recipe import MergeRecipe, layer_position, load_recipe
from restorekit._report import summary_row

__all__ = ["MergeResult", "merge"]


@dataclass(frozen=True)
class MergeResult:
    """What ``merge`` wrote: ``merged`` float tensors; ``copied`` non-float entries (equal in every source, or
    ``taken`` from one under ``mismatch``); ``dropped`` optimizer state of the first source left out; ``skipped``
    entries not in every source alike (``intersection=True``)."""

    path: str
    format: str
    method: str
    sources: tuple
    base: str | None
    merged: tuple
    copied: tuple = ()
    taken: tuple = ()
    dropped: tuple = ()
    skipped: tuple = ()
    nbytes: int = 0

    def __str__(self) -> str:
        base = f", base {self.base!r}" if self.base else ""
        lines = [f"restorekit: {self.method} merge of {len(self.sources)} models{base} -> {self.path!r} ({self.format})",
                 summary_row("merged", len(self.merged)),
                 summary_row("copied", len(self.copied), format_names(self.copied))]
        for label, names in (("taken", self.taken), ("dropped", self.dropped), ("skipped", self.skipped)):
            if names:
                lines.append(summary_row(label, len(names), format_names(names)))
        return "\n".join(lines)


def _check_required(recipe: MergeRecipe) -> None:
    """A parameter with no default must be set for every model that takes it (or for all), before reading."""
    method = METHODS[recipe.merge_method]
    base = recipe.base_index
    for name, (default, per_model) in method.parameters.items():
        if default is not None:
            continue
        paths = [p for i, p in enumerate(recipe.sources) if i != base] if per_model else [None]
        for path in paths:
            if not recipe.setting(name, path):
                whose = f" for model {path!r}" if path is not None else ""
                raise InvalidArgumentError(f"merge_method {recipe.merge_method!r} needs parameter {name!r}{whose}: "
                                           f"set it under the model's parameters or the recipe's")


def _resolve(recipe: MergeRecipe, names, seed: int) -> dict:
    """{tensor name: TensorParams}, every parameter resolved (filters, layer gradients) before anything is written."""
    method = METHODS[recipe.merge_method]
    base = recipe.base_index
    others = [p for i, p in enumerate(recipe.sources) if i != base or method is METHODS["linear"]]
    positions = layer_position(names)
    params = {}
    for name in names:
        t = positions[name]
        values: dict = {}
        for key, (default, per_model) in method.parameters.items():
            paths = others if per_model else [None]
            found = []
            for path in paths:
                value = recipe.resolve(key, path, name, t, default)
                if value is None:
                    whose = f" of model {path!r}" if path is not None else ""
                    raise InvalidArgumentError(f"no value of {key!r}{whose} applies to {name!r}: its filters match "
                                               "other tensors only; add an entry without a filter")
                found.append(value)
            values[key] = tuple(found) if per_model else found[0]
        if "density" in values:
            bad = [d for d in values["density"] if not 0 < d <= 1]
            if bad:
                raise InvalidArgumentError(f"density {bad[0]!r} for {name!r} is outside (0, 1]")
        params[name] = TensorParams(name, weight=values.get("weight", ()), density=values.get("density", ()),
                                    t=values.get("t", 0.5), lambda_=values.get("lambda", 1.0),
                                    normalize=values.get("normalize", False),
                                    rescale=values.get("rescale", False), seed=seed)
    return params


def merge(recipe, out, *, to: str | None = None, layout: str | None = None, rules=None, include=None, exclude=None,
          intersection: bool = False, mismatch: str = "error",
          max_shard_size=None, seed: int = 0, overwrite: bool = False, progress: bool = False,
          distributed: bool = False) -> MergeResult:
    """Merge models as a mergekit recipe says, streamed: each output tensor from one tensor of each source.

    Methods: ``linear``, ``task_arithmetic``, ``ties``, ``dare_linear``, ``dare_ties``, ``slerp``
    (``restorekit._merging._methods``). Sources are any mix restorekit opens (TF checkpoints, Keras
    files, safetensors files and Hugging Face directories, ``.pt``, ``.npz``, ONNX), paired by
    name; optimizer state is left out; float tensors are computed in float64, a chunk of elements
    at a time, and written in the recipe's ``dtype`` (default: the stored dtype). Memory holds the
    output tensor, a few chunks and, while TIES finds a model's magnitude cut, one float32 array of
    the tensor's size: sources whose bytes lie in a file as stored (TF checkpoints, safetensors) are
    read by ranges, never whole; others (``.pt``, ``.npz``) one tensor at a time in their stored dtype.

        restorekit.merge("ties.yml", "merged/")            # a Hugging Face directory, as mergekit writes
        restorekit.merge({"merge_method": "slerp", "base_model": "a/", "models": ["a/", "b/"],
                          "parameters": {"t": [0, 0.5, 1]}}, "slerp.safetensors")

    Args:
        recipe: a :class:`MergeRecipe`, a mapping of mergekit's keys, or a YAML file's path.
        out: the output; its format is ``to`` or its extension. A name without one is a TF
            checkpoint prefix, unless the base model (else the first) is a Hugging Face
            directory or ``max_shard_size`` is given: then a directory of safetensors
            shards (with the base's ``config.json``).
        to: the output format ('tf', 'safetensors', 'npz', 'torch').
        layout: 'torch' to pair the sources by PyTorch names and axes, as a restore into a torch module
            pairs them (a TF checkpoint's Dense kernel ``[in, out]`` is ``nn.Linear``'s ``weight``
            ``[out, in]``; a PyTorch file from elsewhere is read as it is); the output takes those names.
        rules: a rule set (``'bert-tf-to-hf'``, ``'gpt2-tf-to-hf'``, ... or a ``RuleSet``) every source is
            seen through, as ``convert(rules=...)`` and a restore see it: a TF BERT checkpoint and a Hugging
            Face one pair by the Hugging Face names (the output's). Not with ``layout``.
        include: patterns over entry names; only those are written (default every entry).
        exclude: patterns over entry names left out.
        intersection: merge only the entries every source holds with the same shape and
            dtype; by default any difference is an error listing them all.
        mismatch: integer, boolean or string entries that differ: 'error' (default), or take
            the 'first' or 'last' source's.
        max_shard_size: the largest safetensors shard (default '5GB' for a directory output).
        seed: seeds DARE's drop masks (with each tensor's name and model index).
        overwrite: replace an existing output.
        progress: a progress bar on stderr (when it is a terminal).
        distributed: merge across the ranks of a torch.distributed process group, as
            ``convert(distributed=True)``: a safetensors shard set only; each rank merges the tensors of
            its own shards (DARE's masks depend on the seed, the name and the model only, so the ranks
            agree), rank 0 publishes them in one commit, byte-identical to one process's output.

    Returns:
        A MergeResult.

    Raises:
        InvalidArgumentError: an unknown recipe key, method or parameter; a missing base model
            or weight; a layout other than 'torch', an unknown rule set, or both; slerp without two
            models; ``t`` outside [0, 1]; ``density`` outside (0, 1].
        SourceMismatchError: the sources differ in names, shapes or dtypes, or in non-float values.
        NoMatchError: an include/exclude pattern matches no entry.
        CheckpointNotFoundError: a model path or the recipe file is missing.
        OutputExistsError: the output exists (without ``overwrite``) or is a source.
        OptionNotApplicableError: ``distributed`` for an output that is not a safetensors shard set.
        RankFailedError: with ``distributed``, a rank failed or was killed (it is named); nothing was published.

    Nothing is written when any of these is raised.
    """
    recipe = load_recipe(recipe)
    if mismatch not in pipeline.MISMATCH:
        raise InvalidArgumentError(f"mismatch is one of {pipeline.MISMATCH}, got {mismatch!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InvalidArgumentError(f"seed is an integer, got {seed!r}")
    _check_required(recipe)
    options = dict(to=to, layout=layout, rules=rules, include=include, exclude=exclude, intersection=intersection,
                   mismatch=mismatch,
                   max_shard_size=max_shard_size, seed=int(seed), overwrite=overwrite, progress=progress)
    return pipeline.across_ranks(out, to, recipe.sources[recipe.base_index or 0],
                                 lambda ranks: _merge(recipe, out, ranks, **options),
                                 max_shard_size=max_shard_size, distributed=distributed)


def _merge(recipe: MergeRecipe, out, ranks, *, to, layout, rules, include, exclude, intersection: bool, mismatch: str,
           max_shard_size, seed: int, overwrite: bool, progress: bool) -> MergeResult:
    method = METHODS[recipe.merge_method]
    srcs = [pipeline.open_source(p, layout=layout, rules=rules) for p in recipe.sources]
    base = recipe.base_index
    target = pipeline.output(out, to, srcs, reference=base or 0, max_shard_size=max_shard_size, dtype=recipe.dtype,
                             overwrite=overwrite)
    plan = pipeline.plan(srcs, target, include=include, exclude=exclude, intersection=intersection,
                         mismatch=mismatch, dtype=recipe.dtype, what="merge")
    params = _resolve(recipe, plan.merged, seed)

    def merged(name: str) -> np.ndarray:
        # each source's tensor streamed in chunks (stored dtype, read by element ranges), the output filled in place
        p = params[name]
        streams = [Stream(s.ckpt, name) for i, s in enumerate(srcs) if i != base or isinstance(method, Linear)]
        base_stream = None if isinstance(method, Linear) or base is None else Stream(srcs[base].ckpt, name)
        out = np.empty(streams[0].shape, pipeline.numpy_dtype(plan.dtypes[name]))
        return run(method, streams, base_stream, p, out)

    pipeline.write(plan, merged, progress=progress, ranks=ranks)
    return MergeResult(target.path, target.format, recipe.merge_method,
                       recipe.sources, recipe.base_model, plan.merged, tuple(plan.chosen), tuple(plan.taken),
                       srcs[0].dropped, tuple(plan.skipped), plan.nbytes)
