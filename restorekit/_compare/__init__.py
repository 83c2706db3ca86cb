"""Compare checkpoints and summarize tensors: the library behind ``restorekit diff`` and ``inspect --stats``."""

from __future__ import annotations

import math

import numpy as np

from restorekit._compare.files import open_checkpoint

__all__ = ["diff_checkpoints", "open_checkpoint", "tensor_stats"]


def tensor_stats(array: np.ndarray) -> dict:
    """min, max, mean and NaN count of a tensor (None where they do not apply)."""
    if array.dtype == object or array.size == 0:
        return {"min": None, "max": None, "mean": None, "nans": 0}
    values = array
    if values.dtype.kind == "c":
        values = np.abs(values)
    elif values.dtype.kind not in "fiub":  # bfloat16, float8: numpy sees them as void-like
        values = values.astype(np.float32)
    if values.dtype.kind == "b":
        values = values.astype(np.int8)
    nans = int(np.isnan(values).sum()) if values.dtype.kind == "f" else 0
    finite = values[~np.isnan(values)] if nans else values
    if finite.size == 0:
        return {"min": None, "max": None, "mean": None, "nans": nans}
    as_py = float if values.dtype.kind == "f" else int
    return {
        "min": as_py(finite.min()),
        "max": as_py(finite.max()),
        "mean": float(finite.mean(dtype=np.float64)),
        "nans": nans,
    }



_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
_BY = ("auto", "key", "path")


def diff_checkpoints(a, b, *, atol: float = 0.0, by: str = "auto") -> dict:
    """Compare two checkpoints: names only in one, shape/dtype changes, value differences.

    ``a`` and ``b`` are anything ``open_checkpoint`` reads: TF checkpoints, Keras files,
    safetensors (one file or shards), ``.pt`` and ``.npz`` files, in any pairing.
    Tensors pair by checkpoint key (``by='key'``) or by readable path (``by='path'``:
    TF2 object paths, Keras variable paths; a path with scopes the other side lacks,
    such as the model name in ``seq/dense/kernel``, pairs with ``dense/kernel`` when
    that is unambiguous; the object-graph entry has no counterpart and is left out).
    ``by='auto'`` pairs by path when that pairs more tensors than keys do; the result's
    ``paired_by`` says which. A file restorekit exported with layout 'torch' beside a
    torch-layout file without its record (a foreign ``.pt`` and restorekit's conversion
    of it) is read as stored, with PyTorch names and axes, when that pairs more; the
    result's ``as_stored`` names that side ('a', 'b' or None). Tensors are read one pair at a time.

    Values are equal when their bytes are; otherwise ``max_abs_diff`` is reported
    (NaN where NaNs sit in different places) and the tensor counts as different when
    it exceeds ``atol`` (``atol=0``: any difference).

    Raises:
        InvalidArgumentError: ``by`` is not 'auto', 'key' or 'path'.
        CheckpointNotFoundError, CorruptCheckpointError: a side cannot be read.
    """
    from restorekit.errors import InvalidArgumentError

    if by not in _BY:
        raise InvalidArgumentError(f"by={by!r}: choose one of {', '.join(map(repr, _BY))}")
    a, b = open_checkpoint(a), open_checkpoint(b)
    a, b, as_stored = _conventions(a, b)
    pairs, only_a, only_b = by_key = _key_pairs(a, b)
    use_path = False
    if by != "key":
        by_path = _path_pairs(a, b)
        use_path = by == "path" or len(by_path[0]) > len(by_key[0])
        if use_path:
            pairs, only_a, only_b = by_path
    changed, values, equal = _compare(a, b, pairs, atol)
    if use_path:
        keys = {name: {"a": ka, "b": kb} for name, ka, kb in pairs if name != ka or name != kb}
        for c in changed + values:
            if c["name"] in keys:
                c["keys"] = keys[c["name"]]
        paths = {}
    else:
        listed = only_a + only_b + [c["name"] for c in changed] + [v["name"] for v in values]
        paths = _readable_paths(listed, a, b)
    return {
        "a": a.prefix,
        "b": b.prefix,
        "paired_by": "path" if use_path else "key",
        "as_stored": as_stored,
        "equal": not (only_a or only_b or changed or values),
        "only_in_a": only_a,
        "only_in_b": only_b,
        "changed": changed,
        "values": values,
        "same": equal,
        "paths": paths,
    }


