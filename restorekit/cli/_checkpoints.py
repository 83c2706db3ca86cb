"""``restorekit inspect``, ``diff`` and ``scan``: read a checkpoint, compare two, plan a restore."""

from __future__ import annotations

import argparse
import math
import os

from restorekit._tensorflow import import_tensorflow
from restorekit._compare import diff_checkpoints, open_checkpoint, tensor_stats
from restorekit._report import format_bytes, format_shape
from restorekit.cli._base import (
    _quiet,
    EXIT_DIFFERENT,
    EXIT_OK,
    Usage as _Usage,
    _num,
    _print_json,
    _table,
    register,
)


# ------------------------------------------------------------------ inspect


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint prefix, directory, .index file, SavedModel, Keras file, "
                   ".safetensors (or a shard index), .pt or .npz")
    p.add_argument("--filter", metavar="PATTERN",
                   help="only tensors whose name or readable path matches this pattern (a regex from the start)")
    p.add_argument("--stats", action="store_true", help="read every tensor: min, max, mean, NaN count")
    p.add_argument("--tensor", metavar="NAME", help="print one tensor's values (a name or readable path)")
    p.add_argument("--tf-names", action="store_true",
                   help="a file restorekit wrote with a layout (--layout torch): list the TF names and axes it "
                        "converts back to, not the names and shapes stored in the file")
    p.add_argument("--json", action="store_true", help="print JSON")


def _selected(ckpt, pattern) -> list[str]:
    """Entry names whose key or readable path the --filter pattern takes (one pattern rule for both)."""
    from restorekit._names import PatternSet

    names = list(ckpt.entries)
    if not pattern:
        return names
    paths = ckpt.object_paths  # readable path -> key, for object-based (TF2) checkpoints
    path_of = {key: path for path, key in paths.items()}
    patterns = PatternSet([pattern], what="--filter")
    chosen = [n for n in names if patterns.first_match(n) is not None or (
        n in path_of and patterns.first_match(path_of[n]) is not None)]
    patterns.check_all_used([path_of.get(n, n) for n in names])  # each entry once, by the name a person reads
    return chosen


def _print_tensor(ckpt, name: str, as_json: bool) -> int:
    import numpy as np

    from restorekit.errors import NoMatchError

    key = name if name in ckpt.entries else ckpt.object_paths.get(name)
    if key is None:
        raise NoMatchError(f"no tensor {name!r} in {ckpt.prefix!r}.", name=name,
                           candidates=list(ckpt.entries) + list(ckpt.object_paths))
    value = ckpt.read(key)
    entry = ckpt.entries[key]
    if as_json:
        data = value.tolist() if value.dtype != object else [v.decode("utf-8", "replace") for v in value.reshape(-1)]
        _print_json({"name": key, "path": ckpt.readable_name(key), "shape": list(entry.shape), "dtype": entry.dtype,
                     "values": data})
        return EXIT_OK
    print(f"{key} {format_shape(entry.shape)} {entry.dtype}")
    with np.printoptions(threshold=1000, edgeitems=4, linewidth=100):
        print(value)
    return EXIT_OK


@register("inspect", help="list a checkpoint's tensors (names, readable paths, shapes, dtypes, sizes)",
          configure=_inspect_args)
