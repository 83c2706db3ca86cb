"""bundle/crc.py: the fastest crc32c, ranges of a file checked on several threads, and a source truncated meanwhile."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import google_crc32c
import numpy as np
import pytest
from conftest import save_variables

from restorekit._bundle import crc
from restorekit._checkpoint import Checkpoint
from restorekit.edit import CheckpointEditor
from restorekit.errors import ChecksumMismatchError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_combine_joins_the_crcs_of_two_pieces():
    rnd = random.Random(0)
    for _ in range(300):
        a = os.urandom(rnd.randrange(0, 5000))
        b = os.urandom(rnd.choice([0, 1, 7, rnd.randrange(0, 70000)]))
        assert crc.combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == google_crc32c.value(a + b)


def test_extend_matches_google_crc32c_on_every_buffer_kind():
    data = os.urandom(100_003)
    want = google_crc32c.value(data)
    array = np.frombuffer(data, np.uint8)
    assert crc.extend(0, data) == want
    assert crc.extend(0, array) == want
    assert crc.extend(crc.extend(0, array[:999]), memoryview(data)[999:]) == want


def test_work_items_keep_ranges_up_to_two_pieces_whole_and_cut_bigger_ones_in_file_order():
    rnd = random.Random(3)
    piece = 1000
    ranges = [(rnd.randrange(10**6), rnd.choice([0, 1, 999, 1000, 1999, 2000, 2001, 5000, rnd.randrange(8000)]))
              for _ in range(400)]
    items = crc.work_items(ranges, piece)
    got: dict[int, list] = {}
    for item in items:
        assert item and sum(n for _, _, n in item) <= 2 * piece
        for i, offset, size in item:
            got.setdefault(i, []).append((offset, size))
    for i, (offset, size) in enumerate(ranges):
        parts = got.get(i, [])
        if size == 0:
            assert parts in ([], [(offset, 0)])
            continue
        assert parts[0][0] == offset and sum(n for _, n in parts) == size  # in order, nothing left out
        assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))
        assert len(parts) == 1 if size <= 2 * piece else all(n <= piece for _, n in parts)
    order = [ranges[i][0] for item in items for i, _, _ in item]
    assert order == sorted(order)


def test_work_items_aim_lower_toward_the_end_so_threads_finish_together():
    """Guided items: full ``piece`` items while much is left, then smaller ones down to ``least``;
    nothing left out, file order kept, no item over ``2 * piece``, one big range cut the same way."""
    piece, least = 1000, 100
    rnd = random.Random(5)
    offset, ranges = 0, []
    for _ in range(300):
        size = rnd.choice([10, 500, 1500, 2500, 40, 30_000])
        ranges.append((offset, size))
        offset += size
    for rs in (ranges, [(0, 100 * piece)]):
        items = crc.work_items(rs, piece, least=least, threads=2)
        sizes = [sum(n for _, _, n in item) for item in items]
        assert max(sizes) <= 2 * piece and sizes[0] >= piece
        assert max(sizes[-8:]) < piece // 2  # the last 8 items (4 per thread) are small ...
        assert sum(sizes[-8:]) >= least  # ... but not crumbs
        pieces = [(i, o, n) for item in items for i, o, n in item]
        assert [o for _, o, _ in pieces] == sorted(o for _, o, _ in pieces)
        for k, (start, size) in enumerate(rs):
            parts = [(o, n) for i, o, n in pieces if i == k]
            assert parts[0][0] == start and sum(n for _, n in parts) == size
            assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))
    assert len(crc.work_items([(0, 100 * piece)], piece, least=least, threads=2)) < 100 + 40


def test_mapped_crcs_of_ranges_starting_anywhere_in_a_page_match(tmp_path):
    """_mapped_item crcs a range's bytes up to a page boundary apart from the rest: every start in a page,
    sizes on both sides of the threshold, and ranges ending inside their first page."""
    data = os.urandom(3 << 20)
    path = tmp_path / "shard"
    path.write_bytes(data)
    page = 4096
    ranges = [(page * k + d, n) for k, d in enumerate((0, 1, 7, 8, 2047, 4095, 4096))
              for n in (1, page - d % page, crc._ALIGN_MIN - 1, crc._ALIGN_MIN, crc._ALIGN_MIN + 5, 1 << 20)]
    fd = os.open(path, os.O_RDONLY)
    try:
        _need_a_lease(fd)
        got = crc.file_crcs(fd, ranges, path=str(path))
    finally:
        os.close(fd)
    assert got == [google_crc32c.value(data[o : o + n]) for o, n in ranges]


def _need_a_lease(fd: int) -> None:
    """Skip, naming why, where the file system gives no read lease (NFS, some overlays): crc.file_crcs then
    reads instead of mapping (the "reads" cases), so the mapped path cannot run there."""
    probe = crc._Lease(fd)
    held = probe.held
    probe.release()
    if not held:
        pytest.skip("this file system gives no read lease (F_SETLEASE): file_crcs reads instead of mapping here")


@pytest.fixture
def tf_shard(tmp_path):
    rng = np.random.RandomState(1)
    values = {"big": rng.randn(3, 1 << 20).astype(np.float32), "small": rng.randn(5).astype(np.float32),
              "mid": rng.randn(700, 300).astype(np.float32)}
    prefix = save_variables(tmp_path / "src" / "model.ckpt", values)
    return prefix, Checkpoint(prefix)


@pytest.mark.parametrize("lease", [True, False], ids=["mapped", "reads"])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_file_crcs_of_a_tf_shard_match_the_index_and_google_crc32c(tf_shard, monkeypatch, lease, threads):
    prefix, ckpt = tf_shard
    if not lease:
        monkeypatch.setattr(crc, "_LINUX", False)
    monkeypatch.setattr(crc, "_SPLIT_MIN", 0)
    monkeypatch.setattr(crc, "CHUNK", 1 << 16)
    path = ckpt.data_file(0)
    data = open(path, "rb").read()
    entries = [ckpt.bundle_entry(n) for n in ckpt]
    rnd = random.Random(threads)
    # Every entry, then overlapping, empty and past-the-end ranges.
    ranges = [(e.offset, e.size) for e in entries]
    ranges += [(rnd.randrange(len(data)), rnd.randrange(1 << 22)) for _ in range(12)]
    ranges += [(0, 0), (len(data) + 5, 0), (len(data) - 3, 3), (len(data) - 3, 4)]
    fd = os.open(path, os.O_RDONLY)
    try:
        if lease:
            _need_a_lease(fd)
        got = crc.file_crcs(fd, ranges, path=path, threads=threads)
    finally:
        os.close(fd)
    want = [google_crc32c.value(data[o : o + s]) if o + s <= len(data) else None for o, s in ranges]
    want[-3] = 0  # an empty range past the end: nothing to read
    assert got == want
    from restorekit._bundle.table import mask_crc

    assert [mask_crc(c) for c in got[: len(entries)]] == [e.crc32c for e in entries]


def test_a_flipped_bit_in_a_kept_tensor_fails_the_save(tf_shard, tmp_path):
    prefix, ckpt = tf_shard
    entry = ckpt.bundle_entry("mid")
    with open(ckpt.data_file(0), "r+b") as f:
        f.seek(entry.offset + entry.size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    out = tmp_path / "out"
    editor = CheckpointEditor(prefix)
    editor.rename("small", "tiny")
    with pytest.raises(ChecksumMismatchError, match="'mid'"):
        editor.save(str(out / "model.ckpt"))
    assert not out.exists()


# One save in its own process: a SIGBUS (a mapped read of truncated bytes) would kill it, not raise.
CHILD = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from restorekit._bundle import crc
from restorekit.edit import CheckpointEditor
from restorekit.errors import CheckpointChangedError
src, out, mode = sys.argv[2:5]
shard = src + ".data-00000-of-00001"
crc.CHUNK = 1 << 16
crc._SPLIT_MIN = 0
if mode == "reads":
    crc._LINUX = False  # as for a shard another process holds open for writing: no lease
leases = []
real_lease_init = crc._Lease.__init__
def lease_init(self, fd):
    real_lease_init(self, fd)
    leases.append(self)
crc._Lease.__init__ = lease_init
real_extend = crc.extend
state = {}
def extend(value, data):
    if not state:  # the first chunk: another process truncates the shard now
        state["p"] = subprocess.Popen([sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], 100)", shard])
        if mode == "reads":
            state["p"].wait(timeout=60)
        else:  # the truncation waits on the lease: go on once the kernel says it is breaking
            deadline = time.time() + 30
            while not leases[0].broken() and time.time() < deadline:
                time.sleep(0.01)
            state["broken"] = leases[0].broken()
    return real_extend(value, data)
crc.extend = extend
editor = CheckpointEditor(src)
editor.rename_all(lambda n: "renamed/" + n)
try:
    editor.save(os.path.join(out, "model.ckpt"))
    result = "saved"
except CheckpointChangedError as e:
    result = "changed: " + str(e)
state["p"].wait(timeout=60)
print(json.dumps({"result": result, "held": bool(leases and leases[0].held), "mode_lease": bool(leases) and mode,
                  "broken": state.get("broken"), "size": os.path.getsize(shard)}))
"""


