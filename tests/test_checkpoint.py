"""Checkpoint: path resolution, listing from the index only, reading tensors, clear errors."""

import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import Checkpoint, CheckpointNotFoundError, CorruptCheckpointError, NoMatchError
from restorekit._bundle.format import decode_slice_key
from conftest import save_variables

tf1 = tf.compat.v1


def test_lists_entries_sorted_with_shapes_dtypes_and_sizes(small_checkpoint):
    prefix, values = small_checkpoint
    ckpt = Checkpoint(prefix)
    assert ckpt.prefix == prefix
    assert list(ckpt) == sorted(values)
    assert len(ckpt) == len(values) and "dense/kernel" in ckpt and "nope" not in ckpt
    entry = ckpt.entries["dense/kernel"]
    assert entry == restorekit.Entry("dense/kernel", (4, 3), "float32", 48)
    assert ckpt.entries["global_step"].dtype == "int64" and ckpt.entries["global_step"].shape == ()


def test_reads_values_equal_to_what_tensorflow_saved(small_checkpoint):
    prefix, values = small_checkpoint
    ckpt = Checkpoint(prefix)
    for name, value in values.items():
        np.testing.assert_array_equal(ckpt.read(name), value)


def test_every_resnet_entry_reads_like_tensorflows_own_reader(resnet_checkpoint):
    ckpt = Checkpoint(resnet_checkpoint)
    reader = tf.train.load_checkpoint(resnet_checkpoint)
    shapes = reader.get_variable_to_shape_map()
    assert set(ckpt) == set(shapes)
    for name in ckpt:
        assert ckpt.entries[name].shape == tuple(shapes[name])
        np.testing.assert_array_equal(ckpt.read(name), reader.get_tensor(name))


