"""Tests for restorekit/_remap.py: vocabulary remapping and shape policies, TF2 (assign) and TF1 (initializers)."""

import json
import pickle

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from conftest import save_variables

from restorekit import _remap as remap, _tf2 as tf2
from restorekit.errors import InvalidArgumentError, NoMatchError, VocabularyError
from restorekit._remap import VocabRemap
from restorekit._scan import scan

tf1 = tf.compat.v1

OLD = ["apple", "banana", "guava", "orange"]
NEW = ["orange", "guava", "banana", "apple", "raspberry"]
OLD_WEIGHTS = np.array([[0.5], [1.0], [1.5], [2.0]], np.float32)


def write_vocab(path, words):
    path.write_text("".join(f"{w}\n" for w in words))
    return str(path)


@pytest.fixture
def fruit_checkpoint(tmp_path):
    return save_variables(tmp_path / "fruit" / "model.ckpt", {"emb": OLD_WEIGHTS})


# ------------------------------------------------------------------ vocabularies, TF2


@pytest.mark.parametrize("source", ["lists", "files"], ids=["vocab-lists", "vocab-files"])
def test_vocabulary_remap_reorders_rows_and_zeroes_new_words(fruit_checkpoint, tmp_path, source):
    if source == "files":
        old, new = write_vocab(tmp_path / "old.txt", OLD), write_vocab(tmp_path / "new.txt", NEW)
    else:
        old, new = OLD, NEW
    emb = tf.Variable(tf.fill((5, 1), 9.0), name="emb")
    report = scan(fruit_checkpoint, [emb], vocab={"emb": VocabRemap(old, new)})
    assert [(r.variable_name, r.reason) for r in report.matched] == [("emb", "vocab")]
    assert "1 via vocab" in str(report)
    tf2.restore(report)
    np.testing.assert_array_equal(emb.numpy(), [[2.0], [1.5], [1.0], [0.5], [0.0]])


def test_vocabulary_remap_along_columns(tmp_path):
    old_kernel = np.array([[0.5, 1.0, 1.5, 2.0], [5.0, 10.0, 15.0, 20.0]], np.float32)
    prefix = save_variables(tmp_path / "cols" / "model.ckpt", {"out": old_kernel})
    out = tf.Variable(tf.ones((2, 5)), name="out")
    tf2.restore(scan(prefix, [out], vocab={"out": VocabRemap(OLD, NEW, axis=1)}))
    np.testing.assert_array_equal(out.numpy(), [[2.0, 1.5, 1.0, 0.5, 0.0], [20.0, 15.0, 10.0, 5.0, 0.0]])


def test_old_vocab_size_uses_only_the_first_old_words(fruit_checkpoint):
    emb = tf.Variable(tf.ones((5, 1)), name="emb")
    tf2.restore(scan(fruit_checkpoint, [emb], vocab={"emb": VocabRemap(OLD, NEW, old_vocab_size=2)}))
    # guava and orange lie beyond the first two old words: treated as new.
    np.testing.assert_array_equal(emb.numpy(), [[0.0], [0.0], [1.0], [0.5], [0.0]])


def test_oov_buckets_and_backup_initializer(fruit_checkpoint):
    emb = tf.Variable(tf.ones((7, 1)), name="emb")
    remapping = VocabRemap(OLD, NEW, num_oov_buckets=2, backup_initializer=tf.constant_initializer(-1.0))
    tf2.restore(scan(fruit_checkpoint, [emb], vocab={"emb": remapping}))
    np.testing.assert_array_equal(emb.numpy().ravel(), [2.0, 1.5, 1.0, 0.5, -1.0, -1.0, -1.0])


# ------------------------------------------------------------------ vocabularies, TF1


def test_tf1_partitioned_variable_with_vocabulary(tmp_path):
    old_words = [f"w{i}" for i in range(6)]
    new_words = ["w5", "w0", "new", "w3", "w2", "w1"]
    old_value = np.arange(12, dtype=np.float32).reshape(6, 2)
    prefix = save_variables(tmp_path / "part" / "model.ckpt", {"emb": old_value})
    with tf.Graph().as_default():
        emb = tf1.get_variable(
            "emb", shape=(7, 2), initializer=tf1.constant_initializer(3.0), partitioner=tf1.fixed_size_partitioner(3)
        )
        assert len(list(emb)) == 3
        remapping = VocabRemap(old_words, new_words, num_oov_buckets=1, backup_initializer=tf1.constant_initializer(-1.0))
        report = scan(prefix, [emb], vocab={"emb": remapping})
        assert report.matched_names == ("emb",)
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            got = np.concatenate(sess.run(list(emb)))
    expected = np.array([old_value[5], old_value[0], [-1, -1], old_value[3], old_value[2], old_value[1], [-1, -1]])
    np.testing.assert_array_equal(got, expected)


