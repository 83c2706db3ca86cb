"""Variable groups as optax partitions: a label per group over a Flax NNX module's ``nnx.Param`` state.

optax's ``multi_transform(transforms, labels)`` gives each label its own transform. The
labels are the groups of ``group_variables`` (the same rules as every other training
style), one per parameter of ``nnx.state(module, nnx.Param)``; the transforms are the
caller's optimizer at each group's rate, ``optax.set_to_zero()`` for a frozen group.
Partitions are labels, never copies of the optimizer. flax and optax load inside the
functions.
"""

from __future__ import annotations

from restorekit.errors import InvalidArgumentError, MissingDependencyError
from restorekit._flax_target import is_flax_module, module_variables
from restorekit.finetune._groups import VariableGroups, group_variables

__all__ = ["grouped_optax", "optax_partitions"]


def _groups(module, rules, default: float) -> VariableGroups:
    if not is_flax_module(module):
        raise InvalidArgumentError(f"optax partitions are made over a Flax nnx.Module, got {type(module).__name__}")
    return rules if isinstance(rules, VariableGroups) else group_variables(rules, module, default=default)


def optax_partitions(module, rules, *, default: float = 1.0):
    """The label of every ``nnx.Param`` of ``module``: its group's label, as ``optax.multi_transform`` takes them.

    Args:
        module: a Flax ``nnx.Module``.
        rules: ordered ``{pattern: multiplier}`` over the parameters' paths joined with '/'
            (``{'backbone': 0, 'head': 10.0}``), as for ``group_variables``; or the
            ``VariableGroups`` that ``group_variables(rules, module)`` returned.
        default: the multiplier of parameters no rule takes.

    Returns:
        An ``nnx.State`` shaped as ``nnx.state(module, nnx.Param)`` whose leaves are group labels
        (``"'head'"``, ``'(default)'``: ``VariableGroup.label``).

    Raises:
        InvalidArgumentError: ``module`` is not a Flax NNX module, or a multiplier is no number >= 0.
        NoMatchError: a rule takes no parameter (lists the closest names).

    Example:
        >>> labels = optax_partitions(model, {'backbone': 0, 'head': 10.0})
        >>> tx = optax.multi_transform({"'backbone'": optax.set_to_zero(), "'head'": optax.adam(1e-3), ...}, labels)
    """
    import jax
    from flax import nnx

    groups = _groups(module, rules, default)
    label_of = {id(v): groups.group_of(name).label for name, v, _ in module_variables(module, params_only=True)}
    return jax.tree.map(lambda v: label_of[id(v)], nnx.state(module, nnx.Param),
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def grouped_optax(optimizer_factory, module, rules, *, default: float = 1.0):
    """One optax transformation that trains each group of ``module`` with its own rate and leaves frozen ones still.

    ``optax.multi_transform`` over ``optax_partitions(module, rules)``: each group's transform is
    ``optimizer_factory(multiplier)`` (already at that group's rate), a frozen group's
    ``optax.set_to_zero()``. Use it as any optax transformation, in ``nnx.Optimizer(module, tx,
    wrt=nnx.Param)`` or over ``nnx.state(module, nnx.Param)``.

    Args:
        optimizer_factory: ``multiplier -> optax.GradientTransformation``
            (``lambda m: optax.adamw(1e-4 * m)``).
        module: a Flax ``nnx.Module``.
        rules: ``{pattern: multiplier}`` or ``VariableGroups``, as for ``optax_partitions``.
        default: the multiplier of parameters no rule takes.

    Raises:
        MissingDependencyError: optax is not installed.
        InvalidArgumentError, NoMatchError: as ``optax_partitions``.

    Example:
        >>> tx = grouped_optax(lambda m: optax.adam(1e-3 * m), model, {'backbone': 0, 'head': 10.0})
        >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    """
    try:
        import optax
    except ImportError:
        raise MissingDependencyError("grouped_optax needs optax: pip install 'restorekit[flax]'") from None
    groups = _groups(module, rules, default)
    transforms = {g.label: optax.set_to_zero() if g.frozen else optimizer_factory(g.multiplier) for g in groups}
    return optax.multi_transform(transforms, optax_partitions(module, groups))
