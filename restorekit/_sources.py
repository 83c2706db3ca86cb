"""Several sources in one restore: each scanned with its own options, merged into one RestoreReport.

``scan`` (and so every restore path: ``easy_going_scaffold``, ``warm_start``,
``restorekit.restore``, ``WarmStart``, ``resume_or_warm_start``) takes, instead of one
checkpoint:

* a list of sources: each variable restores from the first source that holds its
  entry (matched or mismatched there); the others' entries for it are skipped;
* a mapping ``{pattern: source}`` over variable names (``restorekit._names`` patterns,
  as ``include`` takes): a variable restores from the one source whose pattern takes
  it; one taken by no pattern is missing (unless skipped on purpose, such as an
  optimizer slot); one taken by two patterns, or a pattern taking no variable, is an
  error raised before any source is read.

A source is a path or Checkpoint in any format ``restorekit.formats.open`` reads, or
``From(path, **scan_options)`` with options of its own (an ``assignment_map`` or
``rules`` for that file, ...) that replace the shared ones for it.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import replace

from restorekit.errors import InvalidArgumentError
from restorekit._hints import restore_hints
from restorekit._names import PatternSet
from restorekit._report import Record, RestoreReport
from restorekit._targets import collect

__all__ = ["From", "is_several", "merge", "scan_several", "source_paths"]

_KINDS = ("matched", "missing", "shape_mismatched", "dtype_mismatched", "skipped", "unused")
_HELD = ("matched", "shape_mismatched", "dtype_mismatched")  # the source holds the variable's entry
# skips that do not depend on a source: they stand for a variable no source pattern takes
_ON_PURPOSE = ("not_included", "excluded", "optimizer", "counter", "rng")


class From:
    """One source of a several-source restore with its own ``scan`` options.

    ``prefix`` picks one group of a torch training checkpoint as the source: its entries
    under ``prefix`` without it (``From('ckpt.pt', prefix='model_state.')`` is the path
    ``'ckpt.pt:model_state'``).

    Example:
        >>> restorekit.scan({'encoder': restorekit.From('bert/', assignment_map={'bert/': 'encoder/'}),
        ...                  'decoder': 'gpt2.safetensors'}, model)
    """

    __slots__ = ("checkpoint", "options")

    def __init__(self, checkpoint, *, prefix: str | None = None, **scan_options):
        if is_several(checkpoint):
            raise InvalidArgumentError(f"From takes one checkpoint, got {type(checkpoint).__name__}: {checkpoint!r}")
        self.checkpoint = os.fspath(checkpoint) if isinstance(checkpoint, os.PathLike) else checkpoint
        if prefix:
            if not isinstance(self.checkpoint, str):
                raise InvalidArgumentError(f"From(prefix=...) takes a path, got {type(checkpoint).__name__}")
            self.checkpoint = f"{self.checkpoint}:{prefix.rstrip('.')}"
        self.options = dict(scan_options)

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"From({self.checkpoint!r}{options})"

    # Defining __eq__ alone leaves From unhashable, as it must be: its options are a dict.
    def __eq__(self, other) -> bool:
        return isinstance(other, From) and (self.checkpoint, self.options) == (other.checkpoint, other.options)


def is_several(checkpoint) -> bool:
    """True for a list, tuple or dict of sources, or a ``From``: what ``scan_several`` takes.

    A dict, not any Mapping: an open Checkpoint is a Mapping of its entries, and one source.
    """
    return isinstance(checkpoint, (From, list, tuple, dict))


def _specs(checkpoint) -> tuple[list, list | None]:
    """The sources as ``From`` values, and the mapping's patterns (None for a list)."""
    if isinstance(checkpoint, dict):
        patterns, items = list(checkpoint), list(checkpoint.values())
    else:
        patterns, items = None, [checkpoint] if isinstance(checkpoint, From) else list(checkpoint)
    if not items:
        raise InvalidArgumentError("a restore needs at least one source; got an empty list or mapping")
    for item in items:
        if is_several(item) and not isinstance(item, From):
            raise InvalidArgumentError(f"a source is a path, Checkpoint or restorekit.From, got {item!r}")
    return [item if isinstance(item, From) else From(item) for item in items], patterns


def source_paths(checkpoint) -> list:
    """The individual checkpoints a restore reads: ``[checkpoint]``, or each of several sources."""
    if not is_several(checkpoint):
        return [checkpoint]
    return [spec.checkpoint for spec in _specs(checkpoint)[0]]


def _assign(patterns: list, names: list) -> dict:
    """variable name -> index of the one pattern taking it (None: no pattern). Overlaps and idle patterns raise."""
    sets = [PatternSet([p], what="source pattern") for p in patterns]
    shown = [p.pattern if isinstance(p, re.Pattern) else p for p in patterns]
    assigned = {}
    for name in names:
        hits = [i for i, s in enumerate(sets) if s.first_match(name) is not None]
        if len(hits) > 1:
            raise InvalidArgumentError(
                f"variable {name!r} is taken by source patterns {shown[hits[0]]!r} and {shown[hits[1]]!r}; each "
                "variable restores from one source, so make the patterns disjoint (e.g. end a scope with '/')"
            )
        assigned[name] = hits[0] if hits else None
    for s in sets:
        s.check_all_used(names)
    return assigned


