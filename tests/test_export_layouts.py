"""Tests for restorekit/layouts/: every common layer exported with layout='torch' computes the same in torch.nn.

Each case trains a small Keras 3 model a few steps (BatchNorm statistics move), exports
it, loads the file into a hand-built ``torch.nn`` twin with ``load_state_dict(strict=True)``
and compares outputs on one input (float32, atol 1e-5); then imports the file back and
restores it with ``tf.train.Checkpoint``. Everything goes through the public API
(``restorekit.convert``, ``export_checkpoint``, ``import_checkpoint``, ``CheckpointEditor.save``).
The twins live in tests/torch_twins.py: the cases that run them are marked ``requires_torch``;
the names, the refusals and the imports back run without torch.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import requires_torch
import restorekit
from restorekit._checkpoint import Checkpoint
from restorekit.edit import CheckpointEditor
from restorekit.errors import InvalidArgumentError, RestoreKitWarning
from restorekit.export import export_checkpoint, import_checkpoint
from restorekit.formats import safetensors as st_format
from restorekit.layouts import LayoutRecord, torch_view

L = keras.layers


def arrays(path):
    """The tensors of an exported ``.safetensors`` file, as numpy arrays."""
    return dict(st_format.read(path))


class Wrap(keras.Model):
    """A subclassed model holding one layer as ``self.layer`` (the torch twin's attribute too)."""

    def __init__(self, layer, self_attention=False):
        super().__init__()
        self.layer = layer
        self.self_attention = self_attention

    def call(self, x, training=False):
        if self.self_attention:
            return self.layer(x, x, training=training)
        return self.layer(x, training=training)


def rand(*shape):
    return lambda rng: rng.standard_normal(shape).astype(np.float32)


# name: (Keras layer, input); each one's torch.nn twin is torch_twins.TWINS[name]
CASES = {
    "dense": (lambda: L.Dense(4), rand(2, 3)),
    "conv1d": (lambda: L.Conv1D(4, 3), rand(2, 7, 3)),
    "conv2d": (lambda: L.Conv2D(4, 3), rand(2, 6, 6, 3)),
    "conv3d": (lambda: L.Conv3D(2, 2), rand(2, 4, 4, 4, 3)),
    "conv1d_transpose": (lambda: L.Conv1DTranspose(4, 3, strides=2), rand(2, 5, 3)),
    "conv2d_transpose": (lambda: L.Conv2DTranspose(4, 3, strides=2), rand(2, 4, 4, 3)),
    "depthwise_conv2d": (lambda: L.DepthwiseConv2D(3, depth_multiplier=2), rand(2, 6, 6, 3)),
    "depthwise_conv2d_mult1": (lambda: L.DepthwiseConv2D(3), rand(2, 6, 6, 3)),
    "separable_conv2d": (lambda: L.SeparableConv2D(5, 3, depth_multiplier=2), rand(2, 6, 6, 3)),
    "batch_norm": (lambda: L.BatchNormalization(), rand(4, 5)),
    "batch_norm_2d": (lambda: L.BatchNormalization(), rand(2, 4, 4, 3)),
    "layer_norm": (lambda: L.LayerNormalization(), rand(2, 5)),
    "group_norm": (lambda: L.GroupNormalization(2), rand(2, 4, 4, 6)),
    "embedding": (lambda: L.Embedding(10, 4), lambda rng: rng.integers(0, 10, (2, 5)).astype(np.int32)),
    "einsum_dense": (lambda: L.EinsumDense("ab,bcd->acd", output_shape=(2, 3), bias_axes="cd"), rand(2, 4)),
    "multi_head_attention": (lambda: L.MultiHeadAttention(2, 3), rand(2, 5, 6)),
    "lstm": (lambda: L.LSTM(5, return_sequences=True), rand(2, 4, 3)),
    "gru": (lambda: L.GRU(4, return_sequences=True), rand(2, 4, 3)),
    "simple_rnn": (lambda: L.SimpleRNN(4, return_sequences=True), rand(2, 4, 3)),
}


def train(model, x, steps=3):
    """A few SGD steps in training mode: weights and BatchNorm statistics move."""
    optimizer = keras.optimizers.SGD(0.1)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - 0.5))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))


