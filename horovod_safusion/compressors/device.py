"""The device path of selection: every per-segment decision on the buffer's device, one host read.

On a GPU, each value read back to the host inside a gradient hook stops the CPU from queueing the
rest of back-propagation, which is the overlap SAFusion exists for (§3.1 Step-2, §4). The CPU path
(:class:`~horovod_safusion.compressors.threshold.SegmentView`) decides per segment in NumPy and
compiled loops; here thresholds, counts, statistics and corrections stay device tensors, and the
buffer is read back once, for the count that sizes its collective (:class:`Proposal`).

Where the CPU path takes a data-dependent branch, the device path computes both sides for every
segment and keeps, per segment, the side the host would have taken (``torch.where``), so that it
selects the host path's elements (``tests/unit/test_compressors.py`` holds every threshold
compressor to that): RedSync's bisection and GaussianK's stepping run all their passes, a segment
in its band keeping its threshold; DGC's and SIDCo's corrections (trim, lowering, a new estimate
with more effort) run as the host's, every pass for every segment, with the k-th largest of every
segment and the estimate of every effort taken at once
(:meth:`~horovod_safusion.compressors.threshold.PeriodicThreshold.propose_on_device`). Stopping
early, or skipping a segment, would need the counts on the host. A compressor's state is updated
only after the host read said the buffer was finite (:meth:`Proposal.decide`).

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
    """One flat buffer on the device path: per-segment statistics as float64 device tensors
    (``max``, ``mean`` of ``|x|``, ``live``, target ``k``, the exact ``k``-th largest ``kth``),
    compare-and-count passes, and the final :class:`Proposal`. ``k_host`` is the target count per
    segment as a NumPy array."""

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
        return self.count(self.applied(thresholds))

    def count(self, applied: torch.Tensor) -> torch.Tensor:
        """Per segment, how many elements thresholds already :meth:`applied` select (float64)."""
        return kernels.selection(self.flat, applied, self.table).counts.double()

    @cached_property
    def kth(self) -> torch.Tensor:
        """Per segment, its ``k``-th largest ``|x|`` (float64, exact; 0 for an empty segment): one
        radix selection for all segments (:func:`~horovod_safusion.kernels.reference.kth_largest`),
        the host's :meth:`~horovod_safusion.compressors.threshold.SegmentView.kth_largest`."""
        ks = np.minimum(self.k_host, np.maximum(self.segments.size_array, 1))
        return self.kth_largest_of(self.flat, self.table.seg_ids(), ks)

    def kth_largest_of(self, values: torch.Tensor, groups: torch.Tensor, ks: np.ndarray) -> torch.Tensor:
        """Per group ``g``, the ``ks[g]``-th largest ``|values|`` where ``groups == g`` (float64),
        e.g. of a sample per segment."""
        return reference.kth_largest(values, groups, kernels.constant(ks, values.device)).double()

    def propose(self, thresholds: torch.Tensor, commit: Callable[[torch.Tensor], None] | None = None) -> Proposal:
        """The selection by ``thresholds``; ``commit(counts)`` updates the compressor's state
        (per-segment counts, float64) once the buffer is known to be finite."""
        sel = kernels.selection(self.flat, self.applied(thresholds), self.table)
        done = None if commit is None else (lambda: commit(sel.counts.double()))
        return Proposal(sel.total, self.finite, sel.take, done)
