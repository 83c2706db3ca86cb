"""The torch files packages ship (issue 40): legacy pickles, training-checkpoint dicts, TorchScript archives.

Each file is written by torch itself and every verb (inspect, convert to safetensors / TF /
npz, scan + restore into a torch module, diff) is checked against torch's own loader.
"""

import collections

import numpy as np
import pytest

import restorekit
from restorekit.cli import main
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError
from conftest import import_torch

torch = import_torch()


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


class _OldTensor:
    """A tensor pickled the way torch < 1.0 did: ``torch._utils._rebuild_tensor(storage, offset, size, stride)``."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __reduce_ex__(self, protocol):
        t = self.tensor
        storage = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)
        return torch._utils._rebuild_tensor, (storage, t.storage_offset(), tuple(t.size()), t.stride())


def _listing(path):
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def check_every_verb(capsys, tmp_path, src, expected: dict, module=None):
    """inspect, convert (safetensors, TF, npz), scan + restore into ``module``, diff: each gives ``expected``."""
    code, out, _ = run(capsys, "inspect", src)
    assert code == 0 and f"{len(expected)} tensors" in out
    for name in expected:
        assert name in out
    source = restorekit.formats.open(str(src))
    assert sorted(source.entries) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(source.read(name), value)
    outputs = {"safetensors": tmp_path / "out.safetensors", "npz": tmp_path / "out.npz", "tf": tmp_path / "tf" / "m"}
    for fmt, out_path in outputs.items():
        code, _, err = run(capsys, "convert", src, out_path, "--to", fmt)
        assert code == 0, err
    import safetensors.numpy

    for name, value in safetensors.numpy.load_file(str(outputs["safetensors"])).items():
        np.testing.assert_array_equal(value, expected[name])
    with np.load(outputs["npz"]) as npz:
        assert sorted(npz.files) == sorted(expected)
        for name in npz.files:
            np.testing.assert_array_equal(npz[name], expected[name])
    back = restorekit.Checkpoint(str(outputs["tf"]))
    assert sorted(back.entries) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(back.read(name), value)
    code, out, err = run(capsys, "diff", src, outputs["safetensors"])
    assert code == 0, out + err
    if module is not None:
        report = restorekit.scan(str(src), module)
        restorekit.restore(report, strict=True)
        for name, tensor in module.state_dict().items():
            np.testing.assert_array_equal(tensor.numpy(), expected[name])


def _values(state: dict) -> dict:
    return {name: t.numpy() for name, t in state.items()}


# ---------------------------------------------------------------- item 1: legacy (pre-zip) files


def test_a_legacy_state_dict_reads_with_every_verb(capsys, tmp_path):
    model = _model()
    path = tmp_path / "legacy.pt"
    torch.save(model.state_dict(), path, _use_new_zipfile_serialization=False)
    expected = _values(torch.load(path, weights_only=True))
    check_every_verb(capsys, tmp_path, path, expected, module=_model().train(False).requires_grad_(False))


def test_a_pre_1_0_rebuild_tensor_file_reads_as_torch_reads_it(capsys, tmp_path):
    path = tmp_path / "old.pt"
    weight = torch.randn(3, 4)
    rows = torch.arange(10.0)[2:8:2]  # a strided view into a larger storage
    state = collections.OrderedDict([("lin0.model.1.weight", _OldTensor(weight)), ("lin0.model.1.bias", _OldTensor(rows))])
    torch.save(state, path, _use_new_zipfile_serialization=False)
    expected = _values(torch.load(path, weights_only=True))
    assert expected["lin0.model.1.bias"].tolist() == [2, 4, 6]
    check_every_verb(capsys, tmp_path, path, expected)


def _legacy_bytes(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32), "b": torch.arange(2, dtype=torch.int64)}, path,
               _use_new_zipfile_serialization=False)
    return path.read_bytes()


def _small_storage(data: bytes) -> bytes:
    """The first storage's element count (8 bytes little-endian, before its data) one less than the pickle says."""
    six = (6).to_bytes(8, "little") + np.arange(6, dtype=np.float32).tobytes()
    assert data.count(six) == 1
    return data.replace(six, (5).to_bytes(8, "little") + np.arange(6, dtype=np.float32).tobytes())


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("damage,error,message", [
    (lambda data, tmp: data[:-5], CorruptCheckpointError, "declare"),
    (lambda data, tmp: data[:40], CorruptCheckpointError, "bad.pt"),
    (lambda data, tmp: _small_storage(data), CorruptCheckpointError, "holds 5 elements where the pickle declares 6"),
], ids=["truncated_storage", "truncated_header", "storage_count_too_small"])
def test_a_broken_legacy_file_is_refused_and_nothing_is_written(capsys, tmp_path, damage, error, message):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(damage(_legacy_bytes(tmp_path), tmp_path))
    with pytest.raises(error, match=message):
        restorekit.convert(bad, tmp_path / "out" / "m.safetensors")
    assert _listing(tmp_path / "out") == []
    code, _, err = run(capsys, "convert", bad, tmp_path / "out" / "m.npz")
    assert code == 3 and "bad.pt" in err and _listing(tmp_path / "out") == []