def build(name, seed=0):
    keras.utils.set_random_seed(seed)
    layer, make_input = CASES[name]
    model = Wrap(layer(), self_attention=name == "multi_head_attention")
    x = make_input(np.random.default_rng(seed))
    model(x)
    return model, x


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> (checkpoint prefix, model, input), built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            model, x = build(name)
            train(model, x)
            prefix = tf.train.Checkpoint(model=model).save(str(tmp_path_factory.mktemp(name) / "ckpt"))
            cache[name] = (prefix, model, x)
        return cache[name]

    return get


@requires_torch
@pytest.mark.parametrize("name", list(CASES))
def test_torch_twin_loads_strictly_and_computes_what_keras_computes(trained, tmp_path, name):
    import torch
    from torch_twins import stored, torch_twin

    prefix, model, x = trained(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RestoreKitWarning)  # every tensor of these layers is mapped
        result = restorekit.convert(prefix, tmp_path / "m.safetensors", layout="torch")
    assert result.unmapped == ()
    twin = torch_twin(name, stored(tmp_path / "m.safetensors"))
    with torch.no_grad():
        out = twin(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, np.asarray(model(x, training=False)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["safetensors", pytest.param("pt", marks=requires_torch)])
@pytest.mark.parametrize("name", list(CASES))
def test_import_back_restores_with_tf_train_checkpoint(trained, tmp_path, name, fmt):
    prefix, model, x = trained(name)
    export_checkpoint(prefix, tmp_path / f"m.{fmt}", layout="torch")
    import_checkpoint(tmp_path / f"m.{fmt}", tmp_path / "back" / "ckpt")
    a, b = Checkpoint(prefix), Checkpoint(tmp_path / "back" / "ckpt")
    assert sorted(a.entries) == sorted(b.entries)
    for key in a.entries:
        if a.entries[key].dtype != "string":
            assert a.read(key).tobytes() == b.read(key).tobytes(), key
    fresh, _ = build(name, seed=1)
    tf.train.Checkpoint(model=fresh).restore(str(tmp_path / "back" / "ckpt")).assert_existing_objects_matched()
    for restored, original in zip(fresh.weights, model.weights, strict=True):
        np.testing.assert_array_equal(restored.numpy(), original.numpy(), err_msg=restored.path)


# ------------------------------------------------------------------ tf-slim and TF1 cells (name-based checkpoints)

tf1 = tf.compat.v1


def saved_graph(tmp_path, build, feed, train_steps=0):
    """Build a TF1 graph, train it, save it with a Saver; return (prefix, output on feed)."""
    with tf.Graph().as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, feed.shape)
        out = build(x)
        loss = tf.reduce_mean(tf.square(out - 0.5))
        step = tf1.train.GradientDescentOptimizer(0.3).minimize(loss) if train_steps else None
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(train_steps):
                sess.run(step, {x: feed})
            prefix = tf1.train.Saver().save(sess, str(tmp_path / "tf1" / "ckpt"))
    return prefix


def run_graph(prefix, build, feed):
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, feed.shape)
        out = build(x)
        with tf1.Session() as sess:
            tf1.train.Saver().restore(sess, prefix)
            return sess.run(out, {x: feed})


def slim_net(training):
    import tf_slim as slim

    def build(x):
        bn = {"is_training": training, "updates_collections": None, "fused": True, "decay": 0.5}  # scale=False: no gamma
        net = slim.conv2d(x, 4, 3, scope="conv1", normalizer_fn=slim.batch_norm, normalizer_params=bn)
        net = slim.separable_conv2d(net, None, 3, depth_multiplier=2, scope="dw")  # depthwise only
        return slim.separable_conv2d(net, 5, 3, depth_multiplier=1, scope="sep")
    return build


@pytest.fixture(scope="module")
def slim_checkpoint(tmp_path_factory):
    feed = np.random.default_rng(0).standard_normal((2, 6, 6, 3)).astype(np.float32)
    prefix = saved_graph(tmp_path_factory.mktemp("slim"), slim_net(True), feed, train_steps=3)
    return prefix, feed


