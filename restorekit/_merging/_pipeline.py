"""What every merge shares (``average``, ``interpolate``, ``merge``): open the sources, plan, stream, commit once.

Planning decides everything from the sources' indexes (names, shapes, dtypes) and their
non-float entries before anything is written: which names every source holds alike,
optimizer state dropped by the one weights rule (``export._options.select`` over
``_names.entry_kind``), integer and string entries equal or taken under ``mismatch``,
include/exclude, the output's format and name. Writing then asks for one output tensor
at a time, and the format's writer commits the output through ``_bundle`` once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from restorekit.errors import InvalidArgumentError, SourceMismatchError
from restorekit._registry import Source
from restorekit._names import PatternSet
from restorekit._report import format_shape

__all__ = ["FLOAT_DTYPES", "MISMATCH", "Output", "Plan", "across_ranks", "open_source", "plan", "write"]

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
MISMATCH = ("error", "first", "last")
HF_CONFIG = "config.json"
_PLACEHOLDER = np.empty(0, dtype=np.uint8)  # a tensor of another rank's shard (``_shards.write`` passes it over)


@dataclass
class Input:
    """One open source: its path, reader (under TF names), files, the entries it offers, what was dropped."""

    path: str
    ckpt: Source
    files: list
    names: list
    dropped: tuple


def open_source(path, weights_only: bool = True, *, layout: str | None = None, rules=None) -> Input:
    """A source as a checkpoint-like reader under TF names: a TF checkpoint, a Keras file, or any file convert reads;
    with ``layout`` or ``rules``, under the names and axes a restore pairs it by (:func:`paired`)."""
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
    if layout is not None or rules is not None:
        ckpt = paired(ckpt, layout, rules)
    names = list(ckpt.entries)
    graph = ckpt.object_graph if ckpt.is_object_based and weights_only else None
    # the one rule for "which entries are weights" (optimizer slots, beta powers, global_step, save_counter)
    selection = select(names, graph=graph, weights_only=weights_only)
    kept = [n for n in selection.names.values() if n != OBJECT_GRAPH_KEY]
    return Input(path, ckpt, files, kept, tuple(selection.dropped))


def paired(ckpt, layout: str | None, rules):
    """``ckpt`` seen as a restore into a PyTorch / Hugging Face model sees it (``_torch_target.layout_source``, the one
    resolution of ``layout=`` and ``rules=``): ``layout='torch'`` gives PyTorch names and axes (a foreign PyTorch file
    already has them), a rule set (``'bert-tf-to-hf'``) the rule set's names and axes (a source it renames nothing
    of, such as a Hugging Face file, is in those names already). So sources of different naming pair by name.

    Raises:
        InvalidArgumentError: a layout other than 'torch', both a layout and a rule set, or rules that name no
            rule set.
    """
    from restorekit._torch_target import is_foreign_torch_file, layout_source
    from restorekit.export._hf import rule_set

    if layout == "torch" and rules is None and is_foreign_torch_file(ckpt):
        return ckpt
    if rules is not None:
        rules = rule_set(rules)  # a name or a RuleSet (regex pairs name a model's variables, not a merge's sources)
        renamed = [n for n in ckpt.entries if rules.target_of(n)[0] is not None and rules.target_of(n)[2] is None]
        if layout is None and not renamed:
            return ckpt  # the rule set renames nothing of it: the source is in its target's names already
    view, _ = layout_source(ckpt, layout, rules)
    return view


@dataclass(frozen=True)
class Output:
    """Where a merge goes: the path, the format, and for a Hugging Face directory its shard size and config.json."""

    path: str
    format: str
    max_shard_size: object = None
    config: str | None = None  # the text of the config.json written beside the shards
    overwrite: bool = False


@dataclass
class Plan:
    """A merge decided: the names to write (float ones merged, ``chosen`` ones copied from one source)."""

    srcs: list
    out: Output
    names: list
    skipped: list
    chosen: dict
    taken: list
    dtypes: dict  # name -> output dtype

    @property
    def merged(self) -> tuple:
        return tuple(n for n in self.names if n not in self.chosen)

    @property
    def nbytes(self) -> int:
        entries = self.srcs[0].ckpt.entries
        return sum(entries[n].nbytes * _itemsize(self.dtypes[n]) // max(1, _itemsize(entries[n].dtype))
                   for n in self.names)


def _itemsize(dtype: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}.get(dtype, 1)


def compare_entries(srcs: list, intersection: bool, what: str = "average") -> tuple[list, list]:
    """(names every source holds alike, in the first source's order; names skipped), or SourceMismatchError."""
    held = [set(s.names) for s in srcs]
    everywhere = set.intersection(*held)
    problems = []
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
                                  lambda w: f"Pass {w.option('intersection')} to {what} only the entries they "
                                            "share alike.")
    skipped = [n for n, _ in problems]
    gone = set(skipped)
    return [n for n in srcs[0].names if n not in gone], skipped


