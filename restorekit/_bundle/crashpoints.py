"""Named points in every writer where a kill -9 test pauses the process to kill it there.

Call ``crashpoints.crash_point(...)`` through the module, never a copy of the name: tests and
``benchmarks/kill_harness.py`` replace ``crashpoints.crash_point`` to trace or pause a writer.
"""

from __future__ import annotations

import os
import time

__all__ = ["CRASH_HOOK_ENV", "CRASH_RANK_ENV", "crash_point"]

# Tests set this to a point name; the process then pauses there so it can be killed.
CRASH_HOOK_ENV = "RESTOREKIT_CRASH_HOOK"
# With several ranks writing one output (each with the same environment): only the rank whose
# $RANK this names stops at the point.
CRASH_RANK_ENV = "RESTOREKIT_CRASH_RANK"


def crash_point(point: str) -> None:
    """Pause at ``point`` when ``$RESTOREKIT_CRASH_HOOK`` names it (kill -9 tests).

    The hook value is ``point:marker_path``; the marker file is created when the point
    is reached, then the process sleeps until it is killed (a signal with a Python handler, such as
    ``interrupts.terminate_cleanly``'s SIGTERM, is handled within 0.05 s). The marker ``raise``
    raises a ``RuntimeError`` there instead (a failure, not a kill). ``$RESTOREKIT_CRASH_RANK``
    limits the hook to the process whose ``$RANK`` it names.
    """
    spec = os.environ.get(CRASH_HOOK_ENV)
    if not spec:
        return
    name, _, marker = spec.partition(":")
    if name != point:
        return
    rank = os.environ.get(CRASH_RANK_ENV)
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    if marker == "raise":
        raise RuntimeError(f"failure injected at {point!r} by ${CRASH_HOOK_ENV}")
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    # Short naps, not one long sleep: a signal that lands just before a sleep's system call (its C
    # handler has run, the Python one waits for the next bytecode) is otherwise seen when the sleep ends.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.05)
