"""restorekit.export._hf: BERT and GPT-2 TF checkpoints <-> Hugging Face models, loaded with from_pretrained."""

import json
import os
import re

import numpy as np
import pytest
import transformers  # in the [test] extra: a missing one is a broken setup, not a skip

from conftest import requires_torch, save_variables
from restorekit._checkpoint import Checkpoint
from restorekit.cli import main
from restorekit.edit import CheckpointEditor
from restorekit.errors import InvalidArgumentError, NameCollisionError, RestoreKitWarning
from restorekit.export import convert, export_checkpoint, import_checkpoint
from restorekit.export._hf import RULE_SETS, RuleSet, Rule, rule_set


VOCAB, HIDDEN, LAYERS, INNER, POSITIONS = 30, 16, 2, 32, 12


def bert_values(*, head=True, optimizer=True, seed=0):
    """Every variable of a google-research BERT checkpoint (run_pretraining.py), tiny."""
    rng = np.random.RandomState(seed)

    def r(*shape):
        return rng.randn(*shape).astype(np.float32)

    v = {
        "bert/embeddings/word_embeddings": r(VOCAB, HIDDEN),
        "bert/embeddings/position_embeddings": r(POSITIONS, HIDDEN),
        "bert/embeddings/token_type_embeddings": r(2, HIDDEN),
        "bert/embeddings/LayerNorm/gamma": r(HIDDEN),
        "bert/embeddings/LayerNorm/beta": r(HIDDEN),
    }
    for i in range(LAYERS):
        p = f"bert/encoder/layer_{i}/"
        for part in ("query", "key", "value"):
            v[p + f"attention/self/{part}/kernel"] = r(HIDDEN, HIDDEN)
            v[p + f"attention/self/{part}/bias"] = r(HIDDEN)
        v[p + "attention/output/dense/kernel"] = r(HIDDEN, HIDDEN)
        v[p + "attention/output/dense/bias"] = r(HIDDEN)
        v[p + "attention/output/LayerNorm/gamma"] = r(HIDDEN)
        v[p + "attention/output/LayerNorm/beta"] = r(HIDDEN)
        v[p + "intermediate/dense/kernel"] = r(HIDDEN, INNER)
        v[p + "intermediate/dense/bias"] = r(INNER)
        v[p + "output/dense/kernel"] = r(INNER, HIDDEN)
        v[p + "output/dense/bias"] = r(HIDDEN)
        v[p + "output/LayerNorm/gamma"] = r(HIDDEN)
        v[p + "output/LayerNorm/beta"] = r(HIDDEN)
    v["bert/pooler/dense/kernel"] = r(HIDDEN, HIDDEN)
    v["bert/pooler/dense/bias"] = r(HIDDEN)
    if head:
        v["cls/predictions/transform/dense/kernel"] = r(HIDDEN, HIDDEN)
        v["cls/predictions/transform/dense/bias"] = r(HIDDEN)
        v["cls/predictions/transform/LayerNorm/gamma"] = r(HIDDEN)
        v["cls/predictions/transform/LayerNorm/beta"] = r(HIDDEN)
        v["cls/predictions/output_bias"] = r(VOCAB)
        v["cls/seq_relationship/output_weights"] = r(2, HIDDEN)
        v["cls/seq_relationship/output_bias"] = r(2)
    if optimizer:  # what run_pretraining.py's AdamWeightDecayOptimizer saves beside the weights
        for name in list(v):
            v[name + "/adam_m"] = r(*v[name].shape)
            v[name + "/adam_v"] = r(*v[name].shape)
        v["global_step"] = np.int64(1000)
    return v