def _values_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def compare_values(srcs: list, names: list, mismatch: str, what: str = "averaged") -> tuple[dict, list]:
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
        raise SourceMismatchError(f"integer, boolean or string entries differ between the sources and cannot be "
                                  f"{what}", problems, "Pass mismatch='last' (or 'first') to take one source's value.")
    return chosen, [n for n, _ in differing]


def filtered(names: list, include, exclude) -> list:
    includes = PatternSet(include, what="include pattern")
    excludes = PatternSet(exclude, what="exclude pattern")
    kept = [n for n in names if (not includes or includes.first_match(n) is not None)
            and excludes.first_match(n) is None]
    includes.check_all_used(names)
    excludes.check_all_used(names)
    return kept


def base_name(src: Input) -> str:
    """The name an output takes inside a directory: the source prefix's, or the file's without its extension."""
    prefix = getattr(src.ckpt, "prefix", None)
    if prefix and os.path.exists(prefix + ".index"):
        return os.path.basename(prefix)
    return os.path.splitext(os.path.basename(os.path.normpath(src.path)))[0] or "model"


def _hf_config(source) -> str | None:
    """The path of a Hugging Face directory's config.json, or None."""
    path = os.path.join(os.fspath(source), HF_CONFIG)
    return path if os.path.isdir(source) and os.path.isfile(path) else None


def output_format(out, to, reference, *, max_shard_size=None, hf_directory: bool = True) -> tuple[str, bool]:
    """(format, whether it is a safetensors shard set) of the output, from the names alone (``reference`` is the
    path of the source whose config.json an extension-less output takes): decided before any source is opened."""
    from restorekit.formats import _sinks as formats
    from restorekit.export._targets import target_format

    fmt = target_format(os.fspath(out), to)
    config = _hf_config(reference) if hf_directory else None
    sharded_dir = to is None and fmt == formats.TF and (max_shard_size is not None or config is not None)
    if sharded_dir or (fmt == "safetensors" and max_shard_size is not None):
        return "safetensors", True
    return fmt, False


def across_ranks(out, to, reference, work, *, max_shard_size=None, hf_directory: bool = True,
                 distributed: bool = False):
    """``work(ranks)``: with ``distributed``, across the ranks of the process group as ``convert(distributed=True)``
    runs (``_bundle.ranks.distribute``: a safetensors shard set only); else ``work(None)``."""
    if not distributed:
        return work(None)
    from restorekit._bundle.ranks import distribute

    fmt, sharded = output_format(out, to, reference, max_shard_size=max_shard_size, hf_directory=hf_directory)
    return distribute(os.fspath(out), work, to=fmt, sharded=sharded)


def output(out, to, srcs: list, *, reference: int = 0, max_shard_size=None, dtype: str | None = None,
           overwrite: bool = False, hf_directory: bool = True) -> Output:
    """Decide and check the output before anything is read: its format from ``to`` or its name; a name with no
    extension is a TF checkpoint prefix, or, when ``max_shard_size`` is given or the reference source is a Hugging
    Face directory, a directory of safetensors shards with the reference's config.json."""
    from restorekit._bundle.files import check_parent, output_prefix
    from restorekit.formats import _sinks as formats
    from restorekit.export._outputs import check_output
    from restorekit.formats.safetensors import _shards as sharded

    out = os.fspath(out)
    fmt, shards = output_format(out, to, srcs[reference].path, max_shard_size=max_shard_size,
                                hf_directory=hf_directory)
    config = _hf_config(srcs[reference].path) if hf_directory else None
    if max_shard_size is not None and fmt not in (formats.TF, "safetensors"):
        raise InvalidArgumentError(f"max_shard_size applies to safetensors output, not {fmt}")
    if shards:
        shard = sharded.parse_size(max_shard_size if max_shard_size is not None else "5GB")
        directory = os.path.realpath(sharded.output_files(out, 1)[0])
        if any(os.path.realpath(os.path.dirname(f)) == directory for s in srcs for f in s.files):
            raise _into_source(out)
        sharded.check_output(out, overwrite=overwrite)
        text = None
        if config is not None:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
            if dtype is not None:
                for key in ("torch_dtype", "dtype"):
                    if key in data or key == "torch_dtype":
                        data[key] = dtype
            text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        return Output(out, "safetensors", shard, text, overwrite)
    if fmt == formats.TF:
        # like convert: into an existing directory (or 'OUT/') under the first source's name
        out = output_prefix(out, base_name(srcs[0]))
        check_parent(out)
    check_output(out, fmt, [f for s in srcs for f in s.files], overwrite)
    return Output(out, fmt, overwrite=overwrite)


