"""restorekit.formats.safetensors._shards: Hugging Face-style safetensors shards + index, written and read as one checkpoint."""

import json
import os

import numpy as np
import pytest

from conftest import requires_torch, save_variables
from restorekit._checkpoint import Checkpoint
from restorekit.cli import main
from restorekit.edit import CheckpointEditor
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, OutputExistsError
from restorekit.export import convert, export_checkpoint, import_checkpoint
from restorekit.formats import safetensors as st
from restorekit.formats.safetensors._shards import parse_size

KERNEL = 64 * 64 * 4  # bytes of one tensor below


@pytest.fixture
def five(tmp_path):
    rng = np.random.RandomState(0)
    values = {f"l{i}/kernel": rng.randn(64, 64).astype(np.float32) for i in range(5)}
    values["l0/bias"] = rng.randn(64).astype(np.float32)
    values["global_step"] = np.int64(3)
    return save_variables(tmp_path / "ckpt" / "model.ckpt", values), values


def _same(prefix, values):
    ckpt = Checkpoint(str(prefix))
    assert set(ckpt.entries) == set(values)
    for name, value in values.items():
        got = ckpt.read(name)
        assert got.dtype == np.asarray(value).dtype, name
        np.testing.assert_array_equal(got, value, err_msg=name)


def test_export_writes_shards_under_the_size_and_an_index_and_imports_back_bit_exact(five, tmp_path):
    prefix, values = five
    result = convert(prefix, tmp_path / "out", max_shard_size=2 * KERNEL + 300)
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"]
    assert result.count == len(values) and len(result.files) == 4
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(values)
    assert index["metadata"]["total_size"] == sum(np.asarray(v).nbytes for v in values.values())
    for name in names[:-1]:
        path = tmp_path / "out" / name
        tensor_bytes = sum(np.prod(s, dtype=np.int64) * 4 for s in st.read_shapes(path).values())
        assert tensor_bytes <= 2 * KERNEL + 300
        from safetensors.numpy import load_file  # the reference reader reads every shard

        assert set(load_file(str(path))) == {n for n, f in index["weight_map"].items() if f == name}
    for source in (tmp_path / "out", tmp_path / "out" / "model.safetensors.index.json"):
        back = tmp_path / f"back-{source.name}" / "model.ckpt"
        import_checkpoint(source, back)
        _same(back, values)


def test_one_shard_is_model_safetensors_without_an_index(five, tmp_path):
    prefix, values = five
    export_checkpoint(prefix, tmp_path / "out", max_shard_size="10GB")
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    convert(tmp_path / "out", tmp_path / "back" / "model.ckpt")
    _same(tmp_path / "back" / "model.ckpt", values)


def test_a_named_output_names_the_shards_and_a_tensor_over_the_limit_gets_a_shard_of_its_own(five, tmp_path):
    prefix, values = five
    convert(prefix, tmp_path / "o" / "weights.safetensors", max_shard_size=100)
    names = sorted(os.listdir(tmp_path / "o"))
    assert names[-1] == "weights.safetensors.index.json" and len(names) == len(values) + 1
    assert all(n.startswith("weights-") for n in names[:-1])
    convert(tmp_path / "o" / "weights.safetensors.index.json", tmp_path / "b" / "m.ckpt")
    _same(tmp_path / "b" / "m.ckpt", values)


def test_layout_torch_and_options_travel_through_shards(five, tmp_path):
    prefix, values = five
    result = convert(prefix, tmp_path / "out", max_shard_size=KERNEL, layout="torch", weights_only=True)
    assert "global_step" in result.dropped and len(result.permuted) == 5
    shapes = {}
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".safetensors"):
            shapes.update(st.read_shapes(tmp_path / "out" / name))
    assert "l3.weight" in shapes
    import_checkpoint(tmp_path / "out", tmp_path / "b" / "m.ckpt")
    _same(tmp_path / "b" / "m.ckpt", {k: v for k, v in values.items() if k != "global_step"})
    # file -> shards -> shards, and a rule set transposing on the way (the generic writer)
    convert(tmp_path / "out", tmp_path / "again", max_shard_size=3 * KERNEL, layout="torch")
    import_checkpoint(tmp_path / "again", tmp_path / "c" / "m.ckpt")
    _same(tmp_path / "c" / "m.ckpt", {k: v for k, v in values.items() if k != "global_step"})


