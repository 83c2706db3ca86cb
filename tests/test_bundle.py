"""Tests for restorekit/_bundle: the table writer, varints, slice keys, errors, BundleWriter, atomic outputs."""

import os
import re
import stat

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from restorekit._bundle import crashpoints
from restorekit._bundle.format import (
    decode_slice_key,
    decode_tensor,
    dtype_enum,
    encode_slice_key,
    encode_string_tensor,
    tensor_crc,
)
from restorekit._bundle.protos import BundleEntry
from restorekit._bundle.staging import Staging, atomic_output, write_bytes
from restorekit._bundle.table import read_table, write_table
from restorekit._bundle.varint import put_varint, read_varint
from restorekit._bundle.writer import BundleWriter
from restorekit._checkpoint import Checkpoint
from restorekit.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NameCollisionError,
    OutputError,
    WriteFailedError,
)

tf1 = tf.compat.v1

VALUES = {
    "float32": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "bfloat16": (np.arange(6, dtype=np.float32) / 3).astype(ml_dtypes.bfloat16).reshape(2, 3),
    "float16": np.linspace(-1, 1, 5).astype(np.float16),
    "float64": np.array([np.pi, -np.e]),
    "int8": np.array([-128, 0, 127], np.int8),
    "int32": np.array([[1, -2], [3, 2**31 - 1]], np.int32),
    "int64": np.int64(-(2**40)),
    "uint8": np.array([0, 255], np.uint8),
    "bool": np.array([True, False, True]),
    "complex64": np.array([1 + 2j, -3j], np.complex64),
    "complex128": np.array([[1e-300 + 1j]]),
    "string": np.array([[b"hello", b""], [b"\x00\xff", "é".encode()]], dtype=object),
    "string_scalar": np.array(b"x" * 200, dtype=object),
    "empty": np.zeros((0, 3), np.float32),
}