def gpt2_values(seed=0):
    """Every variable of an OpenAI GPT-2 TF checkpoint (gpt-2/src/model.py), tiny."""
    rng = np.random.RandomState(seed)

    def r(*shape):
        return rng.randn(*shape).astype(np.float32)

    v = {"model/wte": r(VOCAB, HIDDEN), "model/wpe": r(POSITIONS, HIDDEN)}
    for i in range(LAYERS):
        p = f"model/h{i}/"
        v[p + "ln_1/g"], v[p + "ln_1/b"] = r(HIDDEN), r(HIDDEN)
        v[p + "attn/c_attn/w"], v[p + "attn/c_attn/b"] = r(1, HIDDEN, 3 * HIDDEN), r(3 * HIDDEN)
        v[p + "attn/c_proj/w"], v[p + "attn/c_proj/b"] = r(1, HIDDEN, HIDDEN), r(HIDDEN)
        v[p + "ln_2/g"], v[p + "ln_2/b"] = r(HIDDEN), r(HIDDEN)
        v[p + "mlp/c_fc/w"], v[p + "mlp/c_fc/b"] = r(1, HIDDEN, 4 * HIDDEN), r(4 * HIDDEN)
        v[p + "mlp/c_proj/w"], v[p + "mlp/c_proj/b"] = r(1, 4 * HIDDEN, HIDDEN), r(HIDDEN)
    v["model/ln_f/g"], v["model/ln_f/b"] = r(HIDDEN), r(HIDDEN)
    return v


@pytest.fixture(scope="module")
def bert_ckpt(tmp_path_factory):
    values = bert_values()
    return save_variables(tmp_path_factory.mktemp("bert") / "bert_model.ckpt", values), values


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    values = gpt2_values()
    return save_variables(tmp_path_factory.mktemp("gpt2") / "model.ckpt", values), values


def load(cls, directory):
    model, info = cls.from_pretrained(str(directory), output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if v} == {}, info
    return model


def bert_tf_value(values, hf_name):
    """The TF value an HF BERT parameter must equal, under the documented transform."""
    name = hf_name.removeprefix("bert.")
    table = {
        "cls.predictions.bias": "cls/predictions/output_bias",
        "cls.predictions.decoder.bias": "cls/predictions/output_bias",
        "cls.predictions.decoder.weight": "bert/embeddings/word_embeddings",
        "cls.seq_relationship.weight": "cls/seq_relationship/output_weights",
        "cls.seq_relationship.bias": "cls/seq_relationship/output_bias",
    }
    if name in table:
        return values[table[name]]
    tf_name = ("" if name.startswith("cls.") else "bert/") + re.sub(r"layer\.(\d+)\.", r"layer_\1.", name).replace(".", "/")
    if tf_name.endswith("_embeddings/weight"):
        return values[tf_name[: -len("/weight")]]
    if "LayerNorm" in tf_name:
        return values[tf_name.replace("/weight", "/gamma").replace("/bias", "/beta")]
    if tf_name.endswith("/weight"):
        return values[tf_name[: -len("/weight")] + "/kernel"].T
    return values[tf_name]


@requires_torch  # transformers' PyTorch models
def test_bert_tf_checkpoint_loads_into_bert_for_pretraining_with_nothing_missing(bert_ckpt, tmp_path):
    prefix, values = bert_ckpt
    out = tmp_path / "hf"
    result = convert(prefix, out / "model.safetensors", rules="bert-tf-to-hf", weights_only=True,
                     config={"num_attention_heads": 2})
    assert result.renamed == "bert-tf-to-hf"
    assert "global_step" in result.dropped and "bert/pooler/dense/kernel/adam_m" in result.dropped
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"],
            config["max_position_embeddings"], config["type_vocab_size"], config["num_attention_heads"]) == (
        VOCAB, HIDDEN, LAYERS, INNER, POSITIONS, 2, 2)
    model = load(transformers.BertForPreTraining, out)
    state = model.state_dict()
    weights = [n for n in values if "adam_" not in n and n != "global_step"]
    assert len(state) == len(weights) + 2  # + the decoder's weight and bias, tied to two of them
    for name, tensor in state.items():
        np.testing.assert_array_equal(tensor.numpy(), bert_tf_value(values, name), err_msg=name)
    # BertModel (no head) loads the same file: the cls.* tensors are the only ones it does not use.
    base, info = transformers.BertModel.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    for name, tensor in base.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), bert_tf_value(values, name), err_msg=name)


@requires_torch  # transformers' PyTorch models
def test_bert_without_head_loads_into_bert_model_with_nothing_missing_or_unexpected(tmp_path):
    values = bert_values(head=False, optimizer=False, seed=1)
    prefix = save_variables(tmp_path / "ckpt" / "model.ckpt", values)
    convert(prefix, tmp_path / "hf" / "model.safetensors", rules="bert-tf-to-hf", config={"num_attention_heads": 4})
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BertModel"]
    model = load(transformers.BertModel, tmp_path / "hf")
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), bert_tf_value(values, name), err_msg=name)