def _into_source(out: str):
    from restorekit.errors import OutputExistsError

    return OutputExistsError(f"output {out!r} would overwrite its own source; choose another path", path=out,
                             is_source=True)


def plan(srcs: list, out: Output, *, include=None, exclude=None, intersection: bool = False,
         mismatch: str = "error", dtype: str | None = None, what: str = "average") -> Plan:
    """Every decision from the sources' indexes and non-float values; raises before anything is written."""
    from restorekit._bundle.files import check_space

    names, skipped = compare_entries(srcs, intersection, what)
    names = filtered(names, include, exclude)
    chosen, taken = compare_values(srcs, names, mismatch, "merged" if what == "merge" else "averaged")
    entries = srcs[0].ckpt.entries
    dtypes = {n: (dtype if dtype is not None and n not in chosen else entries[n].dtype) for n in names}
    result = Plan(srcs, out, names, skipped, chosen, taken, dtypes)
    check_space(os.path.dirname(os.path.abspath(out.path)), result.nbytes)
    return result


def object_graph_kept(src: Input, names: list):
    """The first source's object graph for the output (keys of entries left out removed), or None."""
    from restorekit._bundle.objectgraph import rewrite_keys
    from restorekit.export._options import OBJECT_GRAPH_KEY

    if OBJECT_GRAPH_KEY not in src.ckpt.entries:
        return None
    raw = src.ckpt.read(OBJECT_GRAPH_KEY).item()
    kept = set(names)
    gone = [n for n in src.ckpt.entries if n != OBJECT_GRAPH_KEY and n not in kept]
    return rewrite_keys(raw, {n: n for n in names}, gone) if gone else raw


def numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def write(p: Plan, merged, *, progress: bool = False, ranks=None):
    """Write the plan: ``merged(name)`` gives each float tensor (float64 or stored dtype), cast to its output dtype;
    non-float entries are copied from their chosen source. One commit through the format's writer.

    With ``ranks`` (a safetensors shard set), ``merged`` is asked only for the tensors of this rank's shards: the
    others pass as unread placeholders, and the shard set's writer publishes every rank's shards in one commit."""
    from restorekit.formats import _sinks as formats
    from restorekit.formats.safetensors import _shards as sharded
    from restorekit.formats.tf._writer import write_tf
    from restorekit.export._options import OBJECT_GRAPH_KEY

    graph = object_graph_kept(p.srcs[0], p.names) if p.out.format == formats.TF else None
    entries = p.srcs[0].ckpt.entries
    sizes = [(n, tuple(entries[n].shape), entries[n].nbytes * _itemsize(p.dtypes[n])
              // max(1, _itemsize(entries[n].dtype))) for n in p.names if entries[n].dtype != "string"]
    only = sharded.rank_names(sizes, p.out.max_shard_size, ranks) if p.out.max_shard_size is not None else None

    def tensors():
        for name in p.names:
            dtype = p.dtypes[name]
            if only is not None and name not in only and entries[name].dtype != "string":
                yield name, _PLACEHOLDER, dtype  # another rank's shard: neither read nor merged here
            elif name in p.chosen:
                yield name, p.srcs[p.chosen[name]].ckpt.read(name), dtype
            else:
                value = merged(name)
                yield name, value.astype(numpy_dtype(dtype), copy=False), dtype
                del value
        if graph is not None:
            yield OBJECT_GRAPH_KEY, np.array(graph, dtype=object), "string"

    if p.out.format == formats.TF:
        return write_tf(p.out.path, tensors(), total=p.nbytes, progress=progress)
    if p.out.max_shard_size is not None:
        texts = None
        if p.out.config is not None:
            directory = sharded.output_files(p.out.path, 1)[0]
            texts = {os.path.join(directory, HF_CONFIG): p.out.config}
        return sharded.write(p.out.path, tensors(), sizes=sizes, max_shard_size=p.out.max_shard_size,
                             overwrite=p.out.overwrite, progress=progress, texts=texts, ranks=ranks)
    return formats.module(p.out.format).write(p.out.path, tensors(), progress=progress)