def files_in(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ------------------------------------------------------------------ table


@pytest.mark.parametrize("count", [0, 1, 40, 5000], ids=["empty", "one-record", "one-block", "many-blocks"])
def test_write_table_round_trips_through_our_reader(count):
    records = [(b"", b"header")] + [(f"layer_{i:05d}/kernel".encode(), bytes([i % 251]) * (i % 97)) for i in range(count)]
    assert read_table(write_table(records)) == records


def test_write_table_shares_key_prefixes_as_leveldb_does_and_reads_back():
    """Keys that are prefixes of each other, share all but the last byte, or nothing; TF reads the result."""
    import random

    from restorekit._bundle.table import _shared_prefix

    rnd = random.Random(3)
    keys = {b"a", b"ab", b"abc", b"abd", b"b", b"\xff", b"\xff\x00", b"\x00\x01"}
    keys |= {bytes(rnd.choice(b"ab\x00\xff") for _ in range(rnd.randrange(1, 12))) for _ in range(400)}
    ordered = sorted(keys)
    for a, b in zip(ordered, ordered[1:]):
        naive = 0
        while naive < min(len(a), len(b)) and a[naive] == b[naive]:
            naive += 1
        assert _shared_prefix(a, b) == naive, (a, b)
    records = [(b"", b"header")] + [(k, k[::-1]) for k in ordered]
    assert read_table(write_table(records)) == records


def test_write_table_rejects_unsorted_keys():
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        write_table([(b"b", b""), (b"a", b"")])


# ------------------------------------------------------------------ bundle/ raises only restorekit errors


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: dtype_enum("no-such-dtype"), "is not a dtype"),
        (lambda: dtype_enum(np.dtype([("a", "f4")])), "no TensorFlow checkpoint equivalent"),
        (lambda: encode_slice_key("v", ((2**60, 1),)), "too large for a slice key"),
        (lambda: encode_string_tensor(np.array([b"a", 3], dtype=object)), "str or bytes; got int"),
    ],
    ids=["unknown dtype name", "structured dtype", "slice bound over 56 bits", "an int in a string tensor"],
)
def test_bad_arguments_to_the_format_are_invalid_argument_errors(call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call()


def test_staging_refuses_a_path_outside_its_directory(tmp_path):
    with Staging(str(tmp_path / "out"), output=str(tmp_path / "out" / "m")) as staging:
        with pytest.raises(InvalidArgumentError, match="not in the staging directory"):
            staging.path(str(tmp_path / "elsewhere" / "m.index"))
    assert files_in(tmp_path / "out") == []


def test_writer_refuses_an_object_array_that_is_not_strings(tmp_path):
    with pytest.raises(InvalidArgumentError, match="str or bytes"):
        with BundleWriter(str(tmp_path / "m")) as w:
            w.add("words", np.array([b"ok", 7], dtype=object))
    assert files_in(tmp_path) == []


# ------------------------------------------------------------------ varints


@pytest.mark.parametrize(
    "value, encoded",
    [(0, b"\x00"), (127, b"\x7f"), (300, b"\xac\x02"), (2**64 - 1, b"\xff" * 9 + b"\x01"), (-1, b"\xff" * 9 + b"\x01")],
    ids=["zero", "one-byte", "two-bytes", "max-uint64", "negative-as-int64"],
)
def test_varints_encode_as_protobuf_does_and_read_back(value, encoded):
    out = bytearray()
    put_varint(out, value)
    assert bytes(out) == encoded
    assert read_varint(encoded, 0, len(encoded), "test") == (value % 2**64, len(encoded))


@pytest.mark.parametrize(
    "data, message",
    [(b"\x80\x80", "truncated varint in test data"), (b"\xff" * 10 + b"\x01", "varint longer than 64 bits in test data")],
    ids=["truncated", "over-64-bits"],
)
def test_bad_varints_are_corrupt_checkpoint_errors_saying_where(data, message):
    with pytest.raises(CorruptCheckpointError, match=message):
        read_varint(data, 0, len(data), "test data")


def test_string_tensor_with_a_truncated_length_names_the_tensor():
    raw, crc = encode_string_tensor([b"a" * 200, b"b"])
    with pytest.raises(CorruptCheckpointError, match="'vocab'"):
        decode_tensor(raw[:1], 7, (2,), name="vocab", crc32c=crc)
    assert list(decode_tensor(raw, 7, (2,), name="vocab", crc32c=crc)) == [b"a" * 200, b"b"]


# ------------------------------------------------------------------ slice keys


def test_slice_key_encoder_inverts_tf_keys(tmp_path):
    with tf.Graph().as_default():
        tf1.get_variable("emb", shape=[1000, 7], partitioner=tf1.fixed_size_partitioner(3))
        tf1.get_variable("deep/big", shape=[300000, 2], partitioner=tf1.fixed_size_partitioner(5))
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            prefix = saver.save(sess, str(tmp_path / "m"), write_meta_graph=False)
    keys = [k for k, _ in read_table(open(prefix + ".index", "rb").read()) if k[:1] == b"\x00"]
    assert len(keys) == 8
    for key in keys:
        name, extents = decode_slice_key(key)
        assert encode_slice_key(name, extents) == key
    assert decode_slice_key(encode_slice_key("a\x00b\xff", ((-70, -1), (2**40, 9))))[1] == ((-70, -1), (2**40, 9))


# ------------------------------------------------------------------ BundleWriter


@pytest.fixture
def written(tmp_path):
    prefix = str(tmp_path / "out" / "model.ckpt")
    with BundleWriter(prefix) as w:
        for name, value in VALUES.items():
            w.add(name, value)
    return prefix


def test_writer_output_reads_back_with_our_reader(written):
    ckpt = Checkpoint(written)
    assert list(ckpt) == sorted(VALUES)
    for name, value in VALUES.items():
        got = ckpt.read(name)
        assert got.shape == np.shape(value)
        if "string" not in name:
            assert got.dtype == np.asarray(value).dtype
        assert np.array_equal(got, value)


@pytest.mark.parametrize("name", list(VALUES), ids=list(VALUES))
def test_writer_output_reads_back_with_tensorflow(written, name):
    reader = tf.train.load_checkpoint(written)  # checks every crc32c
    expected_dtype = {"string_scalar": "string", "empty": "float32"}.get(name, name)
    assert reader.get_variable_to_dtype_map()[name].name == expected_dtype
    got = reader.get_tensor(name)
    if "string" in name:
        assert np.array_equal(np.asarray(got, dtype=object), VALUES[name])
    else:
        assert np.array_equal(np.asarray(got).astype(np.asarray(VALUES[name]).dtype), VALUES[name])


def test_writer_output_restores_with_saver(tmp_path):
    prefix = str(tmp_path / "m")
    kernel = np.random.RandomState(1).randn(5, 2).astype(np.float32)
    with BundleWriter(prefix) as w:
        w.add("dense/kernel", kernel)
        w.add("global_step", np.int64(42))
    with tf.Graph().as_default():
        v = tf1.get_variable("dense/kernel", shape=[5, 2])
        step = tf1.train.get_or_create_global_step()
        with tf1.Session() as sess:
            tf1.train.Saver().restore(sess, prefix)
            assert np.array_equal(sess.run(v), kernel)
            assert sess.run(step) == 42


def test_add_raw_copies_bytes_verbatim_and_checks_the_crc(written, tmp_path):
    src = Checkpoint(written)
    prefix = str(tmp_path / "copy" / "m")
    entry = src.bundle_entry("float32")
    raw = src.read_raw(entry)
    with BundleWriter(prefix) as w:
        w.add_raw("float32", entry, [raw[:10], raw[10:]])
        w.add_raw("string", src.bundle_entry("string"), src.read_raw(src.bundle_entry("string")))
    out = Checkpoint(prefix)
    assert np.array_equal(out.read("float32"), VALUES["float32"])
    assert np.array_equal(out.read("string"), VALUES["string"])
    bad = str(tmp_path / "bad" / "m")
    with pytest.raises(ChecksumMismatchError):
        with BundleWriter(bad) as w:
            w.add_raw("float32", entry, b"\x01" + raw[1:])
    assert files_in(tmp_path / "bad") == []


def test_writer_leaves_nothing_on_error_and_rejects_duplicates(tmp_path):
    prefix = str(tmp_path / "m")
    with pytest.raises(NameCollisionError):
        with BundleWriter(prefix) as w:
            w.add("a", np.zeros(3))
            w.add("a", np.ones(3))
    assert files_in(tmp_path) == []


def test_writer_is_invisible_until_finish(tmp_path):
    w = BundleWriter(str(tmp_path / "m"))
    w.add("a", np.arange(4))
    assert [f for f in files_in(tmp_path) if not f.startswith(".")] == []
    w.finish()
    assert files_in(tmp_path) == ["m.data-00000-of-00001", "m.index"]
    assert list(Checkpoint(str(tmp_path / "m")).read("a")) == [0, 1, 2, 3]


def test_atomic_output_gives_normal_permissions_and_refuses_a_directory(tmp_path):
    old_umask = os.umask(0o022)
    try:
        write_bytes(str(tmp_path / "frozen.pb"), b"graph")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(tmp_path / "frozen.pb").st_mode) == 0o644  # not mkstemp's 0600
    assert (tmp_path / "frozen.pb").read_bytes() == b"graph"
    os.mkdir(tmp_path / "out")
    with pytest.raises(OutputError, match="is a directory"):
        write_bytes(str(tmp_path / "out"), b"graph")
    with pytest.raises(WriteFailedError, match="half.pb.*killed halfway"):  # a library's RuntimeError, worded
        with atomic_output(str(tmp_path / "half.pb")) as tmp:
            open(tmp, "wb").write(b"half")
            raise RuntimeError("killed halfway")
    assert files_in(tmp_path) == ["frozen.pb", "out"]


