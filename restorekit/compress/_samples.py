"""Sample inputs for ``compress``: representative data in any accepted form, or seeded random feeds."""

from __future__ import annotations

import os

import numpy as np

from restorekit.compress._models import _Spec, _tensor_name
from restorekit.errors import InvalidArgumentError, NoMatchError


def _concrete_shape(spec: _Spec) -> tuple:
    if spec.shape is None:
        raise InvalidArgumentError(
            f"input {spec.key!r} has an unknown rank; pass representative_data so its shape is known.")
    shape = tuple(1 if (d is None or d < 0) and i == 0 else d for i, d in enumerate(spec.shape))
    if any(d is None or d < 0 for d in shape):
        raise InvalidArgumentError(
            f"input {spec.key!r} has unknown dimensions {list(spec.shape)} beyond the batch; pass "
            f"representative_data so its shape is known.")
    return shape


def _random_feeds(specs: list[_Spec], n: int) -> list[dict]:
    rng = np.random.RandomState(0)
    feeds = []
    for _ in range(n):
        feed = {}
        for spec in specs:
            shape, dtype = _concrete_shape(spec), np.dtype(spec.dtype)
            if dtype.kind == "f":
                feed[spec.key] = rng.standard_normal(shape).astype(dtype)
            elif dtype.kind in "iu":
                feed[spec.key] = rng.randint(0, 10, shape).astype(dtype)
            elif dtype.kind == "b":
                feed[spec.key] = rng.rand(*shape) > 0.5
            else:
                raise InvalidArgumentError(f"input {spec.key!r} has dtype {spec.dtype}; pass representative_data.")
        feeds.append(feed)
    return feeds


def _key_of(name: str, specs: list[_Spec]) -> str:
    keys = [s.key for s in specs]
    for key in (name, _tensor_name(name)):
        if key in keys:
            return key
    raise NoMatchError(f"representative_data names {name!r}, which is not an input.", name=name, candidates=keys)


def _feed(item, specs: list[_Spec]) -> dict:
    if isinstance(item, dict):
        feed = {_key_of(k, specs): v for k, v in item.items()}
    elif isinstance(item, (list, tuple)):
        feed = dict(zip([s.key for s in specs], item))
    else:
        feed = {specs[0].key: item}
    missing = [s.key for s in specs if s.key not in feed]
    if missing or len(feed) != len(specs):
        raise InvalidArgumentError(f"a representative sample feeds {sorted(feed)}; the inputs are "
                                   f"{[s.key for s in specs]}.")
    return {s.key: np.asarray(feed[s.key], dtype=np.dtype(s.dtype)) for s in specs}


def _sample_feeds(data, specs: list[_Spec]) -> list[dict]:
    """One feed per sample. Arrays (and a dict or .npz of arrays) hold samples along their first
    axis, each run as a batch of one; any other iterable yields whole feeds."""
    if isinstance(data, (str, os.PathLike)):
        with np.load(os.fspath(data)) as npz:
            data = {k: npz[k] for k in npz.files}
    if isinstance(data, np.ndarray) or (isinstance(data, dict) and all(isinstance(v, np.ndarray)
                                                                        for v in data.values())):
        arrays = data if isinstance(data, dict) else {specs[0].key: data}
        arrays = {_key_of(k, specs): v for k, v in arrays.items()}
        counts = {len(v) for v in arrays.values()}
        if len(counts) != 1:
            raise InvalidArgumentError(f"representative arrays hold different sample counts: {sorted(counts)}.")
        feeds = [_feed({k: v[i:i + 1] for k, v in arrays.items()}, specs) for i in range(counts.pop())]
    else:
        feeds = [_feed(item, specs) for item in data]
    if not feeds:
        raise InvalidArgumentError("representative_data holds no samples.")
    return feeds
