"""Tests for restorekit/formats/_sinks.py and _sink.py: one set of verbs per format, one dispatch table."""

import inspect
import types

import numpy as np
import pytest

from restorekit._checkpoint import Checkpoint
from restorekit.edit import CheckpointEditor
from restorekit.errors import InvalidArgumentError
from restorekit.export import ExportResult, convert, export_checkpoint, import_checkpoint
from restorekit.formats import _sinks as formats
from restorekit.formats._sink import checkpoint_files
from conftest import requires_torch, write_bundle

VERBS = {
    "write": ["path", "tensors", "layout", "metadata", "graph", "progress"],
    "write_checkpoint": ["checkpoint", "path", "names", "layout", "metadata", "progress"],
    "read": ["path", "max_output_bytes"],
    "read_shapes": ["path"],
    "read_record": ["path"],
    "recognizes": ["head", "suffix"],
}


def test_every_format_module_offers_the_same_verbs_with_the_same_arguments():
    assert set(formats.modules()) == {"npz", "safetensors", "torch"}
    assert formats.names() == ("tf", "npz", "safetensors", "torch")
    for name, module in formats.modules().items():
        assert module.FORMAT == name and module.SUFFIXES and None in module.LAYOUTS
        for verb, params in VERBS.items():
            assert list(inspect.signature(getattr(module, verb)).parameters) == params, (name, verb)


@pytest.mark.parametrize(
    "fmt, argument, value",
    [("npz", "layout", "torch"), ("npz", "metadata", {"a": "b"}), pytest.param("torch", "metadata", {"a": "b"},
                                                                                marks=requires_torch)],
    ids=["npz-refuses-a-layout", "npz-refuses-metadata", "torch-refuses-metadata"],
)
def test_a_format_refuses_an_argument_it_cannot_honour_and_writes_nothing(tmp_path, fmt, argument, value):
    module = formats.module(fmt)
    prefix = write_bundle(tmp_path / "src" / "m", {"a": np.ones(2, np.float32)})
    out = tmp_path / "out" / "m.file"
    with pytest.raises(InvalidArgumentError, match=f"{fmt} files cannot take {argument}="):
        module.write(out, [("a", np.ones(2, np.float32))], **{argument: value})
    with pytest.raises(InvalidArgumentError, match=f"{fmt} files cannot take {argument}="):
        module.write_checkpoint(Checkpoint(prefix), out, **{argument: value})
    assert not out.exists()


