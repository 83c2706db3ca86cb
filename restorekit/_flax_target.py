"""Flax NNX module targets: a module's variables as scan Targets, named by their attribute paths joined with '/'.

Flax keeps TensorFlow's kernel layouts (``nnx.Linear`` [in, out], ``nnx.Conv`` HWIO), so a
module pairs with a TF checkpoint by name alone: ``self.conv = nnx.Conv(...)`` holds
``conv/kernel``, as TF1 and Keras name it; a list of layers gives ``layers/0/kernel``.
Where Flax's leaf names differ from TF's (``scale`` / ``gamma``, ``mean`` / ``moving_mean``)
``rules=restorekit.FLAX_FROM_TF`` pairs them. flax is imported only to walk a module the
caller passed in (so it is installed), never by ``import restorekit``.
"""

from __future__ import annotations

from restorekit.rules import FLAX_FROM_TF
from restorekit._hints import fits

__all__ = ["flax_hints", "is_flax_module", "is_flax_variable", "module_variables", "variable_name"]

# Variable kinds that are no weights: random streams, values a call sowed, decoding caches, perturbations.
_NOT_WEIGHTS = ("RngState", "Intermediate", "Cache", "Perturbation")


def _from_flax_nnx(obj, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("flax.nnx") for c in type(obj).__mro__)


def is_flax_module(obj) -> bool:
    """True for a Flax NNX ``nnx.Module`` (checked by its classes: flax is not imported)."""
    return _from_flax_nnx(obj, "Module")


def is_flax_variable(obj) -> bool:
    """True for a Flax NNX ``nnx.Variable`` (``nnx.Param``, ``nnx.BatchStat``, ...)."""
    return _from_flax_nnx(obj, "Variable")


def variable_name(path) -> str:
    """A graph path (``('layers', 0, 'kernel')``) as a name: its parts joined with '/' (``layers/0/kernel``)."""
    return "/".join(str(part) for part in path)


def module_variables(module, *, params_only: bool = False) -> list:
    """(name, variable, trainable) for every weight of ``module``, in Flax's path order.

    ``nnx.iter_graph`` hands out the live Variables the module holds (setting one's value
    sets the module's), a shared one once under its first path. ``nnx.Param`` is trainable;
    ``nnx.BatchStat`` (a BatchNorm's ``mean`` / ``var``) and other Variables are restored too
    but not trained; RNG state, sown intermediates, caches and perturbations are no weights.
    """
    from flax import nnx

    out = []
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable) or any(_from_flax_nnx(node, kind) for kind in _NOT_WEIGHTS):
            continue
        trainable = isinstance(node, nnx.Param)
        value = node.get_value() if hasattr(node, "get_value") else node.value
        if (params_only and not trainable) or not hasattr(value, "shape") or not hasattr(value, "dtype"):
            continue
        out.append((variable_name(path), node, trainable))
    return out


def module_items(module) -> list:
    """(name, shape, dtype name, live variable, trainable) for every weight of ``module`` (``module_variables``)."""
    items = []
    for name, variable, trainable in module_variables(module):
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        items.append((name, tuple(value.shape), str(value.dtype), variable, trainable))
    return items


def flax_hints(rules, missing, unused) -> tuple:
    """A Flax module scanned by name whose missing variables are in the checkpoint under TF's leaf names
    (``bn/scale`` saved as ``bn/gamma``): point at ``rules=restorekit.FLAX_FROM_TF``."""
    if rules is not None or not missing or not unused:
        return ()
    entries = {r.checkpoint_path or r.checkpoint_name: r for r in unused}
    names = [r.variable_name for r in missing]
    mapping = FLAX_FROM_TF.mapping(names, list(entries))
    pairs = [(r, mapping[r.variable_name]) for r in missing
             if mapping[r.variable_name] in entries and fits(r, entries[mapping[r.variable_name]])]
    if not pairs:
        return ()
    r, found = pairs[0]
    return (f"{len(pairs)} of the {len(missing)} missing variables of this Flax module are in the checkpoint under "
            f"TensorFlow's names (e.g. {r.variable_name!r} as {found!r}); pass rules=restorekit.FLAX_FROM_TF.",)
