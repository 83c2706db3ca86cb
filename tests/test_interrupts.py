"""SIGTERM during a write (bundle/interrupts.py): the write's own cleanup runs, then the process ends by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from restorekit._bundle import crashpoints
from restorekit._bundle.locking import output_lock
from restorekit._bundle.staging import write_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from restorekit._bundle.staging import atomic_output
out = sys.argv[2]
with atomic_output(out) as tmp:
    with open(tmp, "wb") as f:
        f.write(b"half a file")
    os.kill(os.getpid(), signal.SIGTERM)  # as if sent by another process in the middle of the write
    print("not reached", flush=True)
print("not reached either", flush=True)
"""


def test_sigterm_inside_a_write_leaves_nothing_and_still_ends_the_process(tmp_path):
    out = tmp_path / "d" / "model.pb"
    proc = subprocess.run([sys.executable, "-c", CHILD, ROOT, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "not reached" not in proc.stdout
    assert not (tmp_path / "d").exists()  # no temporary, no lock file, not even the directory made for it


def test_an_applications_own_sigterm_handler_is_left_alone(tmp_path):
    seen = []

    def handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with output_lock(tmp_path / "x.bin"):
            assert signal.getsignal(signal.SIGTERM) is handler
            os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_handler_is_installed_only_for_the_write_and_only_in_the_main_thread(tmp_path):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with output_lock(tmp_path / "a.bin"):
        inside = signal.getsignal(signal.SIGTERM)
        with output_lock(tmp_path / "b.bin"):  # nested: the outer one's handler stays
            assert signal.getsignal(signal.SIGTERM) is inside
        assert signal.getsignal(signal.SIGTERM) is inside
    assert inside is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    in_thread = []

    def write():
        with output_lock(tmp_path / "c.bin"):
            in_thread.append(signal.getsignal(signal.SIGTERM))
        write_bytes(str(tmp_path / "c.bin"), b"x")

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    assert in_thread == [signal.SIG_DFL] and (tmp_path / "c.bin").read_bytes() == b"x"


# The handler's own frames (found as the installed SIGTERM handler, so whatever it calls), and the
# functions of the cleanup: the child sends itself a second SIGTERM at the chosen moment, as a supervisor
# sending SIGTERM twice would (GNU ``timeout`` signals the command, then its process group).
SECOND = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from restorekit._bundle.staging import atomic_output
out, where = sys.argv[2], sys.argv[3]
sent = []

def second_sigterm():
    sent.append(where)
    os.kill(os.getpid(), signal.SIGTERM)

def in_handler(frame, n):
    # the n-th line run by the SIGTERM handler or a function it calls (its depth: 0 or 1)
    lines = [0]
    handler = signal.getsignal(signal.SIGTERM).__code__
    def trace(frame, event, arg):
        inside = frame.f_code is handler or (frame.f_back is not None and frame.f_back.f_code is handler)
        if not inside:
            return None
        def local(frame, event, arg):
            if event == "line" and not sent:
                lines[0] += 1
                if lines[0] == n:
                    second_sigterm()
            return local
        return local(frame, event, arg)
    return trace

def in_cleanup(name):
    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == name and not sent:
            sys.settrace(None)
            second_sigterm()
        return None
    return trace

with atomic_output(out) as tmp:
    with open(tmp, "wb") as f:
        f.write(b"half a file")
    if where.startswith("handler-line-"):
        sys.settrace(in_handler(None, int(where.rsplit("-", 1)[1])))
    else:
        sys.settrace(in_cleanup(where))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("not reached", flush=True)
"""


@pytest.mark.parametrize("where", ["handler-line-1", "handler-line-2", "handler-line-3", "_release", "_leave"])
def test_a_second_sigterm_neither_hangs_nor_cuts_the_cleanup_short(tmp_path, where):
    # While the first SIGTERM's handler runs (it once took a lock a second handler call then waited on
    # forever), or while the cleanup it started removes the lock file: the cleanup still ends, nothing is
    # left, and the process still ends by SIGTERM.
    out = tmp_path / "d" / "model.pb"
    try:
        proc = subprocess.run([sys.executable, "-c", SECOND, ROOT, str(out), where], capture_output=True, text=True,
                              timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a second SIGTERM at {where} left the writer hanging")
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "not reached" not in proc.stdout
    assert not (tmp_path / "d").exists(), sorted(os.listdir(tmp_path / "d"))


# A writer paused at a crash point (kill tests) when SIGTERM's C-level handler runs while the main thread
# cannot be interrupted: here another thread takes the signal (the main thread blocks it), as when it lands
# between the main thread's last bytecode and its sleep's system call (seen once in 200 trials under load).
PAUSED = r"""
import signal, sys, threading
sys.path.insert(0, sys.argv[1])
from restorekit._bundle.staging import atomic_output
idle = threading.Event()
threading.Thread(target=idle.wait, daemon=True).start()  # SIGTERM unblocked: the kernel delivers it here
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
with atomic_output(sys.argv[2]) as tmp:
    with open(tmp, "wb") as f:
        f.write(b"half a file")
print("not reached", flush=True)
"""


def _main_thread_sleeping(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "S"
    except OSError:  # no /proc: the pause is under way once its marker holds the pid
        return True


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs pthread_sigmask")
def test_a_sigterm_the_main_thread_is_told_of_late_still_ends_a_paused_writer(tmp_path):
    out, marker = tmp_path / "d" / "model.pb", tmp_path / "reached"
    env = dict(os.environ, **{crashpoints.CRASH_HOOK_ENV: f"before-replace:{marker}"})
    proc = subprocess.Popen([sys.executable, "-c", PAUSED, ROOT, str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(6000):  # the child reaches the point within a minute, or fails
            if (marker.exists() and marker.read_text() == str(proc.pid) and _main_thread_sleeping(proc.pid)
                    or proc.poll() is not None):
                break
            threading.Event().wait(0.01)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the writer paused at a crash point did not end after SIGTERM")
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGTERM, stderr
    assert "not reached" not in stdout
    assert not (tmp_path / "d").exists()