def test_stale_temporary_directories_are_swept(tmp_path):
    stale = tmp_path / ".restorekit-tmp-999999999-deadbeef"
    stale.mkdir()
    (stale / "m.index").write_bytes(b"partial")
    with BundleWriter(str(tmp_path / "m")) as w:
        w.add("a", np.zeros(1))
    assert files_in(tmp_path) == ["m.data-00000-of-00001", "m.index"]
    assert crashpoints.CRASH_HOOK_ENV == "RESTOREKIT_CRASH_HOOK"


# ------------------------------------------------------------------ slices (the fuzz corpus is tests/test_fuzz.py)


def test_slice_outside_its_full_shape_is_a_corrupt_checkpoint(tmp_path):
    raw = np.arange(4, dtype=np.float32).tobytes()
    prefix = str(tmp_path / "m")
    with BundleWriter(prefix) as w:
        w.add_raw(encode_slice_key("part", ((5, 2), (0, -1))),
                  BundleEntry(dtype=1, shape=(2, 2), size=16, crc32c=tensor_crc(raw)), raw)
        w.add_entry_only("part", BundleEntry(dtype=1, shape=(2, 2), slices=(b"",)))
    with pytest.raises(CorruptCheckpointError, match="outside dimension 2"):
        Checkpoint(prefix).read("part")


