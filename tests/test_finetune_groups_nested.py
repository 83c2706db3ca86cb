"""group_variables over nested Keras models and tf.Modules: rules name a nested model by its name."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit.finetune import group_variables, grouped_keras_optimizer


def _nested(head_units=2):
    keras.utils.set_random_seed(0)
    bi = keras.Input((4,))
    base = keras.Model(bi, keras.layers.Dense(5, name="d2")(keras.layers.Dense(5, name="d1")(bi)), name="backbone")
    inp = keras.Input((4,))
    return keras.Model(inp, keras.layers.Dense(head_units, name="head")(base(inp)), name="clf")


def _fit_one_step(model, groups):
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.1 * m), groups)
    model.compile(opt, "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("f")
    model.fit(x, rng.normal(size=(8, model.output_shape[-1])).astype("f"), epochs=1, batch_size=8, verbose=0)


@pytest.mark.parametrize("rules", [{"backbone": 0, "head": 1.0}, {"backbone/": 0, "head/": 1.0},
                                   {"backbone/d1": 0, "backbone/d2": 0, "head": 1.0}],
                         ids=["model name", "scope with slash", "layers inside the model"])
def test_a_rule_naming_a_nested_model_takes_its_variables(rules):
    model = _nested()
    groups = group_variables(rules, model)
    backbone = ["d1/kernel", "d1/bias", "d2/kernel", "d2/bias"]
    assert [v for g in groups for v in g.variables if g.frozen] == backbone
    assert groups.rule_for("d1/kernel") in ("backbone", "backbone/", "backbone/d1")
    assert groups.multiplier(model.get_layer("head").kernel) == 1.0


def test_frozen_nested_backbone_stays_bit_identical_after_fit():
    model = _nested()
    groups = group_variables({"backbone": 0, "head": 1.0}, model)
    backbone = model.get_layer("backbone")
    before = [v.numpy().tobytes() for v in backbone.trainable_variables]
    head_before = model.get_layer("head").kernel.numpy()
    _fit_one_step(model, groups)
    assert [v.numpy().tobytes() for v in backbone.trainable_variables] == before
    assert not np.array_equal(model.get_layer("head").kernel.numpy(), head_before)


def test_readme_rules_with_an_applications_backbone():
    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None,
                                          name="backbone")
    inp = keras.Input((32, 32, 3))
    out = keras.layers.Dense(2, name="head")(keras.layers.GlobalAveragePooling2D()(base(inp)))
    model = keras.Model(inp, out)
    groups = group_variables({"backbone/": 0, "head/": 1.0}, model)
    assert len(groups.frozen) == len(base.trainable_variables) > 20
    before = [v.numpy().tobytes() for v in base.trainable_variables]
    head_before = model.get_layer("head").kernel.numpy()
    opt = grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.1 * m), groups)
    model.compile(opt, "mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(4, 32, 32, 3)).astype("f"), rng.normal(size=(4, 2)).astype("f"), verbose=0)
    assert [v.numpy().tobytes() for v in base.trainable_variables] == before
    assert not np.array_equal(model.get_layer("head").kernel.numpy(), head_before)


def test_a_rule_matching_no_name_says_which_names_it_was_matched_against():
    with pytest.raises(restorekit.NoMatchError) as info:
        group_variables({"trunk": 0}, _nested())
    text = str(info.value)
    assert "group rule 'trunk' matches no name among 6 (variable names and paths through the model's layers" in text
    assert "'backbone/d1/kernel'" in text


def test_a_rule_matching_no_name_of_a_list_of_variables_names_only_variable_names():
    model = _nested()
    with pytest.raises(restorekit.NoMatchError) as info:
        group_variables({"backbone": 0}, model.trainable_variables)  # a list has no model to walk
    assert "matches no name among 6 (variable names)." in str(info.value)


def test_an_earlier_rule_taking_the_nested_names_is_still_reported():
    with pytest.raises(restorekit.NoMatchError, match="earlier rules took every name"):
        group_variables({"backbone": 0, "backbone/d1": 2.0}, _nested())


def test_tf_module_rules_match_attribute_paths():
    module = tf.Module()
    module.encoder = tf.Module()
    module.encoder.w = tf.Variable(1.0, name="w")
    module.head = tf.Variable(2.0, name="h")
    groups = group_variables({"encoder": 0}, module)
    assert [g.variables for g in groups if g.frozen] == [("w",)]
    assert groups.multiplier(module.head) == 1.0
