"""Keras files to safetensors by kernel copy of their stored bytes (KerasCheckpoint.stored_range in
restorekit/keras_files, copy_unchecked_run in restorekit/formats/_rawcopy.py, the safetensors writer):
values equal to h5py's, plain datasets copied, the others decoded, bad ranges refused with nothing written."""

import os

import h5py
import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import requires_torch
import restorekit
from restorekit.errors import CorruptCheckpointError
from restorekit.formats import _rawcopy as rawcopy
from restorekit.formats import safetensors as st
from restorekit.layouts import _planned as sources
from restorekit.keras_files import KerasCheckpoint


def model(dtype=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(3, name="enc1", dtype=dtype)(inputs))
    m = keras.Model(inputs, keras.layers.Dense(2, name="head")(x), name="net")
    m.compile(optimizer="adam", loss="mse")
    m.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
    return m


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keras")
    m = model()
    m.save_weights(tmp / "m.weights.h5")
    m.save(tmp / "m.keras")
    return tmp


def h5_values(path) -> dict:
    """Readable path -> the value h5py reads, in native byte order (for a .keras: its weights member)."""
    ckpt = KerasCheckpoint(path)
    out = {}
    with ckpt._h5() as f:
        for key in ckpt.entries:
            value = np.asarray(f[key][()])
            out[ckpt.readable_name(key)] = value.astype(value.dtype.newbyteorder("="))
    return out


def converted(src, out, *, decoded=False, monkeypatch=None):
    """Convert ``src`` to safetensors; ``decoded``: with every tensor read through h5py, as before raw copies."""
    if decoded:
        monkeypatch.setattr(sources._KerasSource, "stored_range", lambda self, name: None)
    restorekit.convert(src, out)
    if decoded:
        monkeypatch.undo()
    return out


@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_stored_bytes_are_copied_and_load_with_safetensors_equal_to_h5py(saved, tmp_path, name, monkeypatch):
    ckpt = KerasCheckpoint(saved / name)
    assert all(ckpt.stored_range(key) is not None for key in ckpt.entries)
    path, offset, size = ckpt.stored_range("enc1/kernel")
    assert path == str(saved / name) and size == 4 * 3 * 4
    with open(path, "rb") as f:
        f.seek(offset)
        np.testing.assert_array_equal(np.frombuffer(f.read(size), "<f4").reshape(4, 3), ckpt.read("enc1/kernel"))

    # No tensor is read through h5py: every one is copied as stored.
    monkeypatch.setattr(KerasCheckpoint, "read_many", lambda self, names: pytest.fail(f"decoded {names}"))
    out = converted(saved / name, tmp_path / "raw.safetensors")
    monkeypatch.undo()
    stored = load_file(out)
    expected = h5_values(saved / name)
    assert stored.keys() == expected.keys() and stored["optimizer/vars/0"].dtype == np.int64  # the iteration
    for key, value in expected.items():
        assert stored[key].dtype == value.dtype, key
        np.testing.assert_array_equal(stored[key], value, err_msg=key)

    # The same file as the decoding writer makes: names, dtypes, shapes, metadata and layout record.
    before = st.read_header(converted(saved / name, tmp_path / "decoded.safetensors", decoded=True,
                                      monkeypatch=monkeypatch))
    after = st.read_header(out)
    assert after.metadata == before.metadata and after.record == before.record
    assert {n: (i.dtype, i.shape) for n, i in after.tensors.items()} == {
        n: (i.dtype, i.shape) for n, i in before.tensors.items()}


def rewrite(path, key, **options):
    """Store dataset ``key`` of an h5 file again with h5py ``create_dataset`` options (chunks, compression, dtype)."""
    with h5py.File(path, "r+") as f:
        value, attrs = f[key][()], dict(f[key].attrs)
        del f[key]
        dtype = options.pop("dtype", value.dtype)
        ds = f.create_dataset(key, data=value.astype(dtype), dtype=dtype, **options)
        ds.attrs.update(attrs)


def test_chunked_compressed_and_big_endian_datasets_are_decoded(saved, tmp_path):
    src = tmp_path / "mixed.weights.h5"
    src.write_bytes((saved / "m.weights.h5").read_bytes())
    ckpt = KerasCheckpoint(src)
    kernel, bias, gamma = (ckpt.object_paths[p] for p in ("enc1/kernel", "enc1/bias", "bn/gamma"))
    rewrite(src, kernel, chunks=(2, 3), compression="gzip")
    rewrite(src, bias, chunks=(3,))
    rewrite(src, gamma, dtype=">f4")
    with h5py.File(src, "r") as f:
        assert f[gamma].dtype.byteorder == ">" and f[kernel].compression == "gzip"
    ckpt = KerasCheckpoint(src)
    plain = {ckpt.readable_name(k) for k in ckpt.entries if ckpt.stored_range(k) is not None}
    assert not {"enc1/kernel", "enc1/bias", "bn/gamma"} & plain
    assert {"head/kernel", "bn/beta", "bn/moving_mean"} <= plain

    out = converted(src, tmp_path / "mixed.safetensors")
    stored, expected = load_file(out), h5_values(src)
    assert stored.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(stored[key], value, err_msg=key)
    assert stored["bn/gamma"].dtype == np.float32 and st.read_header(out).tensors["bn/gamma"].dtype == "F32"


