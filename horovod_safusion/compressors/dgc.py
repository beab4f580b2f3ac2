"""``dgc``: sampled-threshold sparsification of Deep Gradient Compression (Lin et al., ICLR'18).

The threshold of a segment is the ``(1 − density)`` quantile of ``|x|`` estimated from a random
sample of ``sample_rate`` (0.1–1 %) of its elements, then refined: if the exact count it selects is
far above the target ``k``, the threshold becomes the k-th largest among the candidates (DGC's
hierarchical selection); if far below, the sample is doubled and the estimate repeated. As SAFusion
§4 says, the gradient distribution changes slowly, so thresholds are re-estimated only every
``interval`` steps and reused in between; between estimations one pass over the flat buffer
applies all segment thresholds at once, and a threshold that drifted is re-estimated at once
(:class:`~horovod_safusion.compressors.threshold.PeriodicThreshold`).
"""
from __future__ import annotations

import math

import torch

from .base import register_compressor
from .threshold import PeriodicThreshold, kth_largest


@register_compressor("dgc")
class DGC(PeriodicThreshold):
    """Sampled threshold per segment, re-estimated every ``interval`` steps or on drift.

    Args:
        density: target fraction of elements per segment.
        sample_rate: fraction of a segment sampled to estimate its threshold (DGC uses
            0.001–0.01). Larger is more accurate and slower.
        min_samples: a segment smaller than this is thresholded exactly (sampling buys nothing).
        interval: steps between threshold estimations; 1 estimates every step. Larger is cheaper
            but lets the actual density drift while residuals grow.
        refine_passes: at most this many corrections when the estimate selects fewer than
            ``k / tolerance`` or more than ``k · tolerance`` elements.
        tolerance: accepted ratio between selected and target counts during refinement.
        drift: a reused threshold is re-estimated early when its count leaves
            ``[k / drift, drift · (k + 1)]``.
        seed: seed of the sampling generator (each rank may sample differently; only counts
            depend on it, never correctness).
    """

    def __init__(self, density: float = 0.01, sample_rate: float = 0.01, min_samples: int = 1024,
                 interval: int = 10, refine_passes: int = 3, tolerance: float = 1.3,
                 drift: float = 2.0, seed: int = 0) -> None:
        super().__init__(density, interval, drift)
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must satisfy 0 < sample_rate <= 1, got {sample_rate!r}")
        self.sample_rate = sample_rate
        self.min_samples = int(min_samples)
        self.refine_passes = int(refine_passes)
        self.tolerance = float(tolerance)
        self._gen = torch.Generator().manual_seed(seed)

    # ---- estimation -------------------------------------------------------------------------
    def _sample_threshold(self, seg: torch.Tensor, k: int, samples: int) -> float:
        n = seg.numel()
        if samples >= n:
            return float(kth_largest(seg, k))
        idx = torch.randint(n, (samples,), generator=self._gen).to(seg.device)
        return float(kth_largest(seg[idx], math.ceil(self.density * samples)))

    def estimate(self, seg: torch.Tensor, k: int) -> float:
        """Threshold on ``|x|`` of one segment (``seg`` holds magnitudes) selecting about ``k``."""
        n = seg.numel()
        samples = min(n, max(math.ceil(self.sample_rate * n), self.min_samples))
        thr = self._sample_threshold(seg, k, samples)
        for _ in range(self.refine_passes):
            count = int((seg >= thr).sum())
            if count > self.tolerance * k:
                # DGC's hierarchical selection: exact k-th largest among the candidates.
                return float(kth_largest(seg[seg >= thr], k))
            if count * self.tolerance >= k or samples >= n:
                return thr
            samples = min(n, samples * 2)
            thr = self._sample_threshold(seg, k, samples)
        return thr
