"""Bootstrap confidence intervals and minimum detectable effects (pure functions, seeded, deterministic).

* CI: percentile bootstrap over prompts (the unit that is sampled), B resamples drawn once per report from
  `numpy.random.default_rng(seed)`; a statistic's CI is the 2.5 / 97.5 percentiles of its B replicates.
* MDE of a mean of n per-prompt values with sample standard deviation s (two-sided level alpha, power 1-beta):
  (z_{1-alpha/2} + z_{1-beta}) * s / sqrt(n); not given (None) when s = 0.
* MDE of a proportion p0 = k/n (prompts that diverge): the smallest increase d such that the exact binomial
  test that rejects p = p0 when K >= c (c the smallest count with P(K >= c | p0) <= alpha/2) rejects with
  probability >= 1-beta when p = p0 + d. At p0 = 0 this is 1 - beta^(1/n) (any divergence rejects).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import numpy as np

ALPHA, BETA = 0.05, 0.2
BOOTSTRAP = 2000
CONFIDENCE = 0.95


def resamples(n: int, seed: int, b: int = BOOTSTRAP) -> np.ndarray:
    """int [b, n]: row r holds the prompt indices of bootstrap resample r."""
    return np.random.default_rng(seed).integers(0, n, size=(b, n))


def percentile_ci(replicates: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    lo, hi = np.percentile(np.asarray(replicates, np.float64), [50 * (1 - confidence), 50 * (1 + confidence)])
    return float(lo), float(hi)


def mean_ci(values: np.ndarray, idx: np.ndarray) -> tuple[float, float]:
    """CI of the mean of per-prompt values [n] over the resamples idx [b, n]."""
    return percentile_ci(np.asarray(values, np.float64)[idx].mean(axis=1))


def pooled_ci(per_prompt: np.ndarray, idx: np.ndarray, stat: Callable[[np.ndarray], np.ndarray],
              block: int = 100) -> tuple[float, float]:
    """CI of a statistic of all steps pooled, resampling whole prompts: per_prompt [n, S] (every prompt has S
    steps); stat maps [m, n*S] -> [m]."""
    x = np.asarray(per_prompt, np.float64)
    reps = [stat(x[idx[i:i + block]].reshape(len(idx[i:i + block]), -1)) for i in range(0, len(idx), block)]
    return percentile_ci(np.concatenate(reps))


def mde_mean(values: np.ndarray, alpha: float = ALPHA, beta: float = BETA) -> float | None:
    """(z_{1-alpha/2} + z_{1-beta}) * s / sqrt(n); None for n < 2 or s = 0 (no spread to scale an effect by:
    the normal formula would claim any effect is detectable)."""
    v = np.asarray(values, np.float64)
    if len(v) < 2 or v.std(ddof=1) == 0:
        return None
    z = NormalDist()
    return float((z.inv_cdf(1 - alpha / 2) + z.inv_cdf(1 - beta)) * v.std(ddof=1) / math.sqrt(len(v)))


def binom_sf(c: int, n: int, p: float) -> float:
    """P(K >= c) for K ~ Binomial(n, p)."""
    if c <= 0:
        return 1.0
    if c > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp
                                 + (n - k) * lq) for k in range(c, n + 1)))


def mde_proportion(k: int, n: int, alpha: float = ALPHA, beta: float = BETA) -> float | None:
    """Smallest detectable increase over p0 = k/n (module docstring); None when even p = 1 is not detected."""
    p0 = k / n
    c = next(c for c in range(n + 2) if binom_sf(c, n, p0) <= alpha / 2)
    if c > n:
        return None
    lo, hi = p0, 1.0
    for _ in range(60):  # bisection on the power, which grows with p
        mid = 0.5 * (lo + hi)
        if binom_sf(c, n, mid) >= 1 - beta:
            hi = mid
        else:
            lo = mid
    return hi - p0
