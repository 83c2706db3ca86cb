"""``restorekit rename``, ``strip``, ``cast``, ``convert``, ``average`` and ``merge``: write a new checkpoint or another format."""

from __future__ import annotations

import argparse
import json
import os

from restorekit._report import format_bytes

from restorekit.cli._base import (
    _pairing_options,
    cli_exists_error,
    EXIT_OK,
    reworded_exists_error,
    Usage as _Usage,
    _quiet,
    register,
)


# ------------------------------------------------------------------ edits

def _edit_io(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="source checkpoint")
    p.add_argument("out", help="output checkpoint prefix, or an existing directory (never the source)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output checkpoint")
    p.add_argument("--update-state-file", action="store_true",
                   help="point the output directory's 'checkpoint' file at the output (for tf.train.latest_checkpoint)")
    p.add_argument("--no-check", action="store_true",
                   help="do not read the kept tensors to check their crc32c now (a rename stays index-only; "
                        "the bytes are checked when read)")


def _editor(path):
    from restorekit.edit import CheckpointEditor

    return CheckpointEditor(path)


def _shrinking_io(p: argparse.ArgumentParser) -> None:
    _edit_io(p)
    p.add_argument("--link", action="store_true",
                   help="fast: hard-link the source's data shards (the output then holds the dropped bytes too) "
                        "instead of writing only what is kept")


def _output_bytes(prefix: str) -> int:
    """Bytes the output's own files hold on disk (a hard-linked shard counts whole)."""
    directory, base = os.path.split(prefix)
    names = [n for n in os.listdir(directory or ".") if n == base + ".index" or n.startswith(base + ".data-")]
    return sum(os.path.getsize(os.path.join(directory, n)) for n in names)


def _save(editor, args, *, compact: bool = False) -> int:
    from restorekit.errors import OutputExistsError

    try:
        prefix = editor.save(args.out, compact=compact, overwrite=args.overwrite,
                             update_state_file=args.update_state_file, progress=not _quiet(args),
                             check_kept=not args.no_check)
    except OutputExistsError as e:
        raise cli_exists_error(e, args.out) from None
    if not _quiet(args):
        held = f" ({format_bytes(_output_bytes(prefix))} on disk)" if os.path.exists(prefix + ".index") else ""
        print(f"wrote {prefix!r}{held}")
    return EXIT_OK


def _rename_args(p: argparse.ArgumentParser) -> None:
    _edit_io(p)
    p.add_argument("--rule", action="append", default=[], metavar="REGEX=REPL",
                   help="re.sub rule applied to every name, in order; split at the first '='")
    p.add_argument("--map", metavar="FILE.json", help='JSON object {"old name": "new name", ...}')


@register("rename", help="rename tensors by regex rules or a JSON map", configure=_rename_args)
def _rename(args) -> int:
    from restorekit.errors import InvalidArgumentError

    if bool(args.rule) == bool(args.map):
        raise _Usage("rename needs --rule REGEX=REPL (repeatable) or --map FILE.json, not both")
    if args.map:
        try:
            with open(args.map, encoding="utf-8") as f:
                rule = json.load(f)
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(f"--map {args.map!r} is not a readable JSON file: {e}") from None
        if not isinstance(rule, dict) or not all(isinstance(v, str) for v in rule.values()):
            raise InvalidArgumentError(f"--map {args.map!r} must hold a JSON object of name -> new name")
    else:
        rule = []
        for text in args.rule:
            pattern, sep, repl = text.partition("=")
            if not sep or not pattern:
                raise _Usage(f"--rule {text!r} is not REGEX=REPL")
            rule.append((pattern, repl))
    editor = _editor(args.checkpoint)
    editor.rename_all(rule)
    return _save(editor, args)


@register("strip", help="drop optimizer slots (Momentum, Adam, ...); the output holds only what is kept",
          configure=_shrinking_io)
def _strip(args) -> int:
    editor = _editor(args.checkpoint)
    editor.strip_optimizer_slots()
    return _save(editor, args, compact=not args.link)


def _cast_args(p: argparse.ArgumentParser) -> None:
    _shrinking_io(p)
    p.add_argument("--dtype", required=True, help="target dtype: bfloat16, float16, float32, ...")
    p.add_argument("--filter", metavar="PATTERN", default=".*", help="only names matching this pattern (default: all)")


