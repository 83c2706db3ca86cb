"""Several sources in one restore (restorekit/_sources.py): lists, {pattern: source} mappings, From options,
into TF1 graphs (MonitoredTrainingSession) and Keras 3 models, from checkpoints of different formats."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import Checkpoint, InvalidArgumentError, NoMatchError
from restorekit.cli import main
from conftest import save_variables

tf1 = tf.compat.v1


def _values(seed: int, scope: str = "") -> dict:
    rng = np.random.RandomState(seed)
    return {
        f"{scope}encoder/kernel": rng.randn(4, 3).astype(np.float32),
        f"{scope}encoder/bias": rng.randn(3).astype(np.float32),
        f"{scope}decoder/kernel": rng.randn(3, 2).astype(np.float32),
        f"{scope}decoder/bias": rng.randn(2).astype(np.float32),
    }


@pytest.fixture
def sources(tmp_path):
    """A TF1 name-based checkpoint (encoder and a stale decoder) and a safetensors file restorekit converted
    from another TF checkpoint (decoder only): the same names, other values."""
    enc_values = _values(1)
    enc = save_variables(tmp_path / "enc" / "model.ckpt", enc_values)
    dec_values = {k: v for k, v in _values(2).items() if k.startswith("decoder/")}
    dec_tf = save_variables(tmp_path / "dec_tf" / "model.ckpt", dec_values)
    dec = str(tmp_path / "decoder.safetensors")
    restorekit.convert(dec_tf, dec)
    return enc, enc_values, dec, dec_values


def _graph_model():
    """encoder, decoder and a new head in the default graph, as tf.layers.dense names them."""
    for scope, shape in (("encoder", (4, 3)), ("decoder", (3, 2)), ("head", (2, 5))):
        with tf1.variable_scope(scope):
            tf1.get_variable("kernel", shape, initializer=tf1.glorot_uniform_initializer())
            tf1.get_variable("bias", shape[1:], initializer=tf1.zeros_initializer())
    tf1.train.get_or_create_global_step()
    return {v.op.name: v for v in tf1.global_variables()}


def test_encoder_and_decoder_from_two_formats_through_the_scaffold_in_a_monitored_session(sources, tmp_path):
    enc, enc_values, dec, dec_values = sources
    with tf.Graph().as_default():
        handles = _graph_model()
        scaffold = restorekit.easy_going_scaffold({"encoder": enc, "decoder": dec})
        report = scaffold.restore_report
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=str(tmp_path / "run"),
                                                save_checkpoint_secs=None, save_checkpoint_steps=None) as sess:
            got = sess.run(handles)
    for name, value in enc_values.items():
        expected = dec_values[name] if name.startswith("decoder/") else value
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
    assert got["head/kernel"].shape == (2, 5)  # initialized, not restored
    sources_of = {r.variable_name: r.source for r in report.matched}
    assert sources_of == {"encoder/kernel": enc, "encoder/bias": enc, "decoder/kernel": dec, "decoder/bias": dec}
    assert report.sources == (enc, dec)
    assert report.checkpoint == f"{enc} + {dec}"
    assert {r.variable_name for r in report.missing} == {"head/kernel", "head/bias"}
    assert all(r.source is None and "no_source" in r.how for r in report.missing)
    # the encoder checkpoint's decoder entries are left out on purpose, naming their source
    other = {(r.checkpoint_name, r.source) for r in report.skipped if "other_source" in r.how}
    assert other == {("decoder/kernel", enc), ("decoder/bias", enc)}
    text = str(report)
    assert f"from {enc}: 2 matched" in text and f"from {dec}: 2 matched" in text
    as_dict = report.to_dict()
    assert as_dict["sources"] == [enc, dec]
    assert {r["variable_name"]: r["source"] for r in as_dict["matched"]} == sources_of
    json.dumps(as_dict)


def test_into_a_keras_model_from_a_tf1_checkpoint_and_a_keras_weights_file(sources, tmp_path):
    enc, enc_values, _, _ = sources

    def model():
        inp = keras.Input((4,))
        h = keras.layers.Dense(3, name="encoder")(inp)
        h = keras.layers.Dense(2, name="decoder")(h)
        return keras.Model(inp, keras.layers.Dense(5, name="head")(h))

    donor = model()
    h5 = str(tmp_path / "donor.weights.h5")
    donor.save_weights(h5)
    target = model()
    head_before = target.get_layer("head").kernel.numpy()
    report = restorekit.scan({"encoder": enc, "decoder": h5}, target)
    restorekit.restore(report)
    np.testing.assert_array_equal(target.get_layer("encoder").kernel.numpy(), enc_values["encoder/kernel"])
    np.testing.assert_array_equal(target.get_layer("encoder").bias.numpy(), enc_values["encoder/bias"])
    np.testing.assert_array_equal(target.get_layer("decoder").kernel.numpy(), donor.get_layer("decoder").kernel.numpy())
    np.testing.assert_array_equal(target.get_layer("decoder").bias.numpy(), donor.get_layer("decoder").bias.numpy())
    np.testing.assert_array_equal(target.get_layer("head").kernel.numpy(), head_before)
    assert {r.variable_name: r.source for r in report.matched} == {
        "encoder/kernel": enc, "encoder/bias": enc, "decoder/kernel": h5, "decoder/bias": h5}


def test_a_list_takes_each_variable_from_the_first_source_holding_it(sources):
    enc, enc_values, dec, dec_values = sources
    for order, decoder_from in (([dec, enc], dec), ([enc, dec], enc)):
        with tf.Graph().as_default():
            handles = _graph_model()
            report = restorekit.scan(order)
            restorekit.warm_start(report)
            with tf1.Session() as sess:
                sess.run(tf1.global_variables_initializer())
                got = sess.run(handles)
        expected = dec_values if decoder_from == dec else enc_values
        np.testing.assert_array_equal(got["decoder/kernel"], expected["decoder/kernel"])
        np.testing.assert_array_equal(got["encoder/kernel"], enc_values["encoder/kernel"])
        assert {r.variable_name: r.source for r in report.matched} == {
            "encoder/kernel": enc, "encoder/bias": enc, "decoder/kernel": decoder_from, "decoder/bias": decoder_from}
        # only in no source: missing, looked for in the first source
        assert {(r.variable_name, r.source) for r in report.missing} == {("head/kernel", order[0]),
                                                                         ("head/bias", order[0])}


def test_each_source_with_its_own_assignment_map_and_one_saver_per_tf_source(tmp_path):
    enc_values = {k: v for k, v in _values(3, "bert/").items() if "encoder" in k}
    dec_values = {k: v for k, v in _values(4, "gpt2/").items() if "decoder" in k}
    bert = save_variables(tmp_path / "bert" / "model.ckpt", enc_values)
    gpt2 = save_variables(tmp_path / "gpt2" / "model.ckpt", dec_values)
    with tf.Graph().as_default():
        handles = _graph_model()
        report = restorekit.scan({
            "encoder": restorekit.From(bert, assignment_map={"bert/encoder/": "encoder/"}),
            "decoder": restorekit.From(gpt2, assignment_map={"gpt2/decoder/": "decoder/"}),
        })
        savers = restorekit.source_savers(report)
        restore = restorekit.assign_from_checkpoint_fn(report)
        with pytest.raises(InvalidArgumentError, match="source_savers"):
            restorekit.partial_saver(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            restore(sess)
            got = sess.run(handles)
    assert list(savers) == [bert, gpt2]
    for name, value in {**enc_values, **dec_values}.items():
        np.testing.assert_array_equal(got[name.split("/", 1)[1]], value, err_msg=name)
    assert {r.checkpoint_name for r in report.matched if r.source == bert} == set(enc_values)


@pytest.mark.parametrize("mapping, error, text", [
    ({"encoder": "ENC", "encoder/kernel": "DEC"}, InvalidArgumentError, "'encoder' and 'encoder/kernel'"),
    ({"encoder": "ENC", "nothing_here": "DEC"}, NoMatchError, "'nothing_here' matches no name"),
], ids=["a variable taken by two patterns", "a pattern taking no variable"])
def test_mapping_errors_come_before_any_source_is_read_or_any_op_built(sources, tmp_path, mapping, error, text):
    enc, _, _, _ = sources
    gone = str(tmp_path / "no" / "such.ckpt")  # never opened: the mapping is checked first
    mapping = {p: enc if s == "ENC" else gone for p, s in mapping.items()}
    with tf.Graph().as_default() as graph:
        _graph_model()
        ops = len(graph.get_operations())
        with pytest.raises(error, match=text):
            restorekit.easy_going_scaffold(mapping)
        assert len(graph.get_operations()) == ops


def test_bad_sources_are_refused(sources):
    enc, _, _, _ = sources
    with tf.Graph().as_default():
        _graph_model()
        with pytest.raises(InvalidArgumentError, match="at least one source"):
            restorekit.scan([])
        with pytest.raises(InvalidArgumentError, match="not includ"):
            restorekit.scan([restorekit.From(enc, includ=["encoder"]), enc])
        with pytest.raises(InvalidArgumentError, match="From takes one checkpoint"):
            restorekit.From([enc])


def test_one_source_in_a_list_gives_the_single_source_report(sources):
    enc, _, _, _ = sources
    with tf.Graph().as_default():
        _graph_model()
        single, listed = restorekit.scan(enc), restorekit.scan([enc])
    assert listed == single and listed.to_dict() == single.to_dict()
    assert "source" not in single.to_dict()["matched"][0] and "sources" not in single.to_dict()


def test_cli_scan_from_several_sources(sources, tmp_path, capsys):
    enc, _, dec, _ = sources
    meta = str(tmp_path / "model.meta")
    with tf.Graph().as_default():
        _graph_model()
        tf1.train.export_meta_graph(meta)
    assert main(["scan", dec, enc, "--meta-graph", meta, "--json"]) == 1  # the head is missing
    listed = json.loads(capsys.readouterr().out)
    assert listed["sources"] == [dec, enc]
    assert {r["variable_name"]: r["source"] for r in listed["matched"]}["decoder/kernel"] == dec
    assert main(["scan", "--source", f"encoder={enc}", "--source", f"decoder={dec}", "--meta-graph", meta]) == 1
    out = capsys.readouterr().out
    assert f"from {enc}: 2 matched" in out and f"from {dec}: 2 matched" in out
    assert main(["scan", enc, "--source", f"decoder={dec}", "--meta-graph", meta]) == 2
    assert main(["scan", "--source", "decoder", "--meta-graph", meta]) == 2
    assert Checkpoint(enc)  # the sources are untouched


def _keras_net():
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="enc")(inputs)))


@pytest.fixture
def keras_sources(tmp_path):
    """enc from a .weights.h5 of the same net, head from a TF1 Saver checkpoint."""
    donor = _keras_net()
    h5 = str(tmp_path / "donor.weights.h5")
    donor.save_weights(h5)
    head = {"head/kernel": np.full((3, 2), 0.5, np.float32), "head/bias": np.full((2,), -1.0, np.float32)}
    ckpt = save_variables(tmp_path / "head" / "model.ckpt", head)
    return {"enc/kernel": donor.get_layer("enc").kernel.numpy(), "enc/bias": donor.get_layer("enc").bias.numpy(),
            **head}, h5, ckpt


def test_resume_or_warm_start_from_two_pretrained_sources(tmp_path, keras_sources):
    expected, h5, ckpt = keras_sources
    model = _keras_net()
    start = restorekit.resume_or_warm_start(str(tmp_path / "run"), {"enc": h5, "head": ckpt}, model=model)
    assert not start.resumed and start.checkpoint == f"{h5} + {ckpt}"
    weights = {v.path: v.numpy() for v in model.weights}
    for name, value in expected.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    assert {r.source for r in start.report.matched} == {h5, ckpt}


def test_warm_start_callback_from_a_list_and_an_unreadable_source(tmp_path, keras_sources):
    expected, h5, ckpt = keras_sources
    gone = str(tmp_path / "gone.weights.h5")
    with pytest.raises(restorekit.CheckpointNotFoundError, match="gone.weights.h5"):
        restorekit.WarmStart([ckpt, gone])
    model = _keras_net()
    model.compile(optimizer="sgd", loss="mse")
    warm = restorekit.WarmStart([ckpt, h5], verbose=0)  # the head from the checkpoint, the rest from the file
    model.fit(np.zeros((2, 4), np.float32), np.zeros((2, 2), np.float32), epochs=1, verbose=0, callbacks=[warm])
    matched = {r.variable_name: r.source for r in warm.start.report.matched}
    assert matched == {"head/kernel": ckpt, "head/bias": ckpt, "enc/kernel": h5, "enc/bias": h5}
