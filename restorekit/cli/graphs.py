"""``restorekit graph inspect``, ``freeze`` and ``unfreeze``."""

from __future__ import annotations

import argparse

from restorekit.cli.base import (
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


@register("graph", help="inspect graph files (graph inspect FILE)", configure=_graph_args)
def _graph(args) -> int:
    raise _Usage("'graph' needs a subcommand: graph inspect FILE")


def _graph_inspect(args) -> int:
    from restorekit.graph import inspect_graph

    summary = inspect_graph(args.file)
    if args.json:
        _print_json(summary.to_dict())
    else:
        print(summary)
    return EXIT_OK


def _freeze_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint prefix or directory")
    parser.add_argument("graph", help="a .meta MetaGraph (or a GraphDef file)")
    parser.add_argument("--outputs", required=True, help="comma-separated output node or tensor names")
    parser.add_argument("--out", required=True, help="the frozen .pb to write (.pbtxt writes text)")


@register("freeze", help="freeze a checkpoint into a .pb", configure=_freeze_args)
def _freeze(args) -> int:
    from restorekit.graph import freeze

    graph_def = freeze(args.checkpoint, args.graph, args.outputs, out=args.out)
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
    parser.add_argument("--json", action="store_true", help="print JSON")


@register("unfreeze", help="turn a frozen .pb back into a checkpoint (and a trainable graph)",
          configure=_unfreeze_args)
def _unfreeze(args) -> int:
    from restorekit.graph import unfreeze

    weights = args.weights if args.weights in ("auto", "large") else [w for w in args.weights.split(",") if w]
    result = unfreeze(args.frozen, args.out_prefix, weights=weights, reference=args.reference,
                      trainable_graph=args.trainable_graph, min_bytes=args.min_bytes)
    if args.json:
        import dataclasses

        _print_json(dataclasses.asdict(result))
    else:
        print(result)
    return EXIT_OK