def test_a_legacy_tensor_reaching_past_its_storage_is_refused(tmp_path):
    path = tmp_path / "past.pt"
    base = torch.arange(4.0)
    torch.save({"w": _OldTensor(base)}, path, _use_new_zipfile_serialization=False)
    # the pickle's size (4,) becomes (9,): torch.load would read past the storage's 4 elements
    data = path.read_bytes()
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data.replace(b"K\x04\x85", b"K\x09\x85", 1))
    assert bad.read_bytes() != data
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' of shape \[9\].* reaches byte 36 of a 16-byte storage"):
        restorekit.convert(bad, tmp_path / "out" / "m.safetensors")
    assert _listing(tmp_path / "out") == []


def test_a_legacy_pickle_that_wants_to_run_code_is_refused_unrun(capsys, tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "hook": _Evil(marker)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CorruptCheckpointError, match="refusing to load"):
        restorekit.convert(path, tmp_path / "out" / "m.safetensors")
    code, _, err = run(capsys, "inspect", path)
    assert code == 3 and "evil.pt" in err
    assert not marker.exists() and _listing(tmp_path / "out") == []


# ---------------------------------------------------------------- item 2: training-checkpoint dicts


def _trained():
    """A model, its Adam optimizer after one step, and a flat name -> numpy of a checkpoint dict as torch loads it."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _flat(obj, name=""):
    """name -> numpy of every tensor of what torch.load returned, by path (the reference for restorekit's names)."""
    if torch.is_tensor(obj):
        return {name: obj.numpy()}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out = {}
    for key, value in items:
        out.update(_flat(value, f"{name}.{key}" if name else str(key)))
    return out


LAYOUTS = {
    "step_model_optimizer": lambda m, o: {"step": 3, "model_state": m.state_dict(), "optimizer_state": o.state_dict()},
    "model_ema_optimizer_epoch": lambda m, o: {"model": m.state_dict(), "ema": m.state_dict(),
                                               "optimizer": o.state_dict(), "epoch": 7},
    "lightning": lambda m, o: {"epoch": 2, "global_step": 20, "state_dict": m.state_dict(),
                               "optimizer_states": [o.state_dict()], "lr_schedulers": []},
}
GROUP = {"step_model_optimizer": "model_state", "model_ema_optimizer_epoch": "model", "lightning": "state_dict"}


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_a_training_checkpoint_reads_by_path_with_every_verb(capsys, tmp_path, layout, zipped):
    model, optimizer = _trained()
    path = tmp_path / "ckpt.pt"
    torch.save(LAYOUTS[layout](model, optimizer), path, _use_new_zipfile_serialization=zipped)
    loaded = torch.load(path, weights_only=True)
    expected = _flat(loaded)
    group = GROUP[layout]
    assert f"{group}.0.weight" in expected and any(".state.0.exp_avg_sq" in n for n in expected)
    check_every_verb(capsys, tmp_path, path, expected)
    # the scalars are metadata that inspect shows
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "metadata (" in out and "param_groups.0.lr = 0.01" in out
    source = restorekit.formats.open(str(path))
    assert {k: v for k, v in source.metadata.items() if k in ("step", "epoch", "global_step")} == {
        k: v for k, v in loaded.items() if k in ("step", "epoch", "global_step")}
    # the one weights rule knows torch's optimizer state: --weights-only, scan and strip agree
    optimizer_names = sorted(n for n in expected if ".state." in n)
    weights = sorted(set(expected) - set(optimizer_names))
    restorekit.convert(path, tmp_path / "w.safetensors", weights_only=True)
    assert sorted(restorekit.formats.open(str(tmp_path / "w.safetensors")).entries) == weights
    code, _, err = run(capsys, "strip", tmp_path / "tf" / "m", tmp_path / "stripped" / "m")
    assert code == 0, err
    assert sorted(restorekit.Checkpoint(str(tmp_path / "stripped" / "m")).entries) == weights
    report = restorekit.scan(str(path), _model())
    assert sorted(r.checkpoint_name for r in report.skipped) == optimizer_names
    assert all(r.how[0] == "optimizer" for r in report.skipped)
    assert any(f"prefix={group + '.'!r}" in h and f"'CHECKPOINT:{group}'" in h for h in report.hints), report.hints
    # one group as the source: From(prefix=...) in Python, FILE:GROUP on the command line
    target = _model().requires_grad_(False)
    restorekit.restore(restorekit.scan(restorekit.From(path, prefix=f"{group}."), target), strict=True)
    for name, tensor in target.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), loaded[group][name].numpy())
    code, out, _ = run(capsys, "inspect", f"{path}:{group}")
    assert code == 0 and f"{len(loaded[group])} tensors" in out and "\n0.weight " in out


