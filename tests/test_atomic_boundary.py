"""bundle/staging and locking at the write boundary (issue 22): the lock file is never followed or truncated and has a
bounded name; every writer takes its output's lock; a failure while writing (disk full, a library's error)
is one WriteFailedError naming the output, with nothing left behind; the sweep removes only what
restorekit's own journal recorded."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import h5py
import numpy as np
import pytest

import restorekit
from conftest import import_torch, write_bundle
from restorekit._bundle import sweep
from restorekit._bundle.locking import lock_path, output_lock
from restorekit._bundle.staging import Staging, atomic_output
from restorekit._bundle.sweep import sweep_stale
from restorekit.cli import main
from restorekit.edit import CheckpointEditor
from restorekit.errors import OutputError, OutputExistsError, WriteFailedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALUES = {f"layer{i}/kernel": np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + i for i in range(4)}


def keras_file(path) -> dict:
    """A Keras 3 ``.weights.h5`` (two Dense layers), written with h5py in Keras' layout."""
    rng = np.random.RandomState(0)
    values = {}
    with h5py.File(path, "w") as f:
        for layer in ("dense", "dense_1"):
            for k, shape in enumerate([(8, 8), (8,)]):
                values[f"layers/{layer}/vars/{k}"] = rng.randn(*shape).astype(np.float32)
                f.create_dataset(f"layers/{layer}/vars/{k}", data=values[f"layers/{layer}/vars/{k}"])
            f[f"layers/{layer}/vars"].attrs["name"] = layer
    return values


def listing(directory) -> list:
    return sorted(os.listdir(directory))


# ------------------------------------------------------------------ the lock file


def test_a_lock_name_that_links_to_the_source_never_shrinks_it(tmp_path):
    source = tmp_path / "model.weights.h5"
    keras_file(source)
    before = source.read_bytes()
    os.symlink(source, lock_path(source))
    editor = CheckpointEditor(source)
    editor.set("layers/dense/vars/1", np.ones(8, np.float32))
    with pytest.raises(OutputError, match="is a symbolic link"):
        editor.save_in_place()
    assert source.read_bytes() == before
    os.remove(lock_path(source))
    os.link(source, lock_path(source))  # a hard link is refused too: writing the pid would shrink it
    with pytest.raises(OutputError, match="hard link"):
        editor.save_in_place()
    assert source.read_bytes() == before


@pytest.mark.parametrize("make", [os.mkdir, os.mkfifo], ids=["a directory", "a FIFO"])
def test_a_directory_or_fifo_at_the_lock_name_is_a_restorekit_error_not_a_hang(tmp_path, make):
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    make(lock_path(out))
    write_bundle(str(tmp_path / "src" / "model.ckpt"), VALUES)
    with pytest.raises(OutputError, match="restorekit lock"):
        restorekit.convert(str(tmp_path / "src" / "model.ckpt"), str(out))
    assert listing(out.parent) == [os.path.basename(lock_path(out))]
    sweep_stale(str(out.parent))  # never removed, never followed
    assert listing(out.parent) == [os.path.basename(lock_path(out))]


def test_a_251_byte_file_name_can_be_edited_in_place(tmp_path):
    source = tmp_path / ("k" * (251 - len(".weights.h5")) + ".weights.h5")
    assert len(source.name.encode()) == 251
    keras_file(source)
    assert len(os.path.basename(lock_path(source)).encode()) <= 255
    assert lock_path(source) != lock_path(tmp_path / ("k" * 239 + "x.weights.h5"))
    editor = CheckpointEditor(source)
    editor.set("layers/dense/vars/1", np.ones(8, np.float32))
    editor.save_in_place()
    np.testing.assert_array_equal(restorekit.Checkpoint(source).read("layers/dense/vars/1"), np.ones(8))
    assert listing(tmp_path) == [source.name]


# ------------------------------------------------------------------ one writer per output


@pytest.fixture
def held(tmp_path):
    """Hold an output's lock in another thread (its own open file: the lock conflicts as another process's does)."""
    stop = threading.Event()

    def hold(path, ready):
        with output_lock(path):
            ready.set()
            stop.wait(60)

    threads = []

    def start(path):
        ready = threading.Event()  # one per lock: the next call waits for its own thread, not the last one's
        thread = threading.Thread(target=hold, args=(str(path), ready))
        thread.start()
        threads.append(thread)
        assert ready.wait(30)

    yield start
    stop.set()
    for thread in threads:
        thread.join(30)


