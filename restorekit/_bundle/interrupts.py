"""SIGTERM during a write: the same cleanup as Ctrl-C, then the process ends as SIGTERM ends it.

SIGTERM's default action ends the process at once: a write cut there leaves its lock
file, its staged files and its journal for the next write's sweep. ``terminate_cleanly``
(taken by ``output_lock`` for the whole of every write) turns a SIGTERM that arrives
meanwhile into an exception, ``Terminated``, so the write's own cleanup runs (the staged
files removed, what no index names removed before the journal goes, the lock released), as
for a ``KeyboardInterrupt``; then the previous handler is put back and the signal sent
again, so the process ends with SIGTERM's status, as it would have. Only in the main
thread (the only one that can set a handler) and only while SIGTERM has its default
action: an application's own handler, or an ignored SIGTERM, is left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

__all__ = ["Terminated", "terminate_cleanly"]


class Terminated(BaseException):
    """SIGTERM arrived during a write (raised by the handler ``terminate_cleanly`` installs; never caught as an error)."""


_received = threading.Event()


def _raise_terminated(signum, frame):
    _received.set()
    raise Terminated(f"signal {signum} (SIGTERM) during a write")


@contextlib.contextmanager
def terminate_cleanly():
    """For the duration of the block, a SIGTERM raises ``Terminated`` in the main thread; at the end of
    the block (the cleanup done) the previous handler is restored and SIGTERM re-sent to this process."""
    install = (hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    if not install:
        yield
        return
    _received.clear()
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if _received.is_set():  # even if something caught Terminated and raised another error
            os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends here