def test_hf_trainer_optimizer_file_is_all_optimizer_state(tmp_path):
    _, optimizer = _trained()
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    source = restorekit.formats.open(str(path))
    assert sorted(source.entries) == sorted(_flat(torch.load(path, weights_only=True)))
    assert {restorekit._names.entry_kind(n) for n in source.entries} == {restorekit._names.Kind.OPTIMIZER}
    assert source.metadata["param_groups.0.lr"] == 0.01


def test_a_group_holding_nothing_is_refused_by_name_and_nothing_is_written(capsys, tmp_path):
    model, optimizer = _trained()
    path = tmp_path / "ckpt.pt"
    torch.save(LAYOUTS["step_model_optimizer"](model, optimizer), path)
    with pytest.raises(InvalidArgumentError, match=r"no tensors under 'modle_state'.*'model_state', 'optimizer_state'"):
        restorekit.convert(f"{path}:modle_state", tmp_path / "out" / "m.safetensors")
    code, _, err = run(capsys, "convert", f"{path}:modle_state", tmp_path / "out" / "m.npz")
    assert code == 3 and "modle_state" in err and _listing(tmp_path / "out") == []


def test_a_broken_training_checkpoint_is_refused_and_nothing_is_written(tmp_path):
    model, optimizer = _trained()
    path = tmp_path / "ckpt.pt"
    torch.save(LAYOUTS["step_model_optimizer"](model, optimizer), path, _use_new_zipfile_serialization=False)
    (tmp_path / "cut.pt").write_bytes(path.read_bytes()[:-9])
    with pytest.raises(CorruptCheckpointError, match="cut.pt"):
        restorekit.convert(tmp_path / "cut.pt", tmp_path / "out" / "m.safetensors")
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "model_state": model.state_dict(), "hook": _Evil(marker)}, tmp_path / "evil.pt")
    with pytest.raises(CorruptCheckpointError, match="refusing to load"):
        restorekit.convert(tmp_path / "evil.pt", tmp_path / "out" / "m.safetensors")
    assert not marker.exists() and _listing(tmp_path / "out") == []


