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

import numpy as np
import torch

from .base import register_compressor
from .device import DeviceView
from .threshold import PeriodicThreshold, SegmentView


#: A segment whose sample would exceed 1/EXACT_SHARE of it takes its exact k-th largest instead.
EXACT_SHARE = 16


@register_compressor("dgc")
class DGC(PeriodicThreshold):
    """Sampled threshold per segment, re-estimated every ``interval`` steps or on drift.

    Args:
        density: target fraction of elements per segment.
        sample_rate: fraction of a segment sampled to estimate its threshold (DGC uses
            0.001–0.01). Larger is more accurate and slower.
        min_samples: the fewest samples per segment; a segment whose sample would be more than
            1/16 of it is thresholded exactly (sampling buys nothing).
        interval: steps between threshold estimations; 1 estimates every step. Larger is cheaper
            but lets the actual density drift while residuals grow.
        drift: a threshold whose count leaves ``[k / drift − 1, drift · (k + 1)]`` is corrected at once
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
    state_fields = PeriodicThreshold.state_fields + ("_gen",)

    def estimate(self, view: SegmentView, which: np.ndarray, ks: np.ndarray, effort: np.ndarray) -> np.ndarray:
        """Per segment, the ``(1 − density)`` quantile of a random sample of its ``|x|``, the
        sample doubled per ``effort``; exact where the sample would hold more than
        1/:data:`EXACT_SHARE` of the segment: the exact k-th largest (radix selection, a few
        passes over the segment and no copy) then costs about what sampling does, and a sample
        of a large tensor would take several times the tensor's memory (a position and a value
        per draw). The samples of all segments are drawn at once (uniform, with replacement) and
        their quantiles taken in one call."""
        n = view.sizes[which]
        samples = np.minimum(n, np.maximum(np.ceil(self.sample_rate * n).astype(np.int64),
                                           self.min_samples) << effort)
        out = np.empty(len(which), dtype=np.float64)
        exact = samples * EXACT_SHARE >= n
        out[exact] = view.kth_largest(which[exact], ks[exact])
        sampled = ~exact
        if sampled.any():
            m = samples[sampled]
            u = torch.rand(int(m.sum()), generator=self._gen, dtype=torch.float64).numpy()
            idx = np.repeat(view.offsets[which[sampled]], m) + (u * np.repeat(n[sampled], m)).astype(np.int64)
            out[sampled] = view.kth_largest_at(idx, m, np.ceil(view.density * m).astype(np.int64))
        return out

    def estimate_on_device(self, view: DeviceView) -> torch.Tensor:
        """The base-effort estimate of every segment on its device: the sample positions are drawn
        on the host (the same generator), the quantiles taken on the device."""
        n = view.segments.size_array
        m = np.minimum(n, np.maximum(np.ceil(self.sample_rate * n).astype(np.int64), self.min_samples))
        exact = m >= n
        ks = np.where(exact, view.k_host, np.ceil(view.density * m).astype(np.int64))
        positions = np.repeat(view.segments.offset_array, m) + np.arange(int(m.sum()), dtype=np.int64) \
            - np.repeat(np.cumsum(m) - m, m)  # exact segments: all their elements
        sampled = np.flatnonzero(np.repeat(~exact, m))
        u = torch.rand(len(sampled), generator=self._gen, dtype=torch.float64)  # host: the generator's
        positions = torch.from_numpy(positions)
        positions[torch.from_numpy(sampled)] = torch.from_numpy(np.repeat(view.segments.offset_array, m)[sampled]) \
            + (u * torch.from_numpy(np.repeat(n, m)[sampled])).long()
        return view.kth_largest(ks, positions, m)
