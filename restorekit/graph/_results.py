"""What the graph verbs return: plain, printable values (summaries, converted constants, alignments)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from restorekit.errors import format_names
from restorekit._names import is_global_step
from restorekit._report import format_bytes, format_shape

__all__ = ["Alignment", "ConvertedConstant", "GraphSummary", "TensorSummary", "UnfreezeResult", "VariableSummary"]

# How summaries print a shape of unknown rank.
_UNKNOWN_RANK = "<unknown>"


def _table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


@dataclass(frozen=True)
class TensorSummary:
    """One input or output tensor.

    ``name`` is the tensor name (``'x:0'``); ``shape`` is a tuple with ``None`` for an
    unknown dimension, or ``None`` for an unknown rank. For a SavedModel signature,
    ``signature`` and ``key`` say where the tensor appears.
    """

    name: str
    dtype: str
    shape: tuple | None
    op: str
    signature: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class VariableSummary:
    """One variable in a graph.

    ``name`` is the variable name (graph node); ``checkpoint_name`` the key a checkpoint
    holds it under when that differs (TF2 object paths, partitioned variables).
    ``slot`` names the optimizer for optimizer slots, else ``None``; ``ema_shadow`` marks
    an ExponentialMovingAverage shadow (``w/ExponentialMovingAverage``).
    """

    name: str
    shape: tuple | None
    dtype: str
    op: str
    trainable: bool | None = None
    slot: str | None = None
    checkpoint_name: str | None = None
    ema_shadow: bool = False


@dataclass(frozen=True)
class GraphSummary:
    """What ``inspect_graph`` found: a value, printable as a table and convertible to JSON.

    ``op_counts`` counts node types in the graph and in its function library;
    ``const_bytes`` is the size of all ``Const`` values there. ``repaired`` says what was
    changed so that the graph loads in this TensorFlow, and why. ``unknown_ops`` lists
    op types this TensorFlow does not know (the graph cannot be loaded while they remain).
    """

    source: str
    kind: str
    node_count: int
    inputs: tuple[TensorSummary, ...]
    outputs: tuple[TensorSummary, ...]
    variables: tuple[VariableSummary, ...]
    op_counts: dict
    const_bytes: int
    repaired: tuple[str, ...] = ()
    unknown_ops: tuple[str, ...] = ()
    signatures: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """Plain JSON-ready data (lists for tuples, ``None`` for unknown dimensions)."""

        def plain(value):
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if dataclasses.is_dataclass(value):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return value

        return plain(self)

    def __str__(self) -> str:
        slots = sum(1 for v in self.variables if v.slot)
        total = sum(
            int(np.prod(v.shape))
            for v in self.variables
            if v.shape is not None and None not in v.shape and not v.slot and not v.ema_shadow
            and not is_global_step(v.name)
        )
        shadows = sum(1 for v in self.variables if v.ema_shadow)
        lines = [f"restorekit: {self.source} ({self.kind}, {self.node_count} nodes)"]

        def tensor_rows(tensors):
            return [
                (
                    t.name if t.signature is None else f"{t.signature}[{t.key!r}] {t.name}",
                    t.dtype,
                    format_shape(t.shape, _UNKNOWN_RANK),
                    t.op,
                )
                for t in tensors
            ]

        lines.append(f"inputs     {len(self.inputs)}")
        lines += _table(tensor_rows(self.inputs))
        lines.append(f"outputs    {len(self.outputs)}")
        lines += _table(tensor_rows(self.outputs))
        notes = [f"{slots} optimizer slots"] * bool(slots) + [f"{shadows} EMA shadows"] * bool(shadows)
        detail = f"   ({', '.join(notes)})" if notes else ""
        lines.append(f"variables  {len(self.variables)}{detail}, {total} model parameters")
        lines += _table(
            [
                (v.name, v.dtype, format_shape(v.shape, _UNKNOWN_RANK),
                 v.op + (f" slot of {v.slot}" if v.slot else "") + (" EMA shadow" if v.ema_shadow else ""))
                for v in self.variables
            ]
        )
        counts = ", ".join(f"{op} {n}" for op, n in list(self.op_counts.items())[:12])
        more = f", ... and {len(self.op_counts) - 12} more" if len(self.op_counts) > 12 else ""
        lines.append(f"ops        {len(self.op_counts)} types: {counts}{more}")
        lines.append(f"constants  {format_bytes(self.const_bytes)}")
        if self.unknown_ops:
            lines.append(f"unknown    {format_names(self.unknown_ops)} (not registered in this TensorFlow)")
        for note in self.repaired:
            lines.append(f"repaired   {note}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ConvertedConstant:
    """A weight constant that ``unfreeze`` wrote: frozen node -> checkpoint name."""

    node: str
    name: str
    shape: tuple
    dtype: str
    # 'variable' (VariableV2), 'resource' (TF1 VarHandleOp), 'resource (TF2)' (a captured
    # handle; the node name is not the variable's: pass a reference), 'large' or 'chosen'.
    pattern: str
    # One part of a partitioned variable ('emb/part_1'): saved, as a Saver does, as a
    # slice of ``full_name`` (shape ``full_shape``) starting at ``offset``.
    full_name: str | None = None
    full_shape: tuple | None = None
    offset: tuple | None = None

    @property
    def checkpoint_name(self) -> str:
        return self.full_name or self.name


@dataclass(frozen=True)
class Alignment:
    """How one converted constant was named against the reference."""

    old: str
    new: str
    reason: str


@dataclass(frozen=True)
class UnfreezeResult:
    """What ``unfreeze`` wrote."""

    checkpoint: str
    meta_graph: str | None
    converted: tuple[ConvertedConstant, ...]
    aligned: tuple[Alignment, ...] = ()

    def __str__(self) -> str:
        total = sum(int(np.prod(c.shape)) for c in self.converted)
        lines = [f"restorekit: {len(self.converted)} constants ({total} values) -> {self.checkpoint}"]
        lines += _table(
            [
                (
                    c.name,
                    c.dtype,
                    format_shape(c.shape, _UNKNOWN_RANK),
                    c.pattern + (f", slice of {c.full_name!r} {format_shape(c.full_shape, _UNKNOWN_RANK)}" if c.full_name else ""),
                )
                for c in self.converted
            ]
        )
        renamed = [a for a in self.aligned if a.old != a.new]
        if self.aligned:
            lines.append(f"aligned    {len(self.aligned) - len(renamed)} kept, {len(renamed)} renamed")
            lines += _table([(a.old, "->", a.new, a.reason) for a in renamed])
        if self.meta_graph:
            lines.append(f"trainable graph -> {self.meta_graph}")
        return "\n".join(lines)

