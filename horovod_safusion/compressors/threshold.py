"""Threshold sparsification over a segmented fusion buffer, in one pass (SAFusion §3.1 Step-1).

"SAFusion ... compresses G_l by selecting its elements whose absolute values are larger than a
defined threshold τ, i.e. |G_l| ≥ τ" — per tensor under ``ahead``, once per buffer under ``behind``.
A :class:`ThresholdCompressor` computes one threshold per segment (its subclasses differ only in
how) and selects in one pass over the flat buffer: each segment's threshold is compared against a
view of that segment, writing into one shared mask, so selecting per tensor costs about what
selecting over the whole buffer costs (no per-element gather of thresholds, which doubles the cost
on CPU), and refinements re-read only the segments whose thresholds they change. Small segments
(biases, normalisation parameters) are gathered and handled in one batch, because for them the
cost of launching per-segment operations would dominate. A threshold above a segment's maximum is clipped to it, so every tensor with a nonzero
gradient keeps at least one element; an all-zero segment sends nothing.
"""
from __future__ import annotations

import math
from abc import abstractmethod

import torch

from ..segment import Segments
from .base import Compressor


class SegmentView:
    """``|x|`` of one flat buffer with its per-segment views, maxima, target counts and a mask.

    :meth:`apply` writes ``|x| >= threshold`` into the mask for all segments or only some and
    counts the selected elements of the segments it touched (``count_nonzero`` per large segment,
    one ``bincount`` for the small ones), so refinements read :meth:`counts` without turning the
    mask into indices; :meth:`indices` does that once, with one ``nonzero`` pass, when the
    selection is final.
    """

    def __init__(self, flat: torch.Tensor, segments: Segments, density: float) -> None:
        self.segments = segments
        self.flat = flat
        self.abs = flat.abs()
        self.small, self.large, self._small_pos, self._small_seg = segments.small
        self._small_set = set(self.small)
        self.mask = torch.empty(self.abs.shape, dtype=torch.bool, device=self.abs.device)
        # Views are made for large segments only: each Python view costs microseconds.
        self._views = {s: (self.abs[o:o + n], self.mask[o:o + n]) for s in self.large
                       for o, n in ((segments.offsets[s], segments.sizes[s]),)}
        self.max = torch.zeros(len(segments), dtype=self.abs.dtype, device=self.abs.device)
        if self.large:
            self.max[self.large] = torch.stack([self._views[s][0].amax() for s in self.large])
        if self.small:
            self._small_abs = self.abs[self._small_pos]
            self.max.scatter_reduce_(0, self._small_seg, self._small_abs, reduce="amax")
        self.k = segments.k(density).to(self.abs.device)  # target count per segment
        self._counts = torch.zeros(len(segments), dtype=torch.int64, device=self.abs.device)
        self._indices: torch.Tensor | None = None

    def means(self, signed: bool = False, squares: bool = False) -> torch.Tensor:
        """Per-segment mean of ``x`` or ``|x|`` (or of their squares): a reduction per large
        segment, one ``index_add_`` for all small ones."""
        src = self.flat if signed else self.abs
        f = (lambda t: t * t) if squares else (lambda t: t)
        out = torch.zeros(len(self.segments), dtype=torch.float64, device=src.device)
        if self.large:
            out[self.large] = torch.stack([f(src[o:o + n]).mean(dtype=torch.float64) for s in self.large
                                           for o, n in ((self.segments.offsets[s], self.segments.sizes[s]),)])
        if self.small:
            out.index_add_(0, self._small_seg, f(src[self._small_pos]).double())
            sizes = torch.tensor([self.segments.sizes[s] for s in self.small], dtype=torch.float64, device=out.device)
            out[self.small] /= sizes
        return out

    def part(self, s: int) -> torch.Tensor:
        """``|x|`` of segment ``s``."""
        o = self.segments.offsets[s]
        return self.abs[o:o + self.segments.sizes[s]]

    def chosen(self, s: int) -> torch.Tensor:
        """``|x|`` of the elements segment ``s`` selects now (its candidates)."""
        o, n = self.segments.offsets[s], self.segments.sizes[s]
        return self.abs[o:o + n][self.mask[o:o + n]]

    def apply(self, thresholds: torch.Tensor, which: list[int] | None = None) -> None:
        """Select ``|x| >= threshold`` (clipped to the segment's maximum) in ``which`` segments
        (all by default) and count what each of them selects."""
        thr = torch.where(self.max > 0, torch.minimum(thresholds.to(self.max.dtype), self.max),
                          torch.full_like(self.max, math.inf))
        which = range(len(self.segments)) if which is None else which
        touched = [s for s in which if s not in self._small_set]
        counts = []
        for s in touched:
            part, out = self._views[s]
            torch.ge(part, thr[s], out=out)
            counts.append(torch.count_nonzero(out))
        if counts:
            self._counts[touched] = torch.stack(counts)
        if self.small and len(touched) < len(which):  # all small segments at once
            chosen = self._small_abs >= thr[self._small_seg]
            self.mask[self._small_pos] = chosen
            self._counts[self.small] = torch.bincount(self._small_seg[chosen], minlength=len(self.segments))[self.small]
        self._indices = None

    def counts(self) -> torch.Tensor:
        """Selected elements per segment (int64 tensor; read, do not modify)."""
        return self._counts

    def indices(self) -> torch.Tensor:
        """Buffer-relative indices of the selected elements, ascending."""
        if self._indices is None:
            self._indices = torch.nonzero(self.mask).squeeze(1)
        return self._indices


