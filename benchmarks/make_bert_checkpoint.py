"""Generate a BERT-base-sized name-based checkpoint with Adam slots (~1.3 GB) for the benchmarks.

Names follow Google's BERT (``bert/encoder/layer_N/attention/self/query/kernel`` with
``/adam_m`` and ``/adam_v`` slots, ``global_step``). Written with restorekit's own
BundleWriter: building it through TF variables would take minutes and ~3x the memory.

    python benchmarks/make_bert_checkpoint.py [OUT_DIR]     # default benchmarks/data/
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from restorekit._bundle.writer import BundleWriter  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, POSITIONS, TYPES = 768, 3072, 12, 30522, 512, 2


def bert_shapes() -> dict[str, tuple]:
    """Model variables of BERT-base (uncased) with their shapes."""
    shapes = {
        "bert/embeddings/word_embeddings": (VOCAB, HIDDEN),
        "bert/embeddings/position_embeddings": (POSITIONS, HIDDEN),
        "bert/embeddings/token_type_embeddings": (TYPES, HIDDEN),
        "bert/embeddings/LayerNorm/gamma": (HIDDEN,),
        "bert/embeddings/LayerNorm/beta": (HIDDEN,),
        "bert/pooler/dense/kernel": (HIDDEN, HIDDEN),
        "bert/pooler/dense/bias": (HIDDEN,),
        "cls/predictions/transform/dense/kernel": (HIDDEN, HIDDEN),
        "cls/predictions/transform/dense/bias": (HIDDEN,),
        "cls/predictions/transform/LayerNorm/gamma": (HIDDEN,),
        "cls/predictions/transform/LayerNorm/beta": (HIDDEN,),
        "cls/predictions/output_bias": (VOCAB,),
        "cls/seq_relationship/output_weights": (2, HIDDEN),
        "cls/seq_relationship/output_bias": (2,),
    }
    for i in range(LAYERS):
        layer = f"bert/encoder/layer_{i}"
        for part in ("query", "key", "value"):
            shapes[f"{layer}/attention/self/{part}/kernel"] = (HIDDEN, HIDDEN)
            shapes[f"{layer}/attention/self/{part}/bias"] = (HIDDEN,)
        shapes[f"{layer}/attention/output/dense/kernel"] = (HIDDEN, HIDDEN)
        shapes[f"{layer}/attention/output/dense/bias"] = (HIDDEN,)
        shapes[f"{layer}/attention/output/LayerNorm/gamma"] = (HIDDEN,)
        shapes[f"{layer}/attention/output/LayerNorm/beta"] = (HIDDEN,)
        shapes[f"{layer}/intermediate/dense/kernel"] = (HIDDEN, INTERMEDIATE)
        shapes[f"{layer}/intermediate/dense/bias"] = (INTERMEDIATE,)
        shapes[f"{layer}/output/dense/kernel"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{layer}/output/dense/bias"] = (HIDDEN,)
        shapes[f"{layer}/output/LayerNorm/gamma"] = (HIDDEN,)
        shapes[f"{layer}/output/LayerNorm/beta"] = (HIDDEN,)
    return shapes


def write(directory: str, *, seed: int = 0) -> str:
    """Write ``directory/bert_model.ckpt`` (with a ``checkpoint`` state file); return its prefix."""
    os.makedirs(directory, exist_ok=True)
    prefix = os.path.join(directory, "bert_model.ckpt")
    rng = np.random.default_rng(seed)
    with BundleWriter(prefix) as w:
        for name, shape in bert_shapes().items():
            w.add(name, rng.standard_normal(shape, dtype=np.float32) * 0.02)
            w.add(f"{name}/adam_m", rng.standard_normal(shape, dtype=np.float32) * 1e-3)
            w.add(f"{name}/adam_v", rng.random(shape, dtype=np.float32) * 1e-6)
        w.add("global_step", np.int64(1_000_000))
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "bert_model.ckpt"\nall_model_checkpoint_paths: "bert_model.ckpt"\n')
    return prefix


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
    parser.add_argument("directory", nargs="?", default=default)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    prefix = write(args.directory)
    size = sum(os.path.getsize(os.path.join(args.directory, f)) for f in os.listdir(args.directory))
    print(f"wrote {prefix} ({size / 1e9:.2f} GB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
