"""Threshold sparsification over a segmented fusion buffer, in one pass (SAFusion §3.1 Step-1).

"SAFusion ... compresses G_l by selecting its elements whose absolute values are larger than a
defined threshold τ, i.e. |G_l| ≥ τ" — per tensor under ``ahead``, once per buffer under ``behind``.
A :class:`ThresholdCompressor` computes one threshold per segment (its subclasses differ only in
how) and selects with a few whole-buffer operations whatever the number of segments: per-segment
maxima and sums by one segmented reduction each, one comparison pass that writes every segment's
``|x| >= τ`` into one mask, one ``nonzero``, and the counts per segment from the selected indices
(cost ∝ selected). Refinements re-select only the segments whose thresholds they change and splice
their indices into the selection: a raised threshold filters the segment's current selection
while that is small (cost ∝ selected); otherwise the segment is compared anew (cost ∝ segment). What remains per
segment is Python bookkeeping — a few microseconds per segment and pass — and, for estimating
compressors, one estimate per segment; it weighs on small tensors (``benchmarks/bench_compressors.py``
measures it against selecting per buffer; SAFusion measured +4.5–6.2 % for its per-tensor selection).
A threshold above a segment's maximum is clipped to it, so every tensor with a nonzero gradient
keeps at least one element; an all-zero segment sends nothing.

On CPU these operations run in NumPy on the tensors' own memory: on the CPU we develop on, with
PyTorch 2.13, NumPy's comparison and ``flatnonzero`` were 5–20x faster than PyTorch's CPU kernels
(``>=`` on 175k floats: 15 µs against 330 µs), which made threshold selection 2–3x faster overall.
Other devices, and dtypes NumPy lacks, use the same operations in PyTorch (:class:`_TorchOps`);
a test checks that both select the same elements.
"""
from __future__ import annotations

import itertools
import math
from abc import abstractmethod

import numpy as np
import torch

from ..segment import Segments
from .base import Compressor


