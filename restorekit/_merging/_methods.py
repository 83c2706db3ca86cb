"""The merge methods: each a small class whose ``merge(tensors, base, params)`` makes one output tensor.

Inputs are float64 arrays of one shape (``tensors`` every non-base model's, ``base`` the
base model's or None); the result is float64. Methods may write into the arrays they are
given (the pipeline hands each call fresh copies), so a merge holds the sources plus a
fixed number of element chunks, never a stack of every delta.

The arithmetic follows mergekit's (``merge_methods/``): the same order of weighting,
sign election and normalization, so a recipe computes what mergekit computes for it, in
float64. DARE's drop mask is numpy's, seeded from (seed, tensor name, model index).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["METHODS", "Method", "TensorParams"]

# Elements handled at a time in elementwise steps: their temporaries stay a few MB.
CHUNK = 1 << 16


@dataclass(frozen=True)
class TensorParams:
    """The resolved parameters of one output tensor: one ``weight`` / ``density`` per non-base model, in order."""

    name: str
    weight: tuple = ()
    density: tuple = ()
    t: float = 0.5
    lambda_: float = 1.0
    normalize: bool = False
    seed: int = 0


class Method:
    """A merge method: its name, what it needs, its parameters with their defaults, and ``merge``."""

    name = ""
    needs_base = False
    min_sources = 2
    max_sources: int | None = None
    # parameter -> (default, per model?)
    parameters: dict = {}

    def merge(self, tensors: list, base, params: TensorParams) -> np.ndarray:
        raise NotImplementedError


def _chunks(size: int):
    for start in range(0, size, CHUNK):
        yield slice(start, min(start + CHUNK, size))


class Linear(Method):
    """Σ wᵢ θᵢ / Σ wᵢ (restorekit.average; mergekit's ``linear``, normalized)."""

    name = "linear"
    parameters = {"weight": (1.0, True)}

    def merge(self, tensors, base, params):
        acc = np.zeros(tensors[0].shape, np.float64)
        for x, w in zip(tensors, params.weight):
            self.add(acc, x, w)
        return self.finish(acc, params.weight)

    @staticmethod
    def add(acc: np.ndarray, x: np.ndarray, w: float) -> None:
        """``acc += w * x`` in element chunks (``x`` in any float dtype)."""
        flat_acc, flat = acc.reshape(-1), x.reshape(-1)
        for s in _chunks(flat.size):
            flat_acc[s] += flat[s].astype(np.float64) * w

    @staticmethod
    def finish(acc: np.ndarray, weights) -> np.ndarray:
        acc /= sum(weights)
        return acc


def _trim(delta: np.ndarray, density: float) -> None:
    """Keep the ``density`` share of ``delta``'s entries largest in magnitude (at least one), zero the rest, in place.

    Magnitudes are ranked in float32, as mergekit ranks them (``w.float()``): a float32 model's
    deltas, rounded, are exactly the float32 differences mergekit ranks. Equal magnitudes at the
    cut keep the earliest entries.
    """
    if density >= 1:
        return
    flat = delta.reshape(-1)
    n = flat.size
    if n == 0:
        return
    k = max(1, int(density * n))
    mag = np.abs(flat).astype(np.float32)
    cut = np.partition(mag, n - k)[n - k]  # the k-th largest magnitude
    keep = mag > cut
    short = k - int(np.count_nonzero(keep))
    if short > 0:
        at_cut = np.flatnonzero(mag == cut)[:short]
        keep[at_cut] = True
    del mag
    flat[~keep] = 0.0


def _dare(delta: np.ndarray, density: float, name: str, seed: int, index: int) -> None:
    """Drop each entry of ``delta`` with probability 1 - density and rescale the rest by 1 / density, in place.

    The mask comes from numpy's Generator seeded from (seed, tensor name, model index): the same
    recipe and seed give the same merge, in any tensor order.
    """
    if density >= 1:
        return
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [seed & 0xFFFFFFFF, zlib.crc32(name.encode("utf-8")), index])))
    flat = delta.reshape(-1)
    for s in _chunks(flat.size):
        dropped = rng.random(s.stop - s.start) >= density
        part = flat[s]
        part[dropped] = 0.0
        part *= 1.0 / density


class TaskArithmetic(Method):
    """base + λ Σ wᵢ (θᵢ − base) (normalized by Σ wᵢ with ``normalize``); ties/dare sparsify and elect signs."""

    name = "task_arithmetic"
    needs_base = True
    parameters = {"weight": (None, True), "lambda": (1.0, False), "normalize": (False, False)}
    sparsify = ""     # '', 'magnitude' (ties) or 'random' (dare)
    consensus = False  # elect a sign per entry and keep the deltas that agree (ties)

    def merge(self, tensors, base, params):
        if not tensors:
            return base
        deltas = tensors  # turned into weighted deltas in place: the sources plus chunks, never a stack
        for i, (d, w) in enumerate(zip(deltas, params.weight)):
            np.subtract(d, base, out=d)
            if self.sparsify == "magnitude":
                _trim(d, params.density[i])
            elif self.sparsify == "random":
                _dare(d, params.density[i], params.name, params.seed, i)
            d *= w
        flat_base = base.reshape(-1)
        flat = [d.reshape(-1) for d in deltas]
        for s in _chunks(flat_base.size):
            parts = [f[s] for f in flat]
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
            flat_base[s] += mixed
        return base


class Ties(TaskArithmetic):
    """TIES: trim each delta to ``density`` by magnitude, elect a sign per entry, average the agreeing deltas."""

    name = "ties"
    parameters = {"weight": (None, True), "density": (1.0, True), "lambda": (1.0, False), "normalize": (True, False)}
    sparsify = "magnitude"
    consensus = True


class DareLinear(TaskArithmetic):
    """DARE: drop delta entries with probability 1 - density, rescale by 1 / density, add the weighted sum."""

    name = "dare_linear"
    parameters = {"weight": (None, True), "density": (1.0, True), "lambda": (1.0, False), "normalize": (False, False)}
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

    def merge(self, tensors, base, params):
        (other,) = tensors
        t = float(params.t)
        a, b = base.reshape(-1), other.reshape(-1)
        if a.size == 0:
            return base
        norm_a, norm_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
        norm_a = norm_a if norm_a > self.EPS else 1.0
        norm_b = norm_b if norm_b > self.EPS else 1.0
        dot = sum(float(np.dot(a[s] / norm_a, b[s] / norm_b)) for s in _chunks(a.size))
        dot = min(1.0, max(-1.0, dot))
        if abs(dot) > self.DOT_THRESHOLD:
            coef_a, coef_b = 1.0 - t, t
        else:
            theta = float(np.arccos(dot))
            sin_theta = float(np.sin(theta))
            coef_a, coef_b = float(np.sin((1 - t) * theta)) / sin_theta, float(np.sin(t * theta)) / sin_theta
        for s in _chunks(a.size):
            part = a[s]
            part *= coef_a
            part += coef_b * b[s]
        return base


METHODS: dict = {m.name: m for m in (Linear(), TaskArithmetic(), Ties(), DareLinear(), DareTies(), Slerp())}