def test_tf1_vocabulary_example(fruit_checkpoint):
    with tf.Graph().as_default():
        emb = tf1.get_variable("emb", shape=(5, 1), initializer=tf1.ones_initializer())
        restorekit.warm_start(scan(fruit_checkpoint, [emb], vocab={"emb": VocabRemap(OLD, NEW)}))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(emb), [[2.0], [1.5], [1.0], [0.5], [0.0]])


# ------------------------------------------------------------------ vocabulary errors


def test_missing_vocabulary_file(fruit_checkpoint, tmp_path):
    emb = tf.Variable(tf.ones((5, 1)), name="emb")
    with pytest.raises(VocabularyError, match="does not exist"):
        scan(fruit_checkpoint, [emb], vocab={"emb": VocabRemap(str(tmp_path / "nope.txt"), NEW)})


def test_duplicate_words_in_a_vocabulary_file(fruit_checkpoint, tmp_path):
    emb = tf.Variable(tf.ones((5, 1)), name="emb")
    old = write_vocab(tmp_path / "dup.txt", ["apple", "banana", "apple", "orange"])
    with pytest.raises(VocabularyError, match=r"lists 'apple' twice \(entries 0 and 2\)"):
        scan(fruit_checkpoint, [emb], vocab={"emb": VocabRemap(old, NEW)})


def test_old_vocab_size_larger_than_the_file(fruit_checkpoint, tmp_path):
    emb = tf.Variable(tf.ones((5, 1)), name="emb")
    old = write_vocab(tmp_path / "old.txt", OLD)
    with pytest.raises(VocabularyError, match="old_vocab_size=9 but the old vocabulary has only 4 words"):
        scan(fruit_checkpoint, [emb], vocab={"emb": VocabRemap(old, NEW, old_vocab_size=9)})


@pytest.mark.parametrize(
    "rows, remapping, message",
    [
        (4, VocabRemap(OLD, NEW), "new vocabulary has 5 words"),
        (5, VocabRemap(OLD + ["kiwi"], NEW), "fewer than the 5 old vocabulary words"),
    ],
    ids=["variable-rows-differ-from-new-vocab", "checkpoint-shorter-than-old-vocab"],
)
def test_vocabulary_that_does_not_fit_the_shapes(fruit_checkpoint, rows, remapping, message):
    emb = tf.Variable(tf.ones((rows, 1)), name="emb")
    with pytest.raises(VocabularyError, match=message):
        scan(fruit_checkpoint, [emb], vocab={"emb": remapping})
    np.testing.assert_array_equal(emb.numpy(), np.ones((rows, 1)))


def test_vocab_key_naming_no_variable(fruit_checkpoint):
    emb = tf.Variable(tf.ones((5, 1)), name="emb")
    with pytest.raises(NoMatchError, match="'embedding'"):
        scan(fruit_checkpoint, [emb], vocab={"embedding": VocabRemap(OLD, NEW)})
    with pytest.raises(InvalidArgumentError, match="axis"):
        VocabRemap(OLD, NEW, axis=2)


@pytest.mark.parametrize(
    "kwargs, what",
    [({"num_oov_buckets": "2"}, "num_oov_buckets"), ({"old_vocab_size": 1.5}, "old_vocab_size"), ({"axis": True}, "axis")],
    ids=["oov-buckets-a-str", "old-vocab-size-a-float", "axis-a-bool"],
)
def test_vocab_remap_numbers_must_be_ints(kwargs, what):
    with pytest.raises(InvalidArgumentError, match=f"VocabRemap {what} must be an int"):
        VocabRemap(OLD, NEW, **kwargs)


# ------------------------------------------------------------------ shape policies, TF1


