"""The documentation's code blocks run, and its links hold (README.md and docs/).

Every ```python block of README.md and docs/ is preceded by ``<!-- run: NAME -->`` or
``<!-- skip: REASON -->`` (docs/development.md describes the convention). A run block
executes in a fresh directory after the setup ``NAME`` below wrote the files it names
with TensorFlow and Keras themselves; then ``NAME``'s check asserts what the block
promised. A block whose next block is marked ``<!-- output -->`` must print exactly that.
The blocks of one page run in one test, in this process (TensorFlow is imported once).
"""

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from conftest import save_variables

tf1 = tf.compat.v1
ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))
MARKER = re.compile(r"^<!-- (run|skip|output)(?:: (.*?))? -->$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    kind: str | None  # run, skip, output or None
    arg: str
    code: str

    def __str__(self):
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list:
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        marker = MARKER.match(lines[i - 1]) if i else None
        kind, arg = (marker.group(1), marker.group(2) or "") if marker else (None, "")
        found.append(Block(page, i + 1, fence.group(2), kind, arg, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def prose(page: Path) -> str:
    """The page without its fenced code blocks and inline code."""
    text = re.sub(r"^(`{3,}).*?^\1\s*$", "", page.read_text(), flags=re.M | re.S)
    return re.sub(r"`[^`\n]+`", "", text)


def links(page: Path) -> list:
    text = prose(page)
    return re.findall(r"!?\[[^\]\n]*\]\(([^)\s]+)[^)]*\)", text) + re.findall(r"<img[^>]*src=\"([^\"]+)\"", text)


# ------------------------------------------------------------------- setups and checks
# Each setup runs in the block's fresh working directory and returns the names the block
# uses; a TF1 setup puts its graph under "_graph" and the block runs inside it.


def _tf1_net(scope_conv, scope_logits, classes, *, extra=False):
    """Variables of a small conv net in the current graph; returns (loss, step)."""
    images = tf.constant(np.random.RandomState(1).rand(2, 6, 6, 1).astype(np.float32))
    with tf1.variable_scope(scope_conv):
        w = tf1.get_variable("weights", [3, 3, 1, 4])
        b = tf1.get_variable("biases", [4], initializer=tf1.zeros_initializer())
    x = tf.reduce_mean(tf.nn.relu(tf.nn.conv2d(images, w, 1, "SAME") + b), axis=[1, 2])
    if extra:
        with tf1.variable_scope("extra"):
            x = tf.matmul(x, tf1.get_variable("weights", [4, 4])) + tf1.get_variable("biases", [4])
    with tf1.variable_scope(scope_logits):
        logits = tf.matmul(x, tf1.get_variable("weights", [4, classes])) + tf1.get_variable("biases", [classes])
    loss = tf.reduce_mean(tf1.losses.sparse_softmax_cross_entropy([0, 1], logits))
    return loss, tf1.train.get_or_create_global_step()


def _pretrain(prefix, scope_conv, scope_logits, classes, *, steps=1):
    """Train the small net with Momentum and save it (weights, slots, global_step)."""
    with tf.Graph().as_default():
        loss, step = _tf1_net(scope_conv, scope_logits, classes)
        train = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(steps):
                sess.run(train)
            values = {v.op.name: sess.run(v) for v in tf1.global_variables()}
            path = tf1.train.Saver().save(sess, prefix, global_step=step, write_meta_graph=False)
    return path, values


def _value(sess, name):
    (variable,) = [v for v in tf1.global_variables() if v.op.name == name]
    return sess.run(variable)


def setup_scaffold(tmp):
    _, values = _pretrain("pretrained/model.ckpt", "net/conv", "net/logits", 5)
    graph = tf.Graph()
    with graph.as_default():
        loss, step = _tf1_net("net/conv", "net/logits", 3, extra=True)
        tf1.train.AdamOptimizer(1e-3).minimize(loss, global_step=step)
    return {"_graph": graph, "tf": tf, "restorekit": restorekit, "train_dir": "train/", "pretrained": values}


def check_scaffold(ns, out):
    report = ns["scaffold"].restore_report
    assert [r.variable_name for r in report.matched] == ["net/conv/weights", "net/conv/biases"]
    assert {r.variable_name for r in report.missing} == {"extra/weights", "extra/biases"}
    assert {r.variable_name for r in report.shape_mismatched} == {"net/logits/weights", "net/logits/biases"}
    assert out.startswith(f"restorekit: pretrained/model.ckpt-1 -> {report.num_variables} variables\n")
    # The session saved into train_dir on close: the restored backbone is the pretrained one.
    saved = restorekit.Checkpoint("train/")
    np.testing.assert_array_equal(saved.read("net/conv/weights"), ns["pretrained"]["net/conv/weights"])
    assert saved.read("global_step") == 0


def setup_tf1_partial(tmp):
    _, values = _pretrain("pretrained/model.ckpt", "resnet_v1_50/conv1", "resnet_v1_50/logits", 5)
    graph = tf.Graph()
    with graph.as_default():
        _tf1_net("resnet_v1_50/conv1", "resnet_v1_50/logits", 10)
    return {"_graph": graph, "pretrained": values}


def check_tf1_partial(ns, out):
    assert ns["ckpt"].entries["resnet_v1_50/conv1/weights"].shape == (3, 3, 1, 4)
    report = ns["report"]
    assert [r.variable_name for r in report.matched] == ["resnet_v1_50/conv1/weights", "resnet_v1_50/conv1/biases"]
    assert report.is_complete
    with tf1.Session() as sess:
        # uninitialized_initializer after warm_start: warm_start's initializers read the checkpoint.
        sess.run(ns["init"])
        np.testing.assert_array_equal(_value(sess, "resnet_v1_50/conv1/weights"),
                                      ns["pretrained"]["resnet_v1_50/conv1/weights"])
        ns["saver"].restore(sess, report.checkpoint)
    assert ns["scaffold"].restore_report.matched == report.matched


def setup_finetune(tmp):
    graph = tf.Graph()
    with graph.as_default():
        ids = tf.constant([[1, 2], [3, 0]])
        emb = tf1.get_variable("embeddings", [5, 4])
        with tf1.variable_scope("backbone"):
            h = tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), 1)
            for i in range(2):
                with tf1.variable_scope(f"layer_{i}"):
                    h = tf.nn.tanh(tf.matmul(h, tf1.get_variable("kernel", [4, 4])))
        with tf1.variable_scope("head"):
            logits = tf.matmul(h, tf1.get_variable("kernel", [4, 2]))
        loss = tf.reduce_mean(tf1.losses.sparse_softmax_cross_entropy([0, 1], logits))
        step = tf1.train.get_or_create_global_step()
        variables = tf1.trainable_variables()
        grads_and_vars = tf1.train.GradientDescentOptimizer(1.0).compute_gradients(loss, variables)
    return {"_graph": graph, "tf": tf, "keras": tf.keras, "loss": loss, "step": step, "variables": variables,
            "grads_and_vars": grads_and_vars}


def check_finetune(ns, out):
    groups = ns["groups"]
    assert [(g.rule, g.multiplier) for g in groups.groups] == [("backbone/", 0.1), ("head/", 1.0), ("embeddings", 0)]
    names = ["embeddings", "backbone/layer_0/kernel", "head/kernel"]
    with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        before = [_value(sess, n) for n in names]
        sess.run(ns["train_op"])
        after = [_value(sess, n) for n in names]
    np.testing.assert_array_equal(before[0], after[0])  # multiplier 0: frozen
    assert not np.array_equal(before[1], after[1]) and not np.array_equal(before[2], after[2])
    if "rules" in ns:  # layer_1 is the top layer: decay ** 1; layer_0 decay ** 2, the embeddings below it ** 3
        by_name = {name: multiplier for rule, multiplier in ns["rules"].items() for name in
                   ("backbone/layer_1/kernel", "backbone/layer_0/kernel", "embeddings") if re.match(rule, name)
                   or (isinstance(rule, re.Pattern) and rule.search(name))}
        assert by_name == pytest.approx({"backbone/layer_1/kernel": 0.9, "backbone/layer_0/kernel": 0.81,
                                         "embeddings": 0.729})


def make_model(head="head", classes=5):
    """The Keras pages' model: an encoder of 8 -> 16 and a head."""
    import keras

    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(classes, name=head)(keras.layers.Dense(16, name="encoder")(inputs)))


