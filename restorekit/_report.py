"""RestoreReport: what a restore will do, as plain values (names, shapes, dtypes).

Also the shape and size formatting every printed result shares (reports, graph
summaries, export results, remap errors). Pure Python: importing this module never
imports TensorFlow.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace

from restorekit.errors import IncompleteRestoreError, InvalidArgumentError, NoMatchError

__all__ = ["HOW", "OptimizerNote", "OptimizerRecord", "OptimizerSection", "Record", "RestoreReport", "format_bytes",
           "format_shape", "live_handles", "nothing_matched"]


def format_shape(shape, unknown_rank: str = "?") -> str:
    """``(2048, None)`` -> ``'[2048, ?]'``; a shape of unknown rank (None) -> ``unknown_rank``."""
    if shape is None:
        return unknown_rank
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def summary_row(label: str, count: int, detail: str = "") -> str:
    """One row of a summary table (``  matched      310   ...``), as every result's ``str`` prints it."""
    return f"  {label:<11}{count:>5}   {detail}".rstrip()


def format_bytes(n: int) -> str:
    """A byte count for people: ``512`` -> ``'512 B'``, ``1536`` -> ``'1.5 KiB'`` (up to TiB)."""
    size: float = n
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass(frozen=True)
class Record:
    """One line of a report.

    ``variable_name`` is the model side (graph name without ':0', or the Keras path),
    ``checkpoint_name`` the checkpoint key; either is None where it does not apply
    (an unused entry has no variable). ``shape``/``dtype`` describe the variable,
    ``checkpoint_shape``/``checkpoint_dtype`` the entry. ``reason`` says why a record
    was skipped, or how a match was made (``'ema'``, ``'ema fallback: ...'``,
    ``'slice_or_pad'``, ``'vocab'``, ``'shape_policy: fn'``). ``checkpoint_path`` is the
    readable path of an object-based (TF2) checkpoint key, such as ``dense_1/kernel``.

    ``how`` says the same as a value, words from :data:`HOW` (code reads this, never
    ``reason``). A matched record: how it was paired, one of ``'name'`` (the variable's
    own name), ``'rule'``, ``'assignment_map'``, ``'object_graph'`` (the object graph
    paired what names did not, or ``match='object_graph'`` asked for it), ``'position'``
    (the object graph, across names), then ``'readable_path'`` when the name was found as
    an entry's readable path, ``'ema'`` / ``'ema_fallback'``, ``'policy'`` (a shape policy,
    vocabulary or cast). A pair the object graph of TensorFlow's live trackables and the
    names both give is reported as the names give it (``('name', 'readable_path')``), so
    one checkpoint and one model give the same ``how`` on every Keras backend. A skipped record: why, one of ``'not_included'``,
    ``'excluded'``, ``'not_in_assignment_map'``, ``'optimizer'``, ``'counter'``,
    ``'rng'``, ``'ema_shadow'``, ``'raw_weights'``, ``'other_source'`` (an entry of one of
    several sources whose variable restores from another), ``'lora_adapter'`` (a Keras
    ``lora_kernel_a``/``lora_kernel_b`` the checkpoint has no entry for: new by design). A missing record of a
    several-source restore that no source pattern takes: ``'no_source'``.

    ``source`` names the checkpoint a record comes from in a restore from several
    sources (``restorekit._sources``); None when there is one (``RestoreReport.checkpoint``).

    ``stored_name``/``stored_shape`` name the entry as the file stores it, where the
    source was read through a view that shows it under another name or shape
    (``layout='torch'``: ``conv1.weight [6, 3, 3, 3]`` is stored as ``conv1/weights
    [3, 3, 3, 6]``; a rule set such as ``'bert-tf-to-hf'``); None where they are the
    checkpoint's own.
    """

    variable_name: str | None
    checkpoint_name: str | None
    shape: tuple | None = None
    dtype: str | None = None
    checkpoint_shape: tuple | None = None
    checkpoint_dtype: str | None = None
    reason: str = ""
    checkpoint_path: str | None = None
    how: tuple = ()
    source: str | None = None
    stored_name: str | None = None
    stored_shape: tuple | None = None

    def describe(self) -> str:
        name = self.variable_name if self.variable_name is not None else (self.checkpoint_path or self.checkpoint_name)
        shape = self.shape if self.variable_name is not None else self.checkpoint_shape
        return f"{name} {format_shape(shape)}"


