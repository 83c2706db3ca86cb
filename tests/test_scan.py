"""scan(): the plan of a restore, checked exactly on real checkpoints."""

import os
import pickle

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit import AssignmentMapError, Checkpoint, NoMatchError, scan
from conftest import resnet_batch, resnet_features, save_variables

tf1 = tf.compat.v1


# ---------------------------------------------------------------- resnet fine-tune


def build_finetune_graph():
    """resnet_v1_50 body, an extra 1x1 layer, a 10-class head under the old logits scope, Adam."""
    import tf_slim as slim

    images, labels = resnet_batch()
    net, _ = resnet_features(tf.constant(images), num_classes=None)
    net = slim.conv2d(net, 256, [1, 1], scope="extra", normalizer_fn=None)
    logits = slim.conv2d(net, 10, [1, 1], scope="resnet_v1_50/logits", normalizer_fn=None, activation_fn=None)
    model_vars = list(tf1.global_variables())
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, tf.reshape(logits, [-1, 10]))
    step = tf1.train.get_or_create_global_step()
    train = tf1.train.AdamOptimizer(1e-3).minimize(loss, global_step=step)
    return model_vars, train


@pytest.fixture(scope="module")
def finetune(resnet_checkpoint):
    graph = tf.Graph()
    with graph.as_default():
        model_vars, train = build_finetune_graph()
        report = scan(resnet_checkpoint)
    return graph, model_vars, train, report


def _names(records, side="variable_name"):
    return {getattr(r, side) for r in records}


def test_resnet_finetune_report_is_exactly_right(finetune, resnet_checkpoint):
    graph, model_vars, _, report = finetune
    ckpt = Checkpoint(resnet_checkpoint)
    head = {"resnet_v1_50/logits/weights", "resnet_v1_50/logits/biases"}
    extra = {"extra/weights", "extra/biases"}
    model_names = {v.op.name for v in model_vars}
    with graph.as_default():
        optimizer_names = {v.op.name for v in tf1.global_variables()} - model_names - {"global_step"}
    # The checkpoint's Momentum slots are every entry ending in '/Momentum'.
    momentum = {n for n in ckpt if n.endswith("/Momentum")}
    assert len(momentum) > 100

    assert _names(report.matched) == model_names - head - extra
    assert all(r.checkpoint_name == r.variable_name for r in report.matched)
    assert _names(report.shape_mismatched) == head
    assert {r.variable_name: (r.checkpoint_shape, r.shape) for r in report.shape_mismatched} == {
        "resnet_v1_50/logits/weights": ((1, 1, 2048, 1000), (1, 1, 256, 10)),
        "resnet_v1_50/logits/biases": ((1000,), (10,)),
    }
    assert _names(report.missing) == extra
    assert report.dtype_mismatched == () and report.unused == ()
    skipped_vars = {r.variable_name: r.reason for r in report.skipped if r.variable_name}
    skipped_entries = {r.checkpoint_name: r.reason for r in report.skipped if r.variable_name is None}
    assert set(skipped_vars) == optimizer_names | {"global_step"}
    assert skipped_vars["global_step"] == "global_step"
    assert all(reason.startswith("optimizer slot (Adam") for n, reason in skipped_vars.items() if n != "global_step")
    assert skipped_entries == {**{n: "optimizer slot (Momentum)" for n in momentum}, "global_step": "global_step"}
    assert report.num_variables == len(model_names) + len(optimizer_names) + 1
    assert not report.is_complete
    text = str(report)
    assert "missing" in text and "extra/weights [1, 1, 2048, 256]" in text
    # slice_or_pad is offered for the classes (last dimension) alone: the weights' input features changed too
    assert "'resnet_v1_50/logits/weights' differs only in shape" not in text
    assert ("'resnet_v1_50/logits/biases' differs only in shape (checkpoint [1000], model [10]); "
            "shape_policy='slice_or_pad'") in text
    # BatchNorm statistics are model state and must be matched.
    assert "resnet_v1_50/conv1/BatchNorm/moving_mean" in _names(report.matched)


def test_report_is_a_value(finetune):
    *_, report = finetune
    copy = pickle.loads(pickle.dumps(report))
    assert copy == report and copy._handles is None
    as_dict = report.to_dict()
    assert as_dict["is_complete"] is False
    assert {r["variable_name"] for r in as_dict["missing"]} == {"extra/weights", "extra/biases"}
    assert restorekit._report.json.loads(report.to_json())["num_variables"] == report.num_variables


