"""A pytest plugin: skipped tests summed up by reason, one line each, instead of one line per test.

Where torch cannot be imported about 200 cases skip for that one reason; a line for each
reads like a wall of failures. The default run (pyproject's ``-rfExX``) lists failures,
errors and xfails per test as before and, at the end, every skip reason once with its
count and one place it skipped. ``-rs`` (or ``-ra``) asks for the per-test lines back, and
then this summary steps aside.
"""

from __future__ import annotations

import os
from collections import Counter


def _reason(report, root) -> tuple[str, str]:
    if isinstance(report.longrepr, tuple):  # (path, lineno, "Skipped: reason")
        path, lineno, text = report.longrepr
        path = os.path.relpath(path, root) if os.path.isabs(path) else path
        where = f"{path}:{lineno + 1}" if lineno is not None else str(path)
    else:
        text, where = str(report.longrepr), report.nodeid
    return text.removeprefix("Skipped: "), where


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    chars = config.getoption("reportchars") or ""
    if "s" in chars or "a" in chars.replace("N", "") or "A" in chars:
        return  # per-test skip lines were asked for
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    counts: Counter[str] = Counter()
    first: dict[str, str] = {}
    for report in skipped:
        text, where = _reason(report, config.rootpath)
        counts[text] += 1
        first.setdefault(text, where)
    terminalreporter.write_sep("=", f"{len(skipped)} skipped, by reason (-rs lists each)")
    for text, count in counts.most_common():
        terminalreporter.write_line(f"{count:5d} skipped: {text}  (e.g. {first[text]})")
