"""TF1 optimizer state -> ``torch.optim`` state, one small pure-numpy function per optimizer pair.

The hyper-parameters of the target optimizer are read as the source run's (``Adam(lr,
betas, eps)`` for ``AdamOptimizer(lr, beta1, beta2, epsilon)``); where the two frameworks
give one name another meaning, the target's value is set so that its next update equals
TensorFlow's, and what no setting can make equal is named with its size. The updates,
for a gradient ``g`` at step ``k`` (1-based: ``k = t + 1`` after ``t`` steps):

| TF1 optimizer | TF1 update | torch update | conversion |
| --- | --- | --- | --- |
| ``AdamOptimizer`` | ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, ``var -= lr sqrt(1-b2^k)/(1-b1^k) m / (sqrt(v) + eps)`` | ``Adam``: ``p -= lr/(1-b1^k) m / (sqrt(v)/sqrt(1-b2^k) + eps')`` | ``exp_avg = m``, ``exp_avg_sq = v``, ``step = t`` (``beta1_power = b1^(t+1)``); equal when ``eps' = eps/sqrt(1-b2^k)``, which changes with ``k``: set for ``k = t+1``, the drift after is reported |
| ``MomentumOptimizer`` | ``a = mu a + g``, ``var -= lr a`` (nesterov: ``var -= lr (g + mu a)``) | ``SGD(momentum=mu, dampening=0, nesterov=...)``: the same | ``momentum_buffer = a``, exact |
| ``RMSPropOptimizer`` | ``ms = rho ms + (1-rho) g^2`` (``ms`` starts at 1), ``mom = mu mom + lr g / sqrt(ms + eps)``, ``var -= mom`` | ``RMSprop(alpha=rho)``: ``buf = mu buf + g / (sqrt(ms) + eps')``, ``p -= lr buf`` | ``square_avg = ms``, ``momentum_buffer = mom / lr`` (TF's buffer holds the rate); ``eps`` inside the root cannot be matched by one ``eps'`` outside it: ``eps'`` makes the smallest ``ms`` exact, the rest differ by at most the size reported |
| centered | ``mg = rho mg + (1-rho) g``, root of ``ms - mg^2 + eps`` | ``centered=True``: root of ``ms - mg^2``, ``+ eps'`` | ``grad_avg = mg``, as above |
| BERT's ``AdamWeightDecayOptimizer`` | ``m``, ``v`` as Adam's, ``var -= lr (m / (sqrt(v) + eps) + wd var)``: no bias correction | ``AdamW(weight_decay=wd)``: ``p *= 1 - lr wd``, then the Adam step | ``exp_avg = adam_m``, ``exp_avg_sq = adam_v``, ``step`` = the first count at which ``1 - beta^step`` is 1.0 in float64 (:func:`uncorrected_steps`, 37,412 for 0.999): exact, ``eps`` kept |
| ``AdagradOptimizer`` | ``acc += g^2`` (``acc`` starts at ``initial_accumulator_value``), ``var -= lr g / sqrt(acc)`` | ``Adagrad``: ``p -= lr g / (sqrt(sum) + eps')`` | ``sum = acc``, ``eps' = 0`` (``acc`` is never 0), exact |

A torch ``weight_decay`` (coupled in ``Adam``/``SGD``/``RMSprop``/``Adagrad``, decoupled in
``AdamW``), ``maximize``, ``amsgrad``, ``dampening`` and Adagrad's ``lr_decay`` are terms no
TF1 optimizer has: each is reported as a difference, never changed.
"""

from __future__ import annotations

import math

import numpy as np

from restorekit.errors import InvalidArgumentError

__all__ = ["adam_epsilon", "adam_epsilon_drift", "adam_steps", "uncorrected_steps", "rmsprop_epsilon", "rmsprop_epsilon_error",
           "to_adagrad", "to_adam", "to_rmsprop", "to_sgd"]


_NORMAL = 1.1754944e-38  # the smallest normal float32: a beta power below it has lost its precision


def adam_steps(beta1_power: float, beta2_power: float | None, beta1: float, beta2: float,
               global_step: int | None = None) -> int:
    """The steps a TF1 Adam run took, from its ``beta1_power`` (``beta1^(t+1)``: TF1 multiplies after each step),
    cross-checked with ``beta2_power``.

    Long runs underflow ``beta1_power`` (``0.9^t`` leaves float32 near t = 830); then
    ``beta2_power`` counts, and where both did, neither correction is distinguishable from 1
    and ``global_step`` (or the first step where both are) is as good a count.

    Raises:
        InvalidArgumentError: the powers are not powers of ``beta1`` and ``beta2`` at one step count: the
            target's betas are not the source run's.
    """
    powers = [(p, b) for p, b in ((beta1_power, beta1), (beta2_power, beta2)) if p is not None]
    if not all(0.0 < b < 1.0 for _, b in powers) or not all(0.0 <= p <= 1.0 for p, _ in powers):
        raise InvalidArgumentError(f"beta powers {beta1_power!r}, {beta2_power!r} are no powers of betas {beta1!r}, "
                                   f"{beta2!r}")
    counting = [(p, b) for p, b in powers if p >= _NORMAL]
    if not counting:
        floor = max(math.ceil(math.log(_NORMAL) / math.log(b)) for _, b in powers)
        return max(global_step or 0, floor)
    power, beta = counting[0]
    steps = max(round(math.log(power) / math.log(beta)) - 1, 0)

    def fits(p: float, b: float) -> bool:  # a float32 product of t+1 factors, each rounded by up to 2**-24
        want = b ** (steps + 1)
        return want < _NORMAL * 2 if p < _NORMAL else abs(p / want - 1.0) <= 1e-4 + (steps + 1) * 2.0 ** -23

    if not all(fits(p, b) for p, b in powers):
        found = ", ".join(f"{n} {p:.7g}" for n, p in (("beta1_power", beta1_power), ("beta2_power", beta2_power))
                          if p is not None)
        raise InvalidArgumentError(
            f"the checkpoint's {found} are not beta1^(t+1) and beta2^(t+1) for the optimizer's betas "
            f"({beta1!r}, {beta2!r}) at any step count t; give the optimizer the betas the TF run used, or scan "
            f"without optimizer= for a warm start")
    return steps


