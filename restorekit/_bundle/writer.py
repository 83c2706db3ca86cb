"""BundleWriter: stream tensors into a TensorFlow V2 checkpoint without TensorFlow.

Our own because TF's writer (``tf.raw_ops.SaveV2``, ``BundleWriter`` in C++) needs every
tensor as a live TF tensor and gives no way to copy stored bytes verbatim or to reuse
existing shards; the editor and the importers need both. Files are written under
temporary names and renamed into place on ``finish`` (see ``staging.py``).
"""

from __future__ import annotations

import io
import os
import threading

import numpy as np

from restorekit._bundle import crashpoints, files
from restorekit._bundle.locking import write_failed
from restorekit._bundle.staging import Staging
from restorekit._bundle.crc import extend, read_chunks
from restorekit._bundle.format import DT_STRING, decode_tensor, dtype_enum, dtype_name, encode_string_tensor, numpy_dtype
from restorekit._bundle.protos import BundleEntry, BundleHeader, encode_entry, encode_header
from restorekit._bundle.table import mask_crc, write_table
from restorekit._bundle.varint import put_varint
from restorekit.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    EditError,
    InvalidArgumentError,
    NameCollisionError,
)

__all__ = ["BundleWriter", "CHUNK_SIZE", "ShardWriter", "array_chunks", "balance", "check_num_shards", "copy_checked", "partitioned_entry"]

CHUNK_SIZE = 8 << 20
STRING = DT_STRING  # the name other modules import


def copy_checked(fd: int, offset: int, size: int, write) -> int | None:
    """Copy ``size`` bytes at ``offset`` of file descriptor ``fd`` to ``write``, in one pass.

    Each chunk is read once into a reused buffer (``crc.read_chunks``), added to the crc32c,
    and passed to ``write`` (a callable taking a memoryview, which it must use up before
    returning: the buffer is reused), so verifying costs no second read of the source.

    Returns:
        The unmasked crc32c of the bytes, or None when the file ended before ``size``.
    """
    crc = 0
    for chunk in read_chunks(fd, offset, size):
        if chunk is None:
            return None
        crc = extend(crc, chunk)
        write(memoryview(chunk))
    return crc


def array_chunks(array: np.ndarray, chunk_size: int = CHUNK_SIZE):
    """The little-endian bytes of a fixed-size-dtype array, as read-only uint8 views of it (no copy).

    Each chunk is valid while ``array`` is unchanged: consume it before the next one
    (``BundleWriter`` writes it straight away; ``bytes(chunk)`` keeps a copy).
    """
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    flat.flags.writeable = False
    for start in range(0, flat.size, chunk_size):
        yield flat[start : start + chunk_size]


def _as_array(chunk) -> np.ndarray:
    """A chunk (bytes, memoryview, numpy) as a uint8 array over the same memory, for the crc without a copy."""
    if isinstance(chunk, np.ndarray):
        return chunk.reshape(-1).view(np.uint8)
    return np.frombuffer(chunk, np.uint8)


def partitioned_entry(dtype, full_shape, extents) -> BundleEntry:
    """The index entry of a partitioned tensor: no bytes of its own, one TensorSliceProto per part.

    ``extents`` lists each part's ``((start, length), ...)`` in the order the parts were
    added (their bytes go under ``format.encode_slice_key`` keys); length -1 means the
    whole dimension, recorded, as TF's ``TensorSlice::AsProto`` does, as an empty extent.
    """
    slices = []
    for part in extents:
        proto = bytearray()
        for start, length in part:
            extent = bytearray()
            if length != -1:
                if start:
                    put_varint(extent, 0x08)  # field 1 (start), varint
                    put_varint(extent, start)
                put_varint(extent, 0x10)  # field 2 (length), varint; a oneof, so 0 is written too
                put_varint(extent, length)
            put_varint(proto, 0x0A)  # field 1 (extent), length-delimited
            put_varint(proto, len(extent))
            proto += extent
        slices.append(bytes(proto))
    code = dtype if isinstance(dtype, int) else dtype_enum(dtype)
    return BundleEntry(dtype=code, shape=tuple(full_shape), slices=tuple(slices))