def test_add_copy_copies_a_stored_tensor(written, tmp_path):
    src = Checkpoint(written)
    prefix = str(tmp_path / "copy" / "m")
    with BundleWriter(prefix) as w:
        for name in ("float32", "string", "bool"):
            w.add_copy(name, src.bundle_entry(name), src.data_file(0))
        w.add("after", np.arange(3))
    out = Checkpoint(prefix)
    for name in ("float32", "string", "bool"):
        assert np.array_equal(out.read(name), VALUES[name])
    assert out.read("after").tolist() == [0, 1, 2]


def test_add_copy_of_a_corrupt_tensor_raises_and_leaves_the_writer_usable(written, tmp_path):
    import shutil

    src_prefix = str(tmp_path / "bad" / "m")
    os.makedirs(os.path.dirname(src_prefix))
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(written + suffix, src_prefix + suffix)
    src = Checkpoint(src_prefix)
    entry = src.bundle_entry("float32")
    with open(src.data_file(0), "r+b") as f:  # flip one byte of the float32 tensor
        f.seek(entry.offset)
        byte = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    prefix = str(tmp_path / "copy" / "m")
    with BundleWriter(prefix) as w:
        w.add_copy("bool", src.bundle_entry("bool"), src.data_file(0))
        with pytest.raises(ChecksumMismatchError, match="float32"):
            w.add_copy("float32", entry, src.data_file(0))
        w.add_copy("string", src.bundle_entry("string"), src.data_file(0))
    out = Checkpoint(prefix)
    assert sorted(out) == ["bool", "string"]  # nothing of the corrupt tensor was kept
    assert np.array_equal(out.read("bool"), VALUES["bool"])
    assert np.array_equal(out.read("string"), VALUES["string"])
    assert os.path.getsize(out.data_file(0)) == sum(out.bundle_entry(n).size for n in out)


