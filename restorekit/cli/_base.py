"""What every ``restorekit`` command shares: the registry, exit codes, output helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass
from typing import Callable

__all__ = ["COMMANDS", "Command", "EXIT_DIFFERENT", "EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "Parser", "Usage", "cli_exists_error", "register", "reworded_exists_error"]

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


class Usage(Exception):
    """A usage error found after parsing (exit 2)."""




class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as argparse does, but through main()
        self.print_usage(sys.stderr)
        raise Usage(message)


def cli_exists_error(e, out):
    """The library's OutputExistsError, reworded for the shell by its fields (never by its text)."""
    from restorekit.errors import OutputExistsError

    if e.is_source:
        return OutputExistsError(f"{out!r} is the source checkpoint; name another output", path=out, is_source=True)
    return e  # words its own advice for the shell (RestoreKitError.for_cli, in main): '--overwrite', or a lock's


@contextlib.contextmanager
def reworded_exists_error(out):
    """An OutputExistsError from the library leaves this block reworded for the shell."""
    from restorekit.errors import OutputExistsError

    try:
        yield
    except OutputExistsError as e:
        raise cli_exists_error(e, out) from None


def _pairing_options(p: argparse.ArgumentParser,
                     layout_help: str = "pair the sources by PyTorch names and axes (layout='torch')",
                     rules_help: str = "see every source through a rule set (bert-tf-to-hf, gpt2-tf-to-hf, ...) to pair "
                                       "them by name") -> None:
    """``--layout`` and ``--rules``, the same two options (and the same resolution) on convert, average and merge."""
    p.add_argument("--layout", choices=["torch"], help=layout_help)
    p.add_argument("--rules", metavar="RULE_SET", help=rules_help)
