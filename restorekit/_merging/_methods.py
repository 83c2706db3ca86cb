"""The merge methods: each a small class with a per-tensor pre-pass (``prepare``) and a per-chunk ``merge``.

``run`` drives one output tensor: ``prepare`` reads the sources' streams once where the method
needs a whole-tensor fact (TIES's magnitude cut per model, SLERP's norms and angle), then
``merge`` makes each chunk of the output from the same chunk of every source (float64 arrays
it may write into). So a merge holds the output tensor and a few chunks, plus one float32
array of magnitudes while a TIES cut is found, never a source as float64.

The arithmetic follows mergekit's (``merge_methods/``): the same order of weighting, sign
election and normalization, so a recipe computes what mergekit computes for it, in float64.
Every step is elementwise, so chunking changes no bit. DARE's drop mask is numpy's, seeded
from (seed, tensor name, model index), drawn in element order.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from restorekit._merging._stream import spans

__all__ = ["METHODS", "Method", "TensorParams", "run"]


@dataclass(frozen=True)
class TensorParams:
    """The resolved parameters of one output tensor: one ``weight`` / ``density`` per non-base model, in order."""

    name: str
    weight: tuple = ()
    density: tuple = ()
    t: float = 0.5
    lambda_: float = 1.0
    normalize: bool = False
    rescale: object = False  # True, False or BY_DENSITY (see below)
    seed: int = 0


class Method:
    """A merge method: its name, what it needs, its parameters with their defaults, ``prepare`` and ``merge``."""

    name = ""
    needs_base = False
    min_sources = 2
    max_sources: int | None = None
    # parameter -> (default, per model?)
    parameters: dict = {}

    def prepare(self, streams: list, base, params: TensorParams):
        """What ``merge`` needs of the whole tensor (read from the streams), for one pass over its chunks."""
        return None

    def merge(self, chunks: list, base, params: TensorParams, state) -> np.ndarray:
        raise NotImplementedError


def run(method: Method, streams: list, base, params: TensorParams, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` (the output tensor, any float dtype) chunk by chunk from ``streams`` (``_stream.Stream``, the
    non-base models in order) and ``base`` (its Stream, or None)."""
    state = method.prepare(streams, base, params)
    flat = out.reshape(-1)
    for span in spans(flat.size):
        chunks = [s.read(span) for s in streams]
        flat[span] = method.merge(chunks, None if base is None else base.read(span), params, state)
        del chunks
    return out


class Linear(Method):
    """Σ wᵢ θᵢ / Σ wᵢ (restorekit.average; mergekit's ``linear``, normalized)."""

    name = "linear"
    parameters = {"weight": (1.0, True)}

    def merge(self, chunks, base, params, state):
        acc = np.zeros(chunks[0].shape, np.float64)
        for x, w in zip(chunks, params.weight):
            acc += x * w
        acc /= sum(params.weight)
        return acc


# ``rescale`` of the sparsifying methods: mergekit's shared boolean (true: scale the kept entries so the delta
# keeps its L1 norm; false: no scaling), or, unset for DARE, the paper's 1 / density.
BY_DENSITY = "1/density"
_EPS = 1e-7  # mergekit's: below it, either L1 norm leaves the kept entries as they are


def _l1_scale(before: float, after: float) -> float:
    """mergekit's ``rescaled_masked_tensor`` factor: the delta's L1 norm over the kept entries' (1 when either is
    below 1e-7)."""
    return 1.0 if before < _EPS or after < _EPS else before / after


class _Cut:
    """One model's TIES trim: keep magnitudes above ``cut`` and the first ``short`` entries equal to it, then
    scale by ``scale`` (1, or mergekit's L1 rescale)."""

    def __init__(self, cut, short: int, scale: float = 1.0):
        self.cut, self.short, self.scale = cut, short, scale

    def apply(self, delta: np.ndarray) -> None:
        mag = np.abs(delta).astype(np.float32)
        keep = mag > self.cut
        if self.short > 0:
            at_cut = np.flatnonzero(mag == self.cut)[: self.short]
            keep[at_cut] = True
            self.short -= len(at_cut)
        delta[~keep] = 0.0
        if self.scale != 1.0:
            delta *= self.scale


