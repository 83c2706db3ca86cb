"""Tests for the read side of restorekit/export (torch.py + torchfile.py, npz.py, safetensors.py,
reading.py): files from anywhere are checked before they are trusted, and every error is restorekit's."""

import json
import os
import resource
import struct
import zipfile

import numpy as np
import pytest
import tensorflow as tf

from restorekit._checkpoint import Checkpoint
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, OutputError
from restorekit.export import convert, export_checkpoint, import_checkpoint
from restorekit.formats import npz as npz_format
from restorekit.formats import safetensors as st_format
from restorekit.formats import torch as torch_format
from conftest import import_torch, write_bundle


def _listing(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _tf_values(prefix):
    """Every tensor of an imported checkpoint as TensorFlow's own reader sees it (not restorekit's)."""
    reader = tf.train.load_checkpoint(str(prefix))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _rezip(src, dst, replace=None):
    """Copy the zip archive ``src`` to ``dst`` member by member, some members' bytes replaced."""
    replace = replace or {}
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as b:
        for info in a.infolist():
            data = a.read(info)
            for suffix, new in replace.items():
                if info.filename.endswith(suffix):
                    data = new
            b.writestr(info.filename, data)
    return str(dst)


@pytest.fixture
def torch():
    return import_torch()


# ------------------------------------------------------------------ .pt: records, CRC, views


def test_pt_rewritten_by_zipfile_still_imports(torch, tmp_path):
    torch.save({"a": torch.arange(4.0), "b": torch.ones(3)}, tmp_path / "m.pt")
    copy = _rezip(tmp_path / "m.pt", tmp_path / "copy.pt")
    import_checkpoint(copy, tmp_path / "out" / "m")
    assert Checkpoint(str(tmp_path / "out" / "m")).read("a").tolist() == [0, 1, 2, 3]
    values = _tf_values(tmp_path / "out" / "m")
    assert sorted(values) == ["a", "b"]
    assert values["a"].dtype == np.float32 and values["a"].tolist() == [0, 1, 2, 3] and values["b"].tolist() == [1] * 3


def test_pt_storage_record_shorter_than_its_tensor_is_refused(torch, tmp_path):
    # torch.load(mmap=True) would take the missing bytes from the next zip entry.
    torch.save({"a": torch.arange(4.0), "b": torch.ones(3)}, tmp_path / "m.pt")
    short = _rezip(tmp_path / "m.pt", tmp_path / "short.pt", {"/data/0": np.arange(2, dtype=np.float32).tobytes()})
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'a'.*holds 8 bytes where the pickle declares 16"):
        import_checkpoint(short, tmp_path / "out" / "m")
    assert _listing(tmp_path / "out") == []


def test_pt_record_failing_its_crc_is_refused(torch, tmp_path):
    torch.save({"a": torch.arange(64.0), "b": torch.ones(3)}, tmp_path / "m.pt")
    data = bytearray((tmp_path / "m.pt").read_bytes())
    at = data.index(np.arange(64.0, dtype=np.float32)[10:14].tobytes())
    data[at] ^= 0x10
    (tmp_path / "flip.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"'data/0' of tensor 'a' fails its CRC-32"):
        import_checkpoint(tmp_path / "flip.pt", tmp_path / "out" / "m")
    assert _listing(tmp_path / "out") == []


def test_pt_stride_zero_view_is_refused_over_the_limit_before_anything_is_read(torch, tmp_path):
    path = tmp_path / "bomb.pt"
    torch.save({"e": torch.zeros(1).expand(2**31)}, path)  # 1.3 KB claiming 8 GiB
    assert path.stat().st_size < 4096
    with pytest.raises(OutputError, match=r"8\.0 GiB of tensors, over max_output_bytes=1073741824.*'e' alone is 8\.0 GiB"):
        torch_format.read(path)
    with pytest.raises(OutputError, match="max_output_bytes"):
        import_checkpoint(path, tmp_path / "out" / "m")
    assert _listing(tmp_path / "out") == []


def test_pt_small_expanded_view_imports_within_the_limit_and_a_caller_can_lower_it(torch, tmp_path):
    path = tmp_path / "e.pt"
    torch.save({"e": torch.full((1,), 2.5).expand(1000)}, path)
    with pytest.raises(OutputError, match="max_output_bytes=100"):
        import_checkpoint(path, tmp_path / "out" / "m", max_output_bytes=100)
    import_checkpoint(path, tmp_path / "out" / "m", max_output_bytes=4000)
    assert Checkpoint(str(tmp_path / "out" / "m")).read("e").tolist() == [2.5] * 1000
    assert _tf_values(tmp_path / "out" / "m")["e"].tolist() == [2.5] * 1000
    with pytest.raises(InvalidArgumentError, match="positive number of bytes"):
        torch_format.read(path, max_output_bytes=True)


def _unusual(torch, kind):
    if kind == "sparse":
        return torch.eye(3).to_sparse()
    if kind == "meta":
        return torch.empty(3, device="meta")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)


@pytest.mark.parametrize("kind", ["sparse", "meta", "quantized"])
def test_pt_non_dense_tensor_is_refused_by_name(torch, tmp_path, kind):
    path = tmp_path / "m.pt"
    torch.save({"fine": torch.ones(2), "odd": _unusual(torch, kind)}, path)
    with pytest.raises(InvalidArgumentError, match=f"tensor 'odd' is a {kind} tensor"):
        import_checkpoint(path, tmp_path / "out" / "m")
    with pytest.raises(InvalidArgumentError, match="'odd'"):
        torch_format.read_shapes(path)
    assert _listing(tmp_path / "out") == []


def test_pt_empty_state_dict_is_refused(torch, tmp_path):
    torch.save({}, tmp_path / "m.pt")
    with pytest.raises(InvalidArgumentError, match="empty state_dict"):
        import_checkpoint(tmp_path / "m.pt", tmp_path / "out" / "m")
    assert _listing(tmp_path / "out") == []


def test_pt_tensors_overlapping_in_one_storage_are_refused_but_tied_weights_import(torch, tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    torch.save({"w": base, "w_t": base.t()}, tmp_path / "views.pt")
    with pytest.raises(InvalidArgumentError, match="'w' and 'w_t' share bytes of one storage"):
        import_checkpoint(tmp_path / "views.pt", tmp_path / "out" / "m")
    torch.save({"embed": base, "lm_head": base, "rows": torch.arange(8.0)[4:]}, tmp_path / "tied.pt")
    import_checkpoint(tmp_path / "tied.pt", tmp_path / "out" / "m")
    ckpt = Checkpoint(str(tmp_path / "out" / "m"))
    assert ckpt.read("lm_head").tolist() == base.tolist() and ckpt.read("rows").tolist() == [4, 5, 6, 7]
    values = _tf_values(tmp_path / "out" / "m")
    assert sorted(values) == ["embed", "lm_head", "rows"]
    assert values["embed"].tolist() == values["lm_head"].tolist() == base.tolist()
    assert values["rows"].tolist() == [4, 5, 6, 7]


def test_pt_legacy_format_still_imports_and_a_truncated_one_is_refused(torch, tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"a": torch.arange(5, dtype=torch.int32)}, path, _use_new_zipfile_serialization=False)
    import_checkpoint(path, tmp_path / "out" / "m")
    assert Checkpoint(str(tmp_path / "out" / "m")).read("a").tolist() == [0, 1, 2, 3, 4]
    a = _tf_values(tmp_path / "out" / "m")["a"]
    assert a.dtype == np.int32 and a.tolist() == [0, 1, 2, 3, 4]
    (tmp_path / "cut.pt").write_bytes(path.read_bytes()[:-6])
    with pytest.raises(CorruptCheckpointError, match="declare"):
        import_checkpoint(tmp_path / "cut.pt", tmp_path / "out2" / "m")
    assert _listing(tmp_path / "out2") == []


def test_pt_compressed_or_broken_archive_is_a_restorekit_error(torch, tmp_path):
    torch.save({"a": torch.arange(4.0)}, tmp_path / "m.pt")
    with zipfile.ZipFile(tmp_path / "m.pt") as a, zipfile.ZipFile(tmp_path / "z.pt", "w", zipfile.ZIP_DEFLATED) as b:
        for info in a.infolist():
            b.writestr(info.filename, a.read(info))
    with pytest.raises(CorruptCheckpointError, match="is compressed"):
        torch_format.read_shapes(tmp_path / "z.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "m.pt").read_bytes()[:300])
    with pytest.raises(CorruptCheckpointError, match="cut.pt"):
        torch_format.read_shapes(tmp_path / "cut.pt")


def test_pt_export_keeps_few_files_open(torch, tmp_path):
    values = {f"layer_{i:04d}/w": np.full((2,), i, np.float32) for i in range(1500)}
    prefix = write_bundle(tmp_path / "src" / "m", values)
    ckpt = Checkpoint(prefix)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 64, hard))
    try:
        export_checkpoint(ckpt, tmp_path / "m.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    state, _ = torch_format.load(tmp_path / "m.pt")
    assert len(state) == 1500 and state["layer_1499/w"].tolist() == [1499, 1499]


# ------------------------------------------------------------------ .npz


def _npz_values():
    import ml_dtypes

    return {
        "bf16": np.array([1.5, -0.0, np.inf, 3.0e38], dtype=ml_dtypes.bfloat16),
        "nan_bits": np.array([0x7FC1, 0xFFFF], dtype=np.uint16).view(ml_dtypes.bfloat16),
        "f8": np.array([0.5, -2.0], dtype=ml_dtypes.float8_e4m3fn),
        "strings": np.array([b"a\x00", b"\x00\x00", b"", b"x\x00y"], dtype=object),
        "plain": np.arange(6, dtype=np.int64).reshape(2, 3),
    }


def test_npz_round_trip_is_bit_exact_for_bfloat16_float8_and_strings_ending_in_nul(tmp_path):
    values = _npz_values()
    prefix = write_bundle(tmp_path / "src" / "m", values)
    export_checkpoint(prefix, tmp_path / "m.npz")
    import_checkpoint(tmp_path / "m.npz", tmp_path / "back" / "m")
    back = Checkpoint(str(tmp_path / "back" / "m"))
    for name, value in values.items():
        got = back.read(name)
        assert back.entries[name].dtype == Checkpoint(prefix).entries[name].dtype, name
        if value.dtype == object:
            assert got.tolist() == value.tolist()
        else:
            assert got.tobytes() == value.tobytes(), name
    by_tf = _tf_values(tmp_path / "back" / "m")
    assert sorted(by_tf) == sorted(values)
    for name, value in values.items():
        if value.dtype == object:
            assert by_tf[name].tolist() == value.tolist(), name
        else:
            assert by_tf[name].dtype == value.dtype and by_tf[name].tobytes() == value.tobytes(), name
    read = dict(npz_format.read(tmp_path / "m.npz"))
    assert read["strings"].tolist() == [b"a\x00", b"\x00\x00", b"", b"x\x00y"]
    assert read["bf16"].dtype == values["bf16"].dtype


def test_npz_to_layout_torch_keeps_bfloat16_as_an_export_from_tf_does(tmp_path):
    # layout 'torch' maps the npz file as the TF checkpoint it holds: its bfloat16 kept as bits in the file
    # are read back through the npz record, so the output is the one the TF checkpoint itself gives
    import ml_dtypes
    from safetensors.numpy import load_file

    from restorekit import convert

    rng = np.random.RandomState(0)
    values = {"dense/kernel": rng.randn(4, 3).astype(ml_dtypes.bfloat16),
              "dense/bias": rng.randn(3).astype(ml_dtypes.bfloat16), "steps": np.arange(2, dtype=np.int64)}
    prefix = write_bundle(tmp_path / "src" / "m", values)
    export_checkpoint(prefix, tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as stored:
        assert stored["dense/kernel"].dtype == np.uint16  # the bits, as npz holds them
    convert(prefix, str(tmp_path / "from_tf.safetensors"), layout="torch")
    convert(str(tmp_path / "m.npz"), str(tmp_path / "from_npz.safetensors"), layout="torch")
    want, got = load_file(str(tmp_path / "from_tf.safetensors")), load_file(str(tmp_path / "from_npz.safetensors"))
    assert sorted(got) == sorted(want) and "dense.weight" in got
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes(), name
    np.testing.assert_array_equal(got["dense.weight"], values["dense/kernel"].T)


def test_npz_refuses_a_tensor_named_like_its_record(tmp_path):
    with pytest.raises(InvalidArgumentError, match="__restorekit__"):
        npz_format.write(tmp_path / "x.npz", [("__restorekit__", np.ones(2))])
    assert _listing(tmp_path) == []


def test_npz_shapes_come_from_headers_without_reading_the_arrays(tmp_path, monkeypatch):
    np.savez_compressed(tmp_path / "x.npz", a=np.zeros((300, 7), np.float32), b=np.ones(3))

    def no_read(*args, **kwargs):
        raise AssertionError("read_array called")

    monkeypatch.setattr(np.lib.format, "read_array", no_read)
    assert npz_format.read_shapes(tmp_path / "x.npz") == {"a": (300, 7), "b": (3,)}


def test_npz_deflated_bomb_is_refused_before_decompressing(tmp_path):
    np.savez_compressed(tmp_path / "z.npz", z=np.zeros(4 << 20, np.float32))  # 16 MiB in ~16 KB
    assert (tmp_path / "z.npz").stat().st_size < 100_000
    with pytest.raises(OutputError, match=r"'z' alone is 16\.0 MiB"):
        npz_format.read(tmp_path / "z.npz", max_output_bytes=1 << 20)
    with pytest.raises(OutputError, match=r"would expand to 16\.0 MiB of tensors, over max_output_bytes=1048576"):
        import_checkpoint(tmp_path / "z.npz", tmp_path / "out" / "m", max_output_bytes=1 << 20)
    assert _listing(tmp_path / "out") == []
    assert dict(npz_format.read(tmp_path / "z.npz"))["z"].shape == (4 << 20,)  # the default allows it


@pytest.mark.parametrize("verb", [
    pytest.param(lambda src, out: convert(src, out / "m.safetensors", max_output_bytes=32 << 20), id="convert_to_safetensors"),
    pytest.param(lambda src, out: convert(src, out / "m.npz", max_output_bytes=32 << 20), id="convert_to_npz"),
    pytest.param(lambda src, out: import_checkpoint(src, out / "m", max_output_bytes=32 << 20), id="import_to_tf"),
])
def test_npz_bomb_is_refused_from_its_headers_at_constant_memory(tmp_path, verb):
    """Issue 40 item 5: opening the archive (its listing) decompressed every member before the size check."""
    import tracemalloc

    np.savez_compressed(tmp_path / "z.npz", z=np.zeros(16 << 20, np.float32))  # 64 MiB of zeros in ~64 KB
    assert (tmp_path / "z.npz").stat().st_size < 200_000
    (tmp_path / "out").mkdir()
    tracemalloc.start()
    try:
        with pytest.raises(OutputError, match=r"would expand to 64\.0 MiB of tensors, over max_output_bytes=33554432"):
            verb(tmp_path / "z.npz", tmp_path / "out")
        entries = Checkpoint(tmp_path / "z.npz").entries  # what inspect lists: from the header alone
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert entries["z"].shape == (16 << 20,) and entries["z"].nbytes == 64 << 20
    assert peak < 4 << 20, f"peak {peak} bytes"
    assert _listing(tmp_path / "out") == []


def test_npz_member_whose_declared_size_disagrees_with_its_header_is_refused(tmp_path):
    np.savez(tmp_path / "x.npz", a=np.arange(10, dtype=np.int32))
    with zipfile.ZipFile(tmp_path / "x.npz") as a:
        whole = a.read("a.npy")
    _rezip(tmp_path / "x.npz", tmp_path / "short.npz", {"a.npy": whole[:-8]})
    with pytest.raises(CorruptCheckpointError, match=r"array 'a' .* needs \d+ bytes in its member, which holds"):
        npz_format.read_shapes(tmp_path / "short.npz")


def test_npz_damaged_member_fails_its_crc(tmp_path):
    np.savez(tmp_path / "x.npz", a=np.arange(100, dtype=np.int32))
    data = bytearray((tmp_path / "x.npz").read_bytes())
    data[data.index(np.arange(40, 44, dtype=np.int32).tobytes())] ^= 1
    (tmp_path / "x.npz").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC"):
        dict(npz_format.read(tmp_path / "x.npz"))


def test_npz_object_arrays_and_non_npy_members_are_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / "x.npz", "w") as z:
        z.writestr("notes.txt", b"hello")
    with pytest.raises(CorruptCheckpointError, match="not an .npy array"):
        npz_format.read_shapes(tmp_path / "x.npz")
    np.savez(tmp_path / "o.npz", o=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CorruptCheckpointError, match="Python objects"):
        list(npz_format.read(tmp_path / "o.npz"))


# ------------------------------------------------------------------ safetensors header


def _st_file(path, header: dict, data: bytes = b"", raw_header: bytes | None = None):
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize(
    "shape, offsets, match",
    [
        ([2.9], [0, 8], "shape"),
        ([True, 2], [0, 8], "shape"),
        ([-2], [0, 8], "shape"),
        ([2**62, 4], [0, 0], "does not hold"),  # an int64 product wraps to 0
        ([2], [8, 0], "data_offsets"),
        ([2], [0.0, 8], "data_offsets"),
        ([2], [0, 8, 9], "data_offsets"),
        ([1] * 65, [0, 4], "65 dimensions"),
    ],
    ids=["float-dimension", "bool-dimension", "negative-dimension", "int64-product-wraps", "reversed-offsets",
         "float-offset", "three-offsets", "rank-65"],
)
def test_safetensors_header_is_parsed_strictly(tmp_path, shape, offsets, match):
    path = _st_file(tmp_path / "x.safetensors", {"w": {"dtype": "F32", "shape": shape, "data_offsets": offsets}},
                    bytes(8))
    with pytest.raises(CorruptCheckpointError, match=f"'w'.*{match}|{match}.*'w'"):
        st_format.read_header(path)


def test_safetensors_bad_dtypes_duplicates_and_metadata_are_refused(tmp_path):
    cases = [
        ({"w": {"dtype": 5, "shape": [2], "data_offsets": [0, 8]}}, CorruptCheckpointError, "dtype"),
        ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, CorruptCheckpointError, "does not define"),
        ({"w": {"dtype": "F8_E8M0", "shape": [8], "data_offsets": [0, 8]}}, InvalidArgumentError, "cannot read"),
        ({"__metadata__": {"a": 1}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
         CorruptCheckpointError, "__metadata__"),
    ]
    for header, error, match in cases:
        path = _st_file(tmp_path / "x.safetensors", header, bytes(8))
        with pytest.raises(error, match=match):
            st_format.read_header(path)
    twice = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    with pytest.raises(CorruptCheckpointError, match="'w' appears twice"):
        st_format.read_header(_st_file(tmp_path / "y.safetensors", {}, bytes(8), raw_header=twice))


def test_safetensors_header_length_past_the_file_or_the_formats_limit_is_refused(tmp_path):
    for n in (1 << 40, 100_000_001):
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", n) + b"{}")
        with pytest.raises(CorruptCheckpointError, match=f"header length {n} does not fit"):
            st_format.read_header(path)


def test_deeply_nested_safetensors_header_is_a_corrupt_file_not_a_recursion_error(tmp_path):
    path = _st_file(tmp_path / "x.safetensors", {}, raw_header=b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    with pytest.raises(CorruptCheckpointError, match="not JSON"):
        import_checkpoint(path, tmp_path / "out" / "m")
    assert _listing(tmp_path / "out") == []


# ------------------------------------------------------------------ one error type at the boundary


@pytest.mark.parametrize("suffix", [".pt", ".npz", ".safetensors"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(torch, tmp_path, suffix):
    fifo = tmp_path / f"x{suffix}"
    os.mkfifo(fifo)
    module = {".pt": torch_format, ".npz": npz_format, ".safetensors": st_format}[suffix]
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        module.read_shapes(fifo)


# ------------------------------------------------------------------ files named for another format


def test_a_torch_file_named_safetensors_is_read_by_its_bytes(torch, tmp_path):
    # torch.load hands any path ending in '.safetensors' to safetensors, which raised its own
    # SafetensorError ("header too large") out of convert with a traceback.
    from restorekit.cli import main

    torch.save({"a": torch.arange(4.0)}, tmp_path / "x.safetensors")
    import_checkpoint(tmp_path / "x.safetensors", tmp_path / "out" / "m")
    assert Checkpoint(str(tmp_path / "out" / "m")).read("a").tolist() == [0, 1, 2, 3]
    assert main(["-q", "convert", str(tmp_path / "x.safetensors"), str(tmp_path / "cli" / "model.ckpt")]) == 0
    assert Checkpoint(str(tmp_path / "cli" / "model.ckpt")).read("a").tolist() == [0, 1, 2, 3]
    for prefix in (tmp_path / "out" / "m", tmp_path / "cli" / "model.ckpt"):
        assert {k: v.tolist() for k, v in _tf_values(prefix).items()} == {"a": [0, 1, 2, 3]}


def _contents(tmp_path):
    prefix = write_bundle(tmp_path / "src" / "m", {"a": np.arange(6, dtype=np.float32).reshape(2, 3)})
    export_checkpoint(prefix, tmp_path / "real.safetensors")
    export_checkpoint(prefix, tmp_path / "real.pt")
    export_checkpoint(prefix, tmp_path / "real.npz")
    with zipfile.ZipFile(tmp_path / "plain.zip", "w") as z:
        z.writestr("a.txt", "hi")
    return {
        "safetensors": (tmp_path / "real.safetensors").read_bytes(),
        "torch": (tmp_path / "real.pt").read_bytes(),
        "npz": (tmp_path / "real.npz").read_bytes(),
        "zip": (tmp_path / "plain.zip").read_bytes(),
        "random": np.random.RandomState(0).bytes(300),
        "text": b"hello world\n" * 10,
        "empty": b"",
    }


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".bin", ".npz"])
def test_a_file_of_another_format_or_none_reads_by_its_bytes_or_is_corrupt_never_a_foreign_error(
    torch, tmp_path, suffix
):
    from restorekit.cli import main

    for kind, data in _contents(tmp_path).items():
        path = tmp_path / f"{kind}_as{suffix}"
        path.write_bytes(data)
        out = tmp_path / f"out_{kind}"
        try:
            import_checkpoint(path, out / "m")
        except CorruptCheckpointError as e:
            assert str(path) in str(e)
            assert _listing(out) == [], kind
            continue
        # Only a real export can read back, sniffed by its bytes whatever its name (restorekit.formats.detect,
        # as inspect and scan open it: a torch zip named '.npz' too).
        assert kind in ("safetensors", "torch", "npz"), kind
        assert Checkpoint(str(out / "m")).read("a").tolist() == [[0, 1, 2], [3, 4, 5]]
    # The shell: one line, exit 3, for the random bytes.
    assert main(["-q", "convert", str(tmp_path / f"random_as{suffix}"), str(tmp_path / "cli" / "m")]) == 3


def test_a_parsing_library_s_own_exception_becomes_corrupt_checkpoint_error():
    from restorekit.formats._reading import boundary

    SafetensorError = type("SafetensorError", (Exception,), {"__module__": "safetensors._safetensors_rust"})
    with pytest.raises(CorruptCheckpointError, match=r"'f.safetensors' is not a readable safetensors file "
                                                     r"\(SafetensorError: header too large\)"):
        with boundary("f.safetensors", "safetensors file"):
            raise SafetensorError("Error while deserializing header: header too large".split(": ")[1])
    with pytest.raises(ZeroDivisionError):  # restorekit's own bugs still surface
        with boundary("f.safetensors", "safetensors file"):
            1 / 0


# ------------------------------------------------------------------ foreign exceptions of odd inputs (issue 22, finding 11)


@pytest.mark.parametrize("layout", [None, "torch"], ids=["as-stored", "layout-torch"])
def test_pt_with_int_keys_is_refused_by_name_not_an_attribute_error(torch, tmp_path, layout):
    torch.save({0: torch.ones(2, 3), 1: torch.zeros(3)}, tmp_path / "m.pt")
    with pytest.raises(InvalidArgumentError, match=r"keys that are not names \(0, 1\)"):
        import_checkpoint(tmp_path / "m.pt", tmp_path / "out" / "m", layout=layout)
    with pytest.raises(InvalidArgumentError, match="not names"):
        torch_format.read_shapes(tmp_path / "m.pt")
    assert _listing(tmp_path / "out") == []


def test_a_name_longer_than_a_zip_member_name_is_refused_before_npz_is_written(tmp_path):
    prefix = write_bundle(tmp_path / "src" / "m", {"ok": np.arange(3, dtype=np.float32),
                                                   "a" * 100_000: np.arange(4, dtype=np.float32)})
    out = tmp_path / "out" / "m.npz"
    with pytest.raises(InvalidArgumentError, match="100000 characters.*at most 65535 bytes"):
        export_checkpoint(prefix, out)
    with pytest.raises(InvalidArgumentError, match="at most 65535 bytes"):
        npz_format.write(out, [("b" * 70_000, np.zeros(2))])
    assert _listing(tmp_path / "out") == []


@pytest.mark.parametrize("offset", [2**63, 2**64 - 16, 1 << 40], ids=["2**63", "2**64-16", "past-the-end"])
def test_an_entry_at_an_impossible_offset_is_refused_when_exported_to_safetensors(tmp_path, offset):
    from restorekit._bundle.protos import BundleEntry
    from restorekit._bundle.writer import BundleWriter

    prefix = str(tmp_path / "src" / "m")
    with BundleWriter(prefix) as w:
        w.add("ok", np.arange(4, dtype=np.float32))
        w.add_entry_only("bad", BundleEntry(dtype=1, shape=(2,), offset=offset, size=8, crc32c=0))
    out = tmp_path / "out" / "m.safetensors"
    with pytest.raises(CorruptCheckpointError, match="'bad' needs bytes"):
        export_checkpoint(prefix, out)
    assert _listing(tmp_path / "out") == []


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_tf_data_shard_that_is_a_fifo_is_refused_unopened_when_exported(tmp_path, suffix):
    from conftest import Sentinel

    prefix = write_bundle(tmp_path / "src" / "m", {"a": np.arange(4, dtype=np.float32)})
    shard = prefix + ".data-00000-of-00001"
    os.remove(shard)
    sentinel = Sentinel(shard)  # a reader that opened it would see an empty shard (and, unguarded, block)
    try:
        with pytest.raises(CorruptCheckpointError, match="FIFO"):
            export_checkpoint(prefix, tmp_path / "out" / f"m{suffix}")
    finally:
        sentinel.close()
    assert not sentinel.opened
    assert _listing(tmp_path / "out") == []
