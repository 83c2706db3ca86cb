"""Tests for restorekit/_lora.py: merge_lora, export_lora_adapter and a LoRA-enabled Keras model as a restore target.

PEFT's own ``merge_and_unload`` is the oracle where torch and peft are installed
(``@requires_torch``, run with the torch venv); elsewhere numpy and Keras' own merged kernel are.
"""

import json
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file, save_file

import restorekit
from conftest import requires_torch
from restorekit._lora import delta, keras_delta, scaling
from restorekit.cli import main
from restorekit.errors import InvalidArgumentError, OptionNotApplicableError, OutputExistsError, SourceMismatchError


def _model(lora: dict | None = None, seed: int = 0):
    """fc1 Dense 8->16, fc2 EinsumDense 16->4 (2-D kernel), heads EinsumDense 16->[2, 3] (3-D kernel)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="fc1")(inputs)
    y = keras.layers.EinsumDense("ab,bc->ac", output_shape=4, bias_axes="c", name="fc2")(x)
    z = keras.layers.EinsumDense("ab,bcd->acd", output_shape=(2, 3), name="heads")(x)
    model = keras.Model(inputs, [y, z])
    for name, (rank, alpha) in (lora or {}).items():
        layer = model.get_layer(name)
        layer.enable_lora(rank, lora_alpha=alpha)
        rng = np.random.RandomState(len(name))
        layer.lora_kernel_a.assign(0.3 * rng.normal(size=layer.lora_kernel_a.shape).astype("float32"))
        layer.lora_kernel_b.assign(0.3 * rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))
    return model


def _adapter(directory, tensors: dict, **config) -> str:
    """A PEFT adapter directory written by hand (what PeftModel.save_pretrained writes)."""
    os.makedirs(directory, exist_ok=True)
    save_file({f"base_model.model.{k}": np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["fc1"], "fan_in_fan_out": False,
           "use_rslora": False, "use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None}
    cfg.update(config)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(directory)


def _fc1_pair(rank=4, seed=1):
    rng = np.random.RandomState(seed)
    return rng.normal(size=(rank, 8)).astype("float32"), rng.normal(size=(16, rank)).astype("float32")


# ------------------------------------------------------------------ the one delta
def test_delta_is_peft_get_delta_weight_and_rslora_scales_by_the_root():
    A, B = _fc1_pair()
    np.testing.assert_allclose(delta(A, B, 0.5), (B @ A) * 0.5, atol=1e-6)
    np.testing.assert_allclose(delta(A, B, 0.5, fan_in_fan_out=True), ((B @ A) * 0.5).T, atol=1e-6)
    assert scaling(4, 8) == 2.0 and scaling(4, 8, use_rslora=True) == 4.0


# ------------------------------------------------------------------ (a) a LoRA-enabled Keras model as a restore target
@pytest.mark.parametrize("fmt", ["weights.h5", "tf"], ids=["from a .weights.h5", "from a TF checkpoint"])
def test_a_lora_model_restores_its_base_and_reports_the_adapters_as_new(tmp_path, fmt):
    donor = _model(seed=1)
    path = str(tmp_path / "base.weights.h5")
    if fmt == "tf":
        path = tf.train.Checkpoint(model=donor).write(str(tmp_path / "ckpt" / "base"))
    else:
        donor.save_weights(path)
    model = _model({"fc1": (4, 8), "fc2": (2, 2)}, seed=2)
    before = {v.path: v.numpy() for v in model.weights if "lora" in v.path}
    report = restorekit.scan(path, model)
    assert report.is_complete
    assert {r.variable_name for r in report.skipped} == set(before)
    assert {r.how for r in report.skipped} == {("lora_adapter",)} and report.skipped[0].reason == "LoRA adapter (new)"
    assert {"fc1/kernel", "fc2/kernel", "heads/kernel"} <= set(report.matched_names)
    text = str(report)
    assert "LoRA adapter (new) (4)" in text and "fc1/kernel, fc2/kernel frozen (trainable=False)" in text
    restorekit.restore(report, strict=True)
    for name, value in before.items():  # left as Keras initialized (here: as assigned) them
        np.testing.assert_array_equal(model.get_layer(name.split("/")[0]).__getattribute__(name.split("/")[1]).numpy(),
                                      value)
    np.testing.assert_array_equal(model.get_layer("fc1")._kernel.numpy(), keras.ops.convert_to_numpy(donor.get_layer("fc1").kernel))
    assert model.get_layer("fc1")._kernel.trainable is False


# ------------------------------------------------------------------ (b) Keras LoRA weights merged into their kernels
def test_keras_lora_in_a_checkpoint_merges_into_the_kernels_as_keras_merges_them(tmp_path):
    model = _model({"fc1": (4, 8), "fc2": (2, 6), "heads": (3, 3)})
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "lora" / "ckpt"))
    alphas = {"fc1": 8, "fc2": 6, "heads": 3}
    # one lora_alpha for the checkpoint: merge layer by layer with each one's alpha and compare each layer
    for name, alpha in alphas.items():
        out = tmp_path / f"merged-{name}.npz"
        result = restorekit.merge_lora(prefix, None, out, lora_alpha=alpha)
        assert len(result.merged) == 3 and len(result.dropped) >= 6
        merged = {k.split("/.ATTRIBUTES")[0]: v for k, v in np.load(out).items()}
        assert not any("lora_kernel" in k for k in merged)
        layer = model.get_layer(name)
        key = next(k for k in merged if k.endswith(f"_operations/{model.layers.index(layer)}/_kernel"))
        np.testing.assert_allclose(merged[key], keras.ops.convert_to_numpy(layer.kernel), atol=1e-5)  # Keras' own merged kernel
        np.testing.assert_allclose(keras_delta(layer.lora_kernel_a.numpy(), layer.lora_kernel_b.numpy(), alpha / layer.lora_rank),
                                   keras.ops.convert_to_numpy(layer.kernel) - layer._kernel.numpy(), atol=1e-5)


def test_a_merged_keras_lora_checkpoint_restores_into_the_plain_model_with_the_same_outputs(tmp_path):
    model = _model({"fc1": (4, 4), "fc2": (2, 2), "heads": (3, 3)})  # lora_alpha = rank: Keras' default
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "lora" / "ckpt"))
    result = restorekit.merge_lora(prefix, None, tmp_path / "merged" / "model.ckpt")
    plain = _model(seed=5)
    restorekit.restore(restorekit.scan(result.path, plain), strict=True)
    x = np.random.RandomState(0).normal(size=(3, 8)).astype("float32")
    for got, want in zip(plain(x), model(x)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# ------------------------------------------------------------------ (b) a PEFT adapter into a TF / Keras base
@pytest.mark.parametrize("fmt", ["tf", "weights.h5"], ids=["TF checkpoint base", "Keras file base"])
def test_a_peft_adapter_merges_into_tf_kernels_transposed_through_layout_torch(tmp_path, fmt):
    base = _model(seed=3)
    path = str(tmp_path / "base.weights.h5")
    if fmt == "tf":
        path = tf.train.Checkpoint(model=base).write(str(tmp_path / "ckpt" / "base"))
    else:
        base.save_weights(path)
    A, B = _fc1_pair()
    adapter = _adapter(tmp_path / "adapter", {"fc1.lora_A.weight": A, "fc1.lora_B.weight": B})
    with pytest.raises(SourceMismatchError, match="pass layout='torch'"):  # TF names without a layout
        restorekit.merge_lora(path, adapter, tmp_path / "no.npz")
    assert not os.path.exists(tmp_path / "no.npz")
    result = restorekit.merge_lora(path, adapter, tmp_path / "merged.safetensors", layout="torch")
    assert len(result.merged) == 1
    merged = load_file(tmp_path / "merged.safetensors")
    key = result.merged[0]  # fc1's kernel: 'fc1/kernel' in a Keras file, its object path in a TF checkpoint
    expected = keras.ops.convert_to_numpy(base.get_layer("fc1").kernel) + ((B @ A) * 2.0).T
    np.testing.assert_allclose(merged[key], expected, atol=1e-5)
    np.testing.assert_array_equal(merged[key.replace("_kernel", "bias").replace("kernel", "bias")],
                                  base.get_layer("fc1").bias.numpy())


def test_a_peft_adapter_in_hugging_face_names_merges_into_a_tf_bert_checkpoint_through_a_rule_set(tmp_path):
    """rules='bert-tf-to-hf' pairs the adapter's modules (BertForPreTraining's names) with the TF checkpoint's
    kernels, whose axes the rule set transposes: the delta goes back transposed, under the TF names."""
    from conftest import save_variables

    rng = np.random.RandomState(0)
    layer = "bert/encoder/layer_0/"
    values = {"bert/embeddings/word_embeddings": rng.normal(size=(30, 8)).astype("float32"),
              layer + "attention/self/query/kernel": rng.normal(size=(8, 8)).astype("float32"),
              layer + "attention/self/query/bias": rng.normal(size=8).astype("float32"),
              layer + "intermediate/dense/kernel": rng.normal(size=(8, 16)).astype("float32"),
              layer + "intermediate/dense/bias": rng.normal(size=16).astype("float32")}
    base = save_variables(tmp_path / "tf" / "bert_model.ckpt", values)
    qA, qB = rng.normal(size=(4, 8)), rng.normal(size=(8, 4))
    iA, iB = rng.normal(size=(4, 8)), rng.normal(size=(16, 4))  # intermediate: nn.Linear(8, 16), weight [16, 8]
    modules = ["bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.intermediate.dense"]
    adapter = _adapter(tmp_path / "adapter", {f"{modules[0]}.lora_A.weight": qA, f"{modules[0]}.lora_B.weight": qB,
                                              f"{modules[1]}.lora_A.weight": iA, f"{modules[1]}.lora_B.weight": iB},
                       target_modules=["query", "dense"])
    with pytest.raises(SourceMismatchError, match="or a rule set"):  # TF names, no rule set
        restorekit.merge_lora(base, adapter, tmp_path / "no.safetensors")
    with pytest.raises(InvalidArgumentError, match="not both"):
        restorekit.merge_lora(base, adapter, tmp_path / "no.safetensors", rules="bert-tf-to-hf", layout="torch")
    assert not os.path.exists(tmp_path / "no.safetensors")
    result = restorekit.merge_lora(base, adapter, tmp_path / "merged.safetensors", rules="bert-tf-to-hf")
    assert sorted(result.merged) == [layer + "attention/self/query/kernel", layer + "intermediate/dense/kernel"]
    got = load_file(tmp_path / "merged.safetensors")
    assert set(got) == set(values)  # the base's names, every entry kept
    np.testing.assert_allclose(got[layer + "attention/self/query/kernel"],
                               values[layer + "attention/self/query/kernel"] + (2.0 * qB @ qA).T, atol=1e-5)
    np.testing.assert_allclose(got[layer + "intermediate/dense/kernel"],
                               values[layer + "intermediate/dense/kernel"] + (2.0 * iB @ iA).T, atol=1e-5)
    for name in ("bert/embeddings/word_embeddings", layer + "attention/self/query/bias"):
        np.testing.assert_array_equal(got[name], values[name])


def test_embedding_factors_and_rank_pattern_merge_into_a_safetensors_base(tmp_path):
    rng = np.random.RandomState(0)
    weights = {"emb.weight": rng.normal(size=(10, 6)).astype("float32"),
               "lin.weight": rng.normal(size=(5, 6)).astype("float32"), "lin.bias": np.zeros(5, np.float32)}
    save_file(weights, str(tmp_path / "base.safetensors"))
    eA, eB = rng.normal(size=(4, 10)), rng.normal(size=(6, 4))
    lA, lB = rng.normal(size=(2, 6)), rng.normal(size=(5, 2))
    adapter = _adapter(tmp_path / "adapter", {"emb.lora_embedding_A": eA, "emb.lora_embedding_B": eB,
                                              "lin.lora_A.weight": lA, "lin.lora_B.weight": lB},
                       target_modules=["emb", "lin"], rank_pattern={"lin": 2}, alpha_pattern={"lin": 1},
                       use_rslora=True)
    restorekit.merge_lora(tmp_path / "base.safetensors", adapter, tmp_path / "out.safetensors")
    got = load_file(tmp_path / "out.safetensors")
    np.testing.assert_allclose(got["emb.weight"], weights["emb.weight"] + ((eB @ eA) * 8 / 2).T, atol=1e-5)
    np.testing.assert_allclose(got["lin.weight"], weights["lin.weight"] + (lB @ lA) / np.sqrt(2), atol=1e-5)
    np.testing.assert_array_equal(got["lin.bias"], weights["lin.bias"])


# ------------------------------------------------------------------ refusals: nothing written
def _base_file(tmp_path) -> str:
    save_file({"fc1.weight": np.zeros((16, 8), np.float32)}, str(tmp_path / "base.safetensors"))
    return str(tmp_path / "base.safetensors")


REFUSALS = {
    "shape mismatch": ({"fc1.lora_A.weight": np.zeros((4, 9)), "fc1.lora_B.weight": np.zeros((16, 4))}, {},
                       SourceMismatchError, "base \\[16, 8\\], adapter delta \\[16, 9\\]"),
    "unknown target": ({"fc9.lora_A.weight": np.zeros((4, 8)), "fc9.lora_B.weight": np.zeros((16, 4))}, {},
                       SourceMismatchError, "'fc9.weight': no such weight"),
    "rank not r": ({"fc1.lora_A.weight": np.zeros((3, 8)), "fc1.lora_B.weight": np.zeros((16, 3))}, {},
                   SourceMismatchError, "rank r=4"),
    "DoRA": (dict(zip(("fc1.lora_A.weight", "fc1.lora_B.weight"), _fc1_pair())), {"use_dora": True},
             InvalidArgumentError, "use_dora"),
    "lora_bias": (dict(zip(("fc1.lora_A.weight", "fc1.lora_B.weight"), _fc1_pair())), {"lora_bias": True},
                  InvalidArgumentError, "lora_bias"),
    "modules_to_save": (dict(zip(("fc1.lora_A.weight", "fc1.lora_B.weight"), _fc1_pair())),
                        {"modules_to_save": ["classifier"]}, InvalidArgumentError, "modules_to_save"),
    "a tensor that is no factor": ({"fc1.lora_A.weight": np.zeros((4, 8)), "fc1.lora_B.weight": np.zeros((16, 4)),
                                    "classifier.weight": np.zeros((2, 16))}, {}, SourceMismatchError, "classifier"),
}


@pytest.mark.parametrize("case", REFUSALS, ids=list(REFUSALS))
def test_an_adapter_that_does_not_merge_exactly_is_refused_by_name_and_nothing_is_written(tmp_path, case):
    tensors, config, error, message = REFUSALS[case]
    adapter = _adapter(tmp_path / "adapter", tensors, **config)
    out = tmp_path / "out" / "merged.safetensors"
    with pytest.raises(error, match=message):
        restorekit.merge_lora(_base_file(tmp_path), adapter, out)
    assert not os.path.exists(out) and not os.path.exists(tmp_path / "out")


def test_an_existing_output_is_refused_without_overwrite_and_lora_alpha_goes_with_keras_weights_only(tmp_path):
    adapter = _adapter(tmp_path / "adapter", dict(zip(("fc1.lora_A.weight", "fc1.lora_B.weight"), _fc1_pair())))
    out = tmp_path / "merged.safetensors"
    out.write_bytes(b"keep")
    with pytest.raises(OutputExistsError):
        restorekit.merge_lora(_base_file(tmp_path), adapter, out)
    assert out.read_bytes() == b"keep"
    with pytest.raises(OptionNotApplicableError):
        restorekit.merge_lora(_base_file(tmp_path), adapter, tmp_path / "x.safetensors", lora_alpha=4)
    restorekit.merge_lora(_base_file(tmp_path), adapter, out, overwrite=True)
    assert load_file(out)["fc1.weight"].shape == (16, 8)


def test_the_cli_merges_in_process(tmp_path, capsys):
    A, B = _fc1_pair()
    adapter = _adapter(tmp_path / "adapter", {"fc1.lora_A.weight": A, "fc1.lora_B.weight": B})
    assert main(["merge-lora", _base_file(tmp_path), adapter, str(tmp_path / "m.npz")]) == 0
    assert "merged         1" in capsys.readouterr().out
    np.testing.assert_allclose(np.load(tmp_path / "m.npz")["fc1.weight"], (B @ A) * 2.0, atol=1e-5)
    assert main(["merge-lora", _base_file(tmp_path), adapter, str(tmp_path / "m.npz")]) != 0


# ------------------------------------------------------------------ (c) Keras LoRA out as a PEFT adapter
def test_an_exported_adapter_merged_back_into_the_base_is_keras_merged_kernel(tmp_path):
    model = _model(seed=4)
    model.save_weights(str(tmp_path / "base.weights.h5"))
    for name, rank, alpha in (("fc1", 4, 8), ("fc2", 2, 2)):
        layer = model.get_layer(name)
        layer.enable_lora(rank, lora_alpha=alpha)
        layer.lora_kernel_b.assign(np.random.RandomState(rank).normal(size=layer.lora_kernel_b.shape))
    result = restorekit.export_lora_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["fc1", "fc2"] and len(config["rank_pattern"]) == 1
    assert [m[:2] for m in result.modules] == [("fc1", "fc1"), ("fc2", "fc2")]
    merged = restorekit.merge_lora(tmp_path / "base.weights.h5", tmp_path / "adapter", tmp_path / "m.npz",
                                   layout="torch")
    got = dict(np.load(tmp_path / "m.npz"))
    for name in ("fc1", "fc2"):
        np.testing.assert_allclose(got[f"{name}/kernel"], keras.ops.convert_to_numpy(model.get_layer(name).kernel), atol=1e-5)
    assert len(merged.merged) == 2
    with pytest.raises(OutputExistsError):
        restorekit.export_lora_adapter(model, tmp_path / "adapter")
    model.get_layer("heads").enable_lora(2)
    with pytest.raises(InvalidArgumentError, match="heads"):
        restorekit.export_lora_adapter(model, tmp_path / "adapter2")
    assert not os.path.exists(tmp_path / "adapter2")


# ------------------------------------------------------------------ PEFT itself as the oracle (torch venv)
def _peft():
    return pytest.importorskip("peft", reason="PEFT is the oracle of these cases (pip install peft)")


def _oracle(tmp_path, model, lora_config, **merge_options):
    """Save base and adapter, merge with restorekit, compare with PEFT's merge_and_unload (tensors and outputs)."""
    import torch

    peft = _peft()
    model.save_pretrained(tmp_path / "base")
    wrapped = peft.get_peft_model(model, lora_config)
    wrapped.save_pretrained(tmp_path / "adapter")
    result = restorekit.merge_lora(tmp_path / "base", tmp_path / "adapter", tmp_path / "out" / "model.safetensors",
                                   **merge_options)
    merged = wrapped.merge_and_unload().eval()  # no dropout: outputs are compared
    want = merged.state_dict()
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) <= set(want) and len(result.merged) > 0
    for name, value in got.items():
        np.testing.assert_allclose(value, want[name].detach().numpy(), atol=1e-5, err_msg=name)
    shutil.copy(tmp_path / "base" / "config.json", tmp_path / "out" / "config.json")
    loaded = type(merged).from_pretrained(tmp_path / "out").eval()  # the merged output as Transformers loads it
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(ids)[0].numpy(), merged(ids)[0].numpy(), atol=1e-5)
    return result