def test_listing_reads_only_the_index(small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(prefix + ".index", copy / "m.index")  # no data shard at all
    ckpt = Checkpoint(str(copy / "m"))
    assert ckpt.entries["dense/kernel"].shape == (4, 3)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        ckpt.read("dense/kernel")


def test_listing_does_not_import_tensorflow(small_checkpoint):
    prefix, _ = small_checkpoint
    code = (
        "import sys, restorekit; c = restorekit.Checkpoint(sys.argv[1]); c.read('dense/kernel'); "
        "print(len(c), 'tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, prefix], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["6", "False"]


@pytest.mark.parametrize(
    "form",
    ["prefix", "index_file", "data_file", "directory"],
    ids=["a prefix", "the .index file", "a .data shard", "a directory with a state file"],
)
def test_accepts_every_path_form(small_checkpoint, form):
    prefix, _ = small_checkpoint
    path = {
        "prefix": prefix,
        "index_file": prefix + ".index",
        "data_file": prefix + ".data-00000-of-00001",
        "directory": os.path.dirname(prefix),
    }[form]
    state = os.path.join(os.path.dirname(prefix), "checkpoint")
    with open(state, "w") as f:
        f.write(f'model_checkpoint_path: "{os.path.basename(prefix)}"\n')
    assert Checkpoint(path).prefix == prefix


def test_directory_whose_state_file_names_another_machine_falls_back_with_one_warning(small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    directory = os.path.dirname(prefix)
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "/home/someone/else/train/model.ckpt-999"\n')
    with pytest.warns(restorekit.RestoreKitWarning, match="does not exist"):
        ckpt = Checkpoint(directory)
    assert ckpt.prefix == prefix


def test_directory_without_state_file_uses_newest_index(tmp_path):
    old = save_variables(tmp_path / "old", {"a": np.zeros(2, np.float32)})
    new = save_variables(tmp_path / "new", {"a": np.ones(2, np.float32)})
    os.utime(old + ".index", (1, 1))
    os.remove(tmp_path / "checkpoint") if (tmp_path / "checkpoint").exists() else None
    with pytest.warns(restorekit.RestoreKitWarning, match="no 'checkpoint' state file"):
        ckpt = Checkpoint(tmp_path)
    assert ckpt.prefix == new
    np.testing.assert_array_equal(ckpt.read("a"), np.ones(2))


def test_saved_model_directory(tmp_path):
    module = tf.Module()
    module.w = tf.Variable(np.arange(3, dtype=np.float32))
    module.f = tf.function(lambda x: x * module.w, input_signature=[tf.TensorSpec([3], tf.float32)])
    tf.saved_model.save(module, str(tmp_path / "sm"))
    ckpt = Checkpoint(tmp_path / "sm")
    assert ckpt.prefix.endswith(os.path.join("sm", "variables", "variables"))
    key = next(k for k in ckpt if k.startswith("w/"))
    np.testing.assert_array_equal(ckpt.read(key), np.arange(3))


def test_ram_filesystem_through_gfile():
    values = {"v": np.arange(4, dtype=np.float32)}
    prefix = save_variables("ram://restorekit_test/model", values)
    ckpt = Checkpoint(prefix)
    np.testing.assert_array_equal(ckpt.read("v"), values["v"])


def test_partitioned_variable_reads_as_one_full_tensor(tmp_path):
    with tf.Graph().as_default():
        var = tf1.get_variable("emb", shape=[10, 4], partitioner=tf1.fixed_size_partitioner(3))
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            full = sess.run(tf.concat(list(var), axis=0))
            prefix = saver.save(sess, str(tmp_path / "p"), write_meta_graph=False)
    ckpt = Checkpoint(prefix)
    assert list(ckpt) == ["emb"]
    assert ckpt.entries["emb"].shape == (10, 4) and ckpt.entries["emb"].nbytes == 160
    np.testing.assert_array_equal(ckpt.read("emb"), full)


def _aligned_and_writable(array) -> bool:
    return array.ctypes.data % 64 == 0 and array.flags.writeable and array.flags.c_contiguous


def test_read_gives_64_byte_aligned_writable_arrays_on_both_sides_of_the_mapped_threshold(tmp_path):
    # Checkpoint.read allocates tensors from _MAPPED bytes on (4 MiB) as anonymous mappings, smaller ones
    # inside a numpy buffer: both must start on a 64-byte boundary (XLA and TF take them without a copy).
    from restorekit._bundle.format import _MAPPED

    rng = np.random.RandomState(3)
    side = _MAPPED // 4 // 1024  # float32 rows of 1024 elements: `side` rows is exactly the threshold
    values = {
        "odd_int8": rng.randint(-128, 127, size=(7,)).astype(np.int8),
        "small": rng.randn(3, 5).astype(np.float32),
        "just_under": rng.randn(side - 1, 1024).astype(np.float32),
        "at": rng.randn(side, 1024).astype(np.float32),
        "over": rng.randn(side + 1, 1024).astype(np.float32),
        "big_f64": rng.randn(side, 1024).astype(np.float64),
    }
    prefix = save_variables(tmp_path / "m", values)
    ckpt = Checkpoint(prefix)
    assert ckpt.entries["just_under"].nbytes < _MAPPED <= ckpt.entries["at"].nbytes < ckpt.entries["over"].nbytes
    for name, value in values.items():
        first, second = ckpt.read(name), ckpt.read(name)
        assert _aligned_and_writable(first) and _aligned_and_writable(second), name
        np.testing.assert_array_equal(first, value)
        first[...] = 0  # writing one read's array leaves the next read (and the checkpoint) as TF wrote it
        np.testing.assert_array_equal(second, value)
        np.testing.assert_array_equal(ckpt.read(name), value)


def test_read_of_a_partitioned_variable_gives_64_byte_aligned_writable_arrays(tmp_path):
    from restorekit._bundle.format import _MAPPED

    rows = _MAPPED // 4 // 1024 + 60  # over the threshold; split in 2 slices, each under it
    with tf.Graph().as_default():
        small = tf1.get_variable("emb", shape=[10, 4], partitioner=tf1.fixed_size_partitioner(3))
        big = tf1.get_variable("big", shape=[rows, 1024], partitioner=tf1.fixed_size_partitioner(2))
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            full = {"emb": sess.run(tf.concat(list(small), axis=0)), "big": sess.run(tf.concat(list(big), axis=0))}
            prefix = saver.save(sess, str(tmp_path / "p"), write_meta_graph=False)
    ckpt = Checkpoint(prefix)
    assert ckpt.entries["emb"].nbytes < _MAPPED < ckpt.entries["big"].nbytes
    for name, value in full.items():
        for _ in range(3):  # numpy's own buffers land 64-aligned by chance now and then: read more than once
            array = ckpt.read(name)
            assert _aligned_and_writable(array), (name, array.ctypes.data % 64)
            np.testing.assert_array_equal(array, value)


def test_all_dtypes_round_trip(tmp_path):
    import ml_dtypes

    values = {
        "bf16": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
        "f16": np.array([0.5, 3.0], dtype=np.float16),
        "f64": np.array([1e-300]),
        "i8": np.array([-3, 4], dtype=np.int8),
        "u8": np.array([250], dtype=np.uint8),
        "i32": np.array([[1, 2]], dtype=np.int32),
        "b": np.array([True, False]),
        "c64": np.array([1 + 2j], dtype=np.complex64),
        "c128": np.array([3 - 1j], dtype=np.complex128),
        "s": np.array([b"hello", b"", "w\u00f6rld".encode()], dtype=object),
    }
    prefix = save_variables(tmp_path / "all", values)
    ckpt = Checkpoint(prefix)
    for name, value in values.items():
        got = ckpt.read(name)
        assert got.dtype == value.dtype, name
        np.testing.assert_array_equal(got, value)
    assert ckpt.entries["bf16"].dtype == "bfloat16" and ckpt.entries["s"].dtype == "string"


def test_slice_key_decoding_matches_tensorflows_encoding(tmp_path):
    from restorekit._bundle.table import read_table

    with tf.Graph().as_default():
        tf1.get_variable("deep/emb", shape=[300, 2], partitioner=tf1.fixed_size_partitioner(2))
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            prefix = saver.save(sess, str(tmp_path / "p"), write_meta_graph=False)
    keys = [k for k, _ in read_table(open(prefix + ".index", "rb").read()) if k[:1] == b"\x00"]
    decoded = sorted(decode_slice_key(k) for k in keys)
    assert decoded == [("deep/emb", ((0, 150), (0, 2))), ("deep/emb", ((150, 150), (0, 2)))]


# ---------------------------------------------------------------- bad input


def test_missing_path_is_a_file_not_found_error_naming_it(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at") as info:
        Checkpoint(tmp_path / "nothing" / "model.ckpt")
    assert isinstance(info.value, FileNotFoundError)


def test_missing_path_suggests_nearby_checkpoints(small_checkpoint):
    prefix, _ = small_checkpoint
    with pytest.raises(CheckpointNotFoundError, match="nearby") as info:
        Checkpoint(prefix + "-1000")
    assert prefix in str(info.value)


def test_directory_without_checkpoint(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(CheckpointNotFoundError, match="holds no checkpoint"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize(
    "damage",
    ["truncate_half", "truncate_footer", "zero_magic", "flip_block_byte", "empty"],
    ids=["index cut in half", "footer cut", "magic zeroed", "a block byte flipped", "empty index"],
)
def test_corrupt_index_is_a_clear_error(small_checkpoint, tmp_path, damage):
    prefix, _ = small_checkpoint
    data = bytearray(open(prefix + ".index", "rb").read())
    if damage == "truncate_half":
        data = data[: len(data) // 2]
    elif damage == "truncate_footer":
        data = data[:-10]
    elif damage == "zero_magic":
        data[-8:] = bytes(8)
    elif damage == "flip_block_byte":
        data[10] ^= 0xFF
    else:
        data = bytearray()
    bad = tmp_path / "bad"
    (tmp_path / "bad.index").write_bytes(bytes(data))
    # A flipped byte inside a block still parses; the block's crc32c is what catches it.
    error = restorekit.ChecksumMismatchError if damage == "flip_block_byte" else CorruptCheckpointError
    with pytest.raises(error, match="bad.index") as info:
        Checkpoint(bad)
    assert type(info.value) is error


def test_crc_mismatch_in_a_shard_is_detected(small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    copy = tmp_path / "c"
    shutil.copy(prefix + ".index", str(copy) + ".index")
    shard = bytearray(open(prefix + ".data-00000-of-00001", "rb").read())
    entry = Checkpoint(prefix).bundle_entry("dense/kernel")
    shard[entry.offset] ^= 0x01
    open(str(copy) + ".data-00000-of-00001", "wb").write(bytes(shard))
    ckpt = Checkpoint(copy)
    with pytest.raises(restorekit.ChecksumMismatchError, match="dense/kernel"):
        ckpt.read("dense/kernel")
    np.testing.assert_array_equal(ckpt.read("logits/bias"), Checkpoint(prefix).read("logits/bias"))


def test_read_into_fills_memory_the_caller_holds_and_check_reads_without_keeping(small_checkpoint, tmp_path):
    prefix, values = small_checkpoint
    ckpt = Checkpoint(prefix)
    out = np.full((4, 3), np.nan, np.float32)
    ckpt.read_into("dense/kernel", out)
    assert out.tobytes() == np.asarray(values["dense/kernel"], np.float32).tobytes()
    ckpt.check("dense/kernel")
    for bad, why in [(np.empty((3, 4), np.float32), "got a float32 [3, 4] array"),
                     (np.empty((4, 3), np.float64), "got a float64 [4, 3] array"),
                     (np.empty((3, 4), np.float32).T, "got a non-contiguous float32 [4, 3] array"), ([0.0] * 12, "got list")]:
        with pytest.raises(restorekit.InvalidArgumentError, match=re.escape(why)):
            ckpt.read_into("dense/kernel", bad)
    frozen = np.zeros((4, 3), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(restorekit.InvalidArgumentError, match="got a read-only float32"):
        ckpt.read_into("dense/kernel", frozen)
    # one flipped byte: check names the tensor, read_into raises after filling (check first to know)
    copy = tmp_path / "c"
    shutil.copy(prefix + ".index", str(copy) + ".index")
    shard = bytearray(open(prefix + ".data-00000-of-00001", "rb").read())
    shard[ckpt.bundle_entry("dense/kernel").offset] ^= 0x01
    open(str(copy) + ".data-00000-of-00001", "wb").write(bytes(shard))
    damaged = Checkpoint(copy)
    with pytest.raises(restorekit.ChecksumMismatchError, match="'dense/kernel'"):
        damaged.check("dense/kernel")
    with pytest.raises(restorekit.ChecksumMismatchError, match="dense/kernel"):
        damaged.read_into("dense/kernel", out)
    damaged.check("logits/bias")
    # truncated: both refuse before reading past the end
    open(str(copy) + ".data-00000-of-00001", "wb").write(bytes(shard[: ckpt.bundle_entry("dense/kernel").offset + 8]))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        Checkpoint(copy).check("dense/kernel")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        Checkpoint(copy).read_into("dense/kernel", out)


def test_unknown_entry_lists_closest_names(small_checkpoint):
    prefix, _ = small_checkpoint
    with pytest.raises(NoMatchError, match="dense/kernel") as info:
        Checkpoint(prefix).read("dense/kernal")
    assert "dense/kernel" in info.value.closest


def test_checkpoint_keeps_the_mapping_contract(small_checkpoint):
    prefix, values = small_checkpoint
    ckpt = Checkpoint(prefix)
    assert ckpt.get("missing", None) is None
    assert ckpt.get("dense/bias").shape == (3,)
    assert "dense/bias" in ckpt and "missing" not in ckpt
    assert sorted(ckpt) == sorted(values)
    with pytest.raises(KeyError) as info:
        ckpt["dense/kernal"]
    assert isinstance(info.value, restorekit.EntryNotFoundError) and isinstance(info.value, NoMatchError)
    # a sentence, not KeyError's repr of it
    assert str(info.value).startswith(f"checkpoint {prefix!r} has no entry 'dense/kernal'.")
    assert "Closest: 'dense/kernel'" in str(info.value)


def test_fallback_warns_once_however_often_the_directory_is_opened(small_checkpoint):
    prefix, _ = small_checkpoint
    directory = os.path.dirname(prefix)
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "/elsewhere/model.ckpt-7"\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert Checkpoint(directory).prefix == prefix
    assert [str(w.message).count("does not exist") for w in caught] == [1]


# ---------------------------------------------------------------- TensorFlow's reader rules


def _rewrite_index(prefix, change):
    """Apply ``change`` to the (key, value) records of ``prefix``'s index and write it back."""
    from restorekit._bundle.table import read_table, write_table

    with open(prefix + ".index", "rb") as f:
        records = read_table(f.read())
    with open(prefix + ".index", "wb") as f:
        f.write(write_table(sorted(change(records))))


def _tf_refuses(prefix, name):
    try:
        tf.train.load_checkpoint(prefix).get_tensor(name)
    except (tf.errors.OpError, ValueError, RuntimeError):
        return True
    return False


@pytest.fixture
def partitioned(tmp_path):
    """'emb' [10, 2] saved by TF in two slices, rows 0-5 and 5-10."""
    with tf.Graph().as_default():
        var = tf1.get_variable("emb", shape=[10, 2], partitioner=tf1.fixed_size_partitioner(2))
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            full = sess.run(tf.concat(list(var), axis=0))
            return saver.save(sess, str(tmp_path / "p"), write_meta_graph=False), full


def test_overlapping_slices_that_leave_rows_uncovered_are_refused(partitioned):
    from restorekit._bundle.format import encode_slice_key

    prefix, full = partitioned
    np.testing.assert_array_equal(Checkpoint(prefix).read("emb"), full)

    def second_slice_covers_rows_0_to_5(records):
        # The same element count as before, so only an overlap check finds it.
        return [(encode_slice_key("emb", ((0, 5), (0, -1))) if key[:1] == b"\x00" and decode_slice_key(key)[1][0][0] == 5
                 else key, value) for key, value in records]

    _rewrite_index(prefix, second_slice_covers_rows_0_to_5)
    with pytest.raises(CorruptCheckpointError, match=r"'emb': slices \[0:5, 0:2\] and \[0:5, 0:2\] overlap"):
        Checkpoint(prefix).read("emb")
    assert _tf_refuses(prefix, "emb")


def test_a_slice_whose_dtype_differs_from_its_tensor_is_refused(partitioned):
    from restorekit._bundle.protos import decode_entry, encode_entry

    prefix, _ = partitioned

    def first_slice_int32(records):
        return [(k, encode_entry(decode_entry(v).replace(dtype=3)) if k[:1] == b"\x00" else v) for k, v in records]

    _rewrite_index(prefix, first_slice_int32)
    with pytest.raises(CorruptCheckpointError, match="'emb' is float32; its slice .* is int32"):
        Checkpoint(prefix).read("emb")


def test_an_entry_with_two_shape_fields_is_refused(small_checkpoint):
    prefix, _ = small_checkpoint

    def second_shape(records):
        # BundleEntryProto field 2 (shape) again: TensorShapeProto with one dim of size 3.
        return [(k, v + b"\x12\x04\x12\x02\x08\x03" if k == b"dense/bias" else v) for k, v in records]

    _rewrite_index(prefix, second_shape)
    with pytest.raises(CorruptCheckpointError, match="more than one shape field"):
        Checkpoint(prefix)
    assert _tf_refuses(prefix, "dense/bias")


def _set_version(producer=1, min_consumer=0, bad_consumers=()):
    from restorekit._bundle.protos import BundleHeader, encode_header

    header = encode_header(BundleHeader(num_shards=1, version_producer=producer, version_min_consumer=min_consumer,
                                        bad_consumers=tuple(bad_consumers)))
    return lambda records: [(k, header if k == b"" else v) for k, v in records]


@pytest.mark.parametrize(
    "version, message",
    [
        ({"min_consumer": 2}, "needs a reader of format version 2 or newer"),
        ({"producer": 2, "bad_consumers": (1,)}, r"disallows readers of format version 1 \(bad_consumers \[1\]\)"),
        ({"producer": -1}, "older than the oldest"),
    ],
    ids=["min_consumer above ours", "our version listed as bad", "negative producer"],
)
def test_header_versions_tensorflow_refuses_are_refused(small_checkpoint, version, message):
    prefix, _ = small_checkpoint
    _rewrite_index(prefix, _set_version(**version))
    with pytest.raises(CorruptCheckpointError, match=message):
        Checkpoint(prefix)
    assert _tf_refuses(prefix, "global_step")


def test_header_versions_tensorflow_accepts_are_accepted(small_checkpoint):
    prefix, values = small_checkpoint
    _rewrite_index(prefix, _set_version(producer=5, min_consumer=1, bad_consumers=(0, 2)))
    assert not _tf_refuses(prefix, "global_step")
    assert Checkpoint(prefix).read("global_step") == values["global_step"]


@pytest.mark.parametrize(
    "shape, message",
    [((1,) * 255, "rank 255; TensorFlow allows at most 254"), ((2**40, 2**40), "more elements than an int64 counts")],
    ids=["rank 255", "2**80 elements"],
)
def test_shapes_tensorflow_refuses_are_refused_when_listing(small_checkpoint, shape, message):
    from restorekit._bundle.protos import decode_entry, encode_entry

    prefix, _ = small_checkpoint
    _rewrite_index(prefix, lambda records: [
        (k, encode_entry(decode_entry(v).replace(shape=shape)) if k == b"dense/bias" else v) for k, v in records])
    with pytest.raises(CorruptCheckpointError, match=message):
        Checkpoint(prefix)


# ---------------------------------------------------------------- every dtype TF 2.21 writes

_ML_VALUES = {
    "float8_e5m2": [0.0, -1.5, 3.0, 57344.0],
    "float8_e4m3fn": [0.0, -1.5, 3.0, 448.0],
    "float8_e4m3fnuz": [0.0, -1.5, 3.0, 240.0],
    "float8_e4m3b11fnuz": [0.0, -1.5, 3.0, 30.0],
    "float8_e5m2fnuz": [0.0, -1.5, 3.0, 57344.0],
    "float4_e2m1fn": [0.0, -0.5, 1.5, 6.0],
    "int4": [-8, -1, 0, 7],
    "uint4": [0, 1, 9, 15],
    "int2": [-2, -1, 0, 1],
    "uint2": [0, 1, 2, 3],
}


@pytest.mark.parametrize("dtype_name", list(_ML_VALUES), ids=list(_ML_VALUES))
def test_every_narrow_dtype_tensorflow_writes_reads_back_equal(tmp_path, dtype_name):
    import ml_dtypes

    from restorekit._bundle.writer import BundleWriter

    value = np.array(_ML_VALUES[dtype_name], dtype=np.float32).astype(getattr(ml_dtypes, dtype_name)).reshape(2, 2)
    prefix = str(tmp_path / "tf")
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=["x"], shape_and_slices=[""], tensors=[tf.constant(value)])
    ckpt = Checkpoint(prefix)
    assert ckpt.entries["x"].dtype == dtype_name and ckpt.entries["x"].nbytes == 4
    got = ckpt.read("x")
    assert got.dtype == value.dtype and got.tobytes() == value.tobytes()
    # ... and what restorekit writes, TensorFlow reads.
    ours = str(tmp_path / "ours")
    with BundleWriter(ours) as w:
        w.add("x", value)
    back = tf.train.load_checkpoint(ours).get_tensor("x")
    assert np.asarray(back).tobytes() == value.tobytes()


def test_a_rank_65_tensor_lists_and_explains_why_numpy_cannot_hold_it(tmp_path):
    from restorekit.errors import InvalidArgumentError

    prefix = str(tmp_path / "deep")
    shape = [2] + [1] * 64
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=["deep", "flat"], shape_and_slices=["", ""],
                      tensors=[tf.reshape(tf.constant([1.5, -2.0]), shape), tf.constant([3.0])])
    ckpt = Checkpoint(prefix)
    assert ckpt.entries["deep"].shape == tuple(shape) and ckpt.entries["deep"].nbytes == 8
    with pytest.raises(InvalidArgumentError, match="'deep' has 65 dimensions; numpy arrays hold at most 64"):
        ckpt.read("deep")
    raw = ckpt.read_raw(ckpt.bundle_entry("deep"), "deep")
    assert np.frombuffer(raw, np.float32).tolist() == [1.5, -2.0]
    assert ckpt.read("flat").tolist() == [3.0]


# ---------------------------------------------------------------- special files


@pytest.fixture
def no_hang():
    """Fail (instead of hanging the suite) when a read blocks: SIGALRM after a few seconds."""
    import signal

    def timeout(signum, frame):
        raise TimeoutError("blocked on a special file")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_fifo_in_place_of_the_index_is_refused_without_blocking(small_checkpoint, tmp_path, no_hang):
    os.mkfifo(tmp_path / "piped.index")
    with pytest.raises(CorruptCheckpointError, match=r"piped.index' is a FIFO \(named pipe\), not a regular file"):
        Checkpoint(tmp_path / "piped")


def test_a_device_in_place_of_the_index_is_refused(tmp_path, no_hang):
    # /dev/null, not /dev/zero: a regression must fail here, not read without end.
    os.symlink("/dev/null", tmp_path / "null.index")
    with pytest.raises(CorruptCheckpointError, match="is a character device, not a regular file"):
        Checkpoint(tmp_path / "null")


def test_a_fifo_in_place_of_a_data_shard_is_refused_when_read_or_copied(small_checkpoint, tmp_path, no_hang):
    from restorekit._bundle.writer import BundleWriter

    prefix, values = small_checkpoint
    copy = str(tmp_path / "c")
    shutil.copy(prefix + ".index", copy + ".index")
    os.mkfifo(copy + ".data-00000-of-00001")
    ckpt = Checkpoint(copy)
    assert dict(ckpt.entries)["dense/bias"].shape == (3,)  # listing needs only the index
    with pytest.raises(CorruptCheckpointError, match="'dense/bias'.* is a FIFO"):
        ckpt.read("dense/bias")
    with pytest.raises(CorruptCheckpointError, match="is a FIFO"):
        with BundleWriter(str(tmp_path / "out" / "m")) as w:
            w.add_copy("dense/bias", ckpt.bundle_entry("dense/bias"), ckpt.data_file(0))


# ---------------------------------------------------------------- verify


@pytest.fixture
def assorted(tmp_path):
    """A TF-written checkpoint: floats, strings, a variant, a rank-65 tensor, bfloat16."""
    import ml_dtypes

    prefix = str(tmp_path / "assorted")
    tensors = {
        "w": tf.constant(np.arange(300, dtype=np.float32).reshape(30, 10)),
        "words": tf.constant([b"alpha", b"", b"gamma" * 50]),
        "ds": tf.data.experimental.to_variant(tf.data.Dataset.range(3)),
        "deep": tf.ones([2] + [1] * 64),
        "half": tf.constant(np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)),
    }
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=list(tensors), shape_and_slices=[""] * len(tensors),
                      tensors=list(tensors.values()))
    return prefix


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_verify_checks_every_tensor_tensorflow_wrote(assorted, capsys):
    ckpt = Checkpoint(assorted)
    result = ckpt.verify(progress=True)
    assert result.ok and result.problems == ()
    assert result.tensors == 5 and result.nbytes == sum(ckpt.bundle_entry(n).size for n in ckpt)
    assert str(result).endswith(": 5 tensors, %d bytes checked: ok" % result.nbytes)
    assert Checkpoint(assorted).verify() == result  # a value: equal results compare equal


@pytest.mark.parametrize("name", ["w", "words", "ds", "deep"], ids=["float32", "string", "variant", "rank 65"])
def test_verify_finds_one_flipped_byte_in_any_tensor(assorted, name):
    ckpt = Checkpoint(assorted)
    entry = ckpt.bundle_entry(name)
    _flip(ckpt.data_file(0), entry.offset + entry.size - 1)
    result = ckpt.verify()
    assert not result.ok
    assert [(p.name, p.kind) for p in result.problems] == [(name, "checksum")]
    assert "crc32c" in result.problems[0].message and name in str(result)


def test_verify_finds_a_truncated_shard_and_overlapping_slices(partitioned, tmp_path):
    from restorekit._bundle.format import encode_slice_key

    prefix, _ = partitioned
    shard = prefix + ".data-00000-of-00001"
    os.truncate(shard, os.path.getsize(shard) - 4)  # the last slice loses its last element

    def second_slice_covers_rows_0_to_5(records):
        return [(encode_slice_key("emb", ((0, 5), (0, -1))) if key[:1] == b"\x00" and decode_slice_key(key)[1][0][0] == 5
                 else key, value) for key, value in records]

    assert [p.name for p in Checkpoint(prefix).verify().problems] == ["emb"]
    _rewrite_index(prefix, second_slice_covers_rows_0_to_5)
    result = Checkpoint(prefix).verify()
    assert [(p.name, p.kind) for p in result.problems] == [("emb", "corrupt")]
    assert "overlap" in result.problems[0].message


def test_verify_reports_a_missing_shard_and_an_entry_whose_size_does_not_fit(small_checkpoint):
    from restorekit._bundle.protos import decode_entry, encode_entry

    prefix, _ = small_checkpoint
    _rewrite_index(prefix, lambda records: [
        (k, encode_entry(decode_entry(v).replace(size=decode_entry(v).size + 4)) if k == b"dense/bias" else v)
        for k, v in records])
    result = Checkpoint(prefix).verify()
    assert [(p.name, p.kind) for p in result.problems] == [("dense/bias", "corrupt")]
    assert "16 bytes stored for a float32 tensor of shape [3], which takes 12" in result.problems[0].message
    os.remove(prefix + ".data-00000-of-00001")
    result = Checkpoint(prefix).verify()
    assert len(result.problems) == len(Checkpoint(prefix)) and result.nbytes == 0
    assert all("missing" in p.message for p in result.problems if p.name != "dense/bias")


def test_a_path_that_is_both_a_prefix_and_a_directory_says_which_it_used(tmp_path):
    import warnings as _warnings

    from restorekit.errors import RestoreKitWarning

    prefix = save_variables(tmp_path / "run", {"v": np.float32(1)})
    os.makedirs(tmp_path / "run")
    with pytest.warns(RestoreKitWarning, match="both a checkpoint prefix and a directory; using the prefix"):
        assert Checkpoint(prefix).prefix == prefix
    with _warnings.catch_warnings():
        _warnings.simplefilter("error")
        with pytest.raises(CheckpointNotFoundError):
            Checkpoint(prefix + "/")  # the directory, which holds no checkpoint


def test_read_takes_a_tf2_readable_path_and_suggests_paths(tmp_path):
    module = tf.Module()
    module.head = tf.Module()
    module.head.kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="head/kernel")
    prefix = tf.train.Checkpoint(model=module).save(str(tmp_path / "tf2" / "ckpt"))
    ckpt = Checkpoint(prefix)
    key = ckpt.object_paths["head/kernel"]
    assert key != "head/kernel" and ckpt.key("head/kernel") == key and ckpt.key(key) == key
    np.testing.assert_array_equal(ckpt.read("head/kernel"), np.arange(6).reshape(2, 3))
    with pytest.raises(NoMatchError, match="Closest: 'head/kernel'") as info:
        ckpt.read("hed/kernel")
    assert info.value.closest[0] == "head/kernel"
