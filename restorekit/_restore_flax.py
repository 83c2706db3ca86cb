"""Flax NNX restore: a report's matches read and checked in numpy, then set on the module's own Variables.

``scan(checkpoint, nnx_module)`` plans it; ``restorekit.restore(report)`` comes here. Every
value is read (a TF checkpoint's tensors against their crc32c), passed through its policy and
checked against its Variable's shape and dtype, then placed as a ``jax.Array`` where the
Variable's value lives (its sharding kept); only then is any Variable set, as ``nnx.update``
sets them. TensorFlow is never imported on this path.
"""

from __future__ import annotations

import numpy as np

from restorekit._array_values import matched_values
from restorekit._optim import _optax as optimizer_optax
from restorekit.errors import IncompleteRestoreError, InvalidArgumentError, MissingDependencyError
from restorekit._flax_target import is_flax_variable
from restorekit._report import live_handles, nothing_matched

__all__ = ["is_flax_report", "restore"]


def is_flax_report(handles: dict) -> bool:
    """True when a report's live handles are Flax NNX Variables (scanned from an ``nnx.Module``)."""
    return any(is_flax_variable(h) for h in handles.values())


def _get(variable):
    return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _current(variable) -> np.ndarray:
    return np.asarray(_get(variable))


def _placed(jax, variable, value: np.ndarray, name: str):
    """``value`` as a jax.Array on the devices (and with the sharding) of ``variable``'s current value."""
    current = _get(variable)
    array = jax.device_put(value, getattr(current, "sharding", None))
    if array.dtype != current.dtype or array.shape != current.shape:  # a float64 value with jax_enable_x64 off
        raise InvalidArgumentError(
            f"{name!r} would become {array.dtype}{list(array.shape)} in JAX, but the variable is "
            f"{current.dtype}{list(current.shape)}"
        )
    return array


def restore(report, *, strict: bool = False):
    """Set a report's matched Flax NNX Variables from the checkpoint, every value read and checked first.

    Raises:
        IncompleteRestoreError: ``strict`` and the report is incomplete.
        NoMatchError: nothing matched.
        InvalidArgumentError: a policy returned a value of the wrong shape, or a value JAX would hold
            in another dtype.
        CorruptCheckpointError: a tensor's bytes fail their checks (nothing has been set).
    """
    try:
        import jax
    except ImportError:
        raise MissingDependencyError("restoring into a Flax module needs jax: pip install 'restorekit[flax]'") from None
    handles = live_handles(report)
    if strict and not report.is_complete:
        raise IncompleteRestoreError(report.incomplete_message(), report)
    if not report.matched:
        raise nothing_matched(report)
    names = {id(h): name for name, h in handles.items()}
    arrays = [(v, _placed(jax, v, value, names[id(v)])) for v, value in matched_values(report, handles, _current)]
    optimizer_state = optimizer_optax.read(report._optimizer)  # scan(..., optimizer=): read before any set
    for variable, array in arrays:  # nothing above wrote; from here nothing can fail on a value
        if hasattr(variable, "set_value"):
            variable.set_value(array)
        else:
            variable.value = array
    optimizer_optax.load(report._optimizer, optimizer_state)
    return report