@requires_torch
def test_a_peft_adapter_merges_as_merge_and_unload_bert(tmp_path):
    import torch
    import transformers

    peft = _peft()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)
    result = _oracle(tmp_path, transformers.BertModel(config),
                     peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"],
                                     init_lora_weights=False))
    assert len(result.merged) == 4 + 2 * 3 + 1  # q, v in 2 layers; 3 dense per layer; the pooler


@requires_torch
def test_a_fan_in_fan_out_adapter_merges_as_merge_and_unload_gpt2_conv1d(tmp_path):
    import torch
    import transformers

    peft = _peft()
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16)
    _oracle(tmp_path, transformers.GPT2Model(config),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                            init_lora_weights=False))


@requires_torch
def test_an_rslora_adapter_merges_as_merge_and_unload_llama(tmp_path):
    import torch
    import transformers

    peft = _peft()
    torch.manual_seed(2)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    _oracle(tmp_path, transformers.LlamaModel(config),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True,
                            init_lora_weights=False))


@requires_torch
def test_an_exported_keras_adapter_loads_into_the_torch_twin_with_peft(tmp_path):
    import torch

    peft = _peft()
    model = _model({"fc1": (4, 8), "fc2": (2, 6)}, seed=6)

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(self.fc1(x))

    twin = Twin()
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            layer = model.get_layer(name)
            getattr(twin, name).weight.copy_(torch.from_numpy(layer._kernel.numpy().T.copy()))
            getattr(twin, name).bias.copy_(torch.from_numpy(layer.bias.numpy()))
    restorekit.export_lora_adapter(model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(twin, str(tmp_path / "adapter"))
    x = np.random.RandomState(0).normal(size=(3, 8)).astype("float32")
    with torch.no_grad():
        got = loaded(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, np.asarray(model(x)[0]), rtol=1e-5, atol=1e-5)
