"""SIGTERM during a write (bundle/interrupts.py): the write's own cleanup runs, then the process ends by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from restorekit._bundle import atomic
from restorekit._bundle.locking import output_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from restorekit._bundle import atomic
out = sys.argv[2]
with atomic.atomic_output(out) as tmp:
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
        atomic.write_bytes(str(tmp_path / "c.bin"), b"x")

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    assert in_thread == [signal.SIG_DFL] and (tmp_path / "c.bin").read_bytes() == b"x"
