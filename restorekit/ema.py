"""Moving-average (EMA) shadow names: which checkpoint entry holds a variable's average."""

from __future__ import annotations

from restorekit.errors import InvalidArgumentError

__all__ = ["DEFAULT_SUFFIX", "shadow_suffix", "is_shadow_name"]

DEFAULT_SUFFIX = "ExponentialMovingAverage"


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
