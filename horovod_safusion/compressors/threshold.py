"""Threshold sparsification over a segmented fusion buffer, in one pass (SAFusion §3.1 Step-1).

"SAFusion ... compresses G_l by selecting its elements whose absolute values are larger than a
defined threshold τ, i.e. |G_l| ≥ τ" — per tensor under ``ahead``, once per buffer under ``behind``.
A :class:`ThresholdCompressor` computes one threshold per segment (its subclasses differ only in
how) and selects with whole-buffer operations whatever the number of segments: per-segment
maxima and sums by one segmented reduction each, and one compiled pass
(:mod:`~horovod_safusion.compressors.segmented`) that compares every segment with its threshold
and writes the selected indices, ascending, with their count per segment. A compressor may hand
that pass a correction (:meth:`ThresholdCompressor.correction`): counts outside a band are then
corrected segment by segment while the segment is in cache — DGC's and SIDCo's trim and lowering,
GaussianK's steps. Refinements left to Python re-select only the segments whose thresholds they
change, in one more pass over the selection: a raised threshold filters the segment's current
selection while that is small (cost ∝ selected); otherwise the segment is compared anew
(cost ∝ segment). Thresholds, counts and per-segment
state are NumPy arrays indexed by segment, and compressors decide for all segments at once, so
selecting per tensor costs about what selecting per buffer does (``benchmarks/bench_compressors.py``
measures both; SAFusion §5 measured +4.5–6.2 % for its per-tensor selection).
A threshold above a segment's maximum is clipped to it, so every tensor with a nonzero gradient
keeps at least one element; an all-zero segment sends nothing, and an exact zero is never
selected, however low a threshold is lowered (an embedding's gradient is zero outside the batch's
rows: with fewer nonzeros than ``density · size``, a tensor sends its nonzeros, not itself whole).
"""
from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from ..kernels import constant
from ..segment import Segments
from .base import Compressor
from .device import DeviceView, Proposal, SegmentStats, on_host
from .segmented import LOWERINGS, Band, IndexScratch, NumbaKernels, Reselection, Steps
from .state import PerSegment

#: A raised threshold filters the segment's current selection (a gather per selected element)
#: rather than comparing the whole segment again only while the selection is at most
#: 1/FILTER_SHARE of the segment: a gather costs several times what a sequential compare does.
FILTER_SHARE = 10


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}  # what SegmentView handles


