"""Copies of stored tensor bytes into an export: from TF data shards, crc32c checked on the way, or unchecked ranges.

The fast paths of the exporters: ``copy_raw_run`` has the kernel copy a run of
tensors lying back to back in a shard (``copy_file_range``) while this thread checks
each tensor's crc32c from the page cache; ``copy_raw`` copies one tensor through a
buffer. Used by every format that stores a tensor's bytes as TF does.
``copy_unchecked_run`` copies ``UncheckedRange``s, bytes of files that keep no checksum
(Keras ``.h5`` datasets), by the same kernel path without a check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from restorekit._bundle import files
from restorekit.errors import ChecksumMismatchError, CorruptCheckpointError

__all__ = ["UncheckedRange", "copy_raw", "copy_raw_run", "copy_unchecked_run", "write_all"]


@dataclass(frozen=True)
class UncheckedRange:
    """A tensor's bytes as they lie in a file that keeps no checksum of them: ``size`` bytes at ``offset`` of ``path``.

    The writers plan with it as with a TF shard entry (``shard_id``, ``offset``, ``size``);
    ``shard_id`` is 0, one source file.
    """

    path: str
    offset: int
    size: int
    shard_id: int = 0


def _shard(checkpoint, name: str, entry, handles: dict):
    """The open data shard holding ``entry`` (a regular file: a FIFO would block, a device read without end),
    checked to hold the entry's bytes before anything is read (a corrupt offset such as 2**63 must not reach
    ``preadv``)."""
    path = checkpoint.data_file(entry.shard_id)
    if path not in handles:
        try:
            handles[path] = files.open_regular(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data shard {path!r} for {name!r} is missing") from None
    _check_bounds(path, handles[path].fileno(), name, entry)
    return path, handles[path]


def _check_bounds(path: str, fd: int, name: str, entry) -> None:
    length = os.fstat(fd).st_size
    if entry.offset < 0 or entry.size < 0 or entry.offset + entry.size > length:
        raise CorruptCheckpointError(
            f"data shard {path!r} is truncated or the index is corrupt: {name!r} needs bytes "
            f"{entry.offset}..{entry.offset + entry.size} of its {length}"
        )


def _check(crc, name: str, entry, path: str) -> None:
    from restorekit._bundle.table import mask_crc

    if crc is None:
        raise CorruptCheckpointError(
            f"data shard {path!r} is truncated: {name!r} needs bytes {entry.offset}..{entry.offset + entry.size}"
        )
    if mask_crc(crc) != entry.crc32c:
        raise ChecksumMismatchError(f"{name!r}: tensor bytes in {path!r} fail their crc32c check; the data shard is corrupt")


def copy_raw(checkpoint, name: str, entry, out, handles: dict, bar=None) -> None:
    """Copy one tensor's bytes from its data shard to ``out`` (``.write``), checking crc32c.

    One pass through a reused cache-sized buffer (``bundle.writer.copy_checked``): each
    byte is read once, then checked and written from the CPU cache.
    """
    from restorekit._bundle.writer import copy_checked

    path, shard = _shard(checkpoint, name, entry, handles)

    def write(view) -> None:
        write_all(out, view)
        if bar is not None:
            bar.update(len(view))

    _check(copy_checked(shard.fileno(), entry.offset, entry.size, write), name, entry, path)


def copy_raw_run(checkpoint, run: list, out, handles: dict, bar=None) -> None:
    """Copy stored tensors that lie back to back in one shard, the way ``cp`` copies a file.

    The kernel copies the whole byte range (``os.copy_file_range``, in a thread: the
    call releases the GIL) while this thread checks every tensor's crc32c from the page
    cache, so the check costs no time beyond the copy on a machine with two cores. A
    failed check stops the copy and raises; the caller's ``atomic_output`` then
    discards the partial file. Where the kernel cannot copy (another filesystem), the
    rest is copied through a buffer.
    """
    from restorekit._bundle.writer import copy_checked

    first_name, first = run[0]
    path, shard = _shard(checkpoint, first_name, first, handles)
    for name, entry in run[1:]:
        _check_bounds(path, shard.fileno(), name, entry)
    start = first.offset
    size = run[-1][1].offset + run[-1][1].size - start
    copy = _KernelCopy(shard.fileno(), out.fileno(), start, size)
    try:
        for name, entry in run:
            _check(copy_checked(shard.fileno(), entry.offset, entry.size, lambda view: None), name, entry, path)
            if bar is not None:
                bar.update(entry.size)
        copy.wait()
    except BaseException:  # a failed check, or Ctrl-C while waiting
        copy.stop()  # the thread must be gone before the caller closes its file descriptors
        raise
    if copy.error is not None and not isinstance(copy.error, OSError):
        raise copy.error
    if copy.done < size:  # the kernel refused or stopped part way: finish through a buffer
        if copy_checked(shard.fileno(), start + copy.done, size - copy.done, lambda view: write_all(out, view)) is None:
            raise CorruptCheckpointError(f"data shard {path!r} ended while copying")


def copy_unchecked_run(run: list, out, handles: dict, bar=None) -> None:
    """Copy ``(name, UncheckedRange)`` ranges lying back to back in one file, the way ``cp`` copies a file.

    Unlike ``copy_raw_run`` nothing is checked: the source keeps no checksum of its data.
    What makes the copy safe is where the ranges come from (``KerasCheckpoint.stored_range``:
    h5py's own parse of the file's structure, bounded by the file's end) and the bounds
    checked here again before the first byte is copied: a range past the file's end is
    refused (``CorruptCheckpointError``; the caller's ``atomic_output`` discards the
    partial output). The kernel copies (``os.copy_file_range``); where it cannot
    (another filesystem), the rest goes through a buffer.
    """
    first_name, first = run[0]
    path = first.path
    if path not in handles:
        try:
            handles[path] = files.open_regular(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path!r}, the source of {first_name!r}, is gone") from None
    fd = handles[path].fileno()
    start, size = first.offset, run[-1][1].offset + run[-1][1].size - first.offset
    file_size = os.fstat(fd).st_size
    for name, where in run:
        if where.offset + where.size > file_size:
            raise CorruptCheckpointError(f"{path!r} is truncated: {name!r} needs bytes {where.offset}..{where.offset + where.size} "
                                         f"of a {file_size}-byte file")
    done = 0
    copy = getattr(os, "copy_file_range", None)  # absent off Linux: the buffered copy does it all
    try:
        while copy is not None and done < size:
            n = copy(fd, out.fileno(), min(_KernelCopy._STEP, size - done), start + done)
            if n == 0:
                break  # the file shrank since the check; the buffered copy reports it
            done += n
            if bar is not None:
                bar.update(n)
    except OSError:  # EXDEV, ENOSYS, EINVAL...: the kernel will not; copy the rest through a buffer
        pass
    if done < size and not _copy_buffered(fd, start + done, size - done, out, bar):
        raise CorruptCheckpointError(f"{path!r} ended while its bytes {start}..{start + size} were copied")


def _copy_buffered(fd: int, offset: int, size: int, out, bar) -> bool:
    """Copy ``size`` bytes at ``offset`` of ``fd`` to ``out`` through a reused buffer; False when the file ends first."""
    from restorekit._bundle.crc import COPY_CHUNK

    view = memoryview(bytearray(min(COPY_CHUNK, size)))
    done = 0
    while done < size:
        n = os.preadv(fd, [view[: min(len(view), size - done)]], offset + done)
        if n == 0:
            return False
        write_all(out, view[:n])
        if bar is not None:
            bar.update(n)
        done += n
    return True


def write_all(out, view) -> None:
    """Write all of ``view`` to a raw (unbuffered) file, which may take several calls."""
    view = memoryview(view).cast("B")
    while view:
        view = view[out.write(view) :]


class _KernelCopy:
    """``copy_file_range`` of a byte range to ``dst``'s file position, in a thread."""

    _STEP = 64 << 20  # per call, so that a failed check stops the copy soon

    def __init__(self, src: int, dst: int, start: int, size: int):
        import threading

        self.src, self.dst, self.start, self.size = src, dst, start, size
        self.done = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._finished = threading.Event()
        threading.Thread(target=self._run, name="restorekit-copy", daemon=True).start()

    def _run(self) -> None:
        try:
            copy = getattr(os, "copy_file_range", None)  # absent off Linux: the buffered copy does it all
            while copy is not None and self.done < self.size and not self._stop.is_set():
                n = copy(self.src, self.dst, min(self._STEP, self.size - self.done), self.start + self.done)
                if n == 0:
                    break  # the shard ended early; the buffered copy reports it
                self.done += n
        except BaseException as e:  # handed to the caller's thread
            self.error = e
        finally:
            self._finished.set()

    def wait(self) -> None:
        self._finished.wait()

    def stop(self) -> None:
        """End the copy after its current step and wait for that, even through another Ctrl-C.

        (An Event, not ``Thread.join``: on CPython 3.11 an interrupted ``join`` marks the
        thread finished while it still runs.)
        """
        self._stop.set()
        while True:
            try:
                self._finished.wait()
                return
            except BaseException:  # noqa: BLE001 - the original exception is re-raised by the caller
                continue