@dataclass(frozen=True)
class OptimizerRecord:
    """One parameter of the optimizer in a restore with ``optimizer=``: its state carried, or reset and why.

    ``parameter`` is the module's name for it (its ``state_dict`` key), ``slots`` the
    checkpoint entries read as the file stores them (``fc1/kernel/Adam``), ``state`` the
    target optimizer's state keys written (``exp_avg``, ``exp_avg_sq``, ``step``). A reset
    record's ``reason`` says why its state starts fresh and ``how`` says it as a word
    (``'no_slots'``, ``'missing'``, ``'mismatched'``, ``'policy'``, ``'not_restored'``,
    ``'not_in_module'``, ``'view'``, ``'slot_shape'``); a carried one's ``how`` is ``'carried'``.
    """

    parameter: str
    slots: tuple = ()
    state: tuple = ()
    reason: str = ""
    how: str = "carried"


@dataclass(frozen=True)
class OptimizerNote:
    """A hyper-parameter restorekit set so the next updates equal the source run's (``settings``), or a
    difference the target optimizer cannot express (``differences``): what, in words, and its size where
    one number says it (a relative difference of the update, or a factor)."""

    what: str
    text: str
    size: float | None = None


@dataclass(frozen=True)
class OptimizerSection:
    """The optimizer part of a report (``scan(..., optimizer=opt)``): what the target optimizer takes over.

    ``optimizer`` names the target (``'torch.optim.Adam'``), ``source`` the checkpoint's
    optimizer state (``'Adam (TF1)'``), ``step`` the steps the source run had taken as the
    target's ``step`` now says (``step_from``: what it was read from). ``carried`` and
    ``reset`` hold an :class:`OptimizerRecord` per parameter of the optimizer;
    ``settings`` the hyper-parameters set, ``differences`` what stays different and by how much;
    ``arguments`` the target optimizer's constructor arguments that make its next update the source's,
    where restorekit does not build it (``tf.compat.v1.train.AdamOptimizer(**arguments)``).
    """

    optimizer: str
    source: str
    step: int | None = None
    step_from: str = ""
    carried: tuple = ()
    reset: tuple = ()
    settings: tuple = ()
    differences: tuple = ()
    arguments: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    def lines(self) -> list:
        """The rows ``str(report)`` shows for it."""
        step = f", step {self.step} ({self.step_from})" if self.step is not None else ""
        out = [f"  optimizer  {self.optimizer} <- {self.source}{step}"]

        def shown(records, text) -> str:
            return ", ".join(text(r) for r in records[:4]) + (f", ... and {len(records) - 4} more" if len(records) > 4 else "")

        out.append("  " + summary_row("carried", len(self.carried), shown(self.carried, lambda r: r.parameter)))
        out.append("  " + summary_row("reset", len(self.reset), shown(self.reset, lambda r: f"{r.parameter} ({r.reason})")))
        if self.arguments:
            out.append("    arguments " + ", ".join(f"{k}={v!r}" for k, v in self.arguments.items()))
        out.extend(f"    set {n.what}: {n.text}" for n in self.settings)
        out.extend(f"    differs {n.what}: {n.text}" for n in self.differences)
        return out


_KINDS = ("matched", "missing", "shape_mismatched", "dtype_mismatched", "skipped", "unused")
# The words of Record.how: how a match was made, or why a record was skipped.
HOW_MATCHED = ("name", "rule", "assignment_map", "object_graph", "position", "readable_path", "ema", "ema_fallback",
               "policy")
HOW_SKIPPED = ("not_included", "excluded", "not_in_assignment_map", "optimizer", "counter", "rng", "ema_shadow",
               "raw_weights", "other_source", "no_source", "lora_adapter")
HOW = HOW_MATCHED + HOW_SKIPPED


