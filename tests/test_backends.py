"""Keras 3 on the JAX and PyTorch backends, and torch.nn.Module targets, with TensorFlow blocked (issue 24).

Checkpoints are written here by TensorFlow and Keras on the TensorFlow backend; one
subprocess per backend (``tests/backend_cases.py``, TensorFlow hidden by
``tests/blockers/no_tensorflow``) scans and restores them and writes what it got.
"""

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCKER = os.path.join(HERE, "blockers", "no_tensorflow")
CASES = {
    "tf1": ["tf1/model.ckpt", {"rules": "KERAS_FROM_TF1"}],
    "tf2": ["tf2/ckpt-1", {}],
    "h5": ["src.weights.h5", {}],
    "keras": ["src.keras", {}],
    "tf1_slice": ["tf1/model.ckpt", {"rules": [["^new_head/", "head/"], "KERAS_FROM_TF1"], "shape_policy": "slice_or_pad"}],
    # TF1 ExponentialMovingAverage shadows restored instead of the raw weights
    "tf1_ema": ["tf1_ema/model.ckpt", {"rules": "KERAS_FROM_TF1", "ema": True}],
    # a checkpoint whose body took 4 inputs: its kernel's rows resized to 6 as a 1-D table (prefix row kept)
    "tf1_resize": ["tf1_narrow/model.ckpt", {"rules": "KERAS_FROM_TF1", "shape_policy": {
        "body/kernel": ["ResizePositions", {"num_prefix_tokens": 1, "grid": False}]}}],
}
COMPUTED = ["tf1_ema", "tf1_resize"]  # values the TF backend's restore computes too: compared with it exactly
SPEC = {"head_units": 5, "head_name": "new_head", "cases": CASES}
RESTORED = ["body/kernel", "body/bias", "bn/gamma", "bn/beta", "bn/moving_mean", "bn/moving_variance"]
HEAD = ["new_head/kernel", "new_head/bias"]


def _missing(*modules) -> str | None:
    gone = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"needs {' and '.join(gone)} installed (pip install 'restorekit[{gone[0]}]')" if gone else None


def _slim(path: str) -> str:
    """A Keras variable path as tf-slim names it in a TF1 checkpoint."""
    return re.sub(r"/bias$", "/biases", re.sub(r"/kernel$", "/weights", path))


def _model(keras, head_units, head_name):
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="body")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    return keras.Model(inputs, keras.layers.Dense(head_units, name=head_name)(h), name="net")


def _write_tf1(tf, prefix, values):
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.get_variable(name, initializer=value) for name, value in values.items()]
        tf.compat.v1.train.get_or_create_global_step()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver(variables + [tf.compat.v1.train.get_global_step()]).save(sess, prefix)


def _write_convnet(tf, directory):
    """A TF1 conv/BN/dense net (slim-style names), its checkpoint, and its outputs on one input."""
    rng = np.random.default_rng(3)
    values = {
        "conv/kernel": rng.standard_normal((3, 3, 3, 4)).astype("float32"),
        "conv/bias": rng.standard_normal(4).astype("float32"),
        "bn/gamma": rng.uniform(0.5, 1.5, 4).astype("float32"),
        "bn/beta": rng.standard_normal(4).astype("float32"),
        "bn/moving_mean": rng.standard_normal(4).astype("float32"),
        "bn/moving_variance": rng.uniform(0.5, 2.0, 4).astype("float32"),
        "fc/kernel": rng.standard_normal((100, 7)).astype("float32"),
        "fc/bias": rng.standard_normal(7).astype("float32"),
    }
    x = rng.standard_normal((2, 5, 5, 3)).astype("float32")
    graph = tf.Graph()
    with graph.as_default():
        v = {name: tf.compat.v1.get_variable(name, initializer=value) for name, value in values.items()}
        h = tf.nn.conv2d(tf.constant(x), v["conv/kernel"], 1, "SAME") + v["conv/bias"]
        h = tf.nn.batch_normalization(h, v["bn/moving_mean"], v["bn/moving_variance"], v["bn/beta"], v["bn/gamma"], 1e-3)
        y = tf.matmul(tf.reshape(tf.nn.relu(h), [2, -1]), v["fc/kernel"]) + v["fc/bias"]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver(list(v.values())).save(sess, os.path.join(directory, "convnet", "model.ckpt"))
            out = sess.run(y)
    np.savez(os.path.join(directory, "convnet-io.npz"), x=x, y=out)


