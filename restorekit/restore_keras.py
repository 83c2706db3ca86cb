"""Keras 3 restore off TensorFlow: a report's matches read and computed in numpy, assigned through ``Variable.assign``.

Keras 3 runs on JAX and PyTorch too, where its variables hold no ``tf.Variable``. The
values come from restorekit's own readers (TF1 and TF2 checkpoints, Keras files) and
``restorekit.array_values``; TensorFlow is never imported on this path.
"""

from __future__ import annotations

from restorekit.array_values import matched_values
from restorekit.errors import IncompleteRestoreError
from restorekit.report import live_handles, nothing_matched
from restorekit.trackables import is_keras_variable, keras_backend

__all__ = ["is_off_tensorflow", "restore"]


def is_off_tensorflow(handles: dict) -> bool:
    """True when the handles are Keras 3 variables of a backend other than TensorFlow."""
    return any(is_keras_variable(h) and keras_backend(h) != "tensorflow" for h in handles.values())


def _current(variable):
    return variable.numpy()


def restore(report, *, strict: bool = False):
    """Assign a report's matched Keras 3 variables (any backend) from numpy values, all checked first.

    The backend-neutral half of ``restorekit.restore``, which calls it for a model on
    the JAX, PyTorch or NumPy backend.

    Raises:
        IncompleteRestoreError: ``strict`` and the report is incomplete.
        NoMatchError: nothing matched.
        InvalidArgumentError: a policy returned a value of the wrong shape.
    """
    handles = live_handles(report)
    if strict and not report.is_complete:
        raise IncompleteRestoreError(report.incomplete_message(), report)
    if not report.matched:
        raise nothing_matched(report)
    for variable, value in matched_values(report, handles, _current):
        variable.assign(value)
    return report