def _keras_pretrained(*, optimizer):
    import keras

    model = make_model(classes=3)
    if optimizer:
        model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
        model.fit(np.ones((4, 8), np.float32), np.array([0, 1, 2, 0]), epochs=1, verbose=0)
    model.save_weights("pretrained.weights.h5")
    model.save("pretrained.keras")
    return model.get_layer("encoder").kernel.numpy()


def setup_keras_read(tmp):
    _keras_pretrained(optimizer=False)
    return {}


def check_keras_read(ns, out):
    assert ns["w"].shape == (8, 16)
    printed = [line.split() for line in out.splitlines()]
    assert printed[0] == "Keras 3 weights file (.weights.h5) ('encoder', 'head')".split()
    documented = [line[2:].split() for line in ns["__code__"].splitlines() if line.startswith("# layers/")]
    assert printed[1:4] == documented


def setup_keras_restore(tmp):
    encoder = _keras_pretrained(optimizer=True)
    return {"model": make_model(head="new_head"), "make_model": make_model, "encoder": encoder}


def check_keras_restore(ns, out):
    np.testing.assert_array_equal(ns["model"].get_layer("encoder").kernel.numpy(), ns["encoder"])
    assert [r.variable_name for r in ns["report"].missing] == ["new_head/kernel", "new_head/bias"]