def test_a_tf2_checkpoint_in_shards_keeps_its_object_graph(tmp_path):
    import tensorflow as tf

    module = tf.Module()
    module.a = tf.Variable(np.arange(4096, dtype=np.float32))
    module.b = tf.Variable(np.ones((32, 32), np.float32))
    prefix = tf.train.Checkpoint(net=module).write(str(tmp_path / "ckpt" / "c"))
    convert(prefix, tmp_path / "out", max_shard_size=5000)
    assert len(os.listdir(tmp_path / "out")) == 3
    import_checkpoint(tmp_path / "out", tmp_path / "back" / "c")
    fresh = tf.Module()
    fresh.a = tf.Variable(np.zeros(4096, np.float32))
    fresh.b = tf.Variable(np.zeros((32, 32), np.float32))
    tf.train.Checkpoint(net=fresh).read(str(tmp_path / "back" / "c")).assert_consumed()
    np.testing.assert_array_equal(fresh.a.numpy(), module.a.numpy())


@requires_torch  # transformers' GPT-2 model needs torch
def test_hugging_face_save_pretrained_shards_import_and_from_pretrained_reads_ours(tmp_path):
    import transformers  # in the [test] extra: a missing one is a broken setup, not a skip

    config = transformers.GPT2Config(vocab_size=30, n_positions=12, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=29, eos_token_id=29)
    model = transformers.GPT2Model(config)
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="8KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    convert(tmp_path / "hf", tmp_path / "tf" / "model.ckpt", rules="gpt2-hf-to-tf")
    ckpt = Checkpoint(str(tmp_path / "tf" / "model.ckpt"))
    np.testing.assert_array_equal(ckpt.read("model/h1/attn/c_attn/w")[0], model.h[1].attn.c_attn.weight.detach().numpy())
    # and back out in shards that transformers reads
    convert(tmp_path / "tf" / "model.ckpt", tmp_path / "hf2", rules="gpt2-tf-to-hf", max_shard_size="8KB",
            config={"n_head": 2})
    assert (tmp_path / "hf2" / "model.safetensors.index.json").exists() and (tmp_path / "hf2" / "config.json").exists()
    again, info = transformers.GPT2Model.from_pretrained(str(tmp_path / "hf2"), output_loading_info=True)
    assert not any(info.values())
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[name].numpy(), tensor.numpy(), err_msg=name)


def _sharded(five, tmp_path):
    prefix, _ = five
    convert(prefix, tmp_path / "out", max_shard_size=2 * KERNEL + 300)
    assert len(os.listdir(tmp_path / "out")) == 4  # 3 shards and the index
    return tmp_path / "out"


def test_a_missing_shard_is_a_clear_error_and_nothing_is_written(five, tmp_path):
    out = _sharded(five, tmp_path)
    os.remove(out / "model-00002-of-00003.safetensors")
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00003.safetensors"):
        import_checkpoint(out, tmp_path / "back" / "m.ckpt")
    os.remove(out / "model.safetensors.index.json")
    with pytest.raises(CorruptCheckpointError, match="missing model-00002-of-00003.safetensors"):
        convert(out, tmp_path / "back" / "m.ckpt")
    assert not (tmp_path / "back").exists()


def test_shards_of_two_saves_in_one_directory_are_refused(five, tmp_path):
    out = _sharded(five, tmp_path)
    os.remove(out / "model.safetensors.index.json")
    (out / "model-00001-of-00002.safetensors").write_bytes((out / "model-00001-of-00003.safetensors").read_bytes())
    with pytest.raises(CorruptCheckpointError, match="2 different saves"):
        import_checkpoint(out, tmp_path / "back" / "m.ckpt")
    assert not (tmp_path / "back").exists()


def test_an_index_that_disagrees_with_its_shards_or_has_strays_is_refused(five, tmp_path):
    out = _sharded(five, tmp_path)
    index = out / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["l0/kernel"] = "model-00003-of-00003.safetensors"  # it is in shard 1
    index.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="l0/kernel"):
        import_checkpoint(out, tmp_path / "back" / "m.ckpt")
    data["weight_map"]["l0/kernel"] = "elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="elsewhere.safetensors"):
        import_checkpoint(index, tmp_path / "back" / "m.ckpt")
    index.write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not a safetensors index"):
        import_checkpoint(index, tmp_path / "back" / "m.ckpt")
    assert not (tmp_path / "back").exists()


