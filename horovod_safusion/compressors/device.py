"""The device path of selection: every per-segment decision on the buffer's device, one host read.

On a GPU, each value read back to the host inside a gradient hook stops the CPU from queueing the
rest of back-propagation, which is the overlap SAFusion exists for (§3.1 Step-2, §4). The CPU path
(:class:`~horovod_safusion.compressors.threshold.SegmentView`) decides per segment in NumPy and
compiled loops; here thresholds, counts, statistics and corrections stay device tensors, and the
buffer is read back once, for the count that sizes its collective (:class:`Proposal`).

Where the CPU path takes a data-dependent branch, the device path takes it on the device:

* a count outside a compressor's band is corrected by a fixed number of compare-and-count passes
  (:meth:`DeviceView.corrected`: a step along the segment's exponential tail, then secants in
  log-count inside the bracket the counts proved) — DGC's hierarchical selection and SIDCo's
  effort escalation become these passes; RedSync's bisection and GaussianK's stepping run all
  their passes, since stopping early would need the counts on the host;
* periodic re-estimation happens for all segments on the steps the host can name (every
  ``interval`` steps, or for segments it has not seen), not when a segment's estimate went stale;
* a compressor's state is updated only after the host read said the buffer was finite.

``HOROVOD_SAFUSION_DEVICE_PATH=1`` sends CPU buffers down this path too (tests, benchmarks).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np
import torch

from .. import kernels
from ..segment import Segments


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

    def read(self) -> tuple[int, bool]:
        """``(total, finite)`` — the one host synchronisation of the buffer."""
        if isinstance(self.total, int):
            return self.total, bool(self.finite)
        total, finite = torch.stack([self.total, self.finite.to(torch.int64)]).tolist()
        return int(total), bool(finite)


def _acc(flat: torch.Tensor) -> torch.dtype:
    return torch.float32 if flat.element_size() < 4 else flat.dtype


class DeviceView:
    """One flat buffer on the device path: per-segment statistics as float64 device tensors
    (``max``, ``mean`` of ``|x|``, ``live``, target ``k``), compare-and-count passes, and the final
    :class:`Proposal`. ``k_host`` is the target count per segment as a NumPy array."""

    def __init__(self, flat: torch.Tensor, segments: Segments, density: float,
                 stats: "SegmentStats | None" = None) -> None:
        self.flat, self.segments, self.density = flat, segments, density
        self.table = kernels.block_table(segments, flat.device)
        if stats is None:
            self.max, sums, self.finite = kernels.segment_stats(flat, self.table)
        else:  # taken while the buffer was filled
            self.max, sums, self.finite = stats.max, stats.sum, stats.finite.all()
        self.sizes = _sizes(segments, flat.device)
        self.mean = sums / self.sizes
        self.unit = torch.clamp(self.mean, min=float(np.finfo(np.float64).tiny))
        self.live = self.max > 0
        self.k = _k(segments, density, flat.device)
        self.k_host = segments.k_array(density)

    def applied(self, thresholds: torch.Tensor) -> torch.Tensor:
        """Thresholds as compared: clipped to the segment's maximum (every live segment keeps an
        element), infinite for an all-zero segment, in the buffer's dtype."""
        inf = torch.full_like(thresholds, float("inf"))
        return torch.where(self.live, torch.minimum(thresholds, self.max), inf).to(self.flat.dtype)

    def counts(self, thresholds: torch.Tensor) -> torch.Tensor:
        """Per segment, how many elements ``thresholds`` select (float64): one pass."""
        return kernels.selection(self.flat, self.applied(thresholds), self.table).counts.double()

    def corrected(self, thresholds: torch.Tensor, low: torch.Tensor, high: torch.Tensor, passes: int) -> torch.Tensor:
        """``thresholds`` after ``passes`` compare-and-count passes that move each live segment whose
        count left ``[low, high]`` towards ``k``. ``ln(count)`` is taken as linear in the threshold
        near it: the first move follows an exponential tail of the segment
        (``count ∝ exp(−τ / mean|x|)``), later ones the secant through the last two counts, kept
        inside the bracket the counts so far have proved (a secant outside it bisects instead).
        The exponential tail alone overshoots on real gradients, whose tails are lighter: its moves
        alternated between selecting 1 % and 100 % of a segment."""
        lo, hi = torch.zeros_like(thresholds), torch.full_like(thresholds, float("inf"))
        target = torch.log(self.k)
        thr, prev = thresholds, None
        for _ in range(passes):
            counts = self.counts(thr)
            off = self.live & ((counts > high) | (counts < low))
            many = counts > high
            lo, hi = torch.where(off & many, torch.maximum(lo, thr), lo), torch.where(off & ~many, torch.minimum(hi, thr), hi)
            log_count = torch.log(torch.clamp(counts, min=0.5))
            slope = -1.0 / self.unit
            if prev is not None:
                secant = (log_count - prev[1]) / (thr - prev[0])
                slope = torch.where(torch.isfinite(secant) & (secant < 0), secant, slope)
            step = thr + (target - log_count) / slope
            inside = (step > lo) & (step < hi)
            bisect = torch.where(torch.isinf(hi), 2 * torch.maximum(thr, lo), (lo + hi) / 2)
            prev = (thr, log_count)
            thr = torch.where(off, torch.where(inside, step, bisect), thr)
        return thr

    def kth_largest(self, ks: np.ndarray, positions: "torch.Tensor | None" = None,
                    lengths: "np.ndarray | None" = None) -> torch.Tensor:
        """Per segment, the ``ks[s]``-th largest ``|x|`` (float64): of the whole segment, or of
        the elements at ``positions`` (buffer indices, in consecutive runs of ``lengths[s]``,
        e.g. a sample). A call per segment, with k known on the host: nothing is read back."""
        if positions is None:
            starts, lengths = self.segments.offset_array, self.segments.size_array
            values = self.flat
        else:
            starts = np.cumsum(lengths) - lengths
            values = self.flat[positions.to(self.flat.device)]
        out = []
        for o, n, k in zip(starts.tolist(), lengths.tolist(), ks.tolist()):
            run = values[o:o + n].abs()
            out.append(torch.topk(run, min(max(k, 1), n), sorted=False).values.min() if n else run.new_zeros(()))
        return torch.stack(out).double() if out else self.max.new_zeros(0)

    def propose(self, thresholds: torch.Tensor, commit: Callable[[torch.Tensor], None] | None = None) -> Proposal:
        """The selection by ``thresholds``; ``commit(counts)`` updates the compressor's state
        (per-segment counts, float64) once the buffer is known to be finite."""
        sel = kernels.selection(self.flat, self.applied(thresholds), self.table)
        done = None if commit is None else (lambda: commit(sel.counts.double()))
        return Proposal(sel.total, self.finite, sel.take, done)