def test_strict_assert_complete_names_what_is_missing(finetune):
    *_, report = finetune
    with pytest.raises(restorekit.IncompleteRestoreError) as info:
        report.assert_complete()
    message = str(info.value)
    assert "missing     extra/weights" in message
    assert "mismatched  resnet_v1_50/logits/weights: checkpoint [1, 1, 2048, 1000], model [1, 1, 256, 10]" in message
    assert "strict=False" in message and info.value.report is report


def test_exclude_by_scope_turns_the_head_into_skips(finetune, resnet_checkpoint):
    graph, *_ = finetune
    with graph.as_default():
        report = scan(resnet_checkpoint, exclude=["resnet_v1_50/logits", "extra"])
    assert report.is_complete
    excluded = {r.variable_name for r in report.skipped if r.reason.startswith("excluded")}
    # Exclude rules come first, so the head's new Adam slots say 'excluded' too.
    assert {n for n in excluded if not n.endswith(("/Adam", "/Adam_1"))} == {
        "resnet_v1_50/logits/weights",
        "resnet_v1_50/logits/biases",
        "extra/weights",
        "extra/biases",
    }
    assert _names(report.unused, "checkpoint_name") == {"resnet_v1_50/logits/weights", "resnet_v1_50/logits/biases"}


def test_include_with_regex_and_boundary(finetune, resnet_checkpoint):
    graph, *_ = finetune
    with graph.as_default():
        report = scan(resnet_checkpoint, include=[r"resnet_v1_50/block1", r".*conv1/BatchNorm"])
    names = _names(report.matched)
    assert names and all("block1/" in n or "conv1/BatchNorm" in n for n in names)
    assert not any("block10" in n for n in names)


# ---------------------------------------------------------------- small graphs


