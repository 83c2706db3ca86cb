"""Gradients by group: scale each (gradient, variable) pair by its group's multiplier, drop frozen ones.

``scale_gradients`` serves TF1 graph mode with one optimizer: tf-slim's
``multiply_gradients`` plus freezing. For Adam-like optimizers a gradient multiplier
is *not* a learning-rate multiplier (Adam divides it out again); ``GroupedOptimizer``
is the true one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import InvalidArgumentError
from restorekit.finetune._groups import VariableGroups, check_groups
from restorekit._targets import is_keras_variable, variable_name

__all__ = ["checked_pairs", "scale_gradients"]

_EXPECTED = "a list of (gradient, variable) pairs, as compute_gradients returns"


def scale_gradients(grads_and_vars, groups: VariableGroups) -> list:
    """Scale each gradient by its group's multiplier; drop frozen ones.

    ``IndexedSlices`` stay sparse (only their values are scaled). A multiplier of 1 is
    left as is. ``None`` gradients are handled as tf-slim's ``multiply_gradients``
    does: an error where a multiplier was asked for (a variable a rule took, or the
    default group when ``default`` is not 1), passed through otherwise; frozen
    variables are dropped whatever their gradient.

    Args:
        grads_and_vars: (gradient, variable) pairs, e.g. from ``compute_gradients``.
        groups: from ``group_variables`` over these variables.

    Returns:
        A list of (gradient, variable) pairs for ``apply_gradients``.

    Raises:
        GroupError: a variable the groups do not know (or from another graph).
        InvalidArgumentError: ``grads_and_vars`` is not a list of (gradient, variable)
            pairs (one bare pair, an item of another shape), or a ``None`` gradient
            where a multiplier was asked for.
    """
    groups = check_groups(groups)
    # Every variable is looked up before any op is built.
    resolved = [(grad, var, groups.group_of(var)) for grad, var in checked_pairs(grads_and_vars)]
    scaled = []
    for grad, var, group in resolved:
        if group.frozen:
            continue
        if grad is None:
            if group.rule is not None or group.multiplier != 1.0:
                raise InvalidArgumentError(
                    f"variable {variable_name(var)!r} has no gradient, but group {group.label} "
                    f"asks for multiplier {group.multiplier:g}; is it connected to the loss?"
                )
            scaled.append((grad, var))
        else:
            scaled.append((_scale(grad, group.multiplier), var))
    return scaled


def _scale(grad, multiplier: float):
    if multiplier == 1.0:
        return grad
    tf = import_tensorflow()

    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.constant(multiplier, dtype=grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad * tf.constant(multiplier, dtype=grad.dtype)


def checked_pairs(grads_and_vars) -> list[tuple]:
    """``grads_and_vars`` as a list of (gradient, variable) tuples.

    A ``None`` gradient is a valid gradient here (TF allows it); what the caller
    does with it is its own rule.

    Raises:
        InvalidArgumentError: not an iterable of pairs: one bare (gradient, variable)
            pair, an item that is not a 2-tuple, or a pair whose second item is not a
            variable.
    """
    if _is_single_value(grads_and_vars):
        raise InvalidArgumentError(f"grads_and_vars must be {_EXPECTED}, got {_describe(grads_and_vars)}")
    if _is_bare_pair(grads_and_vars):
        raise InvalidArgumentError(
            f"grads_and_vars must be {_EXPECTED}, got one pair ({_describe(grads_and_vars[0])}, "
            f"{_describe(grads_and_vars[1])}); wrap it in a list: [(gradient, variable)]"
        )
    pairs = []
    for i, item in enumerate(grads_and_vars):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidArgumentError(
                f"grads_and_vars[{i}] is {_describe(item)}, not a (gradient, variable) pair; "
                f"grads_and_vars must be {_EXPECTED}"
            )
        if not _is_variable(item[1]):
            raise InvalidArgumentError(
                f"grads_and_vars[{i}] holds {_describe(item[1])} where the variable goes; "
                "pairs are (gradient, variable), in that order"
            )
        pairs.append(tuple(item))
    return pairs


def _is_single_value(value) -> bool:
    # Tensors and variables iterate (eagerly) over their rows, strings over characters:
    # none of them is a list of pairs.
    tf = import_tensorflow()

    return (
        isinstance(value, (str, bytes, Mapping))
        or not isinstance(value, Iterable)
        or tf.is_tensor(value)
        or _is_variable(value)
    )


def _is_variable(value) -> bool:
    tf = import_tensorflow()

    return isinstance(value, tf.Variable) or is_keras_variable(value)


def _is_bare_pair(value) -> bool:
    # (gradient, variable) where [(gradient, variable)] was meant: its first item is a
    # gradient or None, not a pair.
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and not isinstance(value[0], (tuple, list))
        and _is_variable(value[1])
    )


def _describe(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'}"
    text = repr(value)
    # An eager tensor's repr holds its values; the head (name, shape, dtype) is what tells.
    text = text if len(text) <= 80 else text[:77] + "..."
    # TF's reprs name their kind (<tf.Tensor ...>); others get their type in front.
    return text if text.startswith("<") else f"{type(value).__name__} {text}"
