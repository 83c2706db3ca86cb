"""scan(): plan a restore of a checkpoint into variables, building no ops."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

from restorekit.checkpoint import OBJECT_GRAPH_KEY, Checkpoint
from restorekit.ema import is_shadow_name, shadow_suffix
from restorekit.errors import AssignmentMapError, InvalidArgumentError, NoMatchError, format_names
from restorekit.names import PatternSet, closest_names, is_global_step, optimizer_slot_kind
from restorekit.report import Record, RestoreReport
from restorekit.targets import Target, collect, is_partitioned, slice_info, variable_name

__all__ = ["as_checkpoint", "scan"]


def as_checkpoint(checkpoint) -> Checkpoint:
    """A Checkpoint, or a path any Checkpoint accepts."""
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


# ------------------------------------------------------------------ assignment maps

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


def _mapper(assignment_map, targets: list[Target], checkpoint: Checkpoint):
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
    if not isinstance(assignment_map, Mapping):
        raise AssignmentMapError(f"assignment_map must be a dict or a callable, got {type(assignment_map).__name__}")
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
            near = closest_names(key.rstrip("/"), ckpt_names)
            raise NoMatchError(
                f"assignment_map key {key!r} matches no entry of {checkpoint.prefix!r}."
                + (f" Closest: {format_names(near)}." if near else ""),
                near,
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
                    near = closest_names(var_scope.rstrip("/"), var_names)
                    raise NoMatchError(
                        f"assignment_map value {target_name!r} matches no variable."
                        + (f" Closest: {format_names(near)}." if near else ""),
                        near,
                    )
                scopes.append((var_scope, "" if key == "/" else key))
                continue
            if key_is_scope:
                raise AssignmentMapError(
                    f"assignment_map maps the scope {key!r} to the single variable {target_name!r}; "
                    f"map a scope to a scope ({key!r}: 'new_scope/') or a tensor to a variable."
                )
            if key not in checkpoint.entries and key not in checkpoint.object_paths:
                near = closest_names(key, ckpt_names)
                raise NoMatchError(
                    f"assignment_map key {key!r} is not in checkpoint {checkpoint.prefix!r}."
                    + (f" Closest: {format_names(near)}." if near else ""),
                    near,
                )
            if target_name not in known:
                near = closest_names(target_name, var_names)
                raise NoMatchError(
                    f"assignment_map value {target_name!r} is not a variable being restored."
                    + (f" Closest: {format_names(near)}." if near else ""),
                    near,
                )
            exact[target_name] = key
    # The most specific variable scope wins, as an exact name beats any scope.
    scopes.sort(key=lambda pair: len(pair[0]), reverse=True)

    def lookup(name: str):
        if name in exact:
            return exact[name]
        for var_scope, ckpt_scope in scopes:
            if name.startswith(var_scope):
                return ckpt_scope + name[len(var_scope):]
        return None

    return lookup


# ------------------------------------------------------------------ hints

_SYNONYMS = {"biases": "bias", "weights": "kernel", "gamma": "scale", "embeddings": "embedding"}
_UNIQUIFIED = re.compile(r"_\d+$")


# batch norm scopes: tf-slim 'conv1/BatchNorm/...', Keras 'conv1_bn/...' or 'batch_normalization'
_BATCH_NORM = re.compile(r"^(?:(?P<base>.+?)_)?(?:bn|batchnorm|batch_norm|batch_normalization)$", re.IGNORECASE)


def _canonical(name: str) -> str:
    parts = []
    for part in name.split("/"):
        part = _UNIQUIFIED.sub("", part)
        bn = _BATCH_NORM.match(part)
        if bn:
            parts += [bn.group("base"), "bn"] if bn.group("base") else ["bn"]
            continue
        parts.append(_SYNONYMS.get(part, part))
    return "/".join(parts)


def _hints(missing, shape_mismatched, dtype_mismatched, unused) -> tuple[str, ...]:
    hints = []
    by_canonical: dict[str, list[Record]] = {}
    for r in unused:
        by_canonical.setdefault(_canonical(r.checkpoint_path or r.checkpoint_name), []).append(r)
    for r in missing:
        candidates = by_canonical.get(_canonical(r.checkpoint_name), [])
        if len(candidates) == 1:
            c = candidates[0]
            fits = c.checkpoint_shape == r.shape or r.shape is None
            hints.append(
                f"{r.variable_name!r} is missing but checkpoint entry {c.checkpoint_path or c.checkpoint_name!r} "
                f"differs only in naming"
                + ("" if fits else f" (and shape: checkpoint {list(c.checkpoint_shape)}, model {list(r.shape)})")
                + f"; pass assignment_map={{{c.checkpoint_path or c.checkpoint_name!r}: {r.variable_name!r}}}."
            )
    for r in shape_mismatched:
        hints.append(
            f"{r.variable_name!r} differs only in shape "
            f"(checkpoint {list(r.checkpoint_shape)}, model {list(r.shape)}); "
            f"shape_policy='slice_or_pad' keeps the overlapping block."
        )
    from restorekit.remap import CAST, dtype_cast_applies

    for r in dtype_mismatched:
        if dtype_cast_applies(CAST, r.dtype, r.checkpoint_dtype) and _shapes_fit(r.shape, r.checkpoint_shape):
            hints.append(
                f"{r.variable_name!r} differs only in dtype (checkpoint {r.checkpoint_dtype}, model {r.dtype}); "
                f"dtype_policy='cast' restores it cast."
            )
    return tuple(hints)


# ------------------------------------------------------------------ scan

def _same(name: str) -> str:
    return name


def _model_scope(object_paths, variable_names: list):
    """Map a variable path into the checkpoint's model scope when only that scope differs.

    A Keras Sequential puts its own name first in every path, and Keras numbers auto
    names per process: the checkpoint says ``sequential/head/kernel``, this model
    ``sequential_9/head/kernel``. When each side has a single, different first
    component (optimizer state aside), ``sequential_9/...`` is looked up as ``sequential/...``.
    """
    model_paths = [p for p in object_paths if not p.startswith("optimizer/") and p != "save_counter"]
    saved = {p.split("/", 1)[0] for p in model_paths}
    live = {n.split("/", 1)[0] for n in variable_names}
    if len(saved) != 1 or len(live) != 1 or saved == live:
        return _same
    (old,), (new,) = saved, live
    # only a model scope (model/layer/variable below it) renumbered by Keras: 'net' and 'net_9'
    if any(p.count("/") < 2 for p in model_paths + list(variable_names)) or _UNIQUIFIED.sub("", old) != _UNIQUIFIED.sub("", new):
        return _same
    return lambda name: old + name[len(new):] if name.startswith(new + "/") else name


def _names_beat_positions(graph_keys: dict, variable_names: list, by_path) -> dict:
    """Drop object-graph pairings that hand a variable the entry another variable is named after.

    Keras 3 saves layers and the optimizer's variables as numbered lists, so with a
    layer inserted the object graph pairs by position: a new ``extra/kernel`` gets
    the entry saved as ``head/kernel`` while the model's own ``head/kernel`` is right
    there. Names are the stronger evidence; the displaced variable is then matched
    by its own path, or reported missing.
    """
    named = {by_path(n): n for n in variable_names}
    return {name: key for name, key in graph_keys.items() if named.get(key, name) == name}


def _shapes_fit(model_shape, checkpoint_shape) -> bool:
    if model_shape is None:
        return True
    if len(model_shape) != len(checkpoint_shape):
        return False
    return all(m is None or m == c for m, c in zip(model_shape, checkpoint_shape))


def scan(
    checkpoint,
    variables=None,
    *,
    assignment_map=None,
    include=None,
    exclude=None,
    skip_optimizer_slots: bool = True,
    include_global_step: bool = False,
    ema=None,
    rules=None,
    shape_policy=None,
    dtype_policy=None,
    vocab=None,
    match: str = "auto",
) -> RestoreReport:
    """Plan a restore of ``checkpoint`` into ``variables``; build no ops.

    Args:
        checkpoint: a ``Checkpoint`` or any path it accepts.
        variables: None (default graph's global variables), a list of variables
            (ref, resource, partitioned, Keras 3), a ``{checkpoint_name: variable}``
            dict as a Saver takes, or a Keras model / tf.Module.
        assignment_map: ``tf.compat.v1.train.init_from_checkpoint`` semantics, keys
            are checkpoint names or scopes, values variable names, scopes,
            variables or lists of them: ``{'old/': 'new/'}``, ``{'/': 'scope/'}``,
            ``{'emb': ['enc/emb', 'dec/emb']}``. Variables it does not cover are
            skipped. Or a callable ``variable_name -> checkpoint_name | None``.
        include, exclude: patterns over variable names (see ``restorekit.names``:
            a regex matched from the start and ending at a '/' boundary, so plain
            scope prefixes work as tf-slim users expect; compiled patterns use
            ``search``). A variable must match an include pattern (when given)
            and no exclude pattern. A pattern that matches nothing is an error.
        skip_optimizer_slots: leave optimizer slots (Momentum, Adam, adam_m, ...)
            to their initializers, and do not count the checkpoint's as unused.
        include_global_step: also restore global_step.
        ema: an ExponentialMovingAverage or a shadow suffix: restore each variable
            from its shadow entry, falling back per variable to the raw entry.
        rules: naming rules variable name -> checkpoint name: a ``restorekit.tf2.Rules``
            such as ``KERAS_FROM_TF1`` (a Keras model from a TF1/slim checkpoint), a
            list of ``(regex, replacement)`` pairs, or both in one list. A rule that
            matches no variable is an error. Not together with ``assignment_map``.
        shape_policy: what to do with an entry whose shape differs from its variable:
            ``'skip'`` (default; the record is ``shape_mismatched``), ``'slice_or_pad'``
            (copy the overlapping block, initialize the rest), a callable
            ``(checkpoint_value, variable) -> value``, or a dict ``{pattern: policy}``.
            Records restored through a policy are ``matched`` with that ``reason``.
        dtype_policy: None (default; an entry of another dtype is ``dtype_mismatched``)
            or ``'cast'``: a float entry (float16, bfloat16, float32, float64) of the
            right shape restores into a float variable of another precision, cast on
            the way in (``warm_start`` and ``restorekit.restore`` apply it; a Saver
            cannot). Not combined with a shape policy on the same variable.
        vocab: ``{variable_name: restorekit.VocabRemap(...)}``: restore these
            variables by vocabulary, ``warm_start``'s ``VocabInfo`` semantics.
        match: for object-based (TF2) checkpoints: ``'auto'`` (the object graph
            when ``variables`` is a Keras model or tf.Module saved from the same
            architecture, else the readable path), ``'path'`` (readable paths and
            raw keys only) or ``'object_graph'``.

    Returns:
        A RestoreReport.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: the checkpoint cannot be read.
        NoMatchError: an include/exclude pattern, assignment_map entry, rule,
            shape_policy pattern or vocab key matches nothing.
        AssignmentMapError: an assignment_map that cannot be applied.
        VocabularyError: a vocabulary file is missing, has duplicates, or does not fit.

    Example:
        >>> report = restorekit.scan('pretrained/model.ckpt-1000', exclude=['logits'])
        >>> print(report)
    """
    from restorekit import remap, tf2

    ckpt = as_checkpoint(checkpoint)
    targets = collect(variables)
    entries = ckpt.entries
    suffix = shadow_suffix(ema) if ema is not None and ema is not False else None
    includes = PatternSet(include, what="include pattern")
    excludes = PatternSet(exclude, what="exclude pattern")
    if match not in ("auto", "path", "object_graph"):
        raise InvalidArgumentError(f"match is 'auto', 'path' or 'object_graph', got {match!r}")
    policies = remap.resolve_shape_policy(shape_policy)
    remap.check_dtype_policy(dtype_policy)
    vocabularies = remap.check_vocab(vocab, [t.variable_name for t in targets])
    object_paths = ckpt.object_paths
    if rules is not None:
        if assignment_map is not None:
            raise InvalidArgumentError("pass either rules= or assignment_map=, not both")
        assignment_map = tf2.as_rules(rules)
    if isinstance(assignment_map, tf2.Rules):
        assignment_map = assignment_map.bind(
            [t.variable_name for t in targets], list(object_paths) if object_paths else list(entries)
        )
    lookup = _mapper(assignment_map, targets, ckpt)
    rescope = _model_scope(object_paths, [t.variable_name for t in targets]) if object_paths and match == "auto" else _same

    def by_path(name: str) -> str | None:  # the key saved under readable path ``name``, if any
        return object_paths.get(name) or object_paths.get(rescope(name))

    graph_keys: dict[str, str] = {}
    if ckpt.is_object_based and match != "path" and assignment_map is None and tf2.is_trackable(variables):
        by_id = tf2.object_graph_keys(variables, ckpt.object_graph, [t.handle for t in targets])
        graph_keys = {t.variable_name: by_id[id(t.handle)] for t in targets if id(t.handle) in by_id}
        if match == "auto":
            graph_keys = _names_beat_positions(graph_keys, [t.variable_name for t in targets], by_path)
    if match == "object_graph" and not graph_keys:
        raise NoMatchError(
            f"match='object_graph' found none of the {len(targets)} variables in the object graph of "
            f"{ckpt.prefix!r}; pass a Keras model or tf.Module saved from the same architecture"
        )

    matched, missing, shape_mm, dtype_mm, skipped = [], [], [], [], []
    owner: dict[str, str] = {}  # checkpoint key -> the variable it restores
    shared: list[tuple[str, str, str]] = []
    raw_replaced: set[str] = set()
    handles: dict[str, object] = {}
    applied: dict[str, object] = {}
    for t in targets:
        name = t.variable_name
        # Every name is offered to the policy patterns, so a pattern "matches
        # nothing" only when it names no variable at all.
        shape_policy_here = policies.for_name(name) if policies else None
        if includes and includes.first_match(name) is None:
            skipped.append(Record(name, None, t.shape, t.dtype, reason="not included"))
            continue
        pattern = excludes.first_match(name) if excludes else None
        if pattern is not None:
            shown = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
            skipped.append(Record(name, None, t.shape, t.dtype, reason=f"excluded by {shown!r}"))
            continue
        slot = optimizer_slot_kind(name)
        if slot and skip_optimizer_slots:
            skipped.append(Record(name, None, t.shape, t.dtype, reason=f"optimizer slot ({slot})"))
            continue
        if is_global_step(name) and not include_global_step:
            skipped.append(Record(name, None, t.shape, t.dtype, reason="global_step"))
            continue
        ckpt_name = t.checkpoint_name if t.checkpoint_name is not None else lookup(name)
        if ckpt_name is not None and t.checkpoint_name is None and ckpt.is_object_based:
            if name in graph_keys:
                ckpt_name = graph_keys[name]
            elif match != "object_graph" and ckpt_name not in entries:
                ckpt_name = by_path(ckpt_name) or ckpt_name
        if ckpt_name is None:
            skipped.append(Record(name, None, t.shape, t.dtype, reason="not in assignment_map"))
            continue
        reason = ""
        if suffix is not None and not is_shadow_name(ckpt_name, suffix):
            shadow = f"{ckpt_name}/{suffix}"
            if shadow in entries:
                raw_replaced.add(ckpt_name)
                ckpt_name, reason = shadow, "ema"
            else:
                reason = "ema fallback: no shadow entry, raw weights used"
        entry = entries.get(ckpt_name)
        if entry is None:
            missing.append(Record(name, ckpt_name, t.shape, t.dtype))
            continue
        if assignment_map is None and ckpt.is_object_based and ckpt_name in owner:
            # Found automatically for two variables: the first keeps it (an
            # assignment_map can still share one entry on purpose).
            missing.append(Record(name, ckpt_name, t.shape, t.dtype))
            shared.append((name, owner[ckpt_name], ckpt_name))
            continue
        owner[ckpt_name] = name
        record = Record(
            name, ckpt_name, t.shape, t.dtype, entry.shape, entry.dtype, reason, _readable(ckpt, ckpt_name)
        )
        policy = vocabularies.get(name)
        if policy is not None:
            policy.check(name, t.shape, entry.shape)
        elif not _shapes_fit(t.shape, entry.shape):
            policy = shape_policy_here
            if policy is None or not remap.policy_applies(policy, t.shape, entry.shape):
                shape_mm.append(record)
                continue
        if t.dtype != entry.dtype:
            if policy is None and remap.dtype_cast_applies(dtype_policy, t.dtype, entry.dtype):
                why = f"cast {entry.dtype} -> {t.dtype}"
                matched.append(replace(record, reason=f"{why}; {reason}" if reason else why))
                handles[name] = t.handle
                applied[name] = remap.CAST
            else:
                dtype_mm.append(record)
        elif policy is not None and policy != remap.SKIP:
            why = remap.policy_reason(policy)
            matched.append(replace(record, reason=f"{why}; {reason}" if reason else why))
            handles[name] = t.handle
            applied[name] = policy
        else:
            matched.append(record)
            handles[name] = t.handle
    includes.check_all_used([t.variable_name for t in targets])
    excludes.check_all_used([t.variable_name for t in targets])
    policies.check_all_used([t.variable_name for t in targets])

    unused = []
    for name, entry in entries.items():
        if name in owner or name == OBJECT_GRAPH_KEY:
            continue
        readable = _readable(ckpt, name)
        record = Record(
            None, name, checkpoint_shape=entry.shape, checkpoint_dtype=entry.dtype, checkpoint_path=readable
        )
        slot = optimizer_slot_kind(readable or name)
        if slot and skip_optimizer_slots:
            skipped.append(replace(record, reason=f"optimizer slot ({slot})"))
        elif is_global_step(readable or name) and not include_global_step:
            skipped.append(replace(record, reason="global_step"))
        elif name in raw_replaced:
            skipped.append(replace(record, reason="raw weights (EMA shadow restored instead)"))
        elif is_shadow_name(name, suffix or "ExponentialMovingAverage") and suffix is None:
            skipped.append(replace(record, reason="EMA shadow (pass ema= to restore it)"))
        else:
            unused.append(record)
    return RestoreReport(
        checkpoint=ckpt.prefix,
        num_variables=len(targets),
        matched=tuple(matched),
        missing=tuple(missing),
        shape_mismatched=tuple(shape_mm),
        dtype_mismatched=tuple(dtype_mm),
        skipped=tuple(skipped),
        unused=tuple(unused),
        hints=_hints(missing, shape_mm, dtype_mm, unused) + tuple(
            f"{name!r} and {first!r} both match checkpoint entry {_readable(ckpt, key) or key!r}; {first!r} restores "
            f"from it and {name!r} is left to its initializer (an assignment_map can give one entry to both)."
            for name, first, key in shared
        ),
        _handles=handles,
        _policies=applied,
    )


def _readable(ckpt: Checkpoint, name: str) -> str | None:
    """The readable path of an object-based checkpoint key, None when it adds nothing."""
    if not ckpt.is_object_based:
        return None
    readable = ckpt.readable_name(name)
    return readable if readable != name else None

