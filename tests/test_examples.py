"""The example scripts run as a user would run them, and do what they print."""

import importlib.util
import os

import numpy as np

import restorekit

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keras_from_tf1_restores_a_sequential_model_with_a_grown_head(tmp_path, capsys):
    report = load("keras_from_tf1").main(str(tmp_path))
    assert report.is_complete and len(report.matched) == 4
    # the model's own name is Keras' counter ('sequential', 'sequential_1', ...: it depends on what ran before)
    reasons = {r.variable_name.split("/", 1)[1]: r.reason for r in report.matched}
    assert reasons["logits/kernel"] == "slice_or_pad"
    assert "head keeps its 3 trained classes" in capsys.readouterr().out


def test_freeze_unfreeze_round_trip(tmp_path, capsys):
    load("freeze_unfreeze").main(str(tmp_path))
    out = capsys.readouterr().out
    assert "unfrozen outputs equal the original: True" in out
    assert "one training step changed them:      True" in out
    original = restorekit.Checkpoint(os.path.join(tmp_path, "unfrozen", "model.ckpt"))
    assert len(original) > 0 and all(np.isfinite(original.read(n)).all() for n in original)


def test_keras_fit_warm_start_is_interrupted_and_resumes(tmp_path, capsys):
    start, history = load("keras_fit_warm_start").main(str(tmp_path))
    out = capsys.readouterr().out
    assert out.count("warm-started from") == 1 and "missing        2   new_head/kernel" in out
    assert "first launch: interrupted after epoch 1" in out and "resumed from backup" in out
    assert start.resumed and history.epoch == [2, 3]
    assert not os.path.exists(tmp_path / "pretrained.weights.h5")
