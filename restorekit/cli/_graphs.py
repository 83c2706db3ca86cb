"""``restorekit graph inspect``, ``freeze`` and ``unfreeze``."""

from __future__ import annotations

import argparse

from restorekit.cli._base import (
    reworded_exists_error,
    EXIT_OK,
    Parser as _Parser,
    Usage as _Usage,
    _print_json,
    _quiet,
    register,
)


# ------------------------------------------------------------------ graphs

def _graph_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="graph_command", metavar="SUBCOMMAND", parser_class=_Parser)
    inspect = sub.add_parser("inspect", help="inputs, outputs, variables and ops of a .pb, .meta or SavedModel")
    inspect.add_argument("file", help="a .pb/.pbtxt GraphDef, a .meta MetaGraph or a SavedModel directory")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(run=_graph_inspect)
    repair = sub.add_parser("repair", help="write the graph repaired so it loads in this TensorFlow (old TF 1.x graphs)")
    repair.add_argument("file", help="a .pb/.pbtxt GraphDef, a .meta MetaGraph or a SavedModel directory")
    repair.add_argument("out", help="the repaired graph to write (.pbtxt/.metatxt write text)")
    repair.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    repair.set_defaults(run=_graph_repair)


@register("graph", help="inspect or repair graph files (graph inspect FILE, graph repair FILE OUT)",
          configure=_graph_args)
def _graph(args) -> int:
    raise _Usage("'graph' needs a subcommand: graph inspect FILE, or graph repair FILE OUT")


def _graph_inspect(args) -> int:
    from restorekit.graph import inspect_graph

    summary = inspect_graph(args.file)
    if args.json:
        _print_json(summary.to_dict())
    else:
        print(summary)
    return EXIT_OK


def _graph_repair(args) -> int:
    from restorekit.graph import inspect_graph, repair_graph

    with reworded_exists_error(args.out):
        repair_graph(args.file, args.out, overwrite=args.overwrite)
    if not _quiet(args):
        repaired = inspect_graph(args.file).repaired
        print(f"wrote {args.out}: " + ("; ".join(repaired) if repaired else "nothing needed repair"))
    return EXIT_OK


def _freeze_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint prefix or directory")
    parser.add_argument("graph", help="a .meta MetaGraph (or a GraphDef file)")
    parser.add_argument("--outputs", required=True, help="comma-separated output node or tensor names")
    parser.add_argument("--out", required=True, help="the frozen .pb to write (.pbtxt writes text)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")


@register("freeze", help="freeze a checkpoint into a .pb", configure=_freeze_args)
def _freeze(args) -> int:
    from restorekit.graph import freeze

    with reworded_exists_error(args.out):
        graph_def = freeze(args.checkpoint, args.graph, args.outputs, out=args.out, overwrite=args.overwrite)
    if not _quiet(args):
        print(f"wrote {args.out}: {len(graph_def.node)} nodes")
    return EXIT_OK


def _unfreeze_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("frozen", help="a frozen .pb")
    parser.add_argument("out_prefix", help="the checkpoint prefix to write")
    parser.add_argument("--weights", default="auto",
                        help="'auto' (variable patterns), 'large' (every float constant over --min-bytes), "
                             "or comma-separated node names")
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--reference", help="a checkpoint or .meta whose names to align to")
    parser.add_argument("--trainable-graph", action="store_true", help="also write a trainable .meta")
    parser.add_argument("--max-output-bytes", type=int, metavar="N",
                        help="refuse an output larger than N bytes (default: the larger of 1 GiB and 64x the .pb)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output checkpoint and .meta")
    parser.add_argument("--json", action="store_true", help="print JSON")


@register("unfreeze", help="turn a frozen .pb back into a checkpoint (and a trainable graph)",
          configure=_unfreeze_args)
def _unfreeze(args) -> int:
    from restorekit.graph import unfreeze

    weights = args.weights if args.weights in ("auto", "large") else [w for w in args.weights.split(",") if w]
    with reworded_exists_error(args.out_prefix):
        result = unfreeze(args.frozen, args.out_prefix, weights=weights, reference=args.reference,
                          trainable_graph=args.trainable_graph, min_bytes=args.min_bytes,
                          max_output_bytes=args.max_output_bytes, overwrite=args.overwrite)
    if args.json:
        import dataclasses

        _print_json(dataclasses.asdict(result))
    else:
        print(result)
    return EXIT_OK