def _inspect(args) -> int:
    from restorekit.cli._compress import inspect_model_file, is_model_file

    from restorekit.formats import detect

    # a .tflite / .onnx: a model for inference, summarized as one; an ONNX model's values read as a checkpoint's
    if is_model_file(args.checkpoint) and not ((args.stats or args.tensor) and detect(args.checkpoint) == "onnx"):
        return inspect_model_file(args)
    tf_view = open_checkpoint(args.checkpoint)
    recorded = getattr(tf_view, "record_layout", None) is not None  # a file restorekit wrote with a layout
    ckpt = tf_view.stored_view() if recorded and not args.tf_names else tf_view
    if args.tensor:
        return _print_tensor(ckpt if _holds(ckpt, args.tensor) else tf_view, args.tensor, args.json)
    readable = ckpt.is_object_based
    fmt = getattr(ckpt, "format", None)  # a FileView: safetensors, torch or npz
    # The other view's name of each entry, shown beside it: the TF name of a stored tensor, or the reverse.
    beside: dict[str, str] = {}
    key = ""
    if recorded:
        stored_of = tf_view.stored_names()
        beside = stored_of if args.tf_names else {stored: name for name, stored in stored_of.items()}
        other = tf_view.stored_view() if args.tf_names else tf_view
        key = "stored" if args.tf_names else "tf"
    rows = []
    for name in _selected(ckpt, args.filter):
        entry = ckpt.entries[name]
        row = {"name": name, "shape": list(entry.shape), "dtype": entry.dtype, "nbytes": entry.nbytes}
        if readable or fmt:  # a file of another format: its path is its name, unless it carries an object graph
            row["path"] = ckpt.readable_name(name)
        if recorded:
            twin = beside.get(name)
            row[f"{key}_name"] = twin
            row[f"{key}_shape"] = list(other.entries[twin].shape) if twin is not None else None
        if args.stats:
            row["stats"] = tensor_stats(ckpt.read(name))
        rows.append(row)
    total = sum(r["nbytes"] for r in rows)
    if args.json:
        where = {"format": fmt} if fmt else {}
        names = {"names": "tf" if args.tf_names or not recorded else "stored"}
        metadata = {"metadata": tf_view.metadata} if getattr(tf_view, "metadata", None) else {}
        _print_json({"checkpoint": ckpt.prefix, **where, **names, "count": len(rows), "nbytes": total,
                     "entries": rows, **metadata})
        return EXIT_OK
    header = (["PATH"] if readable else []) + ["NAME", "SHAPE", "DTYPE", "SIZE"]
    header += [f"{key.upper()} NAME", f"{key.upper()} SHAPE"] if recorded else []
    header += ["MIN", "MAX", "MEAN", "NANS"] if args.stats else []
    lines = []
    for r in rows:
        line = ([r["path"]] if readable else []) + [r["name"], format_shape(r["shape"]), r["dtype"],
                                                   format_bytes(r["nbytes"])]
        if recorded:
            twin = r[f"{key}_name"]
            line += [twin, format_shape(r[f"{key}_shape"])] if twin is not None else ["-", "-"]
        if args.stats:
            st = r["stats"]
            line += [_num(st["min"]), _num(st["max"]), _num(st["mean"]), str(st["nans"])]
        lines.append(line)
    print(_table(lines, header))
    print(f"{len(rows)} tensors, {format_bytes(total)} in {ckpt.prefix!r}{_file_note(tf_view, args.tf_names)}")
    metadata = getattr(tf_view, "metadata", None) or {}  # a torch training checkpoint's step, epoch, ...
    if metadata:
        print(f"metadata ({len(metadata)} plain values):")
    for name, value in metadata.items():
        print(f"  {name} = {value!r}")
    return EXIT_OK


def _holds(ckpt, name: str) -> bool:
    return name in ckpt.entries or name in ckpt.object_paths


def _file_note(ckpt, tf_names: bool) -> str:
    """What names a non-TF file's listing shows: its own, or the TF ones its restorekit record gives back."""
    fmt = getattr(ckpt, "format", None)
    if fmt is None:
        return ""
    if getattr(ckpt, "record_layout", None):
        if tf_names:
            return f" ({fmt}; layout {ckpt.record_layout!r} undone: TF names and axes)"
        return f" ({fmt}, written with layout {ckpt.record_layout!r}: stored names and shapes; --tf-names for the TF view)"
    return f" ({fmt})"


# ------------------------------------------------------------------ verify

def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint prefix, directory, .index file, SavedModel, Keras file, "
                   ".safetensors (or a shard index), .pt or .npz")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("verify", help="check every tensor's bytes against its crc32c and every entry against TF's rules; "
          "read every tensor of a safetensors, .pt or .npz file back (exit 0 when sound, 1 when not)",
          configure=_verify_args)
def _verify(args) -> int:
    from restorekit.cli._compress import is_model_file, verify_model_file

    if is_model_file(args.checkpoint):
        return verify_model_file(args)
    result = open_checkpoint(args.checkpoint).verify(progress=not _quiet(args) and not args.json)
    if args.json:
        checks = {"checks": result.checks} if getattr(result, "checks", "") else {}
        _print_json({"checkpoint": result.prefix, "ok": result.ok, "tensors": result.tensors, "nbytes": result.nbytes,
                     "problems": [{"name": p.name, "kind": p.kind, "message": p.message} for p in result.problems],
                     **checks})
    else:
        print(result)
    return EXIT_OK if result.ok else EXIT_DIFFERENT


# ------------------------------------------------------------------ diff

def _diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first checkpoint (TF, Keras, .safetensors, .pt or .npz)")
    p.add_argument("b", help="second checkpoint (any of the same, in any pairing)")
    p.add_argument("--by", choices=("key", "path"), default=None,
                   help="pair tensors by checkpoint key or by readable path (default: by path when that pairs "
                        "more tensors than keys do)")
    p.add_argument("--atol", type=float, default=0.0, help="values within this max abs difference count as equal")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("diff", help="compare two checkpoints (exit 0 when equal, 1 when different)", configure=_diff_args)