def setup_keras_fit(tmp):
    import keras

    _keras_pretrained(optimizer=True)
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    data = tf.data.Dataset.from_tensor_slices((np.ones((4, 8), np.float32), np.array([0, 1, 2, 3]))).batch(4)
    return {"model": model, "data": data, "keras": keras}


def check_keras_fit(ns, out):
    assert out.count("restorekit: warm-started from 'pretrained.weights.h5' (2 of 4 variables restored)") == 1
    assert ns["model"].optimizer.iterations.numpy() == 10  # 10 epochs of one batch ran after the warm start
    assert not os.path.exists("backup")  # BackupAndRestore removes its backup after a finished fit


def setup_keras_loop(tmp):
    import keras

    _keras_pretrained(optimizer=False)
    return {"make_model": make_model, "keras": keras, "tf": tf}


def check_keras_loop(ns, out):
    comment = next(line for line in ns["__code__"].splitlines() if line.startswith("print(start)"))
    assert out.strip() == comment.split("# ", 1)[1].strip()
    assert not ns["start"].resumed and len(ns["start"].report.matched) == 2


def setup_tf2(tmp):
    import keras

    def model_of(vocab_size, units):
        inputs = keras.Input((2,), dtype="int32")
        x = keras.layers.Flatten()(keras.layers.Embedding(vocab_size, 3, name="embedding")(inputs))
        return keras.Model(inputs, keras.layers.Dense(units, name="dense_1")(x))

    old = model_of(3, 4)
    tf.train.CheckpointManager(tf.train.Checkpoint(model=old), "tf2_ckpt", max_to_keep=1).save()
    values = {"embedding/embeddings": old.get_layer("embedding").embeddings.numpy(),
              "dense_1/kernel": old.get_layer("dense_1").kernel.numpy()}
    save_variables("slim_ckpt/model.ckpt", {"dense/weights": np.full((6, 4), 0.5, np.float32),
                                            "dense/biases": np.full((4,), 0.25, np.float32)})
    Path("old_vocab.txt").write_text("a\nb\nc\n")
    Path("new_vocab.txt").write_text("c\na\nb\n")
    return {"model": model_of(4, 4), "values": values}  # the new vocabulary plus 1 OOV bucket


def check_tf2(ns, out):
    assert ns["ckpt"].object_paths["dense_1/kernel"].endswith("/.ATTRIBUTES/VARIABLE_VALUE")
    # restore() ran after the first scan: dense_1 is the checkpoint's, the embedding (3 rows, not 4) is not.
    model, values = ns["model"], ns["values"]
    np.testing.assert_array_equal(model.get_layer("dense_1").kernel.numpy(), values["dense_1/kernel"])
    vocab = ns["report"]
    (record,) = [r for r in vocab.matched if r.variable_name.endswith("embedding/embeddings")]
    assert "vocab" in record.reason


