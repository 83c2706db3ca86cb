"""Hints for near misses in a restore report: naming synonyms, shapes, dtypes."""

from __future__ import annotations

import re

from restorekit._policies import CAST, AdaptInputChannels, ResizePositions, dtype_cast_applies
from restorekit._report import Record

__all__ = ["UNIQUIFIED", "fits", "level_hint", "level_index", "one_level_away", "restore_hints", "scope_hint", "shapes_fit"]

_SYNONYMS = {"biases": "bias", "weights": "kernel", "gamma": "scale", "embeddings": "embedding"}
UNIQUIFIED = re.compile(r"_\d+$")


# batch norm scopes: tf-slim 'conv1/BatchNorm/...', Keras 'conv1_bn/...' or 'batch_normalization'
_BATCH_NORM = re.compile(r"^(?:(?P<base>.+?)_)?(?:bn|batchnorm|batch_norm|batch_normalization)$", re.IGNORECASE)


def _canonical(name: str) -> str:
    parts: list[str] = []
    for part in name.split("/"):
        part = UNIQUIFIED.sub("", part)
        bn = _BATCH_NORM.match(part)
        if bn:
            parts += [bn.group("base"), "bn"] if bn.group("base") else ["bn"]
            continue
        parts.append(_SYNONYMS.get(part, part))
    return "/".join(parts)


def restore_hints(missing, shape_mismatched, dtype_mismatched, unused) -> tuple[str, ...]:
    hints = []
    by_canonical: dict[str, list[Record]] = {}
    for r in unused:
        by_canonical.setdefault(_canonical(r.checkpoint_path or r.checkpoint_name), []).append(r)
    for r in missing:
        # only an entry that would restore as it is: a hint must not lead to a mismatch
        candidates = [c for c in by_canonical.get(_canonical(r.checkpoint_name), []) if fits(r, c)]
        if len(candidates) == 1:
            c = candidates[0]
            hints.append(
                f"{r.variable_name!r} is missing but checkpoint entry {c.checkpoint_path or c.checkpoint_name!r} "
                f"differs only in naming; pass assignment_map={{{c.checkpoint_path or c.checkpoint_name!r}: "
                f"{r.variable_name!r}}}."
            )
    for r in shape_mismatched:
        if "CuDNN" in (r.reason or ""):
            continue  # a CuDNN RNN weight converts whole or not at all: a slice of it means nothing
        adapter = adapter_hint(r)
        if adapter is not None:
            hints.append(adapter)
            continue
        if not _only_last_dim_differs(r.shape, r.checkpoint_shape):
            continue  # other input features too: the overlapping block would mean nothing
        hints.append(
            f"{r.variable_name!r} differs only in shape "
            f"(checkpoint {list(r.checkpoint_shape)}, model {list(r.shape)}); "
            f"shape_policy='slice_or_pad' keeps the overlapping block, which helps only when those rows mean the "
            f"same thing in both (the first classes of a grown head); a new head for other classes should start fresh."
        )
    for r in dtype_mismatched:
        if dtype_cast_applies(CAST, r.dtype, r.checkpoint_dtype) and shapes_fit(r.shape, r.checkpoint_shape):
            hints.append(
                f"{r.variable_name!r} differs only in dtype (checkpoint {r.checkpoint_dtype}, model {r.dtype}); "
                f"dtype_policy='cast' restores it cast."
            )
    scoped = scope_hint(missing, unused) or group_hint(missing, unused)
    level = level_hint(missing, unused)
    return tuple(hints) + ((scoped,) if scoped else ()) + ((level,) if level else ())