def test_name_variants_give_hints(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense_1/weights", [4, 3])
        tf1.get_variable("dense_1/biases", [3])
        report = scan(prefix)
    hints = "\n".join(report.hints)
    assert "'dense_1/weights' is missing but checkpoint entry 'dense/kernel' differs only in naming" in hints
    assert "assignment_map={'dense/bias': 'dense_1/biases'}" in hints


def test_a_naming_hint_is_offered_only_for_an_entry_that_fits(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense_1/weights", [4, 7])  # 'dense/kernel' is [4, 3]: renaming would only mismatch
        tf1.get_variable("dense_1/biases", [3])
        report = scan(prefix)
        followed = scan(prefix, assignment_map={"dense/kernel": "dense_1/weights"})
    hints = "\n".join(report.hints)
    assert "dense_1/weights" not in hints
    assert "assignment_map={'dense/bias': 'dense_1/biases'}" in hints
    assert [r.variable_name for r in followed.shape_mismatched] == ["dense_1/weights"]


def test_scope_hint_for_a_checkpoint_saved_under_an_extra_scope(tmp_path):
    values = {"model/dense/kernel": np.ones((4, 3), np.float32), "model/dense/bias": np.ones(3, np.float32),
              "model/head/kernel": np.ones((3, 2), np.float32)}
    prefix = save_variables(tmp_path / "scoped" / "model.ckpt", values)
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", [4, 3])
        tf1.get_variable("dense/bias", [3])
        tf1.get_variable("head/kernel", [3, 5])  # another shape: not counted
        report = scan(prefix)
        followed = scan(prefix, assignment_map={"model/": "/"})
    assert len(report.matched) == 0
    assert ("2 of the 3 missing variables are in the checkpoint under another scope (e.g. 'dense/kernel' as "
            "'model/dense/kernel'); pass assignment_map={'model/': '/'}.") in report.hints
    assert sorted(r.variable_name for r in followed.matched) == ["dense/bias", "dense/kernel"]


def test_scope_remap_and_root_remap(small_checkpoint):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("new/dense/kernel", [4, 3])
        tf1.get_variable("new/dense/bias", [3])
        tf1.get_variable("other/x", [1])
        report = scan(prefix, assignment_map={"dense/": "new/dense/"})
        assert {(r.checkpoint_name, r.variable_name) for r in report.matched} == {
            ("dense/kernel", "new/dense/kernel"),
            ("dense/bias", "new/dense/bias"),
        }
        assert {r.variable_name for r in report.skipped if r.reason == "not in assignment_map"} == {"other/x"}
        root = scan(prefix, assignment_map={"/": "new/"})
        assert {(r.checkpoint_name, r.variable_name) for r in root.matched} == {
            ("dense/kernel", "new/dense/kernel"),
            ("dense/bias", "new/dense/bias"),
        }


def test_one_tensor_feeds_several_variables(small_checkpoint):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        a = tf1.get_variable("enc/bias", [3])
        b = tf1.get_variable("dec/bias", [3])
        report = scan(prefix, assignment_map={"dense/bias": ["enc/bias", "dec/bias"]})
        assert {(r.checkpoint_name, r.variable_name) for r in report.matched} == {
            ("dense/bias", "enc/bias"),
            ("dense/bias", "dec/bias"),
        }
        with pytest.raises(AssignmentMapError, match="warm_start"):
            restorekit.partial_saver(report)
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(a), values["dense/bias"])
            np.testing.assert_array_equal(sess.run(b), values["dense/bias"])


def test_callable_assignment_map(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("model/dense/kernel", [4, 3])
        tf1.get_variable("model/head/w", [2])
        report = scan(prefix, assignment_map=lambda name: name[len("model/"):] if "dense" in name else None)
    assert [(r.checkpoint_name, r.variable_name) for r in report.matched] == [("dense/kernel", "model/dense/kernel")]
    assert [r.reason for r in report.skipped if r.variable_name == "model/head/w"] == ["not in assignment_map"]


def test_saver_style_dict_of_variables(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        v = tf1.get_variable("anything", [3])
        report = scan(prefix, {"dense/bias": v})
    assert [(r.checkpoint_name, r.variable_name) for r in report.matched] == [("dense/bias", "anything")]


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource variables", "ref variables"])
def test_resource_and_ref_variables_with_output_index(small_checkpoint, use_resource):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        v = tf1.get_variable("dense/kernel", [4, 3], use_resource=use_resource)
        assert v.name == "dense/kernel:0"
        report = scan(prefix, [v])
    assert _names(report.matched) == {"dense/kernel"}


def test_partitioned_variables_match_on_full_name_across_partitionings(tmp_path):
    values = {"emb": np.arange(40, dtype=np.float32).reshape(10, 4)}
    prefix = save_variables(tmp_path / "plain", values)
    with tf.Graph().as_default():
        part = tf1.get_variable("emb", shape=[10, 4], partitioner=tf1.fixed_size_partitioner(3))
        report = scan(prefix)
        assert [(r.variable_name, r.shape) for r in report.matched] == [("emb", (10, 4))]
        saver = restorekit.partial_saver(report)
        with tf1.Session() as sess:
            saver.restore(sess, prefix)
            np.testing.assert_array_equal(sess.run(tf.concat(list(part), 0)), values["emb"])
    # And a checkpoint saved in 3 partitions into a model with 2.
    with tf.Graph().as_default():
        src = tf1.get_variable("emb", shape=[10, 4], partitioner=tf1.fixed_size_partitioner(3))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            expected = sess.run(tf.concat(list(src), 0))
            p3 = tf1.train.Saver().save(sess, str(tmp_path / "p3"), write_meta_graph=False)
    with tf.Graph().as_default():
        dst = tf1.get_variable("emb", shape=[10, 4], partitioner=tf1.fixed_size_partitioner(2))
        report = scan(p3, [dst])
        saver = restorekit.partial_saver(report)
        with tf1.Session() as sess:
            saver.restore(sess, p3)
            np.testing.assert_array_equal(sess.run(tf.concat(list(dst), 0)), expected)


def test_ema_restores_shadows_and_falls_back_per_variable(tmp_path):
    values = {
        "w": np.full([2], 1.0, np.float32),
        "w/ExponentialMovingAverage": np.full([2], 0.5, np.float32),
        "b": np.full([2], 3.0, np.float32),
    }
    prefix = save_variables(tmp_path / "ema", values)
    with tf.Graph().as_default():
        w = tf1.get_variable("w", [2])
        b = tf1.get_variable("b", [2])
        ema = tf1.train.ExponentialMovingAverage(0.9)
        for form in (ema, "ExponentialMovingAverage"):
            report = scan(prefix, [w, b], ema=form)
            reasons = {r.variable_name: (r.checkpoint_name, r.reason) for r in report.matched}
            assert reasons["w"] == ("w/ExponentialMovingAverage", "ema")
            assert reasons["b"][0] == "b" and reasons["b"][1].startswith("ema fallback")
            assert [(r.checkpoint_name, r.reason) for r in report.skipped] == [
                ("w", "raw weights (EMA shadow restored instead)")
            ]
        saver = restorekit.partial_saver(report)
        with tf1.Session() as sess:
            saver.restore(sess, prefix)
            np.testing.assert_array_equal(sess.run(w), [0.5, 0.5])
            np.testing.assert_array_equal(sess.run(b), [3.0, 3.0])
        plain = scan(prefix, [w, b])
        assert [(r.checkpoint_name, r.reason) for r in plain.skipped] == [
            ("w/ExponentialMovingAverage", "EMA shadow (pass ema= to restore it)")
        ]


def test_dtype_mismatch_is_reported(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/bias", [3], dtype=tf.float64)
        report = scan(prefix)
    assert [(r.variable_name, r.checkpoint_dtype, r.dtype) for r in report.dtype_mismatched] == [
        ("dense/bias", "float32", "float64")
    ]
    assert "checkpoint float32, model float64" in str(report)


def test_slots_and_global_step_restore_when_asked(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel/Momentum", [4, 3])
        tf1.train.get_or_create_global_step()
        report = scan(prefix, skip_optimizer_slots=False, include_global_step=True)
    assert _names(report.matched) == {"dense/kernel/Momentum", "global_step"}


# ---------------------------------------------------------------- bad input


def test_assignment_map_key_matching_nothing_lists_closest(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", [4, 3])
        with pytest.raises(NoMatchError, match="'dense/kernal' is not in checkpoint") as info:
            scan(prefix, assignment_map={"dense/kernal": "dense/kernel"})
        assert "dense/kernel" in info.value.closest
        with pytest.raises(NoMatchError, match="matches no entry"):
            scan(prefix, assignment_map={"dnse/": "dense/"})
        with pytest.raises(NoMatchError, match="not a variable"):
            scan(prefix, assignment_map={"dense/kernel": "dense/kernal"})


def test_key_without_slash_mapped_to_scope(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("new/kernel", [4, 3])
        with pytest.raises(AssignmentMapError, match="without a trailing '/'"):
            scan(prefix, assignment_map={"dense": "new/"})


def test_exclude_pattern_matching_nothing_is_an_error(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", [4, 3])
        with pytest.raises(NoMatchError, match="exclude pattern 'logitz'"):
            scan(prefix, exclude=["logitz"])


def test_bad_checkpoint_paths_raise_before_anything(tmp_path):
    with tf.Graph().as_default():
        tf1.get_variable("x", [1])
        with pytest.raises(restorekit.CheckpointNotFoundError):
            scan(tmp_path / "missing")


def test_report_counts_a_name_skipped_on_both_sides_once(tmp_path):
    prefix = save_variables(tmp_path / "c" / "m", {"w": np.ones(2, np.float32), "global_step": np.int64(3)})
    with tf.Graph().as_default():
        tf.compat.v1.get_variable("w", shape=[2])
        tf.compat.v1.train.get_or_create_global_step()
        report = scan(prefix)
    assert len([r for r in report.skipped if r.reason == "global_step"]) == 2  # the variable and the entry
    assert "global_step (1)" in str(report)


def test_keras_batch_norm_names_get_a_hint_towards_slim_batchnorm_entries(tmp_path):
    values = {"conv1/weights": np.ones((3, 3, 1, 2), np.float32), "conv1/BatchNorm/gamma": np.ones(2, np.float32),
              "conv1/BatchNorm/moving_mean": np.zeros(2, np.float32)}
    prefix = save_variables(tmp_path / "slim" / "m", values)
    with tf.Graph().as_default():
        tf.compat.v1.get_variable("conv1/kernel", shape=[3, 3, 1, 2])
        tf.compat.v1.get_variable("conv1_bn/gamma", shape=[2])
        tf.compat.v1.get_variable("conv1_bn/moving_mean", shape=[2])
        report = scan(prefix)
    text = "\n".join(report.hints)
    assert "'conv1_bn/gamma' is missing but checkpoint entry 'conv1/BatchNorm/gamma' differs only in naming" in text
    assert "'conv1_bn/moving_mean'" in text and "'conv1/kernel'" in text


def test_ema_with_the_shadow_variables_in_the_graph_is_complete(tmp_path):
    def build():
        w = tf.compat.v1.get_variable("w", [2], initializer=tf.compat.v1.ones_initializer())
        ema = tf.train.ExponentialMovingAverage(0.9)
        return ema, ema.apply([w])

    with tf.Graph().as_default():
        ema, update = build()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(update)
            prefix = tf.compat.v1.train.Saver().save(sess, str(tmp_path / "ema" / "m"))
    with tf.Graph().as_default():
        ema, _ = build()
        report = scan(prefix, ema=ema)  # 'w' and its live shadow both read the shadow entry
    assert report.is_complete and len(report.matched) == 2 and not report.hints


def test_a_single_layer_of_another_name_is_not_taken_for_a_renamed_model_scope(tmp_path):
    import keras

    def one_layer(name):
        inp = keras.Input((3,))
        return keras.Model(inp, keras.layers.Dense(2, name=name)(inp))

    prefix = tf.train.Checkpoint(model=one_layer("probe")).save(str(tmp_path / "k" / "ckpt"))
    report = scan(prefix, one_layer("head").variables)  # a list: matched by path, not by object graph
    assert not report.matched and len(report.missing) == 2


# ------------------------------------------------------------------ upstream behaviours (issue 14)

def _ema_checkpoint(tmp_path, scope):
    """w and b; ema.apply() called inside variable_scope(scope) (TF saves the shadows under it)."""
    with tf.Graph().as_default():
        w = tf1.get_variable("w", initializer=np.float32([1.0, 2.0]))
        b = tf1.get_variable("b", initializer=np.float32([3.0]))
        ema = tf1.train.ExponentialMovingAverage(0.5)
        with tf1.variable_scope(scope):
            update = ema.apply([w, b])
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run([w.assign([5.0, 6.0]), b.assign([7.0])])
            sess.run(update)
            shadows = sess.run([ema.average(w), ema.average(b)])
            prefix = tf1.train.Saver().save(sess, str(tmp_path / "ema" / "m"))
    return prefix, shadows


@pytest.mark.parametrize("with_apply", [True, False], ids=["ema-applied-in-new-graph", "ema-not-applied"])
def test_ema_shadows_saved_under_a_variable_scope_are_found(tmp_path, with_apply):
    prefix, shadows = _ema_checkpoint(tmp_path, "scope")
    assert "scope/w/ExponentialMovingAverage" in Checkpoint(prefix).entries
    with tf.Graph().as_default():
        w = tf1.get_variable("w", shape=[2])
        b = tf1.get_variable("b", shape=[1])
        ema = tf1.train.ExponentialMovingAverage(0.5)
        if with_apply:
            with tf1.variable_scope("scope"):
                ema.apply([w, b])
        report = scan(prefix, [w, b], ema=ema)
        assert {r.variable_name: r.checkpoint_name for r in report.matched} == {
            "w": "scope/w/ExponentialMovingAverage", "b": "scope/b/ExponentialMovingAverage"}
        restorekit.warm_start(report)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            np.testing.assert_allclose(sess.run(w), shadows[0])
            np.testing.assert_allclose(sess.run(b), shadows[1])


def test_ema_fallbacks_are_named_and_no_shadow_at_all_warns(tmp_path, small_checkpoint):
    prefix, _ = _ema_checkpoint(tmp_path, "scope")
    with tf.Graph().as_default():
        tf1.get_variable("w", shape=[2])
        tf1.get_variable("extra", shape=[1])
        report = scan(prefix, ema=True, exclude=["extra"])
    assert "ema fallback" not in str(report)
    small, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", shape=[4, 3])
        tf1.get_variable("dense/bias", shape=[3])
        with pytest.warns(restorekit.RestoreKitWarning, match="holds no shadow entries"):
            report = scan(small, ema=True)
    assert "  ema fallback (no shadow entry, raw weights): dense/kernel, dense/bias" in str(report).splitlines()
    assert any("holds no shadow entries" in h for h in report.hints)


def test_assignment_map_as_a_list_of_pairs(small_checkpoint):
    prefix, values = small_checkpoint
    with tf.Graph().as_default():
        a = tf1.get_variable("a", shape=[3])
        b = tf1.get_variable("b", shape=[3])
        report = scan(prefix, [a, b], assignment_map=[("dense/bias", a), ("dense/bias", "b")])
        assert {r.variable_name: r.checkpoint_name for r in report.matched} == {"a": "dense/bias", "b": "dense/bias"}
        with pytest.raises(restorekit.AssignmentMapError, match="holds \\(checkpoint_name, variable\\) pairs"):
            scan(prefix, [a], assignment_map=[("dense/bias",)])


def test_warm_start_when_the_prefix_is_also_a_directory(tmp_path):
    directory = tmp_path / "run"
    with tf.Graph().as_default():
        v = tf1.get_variable("v", initializer=np.float32([1.5, 2.5]))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            prefix = tf1.train.Saver().save(sess, str(directory))  # writes run.index beside a 'run' directory
    os.makedirs(directory, exist_ok=True)
    assert os.path.isdir(prefix)
    with tf.Graph().as_default():
        v = tf1.get_variable("v", shape=[2])
        restorekit.warm_start(scan(prefix))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(v), [1.5, 2.5])


def test_partial_saver_for_a_report_of_another_graph_is_a_clear_error(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/bias", shape=[3])
        report = scan(prefix)
    with tf.Graph().as_default():
        with pytest.raises(restorekit.InvalidArgumentError, match="belongs to another graph"):
            restorekit.partial_saver(report)
        with pytest.raises(restorekit.InvalidArgumentError, match="belongs to another graph"):
            restorekit.warm_start(report)


def test_a_vocabulary_list_with_duplicates_is_refused_at_construction():
    with pytest.raises(restorekit.VocabularyError, match="lists 'a' twice"):
        restorekit.VocabRemap(["a", "b", "a"], ["a", "b"])


def test_a_truncated_shard_is_named_by_scan_before_any_restore(small_checkpoint, tmp_path):
    import shutil

    prefix, _ = small_checkpoint
    copy = tmp_path / "cut"
    shutil.copytree(os.path.dirname(prefix), copy)
    cut = str(copy / os.path.basename(prefix))
    shard = cut + ".data-00000-of-00001"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 8)
    with tf.Graph().as_default():
        tf1.get_variable("dense/bias", shape=[3])
        with pytest.raises(restorekit.CorruptCheckpointError, match="is truncated") as info:
            scan(cut)
    assert shard in str(info.value)


# ------------------------------------------------------------------ optimizer state of every TF1 optimizer is a slot

TF1_OPTIMIZERS = {
    "Momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
    "Adam": lambda: tf1.train.AdamOptimizer(0.1),
    "RMSProp": lambda: tf1.train.RMSPropOptimizer(0.1, momentum=0.5),
    "Adagrad": lambda: tf1.train.AdagradOptimizer(0.1),
    "Adadelta": lambda: tf1.train.AdadeltaOptimizer(0.1),
    "Ftrl": lambda: tf1.train.FtrlOptimizer(0.1),
}


@pytest.mark.parametrize("optimizer", list(TF1_OPTIMIZERS), ids=list(TF1_OPTIMIZERS))
def test_tf1_optimizer_state_in_a_real_checkpoint_is_skipped_as_slots(tmp_path, optimizer):
    prefix = str(tmp_path / "ckpt" / "model.ckpt")
    with tf.Graph().as_default():
        w = tf1.get_variable("net/w", [3, 2])
        b = tf1.get_variable("net/b", [2])
        loss = tf.reduce_sum(tf.square(tf.matmul(tf.ones([1, 3]), w) + b))
        step = tf1.train.get_or_create_global_step()
        train = TF1_OPTIMIZERS[optimizer]().minimize(loss, global_step=step)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train)
            tf1.train.Saver().save(sess, prefix)
    ckpt = Checkpoint(prefix)
    optimizer_entries = set(ckpt) - {"net/w", "net/b", "global_step"}
    assert optimizer_entries  # the optimizer saved state of its own
    with tf.Graph().as_default():
        tf1.get_variable("net/w", [3, 2])
        tf1.get_variable("net/b", [2])
        report = restorekit.scan(prefix)
    assert {r.variable_name for r in report.matched} == {"net/w", "net/b"}
    assert report.unused == () and report.missing == () and report.is_complete
    slots = {r.checkpoint_name for r in report.skipped if r.reason.startswith("optimizer slot")}
    assert slots == optimizer_entries


def test_bert_style_adam_m_and_adam_v_are_slots(tmp_path):
    values = {
        "bert/encoder/layer_0/kernel": np.ones([2, 2], np.float32),
        "bert/encoder/layer_0/kernel/adam_m": np.ones([2, 2], np.float32),
        "bert/encoder/layer_0/kernel/adam_v": np.ones([2, 2], np.float32),
    }
    prefix = save_variables(tmp_path / "bert" / "model.ckpt", values)
    with tf.Graph().as_default():
        tf1.get_variable("bert/encoder/layer_0/kernel", [2, 2])
        report = restorekit.scan(prefix)
    assert [r.variable_name for r in report.matched] == ["bert/encoder/layer_0/kernel"]
    assert report.unused == ()
    assert {r.checkpoint_name: r.reason for r in report.skipped} == {
        "bert/encoder/layer_0/kernel/adam_m": "optimizer slot (Adam (BERT))",
        "bert/encoder/layer_0/kernel/adam_v": "optimizer slot (Adam (BERT))",
    }


def test_slice_or_pad_hint_only_when_the_classes_alone_differ(small_checkpoint):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", [6, 3])  # input features changed: no slice_or_pad hint
        tf1.get_variable("logits/kernel", [3, 10])  # only the classes changed
        tf1.get_variable("logits/bias", [10])
        report = scan(prefix)
    assert sorted(r.variable_name for r in report.shape_mismatched) == ["dense/kernel", "logits/bias", "logits/kernel"]
    hinted = sorted(h.split("'")[1] for h in report.hints if "slice_or_pad" in h)
    assert hinted == ["logits/bias", "logits/kernel"]


def test_tf2_save_counter_is_skipped_as_the_save_counter_not_global_step(tmp_path):
    module = tf.Module()
    module.w = tf.Variable(np.arange(3, dtype=np.float32), name="w")
    prefix = tf.train.Checkpoint(model=module).save(str(tmp_path / "tf2" / "ckpt"))
    fresh = tf.Module()
    fresh.w = tf.Variable(np.zeros(3, np.float32), name="w")
    report = scan(prefix, fresh)
    assert {(r.checkpoint_path, r.reason) for r in report.skipped} == {("save_counter", "save counter")}
    assert "save counter (1)" in str(report) and "global_step" not in str(report)
    restorekit.restore(report)
    np.testing.assert_array_equal(fresh.w.numpy(), [0.0, 1.0, 2.0])


# ---------------------------------------------------------------- Record.how: how each record matched, as a value

def test_every_record_says_how_it_matched_or_why_it_was_skipped(small_checkpoint, tmp_path):
    prefix, _ = small_checkpoint
    with tf.Graph().as_default():
        tf1.get_variable("dense/kernel", [4, 3])
        tf1.get_variable("dense/bias", [3], dtype=tf.float64)
        tf1.get_variable("dense/kernel/Momentum", [4, 3])
        tf1.get_variable("head/kernel", [3, 6])
        tf1.train.get_or_create_global_step()
        report = scan(prefix, exclude=["dense/kernel/Momentum"], rules=[(r"^head/", "logits/")],
                      shape_policy="slice_or_pad", dtype_policy="cast")
        mapped = scan(prefix, assignment_map={"dense/": "dense/"}, dtype_policy="cast")
    how = {r.variable_name: r.how for r in report.matched + report.skipped if r.variable_name is not None}
    assert [r.how for r in report.skipped if r.checkpoint_name == "dense/kernel/Momentum"] == [("optimizer",)]
    assert how["dense/kernel"] == ("name",)  # a rule set, but this name is its own
    assert how["head/kernel"] == ("rule", "policy")  # renamed by the rule, sliced by the shape policy
    assert how["dense/bias"] == ("name", "policy")  # cast
    assert how["dense/kernel/Momentum"] == ("excluded",)
    assert how["global_step"] == ("counter",)
    assert {r.variable_name: r.how for r in mapped.matched} == {"dense/kernel": ("assignment_map",),
                                                                "dense/bias": ("assignment_map", "policy")}
    assert [r.how for r in mapped.skipped if r.variable_name == "head/kernel"] == [("not_in_assignment_map",)]
    assert set(restorekit._report.HOW) >= {h for r in report.matched + report.skipped for h in r.how}
    as_json = restorekit._report.json.loads(report.to_json())
    assert {r["variable_name"]: r["how"] for r in as_json["matched"]}["head/kernel"] == ["rule", "policy"]


def test_how_tells_the_pairing_methods_and_ema_apart(tmp_path):
    import keras

    def model(seed):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((3,))
        return keras.Model(inputs, keras.layers.Dense(2, name="fc")(inputs), name="m")

    saved = model(0)
    prefix = tf.train.Checkpoint(model=saved).write(str(tmp_path / "tf2" / "ckpt"))
    saved.save_weights(tmp_path / "m.weights.h5")
    traced = scan(prefix, model(1))
    by_graph = scan(prefix, model(1), match="object_graph")
    by_path = scan(prefix, model(1), match="path")
    keras_file = scan(tmp_path / "m.weights.h5", model(1))
    # The object graph and the readable paths give the same pairs: reported as the names give them, as on
    # every backend (issue 39); 'object_graph' where it was asked for (or paired what names did not).
    assert {r.how for r in traced.matched} == {("name", "readable_path")}
    assert traced.to_dict() == by_path.to_dict()
    assert {r.how for r in by_graph.matched} == {("object_graph",)}
    assert {r.how for r in by_path.matched} == {("name", "readable_path")}
    assert {r.how for r in keras_file.matched} == {("name", "readable_path")}
    # EMA: shadow, fallback, and the raw weights it replaced
    values = {"w": np.ones([2], np.float32), "w/ExponentialMovingAverage": np.zeros([2], np.float32),
              "b": np.ones([2], np.float32)}
    ema_prefix = save_variables(tmp_path / "ema", values)
    with tf.Graph().as_default():
        report = scan(ema_prefix, [tf1.get_variable("w", [2]), tf1.get_variable("b", [2])], ema=True)
    assert {r.variable_name: r.how for r in report.matched} == {"w": ("name", "ema"), "b": ("name", "ema_fallback")}
    assert [r.how for r in report.skipped] == [("raw_weights",)]
    assert "ema fallback (no shadow entry, raw weights): b" in str(report)


# ---------------------------------------------------------------- nested blocks whose layers share names


@pytest.fixture
def nested_files(tmp_path):
    """The model of tests/test_export_layouts_live.py (``block_a/fc``, ``block_b/fc``, Sequential ``block_c``), saved
    as a TF2 checkpoint, a .weights.h5 and a .keras, and a fresh model of the same architecture with other values."""
    from test_export_layouts_live import nested_model

    model = nested_model()
    files = {"tf2": tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt")),
             "weights.h5": str(tmp_path / "m.weights.h5"), "keras": str(tmp_path / "m.keras")}
    model.save_weights(files["weights.h5"])
    model.save(files["keras"])
    fresh = nested_model()
    rng = np.random.default_rng(7)
    for v in fresh.weights:
        v.assign(np.abs(rng.standard_normal(v.shape)).astype(np.float32) + 0.25)
    return model, fresh, files


NESTED_KINDS = ["tf2", "weights.h5", "keras"]


@pytest.mark.parametrize("kind", NESTED_KINDS, ids=["tf2 checkpoint", "weights.h5", ".keras"])
def test_nested_blocks_sharing_layer_names_restore_completely_from_their_own_file(nested_files, kind):
    model, fresh, files = nested_files
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    assert not np.allclose(np.asarray(fresh(x, training=False)), np.asarray(model(x, training=False)))
    report = scan(files[kind], fresh)
    assert len(report.matched) == report.num_variables == 16 and report.is_complete, report
    names = {r.variable_name for r in report.matched}
    assert {"block_a/fc/kernel", "block_b/fc/kernel", "block_a/pre/bias", "block_b/pre/bias"} <= names
    if kind == "tf2":  # the object graph pairs every variable; none is dropped for a path that is not a name
        how = {r.variable_name: r.how for r in report.matched}
        # the repeated 'fc' paths only the object graph pairs; a unique path the names pair as well (issue 39)
        assert how["block_a/fc/kernel"] == how["block_b/fc/kernel"] == ("object_graph",), how
        assert set(how.values()) == {("object_graph",), ("name", "readable_path")}, how
    restorekit.restore(report, strict=True)
    for saved, restored in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(saved), err_msg=saved.path)
    np.testing.assert_array_equal(np.asarray(fresh(x, training=False)), np.asarray(model(x, training=False)))


@pytest.mark.parametrize("kind", NESTED_KINDS, ids=["tf2 checkpoint", "weights.h5", ".keras"])
def test_repeated_names_in_a_flat_variable_list_are_left_missing_and_said_so(nested_files, kind):
    # model.weights names both blocks' layers 'pre/...' and 'fc/...': no name tells block_a's from block_b's
    model, fresh, files = nested_files
    report = scan(files[kind], fresh.weights)
    repeated = ["pre/kernel", "pre/bias", "fc/kernel", "fc/bias"]
    assert sorted(r.variable_name for r in report.missing) == sorted(repeated * 2)
    assert len(report.matched) == 8 and not report.shape_mismatched
    saved = {v.path: np.asarray(v) for v in model.weights if v.path not in repeated}
    restorekit.restore(report)
    for v in fresh.weights:  # what was paired is right, what could not be decided is untouched
        if v.path in saved:
            np.testing.assert_array_equal(np.asarray(v), saved[v.path], err_msg=v.path)
    hint = next(h for h in report.hints if "cannot be decided by name" in h)
    assert "'pre/kernel' names 2" in hint and "scan(checkpoint, model)" in hint
    assert not any("assignment_map={'block_a/'" in h for h in report.hints), report.hints