@requires_torch  # transformers' PyTorch models
def test_a_fine_tuned_classifier_head_becomes_bert_for_sequence_classification(tmp_path):
    values = bert_values(head=False, optimizer=False, seed=2)
    values["output_weights"] = np.arange(3 * HIDDEN, dtype=np.float32).reshape(3, HIDDEN)
    values["output_bias"] = np.arange(3, dtype=np.float32)
    prefix = save_variables(tmp_path / "ckpt" / "model.ckpt", values)
    convert(prefix, tmp_path / "hf" / "model.safetensors", rules="bert-tf-to-hf", config={"num_attention_heads": 2})
    model = load(transformers.BertForSequenceClassification, tmp_path / "hf")
    np.testing.assert_array_equal(model.classifier.weight.detach().numpy(), values["output_weights"])
    np.testing.assert_array_equal(model.classifier.bias.detach().numpy(), values["output_bias"])
    assert model.config.num_labels == 3


def test_optimizer_state_without_weights_only_is_refused_and_nothing_is_written(bert_ckpt, tmp_path):
    prefix, _ = bert_ckpt
    with pytest.raises(InvalidArgumentError, match="weights_only=True"):
        convert(prefix, tmp_path / "hf" / "model.safetensors", rules="bert-tf-to-hf")
    assert not (tmp_path / "hf").exists() or os.listdir(tmp_path / "hf") == []


@requires_torch  # transformers' PyTorch models
def test_bert_round_trip_through_hugging_face_restores_every_tf_value(bert_ckpt, tmp_path):
    prefix, values = bert_ckpt
    convert(prefix, tmp_path / "hf" / "model.safetensors", rules="bert-tf-to-hf", weights_only=True,
            config={"num_attention_heads": 2})
    # save_pretrained's own file too (tied decoder weights, transformers' names and order)
    model = load(transformers.BertForPreTraining, tmp_path / "hf")
    model.save_pretrained(str(tmp_path / "saved"))
    for source in (tmp_path / "hf" / "model.safetensors", tmp_path / "saved"):
        back = str(tmp_path / f"back-{os.path.basename(source)}" / "model.ckpt")
        result = convert(source, back, rules="bert-hf-to-tf")
        ckpt = Checkpoint(back)
        weights = {n: v for n, v in values.items() if "adam_" not in n and n != "global_step"}
        assert set(ckpt.entries) == set(weights)
        for name, value in weights.items():
            np.testing.assert_array_equal(ckpt.read(name), value, err_msg=name)
    assert all(n.startswith("cls.predictions.decoder") for n in result.dropped)


@requires_torch  # transformers' PyTorch models
def test_gpt2_tf_checkpoint_loads_into_gpt2_lm_head_model_and_gpt2_model(gpt2_ckpt, tmp_path):
    prefix, values = gpt2_ckpt
    convert(prefix, tmp_path / "hf" / "model.safetensors", rules="gpt2-tf-to-hf", config={"n_head": 2})
    for cls in (transformers.GPT2LMHeadModel, transformers.GPT2Model):
        model = load(cls, tmp_path / "hf")
        for name, tensor in model.state_dict().items():
            np.testing.assert_array_equal(tensor.numpy(), gpt2_tf_value(values, name), err_msg=name)


def gpt2_tf_value(values, hf_name):
    name = hf_name.removeprefix("transformer.")
    if name == "lm_head.weight":
        return values["model/wte"]
    tf_name = "model/" + re.sub(r"^h\.(\d+)\.", r"h\1.", name).replace(".", "/")
    tf_name = tf_name.replace("/weight", "/w" if "/c_" in tf_name else "/g")
    tf_name = tf_name.replace("/bias", "/b")
    if tf_name in ("model/wte/g", "model/wpe/g"):
        return values[tf_name[:-2]]
    value = values[tf_name]
    return value[0] if value.ndim == 3 else value  # Conv1D keeps [in, out]: squeezed, not transposed


