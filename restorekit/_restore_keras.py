"""Keras 3 restore off TensorFlow: a report's matches read and computed in numpy, assigned through ``Variable.assign``.

Keras 3 runs on JAX and PyTorch too, where its variables hold no ``tf.Variable``. The
values come from restorekit's own readers (TF1 and TF2 checkpoints, Keras files) and
``restorekit._array_values``; TensorFlow is never imported on this path. Tensors a TF
checkpoint stores as they are restored are checked by their crc32c first, then read one at
a time as they are assigned.
"""

from __future__ import annotations

from restorekit._array_values import checked_plan, reading_checked
from restorekit._optim import _keras as optimizer_keras
from restorekit.errors import IncompleteRestoreError
from restorekit._report import live_handles, nothing_matched
from restorekit._trackables import is_keras_variable, keras_backend

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
    stored, values = checked_plan(report, handles, _current)
    optimizer_state = optimizer_keras.read(report._optimizer)  # scan(..., optimizer=): read before any assign
    # Each checked tensor is read when it is assigned and dropped after: the peak is one tensor, not the model.
    for s in stored:
        with reading_checked(s):
            value = s.checkpoint.read(s.key)
        s.handle.assign(value.T if s.transposed else value.reshape(s.shape))
    for variable, value in values:
        variable.assign(value)
    optimizer_keras.load(report._optimizer, optimizer_state)
    return report