@pytest.fixture
def classifier_checkpoint(tmp_path):
    rng = np.random.RandomState(3)
    values = {
        "features/weights": rng.randn(8, 16).astype(np.float32),
        "logits/weights": rng.randn(16, 1000).astype(np.float32),
        "logits/biases": rng.randn(1000).astype(np.float32),
    }
    return save_variables(tmp_path / "cls" / "model.ckpt", values), values


def _tf1_classifier(classes):
    features = tf1.get_variable("features/weights", (8, 16))
    kernel = tf1.get_variable("logits/weights", (16, classes), initializer=tf1.constant_initializer(7.0))
    bias = tf1.get_variable("logits/biases", (classes,), initializer=tf1.constant_initializer(-3.0))
    return features, kernel, bias


def test_tf1_classifier_1000_to_1001_classes_keeps_the_1000_rows(classifier_checkpoint):
    prefix, values = classifier_checkpoint
    with tf.Graph().as_default():
        features, kernel, bias = _tf1_classifier(1001)
        report = scan(prefix, shape_policy="slice_or_pad")
        assert report.is_complete
        assert {r.variable_name: r.reason for r in report.matched} == {
            "features/weights": "",
            "logits/weights": "slice_or_pad",
            "logits/biases": "slice_or_pad",
        }
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            got_features, got_kernel, got_bias = sess.run([features, kernel, bias])
    np.testing.assert_array_equal(got_features, values["features/weights"])
    np.testing.assert_array_equal(got_kernel[:, :1000], values["logits/weights"])
    np.testing.assert_array_equal(got_kernel[:, 1000], np.full(16, 7.0))  # the variable's own initializer
    np.testing.assert_array_equal(got_bias[:1000], values["logits/biases"])
    assert got_bias[1000] == -3.0


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource-variables", "ref-variables"])
def test_tf1_partitioned_classifier_grows_by_one_row(tmp_path, use_resource):
    old_value = np.arange(20, dtype=np.float32).reshape(10, 2)
    prefix = save_variables(tmp_path / "rows" / "model.ckpt", {"softmax/weights": old_value})
    with tf.Graph().as_default():
        with tf1.variable_scope("softmax", use_resource=use_resource):
            weights = tf1.get_variable(
                "weights", (11, 2), initializer=tf1.constant_initializer(-5.0), partitioner=tf1.fixed_size_partitioner(2)
            )
        report = scan(prefix, [weights], shape_policy="slice_or_pad")
        assert [(r.variable_name, r.reason) for r in report.matched] == [("softmax/weights", "slice_or_pad")]
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            got = np.concatenate(sess.run(list(weights)))
    np.testing.assert_array_equal(got, np.concatenate([old_value, [[-5.0, -5.0]]]))


def test_tf1_slice_or_pad_shrinks_too(classifier_checkpoint):
    prefix, values = classifier_checkpoint
    with tf.Graph().as_default():
        _, kernel, _ = _tf1_classifier(10)
        report = scan(prefix, shape_policy={"logits": "slice_or_pad"})
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(kernel), values["logits/weights"][:, :10])


def test_tf1_callable_policy_and_wrong_shape(classifier_checkpoint):
    prefix, values = classifier_checkpoint

    def add_background_class(value, variable):
        return np.concatenate([np.zeros_like(value[..., :1]), value], axis=-1)

    with tf.Graph().as_default():
        _, kernel, bias = _tf1_classifier(1001)
        report = scan(prefix, shape_policy=add_background_class)
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            got_kernel, got_bias = sess.run([kernel, bias])
    np.testing.assert_array_equal(got_kernel[:, 1:], values["logits/weights"])
    np.testing.assert_array_equal(got_kernel[:, 0], np.zeros(16))
    np.testing.assert_array_equal(got_bias[1:], values["logits/biases"])

    with tf.Graph().as_default():
        _tf1_classifier(1001)
        report = scan(prefix, shape_policy=lambda value, variable: value[:5])
        record = next(r for r in report.matched if r.variable_name == "logits/weights")
        ops_before = len(tf1.get_default_graph().get_operations())
        with pytest.raises(InvalidArgumentError, match=r"returned a \[5, 1000\] value for 'logits/weights'"):
            remap.tf1_initializer(report, record)
        assert len(tf1.get_default_graph().get_operations()) == ops_before


