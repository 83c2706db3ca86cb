"""restorekit/_bundle/statefile.py: the `checkpoint` state file, read and written as TF does."""

import os

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit._bundle import statefile
from conftest import save_variables


@pytest.mark.parametrize("dirname", ["José", "数据", "plain"], ids=["latin-accent", "cjk", "ascii"])
def test_non_ascii_directory_resolves_as_tf_latest_checkpoint(tmp_path, dirname):
    directory = tmp_path / dirname
    first = save_variables(directory / "a.ckpt", {"v": np.float32(1)})
    second = save_variables(directory / "b.ckpt", {"v": np.float32(2)})
    # TF's Saver wrote the state file with absolute, octal-escaped UTF-8 paths.
    tf.compat.v1.train.update_checkpoint_state(str(directory), second, all_model_checkpoint_paths=[first, second])
    expected = tf.train.latest_checkpoint(str(directory))
    assert expected == second
    assert restorekit.Checkpoint(str(directory)).prefix == expected
    assert float(restorekit.Checkpoint(str(directory)).read("v")) == 2.0


def test_parse_unescapes_to_utf8_bytes_not_unicode_escape():
    state = statefile.parse(b'model_checkpoint_path: "/home/Jos\\303\\251/ckpt-1"\n'
                            b'all_model_checkpoint_paths: "/home/Jos\\303\\251/ckpt-1"\n')
    assert state.model_checkpoint_path == "/home/José/ckpt-1"
    assert state.all_model_checkpoint_paths == ("/home/José/ckpt-1",)


def test_parse_without_model_checkpoint_path_is_none():
    assert statefile.parse(b"garbage\n") is None


def test_write_is_read_back_by_tf_and_keeps_listed_prefixes(tmp_path):
    directory = tmp_path / "Zoë's \"run\""
    first = save_variables(directory / "a.ckpt", {"v": np.float32(1)})
    second = save_variables(directory / "b.ckpt", {"v": np.float32(2)})
    os.remove(directory / "checkpoint")
    statefile.write(first)
    statefile.write(second)
    state = tf.train.get_checkpoint_state(str(directory))
    assert os.path.basename(state.model_checkpoint_path) == "b.ckpt"
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ["a.ckpt", "b.ckpt"]
    assert statefile.read(str(directory)) == statefile.State("b.ckpt", ("a.ckpt", "b.ckpt"))


def test_write_drops_listed_prefixes_that_no_longer_exist(tmp_path):
    first = save_variables(tmp_path / "a.ckpt", {"v": np.float32(1)})
    second = save_variables(tmp_path / "b.ckpt", {"v": np.float32(2)})
    statefile.write(first)
    for name in os.listdir(tmp_path):
        if name.startswith("a.ckpt"):
            os.remove(tmp_path / name)
    statefile.write(second)
    assert statefile.read(str(tmp_path)).all_model_checkpoint_paths == ("b.ckpt",)


def test_write_drops_listed_prefixes_outside_the_directory(tmp_path):
    # TF's Saver and CheckpointManager delete the oldest listed prefixes as their own: another run's must not be listed
    other = save_variables(tmp_path / "other" / "a.ckpt", {"v": np.float32(1)})
    run = tmp_path / "run"
    mine = save_variables(run / "b.ckpt", {"v": np.float32(2)})
    tf.compat.v1.train.update_checkpoint_state(str(run), other, all_model_checkpoint_paths=[other, "../other/a.ckpt"])
    statefile.write(mine)
    assert statefile.read(str(run)) == statefile.State("b.ckpt", ("b.ckpt",))


@pytest.mark.parametrize("named, outside", [
    ("ckpt-1", False), ("sub/ckpt-1", False), ("../other/ckpt-1", True), ("/elsewhere/ckpt-1", True),
], ids=["relative-inside", "subdirectory", "dot-dot", "absolute-elsewhere"])
def test_is_outside(tmp_path, named, outside):
    run = str(tmp_path / "run")
    os.makedirs(run)
    assert statefile.is_outside(run, statefile.resolve(run, named)) is outside


def test_is_outside_resolves_symlinks(tmp_path):
    os.makedirs(tmp_path / "other")
    os.makedirs(tmp_path / "run")
    os.symlink(tmp_path / "other", tmp_path / "run" / "link")
    assert statefile.is_outside(str(tmp_path / "run"), str(tmp_path / "run" / "link" / "ckpt-1"))
