"""Tests for restorekit/export: safetensors, torch and npz, both directions, bit-exact."""

import json
import os
import pickle
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from restorekit._bundle.writer import BundleWriter, array_chunks
from restorekit._checkpoint import Checkpoint
from restorekit.errors import (
    ChecksumMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MissingDependencyError,
    NameCollisionError,
    OutputExistsError,
    RestoreKitWarning,
)
from restorekit.export import convert, export_checkpoint, import_checkpoint
from restorekit.formats import safetensors as st_package
from restorekit.formats.safetensors import _writer as st_format
from restorekit.formats import npz as npz_format
from restorekit.layouts import guess_tf_names
from conftest import requires_torch, write_bundle

FORMATS = ["safetensors", pytest.param("torch", marks=requires_torch)]
LAYOUTS = [None, "torch"]


def _values():
    rng = np.random.RandomState(0)
    return {
        "dense/kernel": rng.randn(4, 3).astype(np.float32),
        "dense/bias": rng.randn(3).astype(np.float32),
        "conv/weights": rng.randn(3, 3, 2, 5).astype(ml_dtypes.bfloat16),
        "conv1d/kernel": rng.randn(5, 2, 4).astype(np.float16),
        "conv/biases": rng.randn(5).astype(ml_dtypes.bfloat16),
        "bn/gamma": rng.randn(5).astype(np.float32),
        "bn/beta": rng.randn(5).astype(np.float32),
        "bn/moving_mean": rng.randn(5).astype(np.float64),
        "bn/moving_variance": rng.rand(5).astype(np.float64),
        "emb/embeddings": rng.randn(6, 2).astype(np.float32),
        "model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE": rng.randn(2, 3).astype(np.float32),
        "mask": np.array([[True, False], [False, True]]),
        "counts": rng.randint(-100, 100, size=(7,)).astype(np.int8),
        "ids": rng.randint(0, 60000, size=(3,)).astype(np.uint16),
        "z64": (rng.randn(3) + 1j * rng.randn(3)).astype(np.complex64),
        "z128": (rng.randn(2, 2) + 1j * rng.randn(2, 2)).astype(np.complex128),
        "nan": np.array([np.nan, -0.0, np.inf], dtype=np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "global_step": np.int64(1234),
        "vocab": np.array([b"a\x00b", b"", "\u00e9".encode()], dtype=object),
    }


def _write(prefix, values, *, qint8=None):
    with BundleWriter(prefix) as writer:
        for name, value in values.items():
            writer.add(name, value)
        if qint8 is not None:
            writer.add_stream("quantized", "qint8", qint8.shape, array_chunks(qint8))
    return str(prefix)


@pytest.fixture
def rich_checkpoint(tmp_path):
    """Every dtype and layer kind the exporters treat specially, written without TF."""
    qint8 = np.arange(-4, 4, dtype=np.int8).reshape(2, 4)
    return _write(tmp_path / "src" / "model.ckpt", _values(), qint8=qint8)


def assert_same_checkpoint(a, b):
    a, b = Checkpoint(a), Checkpoint(b)
    assert list(a.entries) == list(b.entries)
    for name, entry in a.entries.items():
        other = b.entries[name]
        assert (other.dtype, other.shape) == (entry.dtype, entry.shape), name
        x, y = a.read(name), b.read(name)
        if x.dtype == object:
            assert x.tolist() == y.tolist(), name
        else:
            assert x.tobytes() == y.tobytes(), name


def _listing(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ------------------------------------------------------------------ round trips

@pytest.mark.parametrize("layout", LAYOUTS, ids=["tf-layout", "torch-layout"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_through_file_is_bit_exact(rich_checkpoint, tmp_path, fmt, layout):
    out = tmp_path / f"model.{'pt' if fmt == 'torch' else fmt}"
    result = export_checkpoint(rich_checkpoint, out, layout=layout)
    assert result.format == fmt and result.strings == ("vocab",)
    back = import_checkpoint(out, tmp_path / "back" / "model.ckpt")
    assert back.count == len(Checkpoint(rich_checkpoint))
    assert_same_checkpoint(rich_checkpoint, tmp_path / "back" / "model.ckpt")


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tf-layout", "torch-layout"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_streaming_write_api_round_trip(rich_checkpoint, tmp_path, fmt, layout):
    """write(path, iterator) (what CheckpointEditor.save uses) round-trips like the fast path."""
    from restorekit.formats import torch as torch_format

    ckpt = Checkpoint(rich_checkpoint)
    module = st_format if fmt == "safetensors" else torch_format
    out = tmp_path / "model.out"
    module.write(out, ((n, ckpt.read(n)) for n in ckpt.entries if n != "quantized"), layout=layout)
    import_checkpoint(out, tmp_path / "back")
    expected = _write(tmp_path / "expected", _values())
    assert_same_checkpoint(expected, tmp_path / "back")


@pytest.mark.parametrize(
    "reserve, compact_below",
    [(256 << 10, 64 << 20), (256 << 10, 0), (16, 0)],
    ids=["small-file-rewritten-compact", "header-in-reserved-room", "header-overflows-reserved-room"],
)
def test_safetensors_streaming_header_placement(rich_checkpoint, tmp_path, monkeypatch, reserve, compact_below):
    monkeypatch.setattr(st_format, "_RESERVE", reserve)
    monkeypatch.setattr(st_format, "_COMPACT_BELOW", compact_below)
    ckpt = Checkpoint(rich_checkpoint)
    out = tmp_path / "m.safetensors"
    # Plain arrays cannot say 'qint8' (numpy reads it as int8): leave it out here.
    st_format.write(out, ((n, ckpt.read(n)) for n in ckpt.entries if n != "quantized"))
    header = st_package.read_header(out)
    assert header.data_start % 8 == 0
    if reserve > 16 and compact_below == 0:
        assert header.data_start == 8 + reserve
    import_checkpoint(out, tmp_path / "back")
    assert_same_checkpoint(_write(tmp_path / "expected", _values()), tmp_path / "back")


def test_tf_written_checkpoint_round_trips_and_tf_reads_the_result(small_checkpoint, tmp_path):
    import tensorflow as tf

    prefix, values = small_checkpoint
    convert(prefix, tmp_path / "m.safetensors", layout="torch")
    convert(tmp_path / "m.safetensors", tmp_path / "back" / "model.ckpt")
    assert_same_checkpoint(prefix, tmp_path / "back" / "model.ckpt")
    reader = tf.train.load_checkpoint(str(tmp_path / "back" / "model.ckpt"))
    for name, value in values.items():
        assert reader.get_tensor(name).tobytes() == np.asarray(value).tobytes(), name


def test_tf_checkpoint_to_tf_copies_exactly(rich_checkpoint, tmp_path):
    convert(rich_checkpoint, tmp_path / "copy" / "model.ckpt", to="tf")
    assert_same_checkpoint(rich_checkpoint, tmp_path / "copy" / "model.ckpt")


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_to_file_conversion_keeps_tf_names(rich_checkpoint, tmp_path, fmt):
    first = tmp_path / "a.safetensors"
    export_checkpoint(rich_checkpoint, first, layout="torch")
    second = tmp_path / ("b.pt" if fmt == "torch" else "b.safetensors")
    convert(first, second, layout="torch")
    import_checkpoint(second, tmp_path / "back")
    assert_same_checkpoint(rich_checkpoint, tmp_path / "back")


# ------------------------------------------------------------------ what the files hold

def test_torch_layout_permutes_kernels_and_renames(rich_checkpoint, tmp_path):
    ckpt = Checkpoint(rich_checkpoint)
    out = tmp_path / "m.safetensors"
    result = export_checkpoint(ckpt, out, layout="torch")
    stored = dict(st_package.read(out))
    assert "dense.weight" in stored and "bn.running_var" in stored and "conv.bias" in stored
    assert "model.layer_with_weights-0.weight" in stored
    np.testing.assert_array_equal(stored["dense.weight"], ckpt.read("dense/kernel").T)
    assert stored["conv.weight"].dtype == ml_dtypes.bfloat16
    assert stored["conv.weight"].tobytes() == np.transpose(ckpt.read("conv/weights"), (3, 2, 0, 1)).copy().tobytes()
    assert stored["conv1d.weight"].shape == (4, 2, 5)
    # Embedding tables keep their layout; norm parameters only change names.
    np.testing.assert_array_equal(stored["emb.weight"], ckpt.read("emb/embeddings"))
    np.testing.assert_array_equal(stored["bn.weight"], ckpt.read("bn/gamma"))
    assert set(result.permuted) == {
        "dense/kernel", "conv/weights", "conv1d/kernel", "model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    }
    # A Dense layer computes the same in both conventions: x @ kernel == x @ weight.T.
    x = np.random.RandomState(1).randn(2, 4).astype(np.float32)
    np.testing.assert_array_equal(x @ ckpt.read("dense/kernel"), x @ stored["dense.weight"].T)


def test_safetensors_file_loads_with_the_safetensors_library(tmp_path):
    from safetensors.numpy import load_file

    values = {k: v for k, v in _values().items() if v.dtype not in (object, ml_dtypes.bfloat16, np.complex128)}
    prefix = _write(tmp_path / "plain", values)
    export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    loaded = load_file(str(tmp_path / "m.safetensors"))
    assert loaded["dense.weight"].tobytes() == values["dense/kernel"].T.copy().tobytes()
    assert loaded["global_step"].shape == () and loaded["global_step"] == 1234
    assert loaded["nan"].tobytes() == values["nan"].tobytes()


@requires_torch
def test_safetensors_file_loads_with_safetensors_torch(rich_checkpoint, tmp_path):
    import torch

    from safetensors.torch import load_file

    export_checkpoint(rich_checkpoint, tmp_path / "m.safetensors", layout="torch")
    loaded = load_file(str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint(rich_checkpoint)
    assert loaded["conv.weight"].dtype == torch.bfloat16
    bits = loaded["conv.weight"].view(torch.int16).numpy().tobytes()
    assert bits == np.transpose(ckpt.read("conv/weights"), (3, 2, 0, 1)).copy().tobytes()
    assert loaded["quantized"].dtype == torch.int8
    lin = torch.nn.Linear(4, 3)
    lin.load_state_dict({"weight": loaded["dense.weight"], "bias": loaded["dense.bias"]})
    x = np.random.RandomState(2).randn(2, 4).astype(np.float32)
    expected = x @ ckpt.read("dense/kernel") + ckpt.read("dense/bias")
    np.testing.assert_allclose(lin(torch.from_numpy(x)).detach().numpy(), expected, rtol=1e-6)


@requires_torch
def test_torch_state_dict_loads_into_modules(tmp_path):
    import torch

    rng = np.random.RandomState(3)
    values = {
        "bn/gamma": rng.rand(4).astype(np.float32),
        "bn/beta": rng.rand(4).astype(np.float32),
        "bn/moving_mean": rng.rand(4).astype(np.float32),
        "bn/moving_variance": rng.rand(4).astype(np.float32),
        "conv/kernel": rng.randn(3, 3, 2, 4).astype(np.float32),
        "conv/bias": rng.randn(4).astype(np.float32),
    }
    prefix = _write(tmp_path / "m", values)
    export_checkpoint(prefix, tmp_path / "m.pt", layout="torch")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    model = torch.nn.ModuleDict({"conv": torch.nn.Conv2d(2, 4, 3), "bn": torch.nn.BatchNorm2d(4)})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"bn.num_batches_tracked"}
    assert model["bn"].running_var.numpy().tobytes() == values["bn/moving_variance"].tobytes()


def test_string_tensors_travel_in_metadata(rich_checkpoint, tmp_path):
    out = tmp_path / "m.safetensors"
    export_checkpoint(rich_checkpoint, out)
    header = st_package.read_header(out)
    assert "vocab" not in header.tensors
    assert json.loads(header.metadata["restorekit"])["strings"]["vocab"]["shape"] == [3]
    assert header.metadata["format"] == "tf"


def test_npz_holds_tf_names_with_exact_values(rich_checkpoint, tmp_path):
    export_checkpoint(rich_checkpoint, tmp_path / "m.npz")
    ckpt = Checkpoint(rich_checkpoint)
    with np.load(tmp_path / "m.npz", allow_pickle=False) as data:
        assert sorted(data.files) == sorted([*ckpt.entries, "__restorekit__"])
        assert data["dense/kernel"].tobytes() == ckpt.read("dense/kernel").tobytes()
        # bfloat16 is stored as its bits (a .npy header cannot name it); the record says so.
        assert data["conv/weights"].dtype == np.uint16
        assert data["conv/weights"].tobytes() == ckpt.read("conv/weights").tobytes()
        assert '"conv/weights":{"dtype":"bfloat16"}' in str(data["__restorekit__"])
        assert data["vocab"].tolist() == [b"a\x00b", b"", "\u00e9".encode()]


def test_npz_write_streams_an_iterator(tmp_path):
    arrays = ((f"t{i}", np.full((3,), i, np.int32)) for i in range(4))
    result = npz_format.write(tmp_path / "x.npz", arrays)
    assert result.count == 4
    assert dict(npz_format.read(tmp_path / "x.npz"))["t3"].tolist() == [3, 3, 3]


# ------------------------------------------------------------------ files from elsewhere

def test_foreign_safetensors_maps_back_to_keras_names_with_layout_torch(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.RandomState(4)
    weight = rng.randn(3, 4).astype(np.float32)
    conv = rng.randn(8, 2, 3, 3).astype(np.float32)
    tensors = {
        "fc.weight": weight,
        "fc.bias": rng.randn(3).astype(np.float32),
        "conv.weight": conv,
        "bn.weight": rng.randn(8).astype(np.float32),
        "bn.bias": rng.randn(8).astype(np.float32),
        "bn.running_mean": rng.randn(8).astype(np.float32),
        "bn.running_var": rng.rand(8).astype(np.float32),
    }
    save_file(tensors, str(tmp_path / "foreign.safetensors"))
    import_checkpoint(tmp_path / "foreign.safetensors", tmp_path / "keras", layout="torch")
    ckpt = Checkpoint(tmp_path / "keras")
    assert sorted(ckpt.entries) == [
        "bn/beta", "bn/gamma", "bn/moving_mean", "bn/moving_variance", "conv/kernel", "fc/bias", "fc/kernel"
    ]
    np.testing.assert_array_equal(ckpt.read("fc/kernel"), weight.T)
    np.testing.assert_array_equal(ckpt.read("conv/kernel"), np.transpose(conv, (2, 3, 1, 0)))
    import_checkpoint(tmp_path / "foreign.safetensors", tmp_path / "as_is")
    assert sorted(Checkpoint(tmp_path / "as_is").entries) == sorted(tensors)


def test_guesses_that_shapes_contradict_or_cannot_confirm_are_warned_about_by_name():
    with pytest.warns(RestoreKitWarning) as caught:
        record = guess_tf_names({"layernorm.weight": (1, 264), "layernorm.bias": (264,), "rnn.proj.weight": (2, 100),
                                 "fc.weight": (3, 4), "fc.bias": (3,)})
    named = {note["name"]: note.get("perm") for note in record.tensors.values()}
    assert "layernorm/weight" in named and named["layernorm/weight"] is None  # not a [264, 1] 'kernel'
    assert named["fc/kernel"] == [1, 0] and named["rnn/proj/kernel"] == [1, 0]
    text = " ".join(str(w.message) for w in caught)
    assert "'layernorm/weight'" in text and "'rnn.proj.weight'" in text and "fc." not in text


def test_guess_refuses_two_names_onto_one():
    with pytest.raises(NameCollisionError):
        guess_tf_names({"a.weight": (2, 2), "a/weight": (2, 2), "a/kernel": (2, 2)})


# ------------------------------------------------------------------ bad input

def test_layout_collision_raises_before_writing(tmp_path):
    prefix = _write(tmp_path / "m", {"bn/gamma": np.ones(2, np.float32), "bn/weights": np.ones(2, np.float32)})
    with pytest.raises(NameCollisionError, match="'bn/gamma' and 'bn/weights'"):
        export_checkpoint(prefix, tmp_path / "out" / "m.safetensors", layout="torch")
    assert _listing(tmp_path / "out") == []


@pytest.mark.parametrize("fmt", ["safetensors", "npz", "pt"])
def test_missing_source_writes_nothing(tmp_path, fmt):
    with pytest.raises(CheckpointNotFoundError):
        convert(tmp_path / "nothing", tmp_path / "out" / f"m.{fmt}")
    with pytest.raises(CheckpointNotFoundError):
        import_checkpoint(tmp_path / f"nothing.{fmt}", tmp_path / "out" / "m.ckpt")
    assert _listing(tmp_path / "out") == []


@pytest.mark.parametrize(
    "content",
    [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json", b"\x02\x00\x00\x00\x00\x00\x00\x00{}extra",
     b"\x40\x00\x00\x00\x00\x00\x00\x00" + b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'.ljust(64)],
    ids=["empty", "header-not-json", "bytes-no-tensor-claims", "tensor-bytes-missing"],
)
def test_corrupt_safetensors_file_is_refused(tmp_path, content):
    src = tmp_path / "bad.safetensors"
    src.write_bytes(content)
    with pytest.raises(CorruptCheckpointError):
        import_checkpoint(src, tmp_path / "out" / "m.ckpt")
    assert _listing(tmp_path / "out") == []


def test_corrupt_shard_leaves_no_output(rich_checkpoint, tmp_path):
    ckpt = Checkpoint(rich_checkpoint)
    entry = ckpt.bundle_entry("dense/kernel")
    shard = ckpt.data_file(entry.shard_id)
    with open(shard, "r+b") as f:
        f.seek(entry.offset)
        byte = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    for fmt in ["safetensors", "npz"]:
        with pytest.raises(ChecksumMismatchError):
            export_checkpoint(rich_checkpoint, tmp_path / "out" / f"m.{fmt}")
    assert _listing(tmp_path / "out") == []


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_files(tmp_path):
    marker = tmp_path / "pwned"
    raw = tmp_path / "evil_raw.pt"
    with open(raw, "wb") as f:
        pickle.dump({"w": _Evil(marker)}, f, protocol=2)
    files = [raw]
    try:
        import torch
    except ImportError:
        return marker, files
    zipped = tmp_path / "evil_zip.pt"
    torch.save({"w": torch.zeros(2), "x": _Evil(marker)}, zipped)
    return marker, files + [zipped]


@requires_torch
def test_unsafe_pickle_is_refused_and_nothing_runs(tmp_path):
    marker, files = _evil_files(tmp_path)
    assert len(files) == 2
    for path in files:
        with pytest.raises(CorruptCheckpointError, match="refusing to load"):
            import_checkpoint(path, tmp_path / "out" / "m.ckpt")
        with pytest.raises(CorruptCheckpointError):
            convert(path, tmp_path / "out" / "m.safetensors")
    assert not marker.exists()
    assert _listing(tmp_path / "out") == []


def test_pt_without_torch_names_the_extra_and_writes_nothing(tmp_path, monkeypatch):
    marker, files = _evil_files(tmp_path)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependencyError, match=r"restorekit\[torch\]"):
        import_checkpoint(files[0], tmp_path / "out" / "m.ckpt")
    with pytest.raises(MissingDependencyError, match=r"restorekit\[torch\]"):
        export_checkpoint(_write(tmp_path / "m", {"a": np.ones(1)}), tmp_path / "out" / "m.pt")
    assert not marker.exists()
    assert _listing(tmp_path / "out") == []


def test_unknown_target_format_and_layout_are_refused(rich_checkpoint, tmp_path):
    with pytest.raises(InvalidArgumentError, match="unknown format 'onnx'"):
        convert(rich_checkpoint, tmp_path / "out" / "m", to="onnx")
    with pytest.raises(InvalidArgumentError, match="unknown layout 'jax'"):
        convert(rich_checkpoint, tmp_path / "out" / "m.safetensors", layout="jax")
    assert _listing(tmp_path / "out") == []


def test_output_equal_to_source_is_refused(rich_checkpoint, tmp_path):
    before = {p: open(p, "rb").read() for p in [rich_checkpoint + ".index"]}
    with pytest.raises(OutputExistsError, match="its own source"):
        convert(rich_checkpoint, rich_checkpoint, to="tf", overwrite=True)
    with pytest.raises(OutputExistsError, match="its own source"):
        export_checkpoint(rich_checkpoint, rich_checkpoint + ".index", format="safetensors", overwrite=True)
    export_checkpoint(rich_checkpoint, tmp_path / "m.safetensors")
    with pytest.raises(OutputExistsError, match="its own source"):
        convert(tmp_path / "m.safetensors", tmp_path / "m.safetensors", overwrite=True)
    assert {p: open(p, "rb").read() for p in before} == before
    Checkpoint(rich_checkpoint).read("dense/kernel")  # still readable


def test_existing_output_needs_overwrite(rich_checkpoint, tmp_path):
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputExistsError, match="overwrite"):
        export_checkpoint(rich_checkpoint, out)
    assert out.read_bytes() == b"keep me"
    export_checkpoint(rich_checkpoint, out, overwrite=True)
    assert st_package.read_header(out).tensors


def test_bad_metadata_is_refused_before_writing(tmp_path):
    with pytest.raises(InvalidArgumentError, match="reserved"):
        st_format.write(tmp_path / "m.safetensors", [("a", np.ones(1))], metadata={"restorekit": "x"})
    with pytest.raises(InvalidArgumentError, match="str to str"):
        st_format.write(tmp_path / "m.safetensors", [("a", np.ones(1))], metadata={"n": 1})
    assert _listing(tmp_path) == []


def test_import_restorekit_loads_neither_torch_nor_safetensors():
    code = (
        "import sys, restorekit, restorekit.export, restorekit.cli;"
        "import restorekit.formats.safetensors, restorekit.formats.torch, restorekit.formats.npz;"
        "bad = [m for m in ('torch', 'safetensors', 'tensorflow') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _contiguous_checkpoint(tmp_path):
    rng = np.random.RandomState(5)
    values = {f"layer_{i}/kernel": rng.randn(64, 32).astype(np.float32) for i in range(5)}
    return write_bundle(tmp_path / "src" / "model.ckpt", values), values


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "no in-kernel copy"])
def test_export_copies_back_to_back_tensors_exactly(tmp_path, monkeypatch, kernel_copy):
    from safetensors.numpy import load_file

    calls = []
    real = os.copy_file_range

    def copy_file_range(*args):
        calls.append(args)
        if not kernel_copy:
            raise OSError(18, "Invalid cross-device link")
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    prefix, values = _contiguous_checkpoint(tmp_path)
    out = tmp_path / "out" / "model.safetensors"
    st_format.write_checkpoint(Checkpoint(prefix), str(out))
    got = load_file(str(out))
    assert sorted(got) == sorted(values)
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value)
    assert calls  # the five back-to-back tensors went to the kernel as one run


def test_export_of_a_corrupt_tensor_inside_a_run_writes_nothing(tmp_path):
    prefix, _ = _contiguous_checkpoint(tmp_path)
    ckpt = Checkpoint(prefix)
    entry = ckpt.bundle_entry("layer_2/kernel")
    with open(ckpt.data_file(0), "r+b") as f:
        f.seek(entry.offset + 10)
        byte = f.read(1)
        f.seek(entry.offset + 10)
        f.write(bytes([byte[0] ^ 0x55]))
    out = tmp_path / "out"
    with pytest.raises(ChecksumMismatchError, match="layer_2/kernel"):
        st_format.write_checkpoint(Checkpoint(prefix), str(out / "model.safetensors"))
    assert _listing(out) == []


def test_kernel_copy_that_stops_part_way_is_finished_through_a_buffer(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    real = os.copy_file_range
    calls = []

    def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
        calls.append(count)
        if len(calls) > 3:
            raise OSError(5, "Input/output error")
        return real(src, dst, count, offset_src)

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    monkeypatch.setattr(st_format._KernelCopy, "_STEP", 1000)  # 3 steps of 1000 bytes, then a failure
    prefix, values = _contiguous_checkpoint(tmp_path)
    out = tmp_path / "out" / "model.safetensors"
    st_format.write_checkpoint(Checkpoint(prefix), str(out))
    assert calls[:3] == [1000, 1000, 1000] and len(calls) == 4
    got = load_file(str(out))
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value)


def test_export_lays_data_out_in_shard_order_and_lists_names_in_index_order(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    rng = np.random.RandomState(6)
    values = {name: rng.randn(40, 8).astype(np.float32) for name in ("zeta/w", "alpha/w", "mid/w", "beta/w")}
    prefix = write_bundle(tmp_path / "src" / "model.ckpt", values)  # shard order: zeta, alpha, mid, beta
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *args: calls.append(args[2]) or real(*args))
    out = str(tmp_path / "model.safetensors")
    st_format.write_checkpoint(Checkpoint(prefix), out)
    with open(out, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__")
    assert list(header) == ["alpha/w", "beta/w", "mid/w", "zeta/w"]
    by_offset = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    assert by_offset == list(values)  # the shard's order, so the copy is one run
    assert calls == [4 * 40 * 8 * 4]
    got = load_file(out)
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value)


def test_large_export_starts_its_data_where_the_kernel_copies_fastest(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    monkeypatch.setattr(st_format, "_FOLIO_ABOVE", 1)  # as for a checkpoint over 64 MiB
    prefix, values = _contiguous_checkpoint(tmp_path)
    out = tmp_path / "model.safetensors"
    st_format.write_checkpoint(Checkpoint(prefix), str(out))
    header = st_package.read_header(out)
    assert header.data_start == st_format._FOLIO  # source run starts at 0 in its shard
    assert os.path.getsize(out) == st_format._FOLIO + sum(v.nbytes for v in values.values())
    got = load_file(str(out))
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value)


def test_small_export_keeps_the_formats_8_byte_alignment(tmp_path):
    prefix, values = _contiguous_checkpoint(tmp_path)
    out = tmp_path / "model.safetensors"
    st_format.write_checkpoint(Checkpoint(prefix), str(out))
    header = st_package.read_header(out)
    assert header.data_start % 8 == 0 and header.data_start < 4096


def test_copy_alignment_follows_the_heaviest_run_and_only_8_byte_offsets():
    from types import SimpleNamespace as Entry

    def step(shard_offset, size):
        raw = None if shard_offset is None else Entry(shard_id=0, offset=shard_offset, size=size)
        return ("n", "n", "F32", (), None, raw, size)

    def alignment(plan):
        return st_format._copy_alignment(st_format._groups(plan))

    big = st_format._FOLIO_ABOVE
    # a 16-byte decoded tensor first, then a big run that starts at 64 in its shard
    assert alignment([step(None, 16), step(64, big)]) == 64 - 16
    assert alignment([step(0, big)]) == st_format._FOLIO
    assert alignment([step(0, big), step(None, 12)]) == st_format._FOLIO  # decoded ones go last
    assert alignment([step(None, 3), step(64, big)]) == 0  # 61: not 8-byte aligned
    assert alignment([step(0, big - 1)]) == 0  # too small to be worth the padding


def test_padding_never_takes_the_header_past_the_formats_limit(monkeypatch):
    entries = [("w", "F32", (2,), 0, 8)]
    plain = st_format._encode_header(entries, {})
    padded = st_format._encode_header(entries, {}, start=st_format._FOLIO)
    assert len(padded) == st_format._FOLIO
    monkeypatch.setattr(st_format, "_MAX_HEADER", len(padded) - 8 - 1)  # the padded header would not fit
    header = st_format._encode_header(entries, {}, start=st_format._FOLIO)
    assert header == plain  # 8-byte alignment instead of a header over the limit


def test_export_without_copy_file_range_copies_through_a_buffer(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    monkeypatch.delattr(os, "copy_file_range")  # as on macOS and Windows
    prefix, values = _contiguous_checkpoint(tmp_path)
    out = tmp_path / "model.safetensors"
    st_format.write_checkpoint(Checkpoint(prefix), str(out))
    got = load_file(str(out))
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value)


def test_export_of_a_checkpoint_with_two_shards_copies_one_run_per_shard(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from restorekit.edit import CheckpointEditor

    prefix, values = _contiguous_checkpoint(tmp_path)
    ed = CheckpointEditor(prefix)
    ed.set("layer_1/kernel", np.ones((64, 32), np.float32))  # saved into a second shard, the rest linked
    edited = ed.save(tmp_path / "edited" / "model.ckpt")
    assert Checkpoint(edited).header.num_shards == 2
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *args: calls.append(args[2]) or real(*args))
    out = tmp_path / "model.safetensors"
    st_format.write_checkpoint(Checkpoint(edited), str(out))
    size = 64 * 32 * 4
    # shard 0: layer_0, then layers 2-4 (the old layer_1 between them is skipped); shard 1: the new layer_1
    assert sorted(calls) == [size, size, 3 * size]
    got = load_file(str(out))
    values["layer_1/kernel"] = np.ones((64, 32), np.float32)
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value)


def test_interrupt_while_waiting_for_the_kernel_copy_stops_it_and_writes_nothing(tmp_path, monkeypatch):
    import threading
    import time

    real = os.copy_file_range

    def slow_copy(*args):
        time.sleep(0.02)
        return real(*args)

    def interrupted_wait(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "copy_file_range", slow_copy)
    monkeypatch.setattr(st_format._KernelCopy, "_STEP", 4096)  # 40 slow steps: still copying when interrupted
    monkeypatch.setattr(st_format._KernelCopy, "wait", interrupted_wait)
    prefix, _ = _contiguous_checkpoint(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        st_format.write_checkpoint(Checkpoint(prefix), str(out / "model.safetensors"))
    assert not [t for t in threading.enumerate() if t.name == "restorekit-copy"]
    assert _listing(out) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_of_a_remote_checkpoint_reads_its_shards_through_gfile(rich_checkpoint, tmp_path, fmt):
    import uuid

    tf = pytest.importorskip("tensorflow")
    from restorekit.edit import CheckpointEditor

    remote = CheckpointEditor(rich_checkpoint).save(f"ram://restorekit-export-{uuid.uuid4().hex[:8]}/model.ckpt")
    out = tmp_path / f"model.{'pt' if fmt == 'torch' else fmt}"
    export_checkpoint(remote, str(out))
    back = str(tmp_path / "back" / "model.ckpt")
    import_checkpoint(str(out), back)
    assert_same_checkpoint(rich_checkpoint, back)
    assert tf.io.gfile.exists(remote + ".index")


@requires_torch
def test_a_text_file_named_pt_gets_a_readable_error(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk\n")
    with pytest.raises(CorruptCheckpointError) as caught:
        import_checkpoint(str(junk), str(tmp_path / "out" / "m"))
    message = str(caught.value)
    assert "not a readable PyTorch file" in message and "\x1b" not in message
    assert not message.rstrip(")").split()[-1].isdigit()  # torch's bare magic number is not the explanation
    assert _listing(tmp_path / "out") == []


def test_layout_on_a_tf_to_tf_copy_is_refused_not_ignored(rich_checkpoint, tmp_path):
    with pytest.raises(InvalidArgumentError, match="layout"):
        convert(rich_checkpoint, str(tmp_path / "out" / "m"), to="tf", layout="torch")
    assert _listing(tmp_path / "out") == []


def test_foreign_embedding_tables_come_back_untransposed_as_embeddings(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.RandomState(8)
    tensors = {
        "bert.embeddings.word_embeddings.weight": rng.randn(50, 8).astype(np.float32),
        "model.embed_tokens.weight": rng.randn(40, 8).astype(np.float32),
        "transformer.wte.weight": rng.randn(30, 8).astype(np.float32),
        "proj.weight": rng.randn(3, 8).astype(np.float32),  # a Linear without bias: still a kernel
        "embed_proj.weight": rng.randn(4, 8).astype(np.float32),
        "embed_proj.bias": rng.randn(4).astype(np.float32),  # has a bias: a Linear, whatever its name
    }
    save_file(tensors, str(tmp_path / "lm.safetensors"))
    import_checkpoint(tmp_path / "lm.safetensors", tmp_path / "tf", layout="torch")
    ckpt = Checkpoint(tmp_path / "tf")
    np.testing.assert_array_equal(ckpt.read("bert/embeddings/word_embeddings/embeddings"),
                                  tensors["bert.embeddings.word_embeddings.weight"])
    np.testing.assert_array_equal(ckpt.read("model/embed_tokens/embeddings"), tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ckpt.read("transformer/wte/embeddings"), tensors["transformer.wte.weight"])
    np.testing.assert_array_equal(ckpt.read("proj/kernel"), tensors["proj.weight"].T)
    np.testing.assert_array_equal(ckpt.read("embed_proj/kernel"), tensors["embed_proj.weight"].T)
    back = tmp_path / "back.safetensors"
    export_checkpoint(str(tmp_path / "tf"), str(back), layout="torch")
    from safetensors.numpy import load_file

    again = load_file(str(back))
    for name, value in tensors.items():  # the round trip restores the file's own names and axes
        np.testing.assert_array_equal(again[name], value)


def test_linear_layers_named_like_embeddings_stay_kernels():
    record = guess_tf_names({"embed_out.weight": (50, 8), "transformer.embed_proj.weight": (4, 8),
                             "unembed.weight": (50, 8), "encoder.embed.weight": (30, 8)})
    named = {note["name"]: note.get("perm") for note in record.tensors.values()}
    assert named["embed_out/kernel"] and named["transformer/embed_proj/kernel"] and named["unembed/kernel"]
    assert "encoder/embed/embeddings" in named and named["encoder/embed/embeddings"] is None


_HPARAMS_MODULE = '''
import typing


class Metadata:
    def __init__(self, key_type):
        self.key_type = key_type


class AnyNode:
    def __init__(self, value):
        self._val = value


class DictConfig:
    """Pickled as omegaconf's is: __new__, then a state of nested objects and typing globals."""

    def __init__(self, content):
        self._content = {k: AnyNode(v) for k, v in content.items()}
        self._metadata = Metadata(typing.Any)


class Flags(dict):
    """A dict subclass: its items are set on it one by one."""
'''


def _lightning_files(tmp_path, monkeypatch):
    """A training checkpoint whose hyper-parameters are objects of a module that is gone when it is read."""
    import torch

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "hparams_lib_gone.py").write_text(_HPARAMS_MODULE)
    monkeypatch.syspath_prepend(str(lib))
    import hparams_lib_gone

    state = {"layer.weight": torch.randn(3, 4), "layer.bias": torch.randn(3)}
    marker = tmp_path / "pwned"
    good = tmp_path / "epoch=3.ckpt"
    torch.save({"epoch": 3, "global_step": 30, "state_dict": state, "optimizer_states": [],
                "hyper_parameters": {"cfg": hparams_lib_gone.DictConfig({"lr": 0.1})}}, good)
    torch.save({"state_dict": state, "hyper_parameters": {"hook": _Evil(marker)}}, tmp_path / "hook.ckpt")
    bad = tmp_path / "bad.pt"
    torch.save({"layer.weight": hparams_lib_gone.DictConfig({"not": "a tensor"}), "layer.bias": state["layer.bias"]}, bad)
    flags = tmp_path / "flags.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": hparams_lib_gone.Flags(lr=0.1)}, flags)
    monkeypatch.delitem(sys.modules, "hparams_lib_gone")
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    sys.path.remove(str(lib))
    return state, good, bad, flags, marker


@requires_torch
def test_a_training_checkpoint_with_unimportable_hyper_parameters_reads_its_state_dict(tmp_path, monkeypatch):
    state, good, _, _, marker = _lightning_files(tmp_path, monkeypatch)
    import torch

    with pytest.raises(pickle.UnpicklingError, match="hparams_lib_gone"):
        torch.load(good, weights_only=True)  # what torch itself says: the module's classes are not allowed
    import_checkpoint(good, tmp_path / "out" / "m.ckpt")
    back = Checkpoint(tmp_path / "out" / "m.ckpt")
    assert sorted(back.entries) == ["layer.bias", "layer.weight"]
    for name, tensor in state.items():
        np.testing.assert_array_equal(back.read(name), tensor.numpy())
    # the hyper-parameters' globals were built as empty stand-ins, never imported or called; torch still
    # refuses what it blocks outright (os.system), by name
    with pytest.raises(CorruptCheckpointError, match=r"calls .*'posix\.system'.*whose module posix is blocked"):
        import_checkpoint(tmp_path / "hook.ckpt", tmp_path / "out2" / "m.ckpt")
    assert not marker.exists() and not (tmp_path / "out2").exists()


@requires_torch
def test_an_unimportable_class_among_the_weights_is_refused_by_its_name(tmp_path, monkeypatch):
    _, _, bad, flags, _ = _lightning_files(tmp_path, monkeypatch)
    with pytest.raises(CorruptCheckpointError, match=r"the pickle calls 'hparams_lib_gone\.DictConfig'"):
        import_checkpoint(bad, tmp_path / "out" / "m.ckpt")
    # outside the weights, but of a kind torch's loader cannot build even as a stand-in: named, with torch's reason
    with pytest.raises(CorruptCheckpointError, match=r"calls 'hparams_lib_gone\.Flags', .* \(Can only SETITEM"):
        import_checkpoint(flags, tmp_path / "out" / "m.ckpt")
    assert _listing(tmp_path / "out") == []