@pytest.mark.parametrize("name,kind", [
    ("optimizer_state.state.0.exp_avg", "optimizer"), ("state.3.momentum_buffer", "optimizer"),
    ("optimizer_states.0.param_groups.0.lr", "optimizer"), ("model_state.state.0.weight", "weight"),
    ("encoder.state.1.bias", "weight"),
], ids=["adam_slot", "sgd_momentum", "param_group_value", "a_module_named_state", "a_module_list_named_state"])
def test_the_weights_rule_knows_torch_optimizer_state_by_its_slot_names(name, kind):
    assert restorekit._names.entry_kind(name).value == kind


# ---------------------------------------------------------------- item 3: TorchScript archives


class _Block(torch.nn.Module):
    """Parameters, a buffer, an unset optional parameter, a tensor attribute that is neither, and a shared child."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 4)
        self.head = torch.nn.Linear(4, 2, bias=False)
        self.norm = torch.nn.LayerNorm(2)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))
        self.register_parameter("unset", None)
        self.offset = torch.ones(2)  # a plain attribute: not in state_dict

    def forward(self, x):
        return self.norm(self.head(torch.relu(self.proj(x)))) * self.scale + self.offset


def _zip_rewrite(src, dst, change):
    """Copy the zip archive ``src`` to ``dst`` with ``change(name, data) -> data or None`` (None drops it), stored."""
    import zipfile

    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as b:
        for info in a.infolist():
            data = change(info.filename, a.read(info))
            if data is not None:
                b.writestr(info.filename, data)


@pytest.mark.parametrize("how", ["script", "trace"], ids=["jit_script", "jit_trace"])
def test_a_torchscript_archive_reads_as_its_state_dict_with_every_verb(capsys, tmp_path, how):
    torch.manual_seed(1)
    block = _Block()
    scripted = torch.jit.script(block) if how == "script" else torch.jit.trace(block, torch.randn(2, 3))
    path = tmp_path / "block.jit"
    torch.jit.save(scripted, str(path))
    reference = torch.jit.load(str(path)).state_dict()
    expected = _values(reference)
    assert "offset" not in expected and "unset" not in expected and "scale" in expected
    assert list(restorekit.formats.open(str(path)).reader.read_shapes()) == list(reference)  # state_dict's order
    check_every_verb(capsys, tmp_path, path, expected, module=_Block().requires_grad_(False))


def _script_file(tmp_path):
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(_model()), str(path))
    return path


def _evil_pickle(marker) -> bytes:
    import pickle

    return pickle.dumps(_Evil(marker), protocol=2)


@pytest.mark.parametrize("change,error,message", [
    (lambda name, data, tmp: data[:-4] if name.endswith("data/0") else data, CorruptCheckpointError,
     r"tensor '0.weight'.* holds 44 bytes where the pickle declares 48"),
    (lambda name, data, tmp: None if name.endswith("modules/linear.py") else data, InvalidArgumentError,
     r"class '__torch__\.torch\.nn\.modules\.linear\.Linear' declares no __parameters__"),
    (lambda name, data, tmp: _evil_pickle(tmp / "pwned") if name.endswith("/data.pkl") else data,
     InvalidArgumentError, r"calls 'posix\.system'"),
], ids=["storage_too_small", "class_without_declarations", "pickle_wants_to_run_code"])
def test_a_broken_torchscript_archive_is_refused_by_name_and_nothing_is_written(capsys, tmp_path, change, error,
                                                                                 message):
    bad = tmp_path / "bad.pt"
    _zip_rewrite(_script_file(tmp_path), bad, lambda name, data: change(name, data, tmp_path))
    with pytest.raises(error, match=message):
        restorekit.convert(bad, tmp_path / "out" / "m.safetensors")
    code, _, err = run(capsys, "inspect", bad)
    assert code == 3 and "bad.pt" in err
    assert not (tmp_path / "pwned").exists() and _listing(tmp_path / "out") == []


def test_a_truncated_torchscript_archive_is_refused(tmp_path):
    cut = tmp_path / "cut.pt"
    cut.write_bytes(_script_file(tmp_path).read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="cut.pt"):
        restorekit.convert(cut, tmp_path / "out" / "m.safetensors")
    assert _listing(tmp_path / "out") == []
