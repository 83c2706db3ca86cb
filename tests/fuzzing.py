"""What the fuzz harnesses share: byte mutations (test_fuzz_export, test_fuzz_graph, test_fuzz_keras),
and the child-process runner of the harnesses that run their cases in a child process (graph, keras).

A test file runs itself as a script (``python tests/test_fuzz_X.py DIR START``); its
``worker`` calls ``run_cases``, which prints one JSON line per case start and outcome.
The test calls ``run_all``, which restarts the child after the case that killed it (a
crash in native code is a finding, named, not the end of the run). Each case is timed
out by SIGALRM (a hang guard, not a speed bar) and has its own peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

MARK = "FUZZCASE "

# ------------------------------------------------------------------ byte mutations (seeded: the corpus is fixed)


def flip(rng, data: bytes, most: int = 4) -> bytes:
    """Flip one bit in each of 1..``most`` random bytes."""
    data = bytearray(data)
    for _ in range(rng.randint(1, most)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def truncate(rng, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))]


OVERWRITE_FILLS = (b"\xff", b"\x00", b"\x7f", b"\x80")


def overwrite(rng, data: bytes, fills=OVERWRITE_FILLS, longest: int = 12) -> bytes:
    """Overwrite a run of 1..``longest`` bytes with one of ``fills`` or a random byte."""
    data = bytearray(data)
    start = rng.randrange(len(data))
    fill = rng.choice([*fills, bytes([rng.randrange(256)])])
    for i in range(start, min(len(data), start + rng.randint(1, longest))):
        data[i] = fill[0]
    return bytes(data)


# ------------------------------------------------------------------ the child-process runner


class Hang(Exception):
    pass


def on_alarm(signum, frame):
    """The SIGALRM handler: a case past its time raises Hang where it is."""
    raise Hang()


def peak_rss(reset: bool = False) -> int:
    """The process's peak resident memory in bytes; ``reset`` starts a new peak (Linux), so each case has its own."""
    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))
    except OSError:  # not Linux: the peak since the process started
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def _report(**fields) -> None:
    sys.stdout.write(MARK + json.dumps(fields) + "\n")
    sys.stdout.flush()


def _where(error) -> str:
    """The innermost restorekit frame a foreign exception passed through: where to fix it."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/restorekit/" in f.filename]
    return f"at {frames[-1].filename.rsplit('/restorekit/', 1)[1]}:{frames[-1].lineno}" if frames else ""


def run_cases(cases: list, start: int, case_seconds: int, run_one) -> None:
    """In the child: ``run_one(index, case)`` for every case from ``start`` (a case's first item is its name).

    Outcomes: ``ok``, ``error`` (a RestoreKitError), ``hang``, or ``foreign TYPE at FILE:LINE: text``.
    """
    from restorekit.errors import RestoreKitError

    _report(total=len(cases), rss=peak_rss(reset=True))
    signal.signal(signal.SIGALRM, on_alarm)
    for index in range(start, len(cases)):
        name = cases[index][0]
        _report(start=index, name=name)
        peak_rss(reset=True)
        signal.alarm(case_seconds)
        try:
            run_one(index, cases[index])
            outcome = "ok"
        except RestoreKitError:
            outcome = "error"
        except Hang:
            outcome = "hang"
        except BaseException as e:  # noqa: BLE001 - the point: no other type may escape
            outcome = f"foreign {type(e).__name__} {_where(e)}: {str(e)[:200]}"
        finally:
            signal.alarm(0)
        _report(case=index, name=name, outcome=outcome, rss=peak_rss())


def _run_child(script: str, directory, start: int, env: dict) -> tuple[list, object]:
    import restorekit

    root = os.path.dirname(os.path.dirname(os.path.abspath(restorekit.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    try:
        done = subprocess.run([sys.executable, os.path.abspath(script), str(directory), str(start)], env=env,
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=600)
        stdout, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        stdout, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or "", "timeout"
    return [json.loads(line[len(MARK):]) for line in stdout.splitlines() if line.startswith(MARK)], code


def run_all(script: str, directory, env: dict | None = None) -> tuple[int, int, list, list]:
    """In the test: run ``script``'s worker over every case, restarting it after a case that killed it.

    Returns ``(total cases, baseline RSS, finished case lines, failures)``; a failure is a
    case whose outcome is neither ``ok`` nor ``error``, or one during which the child died.
    """
    finished, failures, start, total, base_rss = [], [], 0, None, None
    while total is None or start < total:
        lines, code = _run_child(script, directory, start, env or {})
        started = None
        for line in lines:
            if "total" in line:
                total, base_rss = line["total"], base_rss or line["rss"]
            elif "start" in line:
                started = line
            else:
                started = None
                finished.append(line)
                if line["outcome"].split()[0] not in ("ok", "error"):
                    failures.append(f"{line['name']}: {line['outcome']}")
        if started is None:
            assert code == 0 and total is not None, f"the fuzz worker failed outside any case (exit {code})"
            break
        failures.append(f"{started['name']}: the worker died (exit {code})")
        start = started["start"] + 1
    return total, base_rss, finished, failures


def outcome_counts(finished: list) -> dict:
    counts: dict = {}
    for line in finished:
        kind = line["outcome"].split()[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts
