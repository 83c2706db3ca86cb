"""Tests for restorekit/_tf2.py: object-graph paths, scanning Keras 3 models and tf.Modules, eager restore."""

import pickle
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import _tf2 as tf2
from restorekit._checkpoint import OBJECT_GRAPH_KEY, Checkpoint
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, NoMatchError
from restorekit._scan import scan

tf1 = tf.compat.v1


def functional(units=(3, 5), *, names=None, inputs=4):
    """A Functional MLP; ``names`` None lets Keras uniquify 'dense', 'dense_1', ..."""
    x = inp = keras.Input((inputs,))
    for i, n in enumerate(units):
        x = keras.layers.Dense(n, name=None if names is None else names[i])(x)
    return keras.Model(inp, x)


def values_of(variables):
    return {v.path: v.numpy().copy() for v in variables}


# ------------------------------------------------------------------ readable paths


@pytest.fixture
def keras_checkpoint(tmp_path):
    """A Functional model and Adam state saved with tf.train.Checkpoint(model=..., optimizer=...)."""
    model = functional((3, 5), names=["body", "head"])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "tf2" / "ckpt"))
    return prefix, model


def test_object_paths_are_keras_paths_and_mark_optimizer_and_save_counter(keras_checkpoint):
    prefix, model = keras_checkpoint
    ckpt = Checkpoint(prefix)
    paths = ckpt.object_paths
    assert ckpt.is_object_based
    for v in model.variables:
        assert v.path in paths
        np.testing.assert_array_equal(ckpt.read(paths[v.path]), v.numpy())
    assert paths["save_counter"] == "save_counter/.ATTRIBUTES/VARIABLE_VALUE"
    kinds = {t.path: t.kind for t in ckpt.object_graph.variables}
    assert kinds["body/kernel"] == "variable"
    assert kinds["save_counter"] == "save_counter"
    optimizer_paths = sorted(p for p, k in kinds.items() if k == "optimizer")
    # Keras uniquifies optimizer names within a process: adam, adam_1, ...
    assert any(re.fullmatch(r"optimizer/adam(_\d+)?/body_kernel_momentum", p) for p in optimizer_paths)
    assert all(p.startswith("optimizer/") for p in optimizer_paths)
    assert len(paths) == len(ckpt) - 1  # every entry but the object graph itself


def test_object_graph_decoding_agrees_with_tensorflow(keras_checkpoint):
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    prefix, _ = keras_checkpoint
    ckpt = Checkpoint(prefix)
    proto = trackable_object_graph_pb2.TrackableObjectGraph()
    proto.ParseFromString(tf.train.load_checkpoint(prefix).get_tensor(OBJECT_GRAPH_KEY))
    ours = ckpt.object_graph.nodes
    assert len(ours) == len(proto.nodes)
    for mine, theirs in zip(ours, proto.nodes):
        assert mine.children == tuple((c.node_id, c.local_name) for c in theirs.children)
        assert mine.attributes == tuple((a.name, a.full_name, a.checkpoint_key) for a in theirs.attributes)


def test_name_based_checkpoint_has_no_object_paths(small_checkpoint):
    prefix, _ = small_checkpoint
    ckpt = Checkpoint(prefix)
    assert not ckpt.is_object_based
    assert ckpt.object_graph is None
    assert dict(ckpt.object_paths) == {}
    assert ckpt.readable_name("dense/kernel") == "dense/kernel"


@pytest.mark.parametrize(
    "garbage",
    [b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x02\x0a", b"\x0a\x04\x0a\x02\x08\x07"],
    ids=["length-runs-past-the-end", "truncated-child", "child-out-of-range"],
)
def test_corrupt_object_graph_raises_corrupt_checkpoint_error(tmp_path, garbage):
    prefix = str(tmp_path / "bad-ckpt")
    tf.raw_ops.SaveV2(
        prefix=prefix,
        tensor_names=[OBJECT_GRAPH_KEY, "w"],
        shape_and_slices=["", ""],
        tensors=[tf.constant(garbage), tf.constant([1.0])],
    )
    ckpt = Checkpoint(prefix)
    assert ckpt.is_object_based
    with pytest.raises(CorruptCheckpointError, match="object graph"):
        ckpt.object_paths
    variable = tf.Variable([0.0], name="w")
    with pytest.raises(CorruptCheckpointError):
        scan(prefix, [variable])
    assert variable.numpy().tolist() == [0.0]


# ------------------------------------------------------------------ Keras from its own TF2 checkpoint


def test_keras_model_fine_tuned_from_its_own_checkpoint_with_a_new_head(keras_checkpoint):
    prefix, old = keras_checkpoint
    new = functional((3, 7), names=["body", "head"])
    head_before = values_of(new.get_layer("head").weights)
    report = scan(prefix, new)
    assert report.matched_names == ("body/kernel", "body/bias")
    assert {r.variable_name for r in report.shape_mismatched} == {"head/kernel", "head/bias"}
    assert any(r.reason.startswith("optimizer slot") for r in report.skipped)
    assert not report.unused
    assert tf2.restore(report) is report
    np.testing.assert_array_equal(new.get_layer("body").kernel.numpy(), old.get_layer("body").kernel.numpy())
    np.testing.assert_array_equal(new.get_layer("body").bias.numpy(), old.get_layer("body").bias.numpy())
    for path, value in values_of(new.get_layer("head").weights).items():
        np.testing.assert_array_equal(value, head_before[path])


def test_object_graph_matches_the_same_architecture_under_other_layer_names(tmp_path):
    old = functional((3, 5))
    prefix = tf.train.Checkpoint(model=old).save(str(tmp_path / "ckpt"))
    new = functional((3, 5))  # Keras uniquifies: other names than `old`
    assert [v.path for v in new.variables] != [v.path for v in old.variables]
    by_path = scan(prefix, new, match="path")
    assert not by_path.matched and len(by_path.missing) == 4
    report = scan(prefix, new)
    assert len(report.matched) == 4
    tf2.restore(report)
    for a, b in zip(old.variables, new.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_match_object_graph_with_a_variable_list_is_an_error(keras_checkpoint):
    prefix, model = keras_checkpoint
    with pytest.raises(NoMatchError, match="object_graph"):
        scan(prefix, list(model.variables), match="object_graph")
    with pytest.raises(InvalidArgumentError, match="match is"):
        scan(prefix, model, match="names")


def test_variable_list_matches_by_readable_path(keras_checkpoint):
    prefix, old = keras_checkpoint
    report = scan(prefix, [old.get_layer("head").kernel])
    assert [(r.variable_name, r.checkpoint_path) for r in report.matched] == [("head/kernel", "head/kernel")]
    assert "head/bias" in {r.checkpoint_path for r in report.unused}
    assert "body/kernel [4, 3]" in str(report)  # unused entries show readable paths, not raw keys


def test_assignment_map_accepts_readable_paths(keras_checkpoint):
    prefix, old = keras_checkpoint
    target = tf.Variable(np.zeros((4, 3), np.float32), name="encoder/w")
    report = scan(prefix, [target], assignment_map={"body/kernel": "encoder/w"})
    assert report.matched_names == ("encoder/w",)
    tf2.restore(report)
    np.testing.assert_array_equal(target.numpy(), old.get_layer("body").kernel.numpy())


# ------------------------------------------------------------------ Keras from a TF1 name-based checkpoint


@pytest.fixture
def tf1_checkpoint(tmp_path):
    """A TF1 graph of the same MLP built with tf.compat.v1.get_variable: dense/weights, dense_1/biases..."""
    rng = np.random.RandomState(1)
    values = {
        "dense/weights": rng.randn(4, 3).astype(np.float32),
        "dense/biases": rng.randn(3).astype(np.float32),
        "dense_1/weights": rng.randn(3, 5).astype(np.float32),
        "dense_1/biases": rng.randn(5).astype(np.float32),
        "dense/weights/Momentum": rng.randn(4, 3).astype(np.float32),
        "global_step": np.int64(100),
    }
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 4])
        for scope, (n_in, n_out) in [("dense", (4, 3)), ("dense_1", (3, 5))]:
            with tf1.variable_scope(scope):
                w = tf1.get_variable("weights", [n_in, n_out])
                b = tf1.get_variable("biases", [n_out])
                x = tf.matmul(x, w) + b
        with tf1.variable_scope("dense"):
            tf1.get_variable("weights/Momentum", [4, 3])
        tf1.train.get_or_create_global_step()
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            for v in tf1.global_variables():
                v.load(values[v.op.name], sess)
            prefix = saver.save(sess, str(tmp_path / "tf1" / "model.ckpt"), write_meta_graph=False)
    return prefix, values


@pytest.mark.parametrize("how", ["rules", "assignment_map"], ids=["rules-option", "as-assignment-map"])
def test_keras_model_from_tf1_checkpoint_through_keras_from_tf1(tf1_checkpoint, how):
    prefix, values = tf1_checkpoint
    model = functional((3, 5))  # auto names dense_N, N depending on earlier tests
    kwargs = {how: tf2.KERAS_FROM_TF1}
    report = scan(prefix, model, **kwargs)
    assert report.is_complete and len(report.matched) == 4 and not report.unused
    assert {r.reason for r in report.skipped} == {"optimizer slot (Momentum)", "global_step"}
    tf2.restore(report)
    layers = [layer for layer in model.layers if layer.weights]
    for layer, scope in zip(layers, ["dense", "dense_1"]):
        np.testing.assert_array_equal(layer.kernel.numpy(), values[f"{scope}/weights"])
        np.testing.assert_array_equal(layer.bias.numpy(), values[f"{scope}/biases"])


def test_rules_compose_with_user_pairs_for_a_sequential_scope(tf1_checkpoint):
    prefix, values = tf1_checkpoint
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(5)], name="net")
    model.build((None, 4))
    assert model.variables[0].path.startswith("net/")
    report = scan(prefix, model, rules=[(r"^net/", ""), tf2.KERAS_FROM_TF1])
    assert len(report.matched) == 4
    tf2.restore(report)
    np.testing.assert_array_equal(model.layers[1].kernel.numpy(), values["dense_1/weights"])


def test_rule_matching_nothing_is_an_error(tf1_checkpoint):
    prefix, _ = tf1_checkpoint
    model = functional((3, 5))
    with pytest.raises(NoMatchError, match=r"'\^encoder/'"):
        scan(prefix, model, rules=[(r"^encoder/", ""), tf2.KERAS_FROM_TF1])
    with pytest.raises(NoMatchError, match="map none"):
        scan(prefix, model, rules=[(r"^(.*)$", r"elsewhere/\1")])
    with pytest.raises(InvalidArgumentError, match="either rules"):
        scan(prefix, model, rules=tf2.KERAS_FROM_TF1, assignment_map={"dense/": "dense/"})


def test_renumbering_pairs_suffixes_in_order_and_keeps_exact_sets():
    bind = tf2.KERAS_FROM_TF1.bind
    mapping = bind(["dense_1/kernel", "dense_2/kernel"], ["dense/weights", "dense_1/weights"])
    assert mapping("dense_1/kernel") == "dense/weights"
    assert mapping("dense_2/kernel") == "dense_1/weights"
    mapping = bind(["block_1/kernel"], ["block/kernel", "block_1/kernel"])
    assert mapping("block_1/kernel") == "block_1/kernel"


# ------------------------------------------------------------------ tf.Module and variable lists


def test_tf_module_restores_through_its_object_graph(tmp_path):
    def module():
        m = tf.Module()
        m.encoder = tf.Module()
        m.encoder.w = tf.Variable(tf.random.normal((3, 2)))
        m.b = tf.Variable(tf.random.normal((2,)))  # both named 'Variable'
        return m

    old = module()
    prefix = tf.train.Checkpoint(net=old).save(str(tmp_path / "mod"))
    assert set(Checkpoint(prefix).object_paths) == {"net/encoder/w", "net/b", "save_counter"}
    new = module()
    report = scan(prefix, new)
    assert len(report.matched) == 2
    tf2.restore(report)
    np.testing.assert_array_equal(new.encoder.w.numpy(), old.encoder.w.numpy())
    np.testing.assert_array_equal(new.b.numpy(), old.b.numpy())


# ------------------------------------------------------------------ MirroredStrategy


def test_restore_under_mirrored_strategy_reaches_every_replica(keras_checkpoint):
    prefix, old = keras_checkpoint
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) >= 2
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = functional((3, 6), names=["body", "head"])
    head_before = model.get_layer("head").kernel.numpy()
    report = scan(prefix, model, shape_policy="slice_or_pad")
    tf2.restore(report)
    expected_head = head_before.copy()
    expected_head[:, :5] = old.get_layer("head").kernel.numpy()
    for variable, expected in [
        (model.get_layer("body").kernel, old.get_layer("body").kernel.numpy()),
        (model.get_layer("head").kernel, expected_head),
    ]:
        replicas = strategy.experimental_local_results(variable.value)
        assert len(replicas) == len(devices)
        for replica in replicas:
            np.testing.assert_array_equal(replica.numpy(), expected)


# ------------------------------------------------------------------ shape policies in TF2


def test_classifier_1000_to_1001_classes_keeps_the_1000_trained_rows(tmp_path):
    old = functional((8, 1000), names=["features", "logits"])
    prefix = tf.train.Checkpoint(model=old).save(str(tmp_path / "cls"))
    new = functional((8, 1001), names=["features", "logits"])
    kernel_before = new.get_layer("logits").kernel.numpy()
    report = scan(prefix, new, shape_policy="slice_or_pad")
    assert {r.variable_name: r.reason for r in report.matched if r.reason} == {
        "logits/kernel": "slice_or_pad",
        "logits/bias": "slice_or_pad",
    }
    assert report.is_complete
    assert "2 via slice_or_pad" in str(report)
    tf2.restore(report)
    kernel = new.get_layer("logits").kernel.numpy()
    np.testing.assert_array_equal(kernel[:, :1000], old.get_layer("logits").kernel.numpy())
    np.testing.assert_array_equal(kernel[:, 1000], kernel_before[:, 1000])
    np.testing.assert_array_equal(new.get_layer("logits").bias.numpy()[:1000], old.get_layer("logits").bias.numpy())


def test_callable_and_per_pattern_policies(keras_checkpoint):
    prefix, old = keras_checkpoint
    new = functional((3, 6), names=["body", "head"])

    def mean_column(value, variable):
        return np.concatenate([value, value.mean(axis=-1, keepdims=True)], axis=-1)

    report = scan(prefix, new, shape_policy={"head/kernel": mean_column, "head/bias": "slice_or_pad"})
    reasons = {r.variable_name: r.reason for r in report.matched}
    assert reasons["head/kernel"] == "shape_policy: mean_column"
    assert reasons["head/bias"] == "slice_or_pad"
    tf2.restore(report)
    old_kernel = old.get_layer("head").kernel.numpy()
    np.testing.assert_allclose(new.get_layer("head").kernel.numpy()[:, 5], old_kernel.mean(axis=-1), rtol=1e-6)
    with pytest.raises(NoMatchError, match="shape_policy pattern 'tail'"):
        scan(prefix, new, shape_policy={"tail": "slice_or_pad"})
    with pytest.raises(InvalidArgumentError, match="a shape policy is"):
        scan(prefix, new, shape_policy="pad")


def test_policy_returning_the_wrong_shape_raises_before_any_assign(keras_checkpoint):
    prefix, _ = keras_checkpoint
    new = functional((3, 6), names=["body", "head"])
    before = values_of(new.variables)
    report = scan(prefix, new, shape_policy=lambda value, variable: value)
    with pytest.raises(InvalidArgumentError, match=r"returned a \[3, 5\] value for 'head/kernel', which is \[3, 6\]"):
        tf2.restore(report)
    for path, value in values_of(new.variables).items():
        np.testing.assert_array_equal(value, before[path])


# ------------------------------------------------------------------ restore() contract


def test_restore_rejects_graph_mode_lost_handles_and_strict_gaps(keras_checkpoint):
    prefix, _ = keras_checkpoint
    new = functional((3, 7), names=["body", "head"])
    report = scan(prefix, new)
    with pytest.raises(restorekit.IncompleteRestoreError, match="head/kernel"):
        tf2.restore(report, strict=True)
    clone = pickle.loads(pickle.dumps(report))
    assert clone == report and clone._policies is None
    with pytest.raises(InvalidArgumentError, match="unpickled"):
        tf2.restore(clone)
    with tf.Graph().as_default():
        with pytest.raises(InvalidArgumentError, match="eager"):
            tf2.restore(report)
    with pytest.raises(InvalidArgumentError, match="RestoreReport"):
        tf2.restore("ckpt")


@pytest.mark.parametrize(
    "synonyms",
    [[("kernel", "weights")], {"kernel": 5}, {5: ("weights",)}],
    ids=["a-list-not-a-mapping", "alternatives-not-strs", "leaf-not-a-str"],
)
def test_rules_with_bad_synonyms_are_invalid_arguments(synonyms):
    with pytest.raises(InvalidArgumentError, match="synonyms"):
        tf2.Rules(synonyms=synonyms)


def test_a_single_synonym_string_is_one_alternative_not_its_letters():
    assert tf2.Rules(synonyms={"kernel": "weights"}).synonyms == {"kernel": ("weights",)}


# ------------------------------------------------------------------ an inserted layer: names beat positions

@pytest.fixture
def head_checkpoint(tmp_path):
    """body -> head (Dense 5 -> Dense 5), with SGD state, saved by tf.train.Checkpoint."""
    model = functional((5, 5), names=["body", "head"])
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(model.trainable_variables)
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "heads" / "ckpt"))
    return prefix, values_of(model.variables)


def test_an_inserted_layer_is_missing_and_never_takes_the_heads_weights(head_checkpoint):
    prefix, saved = head_checkpoint
    new = functional((5, 5, 5), names=["body", "extra", "head"])  # same shapes, so positions would fit
    fresh = values_of(new.variables)
    report = scan(prefix, new)
    assert sorted(r.variable_name for r in report.missing) == ["extra/bias", "extra/kernel"]
    assert {r.variable_name: r.checkpoint_path for r in report.matched} == {
        n: n for n in ("body/kernel", "body/bias", "head/kernel", "head/bias")}
    assert not report.is_complete
    tf2.restore(report)
    got = values_of(new.variables)
    for name in ("body/kernel", "body/bias", "head/kernel", "head/bias"):
        np.testing.assert_array_equal(got[name], saved[name])
    for name in ("extra/kernel", "extra/bias"):
        np.testing.assert_array_equal(got[name], fresh[name])  # its own initializer, not the old head


def test_inserted_layer_before_a_renamed_head_restores_by_name_only(head_checkpoint):
    prefix, saved = head_checkpoint
    # body, head -> body, extra, new_head: positions would give head's weights to extra
    new = functional((5, 5, 5), names=["body", "extra", "new_head"])
    fresh = values_of(new.variables)
    report = scan(prefix, new)
    assert sorted(r.variable_name for r in report.matched) == ["body/bias", "body/kernel"]
    assert sorted(r.variable_name for r in report.missing) == [
        "extra/bias", "extra/kernel", "new_head/bias", "new_head/kernel"]
    assert sorted(r.checkpoint_path for r in report.unused) == ["head/bias", "head/kernel"]
    assert report.by_position == () and report.to_dict()["by_position"] == []
    assert any("'extra/kernel' pairs by position with checkpoint entry 'head/kernel'" in h for h in report.hints)
    tf2.restore(report)
    got = values_of(new.variables)
    np.testing.assert_array_equal(got["body/kernel"], saved["body/kernel"])
    for name in ("extra/kernel", "extra/bias", "new_head/kernel", "new_head/bias"):
        np.testing.assert_array_equal(got[name], fresh[name])


def test_a_position_pairing_of_another_shape_is_never_offered(head_checkpoint):
    prefix, _ = head_checkpoint
    # body(5), head(5) -> body(5), extra(16), new_head(5): extra takes head's position but not its shape
    new = functional((5, 16, 5), names=["body", "extra", "new_head"])
    report = scan(prefix, new)
    assert sorted(r.variable_name for r in report.missing) == [
        "extra/bias", "extra/kernel", "new_head/bias", "new_head/kernel"]
    assert not any("pairs by position" in h or "object_graph" in h for h in report.hints)
    assert not any("'head/kernel': 'extra/kernel'" in h for h in report.hints)
    # following the old hint would only have turned a missing variable into a mismatched one
    followed = scan(prefix, new, assignment_map={"head/kernel": "extra/kernel"})
    assert [(r.variable_name, r.checkpoint_shape, r.shape) for r in followed.shape_mismatched] == [
        ("extra/kernel", (5, 5), (5, 16))]


def test_when_no_name_matches_positions_pair_and_every_pairing_is_printed(head_checkpoint):
    prefix, saved = head_checkpoint
    new = functional((5, 5), names=["trunk", "top"])  # every layer renamed: positions are all there is
    report = scan(prefix, new)
    assert report.is_complete
    pairs = {r.variable_name: r.checkpoint_path for r in report.by_position}
    assert pairs == {"trunk/kernel": "body/kernel", "trunk/bias": "body/bias",
                     "top/kernel": "head/kernel", "top/bias": "head/bias"}
    assert "  by position: top/kernel <- head/kernel" in str(report).splitlines()
    assert len(report.to_dict()["by_position"]) == 4
    tf2.restore(report)
    np.testing.assert_array_equal(new.get_layer("top").kernel.numpy(), saved["head/kernel"])


def test_match_object_graph_keeps_positional_pairings_and_reports_them(head_checkpoint):
    prefix, saved = head_checkpoint
    new = functional((5, 5, 5), names=["body", "extra", "new_head"])
    report = scan(prefix, new, match="object_graph")
    assert {r.variable_name: r.checkpoint_path for r in report.by_position} == {
        "extra/kernel": "head/kernel", "extra/bias": "head/bias"}


def test_one_entry_found_for_two_variables_restores_only_the_first_and_says_so(head_checkpoint, monkeypatch):
    prefix, saved = head_checkpoint
    new = functional((5, 5), names=["body", "copy"])
    real = tf2.object_graph_keys

    body_key = Checkpoint(prefix).object_paths["body/kernel"]
    copy_kernel = new.get_layer("copy").kernel

    def both_on_body(root, graph, variables):  # an object graph that pairs two layers with one
        keys = real(root, graph, variables)
        return {**keys, id(copy_kernel): body_key, id(copy_kernel.value): body_key}

    import sys

    monkeypatch.setattr(sys.modules["restorekit._scan"], "object_graph_keys", both_on_body)
    report = scan(prefix, new, match="object_graph")
    keys = [r.checkpoint_name for r in report.matched]
    assert len(keys) == len(set(keys))  # no entry feeds two variables
    assert "copy/kernel" in [r.variable_name for r in report.missing]
    assert any("'copy/kernel' and 'body/kernel' both match" in h for h in report.hints)


def test_mismatch_line_names_the_entry_when_it_is_not_the_variables_own(tmp_path):
    old = functional((3, 5), names=["body", "head"])
    prefix = tf.train.Checkpoint(model=old).save(str(tmp_path / "ckpt"))
    new = functional((3, 7), names=["trunk", "top"])  # other names, same structure: object graph pairs them
    report = scan(prefix, new)
    assert "top/kernel (checkpoint head/kernel [3, 5], model [3, 7])" in str(report)


@pytest.mark.parametrize("model_name", ["net", "net_9"], ids=["same-model-name", "renumbered-model-name"])
def test_sequential_with_an_inserted_layer_restores_the_same_under_any_model_name(tmp_path, model_name):
    def sequential(name, layers):
        model = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(n, name=ln) for ln, n in layers], name=name)
        return model

    old = sequential("net", [("body", 6), ("head", 6)])
    prefix = tf.train.Checkpoint(model=old).save(str(tmp_path / "seq" / "ckpt"))
    new = sequential(model_name, [("body", 6), ("extra", 6), ("head", 6)])
    report = scan(prefix, new)
    assert sorted(r.variable_name for r in report.missing) == [f"{model_name}/extra/bias", f"{model_name}/extra/kernel"]
    tf2.restore(report)
    np.testing.assert_array_equal(new.get_layer("head").kernel.numpy(), old.get_layer("head").kernel.numpy())
    np.testing.assert_array_equal(new.get_layer("body").kernel.numpy(), old.get_layer("body").kernel.numpy())