@requires_torch
def test_slim_conv_batch_norm_without_gamma_depthwise_and_separable_in_torch(slim_checkpoint, tmp_path):
    import torch
    from torch_twins import SlimTwin, stored

    prefix, feed = slim_checkpoint
    ckpt = Checkpoint(prefix)
    assert "conv1/BatchNorm/gamma" not in ckpt.entries and ckpt.read("conv1/BatchNorm/moving_mean").any()
    export_checkpoint(prefix, tmp_path / "m.pt", layout="torch")
    state = stored(tmp_path / "m.pt")
    assert state["conv1.BatchNorm.weight"].eq(1).all() and state["conv1.BatchNorm.num_batches_tracked"] == 0
    twin = SlimTwin()
    twin.load_state_dict({k: v for k, v in state.items() if k.split(".")[0] in ("conv1", "dw", "sep")}, strict=True)
    with torch.no_grad():
        out = twin.eval()(torch.from_numpy(feed).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(out, run_graph(prefix, slim_net(False), feed), atol=1e-5, rtol=0)


def test_slim_import_back_is_bit_exact_and_restores_with_a_saver(slim_checkpoint, tmp_path):
    prefix, feed = slim_checkpoint
    restorekit.convert(prefix, tmp_path / "m.safetensors", layout="torch")
    restorekit.convert(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    a, b = Checkpoint(prefix), Checkpoint(tmp_path / "back" / "ckpt")
    assert sorted(a.entries) == sorted(b.entries)  # the added weight and num_batches_tracked are gone
    assert all(a.read(k).tobytes() == b.read(k).tobytes() for k in a.entries)
    np.testing.assert_array_equal(run_graph(str(tmp_path / "back" / "ckpt"), slim_net(False), feed),
                                  run_graph(prefix, slim_net(False), feed))


def tf1_lstm(units=5, forget_bias=1.0):
    """An LSTM over 4 steps with tf.compat.v1 LSTMCell's variables ('rnn/lstm_cell/kernel' [in+u, 4u], gates
    i, j, f, o) computed by TF's own LSTMBlockCell kernel (Keras 3 removed the LSTMCell class)."""
    def build(x):
        batch, steps, n_in = x.shape
        with tf1.variable_scope("rnn/lstm_cell"):
            kernel = tf1.get_variable("kernel", [n_in + units, 4 * units])
            bias = tf1.get_variable("bias", [4 * units], initializer=tf1.random_normal_initializer())
        c = h = tf.zeros([batch, units])
        zeros = tf.zeros([units])
        outputs = []
        for t in range(steps):
            _, c, _, _, _, _, h = tf.raw_ops.LSTMBlockCell(
                x=x[:, t], cs_prev=c, h_prev=h, w=kernel, wci=zeros, wcf=zeros, wco=zeros, b=bias,
                forget_bias=forget_bias, cell_clip=-1.0, use_peephole=False)
            outputs.append(h)
        return tf.stack(outputs, axis=1)
    return build


@pytest.mark.parametrize("forget_bias", [1.0, 0.0], ids=["default-forget-bias", "forget-bias-0"])
@requires_torch
def test_tf1_lstm_cell_becomes_nn_lstm(tmp_path, forget_bias):
    import torch
    from torch_twins import stored

    feed = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)
    prefix = saved_graph(tmp_path, tf1_lstm(forget_bias=forget_bias), feed)
    export_checkpoint(torch_view(Checkpoint(prefix), forget_bias=forget_bias), tmp_path / "m.safetensors")
    state = stored(tmp_path / "m.safetensors")
    lstm = torch.nn.LSTM(3, 5, batch_first=True)
    lstm.load_state_dict({k.removeprefix("rnn."): v for k, v in state.items() if k.startswith("rnn.")}, strict=True)
    with torch.no_grad():
        out = lstm(torch.from_numpy(feed))[0].numpy()
    np.testing.assert_allclose(out, run_graph(prefix, tf1_lstm(forget_bias=forget_bias), feed), atol=1e-5, rtol=0)
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    a, b = Checkpoint(prefix), Checkpoint(tmp_path / "back" / "ckpt")
    assert sorted(a.entries) == sorted(b.entries)
    assert all(a.read(k).tobytes() == b.read(k).tobytes() for k in a.entries)


# ------------------------------------------------------------------ what is not mapped is said, by name

def test_tf1_gru_cell_is_listed_and_warned_not_written_as_nn_gru(tmp_path):
    def build(x):
        with tf1.variable_scope("rnn/gru_cell"):
            for scope, cols in (("gates", 8), ("candidate", 4)):
                with tf1.variable_scope(scope):
                    kernel, bias = tf1.get_variable("kernel", [7, cols]), tf1.get_variable("bias", [cols])
        return tf.reduce_sum(kernel) + tf.reduce_sum(bias) + tf.reduce_sum(x)
    prefix = saved_graph(tmp_path, build, np.zeros((1,), np.float32))
    with pytest.warns(RestoreKitWarning, match=r"'rnn/gru_cell/gates/kernel': a TF1 GRUCell applies its reset gate"):
        result = export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    assert sorted(result.unmapped) == ["rnn/gru_cell/candidate/bias", "rnn/gru_cell/candidate/kernel",
                                       "rnn/gru_cell/gates/bias", "rnn/gru_cell/gates/kernel"]
    assert "left in TF layout (not mapped) 4" in str(result)
    record = st_format.read_record(tmp_path / "m.safetensors")
    assert sorted(record.unmapped) == ["rnn/gru_cell/candidate/bias", "rnn/gru_cell/candidate/kernel",
                                       "rnn/gru_cell/gates/bias", "rnn/gru_cell/gates/kernel"]
    tensors = dict(st_format.read(tmp_path / "m.safetensors"))
    np.testing.assert_array_equal(tensors["rnn.gru_cell.gates.kernel"], Checkpoint(prefix).read("rnn/gru_cell/gates/kernel"))


def test_keras_gru_with_reset_before_is_listed_and_keeps_tf_layout(tmp_path):
    keras.utils.set_random_seed(0)
    model = Wrap(L.GRU(4, reset_after=False))
    model(np.zeros((1, 2, 3), np.float32))
    prefix = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    with pytest.warns(RestoreKitWarning, match="reset_after=False"):
        export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    record = st_format.read_record(tmp_path / "m.safetensors")
    assert len(record.unmapped) == 3 and not any("weight_ih" in k for k in record.tensors)
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    tf.train.Checkpoint(model=model).restore(str(tmp_path / "back" / "ckpt")).assert_existing_objects_matched()


def test_writers_without_the_view_map_what_a_permutation_can_and_list_the_rest(trained, tmp_path):
    """A format module's write_checkpoint on a plain Checkpoint: nothing is written that merely looks right."""
    prefix, _, _ = trained("gru")
    with pytest.warns(RestoreKitWarning, match="torch_view"):
        st_format.write_checkpoint(Checkpoint(prefix), tmp_path / "m.safetensors", layout="torch")
    record = st_format.read_record(tmp_path / "m.safetensors")
    assert len(record.unmapped) == 3
    shapes = st_format.read_shapes(tmp_path / "m.safetensors")
    assert shapes["model.layer.cell.kernel"] == (3, 12)  # TF name and axes, not a transposed 'weight'
    prefix, _, _ = trained("dense")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RestoreKitWarning)
        st_format.write_checkpoint(Checkpoint(prefix), tmp_path / "d.safetensors", layout="torch")
    assert st_format.read_shapes(tmp_path / "d.safetensors")["model.layer.weight"] == (4, 3)


