"""scan(): plan a restore of a checkpoint into variables, building no ops.

``scan`` is a sequence of named steps over one ``_Scan`` state: resolve the options,
find each variable's checkpoint name (filters, assignment map, object graph, readable
paths, EMA shadow), classify it (matched, missing, mismatched, skipped), then sort the
entries nothing took into skipped and unused.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from restorekit import _policies as policy_rules
from restorekit._assignment import mapper
from restorekit._checkpoint import OBJECT_GRAPH_KEY
from restorekit import keras_files
from restorekit._ema import KERAS_AVERAGE_SUFFIX, is_shadow_name, keras_averages, scoped_shadows, shadow_suffix
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, NoMatchError, RestoreKitWarning, format_names
from restorekit.formats import open_source
from restorekit._registry import Source
from restorekit._hints import UNIQUIFIED, restore_hints, shapes_fit
from restorekit._optim._plan import with_optimizer
from restorekit._names import Kind, PatternSet, counter_kind, entry_kind, optimizer_slot_kind
from restorekit._report import Record, RestoreReport, with_stored
from restorekit.rules import KERAS_FROM_KERAS2, Rules, as_rules, keras_layer_pairs
from restorekit._sources import is_several, scan_several
from restorekit._targets import Target, absent_record, collect, is_lora_adapter, lora_notes, target_hints, variable_name
from restorekit._torch_target import layout_source
from restorekit._trackables import is_trackable, object_graph_keys

__all__ = ["as_checkpoint", "scan"]


def as_checkpoint(checkpoint) -> Source:
    """An open Source, or a path in any readable format (``restorekit.formats.open``: TF, Keras, safetensors, .pt, .npz)."""
    return open_source(checkpoint)


def _same(name: str) -> str:
    return name


def _model_scope(object_paths, variable_names: list):
    """Map a variable path into the checkpoint's model scope when only that scope differs.

    A Keras Sequential puts its own name first in every path, and Keras numbers auto
    names per process: the checkpoint says ``sequential/head/kernel``, this model
    ``sequential_9/head/kernel``. When each side has a single, different first
    component (optimizer, counter and RNG state aside), ``sequential_9/...`` is looked up as ``sequential/...``.
    """
    model_paths = [p for p in object_paths if entry_kind(p).is_weight]
    variable_names = [n for n in variable_names if entry_kind(n).is_weight]  # RNG state sits outside the model scope
    saved = {p.split("/", 1)[0] for p in model_paths}
    live = {n.split("/", 1)[0] for n in variable_names}
    if len(saved) != 1 or len(live) != 1 or saved == live:
        return _same
    (old,), (new,) = saved, live
    # only a model scope (model/layer/variable below it) renumbered by Keras: 'net' and 'net_9'
    if any(p.count("/") < 2 for p in model_paths + list(variable_names)) or UNIQUIFIED.sub("", old) != UNIQUIFIED.sub("", new):
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
    layout: str | None = None,
    optimizer=None,
) -> RestoreReport:
    """Plan a restore of ``checkpoint`` into ``variables``; build no ops.

    Args:
        checkpoint: a ``Checkpoint`` or any path it accepts; or several sources: a list
            (each variable from the first source holding its entry) or a mapping
            ``{pattern over variable names: source}``, a source being a path or
            ``restorekit.From(path, **options)`` with options of its own
            (``restorekit._sources``). Records then name their ``source``.
        variables: None (default graph's global variables), a list of variables
            (ref, resource, partitioned, Keras 3), a ``{checkpoint_name: variable}``
            dict as a Saver takes, or a Keras model / tf.Module.
        assignment_map: ``tf.compat.v1.train.init_from_checkpoint`` semantics, keys
            are checkpoint names or scopes, values variable names, scopes,
            variables or lists of them: ``{'old/': 'new/'}``, ``{'/': 'scope/'}``,
            ``{'emb': ['enc/emb', 'dec/emb']}``. Variables it does not cover are
            skipped. Or a callable ``variable_name -> checkpoint_name | None``.
        include: patterns over variable names (see ``restorekit._names``: a regex
            matched from the start and ending at a '/' boundary, so plain scope
            prefixes work as tf-slim users expect; compiled patterns use
            ``search``). A variable must match an include pattern (when given).
            A pattern that matches nothing is an error.
        exclude: patterns as for ``include``; a variable must match none of them.
        skip_optimizer_slots: leave optimizer slots (Momentum, Adam, adam_m, ...)
            to their initializers, and do not count the checkpoint's as unused.
        include_global_step: also restore global_step.
        ema: an ExponentialMovingAverage or a shadow suffix: restore each variable
            from its shadow entry, falling back per variable to the raw entry.
        rules: naming rules variable name -> checkpoint name: a ``restorekit.Rules``
            such as ``KERAS_FROM_TF1`` (a Keras model from a TF1/slim checkpoint), a
            list of ``(regex, replacement)`` pairs, or both in one list. A rule that
            matches no variable is an error. Not together with ``assignment_map``.
            Or a ready rule set of names and axes (``'bert-tf-to-hf'``), for a torch module.
        shape_policy: what to do with an entry whose shape differs from its variable:
            ``'skip'`` (default; the record is ``shape_mismatched``), ``'slice_or_pad'``
            (copy the overlapping block, initialize the rest), ``'resize_positions'``
            or ``ResizePositions(...)`` (interpolate a position-embedding table to a new
            length or grid), ``'adapt_input_channels'`` or ``AdaptInputChannels(...)`` (a
            first convolution for another number of input channels), a callable
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
        layout: ``'torch'``: see the checkpoint as its ``layout='torch'`` export (TF
            names and axes as a ``torch.nn`` twin's ``state_dict``), for a torch module.
        optimizer: the ``torch.optim``, Keras 3 or ``nnx.Optimizer`` (optax) optimizer of the module or model:
            carry the TF1, Keras 2 (tf-keras, in a TF2 checkpoint) or Keras 3 optimizer state into it, each slot
            paired through its weight's record (``report.optimizer``).

    Returns:
        A RestoreReport.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: the checkpoint cannot be read.
        NoMatchError: an include/exclude pattern, assignment_map entry, rule,
            shape_policy pattern or vocab key matches nothing.
        AssignmentMapError: an assignment_map that cannot be applied.
        VocabularyError: a vocabulary file is missing, has duplicates, or does not fit.
        InvalidArgumentError: several sources where a variable is taken by two source
            patterns (NoMatchError: a source pattern takes none), raised before any is read.

    Example:
        >>> report = restorekit.scan('pretrained/model.ckpt-1000', exclude=['logits'])
        >>> print(report)
    """
    if is_several(checkpoint):
        shared = dict(assignment_map=assignment_map, include=include, exclude=exclude, skip_optimizer_slots=
                      skip_optimizer_slots, include_global_step=include_global_step, ema=ema, rules=rules,
                      shape_policy=shape_policy, dtype_policy=dtype_policy, vocab=vocab, match=match, layout=layout)
        return with_optimizer(scan_several(checkpoint, variables, shared, scan), variables, optimizer)
    ckpt, rules = layout_source(as_checkpoint(checkpoint), layout, rules, variables)
    ckpt.check_shards()  # a truncated shard is named now, not by TF's OutOfRangeError at restore time
    if match not in ("auto", "path", "object_graph"):
        raise InvalidArgumentError(f"match is 'auto', 'path' or 'object_graph', got {match!r}")
    state = _Scan(ckpt, collect(variables), match, skip_optimizer_slots, include_global_step)
    _resolve_options(state, include, exclude, ema, shape_policy, dtype_policy, vocab)
    _resolve_names(state, variables, assignment_map, rules)
    for target in state.targets:
        _plan_target(state, target)
    names = [t.variable_name for t in state.targets]
    state.includes.check_all_used(names)
    state.excludes.check_all_used(names)
    state.policies.check_all_used(names)
    _sort_leftover_entries(state)
    state.notes += target_hints(state, variables, layout, rules)
    return with_optimizer(_report(state), variables, optimizer)


@dataclass
class _Scan:
    """What one scan knows and has found so far."""

    ckpt: Source
    targets: list
    match: str
    skip_optimizer_slots: bool
    include_global_step: bool
    # _resolve_options sets includes, excludes, ema, policies and dtype_policy; _resolve_names sets lookup.
    includes: PatternSet = field(default_factory=lambda: PatternSet(None))
    excludes: PatternSet = field(default_factory=lambda: PatternSet(None))
    suffix: str | None = None
    ema: Any = None  # the ExponentialMovingAverage, when one was given (it knows its shadows' names)
    scoped_shadows: dict | None = None  # variable name -> shadow entry saved under an extra scope, if unique
    keras_averages: dict | None = None  # weight's key -> its Keras 3 use_ema average's key
    policies: policy_rules.ShapePolicies = field(default_factory=lambda: policy_rules.ShapePolicies(None))
    dtype_policy: object = None
    vocabularies: dict = field(default_factory=dict)
    assignment_map: object = None
    lookup: Callable[[str], str | None] = _same
    pairing: str = "name"  # Record.how of a pairing by lookup: 'name', 'rule' or 'assignment_map'
    rescope: Callable[[str], str] = _same
    graph_keys: dict = field(default_factory=dict)
    positional: set = field(default_factory=set)  # variables paired with another name's entry, by position
    dropped: dict = field(default_factory=dict)  # by-position pairings refused because names answer
    matched: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    shape_mismatched: list = field(default_factory=list)
    dtype_mismatched: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    unused: list = field(default_factory=list)
    owner: dict = field(default_factory=dict)  # checkpoint key -> the variable it restores
    shared: list = field(default_factory=list)  # (variable, first owner, key) refused a second time
    raw_replaced: set = field(default_factory=set)
    handles: dict = field(default_factory=dict)
    applied: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)  # variable name -> (key, reason): paired inside its Keras layer
    notes: tuple = ()  # hints on how names were found (a rule set applied by itself)

    def by_path(self, name: str) -> str | None:
        """The key saved under readable path ``name``, if any."""
        paths = self.ckpt.object_paths
        return paths.get(name) or paths.get(self.rescope(name)) or self.aliases.get(name, (None,))[0]


def _resolve_options(state: _Scan, include, exclude, ema, shape_policy, dtype_policy, vocab) -> None:
    state.suffix = shadow_suffix(ema) if ema is not None and ema is not False else None
    state.ema = ema if hasattr(ema, "average_name") else None
    state.includes = PatternSet(include, what="include pattern")
    state.excludes = PatternSet(exclude, what="exclude pattern")
    state.policies = policy_rules.resolve_shape_policy(shape_policy)
    policy_rules.check_dtype_policy(dtype_policy)
    state.dtype_policy = dtype_policy
    state.vocabularies = policy_rules.check_vocab(vocab, [t.variable_name for t in state.targets])


def _resolve_names(state: _Scan, variables, assignment_map, rules) -> None:
    """Set up the name lookup: assignment map or rules, model-scope aliasing, object-graph pairing."""
    ckpt, names = state.ckpt, [t.variable_name for t in state.targets]
    object_paths = ckpt.object_paths
    if rules is not None:
        if assignment_map is not None:
            raise InvalidArgumentError("pass either rules= or assignment_map=, not both")
        assignment_map = as_rules(rules)
    state.pairing = "rule" if isinstance(assignment_map, Rules) else "name" if assignment_map is None else "assignment_map"
    if isinstance(assignment_map, Rules):
        assignment_map = assignment_map.bind(names, list(object_paths) if object_paths else list(ckpt.entries))
    state.assignment_map = assignment_map
    state.lookup = mapper(assignment_map, state.targets, ckpt)
    if object_paths and state.match == "auto":
        state.rescope = _model_scope(object_paths, names)
    if ckpt.is_object_based and state.match != "path" and assignment_map is None and is_trackable(variables):
        by_id = object_graph_keys(variables, ckpt.object_graph, [t.handle for t in state.targets])
        state.graph_keys = {t.variable_name: by_id[id(t.handle)] for t in state.targets if id(t.handle) in by_id}
        if state.match == "auto":
            state.graph_keys = _names_beat_positions(state.graph_keys, names, state.by_path)
        _positions_only_where_names_fail(state, names)
    if isinstance(ckpt, keras_files.KerasCheckpoint) and assignment_map is None and state.match != "object_graph":
        _keras_fallbacks(state, ckpt, names)
    if state.match == "object_graph" and not state.graph_keys:
        raise NoMatchError(
            f"match='object_graph' found none of the {len(state.targets)} variables in the object graph of "
            f"{ckpt.prefix!r}; pass a Keras model or tf.Module saved from the same architecture"
        )


def _keras_fallbacks(state: _Scan, ckpt: keras_files.KerasCheckpoint, names: list) -> None:
    """Where paths name no entry of a Keras file: pair inside each layer (by leaf or position, as Keras
    loads weights); and for a legacy Keras 2 file, ``KERAS_FROM_KERAS2`` when it fits more variables
    than the names as they are (Keras 2 numbered layers from 1: its ``dense_1`` is Keras 3's ``dense``)."""
    state.aliases = keras_layer_pairs([(t.variable_name, t.shape, t.dtype) for t in state.targets],
                                      state.by_path, ckpt.layer_variables)
    if ckpt.is_weights_file:
        return
    mapping = KERAS_FROM_KERAS2.mapping(names, list(ckpt.object_paths))

    def fitting(lookup) -> int:
        keys = [(t, lookup(t.variable_name)) for t in state.targets]
        return sum(1 for t, key in keys if key in ckpt.entries and _pair_fits(t, ckpt.entries[key]))

    if fitting(lambda n: state.by_path(mapping[n])) > fitting(state.by_path):
        state.aliases = {}
        state.assignment_map = mapping.get
        state.lookup = mapper(state.assignment_map, state.targets, ckpt)
        state.notes = (f"the names of this Keras 2 file fit fewer variables than rule set {KERAS_FROM_KERAS2!r} "
                       f"(Keras 2 numbered layers from 1, and named some a scope level apart), so it was applied; "
                       f"check the pairs.",)


def _positions_only_where_names_fail(state: _Scan, names: list) -> None:
    """Keep object-graph pairings across names only where names match nothing at all.

    Keras saves layers as numbered lists, so the object graph pairs by position: a
    new ``extra`` layer takes the entry saved as ``head``. When the model shares
    names with the checkpoint, names are the evidence and such pairings are dropped
    (a hint names them); when it shares none (every layer renamed or renumbered),
    positions are all there is, and each such pairing is reported ``by position``.
    ``match='object_graph'`` keeps them all, still reported.
    """
    cross = {}
    saved_as = _keras_paths(state)
    for name, key in state.graph_keys.items():
        path = state.ckpt.readable_name(key)
        if path not in (name, state.rescope(name)) and state.by_path(name) != key and saved_as.get(name) != key:
            cross[name] = key
    if not cross:
        return
    if state.match == "auto" and any(state.by_path(n) for n in names):
        state.dropped = cross
        state.graph_keys = {n: k for n, k in state.graph_keys.items() if n not in cross}
    else:
        state.positional = set(cross)


def _keras_paths(state: _Scan) -> dict:
    """Variable name -> the key saved under that Keras variable's own path, for pairings names agree with.

    Two nested blocks' ``fc/kernel`` repeat a Keras path, so the checkpoint's readable path
    is the object path (``model/_operations/1/...``) and the variable is named by its layers
    (``block_a/fc/kernel``); the saved ``full_name`` is still the variable's own Keras path.
    """
    by_key = state.ckpt.object_graph.by_key
    out = {}
    for t in state.targets:
        key = state.graph_keys.get(t.variable_name)
        tracked = by_key.get(key) if key is not None and not t.partitioned else None
        # a layer scope in it: TF's default 'Variable' names say nothing about which variable it was
        if tracked is not None and "/" in tracked.full_name and tracked.full_name == variable_name(t.handle):
            out[t.variable_name] = key
    return out


def _skip_reason(state: _Scan, name: str) -> tuple[str, str] | None:
    """Why a variable is left out before any lookup (filters, optimizer slots, global_step, RNG state):
    ``(reason, how)``, or None."""
    if state.includes and state.includes.first_match(name) is None:
        return "not included", "not_included"
    pattern = state.excludes.first_match(name) if state.excludes else None
    if pattern is not None:
        shown = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
        return f"excluded by {shown!r}", "excluded"
    return _state_reason(state, name)


def _state_reason(state: _Scan, name: str) -> tuple[str, str] | None:
    """Why optimizer state, a counter or RNG state is left out (``names.entry_kind`` decides which is which):
    ``(reason, how)``, or None."""
    kind = entry_kind(name)
    if kind is Kind.OPTIMIZER and state.skip_optimizer_slots:
        return f"optimizer slot ({optimizer_slot_kind(name) or 'Keras 2 optimizer'})", "optimizer"
    if kind is Kind.COUNTER and not state.include_global_step:
        return counter_kind(name) or "counter", "counter"
    if kind is Kind.RNG:  # renumbered in every model Keras builds, and only a random stream's position
        return "RNG state (seed generator)", "rng"
    return None


def _checkpoint_name(state: _Scan, t: Target) -> tuple[str | None, tuple]:
    """The entry a variable restores from (before EMA), or None when the assignment map leaves it out,
    and how it was found (``Record.how``)."""
    name = t.variable_name
    if t.checkpoint_name is not None:
        return t.checkpoint_name, ("assignment_map",)
    ckpt_name = state.lookup(name)
    how: tuple = ("name",) if state.pairing == "rule" and ckpt_name == name else (state.pairing,)
    if ckpt_name is not None and state.ckpt.is_object_based:
        by_name, name_how = ckpt_name, how
        if state.match != "object_graph" and ckpt_name not in state.ckpt.entries:
            key = state.by_path(ckpt_name)
            if key is not None:
                by_name, name_how = key, how + ("readable_path",)
        if name in state.graph_keys:
            ckpt_name = state.graph_keys[name]
            # A pair the names give too is reported as the names give it, so one checkpoint and one model
            # report alike on every backend (only TensorFlow's live trackables reach the object graph);
            # 'object_graph' means the object graph paired what the names did not, or match='object_graph'.
            if name in state.positional:
                how = ("position",)
            elif state.match != "object_graph" and by_name == ckpt_name:
                how = name_how
            else:
                how = ("object_graph",)
        else:
            ckpt_name, how = by_name, name_how
    return ckpt_name, how


def _scoped_shadows(state: _Scan) -> dict:
    """Shadows that ``ema.apply()`` inside a variable scope saved as ``scope/v/<suffix>``: tail name -> entry."""
    if state.scoped_shadows is None:
        assert state.suffix is not None, "asked for shadows only under ema="
        state.scoped_shadows = scoped_shadows(state.ckpt.entries, state.suffix)
    return state.scoped_shadows


def _keras_averages(state: _Scan) -> dict:
    """Keras 3 ``use_ema`` averages: weight's key -> its average's key (object-based checkpoints)."""
    if state.keras_averages is None:
        try:
            graph = state.ckpt.object_graph if state.ckpt.is_object_based else None
        except CorruptCheckpointError:  # the raw keys still restore; only the averages' names are lost
            graph = None
        state.keras_averages = keras_averages(state.ckpt.entries, graph)
    return state.keras_averages


def _shadow_of(state: _Scan, t: Target, ckpt_name: str) -> str | None:
    entries = state.ckpt.entries
    if state.ema is not None and not t.partitioned:
        try:  # the EMA object knows where it put a shadow it created (a variable scope included)
            named = state.ema.average_name(t.handle)
        except Exception:  # noqa: BLE001  (a Keras variable or another graph's: fall back to the rule)
            named = None
        if named in entries and named != ckpt_name:
            return named
    shadow = f"{ckpt_name}/{state.suffix}"
    if shadow in entries:
        return shadow
    return _keras_averages(state).get(ckpt_name) or _scoped_shadows(state).get(ckpt_name)


def _ema_entry(state: _Scan, t: Target, ckpt_name: str) -> tuple[str, str]:
    """The shadow entry to restore instead of ``ckpt_name`` under ``ema=``, and the reason to record."""
    if state.suffix is None or is_shadow_name(ckpt_name, state.suffix):
        return ckpt_name, ""
    shadow = _shadow_of(state, t, ckpt_name)
    if shadow is not None:
        state.raw_replaced.add(ckpt_name)
        return shadow, "ema"
    return ckpt_name, "ema fallback: no shadow entry, raw weights used"


def _plan_target(state: _Scan, t: Target) -> None:
    name = t.variable_name
    # Every name is offered to the policy patterns, so a pattern "matches nothing"
    # only when it names no variable at all.
    shape_policy = state.policies.for_name(name) if state.policies else None
    skip = _skip_reason(state, name)
    if skip is not None:
        state.skipped.append(Record(name, None, t.shape, t.dtype, reason=skip[0], how=(skip[1],)))
        return
    ckpt_name, how = _checkpoint_name(state, t)
    if ckpt_name is None:
        state.skipped.append(Record(name, None, t.shape, t.dtype, reason="not in assignment_map",
                                    how=("not_in_assignment_map",)))
        return
    ckpt_name, reason = _ema_entry(state, t, ckpt_name)
    if reason:
        how += ("ema",) if reason == "ema" else ("ema_fallback",)
    if name in state.positional:
        reason = f"by position; {reason}" if reason else "by position"
    elif name in state.aliases and state.aliases[name][0] == ckpt_name:
        reason = f"{state.aliases[name][1]}; {reason}" if reason else state.aliases[name][1]
    entry = state.ckpt.entries.get(ckpt_name)
    if entry is None:  # the adapters enable_lora adds are new by design: skipped, not missing
        (state.skipped if is_lora_adapter(t) else state.missing).append(absent_record(t, ckpt_name))
        return
    if state.assignment_map is None and state.ckpt.is_object_based and ckpt_name in state.owner:
        # Found automatically for two variables: the first keeps it (an
        # assignment_map can still share one entry on purpose).
        state.missing.append(Record(name, ckpt_name, t.shape, t.dtype))
        state.shared.append((name, state.owner[ckpt_name], ckpt_name))
        return
    state.owner[ckpt_name] = name
    record = Record(name, ckpt_name, t.shape, t.dtype, entry.shape, entry.dtype, reason, _readable(state.ckpt, ckpt_name),
                    how)
    _classify(state, t, record, shape_policy)


def _classify(state: _Scan, t: Target, record: Record, shape_policy) -> None:
    """Matched (plainly or through a policy or cast), or shape / dtype mismatched."""
    name, reason = t.variable_name, record.reason
    policy = state.vocabularies.get(name)
    cudnn = getattr(state.ckpt, "cudnn_weights", {}).get(record.checkpoint_name)
    if policy is not None:
        policy.check(name, t.shape, record.checkpoint_shape)
    elif cudnn is not None:  # converted like Keras 2 converts it, or refused: never restored as stored
        refusal = _cudnn_refusal(state, t, cudnn, record)
        if refusal:
            state.shape_mismatched.append(replace(record, reason=refusal))
            return
        policy = cudnn
    elif not shapes_fit(t.shape, record.checkpoint_shape):
        policy = shape_policy
        if policy is None or not policy_rules.policy_applies(policy, t.shape, record.checkpoint_shape):
            state.shape_mismatched.append(record)
            return
    if t.dtype != record.checkpoint_dtype:
        if policy is None and policy_rules.dtype_cast_applies(state.dtype_policy, t.dtype, record.checkpoint_dtype):
            policy, why = policy_rules.CAST, f"cast {record.checkpoint_dtype} -> {t.dtype}"
        else:
            state.dtype_mismatched.append(record)
            return
    elif policy is not None and policy != policy_rules.SKIP:
        why = cudnn.__name__ if cudnn is not None else policy_rules.policy_reason(policy)
    else:
        policy = why = None
    if why is not None:
        record = replace(record, reason=f"{why}; {reason}" if reason else why, how=record.how + ("policy",))
        state.applied[name] = policy
    state.matched.append(record)
    state.handles[name] = t.handle


def _cudnn_refusal(state: _Scan, t: Target, cudnn, record: Record) -> str:
    """Why a Keras 2 CuDNN RNN weight cannot restore into ``t`` ('' when its conversion fits)."""
    fits = t.dtype == record.checkpoint_dtype and shapes_fit(t.shape, cudnn.shape(record.checkpoint_shape))
    if cudnn.layer == "CuDNNGRU":  # only GRU(reset_after=True) computes what CuDNNGRU computes
        bias = next((u for u in state.targets if u.variable_name == t.variable_name.rpartition("/")[0] + "/bias"), None)
        fits = fits and bias is not None and tuple(bias.shape or ()) == (2, 3 * cudnn.units)
    if fits:
        return ""
    return (f"{cudnn.layer} weights (units {cudnn.units}) restore only into a Keras "
            f"{'LSTM' if cudnn.layer == 'CuDNNLSTM' else 'GRU(reset_after=True)'} of {cudnn.units} units, converted")


def _sort_leftover_entries(state: _Scan) -> None:
    """Entries no variable took: skipped on purpose (slots, global_step, EMA) or unused."""
    suffix = state.suffix
    for name, entry in state.ckpt.entries.items():
        if name in state.owner or name == OBJECT_GRAPH_KEY:
            continue
        readable = _readable(state.ckpt, name)
        record = Record(None, name, checkpoint_shape=entry.shape, checkpoint_dtype=entry.dtype, checkpoint_path=readable)
        # through a layout or rule set, what an entry is (an optimizer slot) is read off its stored key
        stored = state.ckpt.stored_name(name) if hasattr(state.ckpt, "stored_name") else name
        skip = _state_reason(state, readable or stored)
        if skip is not None:
            state.skipped.append(replace(record, reason=skip[0], how=(skip[1],)))
        elif name in state.raw_replaced:
            state.skipped.append(replace(record, reason="raw weights (EMA shadow restored instead)", how=("raw_weights",)))
        elif is_shadow_name(name, suffix or "ExponentialMovingAverage") and suffix is None:
            state.skipped.append(replace(record, reason="EMA shadow (pass ema= to restore it)", how=("ema_shadow",)))
        else:
            state.unused.append(record)


def _ema_hints(state: _Scan) -> tuple:
    """ema= found no shadow at all: say so loudly, since the raw weights were matched instead."""
    if state.suffix is None or not state.matched or any("ema" in r.how for r in state.matched):
        return ()
    text = (f"ema= was given but {state.ckpt.prefix!r} holds no shadow entries ('.../{state.suffix}') and no "
            f"Keras use_ema '...{KERAS_AVERAGE_SUFFIX}' optimizer variables; all {len(state.matched)} matches "
            "restore the raw weights. ")
    if keras_files.is_keras_path(state.ckpt.prefix):
        text += ("A Keras weights file keeps optimizer variables by position only ('optimizer/vars/N'), so use_ema "
                 "averages cannot be told apart there; model.fit copies them into the weights at the end of "
                 "training, and a tf.train.Checkpoint of the optimizer keeps them by name.")
    else:
        text += "Was the checkpoint saved without the ExponentialMovingAverage (or the optimizer's) variables?"
    warnings.warn(text, RestoreKitWarning, stacklevel=3)
    return (text,)


def _dropped_hints(state: _Scan) -> tuple:
    """Position pairings dropped because names answer, offered back only where they would restore.

    A pairing whose entry has another shape or dtype than the variable (an inserted
    Dense(16) taking a [16, 3] head) would only turn into a mismatch, so it is not offered;
    ``match='object_graph'`` is offered only when every dropped pairing fits.
    """
    ckpt, matched = state.ckpt, {r.variable_name for r in state.matched}
    targets = {t.variable_name: t for t in state.targets}
    dropped = {name: key for name, key in state.dropped.items() if name not in matched}
    fitting = {name: key for name, key in dropped.items() if _pair_fits(targets[name], ckpt.entries.get(key))}
    by_position = "pass match='object_graph' to restore by position, or " if len(fitting) == len(dropped) else "pass "
    return tuple(
        f"{name!r} pairs by position with checkpoint entry {_readable(ckpt, key) or key!r} (the object graph's "
        f"order), but names disagree and other variables match by name; {by_position}"
        f"assignment_map={{{_readable(ckpt, key) or key!r}: {name!r}}} for this one."
        for name, key in fitting.items()
    )


def _pair_fits(t: Target, entry) -> bool:
    """True when ``entry`` restores into ``t`` as it is: same dtype, a shape the variable takes."""
    return entry is not None and t.dtype == entry.dtype and shapes_fit(t.shape, entry.shape)


def _repeated(state: _Scan) -> dict:
    """Missing variable name -> how many variables bear it (more than one: the name cannot tell them apart)."""
    counts: dict = {}
    for t in state.targets:
        counts[t.variable_name] = counts.get(t.variable_name, 0) + 1
    return {r.variable_name: counts[r.variable_name] for r in state.missing if counts[r.variable_name] > 1}


def _repeated_names_hints(state: _Scan) -> tuple:
    """Names that several variables bear (two nested blocks' ``fc/kernel`` in ``model.weights``) are left
    missing, never paired by a guess; a scope hint for them would give every one the same entry."""
    repeated = _repeated(state)
    if not repeated:
        return ()
    name, count = next(iter(repeated.items()))
    return (f"{len(repeated)} missing variable name(s) each name several variables (e.g. {name!r} names {count}: "
            f"{format_names(repeated, 4)}), so which checkpoint entry is whose cannot be decided by name. Pass the "
            f"model itself (scan(checkpoint, model)): each variable is then named by the layers it sits in "
            f"('block/{name}'), or pass assignment_map={{checkpoint name: variable}} for each.",)


def _report(state: _Scan) -> RestoreReport:
    ckpt = state.ckpt
    repeated = _repeated(state)
    shared_hints = tuple(
        f"{name!r} and {first!r} both match checkpoint entry {_readable(ckpt, key) or key!r}; {first!r} restores "
        f"from it and {name!r} is left to its initializer (an assignment_map can give one entry to both)."
        for name, first, key in state.shared
    )
    records: dict = {kind: with_stored(getattr(state, kind), getattr(ckpt, 'stored_entry', None)) for kind in
                     ("matched", "missing", "shape_mismatched", "dtype_mismatched", "skipped", "unused")}
    return RestoreReport(
        checkpoint=ckpt.prefix,
        num_variables=len(state.targets),
        **records,
        hints=_repeated_names_hints(state) + restore_hints(
            [r for r in state.missing if r.variable_name not in repeated], state.shape_mismatched,
            state.dtype_mismatched, state.unused) + shared_hints + _dropped_hints(state) + _ema_hints(state) + state.notes + lora_notes(state.targets),
        _handles=state.handles,
        _policies=state.applied,
        _source=state.ckpt,
    )


def _readable(ckpt: Source, name: str) -> str | None:
    """The readable path of an object-based checkpoint key, None when it adds nothing."""
    if not ckpt.is_object_based:
        return None
    readable = ckpt.readable_name(name)
    return readable if readable != name else None