@register("cast", help="cast tensors to another dtype", configure=_cast_args)
def _cast(args) -> int:
    editor = _editor(args.checkpoint)
    editor.cast(args.filter, args.dtype)
    return _save(editor, args, compact=not args.link)


def _convert_args(p: argparse.ArgumentParser) -> None:
    from restorekit.export import FORMATS

    p.add_argument("src", help="TF checkpoint, .pt/.pth/.bin, .safetensors (a file, a directory of shards or its "
                               "index.json), .npz, or Keras .weights.h5, .keras or sharded .weights.json set")
    p.add_argument("out", help="output file (.pt, .safetensors, .npz, .weights.h5 from a Keras 3 source, .h5 from a "
                               "legacy Keras 2 .h5), or checkpoint prefix for --to tf")
    p.add_argument("--to", choices=FORMATS, help="output format (default: from OUT's extension, else tf)")
    _pairing_options(p, "PyTorch names and axes (reversed on the way back)",
                     "a ready rule set of names and axes: bert-tf-to-hf, bert-hf-to-tf, gpt2-tf-to-hf, gpt2-hf-to-tf")
    p.add_argument("--weights-only", action="store_true",
                   help="leave out optimizer state, global_step and save_counter")
    p.add_argument("--ema", action="store_true",
                   help="write each weight's moving average (TF1 '.../ExponentialMovingAverage' shadows, Keras "
                        "use_ema averages) as the weight; weights without one keep their raw values and are listed")
    p.add_argument("--ema-suffix", metavar="SUFFIX",
                   help="with --ema: the shadows' name suffix, when not ExponentialMovingAverage")
    p.add_argument("--intersection", action="store_true",
                   help="merge the entries every source holds alike; leave out the rest")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="the largest shard of the output (5GB, 500MiB, bytes): Hugging Face-style safetensors "
                        "shards plus an index (OUT is then a directory), or with --to tf TF data shards")
    p.add_argument("--num-shards", type=int, metavar="N",
                   help="a TF checkpoint output: write N data shards balanced by bytes (or --max-shard-size)")
    p.add_argument("--config", action="store_true",
                   help="with a *-tf-to-hf rule set, write config.json beside OUT (sizes read from the shapes)")
    p.add_argument("--heads", type=int, metavar="N",
                   help="attention heads for --config (cannot be read from shapes; default hidden size / 64)")
    p.add_argument("--max-output-bytes", type=int, metavar="N",
                   help="refuse a .pt/.npz source whose tensors expand past N bytes "
                        "(default: the larger of 1 GiB and 64x the file)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _distributed_option(p)


def _distributed_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed", action=argparse.BooleanOptionalAction, default=None,
                   help="write the safetensors shards across the ranks of a torch.distributed gloo group "
                        "(default: on when torchrun or srun started several ranks; docs/cluster.md)")


def _config_arg(args):
    from restorekit.export._hf import rule_set

    if args.heads is not None and not args.config:
        raise _Usage("--heads goes with --config")
    if not args.config:
        return None
    if args.heads is None:
        return True
    model = rule_set(args.rules).model if args.rules else None
    return {"n_head" if model == "gpt2" else "num_attention_heads": args.heads}


def _ema_arg(args):
    if args.ema_suffix is not None and not args.ema:
        raise _Usage("--ema-suffix goes with --ema")
    return (args.ema_suffix or True) if args.ema else None


@register("convert", help="convert between TF checkpoints, PyTorch, safetensors, npz and Keras weights files",
          configure=_convert_args)
def _convert(args) -> int:
    from restorekit.export import convert

    max_shard_size = _size_arg(args.max_shard_size)
    with reworded_exists_error(args.out):
        result = convert(args.src, args.out, to=args.to, layout=args.layout, rules=args.rules,
                         weights_only=args.weights_only, ema=_ema_arg(args), max_shard_size=max_shard_size,
                         config=_config_arg(args), overwrite=args.overwrite, progress=not _quiet(args),
                         max_output_bytes=args.max_output_bytes, num_shards=args.num_shards,
                         distributed=_distributed_arg(args))
    if not _quiet(args) and _first_rank():
        print(result)
    return EXIT_OK


def _size_arg(value):
    """--max-shard-size: bytes as an int, else the string ('5GB') for parse_size."""
    return int(value) if value and value.isdigit() else value