def _cut(stream, base, density: float, rescale) -> _Cut | None:
    """The magnitude cut keeping the ``density`` share of the model's delta largest in magnitude (at least one
    entry), or None (keep all).

    Magnitudes are ranked in float32, as mergekit ranks them (``w.float()``): a float32 model's deltas, rounded,
    are exactly the float32 differences mergekit ranks. Equal magnitudes at the cut keep the earliest entries.
    The magnitudes are one float32 array (the delta is read in chunks), partitioned in place. With ``rescale``
    true, a second pass sums the kept entries' magnitudes for mergekit's L1 rescale.
    """
    n = stream.size
    if density >= 1 or n == 0:
        return None
    k = max(1, int(density * n))
    mag = np.empty(n, np.float32)
    before = 0.0
    for span in spans(n):
        delta = stream.read(span)
        delta -= base.read(span)
        np.abs(delta, out=delta)
        if rescale is True:
            before += float(delta.sum())
        mag[span] = delta
    mag.partition(n - k)
    cut = mag[n - k]  # the k-th largest magnitude
    above = sum(int(np.count_nonzero(mag[span] > cut)) for span in spans(n))
    del mag
    if rescale is not True:
        return _Cut(cut, k - above)
    trim, after = _Cut(cut, k - above), 0.0
    for span in spans(n):
        delta = stream.read(span)
        delta -= base.read(span)
        trim.apply(delta)
        after += float(np.abs(delta).sum())
    return _Cut(cut, k - above, _l1_scale(before, after))


class _Drop:
    """One model's DARE drop: each entry dropped with probability 1 - density (numpy's Generator seeded from
    (seed, tensor name, model index), drawn in element order, so the chunks of a tensor draw one mask), the
    kept ones scaled by ``scale``."""

    def __init__(self, params: TensorParams, index: int, density: float, scale: float):
        self.density, self.scale = density, scale
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
            [params.seed & 0xFFFFFFFF, zlib.crc32(params.name.encode("utf-8")), index])))

    def apply(self, delta: np.ndarray) -> None:
        dropped = self.rng.random(delta.size) >= self.density
        delta[dropped] = 0.0
        if self.scale != 1.0:
            delta *= self.scale


def _drop(stream, base, params: TensorParams, index: int, rescale) -> _Drop | None:
    """Model ``index``'s DARE drop, or None (density 1: keep all). ``rescale`` unset: the kept entries times
    1 / density (the paper's rule); true: mergekit's L1 rescale (a first pass draws the same mask to sum the
    norms); false: as they are."""
    density = params.density[index]
    if density >= 1:
        return None
    if rescale is not True:
        return _Drop(params, index, density, 1.0 / density if rescale == BY_DENSITY else 1.0)
    drop, before, after = _Drop(params, index, density, 1.0), 0.0, 0.0
    for span in spans(stream.size):
        delta = stream.read(span)
        delta -= base.read(span)
        before += float(np.abs(delta).sum())
        drop.apply(delta)
        after += float(np.abs(delta).sum())
    return _Drop(params, index, density, _l1_scale(before, after))


