"""Fine-tuning by variable groups: frozen scopes and per-group learning-rate multipliers.

``group_variables(rules, variables)`` puts every variable in exactly one group (the
first rule whose pattern takes its name, else the default group); a multiplier of
``0`` freezes a group. The same groups then drive every training style:

* TF1 graph mode, one optimizer: ``scale_gradients(grads_and_vars, groups)`` scales
  each gradient by its multiplier and drops frozen ones (tf-slim's
  ``multiply_gradients`` plus freezing). Note that for Adam-like optimizers a gradient
  multiplier is *not* a learning-rate multiplier: Adam divides it out again.
* TF1 graph mode, one optimizer per multiplier: ``GroupedOptimizer(factory, groups)``,
  where ``factory(multiplier)`` returns a ``tf.compat.v1.train.Optimizer`` already at
  that group's learning rate. This is a true learning-rate multiplier for any
  optimizer.
* Keras 3 (``model.fit`` or a custom train step): ``grouped_keras_optimizer(factory,
  groups)``, the same idea as a Keras optimizer whose state saves and restores with
  ``tf.train.Checkpoint``.
* ``torch.optim``: ``param_groups(module, rules, lr=...)``, frozen groups ``requires_grad=False``.
* optax with a Flax NNX module: ``optax_partitions(module, rules)`` labels every ``nnx.Param``
  by its group for ``optax.multi_transform``; ``grouped_optax(factory, module, rules)`` is that
  composition, a frozen group's transform ``optax.set_to_zero()``.

Modules: ``groups`` (the groups, ``layerwise_decay``), ``gradients``
(``scale_gradients``), ``optimizers`` (what both grouped optimizers share),
``graph_mode`` (``GroupedOptimizer``, imports TensorFlow) and ``keras3``
(``KerasGroupedOptimizer``, imports Keras). The last two load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from restorekit.finetune._gradients import scale_gradients
from restorekit.finetune._groups import (
    DEFAULT_EMBEDDINGS as DEFAULT_EMBEDDINGS,
    DEFAULT_LAYER_PATTERN as DEFAULT_LAYER_PATTERN,
    VariableGroup,
    VariableGroups,
    group_variables,
    layerwise_decay,
)
from restorekit.finetune._optax import grouped_optax, optax_partitions
from restorekit.finetune._torch_groups import param_groups

if TYPE_CHECKING:
    # Bound for readers and checkers (and so named in __all__ without F822);
    # at run time __getattr__ below loads them.
    from restorekit.finetune._graph_mode import GroupedOptimizer
    from restorekit.finetune._keras3 import KerasGroupedOptimizer as KerasGroupedOptimizer

__all__ = [
    "GroupedOptimizer",
    "VariableGroup",
    "VariableGroups",
    "group_variables",
    "grouped_keras_optimizer",
    "grouped_optax",
    "layerwise_decay",
    "optax_partitions",
    "param_groups",
    "scale_gradients",
]

# name -> the module defining it. These classes subclass TF and Keras classes, so
# their modules import TensorFlow or Keras; load them on first use so that importing
# restorekit imports neither.
_LAZY = {
    "GroupedOptimizer": "restorekit.finetune._graph_mode",
    "KerasGroupedOptimizer": "restorekit.finetune._keras3",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def grouped_keras_optimizer(optimizer_factory, groups: VariableGroups, *, name: str | None = None):
    """A Keras 3 optimizer applying each group's own optimizer; drop it into ``compile``.

    ``optimizer_factory(multiplier)`` returns a Keras optimizer already at that group's
    learning rate; groups with one multiplier share it, frozen groups get none (their
    gradients are dropped). Works with ``model.fit`` and in a custom train step
    (``opt.apply(grads, model.trainable_variables)``). Its state, each group's slots
    included, saves and restores with ``tf.train.Checkpoint(optimizer=opt)``; restoring
    before the first step is fine (Keras defers it to ``build``). Clipping options
    (``global_clipnorm``...) act per group.

    ``learning_rate`` is one base rate, so ``LearningRateScheduler`` and
    ``ReduceLROnPlateau`` work and keep the ratios between groups. Reading it gives the
    rate of the 1x group, or with no 1x group the first group's rate divided by its
    multiplier (a scalar tensor, as Keras gives). Assigning a number sets every group to
    number × multiplier, so a factory whose rates do not follow the multipliers loses
    its own ratios at the first assignment; ``ReduceLROnPlateau``'s ``min_lr`` bounds the
    base rate. If any group's optimizer has a ``LearningRateSchedule``, assigning
    raises and changes nothing, as Keras raises for one optimizer with a schedule.
    ``learning_rates`` reads each group's rate and ``group_optimizers`` holds the
    optimizers by multiplier (not named ``optimizers``: Keras callbacks would take that
    for a ``MultiOptimizer`` and set each group on its own). Under ``tf.distribute`` (tested
    with MirroredStrategy), create it inside ``strategy.scope()`` as any Keras optimizer,
    and in a custom ``strategy.run`` step call ``opt.build(model.trainable_variables)``
    in the scope first.

    Args:
        optimizer_factory: ``multiplier -> keras.optimizers.Optimizer``.
        groups: from ``group_variables(rules, model)``.
        name: the optimizer's name.

    Returns:
        A ``restorekit.finetune.KerasGroupedOptimizer`` (a ``keras.optimizers.Optimizer``).

    Raises:
        InvalidArgumentError: the factory returns no Keras optimizer, or one twice; on
            assigning ``learning_rate``, a value that is not a number >= 0 or a scalar
            tensor, or a group whose optimizer has a schedule.
        GroupError: at build or apply, a variable the groups do not know.
        MissingDependencyError: Keras 2 is installed instead of Keras 3.

    Example:
        >>> groups = group_variables({"net/backbone": 0, "net/head": 10.0}, model)
        >>> model.compile(grouped_keras_optimizer(lambda m: keras.optimizers.Adam(1e-4 * m), groups), "mse")
    """
    from restorekit.finetune._keras3 import KerasGroupedOptimizer as KerasGroupedOptimizer

    return KerasGroupedOptimizer(optimizer_factory, groups, name=name)
