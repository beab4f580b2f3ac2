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

import torch
from scipy.stats import gamma as gamma_dist

from .base import register_compressor
from .threshold import PeriodicThreshold

DISTRIBUTIONS = ("exponential", "gpareto", "gamma-gpareto")


def _moments(x: torch.Tensor) -> tuple[float, float]:
    v, m = torch.var_mean(x.double(), correction=0)
    return float(m), float(v)


def tail_quantile(x: torch.Tensor, p: float, family: str) -> float:
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
            hierarchical selection; below, by a new estimate with one stage more.
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

    def estimate(self, seg: torch.Tensor, k: int = 0, attempt: int = 0) -> float:
        """The multi-stage threshold of one segment's magnitudes, with ``attempt`` stages more
        (SIDCo adapts the number of stages when the selected ratio misses the target)."""
        stages = self.stages + attempt
        p = self.density ** (1.0 / stages)
        eta, tail = 0.0, seg
        for stage in range(stages):
            family = ("gamma" if self.distribution == "gamma-gpareto" and stage == 0 else
                      "exponential" if self.distribution == "exponential" else "gpareto")
            eta += tail_quantile(tail, p, family)
            tail = seg[seg > eta] - eta
            if tail.numel() < 2:
                break
        return eta