def group_hint(missing, unused) -> str | None:
    """A hint when missing variables sit in a torch training checkpoint under one group (``model_state.0.weight``
    for ``0.weight``): read that group as the source. Pairs as ``scope_hint`` does, by shape and dtype."""
    by_rest: dict[str, list] = {}
    for r in unused:
        group, dot, rest = (r.checkpoint_name or "").partition(".")
        if dot and rest:
            by_rest.setdefault(rest, []).append((group, r))
    votes: dict[str, list] = {}
    for r in missing:
        for g, c in by_rest.get(r.checkpoint_name or r.variable_name or "", ()):
            if fits(r, c):  # a checkpoint with 'model' and 'ema' groups holds each weight twice: both get a vote
                votes.setdefault(g, []).append((r, c))
    if not votes:
        return None
    # the group of the most; on a tie the raw weights before a moving average ('model' before 'ema')
    group, pairs = max(votes.items(), key=lambda item: (len(item[1]), "ema" not in item[0].lower()))
    others = [g for g, p in votes.items() if g != group and len(p) == len(pairs)]
    r, c = pairs[0]
    also = f" (or {', '.join(map(repr, others))}, which holds them too)" if others else ""
    return (
        f"{len(pairs)} of the {len(missing)} missing variables are in the checkpoint under its group {group!r}{also} "
        f"(e.g. {r.variable_name!r} as {c.checkpoint_name!r}); read that group as the source: "
        f"restorekit.From(checkpoint, prefix={group + '.'!r}), or the path 'CHECKPOINT:{group}'."
    )


def level_hint(missing, unused) -> str | None:
    """A hint when missing variables are in the checkpoint one scope level apart (``rnn/lstm_cell/kernel``
    saved as ``rnn/kernel``, or the reverse), each with the one unused entry that restores it as it is."""
    entries = {r.checkpoint_path or r.checkpoint_name: r for r in unused}
    pairs = []
    for r in missing:
        found = one_level_away(r.checkpoint_name or r.variable_name, entries)
        if found is not None and fits(r, entries[found]):
            pairs.append((r, found))
    if not pairs:
        return None
    r, found = pairs[0]
    return (
        f"{len(pairs)} of the {len(missing)} missing variables are in the checkpoint one scope level apart "
        f"(e.g. {r.variable_name!r} as {found!r}); pass rules=restorekit.Rules(scope_levels=True) "
        f"(for a Keras 2 file restorekit.KERAS_FROM_KERAS2), or assignment_map={{{found!r}: {r.variable_name!r}}} "
        f"for this one."
    )


# a path component naming a learned position table: BERT 'position_embeddings', ViT 'pos_embed',
# Keras 'position_embedding', 'posemb'
_POSITIONS = re.compile(r"(pos|position|positional)_?(emb|embed|embedding|embeddings|encoding)?s?(_\d+)?$",
                        re.IGNORECASE)
# A first convolution sees image channels: gray, RGB, RGBA, a few more (multispectral).
_FEW_CHANNELS = 16


def adapter_hint(r) -> str | None:
    """A hint naming the shape adapter that fits ``r`` (a shape-mismatched record), or None.

    Only where it fits: a position table (by name) whose length alone differs, or a
    convolution kernel whose input channels alone differ and are few on both sides.
    """
    name, model, stored = r.variable_name, r.shape, r.checkpoint_shape
    parts = f"{name.split(':')[0]}/{r.checkpoint_name or ''}".split("/")
    if any(_POSITIONS.match(part) for part in parts):
        for adapter, spelled in ((ResizePositions(1, grid=True), "ResizePositions(num_prefix_tokens=1, grid=True)"),
                                 (ResizePositions(0, grid=True), "ResizePositions(num_prefix_tokens=0, grid=True)"),
                                 (ResizePositions(0, grid=False), "ResizePositions(num_prefix_tokens=0, grid=False)")):
            if adapter.applies(model, stored):
                return (f"{name!r} is a position table of another length (checkpoint {list(stored)}, model "
                        f"{list(model)}); shape_policy={{{name!r}: restorekit.{spelled}}} interpolates the "
                        f"learned positions to the new length (set num_prefix_tokens to the class tokens it has).")
    if (model is not None and 3 <= len(model) <= 5 and AdaptInputChannels().applies(model, stored)
            and max(model[-2], stored[-2]) <= _FEW_CHANNELS):
        return (f"{name!r} differs only in its input channels (checkpoint {stored[-2]}, model {model[-2]}); if it is "
                f"the first convolution, shape_policy={{{name!r}: 'adapt_input_channels'}} adapts the kernel "
                f"(summed to one channel, or repeated and rescaled).")
    return None