def _conventions(a, b) -> tuple:
    """(a, b, which side is read as stored): one naming for both sides.

    A file restorekit wrote with layout 'torch' reads back under TF names and axes (its
    layout record undone); a torch-layout file from elsewhere has no record and reads as
    stored. Beside each other (a foreign ``.pt`` and restorekit's conversion of it, a
    torch twin's ``state_dict`` and an export of the TF checkpoint), the recorded side is
    read as stored too, when that pairs more tensors by name.
    """
    from restorekit.formats.files import FileView

    recorded = [x for x in (a, b) if getattr(x, "record_layout", None) is not None]
    if len(recorded) != 1:
        return a, b, None
    other = b if recorded[0] is a else a
    if not isinstance(other, FileView) or other.format not in ("safetensors", "torch"):
        return a, b, None
    stored = FileView(recorded[0].prefix, recorded[0].reader, stored=True)
    if len(set(stored.entries) & set(other.entries)) <= len(set(recorded[0].entries) & set(other.entries)):
        return a, b, None
    return (stored, b, "a") if recorded[0] is a else (a, stored, "b")


def _key_pairs(a, b) -> tuple[list, list, list]:
    """([(name, key in a, key in b)], keys only in a, keys only in b), pairing equal keys."""
    pairs = [(n, n, n) for n in a.entries if n in b.entries]
    return pairs, [n for n in a.entries if n not in b.entries], [n for n in b.entries if n not in a.entries]


def _by_path(ckpt) -> dict:
    """Readable path -> key of every entry but the object graph; a path two keys share stays a key."""
    paths: dict = {}
    for key in ckpt.entries:
        if key != _OBJECT_GRAPH:
            paths.setdefault(ckpt.readable_name(key), []).append(key)
    out = {}
    for path, keys in paths.items():
        for key in keys:
            out[path if len(keys) == 1 else key] = key
    return out


def _path_pairs(a, b) -> tuple[list, list, list]:
    """([(A's path, key in a, key in b)], paths only in a, paths only in b), pairing readable paths:
    equal ones first, then a path with leading scopes the other side lacks."""
    pa, pb = _by_path(a), _by_path(b)
    pairs = [(p, pa[p], pb[p]) for p in pa if p in pb]
    rest_a = [p for p in pa if p not in pb]
    rest_b = [p for p in pb if p not in pa]
    matched = _scoped_matches(rest_a, rest_b)
    taken = set(matched.values())
    matched.update(_undecided_matches(a, b, [p for p in rest_a if p not in matched], [q for q in rest_b if q not in taken]))
    pairs += [(p, pa[p], pb[q]) for p, q in matched.items()]
    taken = set(matched.values())
    return pairs, [p for p in rest_a if p not in matched], [q for q in rest_b if q not in taken]


def _undecided_matches(a, b, rest_a: list, rest_b: list) -> dict:
    """A's path -> B's path inside a layer whose variables one side keeps by index and the other names.

    A bare ``.weights.h5`` keeps indices where two configs write the same file (a
    BatchNormalization with ``scale=False`` or ``center=False``: ``bn/0``, ``bn/1``,
    ``bn/2``) and lists the sets of names that fit (``KerasCheckpoint.undecided``); the
    other side's names for the layer (a ``.keras`` file's config, a TF2 checkpoint) say
    which set it is, and so which index is which variable.
    """
    matched: dict = {}
    for one, rest_one, rest_other, flip in ((a, rest_a, rest_b, False), (b, rest_b, rest_a, True)):
        for scope, sets in getattr(one, "undecided", {}).items():
            indexed = [p for p in rest_one if p.rpartition("/")[0] == scope and p.rpartition("/")[2].isdigit()]
            named = {p.rpartition("/")[2]: p for p in rest_other if p.rpartition("/")[0] == scope}
            fitting = [names for names in sets if len(names) == len(indexed) and set(names) == set(named)]
            if len(fitting) != 1:
                continue
            for p in indexed:
                q = named[fitting[0][int(p.rpartition("/")[2])]]
                matched.update({q: p} if flip else {p: q})
    return matched


