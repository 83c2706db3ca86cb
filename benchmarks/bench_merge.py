"""Model merging (issue 37): peak memory and time of ``restorekit.merge`` against mergekit, on one TIES recipe.

Four generated Hugging Face Llama directories (a base and three 'fine-tuned' copies, the
base plus noise; default 3 layers at hidden size 2048, intermediate 5632, vocabulary 32000:
1.14 GB of float32 each, the largest tensor 250 MiB), written under the git-ignored
``benchmarks/data/`` and deleted afterwards; refused when the disk has less than 8x their
size free (the disk is shared). ``--hidden 1024 --intermediate 2816 --vocab 8192`` is the
earlier 0.22 GB case.
One recipe (ties, three models, density 0.5, dtype float32) is run by both tools, each in
its own process of the torch environment's Python (mergekit needs torch); time excludes
interpreter start and imports; peak memory is VmHWM minus VmRSS just before the run (the
process's whole VmHWM, its ru_maxrss, is printed too).

- ours: ``restorekit.merge(recipe, out)``, one output tensor at a time.
- mergekit: ``mergekit.merge.run_merge`` with ``MergeOptions(cuda=False)`` (its default lazy loader).

Both outputs are compared (max abs difference). The ratios are ours / mergekit.

    python benchmarks/bench_merge.py [--layers 3] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, INTERMEDIATE, VOCAB = 2048, 5632, 32000

DRIVER = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
def rss(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
import yaml
{setup}
recipe_text = open(sys.argv[1]).read()
out = sys.argv[2]
before = rss('VmRSS:')
start = time.perf_counter()
{body}
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "peak": rss('VmHWM:') - before, "hwm": rss('VmHWM:')}}))
"""

OURS = ("import restorekit", "restorekit.merge(restorekit.MergeRecipe.from_yaml(recipe_text), out)")
MERGEKIT = (
    "from mergekit.config import MergeConfiguration\nfrom mergekit.merge import run_merge\n"
    "from mergekit.options import MergeOptions",
    "run_merge(MergeConfiguration.model_validate(yaml.safe_load(recipe_text)), out, "
    "options=MergeOptions(cuda=False, copy_tokenizer=False, write_model_card=False, quiet=True))",
)


def tensors(layers: int, rng) -> dict:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"model.layers.{i}.self_attn.{part}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"model.layers.{i}.mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"model.layers.{i}.mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"model.layers.{i}.mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (HIDDEN,)
    return shapes


def model_bytes(layers: int) -> int:
    return sum(4 * int(np.prod(s)) for s in tensors(layers, None).values())


def make_models(root: str, layers: int) -> list:
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    rng = np.random.default_rng(0)
    shapes = tensors(layers, rng)
    base = {n: (0.02 * rng.standard_normal(s, dtype=np.float32)) for n, s in shapes.items()}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         architectures=["LlamaForCausalLM"])
    paths = []
    for k in range(4):
        path = os.path.join(root, f"m{k}")
        os.makedirs(path)
        values = base if k == 0 else {n: v + 0.002 * rng.standard_normal(v.shape, dtype=np.float32)
                                      for n, v in base.items()}
        save_file(values, os.path.join(path, "model.safetensors"))
        config.save_pretrained(path)
        paths.append(path)
        del values
    return paths


