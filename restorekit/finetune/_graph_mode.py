"""TF1 graph mode, one optimizer per multiplier: ``GroupedOptimizer``, a true learning-rate multiplier.

This module imports TensorFlow when it is imported; ``restorekit.finetune`` loads it on
first use of ``GroupedOptimizer`` so that ``import restorekit`` does not.
"""

from __future__ import annotations

from typing import Any, Callable

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import InvalidArgumentError, format_names
from restorekit.finetune._gradients import checked_pairs
from restorekit.finetune._groups import VariableGroups, check_default_graph, check_groups
from restorekit.finetune._optimizers import optimizers_per_multiplier, split_by_multiplier
from restorekit._targets import variable_name

tf = import_tensorflow()
# The base class is a value of the module imported above (TensorFlow ships no types: Any to mypy).
_Optimizer: Any = tf.compat.v1.train.Optimizer

__all__ = ["GroupedOptimizer"]


class GroupedOptimizer(_Optimizer):
    """One TF1 optimizer per multiplier; one train op for all of them.

    ``optimizer_factory(multiplier)`` returns a ``tf.compat.v1.train.Optimizer``
    already at that group's learning rate (gradients are not scaled again). Groups
    with the same multiplier share one optimizer; frozen groups get none. Each
    optimizer keeps the name the factory gave it, so slot variables are named as a
    single optimizer would name them (``dense/kernel/Momentum``): a variable is in
    one group only, so the names cannot collide, a rebuilt graph gets the same
    names, and checkpoints move between grouped and ungrouped training. Non-slot
    state (Adam's ``beta1_power``) gets ``_1``, ``_2``... in multiplier order.

    ``apply_gradients`` increments ``global_step`` once, after every update.

    Args:
        optimizer_factory: ``multiplier -> tf.compat.v1.train.Optimizer``.
        groups: from ``group_variables``.
        name: the name of the final ops.

    Raises:
        InvalidArgumentError: the factory returns no TF1 optimizer, or the same
            one for two multipliers.
        GroupError: ``groups`` is not from ``group_variables``, or was built for
            another graph than the default one.

    Example:
        >>> opt = GroupedOptimizer(lambda m: tf1.train.MomentumOptimizer(0.01 * m, 0.9), groups)
        >>> train_op = opt.minimize(loss, global_step=tf1.train.get_or_create_global_step())
    """

    def __init__(self, optimizer_factory: Callable, groups: VariableGroups, *, name: str = "GroupedOptimizer"):
        check_groups(groups)
        check_default_graph(groups)
        super().__init__(use_locking=False, name=name)
        self.groups = groups
        self.optimizers = optimizers_per_multiplier(
            optimizer_factory, groups, tf.compat.v1.train.Optimizer, "tf.compat.v1.train.Optimizer"
        )

    def compute_gradients(self, loss, var_list=None, **kwargs):
        """Gradients of ``loss`` for ``var_list``, by default the groups' trainable variables."""
        if var_list is None:
            var_list = self.groups.trainable
        return super().compute_gradients(loss, var_list=var_list, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Apply each gradient with its group's optimizer; one op, one global_step increment.

        Raises:
            GroupError: a variable the groups do not know (or from another graph).
            InvalidArgumentError: ``grads_and_vars`` is not a list of (gradient,
                variable) pairs, or no gradient for any trainable variable.
        """
        pairs = checked_pairs(grads_and_vars)
        split = split_by_multiplier(self.groups, pairs, variable=lambda pair: pair[1])
        buckets = {m: [(g, v) for g, v in bucket if g is not None] for m, bucket in split.items()}
        if not any(buckets.values()):
            raise InvalidArgumentError(
                f"no gradients for any trainable variable among {format_names(variable_name(v) for _, v in pairs)}; "
                "is the loss connected to them?"
            )
        updates = [self.optimizers[m].apply_gradients(bucket) for m, bucket in buckets.items() if bucket]
        op = self._one_op(updates, global_step, name or self.get_name())
        if not tf.executing_eagerly():
            train_ops = tf.compat.v1.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
            if op not in train_ops:
                train_ops.append(op)
        return op

    @staticmethod
    def _one_op(updates: list, global_step, name: str):
        """One op after every update: a group, or the global_step increment."""
        if global_step is None:
            return tf.group(*updates, name=name)
        # assign_add lands on global_step's device by itself (ref ops and resource ops
        # are placed with their variable).
        with tf.control_dependencies(updates):
            return tf.compat.v1.assign_add(global_step, 1, name=name).op

    def get_slot(self, var, name):
        """The slot ``name`` of ``var`` from its group's optimizer (None when frozen)."""
        group = self.groups.group_of(var)
        return None if group.frozen else self.optimizers[group.multiplier].get_slot(var, name)

    def get_slot_names(self):
        return sorted({n for opt in self.optimizers.values() for n in opt.get_slot_names()})

    def variables(self):
        """Every optimizer's variables (slots and non-slot state), in multiplier order."""
        return [v for opt in self.optimizers.values() for v in opt.variables()]


# Its public home, where it has always been imported from.
GroupedOptimizer.__module__ = "restorekit.finetune"