def test_unwritten_dataset_is_decoded_to_its_fill_value(saved, tmp_path):
    src = tmp_path / "unwritten.weights.h5"
    src.write_bytes((saved / "m.weights.h5").read_bytes())
    key = KerasCheckpoint(src).object_paths["head/bias"]
    with h5py.File(src, "r+") as f:
        del f[key]
        f.create_dataset(key, shape=(2,), dtype="float32", fillvalue=7.0)  # no storage allocated
    ckpt = KerasCheckpoint(src)
    assert ckpt.stored_range("head/bias") is None and ckpt.stored_range("head/kernel") is not None
    stored = load_file(converted(src, tmp_path / "u.safetensors"))
    np.testing.assert_array_equal(stored["head/bias"], [7.0, 7.0])


@pytest.mark.parametrize("reader", [pytest.param("numpy", id="safetensors_numpy"),
                                    pytest.param("torch", id="safetensors_torch", marks=requires_torch)])
def test_bfloat16_is_copied_as_its_stored_bits(tmp_path, reader):
    m = model(dtype="bfloat16")
    m.save_weights(tmp_path / "bf.weights.h5")
    ckpt = KerasCheckpoint(tmp_path / "bf.weights.h5")
    assert ckpt["enc1/kernel"].dtype == "bfloat16" and ckpt.stored_range("enc1/kernel") is not None
    out = converted(tmp_path / "bf.weights.h5", tmp_path / "bf.safetensors")
    if reader == "numpy":  # safetensors reads BF16 as ml_dtypes.bfloat16: compare the bits
        stored = load_file(out)
        assert stored["enc1/kernel"].dtype.name == "bfloat16"
        np.testing.assert_array_equal(stored["enc1/kernel"].view(np.uint16), ckpt.read("enc1/kernel").view(np.uint16))
        np.testing.assert_array_equal(stored["head/kernel"], ckpt.read("head/kernel"))
        return
    import torch
    from safetensors.torch import load_file as load_torch

    stored = load_torch(out)
    assert stored["enc1/kernel"].dtype == torch.bfloat16
    np.testing.assert_array_equal(stored["enc1/kernel"].float().numpy(), ckpt.read("enc1/kernel").astype(np.float32))
    np.testing.assert_array_equal(stored["head/kernel"].numpy(), ckpt.read("head/kernel"))


@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"], ids=["weights_h5", "keras_archive"])
def test_a_dataset_past_the_end_of_the_file_is_refused_and_nothing_written(saved, tmp_path, name, monkeypatch):
    # HDF5 itself refuses a dataset past the file's allocated end when it opens it (and a
    # file shorter than that when it opens the file), so the bound is met by what h5py
    # says here: an h5py that did not check is stood in for.
    import restorekit.keras_files._reader as keras_files

    src = tmp_path / name
    src.write_bytes((saved / name).read_bytes())
    plain = keras_files._stored_range
    member = os.path.getsize(src) if name.endswith(".h5") else KerasCheckpoint(src)._member[1]

    def past_the_end(h5py, file_id, data, standard):
        found = plain(h5py, file_id, data, standard)
        return (member - 4, found[1]) if found is not None and data.key == "layers/dense/vars/0" else found

    monkeypatch.setattr(keras_files, "_stored_range", past_the_end)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="layers/dense/vars/0.*past the end"):
        restorekit.convert(src, tmp_path / "bad.safetensors")
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        KerasCheckpoint(src).stored_range("head/kernel")
    assert sorted(os.listdir(tmp_path)) == before


def test_a_file_cut_after_planning_is_refused_and_nothing_written(saved, tmp_path):
    src = tmp_path / "cut.weights.h5"
    src.write_bytes((saved / "m.weights.h5").read_bytes())
    source = sources.keras_source(KerasCheckpoint(src))
    _, offset, _ = source.stored_range("head/kernel")  # the ranges are known from here on
    os.truncate(src, offset)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        st.write_checkpoint(source, tmp_path / "cut.safetensors")
    assert sorted(os.listdir(tmp_path)) == before


def test_the_copy_checks_bounds_itself_and_copies_through_a_buffer_where_the_kernel_will_not(saved, tmp_path, monkeypatch):
    src = saved / "m.weights.h5"
    _, offset, size = KerasCheckpoint(src).stored_range("enc1/kernel")
    expected = src.read_bytes()[offset: offset + size]
    handles = {}
    try:
        with open(tmp_path / "out", "wb", buffering=0) as out:
            past = rawcopy.UncheckedRange(str(src), os.path.getsize(src) - 4, 8)
            with pytest.raises(CorruptCheckpointError, match="truncated"):
                rawcopy.copy_unchecked_run([("x", past)], out, handles)
            assert out.tell() == 0

            def refuse(*args):
                raise OSError(18, "Invalid cross-device link")

            monkeypatch.setattr(os, "copy_file_range", refuse)
            rawcopy.copy_unchecked_run([("k", rawcopy.UncheckedRange(str(src), offset, size))], out, handles)
    finally:
        for handle in handles.values():
            handle.close()
    assert (tmp_path / "out").read_bytes() == expected
