"""Moving-average (EMA) shadow names: which checkpoint entry holds a variable's average.

Two conventions: TF1 ``ExponentialMovingAverage`` shadows (``w/ExponentialMovingAverage``)
and Keras 3 ``use_ema`` averages (optimizer variables ``<path, '/' as '_'>_average``).
scan and export both ask this module, so they agree on which entry is an average.
"""

from __future__ import annotations

from restorekit.errors import InvalidArgumentError

__all__ = ["DEFAULT_SUFFIX", "KERAS_AVERAGE_SUFFIX", "shadow_suffix", "is_shadow_name", "scoped_shadows", "keras_averages"]

DEFAULT_SUFFIX = "ExponentialMovingAverage"
KERAS_AVERAGE_SUFFIX = "_average"


def shadow_suffix(ema) -> str:
    """The name suffix of shadow entries for ``ema``.

    Args:
        ema: a ``tf.compat.v1.train.ExponentialMovingAverage`` (its ``name``, which
            is what it appends to each variable's name), a suffix string such as
            ``'ExponentialMovingAverage'``, or True for that default.

    Raises:
        InvalidArgumentError: anything else.
    """
    if ema is True:
        return DEFAULT_SUFFIX
    if isinstance(ema, str) and ema.strip("/"):
        return ema.strip("/")
    name = getattr(ema, "name", None)
    if isinstance(name, str) and hasattr(ema, "average_name"):
        return name
    raise InvalidArgumentError(
        f"ema must be an ExponentialMovingAverage or a shadow-name suffix such as {DEFAULT_SUFFIX!r}, got {ema!r}"
    )


def is_shadow_name(name: str, suffix: str = DEFAULT_SUFFIX) -> bool:
    """True for 'w/ExponentialMovingAverage'-style shadow entries."""
    return name.endswith("/" + suffix)


def scoped_shadows(names, suffix: str = DEFAULT_SUFFIX) -> dict:
    """Shadows saved under an extra scope: {'w': 'scope/w/<suffix>'}, where only one entry ends so.

    ``ema.apply()`` inside a variable scope names the shadow of ``w`` ``scope/w/<suffix>``.
    A shadow whose own base (``scope/w``) is among ``names`` is that entry's shadow and
    offers no tail; a tail two shadows end with is ambiguous and left out.
    """
    present = set(names)
    tail = "/" + suffix
    found: dict[str, list] = {}
    for name in present:
        if name.endswith(tail) and name[: -len(tail)] not in present:
            parts = name[: -len(tail)].split("/")
            for i in range(1, len(parts)):
                found.setdefault("/".join(parts[i:]), []).append(name)
    return {base: shadows[0] for base, shadows in found.items() if len(shadows) == 1}


def keras_averages(names, graph) -> dict:
    """Keras 3 ``use_ema``: {weight's key: its average's key} among checkpoint keys ``names``.

    Keras names the optimizer's average of a variable ``<variable path, '/' as '_'>_average``
    (``sgd/enc_kernel_average`` for ``enc/kernel``); a TF2 checkpoint keeps those names in
    its object graph. ``graph`` is the decoded object graph (``restorekit._bundle.objectgraph``),
    or None (no graph: no averages). Keras ``.weights.h5`` files list optimizer variables by
    position only (``optimizer/vars/N``), so no average is found there.
    """
    if graph is None:
        return {}
    by_key = graph.by_key
    averages: dict[str, str] = {}
    for name in names:
        tracked = by_key.get(name)
        if tracked is not None and tracked.kind == "optimizer" and tracked.path.endswith(KERAS_AVERAGE_SUFFIX):
            averages[tracked.path.rpartition("/")[2][: -len(KERAS_AVERAGE_SUFFIX)]] = name
    found: dict[str, str] = {}
    if not averages:
        return found
    for name in names:
        tracked = by_key.get(name)
        if tracked is not None and tracked.kind == "variable":
            for path in (tracked.path, tracked.full_name):
                average = averages.get((path or "").replace("/", "_"))
                if average is not None:
                    found[name] = average
                    break
    return found