def _write_tf1_ema(tf, prefix, values):
    """A TF1 checkpoint with raw weights and ExponentialMovingAverage shadows of other values, saved by a Saver."""
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.get_variable(name, initializer=value) for name, value in values.items()]
        ema = tf.compat.v1.train.ExponentialMovingAverage(0.9)
        update = ema.apply(variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(update)
            for v in variables:  # shadows of their own, so a restore of the raw weights shows
                sess.run(ema.average(v).assign(v * 0.5 - 1))
            tf.compat.v1.train.Saver().save(sess, prefix)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The checkpoints of one model, written by TF, and the TF backend's reports for the new-head model."""
    tf = pytest.importorskip("tensorflow")
    import keras

    import restorekit

    if keras.config.backend() != "tensorflow":
        pytest.skip("the checkpoints are written with Keras on the TensorFlow backend")
    directory = str(tmp_path_factory.mktemp("backends"))
    keras.utils.set_random_seed(1)
    source = _model(keras, 3, "head")
    rng = np.random.default_rng(0)
    for v in source.variables:  # BatchNormalization starts at 1/0: give every weight a value of its own
        v.assign(rng.standard_normal(v.shape).astype("float32") + (1.5 if "variance" in v.path else 0))
    expected = {v.path: v.numpy() for v in source.variables}
    tf.train.Checkpoint(model=source).write(os.path.join(directory, "tf2", "ckpt-1"))
    source.save_weights(os.path.join(directory, "src.weights.h5"))
    source.save(os.path.join(directory, "src.keras"))
    _write_tf1(tf, os.path.join(directory, "tf1", "model.ckpt"), {_slim(k): a for k, a in expected.items()})
    _write_tf1_ema(tf, os.path.join(directory, "tf1_ema", "model.ckpt"), {_slim(k): a for k, a in expected.items()})
    narrow = {_slim(k): a for k, a in expected.items()}
    narrow["body/weights"] = rng.standard_normal((4, 8)).astype("float32")
    _write_tf1(tf, os.path.join(directory, "tf1_narrow", "model.ckpt"), narrow)
    _write_convnet(tf, directory)
    corrupt = os.path.join(directory, "tf1_corrupt", "model.ckpt")
    os.makedirs(os.path.dirname(corrupt))
    for suffix in (".index", ".data-00000-of-00001"):
        with open(os.path.join(directory, "tf1", "model.ckpt" + suffix), "rb") as f:
            data = bytearray(f.read())
        if suffix != ".index":
            stored = restorekit.Checkpoint(os.path.join(directory, "tf1", "model.ckpt"))
            data[max(stored.bundle_entry(_slim(n)).offset for n in RESTORED)] ^= 0x01
        with open(corrupt + suffix, "wb") as f:
            f.write(bytes(data))
    with open(os.path.join(directory, "spec.json"), "w") as f:
        json.dump({**SPEC, "corrupt": "tf1_corrupt/model.ckpt"}, f)
    reports = {}
    for case, (path, options) in CASES.items():
        keras.utils.set_random_seed(7)
        model = _model(keras, SPEC["head_units"], SPEC["head_name"])
        rules = options.get("rules")
        if rules is not None:
            rules = restorekit.KERAS_FROM_TF1 if rules == "KERAS_FROM_TF1" else [
                restorekit.KERAS_FROM_TF1 if r == "KERAS_FROM_TF1" else tuple(r) for r in rules]
        shape_policy = options.get("shape_policy")
        if isinstance(shape_policy, dict):
            shape_policy = {k: getattr(restorekit, p[0])(**p[1]) for k, p in shape_policy.items()}
        report = restorekit.scan(os.path.join(directory, path), model, **{**options, "rules": rules,
                                                                           "shape_policy": shape_policy})
        reports[case] = report.to_dict()
        if case in COMPUTED:  # what the TensorFlow path restores
            restorekit.restore(report)
            np.savez(os.path.join(directory, f"tensorflow-{case}.npz"), **{v.path: v.numpy() for v in model.variables})
    return directory, expected, reports


def _run(directory, backend):
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": os.pathsep.join([BLOCKER, os.path.dirname(HERE)])}
    done = subprocess.run([sys.executable, os.path.join(HERE, "backend_cases.py"), directory],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


_RUNS = {}


def _run_once(request, backend):
    why = _missing(backend)
    if why:  # before the checkpoints are written: nothing to run them with
        pytest.skip(f"the {backend} backend {why}")
    directory, expected, reports = request.getfixturevalue("written")
    if backend not in _RUNS:
        _RUNS[backend] = _run(directory, backend)
    return backend, directory, expected, reports, _RUNS[backend]


@pytest.fixture(scope="module", params=["jax", "torch"])
def backend_run(request):
    return _run_once(request, request.param)


@pytest.fixture(scope="module")
def torch_run(request):
    """The torch-backend process, which also restores the torch twin."""
    return _run_once(request, "torch")


def test_tensorflow_is_never_imported(backend_run):
    assert backend_run[4]["tensorflow_imported"] is False


@pytest.mark.parametrize("case", list(CASES), ids=[f"from a {c} checkpoint" for c in CASES])
def test_the_report_equals_the_tensorflow_backends(backend_run, case):
    _, _, _, reports, result = backend_run
    got, want = copy.deepcopy(result["keras"][case]), copy.deepcopy(reports[case])
    if case == "tf2":
        # TF also traces a TF2 checkpoint's object graph through its live trackables, which other backends do
        # not have; it gives the same pairs, so each is reported as the readable paths give it, on every backend.
        assert {tuple(r["how"]) for r in want["matched"]} == {("name", "readable_path")}
    assert got == want
    assert len(reports[case]["matched"]) == len(RESTORED) + (2 if case == "tf1_slice" else 0)


@pytest.mark.parametrize("case", ["tf1", "tf2", "h5", "keras"], ids=["from a TF1 checkpoint", "from a TF2 checkpoint",
                                                                      "from a .weights.h5", "from a .keras file"])
def test_restored_values_are_the_checkpoints_bit_for_bit_and_the_head_untouched(backend_run, case):
    backend, directory, expected, _, _ = backend_run
    got = np.load(os.path.join(directory, f"{backend}-{case}.npz"))
    for name in RESTORED:
        assert got[f"after/{name}"].tobytes() == expected[name].tobytes(), name
    for name in HEAD:
        assert got[f"after/{name}"].tobytes() == got[f"before/{name}"].tobytes(), name


def test_slice_or_pad_is_computed_in_numpy(backend_run):
    backend, directory, expected, _, _ = backend_run
    got = np.load(os.path.join(directory, f"{backend}-tf1_slice.npz"))
    kernel, before = got["after/new_head/kernel"], got["before/new_head/kernel"]
    np.testing.assert_array_equal(kernel[:, :3], expected["head/kernel"])
    np.testing.assert_array_equal(kernel[:, 3:], before[:, 3:])
    np.testing.assert_array_equal(got["after/new_head/bias"][:3], expected["head/bias"])


def test_ema_shadows_restore_off_tensorflow_as_on_it(backend_run):
    backend, directory, expected, _, result = backend_run
    assert all(r["how"][-1] == "ema" for r in result["keras"]["tf1_ema"]["matched"])
    got = np.load(os.path.join(directory, f"{backend}-tf1_ema.npz"))
    on_tf = np.load(os.path.join(directory, "tensorflow-tf1_ema.npz"))
    for name in RESTORED:
        shadow = expected[name] * np.float32(0.5) - np.float32(1)  # as TF computed it: float32 ops
        np.testing.assert_array_equal(got[f"after/{name}"], shadow, err_msg=name)
        assert got[f"after/{name}"].tobytes() == on_tf[name].tobytes(), name
    for name in HEAD:
        assert got[f"after/{name}"].tobytes() == got[f"before/{name}"].tobytes(), name


def test_resize_positions_is_computed_in_numpy_as_on_tensorflow(backend_run):
    import restorekit

    backend, directory, expected, _, result = backend_run
    got = np.load(os.path.join(directory, f"{backend}-tf1_resize.npz"))
    on_tf = np.load(os.path.join(directory, "tensorflow-tf1_resize.npz"))
    narrow = restorekit.Checkpoint(os.path.join(directory, "tf1_narrow", "model.ckpt")).read("body/weights")
    want = restorekit.ResizePositions(num_prefix_tokens=1, grid=False).adapt(narrow, (6, 8))
    assert got["after/body/kernel"].tobytes() == want.tobytes() == on_tf["body/kernel"].tobytes()
    np.testing.assert_array_equal(got["after/body/kernel"][0], narrow[0])  # the prefix row kept as it is
    for name in RESTORED[1:]:
        assert got[f"after/{name}"].tobytes() == expected[name].tobytes(), name


def test_adapt_input_channels_into_a_torch_module_is_computed_in_numpy(torch_run):
    import restorekit

    _, directory, _, _, result = torch_run
    report = result["torch"]["gray_report"]
    assert "conv.weight" in [r["variable_name"] for r in report["matched"]]
    assert report["shape_mismatched"] == [] and report["unused"] == []
    got = np.load(os.path.join(directory, "torch-convnet.npz"))
    kernel = restorekit.Checkpoint(os.path.join(directory, "convnet", "model.ckpt")).read("conv/kernel")  # HWIO
    want = restorekit.AdaptInputChannels().adapt(kernel, (3, 3, 1, 4)).transpose(3, 2, 0, 1)  # to torch's OIHW
    assert got["gray_conv"].shape == (4, 1, 3, 3)
    assert got["gray_conv"].tobytes() == np.ascontiguousarray(want).tobytes()
    np.testing.assert_allclose(kernel.sum(axis=2).transpose(2, 0, 1)[:, None], got["gray_conv"], atol=1e-6)  # the sum of RGB


def test_a_corrupt_tensor_stops_the_restore_before_any_variable_changes(backend_run):
    assert backend_run[4]["keras"]["corrupt"] == {"raised": "ChecksumMismatchError", "unchanged": True}


def test_warm_start_callback_restores_before_the_first_batch(backend_run):
    backend, directory, expected, _, result = backend_run
    assert result["keras"]["fit"] == {"how": "warm_started", "matched": len(RESTORED)}
    first = np.load(os.path.join(directory, f"{backend}-fit.npz"))
    for name in RESTORED:
        np.testing.assert_array_equal(first[name], expected[name])


def test_warm_start_stays_out_of_a_run_resumed_by_backup_and_restore(backend_run):
    # the pretrained file of the restart does not exist: a resumed run never reads it
    assert backend_run[4]["keras"]["resumed"] == "resumed"


def test_grouped_keras_optimizer_freezes_and_scales_groups_off_tensorflow(backend_run):
    groups = backend_run[4]["keras"]["groups"]
    assert groups["frozen"] == ["body/kernel", "body/bias"]
    moved = groups["moved"]
    assert moved["body/kernel"] == 0 and moved["body/bias"] == 0
    assert moved["new_head/kernel"] > 0 and moved["bn/gamma"] > 0


def test_a_torch_twin_of_a_tf1_convnet_computes_its_outputs(torch_run):
    _, directory, _, _, result = torch_run
    report = result["torch"]["report"]
    assert sorted(r["variable_name"] for r in report["missing"]) == ["logits.bias", "logits.weight"]
    assert report["unused"] == [] and report["shape_mismatched"] == []
    assert result["torch"]["head_untouched"]
    got = np.load(os.path.join(directory, "torch-convnet.npz"))
    want = np.load(os.path.join(directory, "convnet-io.npz"))["y"]
    # float32 outputs in the hundreds: torch's and TF's kernels sum in other orders, so the last bits differ by CPU
    # (1.1e-5 seen at 106); a wrong layout moves them by whole units.
    np.testing.assert_allclose(got["y"], want, rtol=0, atol=1e-6 * float(np.abs(want).max()))


# ------------------------------------------------------------------ torch.nn.Module targets, in this process

def _torch():
    why = _missing("torch")
    if why:
        pytest.skip(f"torch.nn.Module targets {why}")
    import torch

    return torch


def test_a_mismatched_torch_parameter_is_reported_and_skipped_or_sliced_by_a_policy(tmp_path):
    torch = _torch()
    from conftest import save_variables

    import restorekit

    rng = np.random.default_rng(5)
    values = {"fc/kernel": rng.standard_normal((4, 3)).astype("float32"), "fc/bias": rng.standard_normal(3).astype("float32"),
              "out/kernel": rng.standard_normal((3, 2)).astype("float32"), "out/bias": np.ones(2, "float32")}
    prefix = save_variables(tmp_path / "ckpt" / "model.ckpt", values)
    torch.manual_seed(0)
    module = torch.nn.Sequential()
    module.add_module("fc", torch.nn.Linear(4, 3))
    module.add_module("out", torch.nn.Linear(3, 5))  # 5 outputs where the checkpoint has 2
    before = module.out.weight.detach().clone()
    report = restorekit.scan(prefix, module, layout="torch")
    assert [r.variable_name for r in report.shape_mismatched] == ["out.weight", "out.bias"]
    assert any("'out.bias' differs only in shape" in h for h in report.hints)
    with pytest.raises(restorekit.IncompleteRestoreError):
        restorekit.restore(report, strict=True)
    assert torch.equal(module.out.weight, before)  # strict refused before any copy
    restorekit.restore(report)
    np.testing.assert_array_equal(module.fc.weight.detach().numpy(), values["fc/kernel"].T)
    assert torch.equal(module.out.weight, before)
    sliced = restorekit.scan(prefix, module, layout="torch", shape_policy="slice_or_pad")
    restorekit.restore(sliced)
    np.testing.assert_array_equal(module.out.weight.detach().numpy()[:2], values["out/kernel"].T)
    np.testing.assert_array_equal(module.out.weight.detach().numpy()[2:], before.numpy()[2:])
    assert module.out.weight.requires_grad  # copied in place: still the module's Parameter


def test_a_bert_tf1_checkpoint_restores_into_bert_for_sequence_classification(tmp_path):
    torch = _torch()
    transformers = pytest.importorskip("transformers")
    from conftest import save_variables
    from test_export_hf import HIDDEN, INNER, LAYERS, POSITIONS, VOCAB, bert_values

    import restorekit

    values = bert_values()
    prefix = save_variables(tmp_path / "bert" / "bert_model.ckpt", values)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=2, intermediate_size=INNER,
                                     max_position_embeddings=POSITIONS, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    head = model.classifier.weight.detach().clone()
    report = restorekit.scan(prefix, model, rules="bert-tf-to-hf")
    restorekit.restore(report)
    assert sorted(r.variable_name for r in report.missing) == ["classifier.bias", "classifier.weight"]
    assert sorted(r.checkpoint_name for r in report.unused) == [  # the pre-training heads
        "cls.predictions.bias", "cls.predictions.transform.LayerNorm.bias", "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.dense.bias", "cls.predictions.transform.dense.weight", "cls.seq_relationship.bias",
        "cls.seq_relationship.weight"]
    assert len(report.skipped) == 2 * len([n for n in values if "adam_" not in n and n != "global_step"]) + 1
    assert len(report.matched) == len(model.bert.state_dict())
    assert torch.equal(model.classifier.weight, head)
    # the same encoder as converting the checkpoint and loading it with from_pretrained
    restorekit.convert(prefix, tmp_path / "hf" / "model.safetensors", rules="bert-tf-to-hf", weights_only=True,
                       config={"num_attention_heads": 2})
    loaded = transformers.BertModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.tensor([[1, 5, 7, 2, 9, 3]])
    with torch.no_grad():
        ours, theirs = model.bert(tokens).last_hidden_state, loaded(tokens).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_param_groups_give_torch_optim_a_rate_per_group_and_freeze_multiplier_zero():
    torch = _torch()
    import restorekit

    module = torch.nn.Sequential()
    module.add_module("stem", torch.nn.Linear(4, 4))
    module.add_module("body", torch.nn.Linear(4, 4))
    module.add_module("head", torch.nn.Linear(4, 2))
    groups = restorekit.param_groups(module, {"stem": 0, "head": 10.0}, lr=0.01, default=0.5)
    assert [(g["name"], g["lr"], len(g["params"])) for g in groups] == [("'head'", 0.1, 2), ("(default)", 0.005, 2)]
    assert groups[0]["params"][0] is module.head.weight
    assert not module.stem.weight.requires_grad and module.body.weight.requires_grad
    stem = module.stem.weight.detach().clone()
    optimizer = torch.optim.SGD(groups, lr=1.0)
    module(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert torch.equal(module.stem.weight, stem)
    with pytest.raises(restorekit.NoMatchError, match="'neck'"):
        restorekit.param_groups(module, {"neck": 0}, lr=0.01)


def _tiny_bert(tmp_path):
    torch = _torch()
    transformers = pytest.importorskip("transformers")
    from conftest import save_variables
    from test_export_hf import HIDDEN, INNER, LAYERS, POSITIONS, VOCAB, bert_values

    values = bert_values()
    prefix = save_variables(tmp_path / "bert" / "bert_model.ckpt", values)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=2, intermediate_size=INNER, max_position_embeddings=POSITIONS)
    torch.manual_seed(0)
    return torch, prefix, values, transformers.BertForPreTraining(config).eval()


def test_a_torch_restore_reads_stored_tensors_straight_into_the_parameters(tmp_path, monkeypatch):
    torch, prefix, values, model = _tiny_bert(tmp_path)
    import restorekit

    report = restorekit.scan(prefix, model, rules="bert-tf-to-hf")
    query = model.bert.encoder.layer[0].attention.self.query.weight
    embeddings = model.bert.embeddings.word_embeddings.weight
    versions = query._version, embeddings._version
    # No array of its own per tensor: every matched value is read into its parameter (through one buffer if transposed).
    monkeypatch.setattr(restorekit.Checkpoint, "read", lambda *a, **k: pytest.fail("staged a whole tensor"))
    restorekit.restore(report)
    monkeypatch.undo()
    assert query.detach().numpy().tobytes() == values["bert/encoder/layer_0/attention/self/query/kernel"].T.tobytes()
    assert embeddings.detach().numpy().tobytes() == values["bert/embeddings/word_embeddings"].tobytes()
    state = model.state_dict()
    for record in report.matched:
        source = report._source.readable_name(record.checkpoint_name)
        want = values[source].T if report._source.plan.transforms.get(source) == "transpose" else values[source]
        assert state[record.variable_name].numpy().tobytes() == want.tobytes(), record.variable_name
    # written through numpy or by copy_: autograd sees the change either way
    assert query._version > versions[0] and embeddings._version > versions[1]
    assert query.requires_grad and isinstance(query, torch.nn.Parameter)


def test_a_corrupt_tensor_stops_a_torch_restore_before_any_parameter_changes(tmp_path):
    torch, prefix, values, model = _tiny_bert(tmp_path)
    import restorekit

    report = restorekit.scan(prefix, model, rules="bert-tf-to-hf")
    ckpt = restorekit.Checkpoint(prefix)
    # the tensor stored last: a restore that copied as it checked would have written all the others
    last = max((n for n in ckpt.entries if "adam" not in n and n != "global_step"), key=lambda n: ckpt.bundle_entry(n).offset)
    shard = prefix + ".data-00000-of-00001"
    data = bytearray(open(shard, "rb").read())
    data[ckpt.bundle_entry(last).offset] ^= 0x01
    open(shard, "wb").write(bytes(data))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(restorekit.ChecksumMismatchError, match=re.escape(repr(last))):
        restorekit.restore(report)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_ema_shadows_restore_into_a_torch_module_through_a_rule_set(tmp_path):
    _torch()
    transformers = pytest.importorskip("transformers")
    tf = pytest.importorskip("tensorflow")
    from test_export_hf import HIDDEN, INNER, LAYERS, POSITIONS, VOCAB, bert_values

    import restorekit

    values = bert_values(optimizer=False)
    prefix = str(tmp_path / "bert" / "bert_model.ckpt")
    _write_tf1_ema(tf, prefix, values)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=2, intermediate_size=INNER, max_position_embeddings=POSITIONS)
    model = transformers.BertForPreTraining(config).eval()
    report = restorekit.scan(prefix, model, rules="bert-tf-to-hf", ema=True)
    assert len(report.matched) == len(values) and all(r.how[-1] == "ema" for r in report.matched)
    assert list(report.unused) == [] and len(report.skipped) == len(values)  # the raw weights
    restorekit.restore(report)
    state, shadows = model.state_dict(), restorekit.Checkpoint(prefix)
    for record in report.matched:
        source = report._source.readable_name(record.checkpoint_name)
        assert source.endswith("/ExponentialMovingAverage"), source
        want = shadows.read(source)
        np.testing.assert_array_equal(want, values[source.rpartition("/")[0]] * np.float32(0.5) - np.float32(1))
        if report._source.plan.transforms.get(source.rpartition("/")[0]) == "transpose":
            want = want.T
        assert state[record.variable_name].numpy().tobytes() == np.ascontiguousarray(want).tobytes(), record.variable_name
    # without ema= the shadows are skipped by name and the raw weights restore, as before
    plain = restorekit.scan(prefix, model, rules="bert-tf-to-hf")
    assert all("ema" not in r.how for r in plain.matched) and len(plain.skipped) == len(values)