@requires_torch  # transformers' PyTorch models
def test_gpt2_forward_pass_matches_a_numpy_gpt2_on_the_tf_values(gpt2_ckpt, tmp_path):
    import torch

    prefix, values = gpt2_ckpt
    convert(prefix, tmp_path / "hf" / "model.safetensors", rules="gpt2-tf-to-hf", config={"n_head": 2})
    model = load(transformers.GPT2LMHeadModel, tmp_path / "hf").eval()
    tokens = np.array([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        got = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(got, numpy_gpt2(values, tokens[0], heads=2)[None], rtol=1e-4, atol=1e-4)


def numpy_gpt2(v, tokens, heads):
    """OpenAI's gpt-2/src/model.py, in numpy, on the TF checkpoint's own tensors."""
    def norm(x, g, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * g + b

    def conv1d(x, w, b):
        return x @ w[0] + b

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    n = len(tokens)
    x = v["model/wte"][tokens] + v["model/wpe"][:n]
    mask = np.tril(np.ones((n, n), bool))
    for i in range(LAYERS):
        p = f"model/h{i}/"
        h = norm(x, v[p + "ln_1/g"], v[p + "ln_1/b"])
        q, k, val = np.split(conv1d(h, v[p + "attn/c_attn/w"], v[p + "attn/c_attn/b"]), 3, axis=-1)
        split = [t.reshape(n, heads, -1).transpose(1, 0, 2) for t in (q, k, val)]
        scores = split[0] @ split[1].transpose(0, 2, 1) / np.sqrt(split[0].shape[-1])
        scores = np.where(mask, scores, -1e10)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        a = (weights @ split[2]).transpose(1, 0, 2).reshape(n, -1)
        x = x + conv1d(a, v[p + "attn/c_proj/w"], v[p + "attn/c_proj/b"])
        h = norm(x, v[p + "ln_2/g"], v[p + "ln_2/b"])
        x = x + conv1d(gelu(conv1d(h, v[p + "mlp/c_fc/w"], v[p + "mlp/c_fc/b"])), v[p + "mlp/c_proj/w"],
                       v[p + "mlp/c_proj/b"])
    x = norm(x, v["model/ln_f/g"], v["model/ln_f/b"])
    return x @ v["model/wte"].T


@requires_torch  # transformers' PyTorch models
def test_gpt2_round_trip_through_save_pretrained_restores_every_tf_value(gpt2_ckpt, tmp_path):
    prefix, values = gpt2_ckpt
    convert(prefix, tmp_path / "hf" / "model.safetensors", rules="gpt2-tf-to-hf", config={"n_head": 2})
    load(transformers.GPT2LMHeadModel, tmp_path / "hf").save_pretrained(str(tmp_path / "saved"))
    result = convert(tmp_path / "saved", tmp_path / "back" / "model.ckpt", rules="gpt2-hf-to-tf")
    ckpt = Checkpoint(str(tmp_path / "back" / "model.ckpt"))
    assert set(ckpt.entries) == set(values)
    for name, value in values.items():
        np.testing.assert_array_equal(ckpt.read(name), value, err_msg=name)
    assert result.dropped == ()  # save_pretrained leaves the tied lm_head out itself
    # A full GPT2LMHeadModel state_dict (lm_head included, transformer.-prefixed) reads too.
    from safetensors.torch import save_file

    state = {k: v.clone().contiguous() for k, v in load(transformers.GPT2LMHeadModel, tmp_path / "hf").state_dict().items()}
    assert "lm_head.weight" in state
    save_file(state, str(tmp_path / "full.safetensors"), metadata={"format": "pt"})
    result = convert(tmp_path / "full.safetensors", tmp_path / "back2" / "model.ckpt", rules="gpt2-hf-to-tf")
    assert result.dropped == ("lm_head.weight",)
    assert set(Checkpoint(str(tmp_path / "back2" / "model.ckpt")).entries) == set(values)


@requires_torch  # transformers' PyTorch models
def test_heads_default_to_64_wide_and_a_warning_says_so(tmp_path):
    hidden = 128
    rng = np.random.RandomState(0)
    values = {"model/wte": rng.randn(VOCAB, hidden).astype(np.float32),
              "model/wpe": rng.randn(POSITIONS, hidden).astype(np.float32)}
    p = "model/h0/"
    for name, shape in (("ln_1/g", (hidden,)), ("ln_1/b", (hidden,)), ("attn/c_attn/w", (1, hidden, 3 * hidden)),
                        ("attn/c_attn/b", (3 * hidden,)), ("attn/c_proj/w", (1, hidden, hidden)),
                        ("attn/c_proj/b", (hidden,)), ("ln_2/g", (hidden,)), ("ln_2/b", (hidden,)),
                        ("mlp/c_fc/w", (1, hidden, 4 * hidden)), ("mlp/c_fc/b", (4 * hidden,)),
                        ("mlp/c_proj/w", (1, 4 * hidden, hidden)), ("mlp/c_proj/b", (hidden,))):
        values[p + name] = rng.randn(*shape).astype(np.float32)
    values["model/ln_f/g"] = values["model/ln_f/b"] = np.ones(hidden, np.float32)
    prefix = save_variables(tmp_path / "ckpt" / "model.ckpt", values)
    with pytest.warns(RestoreKitWarning, match=r"n_head=2 assumed"):
        result = convert(prefix, tmp_path / "hf" / "model.safetensors", rules="gpt2-tf-to-hf", config=True)
    assert str(tmp_path / "hf" / "config.json") in result.files
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["n_head"], config["n_layer"], config["n_embd"], config["n_positions"]) == (2, 1, hidden, POSITIONS)
    load(transformers.GPT2LMHeadModel, tmp_path / "hf")


def test_a_hidden_size_that_is_not_64_wide_heads_needs_heads_given(gpt2_ckpt, tmp_path):
    prefix, _ = gpt2_ckpt
    with pytest.raises(InvalidArgumentError, match="heads"):
        convert(prefix, tmp_path / "hf" / "model.safetensors", rules="gpt2-tf-to-hf", config=True)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


@requires_torch  # transformers' PyTorch models
def test_cli_convert_with_rules_weights_only_and_config(bert_ckpt, tmp_path, capsys):
    prefix, values = bert_ckpt
    out = tmp_path / "hf" / "model.safetensors"
    assert main(["convert", prefix, str(out), "--rules", "bert-tf-to-hf", "--weights-only", "--config",
                 "--heads", "2"]) == 0
    assert "bert-tf-to-hf" in capsys.readouterr().out
    load(transformers.BertForPreTraining, tmp_path / "hf")
    assert main(["convert", str(out), str(tmp_path / "back" / "model.ckpt"), "--rules", "bert-hf-to-tf"]) == 0
    np.testing.assert_array_equal(Checkpoint(str(tmp_path / "back" / "model.ckpt")).read(
        "bert/encoder/layer_1/output/dense/kernel"), values["bert/encoder/layer_1/output/dense/kernel"])


def test_cli_refuses_an_unknown_rule_set(bert_ckpt, tmp_path, capsys):
    prefix, _ = bert_ckpt
    assert main(["convert", prefix, str(tmp_path / "m.safetensors"), "--rules", "bert-to-nowhere"]) != 0
    assert "gpt2-tf-to-hf" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()


@requires_torch  # transformers' PyTorch models
def test_editor_rename_all_takes_a_rule_set_with_its_transforms(gpt2_ckpt, tmp_path):
    prefix, values = gpt2_ckpt
    ed = CheckpointEditor(prefix)
    changed = ed.rename_all("gpt2-tf-to-hf")
    assert changed["model/h1/attn/c_attn/w"] == "h.1.attn.c_attn.weight"
    np.testing.assert_array_equal(ed.get("h.1.attn.c_attn.weight"), values["model/h1/attn/c_attn/w"][0])
    ed.save(tmp_path / "hf" / "model.safetensors", format="safetensors")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": 2,
         "n_positions": POSITIONS}))
    load(transformers.GPT2Model, tmp_path / "hf")