def _unique_suffixes(paths) -> dict:
    """Each path's tails of two or more parts (``dense/kernel`` of ``seq/dense/kernel``) -> that path, where one path has it."""
    found: dict = {}
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts) - 1):
            found.setdefault("/".join(parts[i:]), []).append(path)
    return {tail: owners[0] for tail, owners in found.items() if len(owners) == 1}


def _scoped_matches(rest_a: list, rest_b: list) -> dict:
    """A's path -> B's path for paths equal but for leading scopes on one side, where that is unambiguous."""
    tails_a, tails_b = _unique_suffixes(rest_a), _unique_suffixes(rest_b)
    in_b = set(rest_b)
    matched, taken = {}, set()
    for p in rest_a:
        q = tails_b.get(p)  # B has scopes A lacks
        if q is None:  # A has scopes B lacks: its longest tail that B holds
            q = next((t for t in tails_a if tails_a[t] == p and t in in_b), None)
            if q is not None and tails_b.get(q) is not None:
                continue  # B also holds a longer path ending so: ambiguous
        if q is not None and q not in taken:
            matched[p] = q
            taken.add(q)
    return matched


def _compare(a, b, pairs: list, atol: float) -> tuple[list, list, int]:
    """(shape/dtype changes, value differences, number equal) over ``pairs``, one pair read at a time."""
    changed, values, equal = [], [], 0
    for name, ka, kb in pairs:
        ea, eb = a.entries[ka], b.entries[kb]
        if tuple(ea.shape) != tuple(eb.shape) or ea.dtype != eb.dtype:
            changed.append({"name": name, "a": {"shape": list(ea.shape), "dtype": ea.dtype},
                            "b": {"shape": list(eb.shape), "dtype": eb.dtype}})
            continue
        difference = _difference(a.read(ka), b.read(kb), atol)
        if difference is None:
            equal += 1
        else:
            values.append({"name": name, **difference})
    return changed, values, equal


def _difference(x: np.ndarray, y: np.ndarray, atol: float) -> dict | None:
    """None when equal (within ``atol``), else ``max_abs_diff`` and ``differing``."""
    if x.dtype == object or y.dtype == object:
        if list(x.ravel()) == list(y.ravel()):
            return None
        return {"max_abs_diff": None, "differing": int(sum(p != q for p, q in zip(x.ravel(), y.ravel())))}
    if x.tobytes() == y.tobytes():
        return None
    max_diff, differing = _value_diff(x, y)
    if max_diff is not None and not math.isnan(max_diff) and max_diff <= atol:
        return None
    return {"max_abs_diff": max_diff, "differing": differing}


def _readable_paths(names, a, b) -> dict:
    """Readable paths (TF2 object paths, Keras paths) of the listed keys, where they say more than the key."""
    paths = {}
    for name in names:
        path = a.readable_name(name) if name in a.entries else b.readable_name(name)
        if path != name:
            paths[name] = path
    return paths


def _value_diff(x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """(max abs difference, number of differing elements); NaN when NaNs sit in different places."""
    wide = np.complex128 if x.dtype.kind == "c" else np.float64
    xw, yw = x.astype(wide), y.astype(wide)
    nan_x, nan_y = np.isnan(xw), np.isnan(yw)
    differing = int(np.count_nonzero((xw != yw) & ~(nan_x & nan_y)))
    if not np.array_equal(nan_x, nan_y):
        return math.nan, differing
    delta = np.abs(xw - yw)[~nan_x]
    return (float(delta.max()) if delta.size else 0.0), differing
