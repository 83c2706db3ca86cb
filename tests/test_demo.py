"""Tests for restorekit/demo.py: the transfer-learning demo runs, prints its tables, plots, restores."""

import io
import os

import numpy as np
import pytest
import tensorflow as tf

from restorekit.demo import main, run_demo
from restorekit.errors import InvalidArgumentError

BACKBONE = ("backbone/layer1/weights", "backbone/layer1/biases", "backbone/layer2/weights", "backbone/layer2/biases")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One tiny demo run (2 seeds, 20 steps) shared by the tests: (result, printed text, out dir)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    stream = io.StringIO()
    result = run_demo(out, seeds=2, steps=20, stream=stream)
    return result, stream.getvalue(), out


def test_writes_only_the_checkpoint_and_a_valid_png(demo):
    result, _, out = demo
    assert sorted(os.listdir(out)) == ["learning_curve.png", "pretrained"]
    data = (out / "learning_curve.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > height > 300
    assert result.plot == str(out / "learning_curve.png")


def test_prints_the_restore_report(demo):
    result, text, _ = demo
    report = result.warm[0].report
    assert str(report) in text
    assert report.matched_names == BACKBONE
    assert all(r.reason == "ema" for r in report.matched)
    assert [r.variable_name for r in report.missing] == [
        "head/hidden/weights", "head/hidden/biases", "head/logits/weights", "head/logits/biases"
    ]
    assert {r.checkpoint_name for r in report.unused} == {
        "digits/weights", "digits/biases",
        "digits/weights/ExponentialMovingAverage", "digits/biases/ExponentialMovingAverage",
    }
    assert "optimizer slot (Momentum) (6)" in text and "optimizer slot (Adam)" in text


def test_prints_the_group_table(demo):
    result, text, _ = demo
    groups = result.warm[0].groups
    assert str(groups) in text
    assert [(g.rule, g.multiplier, len(g.variables)) for g in groups] == [("backbone", 0.1, 4), ("head", 1.0, 4)]
    assert "GroupedOptimizer, Adam at 0.003 x multiplier" in text


def test_prints_the_accuracy_table_with_every_seed(demo):
    result, text, _ = demo
    table = text[text.index("[4/4]"):]
    lines = table.splitlines()
    assert lines[1].split() == ["seed", "cold", "warm", "warm", "-", "cold"]
    for w, c in zip(result.warm, result.cold):
        row = next(line.split() for line in lines if line.split()[:1] == [str(w.seed)])
        assert row[1:3] == [f"{c.final_accuracy:.1%}", f"{w.final_accuracy:.1%}"]
    mean = next(line.split() for line in lines if line.strip().startswith("mean "))
    assert mean[1] == f"{np.mean([r.final_accuracy for r in result.cold]) * 100:.1f}%"
    assert any(line.strip().startswith("std ") for line in lines)
    assert f"warm is ahead in {sum(w.final_accuracy > c.final_accuracy for w, c in zip(result.warm, result.cold))} of 2 seeds" in text


def test_curves_are_recorded_from_step_0_to_the_last(demo):
    result, _, _ = demo
    for run in result.warm + result.cold:
        assert run.steps == (0, 5, 10, 15, 20)
        assert all(0.0 <= a <= 1.0 for a in run.accuracy)


def test_warm_backbone_starts_at_the_checkpoints_ema_values(demo):
    result, _, _ = demo
    reader = tf.train.load_checkpoint(result.pretrained)
    for run in result.warm:
        assert sorted(run.initial) == sorted(BACKBONE)
        for name in BACKBONE:
            shadow = reader.get_tensor(f"{name}/ExponentialMovingAverage")
            np.testing.assert_array_equal(run.initial[name], shadow)
            # The shadow, not the raw weights: the two differ after pretraining.
            assert not np.array_equal(shadow, reader.get_tensor(name))


def test_cold_backbone_starts_fresh(demo):
    result, _, _ = demo
    reader = tf.train.load_checkpoint(result.pretrained)
    for run in result.cold:
        assert run.report is None
        weights = run.initial["backbone/layer1/weights"]
        assert not np.allclose(weights, reader.get_tensor("backbone/layer1/weights/ExponentialMovingAverage"))
    assert not np.array_equal(result.cold[0].initial["backbone/layer1/weights"], result.cold[1].initial["backbone/layer1/weights"])


def test_main_runs_in_process(tmp_path, capsys):
    assert main(["--seeds", "2", "--steps", "1", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "restorekit: " in out and "warm is ahead in" in out
    assert (tmp_path / "out" / "learning_curve.png").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "1"], "seeds must be an int of at least 2"),
        (["--steps", "0"], "steps must be an int of at least 1"),
        (["--shots", "500"], "shots must be at most"),
    ],
    ids=["one seed gives no spread", "zero steps", "more shots than the pool holds"],
)
def test_main_refuses_a_bad_budget_and_writes_nothing(tmp_path, capsys, argv, message):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_run_demo_raises_on_a_bad_budget(tmp_path):
    with pytest.raises(InvalidArgumentError, match="steps must be an int"):
        run_demo(tmp_path / "out", steps=2.5)
    assert not (tmp_path / "out").exists()
