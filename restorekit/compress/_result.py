"""CompressResult: what ``compress`` wrote and how far the outputs moved, as a value and a table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from restorekit._report import format_bytes

__all__ = ["CompressResult"]


@dataclass(frozen=True)
class CompressResult:
    """What ``compress`` wrote and how far the compressed outputs moved from the original.

    ``max_abs_error[name]`` is the largest ``|original - compressed|`` over every element
    of every sample; ``max_rel_error[name]`` is that divided by the largest ``|original|``
    (the error as a fraction of the output's range, which stays meaningful where single
    elements are near zero). Latencies are the mean milliseconds per sample on this
    machine (one warm-up run first); a value, not a benchmark. ``next_step`` is what remains
    before the model runs where it is meant to (for ``backend='tensorrt'``, the engine build on
    the target GPU, which restorekit does not do); empty when nothing does.
    """

    source: str
    out: str
    backend: str
    precision: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    size_before: int
    size_after: int
    max_abs_error: dict = field(default_factory=dict)
    max_rel_error: dict = field(default_factory=dict)
    latency_before_ms: float = 0.0
    latency_after_ms: float = 0.0
    samples: int = 0
    sample_source: str = "random"
    next_step: str = ""

    @property
    def ratio(self) -> float:
        """Size after / size before."""
        return self.size_after / self.size_before if self.size_before else math.nan

    @property
    def max_error(self) -> float:
        """The largest absolute error over all outputs."""
        return max(self.max_abs_error.values(), default=0.0)

    def to_dict(self) -> dict:
        """Plain JSON-ready data."""
        return {
            "source": self.source, "out": self.out, "backend": self.backend, "precision": self.precision,
            "inputs": list(self.inputs), "outputs": list(self.outputs),
            "size_before": self.size_before, "size_after": self.size_after, "ratio": self.ratio,
            "max_abs_error": dict(self.max_abs_error), "max_rel_error": dict(self.max_rel_error),
            "latency_before_ms": self.latency_before_ms, "latency_after_ms": self.latency_after_ms,
            "samples": self.samples, "sample_source": self.sample_source, "next_step": self.next_step,
        }

    def __str__(self) -> str:
        head = (f"restorekit: {self.source} -> {self.out} ({self.backend} {self.precision}, "
                f"{self.samples} {self.sample_source} samples)")
        rows = [
            ("", "original", "compressed", ""),
            ("size", format_bytes(self.size_before), format_bytes(self.size_after), f"{self.ratio:.2f}x"),
            ("latency", f"{self.latency_before_ms:.3f} ms", f"{self.latency_after_ms:.3f} ms", "per sample"),
        ]
        errors = [("output", "max abs error", "max rel error", "")]
        errors += [(name, f"{self.max_abs_error[name]:.3g}", f"{self.max_rel_error[name]:.3g}", "")
                   for name in self.outputs]
        lines = [head]
        for block in (rows, errors):
            widths = [max(len(r[i]) for r in rows + errors) for i in range(4)]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in block]
        if self.next_step:
            lines.append(f"  next: {self.next_step}")
        return "\n".join(lines)
