"""Threshold sparsification over a segmented fusion buffer, in one pass (SAFusion §3.1 Step-1).

"SAFusion ... compresses G_l by selecting its elements whose absolute values are larger than a
defined threshold τ, i.e. |G_l| ≥ τ" — per tensor under ``ahead``, once per buffer under ``behind``.
A :class:`ThresholdCompressor` computes one threshold per segment (its subclasses differ only in
how) and selects with whole-buffer operations whatever the number of segments: per-segment
maxima and sums by one segmented reduction each, and one compiled pass
(:mod:`~horovod_safusion.compressors.segmented`) that compares every segment with its threshold
and writes the selected indices, ascending, with their count per segment. A compressor may hand
that pass a correction (a :class:`~horovod_safusion.compressors.segmented.Band` or
:class:`~horovod_safusion.compressors.segmented.Steps`): counts outside a band are then
corrected segment by segment while the segment is in cache — DGC's and SIDCo's trim and lowering,
GaussianK's steps. Refinements left to Python re-select only the segments whose thresholds they
change, in one more pass over the selection: a raised threshold filters the segment's current
selection while that is small (cost ∝ selected); otherwise the segment is compared anew
(cost ∝ segment). Thresholds, counts and per-segment
state are NumPy arrays indexed by segment, and compressors decide for all segments at once, so
selecting per tensor costs about what selecting per buffer does (``benchmarks/bench_compressors.py``
measures both; SAFusion §5 measured +4.5–6.2 % for its per-tensor selection). Each compressor's
algorithm is written once, against a view (:class:`SegmentView` here, the device path's
:class:`~horovod_safusion.compressors.device.DeviceView` on a GPU), and both paths run it.
A threshold above a segment's maximum is clipped to it, so every tensor with a nonzero gradient
keeps at least one element; an all-zero segment sends nothing, and an exact zero is never
selected, however low a threshold is lowered (an embedding's gradient is zero outside the batch's
rows: with fewer nonzeros than ``density · size``, a tensor sends its nonzeros, not itself whole).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Callable, Union

import numpy as np
import torch

from ..kernels import constant
from ..segment import Segments
from .base import DEFAULT_DENSITY, Compressor
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
    """``|x|`` of one CPU buffer with its per-segment statistics and current selection: the host
    path's view, the twin of :class:`~horovod_safusion.compressors.device.DeviceView`.

    A threshold compressor's :meth:`ThresholdCompressor.decide` is written once against the
    interface both views share: per-segment quantities (:attr:`max`, :attr:`mean`, :attr:`unit`,
    :attr:`live`, :attr:`k`) are arrays of the view's kind (NumPy here), and so are masks, counts
    and thresholds; host-known arrays (:attr:`k_host`, index arrays of segments) are NumPy on both.
    :meth:`apply` selects ``|x| >= threshold`` — in all segments, or again in those of a mask —
    and returns the count per segment; :meth:`finish` ends the decision. Where the device view
    must take every branch for every segment, this one skips: :meth:`any` says whether a mask
    holds anything, and :meth:`kth`, :meth:`estimates` and :meth:`exceedance_moments` compute only
    the segments their mask names.
    """

    device = None  # arrays are NumPy (sample_positions draws on the host)

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
        self.k = self.k_host = segments.k_array(density)  # target count per segment
        self.mean = self._abs_sum / np.maximum(self.sizes, 1)  # of |x|
        self.unit = np.maximum(self.mean, np.finfo(np.float64).tiny)  # a scale that is never zero
        self._scratch = scratch or IndexScratch()
        self._scratch.reserve(2 * int(self.k.sum()) + len(self.k), flat.numel())  # a band about k
        self._indices = None  # selected, ascending, in runs of self._counts
        self._counts: np.ndarray | None = None
        self._applied: np.ndarray | None = None  # per segment, the (clipped) threshold of its selection
        self.corrected = np.zeros(len(self.k), dtype=bool)
        self._slot = 0

    # -- arrays of the view's kind --------------------------------------------------------------
    where, full = staticmethod(np.where), staticmethod(np.full)

    @staticmethod
    def array(a: np.ndarray) -> np.ndarray:
        """A host array as an array of the view's kind."""
        return a

    @staticmethod
    def any(mask: np.ndarray) -> bool:
        """Whether ``mask`` holds anything (the device view cannot tell without a read: True)."""
        return bool(mask.any())

    @staticmethod
    def take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return a[idx]

    @staticmethod
    def put(a: np.ndarray, idx: np.ndarray, values: np.ndarray) -> np.ndarray:
        """``a`` with ``values`` at the host indices ``idx`` (a copy)."""
        out = a.copy()
        out[idx] = values
        return out

    @staticmethod
    def assemble(n: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """A float64 array of ``n`` entries from ``(host indices, values)`` parts that cover it."""
        out = np.empty(n, dtype=np.float64)
        for idx, values in parts:
            out[idx] = values
        return out

    @staticmethod
    def state(kept: PerSegment, names: tuple[str, ...]) -> np.ndarray:
        """A compressor's per-segment state of the layout ``names`` (a live array: assign with
        ``[:]`` in :meth:`finish`'s commit)."""
        return kept.of(names)

    @staticmethod
    def unseen(kept: PerSegment, names: tuple[str, ...]) -> np.ndarray | None:
        """The segments of ``names`` that ``kept`` holds no value for (None: it holds them all)."""
        new = np.isnan(kept.of(names))
        return new if new.any() else None

    def known_live(self) -> np.ndarray:
        """:attr:`live` as the host knows it (the device view knows none: all True)."""
        return self.live

    # -- statistics -----------------------------------------------------------------------------
    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Per segment, the mean of ``x`` and of ``x²`` (float64): a segmented sum each (the mean of
        ``|x|``, :attr:`mean`, was taken with the maxima)."""
        n = np.maximum(self.sizes, 1)
        return self._kernels.sums(self._x) / n, self._kernels.sums(self._x, squares=True) / n

    # -- selection ------------------------------------------------------------------------------
    def _next_slot(self) -> int:
        self._slot ^= 1
        return self._slot

    def rounded(self, thresholds: np.ndarray) -> np.ndarray:
        """Thresholds as compared: clipped to the segment's maximum (every live segment keeps an
        element), infinite for an all-zero segment, in the buffer's dtype."""
        return _rounded(np.where(self.live, np.minimum(thresholds, self.max), np.inf), self._dtype)

    def apply(self, thresholds: np.ndarray, which: np.ndarray | None = None,
              correction: Band | Steps | None = None) -> np.ndarray:
        """Select ``|x| >= threshold`` (clipped to the segment's maximum, in the buffer's dtype)
        in the segments ``which`` (a mask or indices; all by default) and return what each segment
        selects. With a ``correction`` (all segments only), a count outside it is corrected in the
        same pass (:meth:`NumbaKernels.select_within`, :meth:`NumbaKernels.select_stepped`);
        :attr:`corrected` then masks those segments (it is left as it was by an apply without a
        correction) and :meth:`applied` has their thresholds."""
        thr = self.rounded(thresholds)
        if isinstance(correction, Band):
            self._indices, self._counts, self._applied = self._kernels.select_within(
                self._x, thr, correction, self._scratch, self._next_slot())
        elif isinstance(correction, Steps):
            self._indices, self._counts, self._applied = self._kernels.select_stepped(
                self._x, np.where(self.live, thresholds, np.inf), correction, _rounded(self.max, self._dtype),
                self._scratch, self._next_slot())
        if correction is not None:
            self.corrected = self._applied != thr
            return self._counts
        if which is None or self._indices is None:
            self._indices, self._counts = self._kernels.select(self._x, thr, self._scratch, self._next_slot())
            self._applied = thr
            return self._counts
        which = np.asarray(which)
        which = np.flatnonzero(which) if which.dtype == bool else which.astype(np.int64)
        mode = np.full(len(thr), Reselection.KEPT, dtype=np.int8)
        mode[which] = Reselection.COMPARED  # unless a subset of a small selection:
        mode[which[(thr[which] >= self._applied[which])
                   & (self._counts[which] * FILTER_SHARE <= self.sizes[which])]] = Reselection.FILTERED
        self._indices, self._counts = self._kernels.reselect(self._x, self._indices, self._counts, mode,
                                                             thr, self._scratch, self._next_slot())
        self._applied[which] = thr[which]
        return self._counts

    def counts(self) -> np.ndarray:
        """Selected elements per segment (int64; read, do not modify)."""
        return self._counts

    def applied(self) -> np.ndarray:
        """The threshold each segment's selection used (clipped, corrected; read, do not modify)."""
        return self._applied

    def finish(self, commit: Callable[[np.ndarray], None] | None = None) -> torch.Tensor:
        """The decision taken: ``commit(counts)`` updates the compressor's state at once, and the
        selected indices are returned (the device view returns a :class:`Proposal` that commits
        once the buffer is known to be finite)."""
        if commit is not None:
            commit(self._counts)
        return self.indices()

    def indices(self) -> torch.Tensor:
        """Buffer-relative indices of the selected elements, ascending (int64, a tensor of its own)."""
        return self._kernels.to_indices(self._indices)

    # -- exact thresholds, estimates and fits ---------------------------------------------------
    def kth(self, mask: np.ndarray, selected: bool = False) -> np.ndarray:
        """Per segment of ``mask``, its ``k``-th largest ``|x|`` (exact; other entries NaN). With
        ``selected`` the segments select more than ``k`` now, and only their selection is ranked
        (DGC's hierarchical selection: cost ∝ selected)."""
        which = np.flatnonzero(mask)
        out = np.full(len(self.k), np.nan)
        if selected:
            runs = np.cumsum(self._counts) - self._counts
            out[which] = self._kernels.kth_largest(self._x, runs[which], self._counts[which], self.k[which],
                                                   idx=self._indices)
        else:
            out[which] = self.kth_largest(which, self.k[which])
        return out

    def kth_largest(self, which: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """Per segment of ``which``, the ``ks``-th largest ``|x|`` (exact thresholds)."""
        return self._kernels.kth_largest(self._x, self.offsets[which], self.sizes[which], ks)

    def kth_largest_at(self, idx: np.ndarray, lengths: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """The ``ks[j]``-th largest ``|x|`` at consecutive runs of buffer indices ``idx`` of
        ``lengths[j]`` elements each (a sample per segment)."""
        return self._kernels.kth_largest(self._x, np.cumsum(lengths) - lengths, lengths, ks, idx=idx)

    def estimates(self, estimate: Callable[[np.ndarray, np.ndarray], np.ndarray], mask: np.ndarray,
                  effort: np.ndarray, levels: int) -> np.ndarray:
        """Per segment of ``mask``, ``estimate(which, efforts)`` at its ``effort`` (other entries
        NaN); ``levels`` efforts exist (the device view estimates them all at once)."""
        which = np.flatnonzero(mask)
        out = np.full(len(self.k), np.nan)
        if which.size:
            out[which] = estimate(which, effort[which].astype(np.int64))
        return out

    def abs_moments(self, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per segment of ``which``: mean and variance of ``|x|``."""
        _, mean, var = self._kernels.exceedance_moments(self._x, which, np.zeros(len(which)), True)
        return mean, var

    def exceedance_moments(self, which: np.ndarray, eta: np.ndarray, inclusive: bool = False,
                           where: np.ndarray | None = None):
        """Per segment of ``which``: count, mean and variance of ``|x| − eta`` over ``|x| > eta``
        (``>=`` if ``inclusive``); only where ``where`` (zeros elsewhere)."""
        if where is None:
            return self._kernels.exceedance_moments(self._x, which, eta, inclusive)
        at = np.flatnonzero(where)
        count, mean, var = np.zeros(len(which), dtype=np.int64), np.zeros(len(which)), np.zeros(len(which))
        count[at], mean[at], var[at] = self._kernels.exceedance_moments(self._x, which[at], eta[at], inclusive)
        return count, mean, var


View = Union[SegmentView, DeviceView]  # what a threshold compressor decides in


class ThresholdCompressor(Compressor):
    """One threshold per segment, selected in one pass; a subclass says how thresholds are found,
    once, for both paths.

    Subclasses implement :meth:`decide` against a view — :class:`SegmentView` for CPU buffers,
    :class:`~horovod_safusion.compressors.device.DeviceView` on the device path — whose arrays
    are NumPy or device tensors alike: thresholds, counts and state are arrays indexed by
    segment, a data-dependent branch is a mask (``view.where``), and a loop that the host may end
    early asks ``view.any`` (the device view answers True and runs every pass, keeping per segment
    what the host would have kept). Every state change happens in the ``commit`` given to
    ``view.finish``: at once on the host, once the buffer is known to be finite on the device.
    Selected indices go into an :class:`~horovod_safusion.compressors.segmented.IndexScratch` kept
    between calls, so an instance selects one buffer at a time, as the controller calls it.
    """

    def __init__(self, density: float = DEFAULT_DENSITY) -> None:
        super().__init__(density)
        self._scratch = IndexScratch()

    def select_at(self, flat: torch.Tensor, segments: Segments, step: int, density: float) -> torch.Tensor:
        if not on_host(flat):
            return self.propose(flat, segments, step, density).decide(zero=False)[0][1]
        return self.decide(SegmentView(flat, segments, density, self._scratch), step)

    def propose(self, flat: torch.Tensor, segments: Segments, step: int, density: float | None = None,
                stats: SegmentStats | None = None) -> Proposal:
        return self.decide(DeviceView(flat, segments, self.density_of_step(density), stats), step)

    @abstractmethod
    def decide(self, view: View, step: int) -> "torch.Tensor | Proposal":
        """Select in ``view`` (``view.apply``) and end with ``view.finish(commit)``."""


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
        self._effort = PerSegment(fill=0)  # per segment, raised until the next periodic estimate

    max_effort: int = 0  # the largest ``effort`` that :meth:`estimate` distinguishes
    state_fields = ("_threshold", "_estimated_at", "_effort")

    @abstractmethod
    def estimate(self, view: View, which: np.ndarray, ks: np.ndarray, effort: np.ndarray,
                 step: int) -> "np.ndarray | torch.Tensor":
        """Thresholds on ``|x|`` of the segments ``which`` (host indices, which may repeat) that
        select about ``ks`` elements each, at ``effort`` (0 to :attr:`max_effort`, per entry: the
        earlier estimates of a segment that selected far too few), as an array of the view's kind.
        Called only for segments with ``k > 1``. The estimate of a segment must depend on nothing
        but the segment, its effort and ``step``: the host estimates the segments it must, the
        device view every segment at every effort at once."""

    def _estimates(self, view: View, mask, effort, step: int) -> "np.ndarray | torch.Tensor":
        """:meth:`estimate` of the segments of ``mask`` at their ``effort`` (a segment with
        ``k = 1``: its maximum, the exact threshold)."""
        def estimate(which: np.ndarray, efforts: np.ndarray):
            ks = view.k_host[which]
            one, est = np.flatnonzero(ks <= 1), np.flatnonzero(ks > 1)
            parts = [(one, view.take(view.max, which[one]))]
            if est.size:
                parts.append((est, self.estimate(view, which[est], ks[est], efforts[est], step)))
            return view.assemble(len(which), parts)
        return view.estimates(estimate, mask, effort, self.max_effort + 1)

    def band(self, k: "np.ndarray | torch.Tensor") -> tuple:
        """The counts a segment with target ``k`` may select: ``[k / drift − 1, drift · (k + 1)]``."""
        return k / self.drift - 1, self.drift * (k + 1)

    def decide(self, view: View, step: int) -> "torch.Tensor | Proposal":
        names, unit, live = view.segments.names, view.unit, view.live
        state, estimated_at, effort = (view.state(kept, names)
                                       for kept in (self._threshold, self._estimated_at, self._effort))
        age = step - estimated_at
        stale = ~((age >= 0) & (age < self.interval))  # never estimated: NaN, stale
        effort_now, fresh, relative, thr = effort, estimated_at, state, state * unit
        if view.any(stale):  # most steps reuse every threshold
            effort_now = view.where(stale, 0.0, effort)  # a periodic estimate starts from the base effort
            fresh = view.where(stale, float(step), estimated_at)  # the step each threshold was estimated at
            estimate = self._estimates(view, stale, effort_now, step)
            relative, thr = view.where(stale, estimate / unit, state), view.where(stale, estimate, thr)
        low, high = self.band(view.k)
        counts = view.apply(thr, correction=Band(k=view.k, low=low, high=high, lower=live & (fresh != step), scale=unit))
        if view.any(view.corrected):  # trimmed or lowered
            relative = view.where(view.corrected, view.applied() / unit, relative)
        for _ in range(self.refine_passes):
            too_many = live & (counts > high)
            too_few = live & (counts < low) & (effort_now < self.max_effort)
            again = too_many | too_few
            if not view.any(again):
                break
            # far too high: estimated anew, harder if the estimate was fresh, and as hard from now on
            effort_now = effort_now + (too_few & (fresh == step))
            new = view.where(too_many, view.kth(too_many, selected=True),
                             self._estimates(view, too_few, effort_now, step))
            relative = view.where(again, new / unit, relative)
            fresh = view.where(too_few, float(step), fresh)
            counts = view.apply(new, again)

        def commit(_) -> None:
            state[:], estimated_at[:], effort[:] = relative, fresh, effort_now
            for kept in (self._threshold, self._estimated_at, self._effort):
                kept.mark(names)

        return view.finish(commit)