def test_editor_rename_all_with_a_rule_set_refuses_uncovered_names_and_changes_nothing(bert_ckpt):
    prefix, _ = bert_ckpt
    ed = CheckpointEditor(prefix)
    with pytest.raises(InvalidArgumentError, match="adam_m"):
        ed.rename_all(RULE_SETS["bert-tf-to-hf"])
    assert "global_step" in [e.name for e in ed.list()]
    ed.strip_optimizer_slots()
    ed.delete("global_step")
    ed.rename_all("bert-tf-to-hf")
    assert ed.get("bert.encoder.layer.0.attention.self.query.weight").shape == (HIDDEN, HIDDEN)


def test_rule_sets_are_registered_both_ways_and_a_bad_transform_shape_is_refused(tmp_path):
    assert {"bert-tf-to-hf", "bert-hf-to-tf", "gpt2-tf-to-hf", "gpt2-hf-to-tf"} <= set(RULE_SETS)
    with pytest.raises(InvalidArgumentError, match="unknown rule set"):
        rule_set("nope")
    prefix = save_variables(tmp_path / "c" / "m.ckpt", {"model/h0/attn/c_attn/w": np.zeros((2, 3, 4), np.float32)})
    with pytest.raises(InvalidArgumentError, match="leading axis of 1"):
        export_checkpoint(prefix, tmp_path / "o.safetensors", rules="gpt2-tf-to-hf")
    assert not (tmp_path / "o.safetensors").exists()