@pytest.mark.parametrize("out, kwargs", [
    ("model.safetensors", {}),
    ("model.npz", {}),
    ("hf/model.safetensors", {"max_shard_size": 20_000}),
    ("tf/model.ckpt", {}),
], ids=["safetensors", "npz", "hugging-face-shards", "tf-checkpoint"])
def test_convert_refuses_an_output_another_writer_holds(tmp_path, held, out, kwargs):
    src = write_bundle(str(tmp_path / "src" / "model.ckpt"), VALUES)
    out = tmp_path / "out" / out
    out.parent.mkdir(parents=True)
    held(out)
    with pytest.raises(OutputExistsError, match="another restorekit process .* is writing"):
        restorekit.convert(src, str(out), **kwargs)
    assert [n for n in listing(out.parent) if not n.endswith(".restorekit-lock")] == []


def test_keras_saves_refuse_an_output_another_writer_holds(tmp_path, held):
    source = tmp_path / "m.weights.h5"
    keras_file(source)
    held(tmp_path / "copy.weights.h5")
    held(tmp_path / "set.weights.json")
    with pytest.raises(OutputExistsError, match="another restorekit process"):
        restorekit.convert(str(source), str(tmp_path / "copy.weights.h5"))
    with pytest.raises(OutputExistsError, match="another restorekit process"):
        CheckpointEditor(source).save(tmp_path / "set.weights.json", max_shard_size=400)
    assert [n for n in listing(tmp_path) if not n.endswith(".restorekit-lock")] == ["m.weights.h5"]


def test_convert_cannot_land_inside_an_editors_save_in_place(tmp_path, held):
    """The editor holds the source's lock while it saves in place: a convert onto that name is refused."""
    source = tmp_path / "m.weights.h5"
    keras_file(source)
    before = source.read_bytes()
    other = tmp_path / "other.weights.h5"
    keras_file(other)
    held(source)  # as CheckpointEditor.save_in_place holds it
    with pytest.raises(OutputExistsError, match="another restorekit process"):
        restorekit.convert(str(other), str(source), overwrite=True)
    assert source.read_bytes() == before


# ------------------------------------------------------------------ write failures

_FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (BYTES, BYTES))
from restorekit.cli import main
sys.exit(main(ARGS))
"""


def run_full(args, limit=20_000):
    code = _FULL_DISK.replace("BYTES", str(limit)).replace("ARGS", repr(list(map(str, args))))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300)


@pytest.mark.parametrize("out, extra", [
    ("new/dir/model.safetensors", []),
    ("new/dir/model.npz", []),
    ("new/dir/shards/", ["--max-shard-size", "40000"]),
    ("new/dir/model.ckpt", ["--to", "tf"]),
    ("new/dir/copy.weights.h5", []),
    ("new/dir/model.pt", []),
], ids=["safetensors", "npz", "hugging-face-shards", "tf-checkpoint", "weights-h5", "torch"])
def test_a_full_disk_is_one_line_exit_3_naming_the_output_and_nothing_is_left(tmp_path, out, extra):
    if out.endswith(".pt"):
        import_torch()  # torch raises RuntimeError from its writer
    if out.endswith(".weights.h5"):
        src = tmp_path / "src" / "m.weights.h5"
        src.parent.mkdir()
        big = {f"layers/dense/vars/{k}": np.ones((64, 64), np.float32) * k for k in range(4)}
        with h5py.File(src, "w") as f:
            for key, value in big.items():
                f.create_dataset(key, data=value)
        src = str(src)
    else:
        src = write_bundle(str(tmp_path / "src" / "model.ckpt"), VALUES)
    sources = {n: (tmp_path / "src" / n).read_bytes() for n in listing(tmp_path / "src")}
    result = run_full(["convert", src, str(tmp_path / out), *extra])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 3, result.stderr
    assert len(lines) == 1 and lines[0].startswith("restorekit: error: could not write"), result.stderr
    assert str(tmp_path / "new" / "dir") in lines[0]
    if not out.endswith(".pt"):  # torch words it as its own writer's failure ('unexpected pos ...')
        assert "File too large" in lines[0]
    assert not (tmp_path / "new").exists()  # not even the directories made for it
    assert {n: (tmp_path / "src" / n).read_bytes() for n in listing(tmp_path / "src")} == sources


def test_a_write_failed_error_is_an_os_error_with_the_cause(tmp_path):
    out = tmp_path / "x" / "model.pb"
    with pytest.raises(WriteFailedError) as info:
        with atomic_output(str(out)) as tmp:
            raise OSError(28, "No space left on device", tmp)
    assert isinstance(info.value, OSError) and info.value.errno == 28
    assert info.value.path == str(out) and info.value.cause == "No space left on device"
    assert not (tmp_path / "x").exists()


def test_a_directory_that_cannot_be_listed_hides_no_existing_output(tmp_path, monkeypatch):
    src = write_bundle(str(tmp_path / "src" / "model.ckpt"), VALUES)
    out = tmp_path / "hf"
    restorekit.convert(src, str(out / "model.safetensors"), max_shard_size=20_000)
    before = {n: (out / n).read_bytes() for n in listing(out)}
    real = os.listdir

    def unlistable(path="."):
        if os.path.abspath(path) == str(out):
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(os, "listdir", unlistable)
    with pytest.raises(OutputExistsError):
        restorekit.convert(src, str(out / "model.safetensors"), max_shard_size=20_000)
    monkeypatch.undo()
    assert {n: (out / n).read_bytes() for n in listing(out)} == before


# ------------------------------------------------------------------ the sweep


def test_the_sweep_keeps_a_config_json_another_program_wrote_after_a_dead_commit(tmp_path):
    """A commit killed after renaming its config.json (its weights never landed) journalled which file that was;
    another program then writes its own config.json there: the next restorekit write keeps it."""
    staging = Staging(str(tmp_path), output=str(tmp_path / "model.safetensors"))
    for name, text in (("config.json", "{}"), ("model.safetensors", "weights")):
        with open(staging.path(str(tmp_path / name)), "w") as f:
            f.write(text)
    staging._write_journal(list(staging._finals), [], [])
    os.replace(staging.path(str(tmp_path / "config.json")), tmp_path / "config.json")
    staging._release()
    # As if this process had died here: its staging directory now looks like a dead one's.
    dead = tmp_path / f".restorekit-tmp-{_dead_pid()}-{sweep._host_tag()}-0badf00d"
    os.rename(staging.tmpdir, dead)
    theirs = json.dumps({"written": "by another program"})
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(theirs)
    sweep_stale(str(tmp_path))
    assert (tmp_path / "config.json").read_text() == theirs
    assert listing(tmp_path) == ["config.json"]


def test_the_sweep_still_removes_the_config_json_a_dead_commit_left(tmp_path):
    staging = Staging(str(tmp_path), output=str(tmp_path / "model.safetensors"))
    for name in ("config.json", "model.safetensors"):
        with open(staging.path(str(tmp_path / name)), "w") as f:
            f.write("{}")
    staging._write_journal(list(staging._finals), [], [])
    os.replace(staging.path(str(tmp_path / "config.json")), tmp_path / "config.json")
    staging._release()
    os.rename(staging.tmpdir, tmp_path / f".restorekit-tmp-{_dead_pid()}-{sweep._host_tag()}-0badf00d")
    sweep_stale(str(tmp_path))
    assert listing(tmp_path) == []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_cli_prints_a_lock_refusal_as_one_line(tmp_path, capsys):
    src = write_bundle(str(tmp_path / "src" / "model.ckpt"), VALUES)
    out = tmp_path / "model.safetensors"
    os.mkdir(lock_path(out))
    assert main(["convert", src, str(out)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "restorekit lock" in err[0]


def test_a_read_only_directory_is_one_write_failed_error_naming_the_output(tmp_path, monkeypatch):
    import errno

    src = write_bundle(str(tmp_path / "src" / "model.ckpt"), VALUES)
    out = tmp_path / "ro" / "model.safetensors"
    out.parent.mkdir()
    real = os.open

    def read_only(path, flags, *args, **kwargs):
        if os.path.dirname(os.fspath(path)) == str(out.parent) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(WriteFailedError, match="could not write .*model.safetensors.*Read-only file system") as info:
        restorekit.convert(src, str(out))
    assert info.value.errno == errno.EROFS
    monkeypatch.undo()
    assert listing(out.parent) == []