def test_policy_records_are_kept_out_of_plain_restores(classifier_checkpoint):
    prefix, _ = classifier_checkpoint
    with tf.Graph().as_default():
        _tf1_classifier(1001)
        report = scan(prefix, shape_policy="slice_or_pad")
        plain = [r.variable_name for r in report.matched if not remap.has_policy(report, r)]
        assert plain == ["features/weights"]
        with pytest.raises(InvalidArgumentError, match="no shape policy"):
            remap.tf1_initializer(report, report.matched[0])
    data = json.loads(report.to_json())
    assert {r["variable_name"]: r["reason"] for r in data["matched"]}["logits/biases"] == "slice_or_pad"
    clone = pickle.loads(pickle.dumps(report))
    assert clone == report and clone._policies is None


def test_rank_change_is_not_sliced_or_padded(tmp_path):
    prefix = save_variables(tmp_path / "rank" / "model.ckpt", {"w": np.ones((3, 2), np.float32)})
    w = tf.Variable(tf.zeros((3, 2, 1)), name="w")
    report = scan(prefix, [w], shape_policy="slice_or_pad")
    assert not report.matched and [r.variable_name for r in report.shape_mismatched] == ["w"]


# ------------------------------------------------------------------ dtype_policy='cast'

@pytest.fixture
def bf16_checkpoint(tmp_path):
    """A float32 checkpoint cast to bfloat16 with restorekit (as `restorekit cast` does)."""
    import ml_dtypes

    from restorekit.edit import CheckpointEditor

    rng = np.random.RandomState(4)
    values = {"net/w": rng.randn(3, 4).astype(np.float32), "net/b": rng.randn(4).astype(np.float32),
              "steps": np.int32(5)}
    prefix = save_variables(tmp_path / "f32" / "model.ckpt", values)
    ed = CheckpointEditor(prefix)
    ed.cast("net/.*", "bfloat16")
    out = ed.save(tmp_path / "bf16" / "model.ckpt")
    upcast = {n: v.astype(ml_dtypes.bfloat16).astype(np.float32) for n, v in values.items() if n.startswith("net/")}
    return out, upcast


def test_tf1_bfloat16_checkpoint_warm_starts_a_float32_graph_with_dtype_policy_cast(bf16_checkpoint):
    prefix, upcast = bf16_checkpoint
    with tf.Graph().as_default():
        w = tf1.get_variable("net/w", shape=[3, 4], dtype=tf.float32)
        b = tf1.get_variable("net/b", shape=[4], dtype=tf.float32)
        tf1.get_variable("steps", shape=[], dtype=tf.int64)  # int32 in the checkpoint: never cast
        plain = scan(prefix)
        assert sorted(r.variable_name for r in plain.dtype_mismatched) == ["net/b", "net/w", "steps"]
        assert any("net/w" in h and "dtype_policy='cast'" in h for h in plain.hints)
        assert not any("steps" in h for h in plain.hints)
        report = scan(prefix, dtype_policy="cast")
        assert {r.variable_name: r.reason for r in report.matched} == {
            "net/w": "cast bfloat16 -> float32", "net/b": "cast bfloat16 -> float32"}
        assert [r.variable_name for r in report.dtype_mismatched] == ["steps"]
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            got_w, got_b = sess.run([w, b])
    assert got_w.dtype == np.float32 and np.array_equal(got_w, upcast["net/w"])
    assert np.array_equal(got_b, upcast["net/b"])


def test_tf2_restore_casts_a_bfloat16_checkpoint_into_float32_variables(bf16_checkpoint):
    prefix, upcast = bf16_checkpoint
    module = tf.Module()
    with tf.name_scope("net"):
        module.w = tf.Variable(tf.zeros([3, 4]), name="w")
        module.b = tf.Variable(tf.zeros([4]), name="b")
    report = restorekit.scan(prefix, [module.w, module.b], dtype_policy="cast")
    assert len(report.matched) == 2 and report.is_complete
    restorekit.restore(report)
    assert np.array_equal(module.w.numpy(), upcast["net/w"])
    assert np.array_equal(module.b.numpy(), upcast["net/b"])


def test_unknown_dtype_policy_is_refused(fruit_checkpoint):
    with pytest.raises(InvalidArgumentError, match="dtype_policy"):
        scan(fruit_checkpoint, [tf.Variable(OLD_WEIGHTS, name="emb")], dtype_policy="round")
