"""The ``restorekit`` command: a thin layer over the Python API.

Commands::

    restorekit inspect CKPT [--stats] [--filter PATTERN] [--json]
    restorekit diff A B [--atol X] [--json]
    restorekit scan CKPT --meta-graph FILE.meta [--json]
    restorekit rename CKPT OUT (--rule REGEX=REPL ... | --map FILE.json)
    restorekit strip CKPT OUT
    restorekit cast CKPT OUT --dtype DTYPE [--filter PATTERN]
    restorekit convert SRC OUT [--to torch|safetensors|npz|tf] [--layout torch]
    restorekit graph inspect FILE [--json]
    restorekit freeze CKPT GRAPH --outputs a,b --out F.pb
    restorekit unfreeze F.pb OUT_PREFIX [--weights auto|large|n1,n2] [--reference R] [--trainable-graph]
    restorekit demo [--seeds N] [--steps N] [--out DIR]

Exit codes:
    0  success; ``diff``: the checkpoints are equal; ``scan``: every variable restores
    1  ``diff``: the checkpoints differ; ``scan``: the restore would be incomplete
    2  usage error (bad arguments)
    3  restorekit error: missing or corrupt checkpoint, unsafe file, output exists, ...

Errors print as one line, ``restorekit: error: ...``, without a traceback. Progress
bars go to stderr, only when it is a terminal, and never with ``--quiet``.

More commands plug in through :func:`register` (``graph inspect``, ``freeze``, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

from restorekit._tensorflow import import_tensorflow
from restorekit.compare import diff_checkpoints, tensor_stats
from restorekit.report import format_bytes, format_shape

__all__ = ["COMMANDS", "Command", "main", "register"]

EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
_EPILOG = """exit codes: 0 ok (equal, complete); 1 differences found (diff) or incomplete
restore (scan); 2 usage error; 3 restorekit error (missing or corrupt checkpoint,
unsafe file, output exists, ...)."""


@dataclass(frozen=True)
class Command:
    """One subcommand: ``configure`` adds its arguments, ``run`` returns an exit code.

    ``configure`` may add its own subparsers (``graph inspect``); each leaf then sets
    ``run`` with ``parser.set_defaults(run=...)``.
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int] | None


COMMANDS: dict[str, Command] = {}


def register(name: str, *, help: str, configure: Callable[[argparse.ArgumentParser], None] | None = None):
    """Add a subcommand; decorate its ``run(args) -> int``.

        @register('freeze', help='freeze a checkpoint into a .pb', configure=_freeze_args)
        def _freeze(args): ...
    """

    def decorate(run):
        COMMANDS[name] = Command(name, help, configure or (lambda parser: None), run)
        return run

    return decorate


# ------------------------------------------------------------------ output helpers

def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _print_json(data) -> None:
    print(json.dumps(_jsonable(data), indent=2, sort_keys=False))


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _num(x) -> str:
    if x is None:
        return "-"
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def _quiet(args) -> bool:
    return bool(getattr(args, "quiet", False))


# ------------------------------------------------------------------ inspect


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint prefix, directory, .index file or SavedModel")
    p.add_argument("--filter", metavar="PATTERN", help="only names matching this pattern (a regex from the start)")
    p.add_argument("--stats", action="store_true", help="read every tensor: min, max, mean, NaN count")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("inspect", help="list a checkpoint's tensors (names, shapes, dtypes, sizes)", configure=_inspect_args)
def _inspect(args) -> int:
    from restorekit.checkpoint import Checkpoint
    from restorekit.names import PatternSet

    ckpt = Checkpoint(args.checkpoint)
    names = list(ckpt.entries)
    if args.filter:
        patterns = PatternSet([args.filter], what="--filter")
        names = [n for n in names if patterns.first_match(n) is not None]
        patterns.check_all_used(ckpt.entries)
    rows = []
    for name in names:
        entry = ckpt.entries[name]
        row = {"name": name, "shape": list(entry.shape), "dtype": entry.dtype, "nbytes": entry.nbytes}
        if args.stats:
            row["stats"] = tensor_stats(ckpt.read(name))
        rows.append(row)
    total = sum(r["nbytes"] for r in rows)
    if args.json:
        _print_json({"checkpoint": ckpt.prefix, "count": len(rows), "nbytes": total, "entries": rows})
        return EXIT_OK
    header = ["NAME", "SHAPE", "DTYPE", "SIZE"] + (["MIN", "MAX", "MEAN", "NANS"] if args.stats else [])
    lines = []
    for r in rows:
        line = [r["name"], format_shape(r["shape"]), r["dtype"], format_bytes(r["nbytes"])]
        if args.stats:
            s = r["stats"]
            line += [_num(s["min"]), _num(s["max"]), _num(s["mean"]), str(s["nans"])]
        lines.append(line)
    print(_table(lines, header))
    print(f"{len(rows)} tensors, {format_bytes(total)} in {ckpt.prefix!r}")
    return EXIT_OK