def test_streamed_tensors_known_only_by_name_refuse_what_the_layer_would_tell(tmp_path):
    tensors = [("lstm/lstm_cell/recurrent_kernel", np.ones((2, 8), np.float32)),
               ("mha/query/kernel", np.ones((4, 2, 2), np.float32)),
               ("fc/kernel", np.ones((3, 2), np.float32))]
    with pytest.warns(RestoreKitWarning) as caught:
        st_format.write(tmp_path / "m.safetensors", tensors, layout="torch")
    assert {str(w.message).split("'")[3] for w in caught} == {"lstm/lstm_cell/recurrent_kernel", "mha/query/kernel"}
    shapes = st_format.read_shapes(tmp_path / "m.safetensors")
    assert shapes == {"lstm.lstm_cell.recurrent_kernel": (2, 8), "mha.query.kernel": (4, 2, 2), "fc.weight": (2, 3)}


# ------------------------------------------------------------------ names of functional, Sequential and nested models

def test_functional_sequential_and_nested_models_are_named_by_their_layers(tmp_path):
    keras.utils.set_random_seed(0)
    block = keras.Sequential([L.Dense(3, name="inner")], name="block")
    inp = keras.Input((5,))
    x = L.BatchNormalization(name="bn")(L.Dense(4, name="fc")(inp))
    model = keras.Model(inp, block(x), name="net")
    prefix = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    names = {k for k in st_format.read_shapes(tmp_path / "m.safetensors") if not k.startswith(("save_counter", "_"))}
    assert names == {"fc.weight", "fc.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                     "bn.num_batches_tracked", "block.inner.weight", "block.inner.bias"}


def test_subclassed_model_names_follow_attributes_not_keras_auto_names(trained, tmp_path):
    prefix, model, _ = trained("batch_norm")
    assert model.layer.gamma.path.startswith("wrap")  # Keras names BatchNorm variables after the model
    export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    assert "model.layer.running_var" in st_format.read_shapes(tmp_path / "m.safetensors")


# ------------------------------------------------------------------ the record

def test_a_version_1_record_written_before_still_imports():
    text = '{"layout":"torch","strings":{},"tensors":{"fc.weight":{"name":"fc/kernel","perm":[1,0]}},"version":1}'
    record = LayoutRecord.from_json(text)
    name, array, dtype = record.restore("fc.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    assert name == "fc/kernel" and array.shape == (3, 2) and dtype is None
    assert [n for n, *_ in record.restore_all([("fc.weight", np.zeros((2, 3), np.float32))])] == ["fc/kernel"]
    assert LayoutRecord.from_json(record.to_json()).to_json() == record.to_json()


def test_a_record_refuses_one_part_alone_and_a_missing_part(trained, tmp_path):
    prefix, _, _ = trained("gru")
    export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    record = st_format.read_record(tmp_path / "m.safetensors")
    arrays = dict(st_format.read(tmp_path / "m.safetensors"))
    from restorekit.errors import CorruptCheckpointError

    with pytest.raises(InvalidArgumentError, match="restore_all"):
        record.restore("model.layer.bias_ih_l0", arrays["model.layer.bias_ih_l0"])
    del arrays["model.layer.bias_hh_l0"]
    with pytest.raises(CorruptCheckpointError, match="only some of the parts"):
        list(record.restore_all(arrays.items()))


# ------------------------------------------------------------------ the public API with options, shards and the editor

@requires_torch
def test_weights_only_with_layout_torch_maps_whole_layers_and_imports_back(tmp_path):
    import torch
    from torch_twins import stored, torch_twin

    model, x = build("lstm")
    optimizer = keras.optimizers.Adam(0.1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    result = restorekit.convert(prefix, tmp_path / "m.safetensors", layout="torch", weights_only=True)
    state = stored(tmp_path / "m.safetensors")
    assert not any(k.startswith(("optimizer", "save_counter")) for k in state) and result.dropped
    # Keras 3 tracks the weights under the optimizer first: they are named by their Keras path ('wrap/...').
    state = {"model.layer." + k.rpartition(".")[2]: v for k, v in state.items()}
    with torch.no_grad():
        out = torch_twin("lstm", state)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, np.asarray(model(x, training=False)), atol=1e-5, rtol=0)
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    fresh, _ = build("lstm", seed=1)
    tf.train.Checkpoint(model=fresh).read(str(tmp_path / "back" / "ckpt")).assert_existing_objects_matched()
    for restored, original in zip(fresh.weights, model.weights, strict=True):
        np.testing.assert_array_equal(restored.numpy(), original.numpy())


def test_a_rename_rule_with_layout_torch_names_the_renamed_layer(tmp_path):
    feed = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)
    prefix = saved_graph(tmp_path, tf1_lstm(), feed)
    export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch", rules=[(r"^rnn/", "enc/")])
    state = arrays(tmp_path / "m.safetensors")
    assert {"enc.weight_ih_l0", "enc.weight_hh_l0", "enc.bias_ih_l0", "enc.bias_hh_l0"} <= set(state)
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "back" / "ckpt")
    back = Checkpoint(tmp_path / "back" / "ckpt")
    assert back.read("enc/lstm_cell/kernel").tobytes() == Checkpoint(prefix).read("rnn/lstm_cell/kernel").tobytes()


