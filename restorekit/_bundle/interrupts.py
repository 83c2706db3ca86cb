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

A second SIGTERM while the first one's cleanup runs (a supervisor that signals twice: GNU
``timeout`` signals the command, then its process group) is taken in and changes nothing: it
neither cuts that cleanup short (a lock file left) nor, arriving inside the handler itself,
waits on anything the first call holds (the handler takes no lock), and the process still ends
by SIGTERM once the cleanup is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

__all__ = ["Terminated", "terminate_cleanly"]


class Terminated(BaseException):
    """SIGTERM arrived during a write (raised by the handler ``terminate_cleanly`` installs; never caught as an error)."""


# Set by the handler, only ever in the main thread: a plain flag, no lock (a handler that took one
# could be re-entered by a second SIGTERM while holding it, and wait forever).
_received = False


def _raise_terminated(signum, frame):
    global _received
    if _received:
        return  # the cleanup of the first SIGTERM is running (or the block goes on): it is not cut short
    _received = True
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
    global _received
    _received = False
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if _received:  # even if something caught Terminated and raised another error
            os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends here