class ShardWriter:
    """Appends tensors to one data shard of a ``BundleWriter``, in the order they are added.

    Get one from ``BundleWriter.shard(i)``. Different shards may be filled from
    different threads at once (each has its own file; the index entries are shared
    under a lock); one shard is filled by one thread at a time.
    """

    def __init__(self, bundle: "BundleWriter", shard_id: int):
        self.bundle = bundle
        self.shard_id = shard_id
        self.path = bundle.staging.path(bundle.data_path(shard_id))
        self._file: io.FileIO | None = open(self.path, "wb", buffering=0)
        self._offset = 0
        self.closed = False

    @property
    def nbytes(self) -> int:
        """Bytes written to the shard so far."""
        return self._offset

    def _need_open(self) -> io.FileIO:
        """The shard's open file; raises once the shard is closed."""
        if self._file is None:
            raise EditError(f"data shard {self.shard_id} of {self.bundle.prefix!r} is already closed")
        return self._file

    def add(self, name, array) -> BundleEntry:
        """Write one tensor (numpy, incl. bfloat16, bool, complex, strings/object arrays)."""
        key = self.bundle._key(name)
        array = np.asarray(array)
        code = dtype_enum(array.dtype)
        if code == STRING:
            self._need_open()
            raw, crc = encode_string_tensor(array)
            entry = BundleEntry(dtype=STRING, shape=array.shape, shard_id=self.shard_id, offset=self._offset,
                                size=len(raw), crc32c=crc)
            self._write(raw)
            self._offset += len(raw)
            return self.bundle._record(key, entry)
        return self._stream(key, code, array.shape, array_chunks(array), expected_crc=None)

    def add_stream(self, name, dtype, shape, chunks) -> BundleEntry:
        """Write a fixed-size-dtype tensor given as byte chunks (e.g. a cast done piece by piece)."""
        key = self.bundle._key(name)
        code = dtype if isinstance(dtype, int) else dtype_enum(dtype)
        if code == STRING:
            raise EditError(f"{key!r}: string tensors cannot be streamed; use add()")
        return self._stream(key, code, tuple(shape), chunks, expected_crc=None)

    def add_raw(self, name, entry: BundleEntry, raw) -> BundleEntry:
        """Copy a stored tensor's bytes verbatim (see ``BundleWriter.add_raw``)."""
        key = self.bundle._key(name)
        chunks = [raw] if isinstance(raw, (bytes, bytearray, memoryview)) else raw
        if entry.dtype == STRING:
            self._need_open()
            start = self._offset
            for chunk in chunks:
                self._write(chunk)
                self._offset += len(chunk)
            if self._offset - start != entry.size:
                raise ChecksumMismatchError(f"{key!r}: copied {self._offset - start} bytes, the entry says {entry.size}")
            return self.bundle._record(key, entry.replace(shard_id=self.shard_id, offset=start))
        return self._stream(key, entry.dtype, entry.shape, chunks, expected_crc=entry.crc32c, like=entry,
                            expected_size=entry.size)

    def add_copy(self, name, entry: BundleEntry, path: str) -> BundleEntry:
        """Copy a stored tensor from the data shard at ``path`` (see ``BundleWriter.add_copy``)."""
        key = self.bundle._key(name)
        self._need_open()
        crashpoints.crash_point(f"tensor-{len(self.bundle._entries)}")
        shown = key.decode("utf-8", "replace")
        try:
            src = files.open_regular(path)
        except OSError:
            raise CorruptCheckpointError(f"data shard {path!r} for {shown!r} is missing or unreadable") from None
        truncated = CorruptCheckpointError(
            f"data shard {path!r} is truncated: {shown!r} needs bytes {entry.offset}..{entry.offset + entry.size}"
        )
        start = self._offset
        with src:
            if os.fstat(src.fileno()).st_size < entry.offset + entry.size:
                raise truncated
            if entry.dtype == STRING:
                raw = os.pread(src.fileno(), entry.size, entry.offset)
                decode_tensor(raw, STRING, entry.shape, name=shown, crc32c=entry.crc32c)
                self._write(raw)
                crc = None
            else:
                crc = copy_checked(src.fileno(), entry.offset, entry.size, self._write)
                if crc is None:
                    self._rewind(start)
                    raise truncated
        if crc is not None and mask_crc(crc) != entry.crc32c:
            # The bad bytes are already in the shard: cut them off, so the writer stays usable.
            self._rewind(start)
            raise ChecksumMismatchError(
                f"{shown!r}: source bytes fail their crc32c check (stored {entry.crc32c:#010x}, computed "
                f"{mask_crc(crc):#010x}); the source data shard is corrupt (or belongs to another save)"
            )
        self._offset = start + entry.size
        return self.bundle._record(key, entry.replace(shard_id=self.shard_id, offset=start))

    def fileno(self) -> int:
        """The shard file's descriptor, for a caller that places bytes itself (then ``add_placed``)."""
        return self._need_open().fileno()

    def add_placed(self, name, dtype, shape, offset: int, size: int, crc32c: int) -> BundleEntry:
        """Record a fixed-size-dtype tensor whose ``size`` bytes the caller already put at ``offset`` of this
        shard's file (through ``fileno()``, e.g. a kernel copy), with their unmasked crc32c.

        The shard then continues after the furthest byte placed; bytes left between
        tensors (alignment) are never read.

        Raises:
            ChecksumMismatchError: ``size`` is not the shape's, or the file does not hold the bytes.
        """
        key = self.bundle._key(name)
        file = self._need_open()
        crashpoints.crash_point(f"tensor-{len(self.bundle._entries)}")
        code = dtype if isinstance(dtype, int) else dtype_enum(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        shown = key.decode("utf-8", "replace")
        if code == STRING or size != count * numpy_dtype(code).itemsize:
            raise ChecksumMismatchError(f"{shown!r}: {size} bytes placed for a {dtype_name(code)} tensor of shape "
                                        f"{list(shape)}")
        if offset < 0 or os.fstat(file.fileno()).st_size < offset + size:
            raise ChecksumMismatchError(f"{shown!r}: bytes {offset}..{offset + size} are not in data shard {self.shard_id}")
        self._offset = max(self._offset, offset + size)
        file.seek(self._offset)
        entry = BundleEntry(dtype=code, shape=tuple(shape), shard_id=self.shard_id, offset=offset, size=size,
                            crc32c=mask_crc(crc32c))
        return self.bundle._record(key, entry)

    def _rewind(self, offset: int) -> None:
        file = self._need_open()
        os.ftruncate(file.fileno(), offset)
        file.seek(offset)
        self._offset = offset

    def _write(self, data) -> None:
        file = self._need_open()
        view = memoryview(data).cast("B")
        while view:
            n = file.write(view)
            view = view[n:]

    def _stream(self, key, code, shape, chunks, *, expected_crc, like=None, expected_size=None) -> BundleEntry:
        self._need_open()
        crashpoints.crash_point(f"tensor-{len(self.bundle._entries)}")
        start = self._offset
        crc = 0
        for chunk in chunks:
            data = _as_array(chunk)
            crc = extend(crc, data)
            self._write(data)
            self._offset += data.size
        size = self._offset - start
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        expected = expected_size if expected_size is not None else count * numpy_dtype(code).itemsize
        shown = key.decode("utf-8", "replace")
        if size != expected:
            raise ChecksumMismatchError(
                f"{shown!r}: got {size} bytes for a {dtype_name(code)} tensor of shape {list(shape)} ({expected} expected)"
            )
        crc = mask_crc(crc)
        if expected_crc is not None and crc != expected_crc:
            raise ChecksumMismatchError(
                f"{shown!r}: source bytes fail their crc32c check (stored {expected_crc:#010x}, computed "
                f"{crc:#010x}); the source data shard is corrupt"
            )
        base = like or BundleEntry(dtype=code, shape=tuple(shape))
        return self.bundle._record(key, base.replace(shard_id=self.shard_id, offset=start, size=size, crc32c=crc))

    def close(self, *, upload: bool = True) -> str:
        """Close the shard's file (its bytes are complete); return its staged path.

        With a ``files.RemoteStaging`` the shard is uploaded now and its local file deleted.
        """
        if self._file is not None:
            # No fsync here: Staging.commit fsyncs every staged file before renaming it.
            self._file.close()
            self._file = None
            if upload and isinstance(self.bundle.staging, files.RemoteStaging):
                # Uploaded now, so the local disk holds one shard at a time (the index comes last, on commit).
                self.bundle.staging.publish(self.bundle.data_path(self.shard_id))
        self.closed = True
        return self.path


class BundleWriter:
    """Write a V2 checkpoint, one tensor at a time, into one data shard or several.

        with BundleWriter('out/model.ckpt') as w:     # finish() on a clean exit
            w.add('dense/kernel', kernel)              # written to the shard now
            w.add('global_step', np.int64(7))

        with BundleWriter('out/model.ckpt', num_shards=4) as w:
            w.shard(2).add('embedding', table)         # each shard is its own file

    Memory is bounded by the tensor being added. Nothing appears at ``prefix`` until
    ``finish``; an error inside the ``with`` block removes every temporary file.

    Args:
        prefix: the checkpoint prefix to create (``dir/model.ckpt``).
        num_shards: shard count recorded in the header. The shards this writer does
            not fill (through ``shard(i)`` or ``shard_id``) must be supplied by the
            caller (the editor links existing shards).
        shard_id: the shard ``add`` and its kin fill, or None for none (only an index,
            or ``shard(i)`` for each). Every shard a writer fills is created, even empty.
        staging: a ``staging.Staging`` (or ``files.RemoteStaging``) owned by the caller,
            who then commits it; by default the writer makes its own (remote for a
            ``gs://``-like prefix) and commits on ``finish``.

    Raises:
        InvalidArgumentError: ``num_shards`` is not a positive int, or ``shard_id`` is out of range.
    """

    def __init__(self, prefix, *, num_shards: int = 1, shard_id: int | None = 0, staging=None):
        check_num_shards(num_shards)
        if shard_id is not None and not 0 <= shard_id < num_shards:
            raise InvalidArgumentError(f"shard_id={shard_id!r} is not a shard of {num_shards}")
        prefix = os.fspath(prefix)
        self.prefix = prefix if files.is_remote(prefix) else os.path.abspath(prefix)
        self.num_shards = num_shards
        self.shard_id = shard_id
        self._own_staging = staging is None
        if staging is None:
            # A remote prefix (gs://...) is staged locally one shard at a time, uploaded as each is closed.
            remote = files.is_remote(prefix)
            staging = files.RemoteStaging(files.dirname(prefix)) if remote else Staging(os.path.dirname(self.prefix), output=self.prefix)
        self.staging = staging
        self._entries: dict[bytes, BundleEntry] = {}
        self._lock = threading.Lock()
        self._shards: dict[int, ShardWriter] = {}
        self.finished = False
        self._default = self.shard(shard_id) if shard_id is not None else None

    # -- names
    def data_path(self, shard_id: int) -> str:
        return f"{self.prefix}.data-{shard_id:05d}-of-{self.num_shards:05d}"

    @property
    def index_path(self) -> str:
        return self.prefix + ".index"

    def shard(self, shard_id: int) -> ShardWriter:
        """The writer of data shard ``shard_id`` (its file is created on the first call)."""
        with self._lock:
            if shard_id not in self._shards:
                if not 0 <= shard_id < self.num_shards:
                    raise InvalidArgumentError(f"shard {shard_id!r} is not a shard of {self.num_shards}")
                self._shards[shard_id] = ShardWriter(self, shard_id)
            return self._shards[shard_id]

    def _key(self, name) -> bytes:
        key = name if isinstance(name, bytes) else str(name).encode("utf-8")
        if not key:
            raise EditError("the empty name is reserved for the checkpoint header")
        if key in self._entries:
            shown = key.decode("utf-8", "replace")
            raise NameCollisionError(f"{shown!r} was already added to {self.prefix!r}")
        return key

    def _record(self, key: bytes, entry: BundleEntry) -> BundleEntry:
        with self._lock:
            if key in self._entries:  # two threads added one name
                raise NameCollisionError(f"{key.decode('utf-8', 'replace')!r} was already added to {self.prefix!r}")
            self._entries[key] = entry
        return entry

    def _data(self) -> ShardWriter:
        if self._default is None:
            raise EditError(f"this writer of {self.prefix!r} writes only an index (shard_id=None)")
        return self._default

    # -- adding tensors (to the shard ``shard_id``)
    def add(self, name, array) -> BundleEntry:
        """Write one tensor (numpy, incl. bfloat16, bool, complex, strings/object arrays)."""
        return self._data().add(name, array)

    def add_stream(self, name, dtype, shape, chunks) -> BundleEntry:
        """Write a fixed-size-dtype tensor given as byte chunks (e.g. a cast done piece by piece)."""
        return self._data().add_stream(name, dtype, shape, chunks)

    def add_raw(self, name, entry: BundleEntry, raw) -> BundleEntry:
        """Copy a stored tensor's bytes verbatim (``bytes`` or an iterable of chunks).

        The crc of non-string tensors is recomputed while copying and must match
        ``entry.crc32c`` (string tensors' crc covers a different byte layout; it is kept).

        Raises:
            ChecksumMismatchError: the bytes do not match the entry's crc32c or size.
        """
        return self._data().add_raw(name, entry, raw)

    def add_copy(self, name, entry: BundleEntry, path: str) -> BundleEntry:
        """Copy a stored tensor from the data shard at ``path`` (``entry.offset``), crc32c checked.

        Each byte is read once: into a buffer, into the crc, and out to the new shard
        (``copy_checked``), so a compaction runs at about the speed of ``cp``. String
        tensors are decoded to check them.

        Raises:
            ChecksumMismatchError: the source bytes fail their crc32c; nothing of the
                tensor stays in the new shard.
            CorruptCheckpointError: the shard is missing or shorter than the entry says.
        """
        return self._data().add_copy(name, entry, path)

    def add_entry_only(self, name, entry: BundleEntry) -> None:
        """Record an index entry whose bytes already exist in this bundle's shards."""
        self._record(self._key(name), entry)

    # -- finishing
    @property
    def entries(self) -> dict[bytes, BundleEntry]:
        return dict(self._entries)

    @property
    def shard_sizes(self) -> dict[int, int]:
        """Bytes written so far to each shard this writer fills."""
        return {i: shard.nbytes for i, shard in self._shards.items()}

    def finish(self, *, commit: bool | None = None) -> str:
        """Write the index (sorted keys); rename everything into place if this writer owns the staging.

        Returns:
            The checkpoint prefix.
        """
        if self.finished:
            return self.prefix
        for shard in self._shards.values():
            shard.close()
        header = BundleHeader(num_shards=self.num_shards)
        records = [(b"", encode_header(header))]
        records += [(k, encode_entry(self._entries[k])) for k in sorted(self._entries)]
        with open(self.staging.path(self.index_path), "wb") as f:
            f.write(write_table(records))
        crashpoints.crash_point("index-written")
        self.finished = True
        if commit if commit is not None else self._own_staging:
            self.staging.commit()
        return self.prefix

    def abort(self) -> None:
        for shard in self._shards.values():
            shard.close(upload=False)
        if self._own_staging:
            self.staging.abort()

    def __enter__(self) -> "BundleWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            if self._own_staging and not files.is_remote(self.prefix):
                failed = write_failed(exc, self.prefix)
                if failed is not exc:
                    raise failed from exc
        elif not self.finished:
            try:
                self.finish()
            except BaseException as e:
                if not self._own_staging or files.is_remote(self.prefix):
                    raise
                self.abort()
                failed = write_failed(e, self.prefix)
                if failed is not e:
                    raise failed from e
                raise


def check_num_shards(num_shards) -> int:
    """``num_shards`` when it is a positive int (TF's readers take up to a million), else InvalidArgumentError."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or not 1 <= num_shards <= 1_000_000:
        raise InvalidArgumentError(f"num_shards={num_shards!r} is not a shard count: give an int from 1 to 1000000")
    return int(num_shards)


def balance(sizes, count: int) -> tuple:
    """Names cut into ``count`` runs (in order) of about equal bytes; ``sizes`` is ``[(name, bytes)]`` in order.

    Each tensor goes to the shard its middle byte falls in when the total is laid out
    evenly over the shards, so runs stay in order and no shard exceeds its share
    by more than half of one tensor on each side. Shards may be empty (fewer tensors
    than shards); TF reads empty shards.
    """
    sizes = list(sizes)
    total = sum(size for _, size in sizes) or 1
    parts: list[list] = [[] for _ in range(count)]
    done = 0
    for name, size in sizes:
        parts[min(count - 1, (2 * done + size) * count // (2 * total))].append(name)
        done += size
    return tuple(tuple(part) for part in parts)