@dataclass(frozen=True)
class RestoreReport:
    """The plan of a partial restore: every variable and every checkpoint entry, once.

    Fields hold tuples of ``Record``:

    * ``matched``: variables that will be restored from ``checkpoint_name``;
    * ``missing``: variables with no entry in the checkpoint;
    * ``shape_mismatched`` / ``dtype_mismatched``: an entry exists but does not fit;
    * ``skipped``: variables or entries left out on purpose, each with its reason
      (optimizer slot, global_step, excluded by a rule, EMA shadow or raw weights);
    * ``unused``: checkpoint entries nothing takes.

    ``hints`` suggests fixes for near misses. ``sources`` lists the checkpoints of a
    restore from several (each record's ``source`` names its own; ``checkpoint`` then
    joins them with ' + '); it is empty for one. A report is a value: it compares,
    pickles and serializes to JSON without the live variables it was made from.
    """

    checkpoint: str
    num_variables: int
    matched: tuple = ()
    missing: tuple = ()
    shape_mismatched: tuple = ()
    dtype_mismatched: tuple = ()
    skipped: tuple = ()
    unused: tuple = ()
    hints: tuple = ()
    sources: tuple = ()
    optimizer: OptimizerSection | None = None  # scan(..., optimizer=opt): the optimizer state taken over
    # variable_name -> live variable (or list of partitions). Private: used by
    # partial_saver/warm_start to find the very variables scanned; never compared,
    # pickled or serialized.
    _handles: dict | None = field(default=None, compare=False, repr=False)
    # variable_name -> shape policy ('slice_or_pad' or a callable) or VocabRemap, for
    # matched records whose value is computed rather than copied. Private like _handles.
    _policies: dict | None = field(default=None, compare=False, repr=False)
    # The opened source scan read (a Checkpoint, Keras file or layout view), so a restore
    # off TensorFlow reads the very entries planned. Private like _handles.
    _source: object = field(default=None, compare=False, repr=False)
    # The live plan of the optimizer state (restorekit._optim), for restore. Private like _handles.
    _optimizer: object = field(default=None, compare=False, repr=False)

    # -- values
    def source_of(self, record: Record) -> str:
        """The checkpoint ``record`` restores from: its ``source``, else the report's one checkpoint."""
        return record.source or self.checkpoint

    def by_source(self, records=None) -> dict:
        """``{checkpoint: [records]}`` of ``records`` (default: the matched ones), in the sources' order."""
        grouped: dict[str, list[Record]] = {}
        for r in self.matched if records is None else records:
            grouped.setdefault(self.source_of(r), []).append(r)
        return grouped

    @property
    def is_complete(self) -> bool:
        """True when every variable in scope has a fitting entry (skips by choice are fine)."""
        return not (self.missing or self.shape_mismatched or self.dtype_mismatched)

    def assert_complete(self) -> "RestoreReport":
        """Return self when complete, else raise IncompleteRestoreError carrying this report."""
        if self.is_complete:
            return self
        raise IncompleteRestoreError(self.incomplete_message(), self)

    def incomplete_message(self) -> str:
        problems = len(self.missing) + len(self.shape_mismatched) + len(self.dtype_mismatched)
        in_scope = problems + len(self.matched)
        lines = [f"{self.checkpoint!r} cannot restore {problems} of {in_scope} variables:"]
        shown = 0
        for r in self.missing:
            if shown < 20:
                looked = f"looked for {r.checkpoint_name!r}" if r.checkpoint_name is not None else r.reason
                lines.append(f"  missing     {r.variable_name} {format_shape(r.shape)} ({looked})")
            shown += 1
        for r in self.shape_mismatched:
            if shown < 20:
                lines.append(
                    f"  mismatched  {r.variable_name}: checkpoint {format_shape(r.checkpoint_shape)}, model {format_shape(r.shape)}"
                )
            shown += 1
        for r in self.dtype_mismatched:
            if shown < 20:
                lines.append(f"  mismatched  {r.variable_name}: checkpoint {r.checkpoint_dtype}, model {r.dtype}")
            shown += 1
        if shown > 20:
            lines.append(f"  ... and {shown - 20} more")
        lines.extend(f"  hint: {h}" for h in self.hints[:5])
        lines.append(
            f"Pass strict=False to restore the {len(self.matched)} that fit and initialize the rest."
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (shapes as lists)."""
        out = {"checkpoint": self.checkpoint, "num_variables": self.num_variables, "is_complete": self.is_complete}
        if self.sources:
            out["sources"] = list(self.sources)
        for kind in _KINDS:
            out[kind] = [
                {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(r).items()
                 if k != "source" or self.sources}
                for r in getattr(self, kind)
            ]
        out["by_position"] = [
            {"variable_name": r.variable_name, "checkpoint_name": r.checkpoint_name, "checkpoint_path": r.checkpoint_path}
            for r in self.by_position
        ]
        out["hints"] = list(self.hints)
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.to_dict()
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __getstate__(self):
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _LIVE}

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)
        for name in _LIVE:
            object.__setattr__(self, name, None)

    # -- reading
    @property
    def by_position(self) -> tuple:
        """Matched records paired with an entry saved under another name, by the object graph's order."""
        return tuple(r for r in self.matched if "position" in r.how)

    @property
    def matched_names(self) -> tuple:
        """Variable names that will be restored."""
        return tuple(r.variable_name for r in self.matched)

    def __str__(self) -> str:
        lines = [f"restorekit: {self.checkpoint} -> {self.num_variables} variables"]

        def row(label: str, records, detail: str) -> None:
            lines.append(summary_row(label, len(records), detail))

        def listing(records, limit: int = 4) -> str:
            text = ", ".join(r.describe() for r in records[:limit])
            return text + (f", ... and {len(records) - limit} more" if len(records) > limit else "")

        ema = Counter(part.split(":")[0].strip() for r in self.matched if r.reason for part in r.reason.split(";"))
        row("matched", self.matched, ", ".join(f"{n} via {k}" for k, n in ema.items()))
        row("missing", self.missing, listing(self.missing))
        def source(r) -> str:  # the entry's name, when it is not the variable's own
            name = r.checkpoint_path or r.checkpoint_name
            return "" if name == r.variable_name else f"{name} "

        mismatched = [
            f"{r.variable_name} (checkpoint {source(r)}{format_shape(r.checkpoint_shape)}, model {format_shape(r.shape)})"
            for r in self.shape_mismatched
        ] + [
            f"{r.variable_name} (checkpoint {source(r)}{r.checkpoint_dtype}, model {r.dtype})"
            for r in self.dtype_mismatched
        ]
        text = ", ".join(mismatched[:4]) + (f", ... and {len(mismatched) - 4} more" if len(mismatched) > 4 else "")
        row("mismatched", tuple(self.shape_mismatched) + tuple(self.dtype_mismatched), text)
        # a name skipped on both sides (the variable and its checkpoint entry) counts once
        reasons = Counter(reason for reason, _ in {(r.reason, r.variable_name or r.checkpoint_name) for r in self.skipped})
        ordered = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))  # ties in a fixed order
        row("skipped", range(sum(reasons.values())), ", ".join(f"{reason} ({n})" for reason, n in ordered))
        row("unused", self.unused, listing(self.unused))
        stored = [r for kind in _KINDS for r in getattr(self, kind) if r.stored_name is not None]
        if stored:
            shown = ", ".join(f"{r.checkpoint_name} {format_shape(r.checkpoint_shape)} <- {r.stored_name} "
                              f"{format_shape(r.stored_shape)}" for r in stored[:4])
            more = f", ... and {len(stored) - 4} more" if len(stored) > 4 else ""
            lines.append(f"  stored as: {shown}{more}")
        for prefix, records in self.by_source().items() if self.sources else ():
            lines.append(f"  from {prefix}: {len(records)} matched")
        lines.extend(
            f"  by position: {r.variable_name} <- {r.checkpoint_path or r.checkpoint_name}" for r in self.by_position[:20]
        )
        if len(self.by_position) > 20:
            lines.append(f"  ... and {len(self.by_position) - 20} more by position")
        fallback = [r.variable_name for r in self.matched if "ema_fallback" in r.how]
        if fallback:
            shown = ", ".join(fallback[:6]) + (f", ... and {len(fallback) - 6} more" if len(fallback) > 6 else "")
            lines.append(f"  ema fallback (no shadow entry, raw weights): {shown}")
        if self.optimizer is not None:
            lines.extend(self.optimizer.lines())
        lines.extend(f"  hint: {h}" for h in self.hints[:8])
        if len(self.hints) > 8:
            lines.append(f"  ... and {len(self.hints) - 8} more hints")
        return "\n".join(lines)