def _tails(name: str):
    """(prefix, tail) splits of ``name`` at each '/', longest tail first, tails of two or more components."""
    parts = name.split("/")
    for i in range(len(parts) - 1):
        yield "/".join(parts[:i]), "/".join(parts[i:])


def scope_hint(missing, unused) -> str | None:
    """A hint when missing variables sit in the checkpoint under another scope (``model/conv1/w`` vs ``conv1/w``).

    Pairs each missing variable with the one unused entry of the same tail (two or
    more path components; shape and dtype agreeing, so following the hint restores
    them); the scope change most pairs agree on becomes one ``assignment_map`` in
    ``init_from_checkpoint`` form.
    """
    by_tail: dict[str, list] = {}
    for r in unused:
        for prefix, tail in _tails(r.checkpoint_path or r.checkpoint_name):
            by_tail.setdefault(tail, []).append((prefix, r))
    votes: dict[tuple, list] = {}
    for r in missing:
        for var_prefix, tail in _tails(r.checkpoint_name or r.variable_name):
            fitting = [(p, c) for p, c in by_tail.get(tail, ()) if p != var_prefix and fits(r, c)]
            if len(fitting) == 1:
                ckpt_prefix, c = fitting[0]
                votes.setdefault((ckpt_prefix, var_prefix), []).append((r, c))
                break
    if not votes:
        return None
    (ckpt_prefix, var_prefix), pairs = max(votes.items(), key=lambda item: len(item[1]))
    r, c = pairs[0]
    key, value = (ckpt_prefix + "/") if ckpt_prefix else "/", (var_prefix + "/") if var_prefix else "/"
    return (
        f"{len(pairs)} of the {len(missing)} missing variables are in the checkpoint under another scope "
        f"(e.g. {r.variable_name!r} as {c.checkpoint_path or c.checkpoint_name!r}); "
        f"pass assignment_map={{{key!r}: {value!r}}}."
    )


def fits(variable, entry) -> bool:
    """True when ``entry`` (a checkpoint-side record) can restore ``variable`` as it is: shape and dtype agree."""
    if entry.checkpoint_shape is not None and not shapes_fit(variable.shape, entry.checkpoint_shape):
        return False
    return variable.dtype is None or entry.checkpoint_dtype is None or variable.dtype == entry.checkpoint_dtype


def _only_last_dim_differs(model_shape, checkpoint_shape) -> bool:
    """True for a head grown or cut in its classes: same rank, every dimension but the last agreeing."""
    if model_shape is None or not model_shape or len(model_shape) != len(checkpoint_shape):
        return False
    return shapes_fit(model_shape[:-1], checkpoint_shape[:-1])


def shapes_fit(model_shape, checkpoint_shape) -> bool:
    """True when a variable of ``model_shape`` (None dims are free) can take ``checkpoint_shape``."""
    if model_shape is None:
        return True
    if len(model_shape) != len(checkpoint_shape):
        return False
    return all(m is None or m == c for m, c in zip(model_shape, checkpoint_shape))


def level_index(names) -> dict:
    """Each name with one inner scope level dropped -> the names that give it (for ``one_level_away``)."""
    index: dict = {}
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts) - 1):
            index.setdefault("/".join(parts[:i] + parts[i + 1:]), []).append(name)
    return index


def one_level_away(name: str, known, index: dict | None = None) -> str | None:
    """The one name of ``known`` that is ``name`` with one inner scope level dropped or inserted, or None.

    ``rnn_1/lstm_cell/kernel`` finds ``rnn_1/kernel`` (Keras 2 saved LSTM weights without the
    cell's scope) and ``rnn_1/kernel`` finds ``rnn_1/lstm_cell/kernel``; the first scope (the
    layer) and the leaf stay. None when no name or several names are one level away.
    """
    parts = name.split("/")
    found = {c for c in ("/".join(parts[:i] + parts[i + 1:]) for i in range(1, len(parts) - 1)) if c in known}
    found.update((index if index is not None else level_index(known)).get(name, ()))
    found.discard(name)
    return found.pop() if len(found) == 1 else None