def setup_surgery(tmp):
    rng = np.random.RandomState(0)
    values = {
        "bert/encoder/layer_0/kernel": rng.randn(4, 4).astype(np.float32),
        "bert/encoder/layer_0/kernel/Adam": rng.randn(4, 4).astype(np.float32),
        "cls/bias": rng.randn(2).astype(np.float32),
        "embeddings": rng.randn(8, 3).astype(np.float32),
        "a": rng.randn(2, 3).astype(np.float32),
        "b": rng.randn(1, 3).astype(np.float32),
        "old/x": rng.randn(3).astype(np.float32),
    }
    save_variables("ckpt/model.ckpt-1000", values)
    return {"np": np, "values": values}


def check_surgery(ns, out):
    import ml_dtypes

    values, out_ckpt = ns["values"], restorekit.Checkpoint("out/model.ckpt")
    names = set(out_ckpt.entries)
    assert "encoder/encoder/layer_0/kernel" in names and not any("bert" in n or "Adam" in n for n in names)
    assert {out_ckpt.entries[n].dtype for n in names} == {"bfloat16"}
    np.testing.assert_array_equal(out_ckpt.read("encoder/encoder/layer_0/kernel"),
                                  values["bert/encoder/layer_0/kernel"].astype(ml_dtypes.bfloat16))
    if "ab" in names:  # the docs' longer block
        assert "old/x" not in names and "new/var" in names
        np.testing.assert_array_equal(out_ckpt.read("cls/bias"), np.zeros(2, ml_dtypes.bfloat16))
        emb = out_ckpt.read("embeddings")
        np.testing.assert_array_equal(emb[[5, 6]], emb[[0, 1]])
        assert out_ckpt.entries["ab"].shape == (3, 3)
        assert restorekit.Checkpoint("ckpt/model.ckpt-1000").entries.keys() == out_ckpt.entries.keys()  # in place


def setup_convert(tmp):
    rng = np.random.RandomState(0)
    kernel = rng.randn(4, 3).astype(np.float32)
    values = {"dense/kernel": kernel, "dense/bias": rng.randn(3).astype(np.float32),
              "dense/kernel/ExponentialMovingAverage": kernel + 1,
              "dense/bias/ExponentialMovingAverage": np.ones(3, np.float32), "global_step": np.int64(5)}
    save_variables("ckpt/model.ckpt", values)
    return {"values": values}


def check_convert(ns, out):
    from safetensors.numpy import load_file

    values = ns["values"]
    torch_names = load_file("model.safetensors")
    np.testing.assert_array_equal(torch_names["dense.weight"], values["dense/kernel"].T)  # nn.Linear layout
    back = restorekit.Checkpoint("back/model.ckpt")
    for name, value in values.items():
        np.testing.assert_array_equal(back.read(name), value)
    if os.path.exists("ema.safetensors"):
        np.testing.assert_array_equal(load_file("ema.safetensors")["dense/kernel"], values["dense/kernel"] + 1)
        assert os.listdir("shards") == ["model.safetensors"]  # one file: it fits in 2GB
        tf_again = restorekit.Checkpoint("tf/model.ckpt")
        np.testing.assert_array_equal(tf_again.read("dense/kernel"), values["dense/kernel"])


