"""restorekit/_rundir.py: which checkpoint of a run directory a restart resumes from (TF1 Saver runs here)."""

import os
import warnings

import numpy as np
import pytest

from restorekit.errors import RestoreKitWarning, RunDirectoryError
from restorekit._rundir import ResumePoint, name_in_state_file, resume_point
from conftest import save_variables


def saver_run(directory, steps=(1, 2, 3)) -> list[str]:
    """model.ckpt-N for each step, as a TF1 Saver writes them (state file with absolute paths)."""
    return [save_variables(directory / f"model.ckpt-{n}", {"v": np.float32(n)}) for n in steps]


def quietly(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return resume_point(directory)


def test_a_fresh_run_has_no_resume_point(tmp_path):
    assert quietly(tmp_path / "not-yet") is None
    assert quietly(tmp_path) is None  # exists, empty
    (tmp_path / "events.out").write_bytes(b"x")  # other files are not checkpoints
    assert quietly(tmp_path) is None


def test_an_intact_run_resumes_from_the_state_files_latest_without_a_word(tmp_path):
    prefixes = saver_run(tmp_path)
    assert quietly(tmp_path) == ResumePoint(prefixes[-1], (), True)


def test_newest_first_by_the_step_number_not_the_file_name(tmp_path):
    saver_run(tmp_path, steps=(9, 10))  # 'model.ckpt-9' sorts after 'model.ckpt-10' by name
    os.remove(tmp_path / "checkpoint")
    with pytest.warns(RestoreKitWarning, match="state file .* is missing"):
        point = resume_point(tmp_path)
    assert point.prefix == str(tmp_path / "model.ckpt-10") and not point.named_by_state_file


def test_a_state_file_that_does_not_parse_falls_back_to_the_newest_index(tmp_path):
    saver_run(tmp_path)
    (tmp_path / "checkpoint").write_bytes(b"\xff\xfe\x00garbage")  # TF's own reader: UnicodeDecodeError
    with pytest.warns(RestoreKitWarning, match="names no checkpoint"):
        assert resume_point(tmp_path).prefix == str(tmp_path / "model.ckpt-3")


def test_every_newer_unreadable_checkpoint_is_named_in_one_warning(tmp_path):
    prefixes = saver_run(tmp_path)
    os.remove(prefixes[2] + ".index")
    with open(prefixes[1] + ".data-00000-of-00001", "r+b") as f:
        f.truncate(1)
    with pytest.warns(RestoreKitWarning) as caught:
        point = resume_point(tmp_path)
    assert point.prefix == prefixes[0] and [p for p, _ in point.skipped] == [prefixes[2], prefixes[1]]
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "model.ckpt-3': missing" in text and "model.ckpt-2': damaged" in text and "truncated" in text


def test_state_file_is_rewritten_to_name_the_resume_point_only_when_it_does_not(tmp_path):
    prefixes = saver_run(tmp_path)
    before = (tmp_path / "checkpoint").read_bytes()
    name_in_state_file(quietly(tmp_path))
    assert (tmp_path / "checkpoint").read_bytes() == before
    for name in os.listdir(tmp_path):
        if name.startswith("model.ckpt-3."):
            os.remove(tmp_path / name)
    with pytest.warns(RestoreKitWarning):
        point = resume_point(tmp_path)
    name_in_state_file(point)
    import tensorflow as tf

    state = tf.train.get_checkpoint_state(str(tmp_path))
    assert state.model_checkpoint_path == prefixes[1]
    assert list(state.all_model_checkpoint_paths) == [prefixes[1]]  # each save_variables Saver listed only its own
    assert quietly(tmp_path) == ResumePoint(prefixes[1], (), True)


def test_a_state_file_naming_only_vanished_checkpoints_is_refused(tmp_path):
    prefixes = saver_run(tmp_path, steps=(1,))
    for name in os.listdir(tmp_path):
        if name.startswith("model.ckpt-1."):
            os.remove(tmp_path / name)
    with pytest.raises(RunDirectoryError, match="none is complete and readable") as e:
        resume_point(tmp_path)
    assert e.value.skipped == ((prefixes[0], "missing (no .index)"),)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]


def test_the_pretrained_checkpoint_kept_in_the_run_directory_is_not_a_resume_point(tmp_path):
    # tf.train.latest_checkpoint ignores it too (no state file names it): a fresh run warm-starts from it
    pretrained = save_variables(tmp_path / "pretrained.ckpt", {"v": np.float32(0)})
    os.remove(tmp_path / "checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resume_point(tmp_path, pretrained=pretrained) is None
        assert resume_point(tmp_path, pretrained=pretrained + ".index") is None
    later = saver_run(tmp_path, steps=(5,))
    assert resume_point(tmp_path, pretrained=pretrained).prefix == later[0]