class TaskArithmetic(Method):
    """base + λ Σ wᵢ (θᵢ − base) (normalized by Σ wᵢ with ``normalize``); ties/dare sparsify and elect signs."""

    name = "task_arithmetic"
    needs_base = True
    parameters = {"weight": (None, True), "lambda": (1.0, False), "normalize": (False, False)}
    sparsify = ""     # '', 'magnitude' (ties) or 'random' (dare)
    consensus = False  # elect a sign per entry and keep the deltas that agree (ties)

    def prepare(self, streams, base, params):
        if self.sparsify == "magnitude":
            return [_cut(s, base, d, params.rescale) for s, d in zip(streams, params.density)]
        if self.sparsify == "random":
            return [_drop(s, base, params, i, params.rescale) for i, s in enumerate(streams)]
        return None

    def merge(self, chunks, base, params, state):
        if not chunks:
            return base
        parts = chunks  # turned into weighted deltas in place
        for i, (d, w) in enumerate(zip(parts, params.weight)):
            np.subtract(d, base, out=d)
            if state is not None and state[i] is not None:
                state[i].apply(d)  # the model's trim (ties) or drop (dare), and its rescale
            d *= w
        if self.consensus:
            # mergekit's 'sum' election: the sign of the summed weighted deltas (0 counts as +)
            majority = np.where(sum(parts[1:], parts[0].copy()) >= 0, 1.0, -1.0)
            mixed = np.zeros_like(majority)
            divisor = np.zeros_like(majority)
            for p, w in zip(parts, params.weight):
                agree = np.sign(p) == majority
                mixed += np.where(agree, p, 0.0)
                divisor += np.where(agree, w, 0.0)
            divisor[divisor == 0] = 1.0
        else:
            mixed = parts[0].copy()
            for p in parts[1:]:
                mixed += p
            total = float(sum(params.weight))
            divisor = np.full_like(mixed, 1.0 if abs(total) < 1e-8 else total)
        if params.normalize:
            mixed /= divisor
        if params.lambda_ != 1:
            mixed *= params.lambda_
        base += mixed
        return base


class Ties(TaskArithmetic):
    """TIES: trim each delta to ``density`` by magnitude, elect a sign per entry, average the agreeing deltas."""

    name = "ties"
    parameters = {"weight": (None, True), "density": (1.0, True), "lambda": (1.0, False), "normalize": (True, False),
                  "rescale": (False, False)}
    sparsify = "magnitude"
    consensus = True


class DareLinear(TaskArithmetic):
    """DARE: drop delta entries with probability 1 - density, rescale by 1 / density (``rescale: true``: to the
    delta's L1 norm, as mergekit's default; ``false``: not at all), add the weighted sum."""

    name = "dare_linear"
    parameters = {"weight": (None, True), "density": (1.0, True), "lambda": (1.0, False), "normalize": (False, False),
                  "rescale": (BY_DENSITY, False)}
    sparsify = "random"


class DareTies(DareLinear):
    """DARE's drop and rescale, then TIES's sign election."""

    name = "dare_ties"
    consensus = True


class Slerp(Method):
    """Spherical interpolation of two models per tensor, ``t`` from the base (0) to the other (1);
    nearly colinear tensors (|cos| > 0.9995) are interpolated linearly, as mergekit does."""

    name = "slerp"
    needs_base = True
    min_sources = max_sources = 2
    parameters = {"t": (None, False)}
    DOT_THRESHOLD = 0.9995
    EPS = 1e-8

    def prepare(self, streams, base, params):
        (other,) = streams
        t = float(params.t)
        squares_a = squares_b = dot = 0.0
        for span in spans(base.size):  # one pass for both norms and the dot product
            a, b = base.read(span), other.read(span)
            squares_a += float(np.dot(a, a))
            squares_b += float(np.dot(b, b))
            dot += float(np.dot(a, b))
        norm_a, norm_b = float(np.sqrt(squares_a)), float(np.sqrt(squares_b))
        norm_a = norm_a if norm_a > self.EPS else 1.0
        norm_b = norm_b if norm_b > self.EPS else 1.0
        dot = min(1.0, max(-1.0, dot / norm_a / norm_b))
        if abs(dot) > self.DOT_THRESHOLD:
            return 1.0 - t, t
        theta = float(np.arccos(dot))
        sin_theta = float(np.sin(theta))
        return float(np.sin((1 - t) * theta)) / sin_theta, float(np.sin(t * theta)) / sin_theta

    def merge(self, chunks, base, params, state):
        coef_a, coef_b = state
        base *= coef_a
        base += coef_b * chunks[0]
        return base


METHODS: dict = {m.name: m for m in (Linear(), TaskArithmetic(), Ties(), DareLinear(), DareTies(), Slerp())}