def _distributed_arg(args) -> bool:
    """--distributed, else on when a launcher (torchrun, srun) started this process among several ranks."""
    from restorekit._bundle.ranks import launched_size

    return args.distributed if args.distributed is not None else launched_size() > 1


def _first_rank() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"




# ------------------------------------------------------------------ average

def _average_args(p: argparse.ArgumentParser) -> None:
    from restorekit.export import FORMATS

    p.add_argument("paths", nargs="+", metavar="SRC... OUT",
                   help="two or more source checkpoints (any format convert reads), then the output")
    p.add_argument("--weights", nargs="+", type=float, metavar="W",
                   help="one weight per source (default: equal); normalized by their sum")
    _pairing_options(p)
    p.add_argument("--include", action="append", metavar="PATTERN", help="average only entries matching PATTERN")
    p.add_argument("--exclude", action="append", metavar="PATTERN", help="leave out entries matching PATTERN")
    p.add_argument("--keep-optimizer", action="store_true",
                   help="average optimizer state and keep global_step too (default: weights only)")
    p.add_argument("--intersection", action="store_true",
                   help="average the entries every source holds alike; leave out the rest")
    p.add_argument("--mismatch", choices=["error", "first", "last"], default="error",
                   help="integer, boolean or string entries that differ: fail (default) or take one source's")
    p.add_argument("--to", choices=FORMATS, help="output format (default: from OUT's extension, else tf)")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="the largest shard (5GB, 500MiB, bytes): Hugging Face-style safetensors shards plus an index "
                        "(OUT is then a directory)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _distributed_option(p)


@register("average", help="write the (weighted) mean of several checkpoints, tensor by tensor",
          configure=_average_args)
def _average(args) -> int:
    from restorekit._averaging import average

    if len(args.paths) < 3:
        raise _Usage("average takes two or more sources and an output: SRC SRC [SRC...] OUT")
    *sources, out = args.paths
    with reworded_exists_error(out):
        result = average(sources, out, weights=args.weights, layout=args.layout, rules=args.rules,
                         include=args.include, exclude=args.exclude, weights_only=not args.keep_optimizer, intersection=args.intersection,
                         mismatch=args.mismatch, to=args.to, max_shard_size=_size_arg(args.max_shard_size),
                         overwrite=args.overwrite, progress=not _quiet(args), distributed=_distributed_arg(args))
    if not _quiet(args) and _first_rank():
        print(result)
    return EXIT_OK


# ------------------------------------------------------------------ merge

def _merge_args(p: argparse.ArgumentParser) -> None:
    from restorekit.export import FORMATS

    p.add_argument("recipe", help="a mergekit-style YAML recipe (merge_method, base_model, models, parameters, dtype)")
    p.add_argument("out", help="the output: a file by its extension, or a directory (Hugging Face shards when the base "
                               "model is a Hugging Face directory, else a TF checkpoint)")
    p.add_argument("--to", choices=FORMATS, help="output format (default: from OUT's extension)")
    _pairing_options(p)
    p.add_argument("--include", action="append", metavar="PATTERN", help="merge only entries matching PATTERN")
    p.add_argument("--exclude", action="append", metavar="PATTERN", help="leave out entries matching PATTERN")
    p.add_argument("--mismatch", choices=["error", "first", "last"], default="error",
                   help="integer, boolean or string entries that differ: fail (default) or take one source's")
    p.add_argument("--intersection", action="store_true",
                   help="merge the entries every source holds alike; leave out the rest")
    p.add_argument("--max-shard-size", metavar="SIZE", help="the largest safetensors shard, e.g. 5GB (a directory output)")
    p.add_argument("--seed", type=int, default=0, help="seed of DARE's drop masks (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _distributed_option(p)


@register("merge", help="merge models as a mergekit recipe says (linear, task_arithmetic, ties, dare_linear, "
                        "dare_ties, slerp), tensor by tensor", configure=_merge_args)
def _merge(args) -> int:
    from restorekit._merging import merge

    with reworded_exists_error(args.out):
        result = merge(args.recipe, args.out, to=args.to, layout=args.layout, rules=args.rules, include=args.include,
                       exclude=args.exclude,
                       intersection=args.intersection, mismatch=args.mismatch,
                       max_shard_size=_size_arg(args.max_shard_size), seed=args.seed, overwrite=args.overwrite,
                       progress=not _quiet(args), distributed=_distributed_arg(args))
    if not _quiet(args) and _first_rank():
        print(result)
    return EXIT_OK
