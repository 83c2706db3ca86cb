"""restorekit.rules: name rewriting rules (renumbering of uniquified layer names)."""

from __future__ import annotations

from restorekit.rules import KERAS_FROM_KERAS2, Rules


def test_renumbering_pairs_uniquified_layers_in_order_past_a_name_with_a_line_break():
    # Checkpoint keys are any strings (a safetensors or Keras file may hold a line break in a
    # layer name); the suffix rule once matched no such name and crashed with AttributeError.
    checkpoint = ["dense_1/kernel", "dense_2/kernel", "notes\nv2/kernel", "dense\n_3/kernel"]
    mapping = Rules(renumber=True).mapping(["dense/kernel", "dense_1/kernel"], checkpoint)
    assert mapping == {"dense/kernel": "dense_1/kernel", "dense_1/kernel": "dense_2/kernel"}


def test_a_model_name_with_a_line_break_keeps_its_name_under_the_keras2_rules():
    mapping = KERAS_FROM_KERAS2.mapping(["odd\nlayer/kernel", "dense/kernel"], ["dense_1/kernel"])
    assert mapping == {"odd\nlayer/kernel": "odd\nlayer/kernel", "dense/kernel": "dense_1/kernel"}
