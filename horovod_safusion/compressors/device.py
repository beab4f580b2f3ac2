"""The device path of selection: every per-segment decision on the buffer's device, one host read.

On a GPU, each value read back to the host inside a gradient hook stops the CPU from queueing the
rest of back-propagation, which is the overlap SAFusion exists for (§3.1 Step-2, §4). The CPU path
(:class:`~horovod_safusion.compressors.threshold.SegmentView`) decides per segment in NumPy and
compiled loops; here thresholds, counts, statistics and corrections stay device tensors, and the
buffer is read back once, for the count that sizes its collective (:class:`Proposal`).

A threshold compressor's algorithm is written once
(:meth:`~horovod_safusion.compressors.threshold.ThresholdCompressor.decide`), against the
interface that :class:`DeviceView` shares with the host's view. Where the host takes a
data-dependent branch, the device view computes both sides for every segment and keeps, per
segment, the side the host would have taken (``torch.where``), so that it selects the host path's
elements (``tests/unit/test_compressors.py`` holds every threshold compressor to that):
RedSync's bisection and GaussianK's stepping run all their passes, a segment in its band keeping
its threshold; DGC's and SIDCo's corrections (trim, lowering, a new estimate with more effort) run
every pass for every segment, with the k-th largest of every segment and the estimate of every
effort taken at once. Stopping early, or skipping a segment, would need the counts on the host.
A compressor's state is updated only after the host read said the buffer was finite
(:meth:`Proposal.decide`).

``HOROVOD_SAFUSION_DEVICE_PATH=1`` sends CPU buffers down this path too (tests, benchmarks).
"""
from __future__ import annotations

from functools import cached_property, lru_cache
from typing import Callable

import numpy as np
import torch

from .. import kernels
from ..kernels import reference
from ..segment import Segments
from .segmented import LOWERINGS, Band, Steps
from .state import PerSegment


def on_host(flat: torch.Tensor) -> bool:
    """Whether ``flat`` is selected by the compiled CPU kernels rather than the device path."""
    return kernels.on_host(flat)


@lru_cache(maxsize=256)
def _sizes(segments: Segments, device: torch.device) -> torch.Tensor:
    return torch.tensor(segments.sizes, dtype=torch.float64, device=device).clamp(min=1)  # means of empty segments: 0