def test_unknown_format_is_refused_by_every_entry_point(tmp_path):
    prefix = write_bundle(tmp_path / "src" / "m", {"a": np.ones(2, np.float32)})
    for call in (lambda: convert(prefix, tmp_path / "x", to="onnx"),
                 lambda: export_checkpoint(prefix, tmp_path / "x", format="onnx"),
                 lambda: CheckpointEditor(prefix).save(tmp_path / "x", format="onnx")):
        with pytest.raises(InvalidArgumentError, match="unknown format 'onnx'; choose one of tf, npz"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _fake_format(calls):
    """A format module as a new file would define it: stores tensors as one npy file per name."""

    def write(path, tensors, *, layout=None, metadata=None, graph=None, progress=False):
        names = [name for name, *_ in tensors]
        calls.append(("write", names))
        open(path, "w").write("\n".join(names))
        return ExportResult(str(path), "fake", len(names), 0)

    def write_checkpoint(checkpoint, path, *, names=None, layout=None, metadata=None, progress=False):
        calls.append(("write_checkpoint", dict(names) if names is not None else None))
        open(path, "w").write("\n".join(names or checkpoint.entries))
        return ExportResult(str(path), "fake", len(checkpoint.entries), 0)

    return types.SimpleNamespace(
        FORMAT="fake", SUFFIXES=(".fake",), LAYOUTS=(None,), write=write, write_checkpoint=write_checkpoint,
        read=lambda path: iter(()), read_shapes=lambda path: {}, read_record=lambda path: None,
        recognizes=lambda head, suffix: False,
    )


def test_a_new_format_module_is_used_by_export_convert_and_the_editor(tmp_path, monkeypatch):
    calls = []
    table = dict(formats.modules())
    table["fake"] = _fake_format(calls)
    monkeypatch.setattr(formats, "modules", lambda: table)
    prefix = write_bundle(tmp_path / "src" / "m", {"a": np.ones(2, np.float32), "b": np.zeros(1, np.int32)})
    assert export_checkpoint(prefix, tmp_path / "one.fake").format == "fake"
    convert(prefix, tmp_path / "two.fake")
    ed = CheckpointEditor(prefix)
    ed.rename("a", "c")
    ed.save(tmp_path / "three.fake", format="fake")  # only a rename: raw copy through write_checkpoint
    ed.set("b", np.ones(1, np.int32))
    ed.save(tmp_path / "four.fake", format="fake")  # a changed value: through write
    assert calls == [("write_checkpoint", None), ("write_checkpoint", None),
                     ("write_checkpoint", {"c": "a", "b": "b"}), ("write", ["c", "b"])]


@requires_torch
def test_convert_applies_a_layout_to_the_side_that_has_one(tmp_path):
    prefix = write_bundle(tmp_path / "src" / "m", {"dense/kernel": np.arange(6, dtype=np.float32).reshape(2, 3)})
    export_checkpoint(prefix, tmp_path / "m.pt", layout="torch")
    convert(tmp_path / "m.pt", tmp_path / "m.npz", layout="torch")  # read in torch layout, npz keeps TF's
    with np.load(tmp_path / "m.npz") as data:
        assert list(data.files) == ["dense/kernel"] and data["dense/kernel"].shape == (2, 3)
    with pytest.raises(InvalidArgumentError, match="applies to neither npz nor npz"):
        convert(tmp_path / "m.npz", tmp_path / "n.npz", layout="torch")
    assert not (tmp_path / "n.npz").exists()
    back = import_checkpoint(tmp_path / "m.npz", tmp_path / "back" / "m")
    assert back.count == 1


def test_checkpoint_files_match_the_prefix_literally(tmp_path):
    for name in ["model[1].ckpt.index", "model[1].ckpt.data-00000-of-00001", "model1.ckpt.index",
                 "model1.ckpt.data-00000-of-00001", "model[1].ckpt.data-x", "ckpt-10.index"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.rsplit("/", 1)[1] for p in checkpoint_files(str(tmp_path / "model[1].ckpt"))] == [
        "model[1].ckpt.index", "model[1].ckpt.data-00000-of-00001"]
    assert checkpoint_files(str(tmp_path / "ckpt-1?")) == []


def test_output_errors_of_conversions_carry_the_path_and_whether_it_is_the_source(tmp_path):
    from restorekit.errors import OutputExistsError

    prefix = write_bundle(tmp_path / "src" / "m", {"a": np.ones(2, np.float32)})
    with pytest.raises(OutputExistsError) as source:
        convert(prefix, prefix, to="tf", overwrite=True)
    assert source.value.is_source and source.value.path == prefix
    export_checkpoint(prefix, tmp_path / "m.npz")
    written = (tmp_path / "m.npz").read_bytes()
    with pytest.raises(OutputExistsError) as existing:
        export_checkpoint(prefix, tmp_path / "m.npz")
    assert not existing.value.is_source and existing.value.path == str(tmp_path / "m.npz")
    assert (tmp_path / "m.npz").read_bytes() == written


@pytest.mark.parametrize("target, neighbour", [("model[1].ckpt", "model1.ckpt"), ("ckpt-1?", "ckpt-10")],
                         ids=["brackets-in-the-prefix", "question-mark-in-the-prefix"])
def test_import_with_overwrite_replaces_exactly_the_old_checkpoints_files(tmp_path, target, neighbour):
    src = write_bundle(tmp_path / "src" / "m", {"a": np.ones(2, np.float32)})
    out = tmp_path / "out"
    neighbour_prefix = write_bundle(out / neighbour, {"n": np.arange(4, dtype=np.int64)})
    before = {p: open(p, "rb").read() for p in checkpoint_files(neighbour_prefix)}
    old = CheckpointEditor(src)
    old.add("extra", np.zeros(3, np.float32))
    old.save(out / target)  # two shards: data-00000-of-00002, data-00001-of-00002
    export_checkpoint(src, tmp_path / "m.npz")
    import_checkpoint(tmp_path / "m.npz", out / target, overwrite=True)
    assert {p: open(p, "rb").read() for p in checkpoint_files(neighbour_prefix)} == before
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        [f"{neighbour}.index", f"{neighbour}.data-00000-of-00001", f"{target}.index", f"{target}.data-00000-of-00001"])
    assert list(Checkpoint(str(out / target)).entries) == ["a"]
