"""Tests for restorekit/_targets.py: what ``variables`` may be, and the name of each kind of variable."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from restorekit.errors import InvalidArgumentError
from restorekit._targets import collect, is_keras_variable, tf_variable, variable_name


@pytest.mark.parametrize(
    "variables, message",
    [
        ("dense/kernel", "got str"),
        (5, "got int"),
        (tf.Variable(np.zeros(3), name="w"), "pass \\[variable\\]"),
        ({5: tf.Variable(1.0, name="b")}, "got key 5"),
    ],
    ids=["a-name", "an-int", "a-lone-variable", "a-dict-keyed-by-int"],
)
def test_variables_that_are_not_variables_are_invalid_arguments(variables, message):
    with pytest.raises(InvalidArgumentError, match=message):
        collect(variables)


def test_keras_and_tf_variables_are_named_and_unwrapped_alike():
    layer = keras.layers.Dense(2, name="head")
    layer.build((None, 3))
    plain = tf.Variable(1.0, name="scope/w")
    assert is_keras_variable(layer.kernel) and not is_keras_variable(plain)
    assert variable_name(layer.kernel) == "head/kernel"
    assert variable_name(plain) == "scope/w"
    assert isinstance(tf_variable(layer.kernel), tf.Variable)
    assert tf_variable(plain) is plain
    assert [t.variable_name for t in collect([layer.kernel, plain])] == ["head/kernel", "scope/w"]