class _TorchOps:
    """The segmented whole-buffer operations of :class:`SegmentView`, in PyTorch (any device)."""

    def __init__(self, segments: Segments, device: torch.device) -> None:
        self.lengths = torch.tensor(segments.sizes, dtype=torch.int64, device=device)
        self.bounds = torch.tensor(segments.offsets + (segments.numel,), dtype=torch.int64, device=device)
        self.numel = segments.numel

    def wrap(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def segment_max(self, a: torch.Tensor) -> torch.Tensor:
        return torch.segment_reduce(a, "max", lengths=self.lengths)

    def segment_sum(self, a: torch.Tensor) -> torch.Tensor:
        return torch.segment_reduce(a, "sum", lengths=self.lengths)

    def select(self, a: torch.Tensor, thresholds: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``a >= threshold of its segment`` into the mask ``out``: the thresholds spread over the
        buffer, one comparison."""
        return torch.ge(a, torch.repeat_interleave(thresholds, self.lengths, output_size=self.numel), out=out)

    def compare(self, a: torch.Tensor, threshold: float, out: torch.Tensor) -> torch.Tensor:
        return torch.ge(a, threshold, out=out)

    def flatnonzero(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(mask).squeeze(1)

    def counts(self, indices: torch.Tensor) -> torch.Tensor:
        """Per segment, how many of the (ascending) ``indices`` it holds: where the segments'
        boundaries fall among them (cost ∝ segments · log selected)."""
        return torch.searchsorted(indices, self.bounds).diff()

    def concat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)

    def to_torch(self, a: torch.Tensor) -> torch.Tensor:
        return a


class _NumpyOps(_TorchOps):
    """The same operations in NumPy, on CPU tensors' memory (no copies)."""

    DTYPES = (torch.float16, torch.float32, torch.float64)

    def __init__(self, segments: Segments, device: torch.device) -> None:
        self.lengths = np.asarray(segments.sizes, dtype=np.int64)
        self.offsets = np.asarray(segments.offsets, dtype=np.int64)
        self.bounds = np.asarray(segments.offsets + (segments.numel,), dtype=np.int64)
        self.numel = segments.numel

    def wrap(self, t: torch.Tensor) -> np.ndarray:
        return t.numpy()

    def segment_max(self, a: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(a, self.offsets)

    def segment_sum(self, a: np.ndarray) -> np.ndarray:
        return np.add.reduceat(a, self.offsets, dtype=np.float64 if a.dtype == np.float16 else a.dtype)

    def select(self, a: np.ndarray, thresholds: np.ndarray, out: np.ndarray) -> np.ndarray:
        """A comparison per segment into the mask ``out``: a NumPy call costs about a microsecond,
        less than spreading the thresholds over the buffer (``np.repeat``) costs."""
        for o, n, t in zip(self.offsets.tolist(), self.lengths.tolist(), thresholds.tolist()):
            np.greater_equal(a[o:o + n], t, out=out[o:o + n])
        return out

    def compare(self, a: np.ndarray, threshold: float, out: np.ndarray) -> np.ndarray:
        return np.greater_equal(a, threshold, out=out)

    def flatnonzero(self, mask: np.ndarray) -> np.ndarray:
        return np.flatnonzero(mask)

    def counts(self, indices: np.ndarray) -> np.ndarray:
        return np.diff(np.searchsorted(indices, self.bounds))

    def concat(self, parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts)

    def to_torch(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))


# A raised threshold filters the segment's current selection (a gather per selected element)
# rather than comparing the whole segment again only while the selection is at most 1/FILTER_SHARE
# of the segment: on the CPU we develop on, gathering and comparing cost 2 ns per selected element
# in a 4 MB buffer and 9 ns in an 11 MB one, against 0.8–0.9 ns per element to compare a segment.
FILTER_SHARE = 10


class Workspace:
    """Scratch memory for selecting from one buffer at a time: ``|x|`` and a comparison mask, as
    long as the largest buffer seen. Allocated afresh per call, buffers of a few megabytes came
    from new pages every time and the page faults cost more than the selection (on ResNet-18,
    ``abs`` of the same buffer took 4–10 ms fresh, 3.4 ms in reused memory)."""

    def __init__(self) -> None:
        self._held: dict[torch.dtype, torch.Tensor] = {}

    def _like(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        held = self._held.get(dtype)
        if held is None or held.numel() < flat.numel() or held.device != flat.device:
            held = self._held[dtype] = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
        return held[:flat.numel()]

    def magnitudes(self, flat: torch.Tensor) -> torch.Tensor:
        """Room for ``|flat|``."""
        return self._like(flat, flat.dtype)

    def mask(self, flat: torch.Tensor) -> torch.Tensor:
        """Room for a boolean mask over ``flat``."""
        return self._like(flat, torch.bool)


class SegmentView:
    """``|x|`` of one flat buffer with its per-segment maxima, target counts and current selection.

    :meth:`apply` selects ``|x| >= threshold`` — in all segments with a few whole-buffer operations,
    or in the few segments a refinement changes — and keeps the count per segment, so refinements
    read :meth:`counts`; :meth:`indices` returns the final selection. A segment whose threshold
    rises keeps the subset of its current selection that passes (cost ∝ selected, not ∝ segment:
    DGC's hierarchical selection, GaussianK's and RedSync's steps up) while that selection is small;
    otherwise the segment is compared anew. Per-segment results (``max``, ``k``, :meth:`means`,
    :meth:`counts`) are tensors on the buffer's device, indexed by segment.
    """

    def __init__(self, flat: torch.Tensor, segments: Segments, density: float,
                 workspace: Workspace | None = None) -> None:
        self.segments = segments
        self.flat = flat
        cpu = flat.device.type == "cpu" and flat.dtype in _NumpyOps.DTYPES
        self._ops = (_NumpyOps if cpu else _TorchOps)(segments, flat.device)
        workspace = workspace or Workspace()
        self.abs = torch.abs(flat, out=workspace.magnitudes(flat))
        self._abs = self._ops.wrap(self.abs)
        self._mask = self._ops.wrap(workspace.mask(flat))  # scratch for comparisons
        self.max = self._ops.to_torch(self._ops.segment_max(self._abs))
        self.k = segments.k(density).to(flat.device)  # target count per segment
        self._counts: torch.Tensor | None = None
        self._applied: list[float] = []  # per segment, the (clipped) threshold of its selection
        self._indices = None       # of the last full selection, then with the patches spliced in
        self._base_counts: list[int] = []  # per segment, as in self._indices
        self._base_ends: list[int] = []
        self._patches: dict = {}   # segment -> its indices, re-selected since

    def means(self, signed: bool = False, squares: bool = False) -> torch.Tensor:
        """Per-segment mean of ``x`` or ``|x|`` (or of their squares), float64: one segmented sum."""
        src = self._ops.wrap(self.flat) if signed else self._abs
        sums = self._ops.to_torch(self._ops.segment_sum(src * src if squares else src))
        return sums.to(torch.float64) / torch.tensor(self.segments.sizes, dtype=torch.float64, device=sums.device)

    def magnitudes(self, s: int):
        """``|x|`` of segment ``s``: a NumPy array on CPU, else a tensor (both index alike)."""
        o = self.segments.offsets[s]
        return self._abs[o:o + self.segments.sizes[s]]

    def _selected(self, s: int):
        """Buffer-relative indices that segment ``s`` selects now."""
        if s in self._patches:
            return self._patches[s]
        end = self._base_ends[s]
        return self._indices[end - self._base_counts[s]:end]

    def chosen(self, s: int):
        """``|x|`` of the elements segment ``s`` selects now (its candidates), as :meth:`magnitudes`."""
        return self._abs[self._selected(s)]

    def apply(self, thresholds: torch.Tensor, which: list[int] | None = None) -> None:
        """Select ``|x| >= threshold`` (clipped to the segment's maximum) in ``which`` segments
        (all by default) and count what each of them selects."""
        thr = torch.where(self.max > 0, torch.minimum(thresholds.to(self.max.dtype), self.max),
                          torch.full_like(self.max, math.inf))
        ops = self._ops
        if which is None or self._indices is None:  # every segment: one comparison, one nonzero
            self._indices = ops.flatnonzero(ops.select(self._abs, ops.wrap(thr), self._mask))
            self._counts = ops.to_torch(ops.counts(self._indices))
            self._rebase()
            self._applied = thr.tolist()
            return
        t = thr.tolist()
        for s in which:  # re-selected alone; spliced into the indices later
            o, n = self.segments.offsets[s], self.segments.sizes[s]
            idx = self._selected(s)
            if t[s] >= self._applied[s] and len(idx) * FILTER_SHARE <= n:  # a subset of the selection
                idx = idx[self._abs[idx] >= t[s]]
            else:
                idx = ops.flatnonzero(ops.compare(self._abs[o:o + n], t[s], self._mask[o:o + n])) + o
            self._patches[s], self._counts[s], self._applied[s] = idx, len(idx), t[s]

    def _rebase(self) -> None:
        """The selection per segment is now ``self._indices``, in runs of ``self._counts``."""
        self._base_counts, self._patches = self._counts.tolist(), {}
        self._base_ends = list(itertools.accumulate(self._base_counts))

    def counts(self) -> torch.Tensor:
        """Selected elements per segment (int64 tensor; read, do not modify)."""
        return self._counts

    def indices(self) -> torch.Tensor:
        """Buffer-relative indices of the selected elements, ascending (int64)."""
        if self._patches:  # replace the re-selected segments' runs of the last full selection
            pieces, pos = [], 0
            for s in sorted(self._patches):
                pieces += [self._indices[pos:self._base_ends[s] - self._base_counts[s]], self._patches[s]]
                pos = self._base_ends[s]
            pieces.append(self._indices[pos:])
            self._indices = self._ops.concat(pieces)
            self._rebase()
        return self._ops.to_torch(self._indices).to(torch.int64)


class ThresholdCompressor(Compressor):
    """One threshold per segment, selected in one pass; subclasses say how thresholds are found.

    Subclasses implement :meth:`thresholds` and may override :meth:`refine` to correct thresholds
    from the counts they selected (re-applying some segments, or adjusting the next step's).
    ``|x|`` and the comparison masks go into a :class:`Workspace` kept between calls, so an
    instance selects one buffer at a time, as the controller calls it.
    """

    def __init__(self, density: float = 0.01) -> None:
        super().__init__(density)
        self._workspace = Workspace()

    def select(self, flat: torch.Tensor, segments: Segments, step: int) -> torch.Tensor | None:
        if self.density >= 1.0:
            return None
        view = SegmentView(flat, segments, self.density, self._workspace)
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


def kth_largest(values, k: int) -> float:
    """The k-th largest entry of a 1-D NumPy array or tensor (k is clamped to its length)."""
    n = len(values)
    k = max(1, min(k, n))
    if isinstance(values, np.ndarray):
        return float(np.partition(values, n - k)[n - k])
    return float(torch.topk(values, k, sorted=False).values.min())


class PeriodicThreshold(ThresholdCompressor):
    """Thresholds estimated every ``interval`` steps and reused in between (SAFusion §4: "we
    periodically estimate the threshold ... and reuse it in some subsequent iterations").

    A threshold — fresh or reused — whose segment selects more than ``drift · (k + 1)`` elements is
    replaced at once by the k-th largest among the elements it selected (DGC's hierarchical
    selection: cost ∝ selected), and one that selects fewer than ``k / drift − 1`` is estimated anew
    with its ``effort`` raised by one (what effort means is the subclass's: DGC samples more, SIDCo
    fits fewer stages), up to :attr:`max_effort`; a segment already at the maximum keeps its
    selection, since estimating it again would give the same threshold. The effort a segment
    needed is kept until its next periodic estimate (which starts from the base effort again):
    re-estimated at the base effort, a segment that fell short once falls short again and pays a
    second pass. (Kept for good, DGC's density at 0.001 fell from 1.08x to 0.89x of the target on
    ResNet-18: the base sample's rounding bias, ``⌈density · samples⌉``, is what lifts it.) Only corrected segments are re-selected,
    at most ``refine_passes`` times a step. Error feedback makes the accumulated gradient grow
    while residuals build up, which is what moves reused thresholds (the ``± 1`` keeps segments
    with small ``k``, whose counts are noisy, from being corrected for a handful of elements).
    A threshold is kept in units of its segment's mean ``|x|``, measured
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
        self._effort: dict[str, int] = {}  # per segment, raised by refine until the next periodic estimate
        self._unit: list[float] = []  # this step's mean |x| per segment

    max_effort: int = 0  # the largest ``effort`` that :meth:`estimate` distinguishes

    @abstractmethod
    def estimate(self, magnitudes, k: int, effort: int) -> float:
        """A threshold on one segment's ``|x|`` (as :meth:`SegmentView.magnitudes`) that selects
        about ``k`` elements; ``effort`` (0 to :attr:`max_effort`) counts the earlier estimates of
        this segment that selected far too few."""

    def _estimate(self, view: SegmentView, which, step: int) -> torch.Tensor:
        ks = view.segments.k_list(self.density)
        maxima = view.max.tolist() if which else []
        for s in which:
            name = view.segments.names[s]
            # k = 1 (every segment smaller than about 1/density): the exact threshold is the maximum
            thr = maxima[s] if ks[s] == 1 else self.estimate(view.magnitudes(s), ks[s], self._effort.get(name, 0))
            self._threshold[name] = thr / self._unit[s]
            self._estimated_at[name] = step
        return self._current(view)

    def _current(self, view: SegmentView) -> torch.Tensor:
        """Every segment's threshold at the segment's current scale."""
        return torch.tensor([self._threshold[n] * u for n, u in zip(view.segments.names, self._unit)],
                            dtype=torch.float64, device=view.abs.device)

    def thresholds(self, view: SegmentView, step: int) -> torch.Tensor:
        tiny = torch.finfo(torch.float64).tiny
        self._unit = [max(u, tiny) for u in view.means().tolist()]
        stale = [s for s, name in enumerate(view.segments.names)
                 if name not in self._estimated_at or not 0 <= step - self._estimated_at[name] < self.interval]
        for s in stale:  # a periodic estimate starts from the base effort
            self._effort.pop(view.segments.names[s], None)
        return self._estimate(view, stale, step)

    def refine(self, view, thresholds, counts, step):
        # Bookkeeping on Python numbers: per-segment decisions on tiny tensors would cost more than
        # the selection itself.
        ks, live, drift = view.segments.k_list(self.density), (view.max > 0).tolist(), self.drift
        names = view.segments.names
        for _ in range(self.refine_passes):
            c = counts.tolist()
            too_many = [s for s in range(len(c)) if live[s] and c[s] > ks[s] * drift + drift]
            too_few = [s for s in range(len(c)) if live[s] and (c[s] + 1) * drift < ks[s]
                       and self._effort.get(names[s], 0) < self.max_effort]
            if not too_many and not too_few:
                return
            for s in too_many:  # DGC's hierarchical selection: the k-th largest among the candidates
                self._threshold[names[s]] = kth_largest(view.chosen(s), ks[s]) / self._unit[s]
            for s in too_few:  # far too high: estimated anew, harder, and as hard from now on
                self._effort[names[s]] = self._effort.get(names[s], 0) + 1
            view.apply(self._estimate(view, too_few, step), too_many + too_few)
            counts = view.counts()
