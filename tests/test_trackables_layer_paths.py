"""restorekit._trackables.layer_paths: a variable's path through a model's named layers."""

import keras
import tensorflow as tf

from restorekit._trackables import layer_paths


class _Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner")

    def build(self, shape):
        self.inner.build(shape)
        self.scale = self.add_weight(shape=(1,), name="scale")

    def call(self, x):
        return self.inner(x) * self.scale


def test_nested_model_and_custom_block_paths():
    bi = keras.Input((4,))
    base = keras.Model(bi, keras.layers.Dense(5, name="d1")(bi), name="backbone")
    inp = keras.Input((4,))
    model = keras.Model(inp, _Block(name="blk")(base(inp)))
    paths = layer_paths(model)
    assert [paths[id(v)] for v in model.trainable_variables] == [
        "backbone/d1/kernel", "backbone/d1/bias", "blk/scale", "blk/inner/kernel", "blk/inner/bias"]
    assert [v.path for v in base.trainable_variables] == ["d1/kernel", "d1/bias"]  # what Keras alone says


def test_tf_module_gets_attribute_paths():
    module = tf.Module()
    module.enc = tf.Module()
    module.enc.w = tf.Variable(1.0, name="w")
    assert layer_paths(module) == {id(module.enc.w): "enc/w"}
