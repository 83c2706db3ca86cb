"""Tests for restorekit/demo/: the transfer-learning demo runs, restores what it says, prints counts that add up."""

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit.cli import main as cli_main
from restorekit.demo import ARMS, load_tasks, plot_learning_curves, run_demo
from restorekit.errors import InvalidArgumentError, MissingDependencyError

BACKBONE = ("backbone/conv1/weights", "backbone/conv1/biases", "backbone/conv2/weights", "backbone/conv2/biases")
HEAD = ("head/logits/weights", "head/logits/biases")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One tiny demo run (2 seeds, 10 steps, 2 shots) shared by the tests: (result, printed text, out dir)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    stream = io.StringIO()
    result = run_demo(out, seeds=2, steps=10, shots=2, stream=stream)
    return result, stream.getvalue(), out


def test_tasks_split_the_digits_into_0_to_4_and_5_to_9():
    tasks = load_tasks()
    from sklearn.datasets import load_digits

    target = load_digits().target
    assert len(tasks.a_train[1]) + len(tasks.a_test[1]) == int((target < 5).sum())
    assert len(tasks.b_pool[1]) + len(tasks.b_test[1]) == int((target >= 5).sum())
    for _, labels in (tasks.a_train, tasks.a_test, tasks.b_pool, tasks.b_test):
        assert set(labels.tolist()) == {0, 1, 2, 3, 4}


