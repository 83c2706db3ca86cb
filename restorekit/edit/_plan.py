"""The editor's plan: one frozen item per output tensor, and lookups of names in it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from restorekit._bundle.format import DT_BOOL, DT_COMPLEX64, DT_COMPLEX128, DT_STRING, FLOAT_DTYPES, numpy_dtype
from restorekit.errors import InvalidArgumentError, NameCollisionError, NoMatchError
from restorekit._names import matches, pattern_hint

STRING = DT_STRING
BOOL = DT_BOOL
FLOATS = FLOAT_DTYPES
COMPLEX = frozenset({DT_COMPLEX64, DT_COMPLEX128})
ATTRIBUTES = "/.ATTRIBUTES/"


@dataclass(frozen=True)
class Item:
    """One tensor of the output. Frozen: an edit makes a new item, so ``concat`` snapshots stay valid."""

    origin: str | None  # source checkpoint name this tensor started from (None: added)
    dtype: int
    shape: tuple
    base: np.ndarray | Concat | Callable[[], np.ndarray] | None = None  # None: the origin's stored bytes; ndarray: a given value; callable: computed
    ops: tuple = ()  # array -> array functions applied to the base, in order
    cast: int | None = None  # a cast of the origin's bytes, streamed on save

    @property
    def stored(self) -> bool:
        """True when the output bytes are the origin's bytes, unchanged."""
        return self.base is None and not self.ops and self.cast is None

    @property
    def read_name(self) -> str:
        """The source tensor an item reads (one with ``base`` None): only added items lack an origin, and they
        always have a base."""
        assert self.origin is not None, "an added item has no source tensor to read"
        return self.origin


@dataclass(frozen=True)
class Concat:
    """The base of a ``concat`` result: its input items (snapshots) and the axis."""

    items: tuple
    axis: int


def initial_plan(checkpoint) -> dict[str, Item]:
    """Every entry of ``checkpoint``, unchanged, in entry order."""
    plan = {}
    for name in checkpoint:
        entry = checkpoint.bundle_entry(name)
        plan[name] = Item(origin=name, dtype=entry.dtype, shape=tuple(entry.shape))
    return plan


def nbytes(item: Item, checkpoint) -> int:
    """The bytes ``item`` takes in a data shard (for a computed string tensor: its source's size)."""
    if item.stored:
        return checkpoint[item.origin].nbytes
    if item.dtype == STRING:
        if isinstance(item.base, np.ndarray) and not item.ops:
            return string_nbytes(item.base)
        return checkpoint[item.origin].nbytes if item.origin is not None else 0
    return math.prod(item.shape) * numpy_dtype(item.dtype).itemsize


def string_nbytes(array: np.ndarray) -> int:
    """Size of a string tensor in a data shard: a varint length per element, a 4-byte crc, the bytes."""
    total = 4
    for value in array.reshape(-1):
        n = len(value.encode("utf-8") if isinstance(value, str) else value)
        total += n + max(1, (n.bit_length() + 6) // 7)
    return total


def lookup(plan: dict[str, Item], name, prefix: str) -> Item:
    """The item of ``name``, or NoMatchError with the closest names."""
    if not isinstance(name, str) or name not in plan:
        raise NoMatchError(f"{prefix!r} (as edited) has no entry {name!r}.", name=str(name), candidates=plan)
    return plan[name]


def check_new_name(plan: dict[str, Item], name, prefix: str) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"a checkpoint name is a non-empty str, got {name!r}")
    if name in plan:
        raise NameCollisionError(f"{name!r} already exists in {prefix!r} (as edited); delete it first")


def select(plan: dict[str, Item], pattern, *, what: str, prefix: str, key=None) -> list[str]:
    """Exact names first; otherwise the ``names.matches`` pattern rule. Never empty.

    ``key`` maps a name that is not in the plan to the key it stands for (a TF2
    readable path); it is asked only when no entry matches the pattern.
    """
    patterns = [pattern] if isinstance(pattern, str) or hasattr(pattern, "pattern") else list(pattern)
    found: list[str] = []
    for p in patterns:
        hits = _hits(plan, p, key)
        if not hits:
            text = getattr(p, "pattern", p)
            hint = pattern_hint(text, plan) if isinstance(text, str) else ""
            raise NoMatchError(f"{what} {text!r} matches no entry of {prefix!r}.{hint}", name=str(text), candidates=plan)
        found += [h for h in hits if h not in found]
    return found


def _hits(plan: dict[str, Item], pattern, key) -> list[str]:
    if isinstance(pattern, str) and pattern in plan:
        return [pattern]
    hits = [n for n in plan if matches(pattern, n)]
    if not hits and isinstance(pattern, str) and key is not None:
        found = key(pattern)
        if found in plan:
            return [found]  # a TF2 readable path, when no key matches it as a pattern
    return hits