@pytest.mark.parametrize("mode", ["lease", "reads"])
def test_a_shard_truncated_by_another_process_during_the_check_is_a_restorekit_error(tf_shard, tmp_path, mode):
    prefix, ckpt = tf_shard
    if mode == "lease":
        fd = os.open(ckpt.data_file(0), os.O_RDONLY)
        try:
            _need_a_lease(fd)
        finally:
            os.close(fd)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", CHILD, ROOT, prefix, str(out), mode],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]  # not killed by SIGBUS
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["result"].startswith("changed: "), report
    assert "data-00000-of-00001" in report["result"]
    assert report["size"] == 100  # the truncation did happen (after the check let go of the lease)
    if mode == "lease":
        assert report["broken"] is True
    assert not out.exists()  # nothing published, no directory made for it left behind
    assert not [n for n in os.listdir(os.path.dirname(prefix)) if "restorekit" in n]  # no lock or staging left


def test_a_shard_open_for_writing_elsewhere_is_read_not_mapped(tf_shard):
    """No lease while a writer has the file open (the kernel refuses it): the check reads instead, same crcs."""
    _, ckpt = tf_shard
    path = ckpt.data_file(0)
    entries = [ckpt.bundle_entry(n) for n in ckpt]
    writer = os.open(path, os.O_RDWR)
    fd = os.open(path, os.O_RDONLY)
    try:
        lease = crc._Lease(fd)
        assert not lease.held
        got = crc.file_crcs(fd, [(e.offset, e.size) for e in entries], path=path, threads=2)
    finally:
        os.close(fd)
        os.close(writer)
    from restorekit._bundle.table import mask_crc

    assert [mask_crc(c) for c in got] == [e.crc32c for e in entries]