def _tf1_graph_files(ckpt_prefix, meta, output):
    """A dense net with a placeholder input, saved as a checkpoint and a .meta; returns inputs and outputs."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 8], name="images")
        h = tf.nn.relu(tf.matmul(x, tf1.get_variable("fc/weights", [8, 16])) + tf1.get_variable("fc/biases", [16]))
        logits = tf.matmul(h, tf1.get_variable("out/weights", [16, 4]))
        y = tf.nn.softmax(logits, name=output) if output != "logits" else tf.identity(logits, name="logits")
        sample = np.random.RandomState(2).rand(3, 8).astype(np.float32)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            expected = sess.run(y, {x: sample})
            tf1.train.Saver().save(sess, ckpt_prefix, write_meta_graph=False)
        tf1.train.export_meta_graph(meta)
    return sample, expected


def setup_graphs(tmp):
    sample, expected = _tf1_graph_files("ckpt/model.ckpt", "model.meta", "logits")
    return {"sample": sample, "expected": expected}


def check_graphs(ns, out):
    result = ns["result"]
    assert sorted(restorekit.Checkpoint(result.checkpoint).entries) == ["fc/biases", "fc/weights", "out/weights"]
    with tf.Graph().as_default(), tf1.Session() as sess:
        saver = tf1.train.import_meta_graph(result.meta_graph)
        saver.restore(sess, result.checkpoint)
        got = sess.run("logits:0", {"images:0": ns["sample"]})
    np.testing.assert_allclose(got, ns["expected"], rtol=1e-6)
    if "summary" in ns:
        assert "logits" in [o.name.split(":")[0] for o in ns["summary"].outputs]


def setup_deploy(tmp):
    os.makedirs("train")
    _tf1_graph_files("train/model.ckpt-30", "eval.meta", "probs")
    return {"calibration_images": np.random.RandomState(3).rand(100, 8).astype(np.float32)}


def setup_deploy_frozen(tmp):
    ns = setup_deploy(tmp)
    restorekit.freeze("train/model.ckpt-30", "eval.meta", ["probs"], out="frozen.pb")
    return ns


def check_deploy(ns, out):
    as_dict = ns["result"].to_dict()
    assert as_dict["precision"] == "int8" and os.path.getsize("model.tflite") > 0
    assert as_dict["outputs"] == ["probs:0"] and 0 < as_dict["max_abs_error"]["probs:0"] <= 0.05
    assert out.startswith("restorekit: frozen.pb -> model.tflite (tflite int8, 100 representative samples)")


def check_deploy_onnx(ns, out):
    result = ns["result"]
    assert result.backend == "tensorrt" and result.precision == "int8" and os.path.getsize("model.onnx") > 0
    assert 0 < result.max_abs_error["probs:0"] <= 0.05 and not os.path.exists("model.plan")
    assert "trtexec --onnx=model.onnx --saveEngine=model.plan" in out


def _two_sources():
    """bert/model.ckpt (TF1 Saver: an encoder and a decoder) and gpt2.safetensors (restorekit-converted: a decoder)."""
    rng = np.random.RandomState(0)
    shapes = {"encoder/kernel": (4, 3), "encoder/bias": (3,), "decoder/kernel": (3, 2), "decoder/bias": (2,)}
    bert = {name: rng.randn(*shape).astype(np.float32) for name, shape in shapes.items()}
    gpt2 = {name: rng.randn(*shape).astype(np.float32) for name, shape in shapes.items() if name.startswith("decoder")}
    save_variables("bert/model.ckpt", bert)
    restorekit.convert(save_variables("gpt2_tf/model.ckpt", gpt2), "gpt2.safetensors")
    return {**bert, **gpt2}, bert


def setup_sources_tf1(tmp):
    expected, bert = _two_sources()
    graph = tf.Graph()
    with graph.as_default():
        for scope, shape in (("encoder", (4, 3)), ("decoder", (3, 2)), ("head", (2, 5))):
            with tf1.variable_scope(scope):
                tf1.get_variable("kernel", shape)
                tf1.get_variable("bias", shape[1:], initializer=tf1.zeros_initializer())
        tf1.train.get_or_create_global_step()
    return {"_graph": graph, "tf": tf, "expected": expected, "bert": bert}


def check_sources_tf1(ns, out):
    assert "from bert/model.ckpt: 2 matched" in out and "from gpt2.safetensors: 2 matched" in out
    for name, value in ns["expected"].items():
        np.testing.assert_array_equal(ns["values"][name], value, err_msg=name)
    # the list: the first source holding an entry wins (the decoder from bert, listed first)
    assert {r.variable_name: r.source for r in ns["report"].matched}["decoder/kernel"] == "bert/model.ckpt"


def setup_sources_keras(tmp):
    import keras

    expected, _ = _two_sources()

    def model():
        inputs = keras.Input((4,))
        x = keras.layers.Dense(2, name="decoder")(keras.layers.Dense(3, name="encoder")(inputs))
        return keras.Model(inputs, keras.layers.Dense(5, name="head")(x))

    donor = model()
    donor.save_weights("decoder.weights.h5")
    expected.update({"decoder/kernel": donor.get_layer("decoder").kernel.numpy(),
                     "decoder/bias": donor.get_layer("decoder").bias.numpy()})
    return {"model": model(), "expected": expected}


def check_sources_keras(ns, out):
    weights = {v.path: v.numpy() for v in ns["model"].weights}
    for name, value in ns["expected"].items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    assert ns["report"].sources == ("bert/model.ckpt", "decoder.weights.h5")


SETUPS = {
    "sources-tf1": (setup_sources_tf1, check_sources_tf1),
    "sources-keras": (setup_sources_keras, check_sources_keras),
    "scaffold": (setup_scaffold, check_scaffold),
    "tf1-partial": (setup_tf1_partial, check_tf1_partial),
    "finetune": (setup_finetune, check_finetune),
    "tf2": (setup_tf2, check_tf2),
    "keras-read": (setup_keras_read, check_keras_read),
    "keras-restore": (setup_keras_restore, check_keras_restore),
    "keras-fit": (setup_keras_fit, check_keras_fit),
    "keras-loop": (setup_keras_loop, check_keras_loop),
    "surgery": (setup_surgery, check_surgery),
    "convert": (setup_convert, check_convert),
    "graphs": (setup_graphs, check_graphs),
    "deploy": (setup_deploy, check_deploy),
    "deploy-frozen": (setup_deploy_frozen, check_deploy),
    "deploy-onnx": (setup_deploy_frozen, check_deploy_onnx),
}


# ------------------------------------------------------------------- the tests


def test_every_python_block_is_run_or_skipped_with_a_reason():
    python = [b for b in ALL_BLOCKS if b.lang == "python"]
    assert len(python) >= 15
    unmarked = [str(b) for b in python if b.kind not in ("run", "skip") or not b.arg]
    assert unmarked == [], "python blocks need <!-- run: NAME --> or <!-- skip: REASON --> on the line before"
    unknown = [f"{b}: {b.arg}" for b in python if b.kind == "run" and b.arg not in SETUPS]
    assert unknown == []
    used = {b.arg for b in python if b.kind == "run"}
    assert used == set(SETUPS), f"setups no block uses: {sorted(set(SETUPS) - used)}"


RUN_PAGES = sorted({b.page for b in ALL_BLOCKS if b.kind == "run"})


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_the_pages_code_blocks_do_what_they_say(page, tmp_path, monkeypatch):
    import keras

    page_blocks = blocks(page)
    for i, block in enumerate(page_blocks):
        if block.kind != "run":
            continue
        setup, check = SETUPS[block.arg]
        directory = tmp_path / f"line{block.line}"
        directory.mkdir()
        monkeypatch.chdir(directory)
        keras.utils.clear_session()
        ns = setup(directory)
        graph = ns.pop("_graph", None)
        ns.setdefault("restorekit", restorekit)
        ns["__code__"] = block.code
        printed = io.StringIO()
        with graph.as_default() if graph is not None else contextlib.nullcontext():
            with contextlib.redirect_stdout(printed):
                exec(compile(block.code, str(block), "exec"), ns)
            check(ns, printed.getvalue())
        following = page_blocks[i + 1] if i + 1 < len(page_blocks) else None
        if following is not None and following.kind == "output":
            assert printed.getvalue() == following.code, f"{block} printed other text than {following}"


def test_relative_links_in_the_docs_resolve():
    broken = []
    for page in PAGES[1:]:
        for target in links(page):
            if re.match(r"^[a-z]+:|^#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_readme_has_no_relative_links_or_images():
    # README.md is the package index page, where relative links and images break.
    readme = ROOT / "README.md"
    relative = [t for t in links(readme) if not t.startswith(("https://", "http://"))]
    assert relative == []
    assert "![" not in prose(readme) and "<img" not in prose(readme)


def test_every_docs_page_is_in_the_nav():
    nav = set(re.findall(r":\s+(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    pages = {str(p.relative_to(DOCS)) for p in PAGES[1:]}
    assert pages == nav
