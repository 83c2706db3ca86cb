"""``restorekit merge-lora``: a PEFT LoRA adapter merged into a base checkpoint of any format; ``restorekit
tf1-training``: a torch training checkpoint written back as a TF1 checkpoint with its optimizer slots."""

from __future__ import annotations

import argparse

from restorekit.cli._base import EXIT_OK, _pairing_options, _quiet, register, reworded_exists_error


def _merge_lora_args(p: argparse.ArgumentParser) -> None:
    from restorekit.export import FORMATS

    p.add_argument("base", help="the base checkpoint: safetensors (file or shard directory), .pt, .npz, TF, Keras")
    p.add_argument("adapter", help="the PEFT adapter directory (adapter_model.safetensors, adapter_config.json)")
    p.add_argument("out", help="the merged output; its format from --to or the extension, as convert")
    _pairing_options(p, "pair PyTorch names with a TF or Keras base's (layout='torch')",
                     "pair Hugging Face names with a TF base's by a rule set")
    p.add_argument("--weights-only", action="store_true", help="leave out optimizer state and global_step")
    p.add_argument("--to", choices=FORMATS, help="output format (default: from OUT's extension, else tf)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")


@register("merge-lora", help="merge a PEFT LoRA adapter into a base checkpoint, tensor by tensor",
          configure=_merge_lora_args)
def _merge_lora(args) -> int:
    from restorekit._lora import merge_lora

    with reworded_exists_error(args.out):
        result = merge_lora(args.base, args.adapter, args.out, to=args.to, layout=args.layout, rules=args.rules,
                            weights_only=args.weights_only, overwrite=args.overwrite, progress=not _quiet(args))
    if not _quiet(args):
        print(result)
    return EXIT_OK


def _tf1_training_args(p: argparse.ArgumentParser) -> None:
    from restorekit._optim._tf1_target import TF1_OPTIMIZERS

    p.add_argument("src", help="a torch training checkpoint and its model group: train.pt:model "
                               "({'model': state_dict, 'optimizer': optimizer.state_dict()})")
    p.add_argument("out", help="the TF1 checkpoint prefix to write (weights in TF names and axes, and the slots)")
    p.add_argument("--optimizer", required=True, choices=sorted(TF1_OPTIMIZERS),
                   help="the tf.compat.v1.train optimizer that resumes the run: adam (torch Adam), momentum "
                        "(torch SGD with momentum)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")


@register("tf1-training", help="write a torch training checkpoint back as a TF1 checkpoint with Adam or Momentum "
                               "slots, and the arguments that resume it", configure=_tf1_training_args)
def _tf1_training(args) -> int:
    from restorekit._optim._tf1_target import tf1_training

    with reworded_exists_error(args.out):
        result = tf1_training(args.src, args.out, optimizer=args.optimizer, overwrite=args.overwrite,
                              progress=not _quiet(args))
    if not _quiet(args):
        print(result)
    return EXIT_OK
