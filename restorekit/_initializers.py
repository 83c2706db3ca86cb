"""Initializers that touch only variables not yet initialized."""

from __future__ import annotations

from restorekit._tensorflow import import_tensorflow
from restorekit._targets import collect, flat_variables, variable_name

__all__ = ["initialize_uninitialized", "uninitialized_initializer"]


def _plain_variables(variables):
    if variables is None:
        tf = import_tensorflow()

        return tf.compat.v1.global_variables() + tf.compat.v1.local_variables()
    return flat_variables(collect(variables))


def uninitialized_initializer(variables=None, *, name: str = "restorekit_init_uninitialized"):
    """An op that initializes each variable only if it is not initialized yet.

    Safe to run after a partial restore: restored values are left alone. Uses each
    variable's ``initial_value``, so warm-started variables still load from their
    checkpoint.

    Args:
        variables: as ``restorekit.scan`` accepts; None means global + local variables.
    """
    tf = import_tensorflow()

    tf1 = tf.compat.v1
    ops = []
    for var in _plain_variables(variables):
        with tf1.name_scope(None), tf1.name_scope(f"{variable_name(var)}/restorekit_init"):
            ops.append(
                tf1.cond(
                    tf1.is_variable_initialized(var),
                    tf.no_op,
                    lambda v=var: tf.group(tf1.assign(v, v.initial_value, validate_shape=False).op),
                )
            )
    return tf.group(*ops, name=name)


def initialize_uninitialized(session, variables=None) -> list[str]:
    """Initialize the variables ``session`` reports uninitialized; return their names.

    Args:
        session: a ``tf.compat.v1.Session`` (or MonitoredSession's raw session).
        variables: as ``restorekit.scan`` accepts; None means global + local variables.
    """
    tf = import_tensorflow()

    tf1 = tf.compat.v1
    candidates = _plain_variables(variables)
    if not candidates:
        return []
    with tf1.name_scope("restorekit_check"):
        names = session.run(tf1.report_uninitialized_variables(candidates))
    wanted = {n.decode() if isinstance(n, bytes) else n for n in names}
    todo = [v for v in candidates if variable_name(v) in wanted]
    if todo:
        session.run(tf1.variables_initializer(todo))
    return sorted(variable_name(v) for v in todo)