def compare(root: str, paths: list) -> tuple:
    """(max abs difference, entries over 1e-6, those explained by a tie at a model's top-k cut, entries), one tensor
    at a time: at a differing entry, some model's float32 |delta| equals the k-th largest of its tensor (density 0.5)."""
    from safetensors import safe_open

    def tensor(path, name):
        with safe_open(path, framework="numpy") as f:
            return f.get_tensor(name)

    ours, theirs = (os.path.join(root, f"out-{k}", "model.safetensors") for k in ("ours", "mergekit"))
    with safe_open(theirs, framework="numpy") as f:
        names = list(f.keys())
    worst, differing, at_cut, total = 0.0, 0, 0, 0
    for name in names:
        diff = np.abs(tensor(ours, name).astype(np.float64) - tensor(theirs, name))
        worst = max(worst, float(diff.max()))
        where = np.flatnonzero(diff.reshape(-1) > 1e-6)
        total += diff.size
        differing += len(where)
        if len(where):
            base = tensor(os.path.join(paths[0], "model.safetensors"), name).reshape(-1)
            tied = np.zeros(len(where), bool)
            for path in paths[1:]:
                mag = np.abs(tensor(os.path.join(path, "model.safetensors"), name).reshape(-1) - base)
                k = max(1, int(0.5 * mag.size))
                cut = np.partition(mag, mag.size - k)[mag.size - k]
                tied |= mag[where] == cut
            at_cut += int(tied.sum())
    return worst, differing, at_cut, total


def run(tool, recipe: str, out: str) -> dict:
    code = DRIVER.format(repo=REPO, setup=tool[0], body=tool[1])
    proc = subprocess.run([sys.executable, "-c", code, recipe, out], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    global HIDDEN, INTERMEDIATE, VOCAB
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "benchmarks", "data"))
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--intermediate", type=int, default=INTERMEDIATE)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--keep", action="store_true", help="keep the generated models")
    args = parser.parse_args(argv)
    HIDDEN, INTERMEDIATE, VOCAB = args.hidden, args.intermediate, args.vocab
    os.makedirs(args.data, exist_ok=True)
    layers = args.layers
    need = 8 * model_bytes(layers)  # four models and two outputs, with room to spare
    free = shutil.disk_usage(args.data).free
    if need > free:
        print(f"needs {need / 1e9:.1f} GB free under {args.data!r}, has {free / 1e9:.1f} GB", file=sys.stderr)
        return 1
    root = os.path.join(args.data, "merge")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    try:
        paths = make_models(root, layers)
        recipe = os.path.join(root, "ties.yml")
        with open(recipe, "w") as f:
            f.write(f"merge_method: ties\nbase_model: {paths[0]}\nmodels:\n" + "".join(
                f"  - model: {p}\n    parameters: {{weight: 1.0, density: 0.5}}\n" for p in paths[1:])
                + "dtype: float32\n")
        largest = 4 * VOCAB * HIDDEN
        rows = {"ours": [], "mergekit": []}
        for r in range(args.repeat):
            order = [("ours", OURS), ("mergekit", MERGEKIT)]
            for name, tool in (order if r % 2 == 0 else order[::-1]):
                out = os.path.join(root, f"out-{name}")
                shutil.rmtree(out, ignore_errors=True)
                rows[name].append(run(tool, recipe, out))
        worst, differing, at_cut, total = compare(root, paths)
        med = {k: (statistics.median(x["seconds"] for x in v), statistics.median(x["peak"] for x in v))
               for k, v in rows.items()}
        mib = 2**20
        print(f"TIES over 3 models + base, {layers} layers, {model_bytes(layers) / 1e9:.2f} GB each "
              f"(largest tensor {largest / mib:.0f} MiB as float32), repeat {args.repeat}")
        for k, (s, p) in med.items():
            hwm = statistics.median(x["hwm"] for x in rows[k])
            print(f"  {k:9s} {s:7.2f} s   peak {p / mib:7.1f} MiB = {p / largest:.1f}x the largest tensor "
                  f"(VmHWM {hwm / mib:.0f} MiB)")
        print(f"  ratio ours/mergekit: time {med['ours'][0] / med['mergekit'][0]:.2f}, "
              f"peak {med['ours'][1] / med['mergekit'][1]:.2f}; max abs difference {worst:.2e}")
        print(f"  entries differing by more than 1e-6: {differing} of {total}; {at_cut} of them where some model's "
              "float32 |delta| equals its top-k cut (a tie torch's argsort breaks arbitrarily)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
