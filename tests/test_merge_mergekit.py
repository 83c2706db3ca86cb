"""restorekit.merge against mergekit itself (an oracle only): the same recipe on a tiny Hugging Face Llama.

Run with torch and mergekit installed (``python -m pytest tests/test_merge_mergekit.py``);
skipped with the reason where either is missing.
"""

import os

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from conftest import requires_torch

from restorekit import merge

pytestmark = requires_torch


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 3-layer LlamaForCausalLM (tiny) saved by save_pretrained, and two noisy 'fine-tuned' copies, in float32."""
    pytest.importorskip("mergekit", reason="mergekit is not installed: the oracle tests compare against it")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    root = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    paths = {}
    for name in ("base", "ft0", "ft1"):
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    return root, paths


def _mergekit(text: str, out: str) -> dict:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    run_merge(MergeConfiguration.model_validate(yaml.safe_load(text)), out,
              options=MergeOptions(cuda=False, copy_tokenizer=False, write_model_card=False, quiet=True))
    return load_file(os.path.join(out, "model.safetensors"))


def _ours(text: str, out: str, **options) -> dict:
    recipe = os.path.join(os.path.dirname(out), os.path.basename(out) + ".yml")
    with open(recipe, "w") as f:
        f.write(text)
    merge(recipe, out, **options)
    assert os.path.isfile(os.path.join(out, "config.json"))
    return load_file(os.path.join(out, "model.safetensors"))


RECIPES = {
    "linear": """merge_method: linear
models:
  - model: {ft0}
    parameters: {{weight: 0.3}}
  - model: {ft1}
    parameters: {{weight: 0.7}}
  - model: {base}
    parameters: {{weight: [0.2, 1.0]}}
""",
    "task_arithmetic": """merge_method: task_arithmetic
base_model: {base}
models:
  - model: {ft0}
    parameters: {{weight: 0.6}}
  - model: {ft1}
    parameters: {{weight: [0.2, 0.8]}}
parameters: {{lambda: 0.9}}
""",
    "ties": """merge_method: ties
base_model: {base}
models:
  - model: {ft0}
    parameters: {{weight: 0.6, density: 0.5}}
  - model: {ft1}
    parameters:
      weight: [0.2, 0.8]
      density: [{{filter: self_attn, value: 0.3}}, {{value: 0.7}}]
""",
    "ties_rescale": """merge_method: ties
base_model: {base}
models:
  - model: {ft0}
    parameters: {{weight: 0.6, density: 0.5}}
  - model: {ft1}
    parameters: {{weight: 0.4, density: 0.3}}
parameters: {{rescale: true}}
""",
    "slerp": """merge_method: slerp
base_model: {base}
models:
  - model: {base}
  - model: {ft0}
parameters:
  t: [0, 0.3, 1]
""",
}

# Where mergekit is deterministic and computes in float64 (dtype: float64) it follows the same order of
# operations as restorekit, and the merge is bit for bit the same for these; linear (torch's fused addcmul)
# and slerp (torch's chunked norms) differ in the last bit only.
EXACT_IN_FLOAT64 = {"task_arithmetic", "ties"}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("method", list(RECIPES), ids=list(RECIPES))
def test_merge_equals_mergekit_for_the_same_recipe(llama, method, dtype):
    root, paths = llama
    text = RECIPES[method].format(**paths) + f"dtype: {dtype}\n"
    theirs = _mergekit(text, str(root / f"mk-{method}-{dtype}"))
    ours = _ours(text, str(root / f"rk-{method}-{dtype}"))
    assert set(ours) == set(theirs)
    for name, expected in theirs.items():
        assert ours[name].dtype == expected.dtype == np.dtype(dtype), name
        if dtype == "float64" and method in EXACT_IN_FLOAT64:
            np.testing.assert_array_equal(ours[name], expected, err_msg=name)
        else:
            np.testing.assert_allclose(ours[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_dare_agrees_with_mergekit_statistically(llama, method):
    """DARE's masks come from torch's RNG in mergekit and from numpy's (seeded by tensor name) here, and mergekit
    rescales the kept entries to the delta's L1 norm where restorekit rescales by 1 / density (the paper's
    rule; the two agree in expectation). So the test is statistical over the ~10k entries: the share of
    entries that moved, and the total L1 norm of the merged deltas, agree within a few percent; and with
    density 1 (no drop) the two merges are the same within 1e-6."""
    root, paths = llama
    text = f"""merge_method: {method}
