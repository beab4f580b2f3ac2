"""Threshold sparsification over a segmented fusion buffer, in one pass (SAFusion §3.1 Step-1).

"SAFusion ... compresses G_l by selecting its elements whose absolute values are larger than a
defined threshold τ, i.e. |G_l| ≥ τ" — per tensor under ``ahead``, once per buffer under ``behind``.
A :class:`ThresholdCompressor` computes one threshold per segment (its subclasses differ only in
how) and selects in one pass over the flat buffer: each segment's threshold is compared against a
view of that segment, writing into one shared mask, so selecting per tensor costs about what
selecting over the whole buffer costs (no per-element gather of thresholds, which doubles the cost
on CPU). A threshold above a segment's maximum is clipped to it, so every tensor with a nonzero
gradient keeps at least one element; an all-zero segment sends nothing.
"""
from __future__ import annotations

import math
from abc import abstractmethod

import torch

from ..segment import Segments
from .base import Compressor


class SegmentView:
    """``|x|`` of one flat buffer with its per-segment views and maxima, shared by a selection."""

    def __init__(self, flat: torch.Tensor, segments: Segments, density: float) -> None:
        self.segments = segments
        self.signed = flat.split(list(segments.sizes))  # views of the signed values
        self.abs = flat.abs()
        self.parts = self.abs.split(list(segments.sizes))
        self.max = torch.stack([p.amax() for p in self.parts])
        self.k = segments.k(density).to(self.abs.device)  # target count per segment

    def select(self, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices with ``|x| >= threshold`` of their segment (clipped to the maximum), and counts."""
        thr = torch.where(self.max > 0, torch.minimum(thresholds.to(self.max.dtype), self.max),
                          torch.full_like(self.max, math.inf))
        mask = torch.empty(self.abs.shape, dtype=torch.bool, device=self.abs.device)
        for part, out, t in zip(self.parts, mask.split(list(self.segments.sizes)), thr):
            torch.ge(part, t, out=out)
        indices = torch.nonzero(mask).squeeze(1)
        return indices, self.segments.counts(indices)


class ThresholdCompressor(Compressor):
    """One threshold per segment, selected in one pass; subclasses say how thresholds are found.

    Subclasses implement :meth:`thresholds` and may override :meth:`refine` to correct thresholds
    from the counts they selected (re-selecting, or adjusting the next step's thresholds).
    """

    def select(self, flat: torch.Tensor, segments: Segments, step: int) -> torch.Tensor | None:
        if self.density >= 1.0:
            return None
        view = SegmentView(flat, segments, self.density)
        thr = self.thresholds(view, step)
        indices, counts = view.select(thr)
        return self.refine(view, thr, indices, counts, step)

    @abstractmethod
    def thresholds(self, view: SegmentView, step: int) -> torch.Tensor:
        """A threshold on ``|x|`` per segment (tensor of length ``len(view.segments)``)."""

    def refine(self, view: SegmentView, thresholds: torch.Tensor, indices: torch.Tensor,
               counts: torch.Tensor, step: int) -> torch.Tensor:
        """Final indices, given what ``thresholds`` selected; the default keeps them."""
        return indices


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest entry of a 1-D tensor (0-dim tensor; k is clamped to the length)."""
    return torch.topk(values, max(1, min(k, values.numel())), sorted=False).values.min()


class PeriodicThreshold(ThresholdCompressor):
    """Thresholds estimated every ``interval`` steps and reused in between (SAFusion §4: "we
    periodically estimate the threshold ... and reuse it in some subsequent iterations").

    Error feedback makes the accumulated gradient grow while residuals build up, so a reused
    threshold whose segment selects more than ``drift · (k + 1)`` or fewer than ``k / drift``
    elements is re-estimated at once and the buffer re-selected (the ``+ 1`` keeps tiny segments
    with ``k = 1`` from being re-estimated for a handful of extra elements). Subclasses implement
    :meth:`estimate` for one segment.
    """

    def __init__(self, density: float, interval: int, drift: float) -> None:
        super().__init__(density)
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval!r}")
        if drift <= 1.0:
            raise ValueError(f"drift must be > 1, got {drift!r}")
        self.interval, self.drift = int(interval), float(drift)
        self._threshold: dict[str, float] = {}
        self._estimated_at: dict[str, int] = {}

    @abstractmethod
    def estimate(self, magnitudes: torch.Tensor, k: int) -> float:
        """A threshold on one segment's ``|x|`` that selects about ``k`` elements."""

    def _estimate(self, view: SegmentView, which, step: int) -> torch.Tensor:
        for s in which:
            name = view.segments.names[s]
            self._threshold[name] = self.estimate(view.parts[s], int(view.k[s]))
            self._estimated_at[name] = step
        return torch.tensor([self._threshold[n] for n in view.segments.names], device=view.abs.device)

    def thresholds(self, view: SegmentView, step: int) -> torch.Tensor:
        stale = [s for s, name in enumerate(view.segments.names)
                 if name not in self._estimated_at or not 0 <= step - self._estimated_at[name] < self.interval]
        return self._estimate(view, stale, step)

    def refine(self, view, thresholds, indices, counts, step):
        ks = view.k
        off_band = (counts * self.drift < ks) | (counts > ks * self.drift + self.drift)
        off_band &= view.max > 0
        drifted = [s for s in torch.nonzero(off_band).flatten().tolist()
                   if self._estimated_at[view.segments.names[s]] != step]
        if not drifted:
            return indices
        return view.select(self._estimate(view, drifted, step))[0]
