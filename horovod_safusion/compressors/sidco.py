"""``sidco``: multi-stage fitting of sparsity-inducing distributions (Abdelmoniem et al., "An
Efficient Statistical-based Gradient Compression Technique for Distributed Training Systems",
MLSys'21; evaluated by SAFusion §5 Experiment 4).

Gradient magnitudes are modelled by a sparsity-inducing distribution; its quantile gives the
threshold. One fit to all of ``|x|`` is poor in the far tail, so the target ratio δ is reached in
``stages`` steps of ``δ^(1/stages)`` each: stage 1 fits ``|x|`` and takes the quantile ``η₁`` that
keeps the fraction ``δ^(1/stages)``; stage ``j`` fits the exceedances ``|x| − η_{j−1}`` of the elements
above ``η_{j−1}`` and moves the threshold on by their quantile. The fits, by maximum likelihood or
the method of moments, cost a few reductions each:

* ``exponential`` — scale = mean; quantile of tail fraction p: ``−scale · ln p``;
* ``gpareto`` — generalised Pareto by moments (ξ = (1 − m²/v)/2, σ = m(1 + m²/v)/2);
  quantile ``σ/ξ · (p^(−ξ) − 1)``;
* ``gamma-gpareto`` — a gamma fit (shape m²/v, scale v/m) for stage 1, generalised Pareto after.

Thresholds are re-estimated every ``interval`` steps and reused in between, as SAFusion §4 does,
and at once when they drift (:class:`~horovod_safusion.compressors.threshold.PeriodicThreshold`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.stats import gamma as gamma_dist

from .base import register_compressor
from .threshold import PeriodicThreshold

DISTRIBUTIONS = ("exponential", "gpareto", "gamma-gpareto")


def _moments(x) -> tuple[float, float]:
    """Mean and (population) variance of magnitudes (a NumPy array or a tensor): two passes,
    ``E[x]`` and ``E[x²]`` (no cancellation to fear: for magnitudes the variance is of the order
    of the squared mean)."""
    n = len(x)
    if isinstance(x, np.ndarray):
        m, sq = float(x.sum(dtype=np.float64)) / n, float(np.dot(x, x)) / n
    else:
        m, sq = float(x.sum(dtype=torch.float64)) / n, float(torch.dot(x, x)) / n
    return m, max(sq - m * m, 0.0)


def tail_quantile(x, p: float, family: str) -> float:
    """Value above which a fraction ``p`` of the fitted distribution of ``x`` (≥ 0) lies."""
    m, v = _moments(x)
    if m <= 0.0:
        return 0.0
    if family == "exponential" or v <= 0.0:
        return -m * math.log(p)
    if family == "gamma":
        return float(gamma_dist.isf(p, m * m / v, scale=v / m))
    xi = 0.5 * (1.0 - m * m / v)
    sigma = 0.5 * m * (1.0 + m * m / v)
    if abs(xi) < 1e-6:
        return -sigma * math.log(p)
    return sigma / xi * (p ** (-xi) - 1.0)


@register_compressor("sidco")
class SIDCo(PeriodicThreshold):
    """Multi-stage statistical threshold per segment, re-estimated every ``interval`` steps.

    Args:
        density: target fraction of elements per segment.
        distribution: ``"exponential"``, ``"gpareto"`` or ``"gamma-gpareto"``.
        stages: number of fitting stages (SIDCo uses 1–3; more fit the far tail better).
        interval: steps between estimations.
        drift: correct at once when a count leaves ``[k / drift, drift · (k + 1)]``: above, by
            hierarchical selection; below, by a new estimate with one stage fewer (down to one).
        refine_passes: at most this many corrections per step.
    """

    def __init__(self, density: float = 0.01, distribution: str = "exponential", stages: int = 2,
                 interval: int = 10, drift: float = 2.0, refine_passes: int = 2) -> None:
        super().__init__(density, interval, drift, refine_passes)
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages!r}")
        self.distribution, self.stages = distribution, int(stages)

    @property
    def max_effort(self) -> int:
        return self.stages - 1

    def estimate(self, seg, k: int = 0, effort: int = 0) -> float:
        """The multi-stage threshold of one segment's magnitudes with ``effort`` stages fewer.

        SIDCo adapts the number of stages when the selected ratio misses the target. On real
        gradients each further stage selects *fewer* elements: on a ResNet-18 gradient at density
        0.01, 1 / 2 / 3 exponential stages selected 7.3x / 0.77x / 0.47x of k on the largest
        tensors, so a segment that selects far too few gets fewer stages, and one that then
        selects too many is trimmed by the hierarchical selection."""
        stages = max(1, self.stages - effort)
        p = self.density ** (1.0 / stages)
        eta, tail = 0.0, seg
        for stage in range(stages):
            family = ("gamma" if self.distribution == "gamma-gpareto" and stage == 0 else
                      "exponential" if self.distribution == "exponential" else "gpareto")
            q = tail_quantile(tail, p, family)
            eta += q
            tail = tail[tail > q] - q  # the exceedances over eta, from the last stage's (smaller) tail
            if len(tail) < 2:
                break
        return eta
