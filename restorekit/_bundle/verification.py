"""What a verify found, as values: ``Problem`` and ``VerifyResult``, shared by TF checkpoints and Keras files."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Problem", "VerifyResult"]


@dataclass(frozen=True)
class Problem:
    """One entry that fails verification: ``kind`` is 'checksum' (bytes changed) or 'corrupt'."""

    name: str
    kind: str
    message: str


@dataclass(frozen=True)
class VerifyResult:
    """What ``Checkpoint.verify`` checked and found. ``ok`` when ``problems`` is empty; ``checks`` says
    what the format lets verify check, where that is less than a checksum of every tensor."""

    prefix: str
    tensors: int
    nbytes: int
    problems: tuple = ()
    checks: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = f"{self.prefix!r}: {self.tensors} tensors, {self.nbytes} bytes checked"
        note = f"\n  note: {self.checks}" if self.checks else ""
        if self.ok:
            return f"{head}: ok{note}"
        lines = [f"{head}: {len(self.problems)} with problems"]
        lines += [f"  {p.kind:<9} {p.name}: {p.message}" for p in self.problems[:20]]
        if len(self.problems) > 20:
            lines.append(f"  ... and {len(self.problems) - 20} more")
        return "\n".join(lines) + note
