"""Keras 3, one optimizer per multiplier: ``KerasGroupedOptimizer``, made by ``grouped_keras_optimizer``.

This module imports Keras when it is imported; ``restorekit.finetune`` loads it on
first use so that ``import restorekit`` does not.

What Keras 3 offers natively, and why this module still exists: a Keras 3 optimizer
has one learning rate for all its variables; there is no per-variable multiplier.
``exclude_from_weight_decay`` only exempts variables from weight decay, and
``layer.trainable = False`` freezes whole layers but cannot slow them down.
``keras.optimizers.MultiOptimizer`` (in recent Keras 3 releases such as 3.15, absent
from older ones) maps variables to sub-optimizers, but its ``OptimizerMap`` patterns
are full-match regexes on ``variable.path`` where two matching patterns are an error
rather than an order, a pattern that matches nothing passes silently (the backbone
trains anyway), there is no frozen group, and the Keras 3 that older TF 2.16+ installs
bring lacks it. The wrapper here uses the same groups as the TF1 path, so one set of
rules and one report serve both.

How a Keras 3 optimizer saves under ``tf.train.Checkpoint`` (TF 2.21, Keras 3.15,
checked by experiment): its state is tracked by position, ``optimizer/_variables/N``,
in the order of the variables it was built with, and the model variables it was
built with are saved again under ``optimizer/_trainable_variables/N``. Restoring
into an optimizer that is not built yet is deferred: the values land when ``build``
creates the variables. The wrapper therefore tracks each group's optimizer under a
stable attribute (``group_0``, ``group_1``, ... in group order) and builds it with its
group's variables in the model's order, so a rebuilt model restores into the same
slots.
"""

from __future__ import annotations

import math
import numbers

import keras

from restorekit.errors import InvalidArgumentError, MissingDependencyError
from restorekit.finetune._groups import VariableGroups, check_groups
from restorekit.finetune._optimizers import optimizers_per_multiplier, split_by_multiplier

if int(keras.__version__.split(".")[0]) < 3:
    raise MissingDependencyError(
        f"grouped_keras_optimizer needs Keras 3 (found {keras.__version__}); "
        "TensorFlow 2.16+ brings it: pip install 'restorekit[tf]'"
    )

__all__ = ["KerasGroupedOptimizer"]


class KerasGroupedOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer holding one optimizer per multiplier; see ``grouped_keras_optimizer``."""

    def __init__(self, optimizer_factory, groups: VariableGroups, *, name: str | None = None):
        check_groups(groups)
        super().__init__(learning_rate=0.0, name=name)
        optimizers = optimizers_per_multiplier(optimizer_factory, groups, keras.optimizers.Optimizer, "Keras optimizer")
        factors = {opt.loss_scale_factor for opt in optimizers.values()}
        if len(factors) > 1:
            raise InvalidArgumentError(
                f"the group optimizers have different loss_scale_factor values {sorted(factors)}; give them one"
            )
        self.loss_scale_factor = factors.pop() if factors else None
        self._groups = groups
        self._multiplier_list = list(optimizers)
        for i, opt in enumerate(optimizers.values()):
            # A stable attribute per optimizer is its stable checkpoint key.
            setattr(self, f"group_{i}", opt)

    @property
    def group_optimizers(self) -> dict:
        """multiplier -> the optimizer that applies it."""
        # Not named ``optimizers``: Keras callbacks (LearningRateScheduler,
        # ReduceLROnPlateau) take any optimizer with that attribute for a
        # MultiOptimizer and set each sub-optimizer's rate on its own, which would
        # give every group the schedule's value and erase the multipliers.
        return {m: getattr(self, f"group_{i}") for i, m in enumerate(self._multiplier_list)}

    @property
    def learning_rates(self) -> dict:
        """multiplier -> that optimizer's current learning rate (a float)."""
        return {m: float(keras.ops.convert_to_numpy(opt.learning_rate)) for m, opt in self.group_optimizers.items()}

    @property
    def learning_rate(self):
        """The base rate (a scalar tensor): the 1x group's rate, else the first group's rate / its multiplier."""
        mult = 1.0 if 1.0 in self._multiplier_list else self._multiplier_list[0]
        return keras.ops.divide(self.group_optimizers[mult].learning_rate, mult)

    @learning_rate.setter
    def learning_rate(self, value):
        _check_base_rate(value)
        optimizers = self.group_optimizers
        # Check every group before setting any, so a refusal changes nothing.
        _check_settable(optimizers)
        for mult, opt in optimizers.items():
            if isinstance(value, numbers.Real):
                opt.learning_rate = float(value) * mult
            else:
                opt.learning_rate = keras.ops.multiply(keras.ops.cast(value, opt.learning_rate.dtype), mult)

    @property
    def variables(self):
        return self._variables[:] + [v for opt in self.group_optimizers.values() for v in opt.variables]

    def build(self, variables):
        if self.built:
            return
        variables = list(variables)
        optimizers = self.group_optimizers
        for mult, group_vars in split_by_multiplier(self._groups, variables).items():
            if group_vars:
                optimizers[mult].build(group_vars)
        super().build(variables)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise InvalidArgumentError("pass trainable_variables on the first apply (or call build first)")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        split = split_by_multiplier(self._groups, zip(grads, trainable_variables), variable=lambda pair: pair[1])
        optimizers = self.group_optimizers
        for mult, pairs in split.items():
            if pairs:
                optimizers[mult].apply([g for g, _ in pairs], [v for _, v in pairs])
        self._iterations.assign_add(1)

    def finalize_variable_values(self, var_list):
        optimizers = self.group_optimizers
        for mult, group_vars in split_by_multiplier(self._groups, var_list).items():
            if group_vars:
                optimizers[mult].finalize_variable_values(group_vars)

    def get_config(self):
        raise NotImplementedError(
            "a grouped optimizer holds live variable groups and cannot be serialized to a config; "
            "save its state with tf.train.Checkpoint and rebuild it in code"
        )


# Its public home, where it has always been imported from.
KerasGroupedOptimizer.__module__ = "restorekit.finetune"


def _check_base_rate(value) -> None:
    """InvalidArgumentError unless ``value`` is a finite number >= 0 or a scalar tensor or variable."""
    if isinstance(value, bool) or not (
        isinstance(value, numbers.Real) or isinstance(value, keras.Variable) or keras.ops.is_tensor(value)
    ):
        raise InvalidArgumentError(
            f"learning_rate must be a number or a scalar tensor (the base rate), got {value!r}; "
            "to schedule it, give each group's optimizer a schedule in optimizer_factory"
        )
    if isinstance(value, numbers.Real) and not (math.isfinite(value) and float(value) >= 0):
        raise InvalidArgumentError(f"learning_rate must be a finite number >= 0, got {value!r}")


def _check_settable(optimizers: dict) -> None:
    """InvalidArgumentError when any group's optimizer has a schedule (or callable) for its rate."""
    scheduled = [m for m, opt in optimizers.items() if not isinstance(opt.learning_rate, keras.Variable)]
    if scheduled:
        which = ", ".join(f"{m:g}x" for m in scheduled)
        raise InvalidArgumentError(
            f"cannot set learning_rate: the optimizer of the {which} group"
            f"{' has' if len(scheduled) == 1 else 's have'} a learning-rate schedule (or callable), "
            "whose rate cannot be set, as Keras refuses for one optimizer. Nothing was changed; "
            "give every group a float rate in optimizer_factory to make it settable"
        )
