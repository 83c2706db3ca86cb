"""The free-disk check of conversions: every output format refused before anything is written, API and CLI."""

import os
import shutil
from collections import namedtuple

import numpy as np
import pytest

from conftest import requires_torch
from restorekit._bundle import files
from restorekit.cli import main
from restorekit.errors import InsufficientSpaceError
from restorekit.export import convert

_Usage = namedtuple("usage", "total used free")


@pytest.fixture
def sources(small_checkpoint, tmp_path, request):
    """The small checkpoint as a TF prefix and as each file format (written before the disk 'fills');
    the ``.pt`` one only for a case marked ``requires_torch``."""
    prefix, _ = small_checkpoint
    made = {"tf": prefix}
    torch = request.node.get_closest_marker("torch") is not None
    for name in ("model.safetensors", "model.pt", "model.npz") if torch else ("model.safetensors", "model.npz"):
        made[name.split(".")[1]] = convert(prefix, tmp_path / "src" / name).path
    made["shards"] = convert(prefix, tmp_path / "src" / "shards", max_shard_size=100).path
    return made


def _full_disk(monkeypatch, free=100):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10**9, 10**9 - free, free))


def _leftovers(root):
    return [os.path.join(d, n) for d, dirs, names in os.walk(root) for n in dirs + names
            if n.startswith(".restorekit-tmp-")]


# (source, output under tmp_path/out, convert's keywords)
CASES = [
    ("tf", "model.ckpt", {}),
    ("tf", "m.safetensors", {}),
    ("tf", "shards", {"max_shard_size": 100}),
    ("tf", "m.pt", {}),
    ("tf", "m.npz", {}),
    ("tf", "m.safetensors", {"weights_only": True}),
    ("safetensors", "model.ckpt", {}),
    ("shards", "model.ckpt", {}),
    ("pt", "model.ckpt", {}),
    ("npz", "model.ckpt", {}),
    ("safetensors", "m.npz", {}),
    ("safetensors", "shards", {"max_shard_size": 100}),
    ("pt", "m.safetensors", {"layout": "torch"}),
]
IDS = ["tf_to_tf", "tf_to_safetensors", "tf_to_hf_shards", "tf_to_pt", "tf_to_npz", "tf_to_safetensors_planned",
       "safetensors_import", "shards_import", "pt_import", "npz_import", "safetensors_to_npz", "safetensors_to_shards",
       "pt_to_safetensors_torch_layout"]


def params(cases, ids):
    """The cases as pytest params, those reading or writing a ``.pt`` file marked ``requires_torch``."""
    return [pytest.param(source, out, kwargs, id=name,
                         marks=[requires_torch] if "pt" in (source, out.rpartition(".")[2]) else [])
            for (source, out, kwargs), name in zip(cases, ids, strict=True)]


@pytest.mark.parametrize("source, out, kwargs", params(CASES, IDS))
def test_a_full_disk_refuses_every_output_format_with_nothing_written(sources, tmp_path, monkeypatch, source, out,
                                                                       kwargs):
    _full_disk(monkeypatch)
    with pytest.raises(InsufficientSpaceError, match="nothing was written"):
        convert(sources[source], tmp_path / "out" / out, **kwargs)
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("source, out, kwargs", params(CASES, IDS))
def test_enough_disk_converts(sources, tmp_path, monkeypatch, source, out, kwargs):
    _full_disk(monkeypatch, free=10**12)
    result = convert(sources[source], tmp_path / "out" / out, **kwargs)
    assert result.count > 0 and os.path.exists(result.path + ".index" if result.format == "tf" else result.path)
    assert _leftovers(tmp_path) == []


def test_the_check_asks_for_the_output_bytes_plus_slack(sources, tmp_path, monkeypatch):
    # A disk that holds the tensors but not the slack for the index and headers is refused; one byte more is not.
    from restorekit._checkpoint import Checkpoint

    needed = sum(e.nbytes for e in Checkpoint(sources["tf"]).entries.values())
    _full_disk(monkeypatch, free=needed + files.INDEX_SLACK - 1)
    with pytest.raises(InsufficientSpaceError):
        convert(sources["tf"], tmp_path / "out" / "m.safetensors")
    _full_disk(monkeypatch, free=needed + files.INDEX_SLACK)
    assert convert(sources["tf"], tmp_path / "out" / "m.safetensors").count == 6


def test_a_cast_asks_for_the_cast_size(small_checkpoint, tmp_path, monkeypatch):
    from restorekit.edit import CheckpointEditor

    prefix, values = small_checkpoint
    floats = sum(v.nbytes for n, v in values.items() if v.dtype == np.float32)
    asked = []
    monkeypatch.setattr(files, "free_space", lambda d: asked.append(d) or 10**12)
    editor = CheckpointEditor(prefix)
    editor.cast(".*", "float16")
    editor.save(tmp_path / "out" / "m.safetensors", format="safetensors")
    assert asked
    # the float32 tensors at half their size, global_step (int64) as it is
    monkeypatch.setattr(files, "free_space", lambda d: floats // 2 + 8 + files.INDEX_SLACK - 1)
    with pytest.raises(InsufficientSpaceError):
        editor.save(tmp_path / "out2" / "m.safetensors", format="safetensors")
    assert not (tmp_path / "out2").exists()
    monkeypatch.setattr(files, "free_space", lambda d: floats // 2 + 8 + files.INDEX_SLACK)
    editor.save(tmp_path / "out2" / "m.safetensors", format="safetensors")


def test_a_remote_output_is_not_checked_on_the_local_disk(monkeypatch):
    monkeypatch.setattr(files, "free_space", lambda d: pytest.fail(f"checked {d!r}"))
    files.check_space("gs://bucket/dir", 10**15)


@pytest.mark.parametrize("source, out, extra", params([
    ("tf", "m.safetensors", []), ("tf", "shards", ["--max-shard-size", "100"]), ("tf", "m.pt", []),
    ("tf", "m.npz", []), ("safetensors", "model.ckpt", []), ("tf", "model.ckpt", []),
], ["safetensors", "hf_shards", "pt", "npz", "import_to_tf", "tf_to_tf"]))
def test_cli_convert_on_a_full_disk_exits_3_with_one_line(sources, tmp_path, monkeypatch, capsys, source, out, extra):
    _full_disk(monkeypatch)
    code = main(["convert", sources[source], str(tmp_path / "out" / out), *extra])
    err = capsys.readouterr().err
    assert code == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("restorekit: error: ") and "are free; nothing was written" in lines[0]
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