def test_split_tensors_in_different_shards_join_on_import(trained, tmp_path):
    prefix, model, _ = trained("gru")
    result = restorekit.convert(prefix, tmp_path / "out", layout="torch", max_shard_size=64)
    assert len(result.files) > 3 and len(result.kept) == len(set(result.kept))
    restorekit.convert(tmp_path / "out", tmp_path / "back" / "ckpt")
    a, b = Checkpoint(prefix), Checkpoint(tmp_path / "back" / "ckpt")
    assert sorted(a.entries) == sorted(b.entries)
    assert all(a.read(k).tobytes() == b.read(k).tobytes() for k in a.entries if a.entries[k].dtype != "string")


def test_a_view_refuses_the_options_that_choose_its_tensors_and_writes_nothing(trained, tmp_path):
    prefix, _, _ = trained("dense")
    for options, match in (({"weights_only": True}, "choose the tensors a torch_view maps"),
                           ({"rules": [("a", "b")]}, "choose the tensors a torch_view maps"),
                           ({"layout": "tf"}, "exported with layout 'torch', not layout='tf'")):
        with pytest.raises(InvalidArgumentError, match=match):
            export_checkpoint(torch_view(Checkpoint(prefix)), tmp_path / "m.safetensors", **options)
    with pytest.raises(InvalidArgumentError, match="npz"):
        restorekit.convert(prefix, tmp_path / "m.npz", layout="torch")
    assert not list(tmp_path.iterdir())