base_model: {paths['base']}
models:
  - model: {paths['ft0']}
    parameters: {{weight: 0.7, density: 0.5}}
  - model: {paths['ft1']}
    parameters: {{weight: 0.5, density: 0.5}}
dtype: float32
"""
    theirs = _mergekit(text, str(root / f"mk-{method}"))
    ours = _ours(text, str(root / f"rk-{method}"))
    base = load_file(os.path.join(paths["base"], "model.safetensors"))
    moved, norm = {}, {}
    for label, merged in (("theirs", theirs), ("ours", ours)):
        deltas = [merged[n].astype(np.float64) - base[n] for n in base]
        flat = np.concatenate([d.reshape(-1) for d in deltas])
        moved[label] = float(np.mean(np.abs(flat) > 1e-6))
        norm[label] = float(np.sum(np.abs(flat)))
    assert abs(moved["ours"] - moved["theirs"]) < 0.03, moved
    assert abs(norm["ours"] / norm["theirs"] - 1) < 0.05, norm
    whole = text.replace("density: 0.5", "density: 1.0")
    theirs = _mergekit(whole, str(root / f"mk-{method}-whole"))
    ours = _ours(whole, str(root / f"rk-{method}-whole"))
    for name, expected in theirs.items():
        np.testing.assert_allclose(ours[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)


class _Positional:
    """A stand-in for a random generator whose draws are a fixed function of the element's position in its
    tensor: given to both tools, they drop the same entries, so their rescaling can be compared exactly."""

    def __init__(self):
        self.at = 0

    def random(self, n: int) -> np.ndarray:
        draws = np.modf((self.at + np.arange(n, dtype=np.float64)) * 0.6180339887498949)[0]
        self.at += n
        return draws


@pytest.mark.parametrize("method, rescale", [("dare_ties", "true"), ("dare_linear", "false")],
                         ids=["dare_ties-l1-rescale", "dare_linear-no-rescale"])
def test_dare_with_mergekits_rescale_equals_mergekit_given_the_same_masks(llama, monkeypatch, method, rescale):
    """``rescale`` is mergekit's own parameter: true scales the kept entries so the delta keeps its L1 norm (mergekit's
    default for DARE), false leaves them as they are. Both tools are given the same drop masks (a function of the
    position: mergekit's ``bernoulli`` and restorekit's generator replaced), so the merges must agree within 1e-6."""
    import torch
    from mergekit import sparsify

    import restorekit._merging._methods as methods

    root, paths = llama

    def bernoulli(tensor, density, rescale_norm=None):  # mergekit's, with the positional mask
        if density >= 1:
            return tensor
        work = tensor.dtype if tensor.dtype == torch.bfloat16 else torch.float32
        keep = _Positional().random(tensor.numel()) < density
        mask = torch.from_numpy(keep.reshape(tuple(tensor.shape))).to(work)
        return sparsify.rescaled_masked_tensor(tensor.to(work), mask, rescale_norm).to(tensor.dtype)

    class Drop(methods._Drop):
        def __init__(self, *args):
            super().__init__(*args)
            self.rng = _Positional()

    monkeypatch.setattr(sparsify, "bernoulli", bernoulli)
    monkeypatch.setattr(methods, "_Drop", Drop)
    text = f"""merge_method: {method}
base_model: {paths['base']}
models:
  - model: {paths['ft0']}
    parameters: {{weight: 0.7, density: 0.4}}
  - model: {paths['ft1']}
    parameters: {{weight: 0.5, density: 0.6}}
parameters: {{rescale: {rescale}}}
dtype: float32
"""
    theirs = _mergekit(text, str(root / f"mk-{method}-{rescale}"))
    ours = _ours(text, str(root / f"rk-{method}-{rescale}"))
    base = load_file(os.path.join(paths["base"], "model.safetensors"))
    moved = 0
    for name, expected in theirs.items():
        np.testing.assert_allclose(ours[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)
        moved += int(np.count_nonzero(ours[name] != base[name]))
    assert moved > 0.5 * sum(v.size for v in base.values())  # the deltas were merged, not dropped wholesale
