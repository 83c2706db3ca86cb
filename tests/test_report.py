"""restorekit/_report.py: a RestoreReport is a value (text, JSON, pickle) that keeps its live side private."""

import json
import pickle

import numpy as np
import pytest
import tensorflow as tf

from restorekit import scan
from restorekit.errors import IncompleteRestoreError, InvalidArgumentError
from restorekit._report import Record, RestoreReport, format_bytes, format_shape, live_handles, plain_records, policy_of

tf1 = tf.compat.v1


def _report(**fields):
    return RestoreReport(checkpoint="ckpt/model.ckpt-1", num_variables=4, **fields)


SAMPLE = _report(
    matched=(Record("a/w", "a/w", (2, 3), "float32", (2, 3), "float32"),
             Record("a/b", "a/b/ExponentialMovingAverage", (3,), "float32", (3,), "float32", reason="ema")),
    missing=(Record("head/w", "head/w", (3, 10), "float32"),),
    shape_mismatched=(Record("logits/w", "logits/w", (3, 10), "float32", (3, 1000), "float32"),),
    skipped=(Record("a/w/Momentum", None, (2, 3), "float32", reason="optimizer slot (Momentum)"),
             Record(None, "a/w/Momentum", checkpoint_shape=(2, 3), checkpoint_dtype="float32",
                    reason="optimizer slot (Momentum)"),
             Record(None, "global_step", checkpoint_shape=(), checkpoint_dtype="int64", reason="global_step"),
             Record(None, "x/Adam", checkpoint_shape=(1,), checkpoint_dtype="float32", reason="optimizer slot (Adam)")),
    unused=(Record(None, "old/w", checkpoint_shape=(5,), checkpoint_dtype="float32"),),
    hints=("'logits/w' differs only in shape",),
)


def test_text_is_a_table_a_person_can_act_on():
    text = str(SAMPLE)
    lines = text.splitlines()
    assert lines[0] == "restorekit: ckpt/model.ckpt-1 -> 4 variables"
    assert lines[1].split()[:3] == ["matched", "2", "1"]  # "1 via ema"
    assert "head/w [3, 10]" in lines[2]
    assert "logits/w (checkpoint [3, 1000], model [3, 10])" in lines[3]
    # a name skipped on both sides counts once; ties print in a fixed order
    assert lines[4].split()[:2] == ["skipped", "3"]
    assert lines[4].endswith("global_step (1), optimizer slot (Adam) (1), optimizer slot (Momentum) (1)")
    assert "old/w [5]" in lines[5]
    assert lines[6] == "  hint: 'logits/w' differs only in shape"


def test_json_round_trips_shapes_as_lists():
    data = json.loads(SAMPLE.to_json())
    assert data["is_complete"] is False
    assert data["shape_mismatched"][0]["checkpoint_shape"] == [3, 1000]
    assert [r["variable_name"] for r in data["matched"]] == ["a/w", "a/b"]
    assert data["hints"] == list(SAMPLE.hints)


def test_incomplete_message_and_error_carry_the_report():
    with pytest.raises(IncompleteRestoreError) as info:
        SAMPLE.assert_complete()
    assert info.value.report is SAMPLE
    assert "cannot restore 2 of 4 variables" in str(info.value)
    assert "Pass strict=False to restore the 2 that fit" in str(info.value)


def test_pickled_report_is_equal_but_has_no_live_side():
    with tf.Graph().as_default():
        v = tf1.get_variable("a/w", initializer=np.ones((2, 3), np.float32))
        report = RestoreReport("ckpt", 1, matched=(Record("a/w", "a/w", (2, 3), "float32", (2, 3), "float32"),),
                               _handles={"a/w": v}, _policies={})
        assert live_handles(report)["a/w"] is v
        clone = pickle.loads(pickle.dumps(report))
    assert clone == report
    with pytest.raises(InvalidArgumentError, match="unpickled or rebuilt"):
        live_handles(clone)
    assert policy_of(clone, "a/w") is None


def test_policy_of_and_plain_records_split_copies_from_computed_values(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", shape=[4, 3])
        tf1.get_variable("logits/kernel", shape=[3, 7])  # 5 classes in the checkpoint
        report = scan(prefix, shape_policy={"logits": "slice_or_pad"})
    assert policy_of(report, "logits/kernel") == "slice_or_pad"
    assert policy_of(report, "dense/kernel") is None
    assert [r.variable_name for r in plain_records(report)] == ["dense/kernel"]


def test_live_handles_refuses_other_objects():
    with pytest.raises(InvalidArgumentError, match="expected a RestoreReport"):
        live_handles({"a": 1})


@pytest.mark.parametrize("value,text", [((2, None), "[2, ?]"), (None, "?"), ((), "[]")], ids=["unknown-dim", "unknown-rank", "scalar"])
def test_format_shape(value, text):
    assert format_shape(value) == text


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024 * 1024) == "3.0 MiB"
