"""``dgc``: sampled-threshold sparsification of Deep Gradient Compression (Lin et al., ICLR'18).

The threshold of a segment is the ``(1 − density)`` quantile of ``|x|`` estimated from a random
sample of ``sample_rate`` (0.1–1 %) of its elements, then refined: if the exact count it selects is
far above the target ``k``, the threshold becomes the k-th largest among the candidates (DGC's
hierarchical selection); if far below, the sample is doubled and the estimate repeated. As SAFusion
§4 says, the gradient distribution changes slowly, so thresholds are re-estimated only every
``interval`` steps and reused in between; between estimations one vectorised pass over the flat
buffer applies all segment thresholds at once. Error feedback makes the accumulated gradient grow
while residuals build up, so a reused threshold whose segment selects more than ``drift · (k + 1)``
or fewer than ``k / drift`` elements is re-estimated at once (counted with one ``bincount``; the
``+ 1`` keeps tiny segments with ``k = 1`` from being re-estimated for a handful of extra elements).

A reused threshold can exceed a segment's current maximum; it is clipped to that maximum, so a
segment with a nonzero gradient always keeps at least one element (SAFusion §3.1).
"""
from __future__ import annotations

import math

import torch

from ..segment import Segments
from .base import Compressor, register_compressor


@register_compressor("dgc")
class DGC(Compressor):
    """Sampled threshold per segment, re-estimated every ``interval`` steps.

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
        super().__init__(density)
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must satisfy 0 < sample_rate <= 1, got {sample_rate!r}")
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval!r}")
        self.sample_rate = sample_rate
        self.min_samples = int(min_samples)
        self.interval = int(interval)
        self.refine_passes = int(refine_passes)
        self.tolerance = float(tolerance)
        self.drift = float(drift)
        self._gen = torch.Generator().manual_seed(seed)
        self._threshold: dict[str, float] = {}
        self._estimated_at: dict[str, int] = {}

    # ---- estimation (every `interval` steps) -----------------------------------------------
    def _sample_threshold(self, seg: torch.Tensor, k: int, samples: int) -> float:
        n = seg.numel()
        if samples >= n:
            return float(torch.topk(seg, k, sorted=False).values.min())
        idx = torch.randint(n, (samples,), generator=self._gen).to(seg.device)
        ks = max(1, math.ceil(self.density * samples))
        return float(torch.topk(seg[idx], ks, sorted=False).values.min())

    def estimate(self, seg: torch.Tensor, k: int) -> float:
        """Threshold on ``|x|`` of one segment (``seg`` holds magnitudes) selecting about ``k``."""
        n = seg.numel()
        samples = min(n, max(math.ceil(self.sample_rate * n), self.min_samples))
        thr = self._sample_threshold(seg, k, samples)
        for _ in range(self.refine_passes):
            count = int((seg >= thr).sum())
            if count > self.tolerance * k:
                # DGC's hierarchical selection: exact k-th largest among the candidates.
                return float(torch.topk(seg[seg >= thr], k, sorted=False).values.min())
            if count * self.tolerance >= k or samples >= n:
                return thr
            samples = min(n, samples * 2)
            thr = self._sample_threshold(seg, k, samples)
        return thr

    # ---- selection (every step, one vectorised pass) ---------------------------------------
    def select(self, flat: torch.Tensor, segments: Segments, step: int) -> torch.Tensor | None:
        if self.density >= 1.0:
            return None
        absx = flat.abs()
        ks = segments.k(self.density)
        fresh = set()
        for s, name in enumerate(segments.names):
            last = self._estimated_at.get(name)
            if last is None or step - last >= self.interval or step < last:
                fresh.add(s)
        self._estimate(absx, segments, ks, fresh, step)
        seg_max = torch.zeros(len(segments), dtype=absx.dtype, device=absx.device)
        seg_max.scatter_reduce_(0, segments.ids, absx, reduce="amax")
        indices = self._apply(absx, segments, seg_max)
        counts = segments.counts(indices)
        off_band = (counts * self.drift < ks) | (counts > ks * self.drift + self.drift)
        off_band &= seg_max > 0
        off_band[list(fresh)] = False
        drifted = set(torch.nonzero(off_band).flatten().tolist())
        if drifted:
            self._estimate(absx, segments, ks, drifted, step)
            indices = self._apply(absx, segments, seg_max)
        return indices

    def _estimate(self, absx, segments: Segments, ks: torch.Tensor, which: set, step: int) -> None:
        for s in which:
            off, n, name = segments.offsets[s], segments.sizes[s], segments.names[s]
            self._threshold[name] = self.estimate(absx[off:off + n], int(ks[s]))
            self._estimated_at[name] = step

    def _apply(self, absx: torch.Tensor, segments: Segments, seg_max: torch.Tensor) -> torch.Tensor:
        """One pass: ``|x| >= threshold`` of each element's segment, clipped to the segment's max."""
        thr = torch.tensor([self._threshold[n] for n in segments.names], dtype=absx.dtype, device=absx.device)
        thr = torch.where(seg_max > 0, torch.minimum(thr, seg_max), torch.full_like(thr, math.inf))
        return torch.nonzero(absx >= thr[segments.ids]).squeeze(1)