# ------------------------------------------------------------------ diff

def _diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--atol", type=float, default=0.0, help="values within this max abs difference count as equal")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("diff", help="compare two checkpoints (exit 0 when equal, 1 when different)", configure=_diff_args)
def _diff(args) -> int:
    if not args.atol >= 0:
        raise _Usage(f"--atol must be a number >= 0, got {args.atol}")
    result = diff_checkpoints(args.a, args.b, atol=args.atol)
    if args.json:
        _print_json(result)
    else:
        for name in result["only_in_a"]:
            print(f"only in A  {name}")
        for name in result["only_in_b"]:
            print(f"only in B  {name}")
        for c in result["changed"]:
            print(f"changed    {c['name']}: {c['a']['dtype']} {format_shape(c['a']['shape'])} -> "
                  f"{c['b']['dtype']} {format_shape(c['b']['shape'])}")
        for v in result["values"]:
            diff = v["max_abs_diff"]
            how = "NaNs in different places" if diff is not None and math.isnan(diff) else f"max abs diff {_num(diff)}"
            print(f"values     {v['name']}: {how} ({v['differing']} elements differ)")
        verdict = "equal" if result["equal"] else "different"
        same = "identical" if args.atol == 0 else f"equal within {args.atol:g}"
        print(f"{verdict}: {result['same']} tensors {same}, {len(result['only_in_a'])} only in A, "
              f"{len(result['only_in_b'])} only in B, {len(result['changed'])} changed shape/dtype, "
              f"{len(result['values'])} changed values")
    return EXIT_OK if result["equal"] else EXIT_DIFFERENT


# ------------------------------------------------------------------ scan

def _scan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint to restore from")
    p.add_argument("--meta-graph", required=True, metavar="FILE.meta", help="the model's MetaGraph (.meta)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


@register("scan", help="report what a restore into a graph's variables would do", configure=_scan_args)
def _scan(args) -> int:
    import os

    from restorekit.checkpoint import Checkpoint
    from restorekit.errors import CheckpointNotFoundError, GraphError

    checkpoint = Checkpoint(args.checkpoint)  # fail fast, before importing TensorFlow
    if not os.path.isfile(args.meta_graph):
        raise CheckpointNotFoundError(f"no MetaGraph file at {args.meta_graph!r}", args.meta_graph)
    tf = import_tensorflow()

    import restorekit

    with tf.Graph().as_default():
        try:
            tf.compat.v1.train.import_meta_graph(args.meta_graph, clear_devices=True)
        except Exception as e:  # TF raises DecodeError, IOError, ValueError, ... for bad files
            raise GraphError(f"cannot import MetaGraph {args.meta_graph!r}: {e}") from None
        report = restorekit.scan(checkpoint, variables=tf.compat.v1.global_variables())
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report)
    return EXIT_OK if report.is_complete else EXIT_DIFFERENT


# ------------------------------------------------------------------ edits

def _edit_io(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="source checkpoint")
    p.add_argument("out", help="output checkpoint prefix, or an existing directory (never the source)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output checkpoint")
    p.add_argument("--update-state-file", action="store_true",
                   help="point the output directory's 'checkpoint' file at the output (for tf.train.latest_checkpoint)")


def _editor(path):
    from restorekit.edit import CheckpointEditor

    return CheckpointEditor(path)


def _cli_exists_error(e, out):
    """The library's OutputExistsError, reworded for the shell by its fields (never by its text)."""
    from restorekit.errors import OutputExistsError

    if e.is_source:
        return OutputExistsError(f"{out!r} is the source checkpoint; name another output", path=out, is_source=True)
    if e.path is None:
        return e
    return OutputExistsError(f"{e.path!r} exists; pass --overwrite to replace it", path=e.path)


def _save(editor, args) -> int:
    from restorekit.errors import OutputExistsError

    try:
        prefix = editor.save(args.out, overwrite=args.overwrite, update_state_file=args.update_state_file,
                             progress=not _quiet(args))
    except OutputExistsError as e:
        raise _cli_exists_error(e, args.out) from None
    if not _quiet(args):
        print(f"wrote {prefix!r}")
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