@lru_cache(maxsize=1024)
def _k(segments: Segments, density: float, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(segments.k_array(density).astype(np.float64)).to(device)


class SegmentStats:
    """Per segment ``max |x|``, ``Σ |x|`` and finiteness, filled in tensor by tensor while the
    gradient hooks write the buffer (:func:`horovod_safusion.kernels.accumulate`)."""

    def __init__(self, segments: int, device: torch.device) -> None:
        self.max = torch.zeros(segments, dtype=torch.float64, device=device)
        self.sum = torch.zeros_like(self.max)
        self.finite = torch.ones(segments, dtype=torch.bool, device=device)

    def set(self, slot: int, stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.max[slot], self.sum[slot], self.finite[slot] = stats


class Proposal:
    """One buffer's selection, decided on the device and taken after one host read.

    ``total`` (0-dim int64 tensor, or an int the host knows already) and ``finite`` (0-dim bool
    tensor) are what the controller reads — together, in one transfer. Then, if the buffer was
    finite, :meth:`commit` updates the compressor's state and :meth:`take` returns
    ``(values, int64 indices, wire rows or None)`` with the selected elements zeroed in the buffer.
    """

    def __init__(self, total: "torch.Tensor | int", finite: torch.Tensor,
                 take: Callable[[int, bool], tuple], commit: Callable[[], None] | None = None) -> None:
        self.total, self.finite = total, finite
        self._take, self._commit = take, commit

    def commit(self) -> None:
        if self._commit is not None:
            self._commit()

    def take(self, total: int, zero: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self._take(total, zero)

    @classmethod
    def of_indices(cls, flat: torch.Tensor, indices: torch.Tensor) -> "Proposal":
        """A selection whose indices are known without reading the buffer (top-k, random-k)."""
        def take(total: int, zero: bool):
            values = flat[indices]
            if zero:
                flat.index_fill_(0, indices, 0)
            return values, indices, None
        return cls(indices.numel(), torch.isfinite(flat.sum(dtype=_acc(flat))), take)

    def decide(self, zero: bool = True, dropped: "torch.Tensor | None" = None) -> tuple[tuple, bool]:
        """Read ``(total, finite)`` once — not finite either where ``dropped`` (the fill's count of
        non-finite gradient elements it left out) is not zero — commit the compressor's state only
        if finite, and take the selection: ``((values, indices, wire rows or None), finite)``."""
        if dropped is not None:
            self.finite = self.finite & (dropped == 0)
        total, finite = self.read()
        if finite:
            self.commit()
        return self.take(total, zero), finite

    def read(self) -> tuple[int, bool]:
        """``(total, finite)`` — the one host synchronisation of the buffer."""
        if isinstance(self.total, int):
            return self.total, bool(self.finite)
        total, finite = torch.stack([self.total, self.finite.to(torch.int64)]).tolist()
        return int(total), bool(finite)


def _acc(flat: torch.Tensor) -> torch.dtype:
    return torch.float32 if flat.element_size() < 4 else flat.dtype


class DeviceView:
    """One flat buffer on the device path: the twin of the host's
    :class:`~horovod_safusion.compressors.threshold.SegmentView`, with the same interface, whose
    per-segment arrays (``max``, ``mean`` and ``unit`` of ``|x|``, ``live``, target ``k``) are
    float64 or bool device tensors, and so are the masks, counts and thresholds a compressor
    computes from them (``k_host`` is ``k`` as a NumPy array). Nothing here reads a value back:
    :meth:`any` answers True, so a compressor runs every pass; :meth:`kth`, :meth:`estimates` and
    :meth:`exceedance_moments` compute every segment, whatever the mask; every :meth:`apply`
    compares the whole buffer with one threshold per segment (the segments outside its mask keep
    theirs), and the last comparison is the selection that :meth:`finish` proposes."""

    device: torch.device

    def __init__(self, flat: torch.Tensor, segments: Segments, density: float,
                 stats: "SegmentStats | None" = None) -> None:
        self.flat, self.segments, self.density = flat, segments, density
        self.device = flat.device
        self.table = kernels.block_table(segments, flat.device)
        if stats is None:
            self.max, sums, self.finite = kernels.segment_stats(flat, self.table)
        else:  # taken while the buffer was filled
            self.max, sums, self.finite = stats.max, stats.sum, stats.finite.all()
        self._divisor = _sizes(segments, flat.device)
        self.mean = sums / self._divisor
        self.unit = torch.clamp(self.mean, min=float(np.finfo(np.float64).tiny))
        self.live = self.max > 0
        self.k = _k(segments, density, flat.device)
        self.k_host = segments.k_array(density)
        self.corrected = torch.zeros_like(self.live)
        self._applied: torch.Tensor | None = None  # the thresholds of the last comparison
        self._selection = None  # ... and its selection
        self._counts: torch.Tensor | None = None
        self._table: torch.Tensor | None = None  # :meth:`estimates`, every segment at every effort

    # -- arrays of the view's kind --------------------------------------------------------------
    where = staticmethod(torch.where)

    def full(self, n: int, value: float) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.float64, device=self.device)

    def array(self, a: np.ndarray) -> torch.Tensor:
        """A host array as a device tensor (copied once per content: :func:`kernels.constant`)."""
        return kernels.constant(a, self.device)

    @staticmethod
    def any(mask: torch.Tensor) -> bool:
        return True  # unknown without a read: every pass runs

    def take(self, a: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
        return a[kernels.constant(idx, self.device)]

    def put(self, a: torch.Tensor, idx: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        return a.index_copy(0, kernels.constant(idx, self.device), values.to(a.dtype))

    def assemble(self, n: int, parts: list[tuple[np.ndarray, torch.Tensor]]) -> torch.Tensor:
        out = torch.empty(n, dtype=torch.float64, device=self.device)
        for idx, values in parts:
            if len(idx):
                out.index_copy_(0, kernels.constant(idx, self.device), values.double())
        return out

    def state(self, kept: PerSegment, names: tuple[str, ...]) -> torch.Tensor:
        return kept.on(names, self.device)

    def unseen(self, kept: PerSegment, names: tuple[str, ...]) -> "torch.Tensor | None":
        """The segments ``kept`` holds no value for, from the host's bookkeeping (it cannot look
        for NaN without a read)."""
        if not kept.unseen(names):
            return None
        return kernels.constant(np.array([kept.unseen((n,)) for n in names]), self.device)

    def known_live(self) -> np.ndarray:
        return np.ones(len(self.k_host), dtype=bool)  # which segments are all-zero only the device knows

    # -- statistics -----------------------------------------------------------------------------
    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        s1, s2 = reference.moments(self.flat, self.table)
        return s1 / self._divisor, s2 / self._divisor

    @cached_property
    def _abs(self) -> torch.Tensor:
        return self.flat.abs()

    # -- selection ------------------------------------------------------------------------------
    def rounded(self, thresholds: torch.Tensor) -> torch.Tensor:
        inf = torch.full_like(thresholds, float("inf"))
        return torch.where(self.live, torch.minimum(thresholds, self.max), inf).to(self.flat.dtype)

    def _compare(self, applied: torch.Tensor) -> torch.Tensor:
        """One pass: the selection by ``applied`` (rounded thresholds) and its counts (float64)."""
        self._applied, self._selection = applied, kernels.selection(self.flat, applied, self.table)
        self._counts = self._selection.counts.double()
        return self._counts

    def apply(self, thresholds: torch.Tensor, which: "torch.Tensor | None" = None,
              correction: "Band | Steps | None" = None) -> torch.Tensor:
        thr = self.rounded(thresholds)
        if isinstance(correction, Band):
            applied = self._within_band(thr, correction)
        elif isinstance(correction, Steps):
            applied = self._stepped(thresholds, correction)
        else:
            applied = thr if which is None or self._applied is None else torch.where(which, thr, self._applied)
            return self._compare(applied)
        self.corrected = applied != thr
        return self._counts

    def _within_band(self, applied: torch.Tensor, band: Band) -> torch.Tensor:
        """:meth:`~horovod_safusion.compressors.segmented.NumbaKernels.select_within` for every
        segment: where ``band.lower`` and too few, the threshold lowered along the exponential
        tail up to :data:`LOWERINGS` times; then too many (or, lowered, more than k) trimmed to
        the k-th largest. The thresholds applied in the end."""
        counts = self._compare(applied)
        lowered = torch.zeros_like(band.lower)
        for _ in range(LOWERINGS):
            go = band.lower & (counts < band.low) & (applied > 0)
            down = torch.clamp(applied.double() - band.scale * torch.log(band.k / torch.clamp(counts, min=1.0)),
                               min=0.0)
            applied = torch.where(go, down.to(applied.dtype), applied)
            counts = self._compare(applied)
            lowered = lowered | go
        trim = self.live & ((counts > band.high) | (lowered & (counts > band.k)))
        applied = torch.where(trim, self.kth(trim).to(applied.dtype), applied)
        self._compare(applied)
        return applied

    def _stepped(self, start: torch.Tensor, steps: Steps) -> torch.Tensor:
        """:meth:`~horovod_safusion.compressors.segmented.NumbaKernels.select_stepped` for every
        segment, all ``steps.passes`` passes: a segment in its band keeps its threshold."""
        u = start
        for _ in range(steps.passes):
            counts = self._compare(self.rounded(u))
            # float64, as on the host; filled on the device (a new_tensor is copied over from the host)
            up, down, keep = (torch.full_like(u, f) for f in (steps.up, steps.down, 1.0))
            u = u * torch.where(counts > steps.high, up, torch.where(counts < steps.low, down, keep))
        applied = self.rounded(u)
        self._compare(applied)
        return applied

    def applied(self) -> torch.Tensor:
        return self._applied

    def finish(self, commit: Callable[[torch.Tensor], None] | None = None) -> Proposal:
        """The last comparison as a :class:`Proposal`; ``commit(counts)`` updates the compressor's
        state once the buffer is known to be finite."""
        sel, counts = self._selection, self._counts
        return Proposal(sel.total, self.finite, sel.take, None if commit is None else lambda: commit(counts))

    # -- exact thresholds, estimates and fits ---------------------------------------------------
    @cached_property
    def _kth(self) -> torch.Tensor:
        """Per segment, its ``k``-th largest ``|x|`` (float64, exact; 0 for an empty segment): one
        radix selection for all segments (:func:`~horovod_safusion.kernels.reference.kth_largest`)."""
        return self._kth_largest(self.flat, self.table.seg_ids(), self._k_clamped)

    @cached_property
    def _k_clamped(self) -> np.ndarray:
        return np.minimum(self.k_host, np.maximum(self.segments.size_array, 1))

    def kth(self, mask: torch.Tensor, selected: bool = False) -> torch.Tensor:
        return self._kth

    def _kth_largest(self, values: torch.Tensor, groups: torch.Tensor, ks: np.ndarray) -> torch.Tensor:
        return reference.kth_largest(values, groups, kernels.constant(ks, values.device)).double()

    def kth_largest(self, which: np.ndarray, ks: np.ndarray) -> torch.Tensor:
        """Per segment of ``which``, the ``ks``-th largest ``|x|`` (``ks`` clamped to the size)."""
        ks = np.minimum(ks, np.maximum(self.segments.size_array[which], 1))
        if np.array_equal(ks, self._k_clamped[which]):
            return self.take(self._kth, which)
        full = self._k_clamped.copy()
        full[which] = ks
        if not np.array_equal(full[which], ks):
            raise ValueError("kth_largest: a segment asked for with two different ranks")
        return self.take(self._kth_largest(self.flat, self.table.seg_ids(), full), which)

    def kth_largest_at(self, idx: torch.Tensor, lengths: np.ndarray, ks: np.ndarray) -> torch.Tensor:
        groups = torch.repeat_interleave(torch.arange(len(lengths), device=self.device),
                                         kernels.constant(lengths, self.device), output_size=int(lengths.sum()))
        return self._kth_largest(self.flat[idx], groups, ks)

    def estimates(self, estimate: Callable, mask: torch.Tensor, effort: torch.Tensor, levels: int) -> torch.Tensor:
        """Every segment at every one of ``levels`` efforts, once per view (one call of
        ``estimate``), then each segment's at its ``effort``."""
        if self._table is None:
            n = len(self.k_host)
            self._table = estimate(np.repeat(np.arange(n), levels), np.tile(np.arange(levels), n)).view(n, levels)
        return self._table.gather(1, effort.long()[:, None]).squeeze(1)

    @cached_property
    def _first(self) -> tuple[torch.Tensor, torch.Tensor]:
        _, m, v = self._moments_over(torch.zeros_like(self.max), inclusive=True)
        return m, v

    def abs_moments(self, which: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        m, v = self._first
        return self.take(m, which), self.take(v, which)

    def _moments_over(self, eta: torch.Tensor, inclusive: bool):
        count, s1, s2 = reference.exceedances(self._abs, eta, self.table, inclusive=inclusive)
        n = torch.clamp(count, min=1.0)
        m = s1 / n
        return count, m, torch.clamp(s2 / n - m * m, min=0.0)

    def exceedance_moments(self, which: np.ndarray, eta: torch.Tensor, inclusive: bool = False,
                           where: "torch.Tensor | None" = None):
        """Per entry of ``which`` (segments that may repeat): count, mean and variance of
        ``|x| − eta`` over ``|x| > eta``, every entry (``where`` is the host's to skip): one pass
        over the buffer per layer of entries in which each segment appears once."""
        order = np.argsort(which, kind="stable")
        first = np.searchsorted(which[order], which[order])  # where each segment's run starts
        layer = np.empty(len(which), dtype=np.int64)
        layer[order] = np.arange(len(which)) - first
        out = [torch.zeros(len(which), dtype=torch.float64, device=self.device) for _ in range(3)]
        for j in range(int(layer.max()) + 1 if len(which) else 0):
            at = np.flatnonzero(layer == j)
            full = self.put(torch.zeros_like(self.max), which[at], self.take(eta, at))
            for o, values in zip(out, self._moments_over(full, inclusive)):
                o.index_copy_(0, kernels.constant(at, self.device), self.take(values, which[at]))
        return tuple(out)