def test_writes_only_the_checkpoint_and_a_valid_png(demo):
    result, _, out = demo
    assert sorted(os.listdir(out)) == ["learning_curve.png", "pretrained"]
    data = (out / "learning_curve.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > height > 300
    assert result.plot == str(out / "learning_curve.png")


def test_checkpoint_holds_weights_momentum_slots_ema_shadows_and_global_step(demo):
    result, _, _ = demo
    names = set(restorekit.Checkpoint(result.pretrained))
    weights = {*BACKBONE, "digits/weights", "digits/biases"}
    assert names == (
        weights | {f"{n}/Momentum" for n in weights} | {f"{n}/ExponentialMovingAverage" for n in weights} | {"global_step"}
    )
    assert tf.train.load_checkpoint(result.pretrained).get_tensor("global_step") == 1000


def test_prints_the_restore_report(demo):
    result, text, _ = demo
    report = result.warm[0].report
    assert str(report) in text
    assert report.matched_names == BACKBONE
    assert all(r.reason == "ema" for r in report.matched)
    assert [r.variable_name for r in report.missing] == list(HEAD)
    assert {r.checkpoint_name for r in report.unused} == {
        "digits/weights", "digits/biases",
        "digits/weights/ExponentialMovingAverage", "digits/biases/ExponentialMovingAverage",
    }
    assert "optimizer slot (Momentum) (6)" in text and "optimizer slot (Adam) (16)" in text


def _parts(text: str) -> dict:
    """'6 weights + 6 EMA shadows + 1 global_step' -> {'weights': 6, ...}."""
    return {kind: int(n) for n, kind in re.findall(r"(\d+) ([A-Za-z_][A-Za-z_ ]*?)(?= \+|$|\))", text)}


def _row(text: str, label: str) -> int:
    return int(re.search(rf"^  {label}\s+(\d+)", text, re.M).group(1))


def test_report_counts_add_up(demo):
    result, text, _ = demo
    report = result.warm[0].report
    block = text[text.index("how the counts add up:"):text.index("[3/4]")]
    graph, entries, matched, skipped, unused = [line.strip() for line in block.splitlines()[1:6]]

    # the graph: model variables + optimizer slots + global_step = the report's total
    total, model, rest = re.match(r"the new graph's (\d+) variables = (\d+) model variables \(.*?\) \+ (.*)", graph).groups()
    assert int(total) == report.num_variables
    assert int(model) == len(report.matched) + len(report.missing) == len(BACKBONE) + len(HEAD)
    assert _parts(rest) == {"Adam slots": 16, "global_step": 1}
    assert int(model) + sum(_parts(rest).values()) == report.num_variables

    # the checkpoint: every entry counted once, by kind
    total, rest = re.match(r"the checkpoint's (\d+) entries = (.*)", entries).groups()
    assert int(total) == len(restorekit.Checkpoint(result.pretrained)) == sum(_parts(rest).values())
    assert _parts(rest) == {"weights": 6, "EMA shadows": 6, "Momentum slots": 6, "global_step": 1}
    assert matched.startswith(f"matched {_row(text, 'matched')}:")

    # skipped: graph side + checkpoint side - names on both sides = the report's row
    m = re.match(r"skipped (\d+) = (\d+) in the graph \((.*?)\) \+ (\d+) in the checkpoint \((.*?)\) - (\d+) on both", skipped)
    total, in_graph, graph_parts, in_checkpoint, checkpoint_parts, both = m.groups()
    assert int(total) == _row(text, "skipped") == int(in_graph) + int(in_checkpoint) - int(both)
    assert int(in_graph) == sum(_parts(graph_parts).values()) and int(in_checkpoint) == sum(_parts(checkpoint_parts).values())
    assert _parts(checkpoint_parts) == {"raw weights": 4, "Momentum slots": 6, "global_step": 1}
    assert unused.startswith(f"unused {_row(text, 'unused')}: ") and _parts(unused.split("(", 1)[1]) == {
        "weights": 2, "EMA shadows": 2
    }
    # every entry of the checkpoint is accounted for exactly once
    assert len(report.matched) + int(in_checkpoint) + len(report.unused) == len(restorekit.Checkpoint(result.pretrained))


def test_prints_the_group_tables(demo):
    result, text, _ = demo
    assert str(result.warm[0].groups) in text and str(result.probe[0].groups) in text
    assert [(g.rule, g.multiplier, len(g.variables)) for g in result.warm[0].groups] == [("backbone", 0.1, 4), ("head", 1.0, 2)]
    assert [(g.rule, g.frozen, len(g.variables)) for g in result.probe[0].groups] == [("backbone", True, 4), ("head", False, 2)]
    assert "GroupedOptimizer, Adam at 0.003 x multiplier" in text


def test_prints_the_accuracy_table_with_every_seed_and_arm(demo):
    result, text, _ = demo
    lines = text[text.index("[4/4]"):].splitlines()
    assert lines[1].split() == ["seed", "cold", "probe", "warm", "probe", "-", "cold", "warm", "-", "cold"]
    for i, seed in enumerate((0, 1)):
        row = next(line.split() for line in lines if line.split()[:1] == [str(seed)])
        assert row[1:4] == [f"{result.runs[arm][i].final_accuracy:.1%}" for arm in ARMS]
    mean = next(line.split() for line in lines if line.strip().startswith("mean "))
    assert mean[1:4] == [f"{np.mean([r.final_accuracy for r in result.runs[arm]]) * 100:.1f}%" for arm in ARMS]
    for arm in ("probe", "warm"):
        wins = sum(a.final_accuracy > c.final_accuracy for a, c in zip(result.runs[arm], result.cold))
        assert f"{arm} is ahead of cold in {wins} of 2 seeds" in text
        assert re.search(rf"^  {arm} - cold: [+-]\d+\.\d\d pts on average, two standard errors \d+\.\d\d: ", text, re.M)


def test_curves_are_recorded_from_step_0_to_the_last(demo):
    result, _, _ = demo
    for arm in ARMS:
        for run in result.runs[arm]:
            assert run.arm == arm and run.steps == (0, 5, 10)
            assert all(0.0 <= a <= 1.0 for a in run.accuracy)


def test_the_three_arms_see_the_same_images_and_start_from_the_same_head(demo):
    result, _, _ = demo
    tasks = load_tasks()
    for i in range(2):
        cold, probe, warm = (result.runs[arm][i] for arm in ARMS)
        assert cold.seed == probe.seed == warm.seed == i
        np.testing.assert_array_equal(cold.images, probe.images)
        np.testing.assert_array_equal(cold.images, warm.images)
        assert cold.images.shape == (2 * 5, 64)  # 2 shots of each of 5 classes
        pool = {row.tobytes() for row in tasks.b_pool[0]}
        assert all(row.tobytes() in pool for row in cold.images)
        for name in HEAD:
            np.testing.assert_array_equal(cold.initial[name], probe.initial[name])
            np.testing.assert_array_equal(cold.initial[name], warm.initial[name])
    assert not np.array_equal(result.cold[0].images, result.cold[1].images)


def test_restored_backbones_start_at_the_checkpoints_ema_values(demo):
    result, _, _ = demo
    reader = tf.train.load_checkpoint(result.pretrained)
    for run in result.probe + result.warm:
        for name in BACKBONE:
            shadow = reader.get_tensor(f"{name}/ExponentialMovingAverage")
            np.testing.assert_array_equal(run.initial[name], shadow)
            # The shadow, not the raw weights: the two differ after pretraining.
            assert not np.array_equal(shadow, reader.get_tensor(name))


def test_probe_keeps_the_backbone_frozen_and_warm_trains_it(demo):
    result, _, _ = demo
    reader = tf.train.load_checkpoint(result.pretrained)
    for probe, warm in zip(result.probe, result.warm):
        for name in BACKBONE:
            np.testing.assert_array_equal(probe.final[name], reader.get_tensor(f"{name}/ExponentialMovingAverage"))
        assert not np.array_equal(warm.final["backbone/conv1/weights"], warm.initial["backbone/conv1/weights"])
        for name in HEAD[:1]:
            assert not np.array_equal(probe.final[name], probe.initial[name])


def test_cold_backbone_starts_fresh(demo):
    result, _, _ = demo
    reader = tf.train.load_checkpoint(result.pretrained)
    for run in result.cold:
        assert run.report is None
        weights = run.initial["backbone/conv1/weights"]
        assert not np.allclose(weights, reader.get_tensor("backbone/conv1/weights/ExponentialMovingAverage"))
    assert not np.array_equal(result.cold[0].initial["backbone/conv1/weights"], result.cold[1].initial["backbone/conv1/weights"])


@pytest.mark.slow  # a second whole demo run; the module fixture already runs one
def test_cli_demo_passes_its_options_through(tmp_path, capsys):
    assert cli_main(["demo", "--seeds", "2", "--steps", "1", "--shots", "1", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "after 1 steps (2 seeds;" in out and "5 training images (1 per class)" in out
    assert "restorekit: " in out and "warm is ahead of cold in" in out and "how the counts add up:" in out
    assert (tmp_path / "out" / "learning_curve.png").is_file()


def test_cli_demo_help_lists_the_options(capsys):
    assert cli_main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--seeds N", "--steps N", "--shots N", "--out DIR"):
        assert option in out
    assert "digits 0-4" in out


def test_cli_demo_help_as_a_subprocess():
    done = subprocess.run([sys.executable, "-m", "restorekit", "demo", "--help"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "--shots N" in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "1"], "seeds must be an int of at least 2"),
        (["--steps", "0"], "steps must be an int of at least 1"),
        (["--shots", "500"], "shots must be at most"),
    ],
    ids=["one seed gives no spread", "zero steps", "more shots than the pool holds"],
)
def test_cli_demo_refuses_a_bad_budget_and_writes_nothing(tmp_path, capsys, argv, message):
    assert cli_main(["demo", *argv, "--out", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err
    assert err.startswith(f"restorekit: error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def _unimportable(monkeypatch, *modules):
    """Make ``modules`` (and their loaded submodules) fail to import, as if not installed."""
    for name in list(sys.modules):
        if name.split(".")[0] in modules:
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize(
    "modules, names",
    [
        (["sklearn"], "scikit-learn, which is"),
        (["matplotlib"], "matplotlib, which is"),
        (["sklearn", "matplotlib"], "scikit-learn and matplotlib, which are"),
    ],
    ids=["without scikit-learn", "without matplotlib", "without either"],
)
def test_cli_demo_without_the_demo_extra_prints_one_error_line_and_exits_3(tmp_path, capsys, monkeypatch,
                                                                           modules, names):
    _unimportable(monkeypatch, *modules)
    assert cli_main(["demo", "--seeds", "2", "--steps", "1", "--out", str(tmp_path / "out")]) == 3
    out, err = capsys.readouterr()
    assert err == f"restorekit: error: the demo needs {names} not installed: pip install 'restorekit[demo]'\n"
    assert out == ""
    assert not (tmp_path / "out").exists()  # refused before pretraining, not after it


def test_cli_demo_without_tensorflow_either_names_the_tf_extra_too(tmp_path, capsys, monkeypatch):
    _unimportable(monkeypatch, "sklearn", "tensorflow")
    assert cli_main(["demo", "--out", str(tmp_path / "out")]) == 3
    assert capsys.readouterr().err == (
        "restorekit: error: the demo needs TensorFlow and scikit-learn, which are not installed: "
        "pip install 'restorekit[tf,demo]'\n"
    )
    assert not (tmp_path / "out").exists()


def test_the_demo_functions_name_the_extra_they_need(tmp_path, monkeypatch):
    _unimportable(monkeypatch, "sklearn", "matplotlib")
    with pytest.raises(MissingDependencyError, match=r"scikit-learn, which is not installed: pip install 'restorekit\[demo\]'"):
        load_tasks()
    with pytest.raises(MissingDependencyError, match=r"matplotlib, which is not installed: pip install 'restorekit\[demo\]'"):
        plot_learning_curves({}, tmp_path / "curve.png")
    assert list(tmp_path.iterdir()) == []


def test_python_m_restorekit_demo_is_the_cli_command():
    done = subprocess.run([sys.executable, "-m", "restorekit", "demo", "--seeds", "1"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 3
    assert done.stderr == "restorekit: error: seeds must be an int of at least 2, got 1\n"


def test_cli_demo_refuses_an_unknown_option(capsys):
    assert cli_main(["demo", "--bogus", "1"]) == 2
    assert "--bogus" in capsys.readouterr().err


def test_run_demo_raises_on_a_bad_budget(tmp_path):
    with pytest.raises(InvalidArgumentError, match="steps must be an int"):
        run_demo(tmp_path / "out", steps=2.5)
    assert not (tmp_path / "out").exists()