_LIVE = ("_handles", "_policies", "_source", "_optimizer")


def with_stored(records, stored_entry) -> tuple:
    """``records`` with the entry each reads as the file stores it (``Record.stored_name``/``stored_shape``), where
    ``stored_entry`` (a view's: name -> (stored name, stored shape) or None) shows it under another name or shape."""
    if stored_entry is None:
        return tuple(records)
    out = []
    for r in records:
        found = stored_entry(r.checkpoint_name) if r.checkpoint_name is not None else None
        if found is not None and (found[0] != r.checkpoint_name or tuple(found[1]) != tuple(r.checkpoint_shape or ())):
            r = replace(r, stored_name=found[0], stored_shape=tuple(found[1]))
        out.append(r)
    return tuple(out)


def live_handles(report) -> dict:
    """variable_name -> live variable of a report made by ``scan`` in this process.

    Raises:
        InvalidArgumentError: not a RestoreReport, or one that was unpickled or rebuilt.
    """
    if not isinstance(report, RestoreReport):
        raise InvalidArgumentError(f"expected a RestoreReport from restorekit.scan, got {type(report).__name__}")
    if report._handles is None:
        raise InvalidArgumentError(
            "this RestoreReport was unpickled or rebuilt and no longer knows its variables; "
            "call restorekit.scan again in the process that builds the graph"
        )
    return report._handles


def nothing_matched(report, what: str = "restore") -> NoMatchError:
    """The error for a report that matched nothing: its text carries the whole report, hints included."""
    return NoMatchError(f"nothing in {report.checkpoint!r} matched; there is nothing to {what}\n{report}")


def policy_of(report, variable_name: str):
    """The shape policy, cast or VocabRemap ``scan`` chose for ``variable_name``; None for a plain copy."""
    policies = report._policies if isinstance(report, RestoreReport) else None
    return (policies or {}).get(variable_name)


def plain_records(report) -> list:
    """Matched records restored by a plain copy (a Saver can take them): no shape policy or vocabulary."""
    return [r for r in report.matched if policy_of(report, r.variable_name) is None]