def test_add_placed_records_bytes_the_caller_put_in_the_shard(tmp_path):
    import google_crc32c

    from restorekit._bundle.writer import BundleWriter
    from restorekit.errors import ChecksumMismatchError

    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = values.tobytes()
    with BundleWriter(str(tmp_path / "p" / "model.ckpt")) as writer:
        shard = writer.shard(0)
        shard.add("first", np.int64(5))
        os.lseek(shard.fileno(), 100, os.SEEK_CUR)  # a gap no entry covers
        offset = os.lseek(shard.fileno(), 0, os.SEEK_CUR)
        os.write(shard.fileno(), raw)
        with pytest.raises(ChecksumMismatchError, match="bytes placed"):
            shard.add_placed("short", "float32", (3, 4), offset, len(raw) - 4, 0)
        with pytest.raises(ChecksumMismatchError, match="are not in data shard"):
            shard.add_placed("beyond", "float32", (3, 4), offset + 4, len(raw), 0)
        shard.add_placed("placed", "float32", (3, 4), offset, len(raw), google_crc32c.value(raw))
        shard.add("after", np.float32(2.5))
    reader = tf.train.load_checkpoint(str(tmp_path / "p" / "model.ckpt"))
    np.testing.assert_array_equal(reader.get_tensor("placed"), values)
    assert reader.get_tensor("first") == 5 and reader.get_tensor("after") == np.float32(2.5)
    assert sorted(reader.get_variable_to_shape_map()) == ["after", "first", "placed"]


# ------------------------------------------------------------------ entries: the fast decoder


def _general_decode(buf, monkeypatch):
    from restorekit._bundle import protos

    with monkeypatch.context() as m:
        m.setattr(protos, "_decode_entry_fast", lambda buf: None)
        return protos.decode_entry(buf)


def test_the_fast_entry_decoder_agrees_with_the_general_one_and_with_tensorflow(monkeypatch):
    from tensorflow.core.protobuf import tensor_bundle_pb2

    from restorekit._bundle.protos import _decode_entry_fast

    rng = np.random.default_rng(7)
    taken = 0
    for _ in range(300):
        proto = tensor_bundle_pb2.BundleEntryProto(
            dtype=int(rng.integers(1, 30)), shard_id=int(rng.choice([0, 0, 1, 200, 2**20])),
            offset=int(rng.integers(0, 2**45)), size=int(rng.integers(0, 2**34)), crc32c=int(rng.integers(0, 2**32)))
        for dim in rng.integers(0, 2 ** int(rng.integers(1, 40)), size=int(rng.integers(0, 7))):
            proto.shape.dim.add(size=int(dim))
        buf = proto.SerializeToString()
        fast, general = _decode_entry_fast(buf), _general_decode(buf, monkeypatch)
        assert general.shape == tuple(d.size for d in proto.shape.dim)
        assert (general.dtype, general.shard_id, general.offset, general.size, general.crc32c) == (
            proto.dtype, proto.shard_id, proto.offset, proto.size, proto.crc32c)
        if fast is not None:
            taken += 1
            assert fast == general and fast.encoded == buf
    assert taken == 300  # every entry TF writes for a plain tensor takes the fast path


@pytest.mark.parametrize("buf", [
    b"\x08\x01\x12\x0c\x12\x0a\x08" + b"\xff" * 9 + b"\x01",  # a negative dim (10-byte varint)
    b"\x08\x01\x12\x04\x12\x02\x08\x03\x12\x04\x12\x02\x08\x03",  # two shapes
    b"\x08\x01\x35\x01\x02\x03\x04\x35\x01\x02\x03\x04",  # two crcs
    b"\x08\x01\x3a\x00",  # a slice
    b"\x08\x01\x12\x05\x12\x02\x08",  # a shape running past its end
    b"\x08\x81",  # a varint running past the end
    b"\x08\x01\x35\x01\x02",  # a short crc
], ids=["negative dim", "two shapes", "two crcs", "slices", "shape overrun", "varint overrun", "short crc"])
def test_the_fast_entry_decoder_leaves_the_unusual_and_the_malformed_to_the_general_one(buf, monkeypatch):
    from restorekit._bundle.protos import _decode_entry_fast, decode_entry

    assert _decode_entry_fast(buf) is None
    try:
        expected = _general_decode(buf, monkeypatch)
    except CorruptCheckpointError as e:
        with pytest.raises(CorruptCheckpointError, match=re.escape(str(e))):
            decode_entry(buf)
    else:
        assert decode_entry(buf) == expected