def _options(shared: dict, own: dict, known) -> dict:
    unknown = sorted(set(own) - set(known))
    if unknown:
        raise InvalidArgumentError(f"From() takes scan options ({', '.join(sorted(known))}), not {', '.join(unknown)}")
    merged = dict(shared)
    if "rules" in own or "assignment_map" in own:  # a source's own naming replaces the shared naming
        merged["rules"] = merged["assignment_map"] = None
    merged.update(own)
    return merged


def scan_several(checkpoint, variables, options: dict, scan_one) -> RestoreReport:
    """Scan each source with its options (``scan_one`` is ``restorekit.scan``) and merge the reports.

    Raises:
        InvalidArgumentError: an empty list, a variable taken by two source patterns,
            an unknown option in a ``From``.
        NoMatchError: a source pattern takes no variable.
    """
    specs, patterns = _specs(checkpoint)
    known = [p for p in inspect.signature(scan_one).parameters if p not in ("checkpoint", "variables")]
    own = [_options(options, spec.options, known) for spec in specs]
    targets = collect(variables)
    assigned = _assign(patterns, [t.variable_name for t in targets]) if patterns is not None else None
    reports = [scan_one(spec.checkpoint, variables, **opts) for spec, opts in zip(specs, own)]
    return merge(reports, targets, assigned)


def _choose(name: str, order, by_variable: list):
    """(kind, record, index of the source it came from or None) for one variable."""
    found = [(i, *by_variable[i].get(name, (None, None))) for i in order]
    for wanted in (_HELD, ("missing",)):
        for i, kind, record in found:
            if kind in wanted:
                return kind, record, i
    if found and found[0][1] is not None:
        i, kind, record = found[0]
        return kind, record, i if "not_in_assignment_map" in record.how else None
    return None, None, None


def merge(reports: list, targets: list, assigned: dict | None) -> RestoreReport:
    """One RestoreReport from one report per source, each record naming its source.

    ``assigned``: variable name -> the index of its source (mapping), or None for a
    list (the first source holding the entry wins).
    """
    if len(reports) == 1:
        return reports[0]  # one source, with options: the report one scan gives
    prefixes = tuple(r.checkpoint for r in reports)
    by_variable = [
        {rec.variable_name: (kind, rec) for kind in _KINDS for rec in getattr(rep, kind) if rec.variable_name is not None}
        for rep in reports
    ]
    out: dict[str, list[Record]] = {kind: [] for kind in _KINDS}
    chosen, handles, policies = {}, {}, {}
    everywhere = range(len(reports))
    for t in targets:
        name = t.variable_name
        order = everywhere if assigned is None else [] if assigned.get(name) is None else [assigned[name]]
        kind, record, i = _choose(name, order, by_variable)
        if kind is None and assigned is not None:  # no pattern takes it: missing, unless skipped everywhere
            first = by_variable[0].get(name, (None, None))
            if first[0] == "skipped" and first[1].how and first[1].how[0] in _ON_PURPOSE:
                kind, record = first
            else:
                kind, record = "missing", Record(name, None, t.shape, t.dtype, reason="no source pattern takes it",
                                                 how=("no_source",))
        if kind is None:
            continue
        if i is not None:
            record = replace(record, source=prefixes[i])
            chosen[name] = i
            rep = reports[i]
            if kind == "matched":
                handles[name] = rep._handles[name] if rep._handles is not None else None
                if rep._policies and name in rep._policies:
                    policies[name] = rep._policies[name]
        out[kind].append(record)
    for i, rep in enumerate(reports):
        taken = {r.checkpoint_name for r in out["matched"] + out["shape_mismatched"] + out["dtype_mismatched"]
                 if r.source == prefixes[i]}
        left: dict[str, Record] = {}
        for kind in _HELD:  # entries this source holds for variables that restore from another
            for r in getattr(rep, kind):
                if chosen.get(r.variable_name) != i and r.checkpoint_name not in taken:
                    left.setdefault(r.checkpoint_name, Record(
                        None, r.checkpoint_name, checkpoint_shape=r.checkpoint_shape, checkpoint_dtype=r.checkpoint_dtype,
                        reason="its variable restores from another source", checkpoint_path=r.checkpoint_path,
                        how=("other_source",), source=prefixes[i]))
        out["skipped"].extend(left.values())
        for kind in ("skipped", "unused"):
            out[kind].extend(replace(r, source=prefixes[i]) for r in getattr(rep, kind) if r.variable_name is None)
    looked_for = [r for r in out["missing"] if r.checkpoint_name is not None]  # not those no pattern takes
    hints = restore_hints(looked_for, out["shape_mismatched"], out["dtype_mismatched"], out["unused"])
    for prefix, rep in zip(prefixes, reports):  # a source's own hints (EMA, shared entries, by position), named
        own = set(restore_hints(rep.missing, rep.shape_mismatched, rep.dtype_mismatched, rep.unused))
        hints += tuple(f"{prefix}: {h}" for h in rep.hints if h not in own)
    records: dict = {kind: tuple(records) for kind, records in out.items()}  # Any: mypy checks ** against every field
    return RestoreReport(
        checkpoint=" + ".join(prefixes),
        num_variables=reports[0].num_variables,
        **records,
        hints=tuple(dict.fromkeys(hints)),
        sources=prefixes,
        _handles=handles,
        _policies=policies,
    )
