"""assignment_map: ``init_from_checkpoint``-style maps and callables turned into one name lookup."""

from __future__ import annotations

from collections.abc import Mapping

from restorekit._registry import Source
from restorekit.errors import AssignmentMapError, NoMatchError
from restorekit._targets import Target, is_partitioned, slice_info, variable_name

__all__ = ["mapper"]


def _value_names(value) -> list[str]:
    """The variable names (or scopes) an assignment_map value stands for."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        if value and all(not isinstance(v, str) and slice_info(v) is not None for v in value):
            return [slice_info(value[0]).full_name]  # the parts of one partitioned variable
        return [name for v in value for name in _value_names(v)]
    if is_partitioned(value):
        return [variable_name(value)]
    info = slice_info(value)
    if info is not None:
        return [info.full_name]
    if hasattr(value, "name") and hasattr(value, "dtype"):
        return [variable_name(value)]
    raise AssignmentMapError(f"assignment_map values are variable names, scopes or variables; got {value!r}")


def mapper(assignment_map, targets: list[Target], checkpoint: Source):
    """A function variable_name -> checkpoint name or None, from init_from_checkpoint-style maps."""
    if assignment_map is None:
        return lambda name: name
    if callable(assignment_map) and not isinstance(assignment_map, Mapping):
        def call(name):
            result = assignment_map(name)
            if result is not None and not isinstance(result, str):
                raise AssignmentMapError(f"assignment_map({name!r}) returned {result!r}; return a str or None")
            return result

        return call
    assignment_map = _from_pairs(assignment_map)
    if not isinstance(assignment_map, Mapping):
        raise AssignmentMapError(
            f"assignment_map must be a dict, a list of (checkpoint_name, variable) pairs or a callable, "
            f"got {type(assignment_map).__name__}"
        )
    exact, scopes = _map_entries(assignment_map, targets, checkpoint)

    def lookup(name: str):
        if name in exact:
            return exact[name]
        for var_scope, ckpt_scope in scopes:
            if name.startswith(var_scope):
                return ckpt_scope + name[len(var_scope):]
        return None

    return lookup


def _from_pairs(assignment_map):
    """A list of ``(checkpoint_name, variable)`` pairs, as ``init_from_checkpoint`` takes, as a dict."""
    if not isinstance(assignment_map, (list, tuple)):
        return assignment_map
    grouped: dict = {}
    for pair in assignment_map:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise AssignmentMapError(f"an assignment_map list holds (checkpoint_name, variable) pairs, got {pair!r}")
        grouped.setdefault(pair[0], []).append(pair[1])
    return {key: values[0] if len(values) == 1 else values for key, values in grouped.items()}


def _map_entries(assignment_map: Mapping, targets: list[Target], checkpoint: Source):
    """Exact names (variable -> checkpoint) and (variable scope, checkpoint scope) pairs, checked."""
    var_names = [t.variable_name for t in targets]
    known = set(var_names)
    # Object-based checkpoints are addressed by readable path as well as raw key.
    ckpt_names = list(checkpoint.entries) + list(checkpoint.object_paths)
    exact: dict[str, str] = {}
    scopes: list[tuple[str, str]] = []  # (variable scope, checkpoint scope), '' means root
    for key, value in assignment_map.items():
        if not isinstance(key, str) or not key:
            raise AssignmentMapError(f"assignment_map keys are checkpoint names or scopes, got {key!r}")
        key_is_scope = key.endswith("/")
        if key_is_scope and key != "/" and not any(n.startswith(key) for n in ckpt_names):
            raise NoMatchError(
                f"assignment_map key {key!r} matches no entry of {checkpoint.prefix!r}.",
                name=key.rstrip("/"), candidates=ckpt_names,
            )
        for target_name in _value_names(value):
            is_scope = target_name.endswith("/") or (
                target_name not in known and any(n.startswith(target_name + "/") for n in var_names)
            )
            if is_scope:
                if not key_is_scope:
                    raise AssignmentMapError(
                        f"assignment_map maps {key!r} to the scope {target_name!r}; a key without a trailing '/' "
                        f"names one tensor. Write {{{key + '/'!r}: {target_name.rstrip('/') + '/'!r}}} to map a scope."
                    )
                var_scope = "" if target_name == "/" else target_name.rstrip("/") + "/"
                if var_scope and not any(n.startswith(var_scope) for n in var_names):
                    raise NoMatchError(
                        f"assignment_map value {target_name!r} matches no variable.",
                        name=var_scope.rstrip("/"), candidates=var_names,
                    )
                scopes.append((var_scope, "" if key == "/" else key))
                continue
            if key_is_scope:
                raise AssignmentMapError(
                    f"assignment_map maps the scope {key!r} to the single variable {target_name!r}; "
                    f"map a scope to a scope ({key!r}: 'new_scope/') or a tensor to a variable."
                )
            if key not in checkpoint.entries and key not in checkpoint.object_paths:
                raise NoMatchError(
                    f"assignment_map key {key!r} is not in checkpoint {checkpoint.prefix!r}.",
                    name=key, candidates=ckpt_names,
                )
            if target_name not in known:
                raise NoMatchError(
                    f"assignment_map value {target_name!r} is not a variable being restored.",
                    name=target_name, candidates=var_names,
                )
            exact[target_name] = key
    # The most specific variable scope wins, as an exact name beats any scope.
    scopes.sort(key=lambda pair: len(pair[0]), reverse=True)
    return exact, scopes