@requires_torch
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_editor_save_with_layout_torch_goes_through_the_view(trained, tmp_path, fmt):
    import torch
    from torch_twins import stored, torch_twin

    prefix, model, x = trained("gru")
    editor = CheckpointEditor(prefix)
    bias = next(e.name for e in editor.list() if e.name.startswith("model/layer/cell/bias"))
    editor.set(bias, np.zeros_like(editor.get(bias)))  # an edited value: read, not copied
    out = tmp_path / ("m.safetensors" if fmt == "safetensors" else "m.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RestoreKitWarning)
        editor.save(out, format=fmt, layout="torch")
    state = stored(out)
    assert not state["model.layer.bias_ih_l0"].any() and not state["model.layer.bias_hh_l0"].any()
    model.layer.cell.bias.assign(np.zeros(model.layer.cell.bias.shape, np.float32))
    with torch.no_grad():
        got = torch_twin("gru", state)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, np.asarray(model(x, training=False)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["safetensors", pytest.param("pt", marks=requires_torch)])
def test_file_to_file_with_layout_torch_maps_whole_layers_as_the_export_does(trained, tmp_path, fmt):
    prefix, _, _ = trained("gru")
    export_checkpoint(prefix, tmp_path / "direct.safetensors", layout="torch")
    export_checkpoint(prefix, tmp_path / f"plain.{fmt}")  # TF names and axes, the object graph in the record
    result = restorekit.convert(tmp_path / f"plain.{fmt}", tmp_path / "converted.safetensors", layout="torch")
    direct, converted = arrays(tmp_path / "direct.safetensors"), arrays(tmp_path / "converted.safetensors")
    assert sorted(converted) == sorted(direct) and "model.layer.bias_hh_l0" in converted
    assert all(converted[k].tobytes() == v.tobytes() for k, v in direct.items())
    assert result.unmapped == ()


def test_a_keras_files_optimizer_state_is_reported_kept_in_tf_layout(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, L.Dense(2, name="fc")(inputs))
    model.compile("adam", "mse")
    model.fit(np.zeros((4, 4), np.float32), np.zeros((4, 2), np.float32), verbose=0)
    model.save_weights(tmp_path / "m.weights.h5")
    result = restorekit.convert(str(tmp_path / "m.weights.h5"), tmp_path / "m.safetensors", layout="torch")
    optimizer = [k for k in Checkpoint(str(tmp_path / "m.weights.h5")).entries if k.startswith("optimizer/")]
    assert optimizer and len(result.kept) == len(optimizer)
    assert f"{len(optimizer)} optimizer tensors left in TF layout" in str(result)


def test_a_tf1_checkpoints_name_based_optimizer_slots_are_reported_kept_in_tf_layout(tmp_path):
    """TF1 slots (``fc/kernel/Adam``) and Adam's beta powers stay in TF axes, and the result says so."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, (2, 4))
        kernel = tf1.get_variable("fc/kernel", [4, 3])
        bias = tf1.get_variable("fc/bias", [3])
        step = tf1.train.AdamOptimizer(0.1).minimize(tf.reduce_sum(tf.square(tf.matmul(x, kernel) + bias)))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(step, {x: np.ones((2, 4), np.float32)})
            prefix = tf1.train.Saver().save(sess, str(tmp_path / "tf1" / "ckpt"))
    result = export_checkpoint(prefix, tmp_path / "m.safetensors", layout="torch")
    assert sorted(result.kept) == ["beta1_power", "beta2_power", "fc/bias/Adam", "fc/bias/Adam_1",
                                   "fc/kernel/Adam", "fc/kernel/Adam_1"]
    assert "6 optimizer tensors left in TF layout" in str(result)
    stored = arrays(tmp_path / "m.safetensors")
    assert stored["fc.weight"].shape == (3, 4) and stored["fc.kernel.Adam"].shape == (4, 3)
