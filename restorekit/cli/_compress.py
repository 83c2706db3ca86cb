"""``restorekit compress``: a model to a smaller .tflite or .onnx, checked; ``inspect`` / ``verify`` of those files."""

from __future__ import annotations

import argparse

from restorekit.cli._base import EXIT_DIFFERENT, EXIT_OK, Usage, _print_json, _quiet, register


def _compress_args(p: argparse.ArgumentParser) -> None:
    from restorekit.compress import BACKENDS, PRECISIONS

    p.add_argument("src", help="a frozen .pb, a checkpoint (prefix or directory), a SavedModel directory or a "
                               "Keras .keras/.h5 model file")
    p.add_argument("out", help="the .tflite (--backend tflite) or .onnx (onnx, tensorrt) file to write")
    p.add_argument("--precision", choices=PRECISIONS, default="fp16", help="default: fp16")
    p.add_argument("--inputs", help="comma-separated input names (default: the graph's placeholders)")
    p.add_argument("--outputs", help="comma-separated output names (default: what 'graph inspect' finds; "
                                     "required for a checkpoint)")
    p.add_argument("--graph", help="the .meta (or .pb) of a checkpoint SRC (default: PREFIX.meta)")
    p.add_argument("--representative", metavar="N.npz",
                   help="samples along the first axis, one array per input name (needed for int8)")
    p.add_argument("--max-error", type=float, metavar="X", help="write nothing if an output moves more than X")
    p.add_argument("--backend", choices=BACKENDS, default="tflite",
                   help="tflite (LiteRT), onnx (checked on ONNX Runtime), or tensorrt (the TensorRT-ready ONNX; "
                        "prints the engine build that remains); default: tflite")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("compress", help="compress a model to fp16/int8 .tflite or .onnx and check it against the original",
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


# ------------------------------------------------------------------ inspect / verify of .tflite and .onnx


def is_model_file(path) -> bool:
    from restorekit.compress._files import is_model_file

    return is_model_file(path)


def inspect_model_file(args) -> int:
    """``restorekit inspect model.onnx``: inputs, outputs, ops and tensors (``--filter`` picks tensors)."""
    import dataclasses
    import re

    from restorekit.compress._files import inspect_model

    if args.stats or args.tensor:
        raise Usage(f"--stats and --tensor read checkpoints and ONNX models; {args.checkpoint!r} is a .tflite "
                    f"model file (inspect lists its inputs, outputs, ops and tensors)")
    summary = inspect_model(args.checkpoint)
    if args.filter:
        pattern = re.compile(args.filter)
        summary = dataclasses.replace(summary, tensors=tuple(t for t in summary.tensors if pattern.match(t.name)))
    if args.json:
        _print_json(summary.to_dict())
    else:
        print(summary)
    return EXIT_OK


def verify_model_file(args) -> int:
    """``restorekit verify model.onnx``: onnx.checker and an ONNX Runtime load (LiteRT for .tflite)."""
    from restorekit.compress._files import verify_model

    problems = verify_model(args.checkpoint)
    if args.json:
        _print_json({"path": args.checkpoint, "ok": not problems, "problems": problems})
    elif problems:
        print("\n".join(f"{args.checkpoint}: {p}" for p in problems))
    else:
        print(f"{args.checkpoint}: ok")
    return EXIT_OK if not problems else EXIT_DIFFERENT