def test_an_existing_sharded_output_needs_overwrite_and_then_is_replaced_whole(five, tmp_path):
    out = _sharded(five, tmp_path)
    prefix, values = five
    with pytest.raises(OutputExistsError):
        convert(prefix, out, max_shard_size=2 * KERNEL)
    convert(prefix, out, max_shard_size="10GB", overwrite=True)
    assert os.listdir(out) == ["model.safetensors"]  # the old shards and index are gone
    import_checkpoint(out, tmp_path / "b" / "m.ckpt")
    _same(tmp_path / "b" / "m.ckpt", values)


def test_bad_shard_sizes_and_formats_are_refused(five, tmp_path):
    prefix, _ = five
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    for bad in (0, -5, "lots", "5XB"):
        with pytest.raises(InvalidArgumentError, match="max_shard_size"):
            convert(prefix, tmp_path / "out", max_shard_size=bad)
    with pytest.raises(InvalidArgumentError, match="safetensors"):
        convert(prefix, tmp_path / "out.pt", to="torch", max_shard_size="1GB")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pt").exists()


def test_cli_max_shard_size(five, tmp_path, capsys):
    prefix, values = five
    assert main(["convert", prefix, str(tmp_path / "out"), "--max-shard-size", "20KB"]) == 0
    assert "files" in capsys.readouterr().out
    assert len(os.listdir(tmp_path / "out")) == 6  # each 16 KiB kernel alone (the last with the bias), and the index
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "b" / "m.ckpt")]) == 0
    _same(tmp_path / "b" / "m.ckpt", values)


def test_editor_deletions_then_sharded_export_of_the_result(five, tmp_path):
    prefix, values = five
    ed = CheckpointEditor(prefix)
    ed.delete("global_step")
    out = ed.save(tmp_path / "e.safetensors", format="safetensors")
    convert(out, tmp_path / "sh", max_shard_size=KERNEL)
    import_checkpoint(tmp_path / "sh", tmp_path / "b" / "m.ckpt")
    _same(tmp_path / "b" / "m.ckpt", {k: v for k, v in values.items() if k != "global_step"})


# ------------------------------------------------------------------ the index is read bounded (bundle/jsonfile.py)


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
@pytest.mark.parametrize("named", ["the-directory", "the-index"])
def test_an_index_that_is_a_fifo_or_device_is_refused_without_reading_it(five, tmp_path, special, named):
    out = _sharded(five, tmp_path)
    index = out / "model.safetensors.index.json"
    os.remove(index)
    if special == "fifo":
        os.mkfifo(index)
    else:
        os.symlink("/dev/zero", index)
    with pytest.raises(CorruptCheckpointError, match="FIFO|character device"):
        convert(out if named == "the-directory" else index, tmp_path / "back" / "m.ckpt")
    assert not (tmp_path / "back").exists()


def test_an_index_larger_than_any_index_is_refused_before_it_is_read(five, tmp_path):
    out = _sharded(five, tmp_path)
    index = out / "model.safetensors.index.json"
    with open(index, "r+b") as f:
        f.truncate(300 << 20)  # sparse: 300 MB long, no disk used
    with pytest.raises(CorruptCheckpointError, match=f"{300 << 20} bytes, more than the {64 << 20}"):
        import_checkpoint(out, tmp_path / "back" / "m.ckpt")
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("depth", [100, 100_000], ids=["deeper-than-an-index", "deeper-than-python"])
def test_a_deeply_nested_index_is_a_restorekit_error(five, tmp_path, depth):
    out = _sharded(five, tmp_path)
    index = out / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["metadata"]["nested"] = "@"
    index.write_text(json.dumps(data).replace('"@"', "[" * depth + "]" * depth))
    with pytest.raises(CorruptCheckpointError, match="nests"):
        import_checkpoint(out, tmp_path / "back" / "m.ckpt")
    assert not (tmp_path / "back").exists()