def _diff(args) -> int:
    if not args.atol >= 0:
        raise _Usage(f"--atol must be a number >= 0, got {args.atol}")
    result = diff_checkpoints(args.a, args.b, atol=args.atol, by=args.by or "auto")
    if args.json:
        _print_json(result)
    else:
        paths = result["paths"]

        def shown(name: str) -> str:  # the readable path first, the raw key after it
            return f"{paths[name]} ({name})" if name in paths else name

        for name in result["only_in_a"]:
            print(f"only in A  {shown(name)}")
        for name in result["only_in_b"]:
            print(f"only in B  {shown(name)}")
        for c in result["changed"]:
            print(f"changed    {shown(c['name'])}: {c['a']['dtype']} {format_shape(c['a']['shape'])} -> "
                  f"{c['b']['dtype']} {format_shape(c['b']['shape'])}")
        for v in result["values"]:
            diff = v["max_abs_diff"]
            how = "NaNs in different places" if diff is not None and math.isnan(diff) else f"max abs diff {_num(diff)}"
            print(f"values     {shown(v['name'])}: {how} ({v['differing']} elements differ)")
        verdict = "equal" if result["equal"] else "different"
        same = "identical" if args.atol == 0 else f"equal within {args.atol:g}"
        print(f"{verdict}: {result['same']} tensors {same}, {len(result['only_in_a'])} only in A, "
              f"{len(result['only_in_b'])} only in B, {len(result['changed'])} changed shape/dtype, "
              f"{len(result['values'])} changed values; {_pairing(result['paired_by'], args.by)}"
              + _as_stored(result.get("as_stored")))
    return EXIT_OK if result["equal"] else EXIT_DIFFERENT


def _as_stored(side) -> str:
    if side is None:
        return ""
    return f" ({side.upper()}'s layout record not undone: both as stored, PyTorch names and axes)"


def _pairing(paired_by: str, forced) -> str:
    if paired_by == "key":
        return "paired by key"
    return "paired by readable path" + ("" if forced else " (the keys pair fewer tensors; --by key to pair by key)")


# ------------------------------------------------------------------ scan

def _scan_sources(args):
    """The positional checkpoints (a list) or the ``--source PATTERN=PATH`` pairs (a mapping)."""
    if bool(args.checkpoint) == bool(args.source):
        raise _Usage("pass the checkpoint(s) to restore from, or --source PATTERN=PATH pairs, not both")
    if args.checkpoint:
        return list(args.checkpoint)
    pairs = [s.partition("=") for s in args.source]
    bad = [s for s, (pattern, eq, path) in zip(args.source, pairs) if not (pattern and eq and path)]
    if bad:
        raise _Usage(f"--source takes PATTERN=PATH, got {bad[0]!r}")
    patterns = [pattern for pattern, _, _ in pairs]
    if len(set(patterns)) < len(patterns):
        raise _Usage(f"--source names pattern {next(p for p in patterns if patterns.count(p) > 1)!r} twice")
    return {pattern: path for pattern, _, path in pairs}


def _scan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="*", help="checkpoint to restore from; several: each variable from the first "
                   "that holds its entry")
    p.add_argument("--source", action="append", default=[], metavar="PATTERN=PATH",
                   help="restore the variables PATTERN takes from PATH (repeat; instead of CHECKPOINT)")
    p.add_argument("--meta-graph", required=True, metavar="FILE.meta", help="the model's MetaGraph (.meta)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


@register("scan", help="report what a restore into a graph's variables would do", configure=_scan_args)
def _scan(args) -> int:

    from restorekit._checkpoint import Checkpoint
    from restorekit.errors import CheckpointNotFoundError, GraphError

    checkpoint = _scan_sources(args)
    for path in checkpoint.values() if isinstance(checkpoint, dict) else checkpoint:
        Checkpoint(path)  # fail fast, before importing TensorFlow
    if not os.path.isfile(args.meta_graph):
        raise CheckpointNotFoundError(f"no MetaGraph file at {args.meta_graph!r}", args.meta_graph)
    if args.meta_graph.endswith((".index", ".data-00000-of-00001")) or ".data-" in os.path.basename(args.meta_graph):
        raise GraphError(f"--meta-graph {args.meta_graph!r} is a checkpoint file; pass the '.meta' saved beside it")
    tf = import_tensorflow()

    import restorekit
    from restorekit.graph import import_meta_graph

    with tf.Graph().as_default():
        import_meta_graph(args.meta_graph, clear_devices=True)  # repairs old TF 1.x graphs first
        report = restorekit.scan(checkpoint if len(checkpoint) > 1 or isinstance(checkpoint, dict) else checkpoint[0],
                                 variables=tf.compat.v1.global_variables())
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report)
    return EXIT_OK if report.is_complete else EXIT_DIFFERENT


