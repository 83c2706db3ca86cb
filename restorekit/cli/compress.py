"""``restorekit compress``: a frozen graph, checkpoint or SavedModel to a smaller .tflite, checked."""

from __future__ import annotations

import argparse

from restorekit.cli.base import EXIT_OK, _print_json, _quiet, register


def _compress_args(p: argparse.ArgumentParser) -> None:
    from restorekit.compress import BACKENDS, PRECISIONS

    p.add_argument("src", help="a frozen .pb, a checkpoint (prefix or directory) or a SavedModel directory")
    p.add_argument("out", help="the .tflite file to write")
    p.add_argument("--precision", choices=PRECISIONS, default="fp16", help="default: fp16")
    p.add_argument("--inputs", help="comma-separated input names (default: the graph's placeholders)")
    p.add_argument("--outputs", help="comma-separated output names (default: what 'graph inspect' finds; "
                                     "required for a checkpoint)")
    p.add_argument("--graph", help="the .meta (or .pb) of a checkpoint SRC (default: PREFIX.meta)")
    p.add_argument("--representative", metavar="N.npz",
                   help="samples along the first axis, one array per input name (needed for int8)")
    p.add_argument("--max-error", type=float, metavar="X", help="write nothing if an output moves more than X")
    p.add_argument("--backend", choices=BACKENDS, default="tflite", help="default: tflite")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("compress", help="compress a model to fp16/int8 .tflite and check it against the original",
          configure=_compress_args)
def _compress(args) -> int:
    from restorekit.compress import compress
    from restorekit.errors import OutputExistsError

    try:
        result = compress(args.src, args.out, outputs=args.outputs, inputs=args.inputs, precision=args.precision,
                          representative_data=args.representative, backend=args.backend,
                          max_error=args.max_error, overwrite=args.overwrite, graph=args.graph)
    except OutputExistsError as e:
        if e.is_source or e.path is None:
            raise
        # The library's advice is a keyword; in the shell it is a flag (decided by the fields, not the text).
        raise OutputExistsError(f"{e.path!r} exists; pass --overwrite to replace it", path=e.path) from None
    if args.json:
        _print_json(result.to_dict())
    elif not _quiet(args):
        print(result)
    return EXIT_OK
