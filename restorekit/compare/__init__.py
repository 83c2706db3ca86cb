"""Compare checkpoints and summarize tensors: the library behind ``restorekit diff`` and ``inspect --stats``."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["diff_checkpoints", "tensor_stats"]


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



def diff_checkpoints(a, b, *, atol: float = 0.0) -> dict:
    """Compare two checkpoints: names only in one, shape/dtype changes, value differences.

    Values are equal when their bytes are; otherwise ``max_abs_diff`` is reported
    (NaN where NaNs sit in different places) and the tensor counts as different when
    it exceeds ``atol`` (``atol=0``: any difference).
    """
    from restorekit.checkpoint import Checkpoint

    a, b = Checkpoint(a), Checkpoint(b)
    only_a = [n for n in a.entries if n not in b.entries]
    only_b = [n for n in b.entries if n not in a.entries]
    changed, values, equal = [], [], 0
    for name in a.entries:
        if name not in b.entries:
            continue
        ea, eb = a.entries[name], b.entries[name]
        if ea.shape != eb.shape or ea.dtype != eb.dtype:
            changed.append({"name": name, "a": {"shape": list(ea.shape), "dtype": ea.dtype},
                            "b": {"shape": list(eb.shape), "dtype": eb.dtype}})
            continue
        x, y = a.read(name), b.read(name)
        if x.dtype == object:
            if list(x.ravel()) == list(y.ravel()):
                equal += 1
            else:
                values.append({"name": name, "max_abs_diff": None,
                               "differing": int(sum(p != q for p, q in zip(x.ravel(), y.ravel())))})
            continue
        if x.tobytes() == y.tobytes():
            equal += 1
            continue
        max_diff, differing = _value_diff(x, y)
        if max_diff is not None and not math.isnan(max_diff) and max_diff <= atol:
            equal += 1
            continue
        values.append({"name": name, "max_abs_diff": max_diff, "differing": differing})
    listed = only_a + only_b + [c["name"] for c in changed] + [v["name"] for v in values]
    return {
        "a": a.prefix,
        "b": b.prefix,
        "equal": not (only_a or only_b or changed or values),
        "only_in_a": only_a,
        "only_in_b": only_b,
        "changed": changed,
        "values": values,
        "same": equal,
        "paths": _readable_paths(listed, a, b),
    }


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
