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

from typing import TypeVar

import numpy as np
import torch
from scipy import special

from .base import DEFAULT_DENSITY, register_compressor
from .threshold import PeriodicThreshold, View

DISTRIBUTIONS = ("exponential", "gpareto", "gamma-gpareto")
Array = TypeVar("Array", np.ndarray, torch.Tensor)


class _Ops:
    """The few functions :func:`quantile` needs, from NumPy and SciPy for host arrays or from
    PyTorch for device tensors, so that the fit is written once and neither path converts."""

    def __init__(self, torch_ops: bool) -> None:
        if torch_ops:
            self.log, self.exp, self.where, self.lgamma = torch.log, torch.exp, torch.where, torch.lgamma
            self.ndtri, self.gammaincc = torch.special.ndtri, torch.special.gammaincc
        else:
            self.log, self.exp, self.where, self.lgamma = np.log, np.exp, np.where, special.gammaln
            self.ndtri, self.gammaincc = special.ndtri, special.gammaincc


_HOST, _DEVICE = _Ops(torch_ops=False), _Ops(torch_ops=True)
_TINY = float(np.finfo(np.float64).tiny)


def _gamma_isf(p: Array, shape: Array, scale: Array, ops: _Ops, newton: int = 8) -> Array:
    """The gamma distribution's inverse survival function (SciPy's ``gamma.isf`` has no PyTorch
    twin): Wilson–Hilferty's start, then Newton steps on ``Q(shape, x) = p``."""
    z = ops.ndtri(1.0 - p)
    c = 1.0 / (9.0 * shape)
    x = shape * (1.0 - c + z * c ** 0.5).clip(min=1e-3) ** 3
    for _ in range(newton):
        x = x.clip(min=_TINY)
        pdf = ops.exp((shape - 1.0) * ops.log(x) - x - ops.lgamma(shape))
        x = x + (ops.gammaincc(shape, x) - p) / pdf.clip(min=_TINY)
    return x.clip(min=0.0) * scale


def quantile(m: Array, v: Array, p: Array, family: str) -> Array:
    """Per entry, the value above which a fraction ``p`` of the distribution ``family``
    (``exponential``, ``gpareto`` or ``gamma``) fitted by the moments ``m`` (mean) and ``v``
    (variance) lies; 0 where ``m <= 0``, the exponential's where ``v <= 0``. Float64 NumPy arrays
    (the host path) or device tensors (the device path): one formula for both."""
    ops = _DEVICE if isinstance(m, torch.Tensor) else _HOST
    out = -m * ops.log(p)  # exponential: scale = mean
    safe_m, safe_v = ops.where(m > 0, m, 1.0), ops.where(v > 0, v, 1.0)
    if family == "gamma":
        q = _gamma_isf(p, safe_m * safe_m / safe_v, safe_v / safe_m, ops)
    elif family == "gpareto":
        xi = 0.5 * (1.0 - safe_m * safe_m / safe_v)
        sigma = 0.5 * safe_m * (1.0 + safe_m * safe_m / safe_v)
        small = abs(xi) < 1e-6
        safe_xi = ops.where(small, 1.0, xi)
        q = ops.where(small, -sigma * ops.log(p), sigma / safe_xi * (p ** -safe_xi - 1.0))
    else:
        q = out
    out = ops.where((m > 0) & (v > 0), q, out)
    return ops.where(m > 0, out, 0.0)


@register_compressor("sidco")
class SIDCo(PeriodicThreshold):
    """Multi-stage statistical threshold per segment, re-estimated every ``interval`` steps.

    Args:
        density: target fraction of elements per segment.
        distribution: ``"exponential"``, ``"gpareto"`` or ``"gamma-gpareto"``.
        stages: number of fitting stages (SIDCo uses 1–3; more fit the far tail better).
        interval: steps between estimations.
        drift: correct at once when a count leaves ``[k / drift − 1, drift · (k + 1)]``: above, by
            hierarchical selection; below, by a new estimate with one stage fewer (down to one).
        refine_passes: at most this many corrections per step.
    """

    def __init__(self, density: float = DEFAULT_DENSITY, distribution: str = "exponential", stages: int = 2,
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

    def _family(self, stage: int) -> str:
        if self.distribution == "gamma-gpareto":
            return "gamma" if stage == 0 else "gpareto"
        return self.distribution

    def estimate(self, view: View, which: np.ndarray, ks: np.ndarray, effort: np.ndarray,
                 step: int) -> "np.ndarray | torch.Tensor":
        """The multi-stage thresholds of the entries ``which``, each with ``effort`` stages fewer,
        every stage one pass over those segments for all of them (stage 1's fit of all of ``|x|``
        is shared by every effort; an entry with fewer than two exceedances stops).

        SIDCo adapts the number of stages when the selected ratio misses the target. On real
        gradients each further stage selects *fewer* elements (on the largest tensors, one
        exponential stage selects several times k, three well under k), so a segment that selects
        far too few gets fewer stages, and one that then selects too many is trimmed by the
        hierarchical selection."""
        stages = np.maximum(1, self.stages - effort)
        p = view.array(view.segments.density_array(view.density)[which] ** (1.0 / stages))
        m, v = view.abs_moments(which)  # stage 1 fits all of |x|
        eta = view.full(len(which), 0.0)
        going = view.array(np.ones(len(which), dtype=bool))
        for stage in range(self.stages):
            eta = view.where(going, eta + quantile(m, v, p, self._family(stage)), eta)
            more = stages > stage + 1
            sub = np.flatnonzero(more)  # the entries with another stage
            going = going & view.array(more)
            if not sub.size or not view.any(going):
                break
            # the next stage fits the exceedances over eta; an entry with fewer than two stops
            count, ms, vs = view.exceedance_moments(which[sub], view.take(eta, sub), where=view.take(going, sub))
            m, v = view.put(m, sub, ms), view.put(v, sub, vs)
            going = view.put(going, sub, view.take(going, sub) & (count >= 2))
        return eta