def uncorrected_steps(beta1: float, beta2: float) -> int:
    """The step count from which torch's Adam bias corrections ``1 - beta^step`` are exactly 1.0 (in float64, and so in
    float32): BERT's ``AdamWeightDecayOptimizer`` has none, and from there torch's update is its update."""
    steps = 1
    for beta in (beta1, beta2):
        if not 0.0 <= beta < 1.0:
            raise InvalidArgumentError(f"beta {beta!r} is not in [0, 1)")
        if beta == 0.0:
            continue
        t = math.ceil(54 * math.log(2.0) / -math.log(beta))  # beta^t <= 2**-54: 1 - beta^t rounds to 1.0
        while 1.0 - beta ** t != 1.0 or math.sqrt(1.0 - beta ** t) != 1.0:
            t += 1
        steps = max(steps, t)
    return steps


def adam_epsilon(epsilon: float, beta2: float, steps: int) -> float:
    """torch's ``eps`` that makes its next step (``steps + 1``) TF1's 'epsilon hat' update:
    ``eps / sqrt(1 - beta2^(steps+1))``."""
    return epsilon / math.sqrt(1.0 - beta2 ** (steps + 1))


def adam_epsilon_drift(epsilon: float, beta2: float, steps: int, ahead: int, root_v_hat: float) -> float:
    """The largest relative difference of an update's denominator over the next ``ahead`` steps, for an element
    whose bias-corrected ``sqrt(v_hat)`` is ``root_v_hat``, with ``eps`` set by :func:`adam_epsilon`."""
    fixed = adam_epsilon(epsilon, beta2, steps)
    worst = 0.0
    for k in range(steps + 1, steps + 1 + ahead):
        wanted = epsilon / math.sqrt(1.0 - beta2 ** k)
        worst = max(worst, abs(fixed - wanted) / (root_v_hat + wanted))
    return worst


def to_adam(m: np.ndarray, v: np.ndarray, steps: int, vhat: np.ndarray | None = None) -> dict:
    """TF1 ``var/Adam``, ``var/Adam_1`` -> torch ``Adam`` state (bias correction reads ``step``); an amsgrad source's
    ``vhat`` (``max(vhat, v)``, read where TF reads ``v``) is torch's ``max_exp_avg_sq``."""
    state = {"step": float(steps), "exp_avg": m, "exp_avg_sq": v}
    if vhat is not None:
        state["max_exp_avg_sq"] = vhat
    return state


def to_sgd(accumulation: np.ndarray) -> dict:
    """TF1 ``var/Momentum`` -> torch ``SGD`` state: the same recursion (``dampening=0``), nesterov or not."""
    return {"momentum_buffer": accumulation}


def to_rmsprop(ms: np.ndarray, mom: np.ndarray | None, mg: np.ndarray | None, *, lr: float, momentum: float,
               steps: int) -> dict:
    """TF1 ``var/RMSProp`` (ms), ``var/RMSProp_1`` (mg when centered) and the momentum slot -> torch ``RMSprop``.

    TF1 keeps the learning rate inside its momentum buffer (``mom = mu mom + lr g / root``,
    ``var -= mom``); torch applies it after (``buf = mu buf + g / root``, ``p -= lr buf``).
    """
    state: dict = {"step": float(steps), "square_avg": ms}
    if momentum > 0 and mom is not None:
        state["momentum_buffer"] = (mom / np.asarray(lr, mom.dtype)).astype(mom.dtype)
    if mg is not None:
        state["grad_avg"] = mg
    return state


def rmsprop_epsilon(epsilon: float, smallest: float) -> float:
    """torch's ``eps`` (outside the root) equal to TF1's (inside it) where the mean square is ``smallest``:
    ``sqrt(s + eps) - sqrt(s)``; elsewhere it differs by :func:`rmsprop_epsilon_error`."""
    smallest = max(float(smallest), 0.0)
    return epsilon / (math.sqrt(smallest + epsilon) + math.sqrt(smallest))


def rmsprop_epsilon_error(epsilon: float, torch_epsilon: float, mean_squares: np.ndarray) -> float:
    """The largest relative difference of the denominators ``sqrt(ms) + eps'`` and ``sqrt(ms + eps)``."""
    ms = np.maximum(np.asarray(mean_squares, np.float64), 0.0)
    if ms.size == 0:
        return 0.0
    tf_root = np.sqrt(ms + epsilon)
    return float(np.max(np.abs(np.sqrt(ms) + torch_epsilon - tf_root) / np.maximum(tf_root, 1e-300)))


def to_adagrad(accumulator: np.ndarray, steps: int) -> dict:
    """TF1 ``var/Adagrad`` -> torch ``Adagrad`` state (``step`` is read only by ``lr_decay``)."""
    return {"step": float(steps), "sum": accumulator}