class ThresholdCompressor(Compressor):
    """One threshold per segment, selected in one pass; subclasses say how thresholds are found.

    Subclasses implement :meth:`thresholds` and may override :meth:`refine` to correct thresholds
    from the counts they selected (re-applying some segments, or adjusting the next step's).
    """

    def select(self, flat: torch.Tensor, segments: Segments, step: int) -> torch.Tensor | None:
        if self.density >= 1.0:
            return None
        view = SegmentView(flat, segments, self.density)
        thr = self.thresholds(view, step)
        view.apply(thr)
        self.refine(view, thr, view.counts(), step)
        return view.indices()

    @abstractmethod
    def thresholds(self, view: SegmentView, step: int) -> torch.Tensor:
        """A threshold on ``|x|`` per segment (tensor of length ``len(view.segments)``)."""

    def refine(self, view: SegmentView, thresholds: torch.Tensor, counts: torch.Tensor, step: int) -> None:
        """Correct the selection from the counts ``thresholds`` gave (``view.apply`` again, for
        some segments), or adjust state for the next step; the default keeps the selection."""


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest entry of a 1-D tensor (0-dim tensor; k is clamped to the length)."""
    return torch.topk(values, max(1, min(k, values.numel())), sorted=False).values.min()


class PeriodicThreshold(ThresholdCompressor):
    """Thresholds estimated every ``interval`` steps and reused in between (SAFusion §4: "we
    periodically estimate the threshold ... and reuse it in some subsequent iterations").

    A threshold — fresh or reused — whose segment selects more than ``drift · (k + 1)`` elements is
    replaced at once by the k-th largest among the elements it selected (DGC's hierarchical
    selection: cost ∝ selected), and one that selects fewer than ``k / drift − 1`` is estimated anew
    with ``attempt`` raised by one (a subclass spends more effort: more samples, more stages); only
    those segments are re-selected, at most ``refine_passes`` times per step. Error feedback makes
    the accumulated gradient grow while residuals build up, which is what moves reused thresholds
    (the ``± 1`` keeps segments with small ``k``, whose counts are noisy, from being corrected for
    a handful of elements). A threshold is kept in units of its segment's mean ``|x|``, measured
    anew every step (one reduction): the gradient's scale changes from one mini-batch to the next
    far more than its shape, and kept in absolute units, per-tensor thresholds went stale within a
    step or two on real gradients (four times more re-estimations on ResNet-18; the same reason as
    ExDyna's ``relative`` thresholds). Subclasses implement :meth:`estimate` for one segment.
    """

    def __init__(self, density: float, interval: int, drift: float, refine_passes: int) -> None:
        super().__init__(density)
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval!r}")
        if drift <= 1.0:
            raise ValueError(f"drift must be > 1, got {drift!r}")
        if refine_passes < 0:
            raise ValueError(f"refine_passes must be >= 0, got {refine_passes!r}")
        self.interval, self.drift, self.refine_passes = int(interval), float(drift), int(refine_passes)
        self._threshold: dict[str, float] = {}  # per segment, in units of its mean |x|
        self._estimated_at: dict[str, int] = {}
        self._unit = torch.ones(0, dtype=torch.float64)  # this step's mean |x| per segment

    @abstractmethod
    def estimate(self, magnitudes: torch.Tensor, k: int, attempt: int) -> float:
        """A threshold on one segment's ``|x|`` that selects about ``k`` elements; ``attempt`` counts
        the earlier estimates of this step that selected far too few."""

    def _estimate(self, view: SegmentView, which, step: int, attempt: dict[int, int]) -> torch.Tensor:
        for s in which:
            name = view.segments.names[s]
            thr = self.estimate(view.part(s), int(view.k[s]), attempt.get(s, 0))
            self._threshold[name] = thr / float(self._unit[s])
            self._estimated_at[name] = step
        return self._current(view)

    def _current(self, view: SegmentView) -> torch.Tensor:
        """Every segment's threshold at the segment's current scale."""
        rel = torch.tensor([self._threshold[n] for n in view.segments.names], dtype=torch.float64,
                           device=view.abs.device)
        return rel * self._unit

    def thresholds(self, view: SegmentView, step: int) -> torch.Tensor:
        self._unit = view.means().clamp(min=torch.finfo(torch.float64).tiny)
        stale = [s for s, name in enumerate(view.segments.names)
                 if name not in self._estimated_at or not 0 <= step - self._estimated_at[name] < self.interval]
        return self._estimate(view, stale, step, {})

    def refine(self, view, thresholds, counts, step):
        ks, live = view.k, view.max > 0
        attempt: dict[int, int] = {}
        for _ in range(self.refine_passes):
            many = (counts > ks * self.drift + self.drift) & live
            few = ((counts + 1) * self.drift < ks) & live
            if not bool((many | few).any()):
                return
            too_many = torch.nonzero(many).flatten().tolist()
            for s in too_many:  # DGC's hierarchical selection: the k-th largest among the candidates
                thr = float(kth_largest(view.chosen(s), int(ks[s])))
                self._threshold[view.segments.names[s]] = thr / float(self._unit[s])
            too_few = torch.nonzero(few).flatten().tolist()  # far too high: estimated anew, harder
            for s in too_few:
                attempt[s] = attempt.get(s, -1) + 1 if self._estimated_at[view.segments.names[s]] == step else 0
            view.apply(self._estimate(view, too_few, step, attempt), too_many + too_few)
            counts = view.counts()