@pytest.mark.parametrize("bad_shard", [None, 0, 1])
def test_a_shard_reusing_save_checks_every_data_shard(tmp_path, bad_shard):
    """Two data shards: the first shard's pass starts on the saving thread, the second follows; a flipped bit
    in either fails the save, naming the tensor, and nothing is published."""
    import tensorflow as tf

    from restorekit._bundle.writer import BundleWriter

    rng = np.random.RandomState(2)
    values = {f"s{shard}/t{i}": rng.randn(300, 200).astype(np.float32) for shard in (0, 1) for i in range(3)}
    prefix = str(tmp_path / "src" / "model.ckpt")
    with BundleWriter(prefix, num_shards=2, shard_id=None) as writer:
        for name, value in values.items():
            writer.shard(int(name[1])).add(name, value)
    if bad_shard is not None:
        entry = Checkpoint(prefix).bundle_entry(f"s{bad_shard}/t1")
        with open(Checkpoint(prefix).data_file(bad_shard), "r+b") as f:
            f.seek(entry.offset + 7)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
    out = tmp_path / "out"
    editor = CheckpointEditor(prefix)
    editor.rename_all(lambda n: "renamed/" + n)
    if bad_shard is None:
        saved = editor.save(str(out / "model.ckpt"))
        reader = tf.train.load_checkpoint(saved)
        for name, value in values.items():
            np.testing.assert_array_equal(reader.get_tensor("renamed/" + name), value)
        return
    with pytest.raises(ChecksumMismatchError, match=f"'s{bad_shard}/t1'"):
        editor.save(str(out / "model.ckpt"))
    assert not out.exists()
    assert not [n for n in os.listdir(os.path.dirname(prefix)) if "restorekit" in n]