@register("strip", help="drop optimizer slots (Momentum, Adam, ...)", configure=_edit_io)
def _strip(args) -> int:
    editor = _editor(args.checkpoint)
    editor.strip_optimizer_slots()
    return _save(editor, args)


def _cast_args(p: argparse.ArgumentParser) -> None:
    _edit_io(p)
    p.add_argument("--dtype", required=True, help="target dtype: bfloat16, float16, float32, ...")
    p.add_argument("--filter", metavar="PATTERN", default=".*", help="only names matching this pattern (default: all)")


@register("cast", help="cast tensors to another dtype", configure=_cast_args)
def _cast(args) -> int:
    editor = _editor(args.checkpoint)
    editor.cast(args.filter, args.dtype)
    return _save(editor, args)


def _convert_args(p: argparse.ArgumentParser) -> None:
    from restorekit.export import FORMATS

    p.add_argument("src", help="TF checkpoint, .pt/.pth, .safetensors or .npz file")
    p.add_argument("out", help="output file, or checkpoint prefix for --to tf")
    p.add_argument("--to", choices=FORMATS, help="output format (default: from OUT's extension, else tf)")
    p.add_argument("--layout", choices=["torch"], help="PyTorch names and axes (reversed on the way back)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")


@register("convert", help="convert between TF checkpoints, PyTorch, safetensors and npz", configure=_convert_args)
def _convert(args) -> int:
    from restorekit.export import convert

    result = convert(args.src, args.out, to=args.to, layout=args.layout, overwrite=args.overwrite,
                     progress=not _quiet(args))
    if not _quiet(args):
        print(result)
    return EXIT_OK


# ------------------------------------------------------------------ main

class _Usage(Exception):
    """A usage error found after parsing (exit 2)."""


# ------------------------------------------------------------------ graphs

def _graph_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="graph_command", metavar="SUBCOMMAND", parser_class=_Parser)
    inspect = sub.add_parser("inspect", help="inputs, outputs, variables and ops of a .pb, .meta or SavedModel")
    inspect.add_argument("file", help="a .pb/.pbtxt GraphDef, a .meta MetaGraph or a SavedModel directory")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(run=_graph_inspect)


@register("graph", help="inspect graph files (graph inspect FILE)", configure=_graph_args)
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


# ------------------------------------------------------------------ demo

@register("demo", help="run the transfer-learning demo (warm start vs from scratch on digits); "
          "options: --seeds N --steps N --shots N --out DIR")
def _demo(args) -> int:
    from restorekit.demo import main as demo_main

    return demo_main(list(args.extra))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as argparse does, but through main()
        self.print_usage(sys.stderr)
        raise _Usage(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered command."""
    from restorekit import __version__

    parser = _Parser(prog="restorekit", description="Inspect, compare, edit and convert TensorFlow checkpoints.",
                     epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"restorekit {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or summaries")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for command in COMMANDS.values():
        p = sub.add_parser(command.name, help=command.help, description=command.help, epilog=_EPILOG)
        p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        command.configure(p)
        if command.run is not None:
            p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``restorekit`` command; return its exit code (see the module docstring)."""
    parser = build_parser()
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return _run(parser, argv)
    finally:
        warnings.formatwarning = formatwarning


def _run(parser: argparse.ArgumentParser, argv) -> int:
    from restorekit.errors import RestoreKitError

    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "demo":  # the demo parses its own options
            raise _Usage(f"unrecognized arguments: {' '.join(extra)}")
        args.extra = extra
        if getattr(args, "run", None) is None:
            raise _Usage(f"{args.command!r} needs a subcommand")
        return int(args.run(args))
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else EXIT_OK if e.code is None else EXIT_USAGE
    except _Usage as e:
        print(f"restorekit: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `restorekit inspect ... | head`: the reader has what it wanted
        try:  # no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # stdout replaced (tests) or closed
            pass
        return EXIT_OK
    except (RestoreKitError, OSError) as e:
        message = str(e) or type(e).__name__
        if isinstance(e, OSError) and not isinstance(e, RestoreKitError) and e.filename:
            message = f"{e.strerror or e}: {e.filename!r}"
        print(f"restorekit: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("restorekit: interrupted", file=sys.stderr)
        return 130


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"restorekit: warning: {message}\n"