def test_a_custom_rule_set_and_collisions(tmp_path):
    prefix = save_variables(tmp_path / "c" / "m.ckpt", {"a/kernel": np.ones((2, 3), np.float32),
                                                          "b/kernel": np.ones((2, 3), np.float32)})
    mine = RuleSet("mine", "test", (Rule(r"(a|b)/kernel", r"x.weight", "transpose"),))
    with pytest.raises(NameCollisionError):
        export_checkpoint(prefix, tmp_path / "o.safetensors", rules=mine)
    mine = RuleSet("mine", "test", (Rule(r"(a|b)/kernel", r"\1.weight", "transpose"),))
    result = export_checkpoint(prefix, tmp_path / "o.safetensors", rules=mine)
    assert result.renamed == "mine"
    back = import_checkpoint(tmp_path / "o.safetensors", tmp_path / "b" / "m.ckpt")
    assert back.count == 2 and Checkpoint(str(tmp_path / "b" / "m.ckpt")).entries["a.weight"].shape == (3, 2)


def test_layout_torch_with_rules_that_write_pytorch_names_is_the_same_conversion(bert_ckpt, tmp_path):
    prefix, _ = bert_ckpt
    convert(prefix, tmp_path / "plain.safetensors", rules="bert-tf-to-hf", weights_only=True)
    convert(prefix, tmp_path / "torch.safetensors", rules="bert-tf-to-hf", layout="torch", weights_only=True)
    assert (tmp_path / "plain.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
    from restorekit.cli import main

    assert main(["convert", str(prefix), str(tmp_path / "cli.safetensors"), "--to", "safetensors", "--layout", "torch",
                 "--rules", "bert-tf-to-hf", "--weights-only"]) == 0
    assert (tmp_path / "cli.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()


def test_layout_torch_with_rules_that_write_tf_names_is_refused(bert_ckpt, tmp_path):
    prefix, _ = bert_ckpt
    mine = RuleSet("mine", "test", (Rule(r"(.*)", r"\1", None),))
    with pytest.raises(InvalidArgumentError, match="leave layout=None"):
        convert(prefix, tmp_path / "m.safetensors", rules=mine, layout="torch")
    assert [p.name for p in tmp_path.glob("m.safetensors*")] == []


@pytest.mark.parametrize("shard", [None, 1500], ids=["one file", "shards"])
def test_an_existing_config_json_is_refused_without_overwrite_and_nothing_is_written(gpt2_ckpt, tmp_path, shard):
    from restorekit.errors import OutputExistsError

    prefix, _ = gpt2_ckpt
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(OutputExistsError) as caught:
        convert(prefix, tmp_path / "hf" / "model.safetensors", rules="gpt2-tf-to-hf", config={"n_head": 2},
                max_shard_size=shard)
    assert caught.value.path == str(tmp_path / "hf" / "config.json")
    assert os.listdir(tmp_path / "hf") == ["config.json"]
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"


@requires_torch  # transformers' PyTorch models
@pytest.mark.parametrize("shard", [None, 1500], ids=["one file", "shards"])
def test_config_json_is_published_with_the_weights_replacing_an_old_output(gpt2_ckpt, tmp_path, shard):
    prefix, _ = gpt2_ckpt
    out = tmp_path / "hf" / "model.safetensors"
    convert(prefix, out, rules="gpt2-tf-to-hf", config={"n_head": 1}, max_shard_size=shard)
    result = convert(prefix, out, rules="gpt2-tf-to-hf", config={"n_head": 2}, max_shard_size=shard, overwrite=True)
    assert result.files[-1] == str(tmp_path / "hf" / "config.json")
    assert result.path == str(out) if shard is None else result.path.endswith(".index.json")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_head"] == 2
    assert not [n for n in os.listdir(tmp_path / "hf") if n.startswith(".restorekit")]
    load(transformers.GPT2LMHeadModel, tmp_path / "hf")
