"""The ``restorekit`` command: a thin layer over the Python API.

Commands::

    restorekit inspect CKPT [--stats] [--filter PATTERN] [--tensor NAME] [--tf-names] [--json]
    restorekit verify CKPT [--json]
    restorekit diff A B [--atol X] [--by key|path] [--json]
    restorekit scan CKPT [CKPT...] | --source PATTERN=PATH... --meta-graph FILE.meta [--json]
    restorekit rename CKPT OUT (--rule REGEX=REPL ... | --map FILE.json)
    restorekit strip CKPT OUT
    restorekit cast CKPT OUT --dtype DTYPE [--filter PATTERN]
    restorekit convert SRC OUT [--to torch|safetensors|npz|tf] [--layout torch]
    restorekit average SRC SRC... OUT [--weights W...] [--intersection] [--mismatch error|first|last]
    restorekit merge RECIPE.yml OUT [--to FORMAT] [--layout torch | --rules NAME] [--max-shard-size SIZE] [--seed N] [--mismatch error|first|last]
    restorekit graph inspect FILE [--json]
    restorekit freeze CKPT GRAPH --outputs a,b --out F.pb
    restorekit unfreeze F.pb OUT_PREFIX [--weights auto|large|n1,n2] [--reference R] [--trainable-graph]
    restorekit compress SRC OUT [--precision fp16|int8|dynamic-int8|fp32] [--representative N.npz] [--max-error X]
    restorekit demo [--seeds N] [--steps N] [--shots N] [--out DIR]

Exit codes:
    0  success; ``diff``: the checkpoints are equal; ``scan``: every variable restores; ``verify``: sound
    1  ``diff``: the checkpoints differ; ``scan``: the restore would be incomplete; ``verify``: problems found
    2  usage error (bad arguments)
    3  restorekit error: missing or corrupt checkpoint, unsafe file, output exists, ...

Errors print as one line, ``restorekit: error: ...``, without a traceback; advice in them
names this command's flags and commands (``RestoreKitError.for_cli``), never Python calls. Progress
bars go to stderr, only when it is a terminal, and never with ``--quiet``.

More commands plug in through :func:`register` (``graph inspect``, ``freeze``, ...).
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import zipfile
import warnings
from typing import Sequence

from restorekit._tensorflow import quiet_logs
from restorekit.cli import _checkpoints as checkpoints, _compress as compress, _edits as edits, _graphs as graphs, _lora as lora  # noqa: F401  (each registers its commands)
from restorekit.cli._base import (  # noqa: F401
    COMMANDS,
    EXIT_DIFFERENT,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    Command,
    Parser as _Parser,
    Usage as _Usage,
    _EPILOG,
    register,
)

__all__ = ["COMMANDS", "Command", "main", "register"]


# ------------------------------------------------------------------ demo

def _demo_args(parser: argparse.ArgumentParser) -> None:
    from restorekit.demo import DESCRIPTION, add_arguments

    parser.description = DESCRIPTION
    add_arguments(parser)


@register("demo", help="run the transfer-learning demo: pretrain on digits 0-4, learn 5-9 from a few "
          "images cold, as a frozen probe and warm", configure=_demo_args)
def _demo(args) -> int:
    from restorekit.demo import run_demo

    run_demo(args.out, seeds=args.seeds, steps=args.steps, shots=args.shots)
    return EXIT_OK


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
        _set_cli_flags(p)
    return parser


def _set_cli_flags(parser: argparse.ArgumentParser, inherited: frozenset = frozenset()) -> None:
    """Give each (sub)command its options by keyword, so an error's advice names only flags it has.

    A subcommand (``graph repair``) sets its own: argparse copies a subparser's defaults over
    its parent's, so the flags of the command that actually ran are the ones the error sees.
    """
    flags = inherited | frozenset(a.dest for a in parser._actions if a.option_strings)
    parser.set_defaults(cli_flags=flags)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _set_cli_flags(child, flags)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``restorekit`` command; return its exit code (see the module docstring)."""
    quiet_logs()
    parser = build_parser()
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return _run(parser, argv)
    finally:
        warnings.formatwarning = formatwarning


def _run(parser: argparse.ArgumentParser, argv) -> int:
    from restorekit.errors import RestoreKitError

    args = None
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            raise _Usage(f"unrecognized arguments: {' '.join(extra)}")
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
        if isinstance(e, RestoreKitError):  # advice worded as this command's flags, by the error's own fields
            e = e.for_cli(getattr(args, "cli_flags", frozenset()))
        message = str(e) or type(e).__name__
        if isinstance(e, OSError) and not isinstance(e, RestoreKitError) and e.filename:
            message = f"{e.strerror or e}: {e.filename!r}"
        print(f"restorekit: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("restorekit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _from_bad_input(e):
            raise  # a bug in restorekit: the traceback is what a report needs
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"restorekit: error: {type(e).__name__}: {first}", file=sys.stderr)
        return EXIT_ERROR


# Exceptions that bad input (a crafted file, a path TF cannot reach) raises from inside
# numpy, TensorFlow or the standard library; the library turns the ones it knows into
# restorekit errors, and the shell still owes the user one line for the rest.
_BAD_INPUT = (MemoryError, OverflowError, RecursionError, UnicodeError, EOFError, struct.error, zipfile.BadZipFile)


def _from_bad_input(e: BaseException) -> bool:
    return isinstance(e, _BAD_INPUT) or type(e).__module__.startswith(("tensorflow", "google.protobuf"))


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"restorekit: warning: {message}\n"
