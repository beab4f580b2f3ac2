"""``dgc``: sampled-threshold sparsification of Deep Gradient Compression (Lin et al., ICLR'18).

The threshold of a segment is the ``(1 − density)`` quantile of ``|x|`` estimated from a random
sample of ``sample_rate`` (0.1–1 %) of its elements, then refined from the count it selects: if
far above the target ``k``, the threshold becomes the k-th largest among the candidates (DGC's
hierarchical selection); if far below, the sample is doubled and the estimate repeated. As SAFusion
§4 says, the gradient distribution changes slowly, so thresholds are re-estimated only every
``interval`` steps and reused in between; between estimations one pass over the flat buffer
applies all segment thresholds at once, and a threshold that drifted is re-estimated at once
(:class:`~horovod_safusion.compressors.threshold.PeriodicThreshold`).
"""
from __future__ import annotations

import math

import numpy as np
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
        drift: a threshold whose count leaves ``[k / drift, drift · (k + 1)]`` is corrected at once
            (hierarchical selection above, a doubled sample below).
        refine_passes: at most this many corrections per step.
        seed: seed of the sampling generator (each rank may sample differently; only counts
            depend on it, never correctness).
    """

    def __init__(self, density: float = 0.01, sample_rate: float = 0.01, min_samples: int = 1024,
                 interval: int = 10, drift: float = 2.0, refine_passes: int = 3, seed: int = 0) -> None:
        super().__init__(density, interval, drift, refine_passes)
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must satisfy 0 < sample_rate <= 1, got {sample_rate!r}")
        self.sample_rate = sample_rate
        self.min_samples = int(min_samples)
        self._gen = torch.Generator().manual_seed(seed)

    max_effort = 6  # a sample up to 64 times larger

    def estimate(self, seg, k: int, effort: int = 0) -> float:
        """The ``(1 − density)`` quantile of a random sample of ``seg`` (magnitudes, a NumPy array
        or a tensor), the sample doubled per ``effort``; exact below ``min_samples`` elements."""
        n = len(seg)
        samples = min(n, max(math.ceil(self.sample_rate * n), self.min_samples) << effort)
        if samples >= n:
            return kth_largest(seg, k)
        idx = torch.randint(n, (samples,), generator=self._gen)
        sample = seg[idx.numpy()] if isinstance(seg, np.ndarray) else seg[idx.to(seg.device)]
        return kth_largest(sample, math.ceil(self.density * samples))