def _rounded(thr: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``thr`` rounded to ``dtype`` (a NumPy array of it)."""
    return thr.astype(_NUMPY_DTYPES[dtype])


class SegmentView:
    """``|x|`` of one CPU buffer with its per-segment maxima, target counts and current selection
    (the device path's twin: :class:`~horovod_safusion.compressors.device.DeviceView`).

    :meth:`apply` selects ``|x| >= threshold`` — in all segments, or again in some — and keeps the
    count per segment; :meth:`indices` returns the final selection. Per-segment quantities
    (:attr:`max`, :attr:`k`, :attr:`live`, :meth:`means`, :meth:`counts`) are NumPy arrays
    indexed by segment, whatever the buffer's device.
    """

    def __init__(self, flat: torch.Tensor, segments: Segments, density: float,
                 scratch: IndexScratch | None = None) -> None:
        self.segments = segments
        self.flat = flat
        self.offsets, self.sizes = segments.offset_array, segments.size_array
        self._kernels = NumbaKernels(self.offsets, self.sizes)
        self._x = self._kernels.wrap(flat)
        self._dtype = flat.dtype  # thresholds are rounded to it, so that every backend compares alike
        self.max, self._abs_sum = self._kernels.abs_stats(self._x)  # max: exact values of the dtype
        self.live = self.max > 0
        self.density = density  # the step's
        self.k = segments.k_array(density)  # target count per segment
        self._scratch = scratch or IndexScratch()
        self._scratch.reserve(2 * int(self.k.sum()) + len(self.k))  # a selection ends in a band about k
        self._indices = None  # selected, ascending, in runs of self._counts
        self._counts: np.ndarray | None = None
        self._applied: np.ndarray | None = None  # per segment, the (clipped) threshold of its selection
        self._slot = 0

    def means(self, signed: bool = False, squares: bool = False) -> np.ndarray:
        """Per-segment mean of ``x`` or ``|x|`` (or of ``x²``), float64: one segmented sum (the mean
        of ``|x|`` was taken with the maxima)."""
        if squares:
            total = self._kernels.sums(self._x, squares=True)
        else:
            total = self._kernels.sums(self._x) if signed else self._abs_sum
        return total / np.maximum(self.sizes, 1)

    def _next_slot(self) -> int:
        self._slot ^= 1
        return self._slot

    def apply(self, thresholds: np.ndarray, which: np.ndarray | None = None,
              correction: Band | Steps | None = None) -> None:
        """Select ``|x| >= threshold`` (clipped to the segment's maximum, in the buffer's dtype)
        in the segments ``which`` (all by default) and count what each of them selects. With a
        ``correction`` (all segments only), a count outside it is corrected in the same pass
        (:meth:`NumbaKernels.select_within`, :meth:`NumbaKernels.select_stepped`);
        :attr:`corrected` lists those segments and :meth:`applied` their thresholds."""
        thr = _rounded(np.where(self.live, np.minimum(thresholds, self.max), np.inf), self._dtype)
        self.corrected = np.zeros(0, dtype=np.int64)
        if isinstance(correction, Band):
            self._indices, self._counts, self._applied = self._kernels.select_within(
                self._x, thr, correction, self._scratch, self._next_slot())
        elif isinstance(correction, Steps):
            self._indices, self._counts, self._applied = self._kernels.select_stepped(
                self._x, np.where(self.live, thresholds, np.inf), correction, _rounded(self.max, self._dtype),
                self._scratch, self._next_slot())
        if correction is not None:
            self.corrected = np.flatnonzero(self._applied != thr)
            return
        if which is None or self._indices is None:
            self._indices, self._counts = self._kernels.select(self._x, thr, self._scratch, self._next_slot())
            self._applied = thr
            return
        which = np.asarray(which, dtype=np.int64)
        mode = np.full(len(thr), Reselection.KEPT, dtype=np.int8)
        mode[which] = Reselection.COMPARED  # unless a subset of a small selection:
        mode[which[(thr[which] >= self._applied[which])
                   & (self._counts[which] * FILTER_SHARE <= self.sizes[which])]] = Reselection.FILTERED
        self._indices, self._counts = self._kernels.reselect(self._x, self._indices, self._counts, mode,
                                                             thr, self._scratch, self._next_slot())
        self._applied[which] = thr[which]

    def counts(self) -> np.ndarray:
        """Selected elements per segment (int64; read, do not modify)."""
        return self._counts

    def applied(self) -> np.ndarray:
        """The threshold each segment's selection used (clipped, corrected; read, do not modify)."""
        return self._applied

    def kth_largest(self, which: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """Per segment of ``which``, the ``ks``-th largest ``|x|`` (exact thresholds)."""
        return self._kernels.kth_largest(self._x, self.offsets[which], self.sizes[which], ks)

    def kth_largest_selected(self, which: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """Per segment of ``which``, the ``ks``-th largest ``|x|`` among the elements it selects now
        (DGC's hierarchical selection: cost ∝ selected)."""
        runs = np.cumsum(self._counts) - self._counts
        return self._kernels.kth_largest(self._x, runs[which], self._counts[which], ks, idx=self._indices)

    def kth_largest_at(self, idx: np.ndarray, lengths: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """The ``ks[j]``-th largest ``|x|`` at consecutive runs of buffer indices ``idx`` of
        ``lengths[j]`` elements each (a sample per segment)."""
        return self._kernels.kth_largest(self._x, np.cumsum(lengths) - lengths, lengths, ks, idx=idx)

    def exceedance_moments(self, which: np.ndarray, eta: np.ndarray, inclusive: bool = False):
        """Per segment of ``which``: count, mean and variance of ``|x| − eta`` over ``|x| > eta``
        (``>=`` if ``inclusive``)."""
        return self._kernels.exceedance_moments(self._x, which, eta, inclusive)

    def indices(self) -> torch.Tensor:
        """Buffer-relative indices of the selected elements, ascending (int64, a tensor of its own)."""
        return self._kernels.to_indices(self._indices)


class ThresholdCompressor(Compressor):
    """One threshold per segment, selected in one pass; subclasses say how thresholds are found.

    Subclasses implement :meth:`thresholds` and may override :meth:`refine` to correct thresholds
    from the counts they selected (re-applying some segments, or adjusting the next step's);
    thresholds and counts are NumPy arrays indexed by segment. The selected indices go into an
    :class:`~horovod_safusion.compressors.segmented.IndexScratch` kept between calls, so an
    instance selects one buffer at a time, as the controller calls it.
    """

    def __init__(self, density: float = 0.01) -> None:
        super().__init__(density)
        self._scratch = IndexScratch()

    def select_at(self, flat: torch.Tensor, segments: Segments, step: int, density: float) -> torch.Tensor:
        if not on_host(flat):
            return self.propose(flat, segments, step, density).decide(zero=False)[0][1]
        view = SegmentView(flat, segments, density, self._scratch)
        thr = self.thresholds(view, step)
        view.apply(thr, correction=self.correction(view, step))
        self.refine(view, thr, view.counts(), step)
        return view.indices()

    def propose(self, flat: torch.Tensor, segments: Segments, step: int, density: float | None = None,
                stats: SegmentStats | None = None) -> Proposal:
        return self.propose_on_device(DeviceView(flat, segments, self.density_of_step(density), stats), step)

    @abstractmethod
    def propose_on_device(self, view: DeviceView, step: int) -> Proposal:
        """The device path: thresholds, corrections and the state update as device tensors
        (:meth:`DeviceView.propose`)."""

    @abstractmethod
    def thresholds(self, view: SegmentView, step: int) -> np.ndarray:
        """A threshold on ``|x|`` per segment (float64 array of length ``len(view.segments)``)."""

    def correction(self, view: SegmentView, step: int) -> Band | Steps | None:
        """How the first selection corrects counts by itself, per segment (None: it does not)."""
        return None

    def refine(self, view: SegmentView, thresholds: np.ndarray, counts: np.ndarray, step: int) -> None:
        """Correct the selection from the counts ``thresholds`` gave (``view.apply`` again, for
        some segments), or adjust state for the next step; the default keeps the selection."""


class PeriodicThreshold(ThresholdCompressor):
    """Thresholds estimated every ``interval`` steps and reused in between (SAFusion §4: "we
    periodically estimate the threshold ... and reuse it in some subsequent iterations").

    A threshold — fresh or reused — whose segment selects more than ``drift · (k + 1)`` elements is
    replaced at once by the k-th largest among the elements it selected (DGC's hierarchical
    selection: cost ∝ selected). One that selects fewer than ``k / drift − 1``:

    * if reused, has drifted since its estimate: it is lowered along an exponential tail fitted to
      its segment (``count ∝ exp(−τ / mean|x|)``, so ``τ − mean|x| · ln(k / count)`` selects about
      k), the segment is compared again, up to three times, and what it then selects is trimmed to
      the k largest. Both corrections happen in the selection pass itself, while the segment is
      in cache (:meth:`~horovod_safusion.compressors.segmented.NumbaKernels.select_within`):
      reused per-tensor thresholds drift out of the band far more often than per-buffer ones,
      and correcting them in passes of their own made selecting per tensor markedly slower than
      per buffer (``benchmarks/bench_compressors.py`` times both orders);
    * if fresh, or still too few after lowering, is estimated anew with its ``effort`` raised by
      one (what effort means is the subclass's: DGC samples more, SIDCo fits fewer stages), up to
      :attr:`max_effort`; a segment already at the maximum keeps its selection. The effort a
      segment needed is kept until its next periodic estimate (which starts from the base effort
      again): re-estimated at the base effort, a segment that fell short once falls short again
      and pays a second pass. (Kept for good, DGC falls short of low target densities: the base
      sample's rounding bias, ``⌈density · samples⌉``, is what lifts it.) These segments are
      re-selected alone, at most ``refine_passes`` times a step.

    Error feedback makes the accumulated gradient grow while residuals build up, which is what
    moves reused thresholds (the ``± 1`` keeps segments with small ``k``, whose counts are noisy,
    from being corrected for a handful of elements). A threshold is kept in units of its segment's
    mean ``|x|``, measured anew every step (one reduction): the gradient's scale changes from one
    mini-batch to the next far more than its shape, and kept in absolute units, per-tensor
    thresholds went stale within a step or two on real gradients (the same reason as ExDyna's
    ``relative`` thresholds). Subclasses implement :meth:`estimate` for a set of segments.
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
        self._threshold = PerSegment()  # per segment, in units of its mean |x|
        self._estimated_at = PerSegment()
        self._effort = PerSegment(fill=0)  # per segment, raised by refine until the next periodic estimate
        self._unit = np.ones(0)  # this step's mean |x| per segment

    max_effort: int = 0  # the largest ``effort`` that :meth:`estimate` distinguishes
    state_fields = ("_threshold", "_estimated_at", "_effort")

    @abstractmethod
    def estimate(self, view: SegmentView, which: np.ndarray, ks: np.ndarray, effort: np.ndarray,
                 step: int) -> np.ndarray:
        """Thresholds on ``|x|`` of the segments ``which`` that select about ``ks`` elements each;
        ``effort`` (0 to :attr:`max_effort`, per segment) counts the earlier estimates of a segment
        that selected far too few. Called only for segments with ``k > 1``. The estimate of a
        segment must depend on nothing but the segment, its effort and ``step``: the device path
        estimates every segment at once and keeps those the host would have estimated."""

    @abstractmethod
    def estimate_on_device(self, view: DeviceView, step: int) -> torch.Tensor:
        """:meth:`estimate` of every segment at every effort: a float64 device tensor of shape
        ``(segments, max_effort + 1)`` (segments with ``k = 1`` are replaced by their maximum)."""

    def propose_on_device(self, view: DeviceView, step: int) -> Proposal:
        """:meth:`thresholds`, :meth:`correction` and :meth:`refine` as device tensors, every
        segment through every branch, each keeping the branch the host takes (a per-segment
        ``torch.where``): the same thresholds, state and selection as the host path."""
        names, device = view.segments.names, view.flat.device
        state = self._threshold.on(names, device)
        estimated_at, effort = self._estimated_at.on(names, device), self._effort.on(names, device)
        age = step - estimated_at
        stale = ~((age >= 0) & (age < self.interval))  # never estimated: NaN, stale
        effort_now = torch.where(stale, 0.0, effort)  # a periodic estimate starts from the base effort
        fresh = torch.where(stale, float(step), estimated_at)
        estimates = torch.where(view.k[:, None] == 1, view.max[:, None], self.estimate_on_device(view, step))
        estimate = estimates.gather(1, effort_now.long()[:, None]).squeeze(1)
        relative = torch.where(stale, estimate / view.unit, state)
        low, high = (constant(b, device) for b in self._band(view.k_host))
        first = view.applied(torch.where(stale, estimate, state * view.unit))
        applied, counts = self._within_band(view, first, view.live & (fresh != step), low, high)
        relative = torch.where(applied != first, applied.double() / view.unit, relative)
        for last in range(self.refine_passes, 0, -1):  # :meth:`refine`
            too_many = view.live & (counts > high)
            too_few = view.live & (counts < low) & (effort_now < self.max_effort)
            effort_now = effort_now + (too_few & (fresh == step)).double()
            new = torch.where(too_many, view.kth, estimates.gather(1, effort_now.long()[:, None]).squeeze(1))
            again = too_many | too_few
            relative = torch.where(again, new / view.unit, relative)
            fresh = torch.where(too_few, float(step), fresh)
            applied = torch.where(again, view.applied(new), applied)
            if last > 1:  # the last pass's counts would decide nothing: the proposal selects anew
                counts = torch.where(again, view.count(applied), counts)

        def commit(_: torch.Tensor) -> None:
            state.copy_(relative)
            estimated_at.copy_(fresh)
            effort.copy_(effort_now)
            for kept in (self._threshold, self._estimated_at, self._effort):
                kept.mark(names)

        return view.propose(applied.double(), commit)

    @staticmethod
    def _within_band(view: DeviceView, applied: torch.Tensor, lower: torch.Tensor, low: torch.Tensor,
                     high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The device path's selection pass with its :class:`Band`
        (:meth:`~horovod_safusion.compressors.segmented.NumbaKernels.select_within`): where
        ``lower`` and too few, the threshold lowered along the exponential tail up to three times;
        then too many (or, lowered, more than k) trimmed to the k-th largest. The applied
        thresholds and their counts."""
        counts = view.count(applied)
        lowered = torch.zeros_like(lower)
        for _ in range(LOWERINGS):
            go = lower & (counts < low) & (applied > 0)
            down = torch.clamp(applied.double() - view.unit * torch.log(view.k / torch.clamp(counts, min=1.0)), min=0.0)
            applied = torch.where(go, down.to(applied.dtype), applied)
            counts = torch.where(go, view.count(applied), counts)
            lowered = lowered | go
        trim = view.live & ((counts > high) | (lowered & (counts > view.k)))
        applied = torch.where(trim, view.kth.to(applied.dtype), applied)
        return applied, torch.where(trim, view.count(applied), counts)

    def _estimate(self, view: SegmentView, which: np.ndarray, step: int) -> np.ndarray:
        """New estimates of the segments ``which`` at their effort, kept in mean-|x| units; the
        thresholds as estimated."""
        names = view.segments.names
        ks, thr = view.k[which], view.max[which]  # k = 1: the exact threshold is the maximum
        est = ks > 1
        if est.any():
            thr[est] = self.estimate(view, which[est], ks[est], self._effort.of(names)[which[est]].astype(np.int64),
                                     step)
        self._threshold.of(names)[which] = thr / self._unit[which]
        self._estimated_at.of(names)[which] = step
        return thr

    def thresholds(self, view: SegmentView, step: int) -> np.ndarray:
        names = view.segments.names
        self._unit = np.maximum(view.means(), np.finfo(np.float64).tiny)
        age = step - self._estimated_at.of(names)
        stale = np.flatnonzero(~((age >= 0) & (age < self.interval)))  # never estimated: NaN, stale
        self._effort.of(names)[stale] = 0  # a periodic estimate starts from the base effort
        thr = self._threshold.of(names) * self._unit
        thr[stale] = self._estimate(view, stale, step)  # as estimated (``/ unit · unit`` may move it an ulp)
        return thr

    def _band(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The counts a segment with target ``k`` may select: ``[k / drift − 1, drift · (k + 1)]``."""
        return k / self.drift - 1, self.drift * (k + 1)

    def correction(self, view: SegmentView, step: int) -> Band:
        fresh = self._estimated_at.of(view.segments.names) == step
        low, high = self._band(view.k)
        return Band(k=view.k, low=low, high=high, lower=view.live & ~fresh, scale=self._unit)

    def refine(self, view, thresholds, counts, step):
        ks, live = view.k, view.live
        low, high = self._band(ks)
        names = view.segments.names
        fixed = view.corrected  # by the selection pass: trimmed or lowered
        self._threshold.of(names)[fixed] = view.applied()[fixed] / self._unit[fixed]
        effort = self._effort.of(names)
        for _ in range(self.refine_passes):
            too_many = np.flatnonzero(live & (counts > high))
            too_few = np.flatnonzero(live & (counts < low) & (effort < self.max_effort))
            if not too_many.size and not too_few.size:
                return
            if too_many.size:  # DGC's hierarchical selection: the k-th largest among the candidates
                thresholds[too_many] = view.kth_largest_selected(too_many, ks[too_many])
                self._threshold.of(names)[too_many] = thresholds[too_many] / self._unit[too_many]
            # far too high: estimated anew, harder if the estimate was fresh, and as hard from now on
            effort[too_few[self._estimated_at.of(names)[too_few] == step]] += 1
            thresholds[too_few] = self._estimate(view, too_few, step)
            view.apply(thresholds, np.concatenate([too_many, too_few]))
            counts = view.counts()
