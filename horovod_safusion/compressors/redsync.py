"""``redsync``: RedSync's threshold search (Fang et al., JPDC 2019; evaluated by SAFusion §5 Exp. 4).

The threshold of a segment is ``mean + r · (max − mean)`` of ``|x|``; RedSync searches the ratio
``r`` by bisection until the selected count lies in ``[k, 2k]`` ("trimmed top-k"), one pass over the
buffer per bisection step, all segments at once. The ratio found is the next step's starting
point, so steps after the first usually need few passes.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import register_compressor
from .device import DeviceView, Proposal
from .state import PerSegment
from .threshold import SegmentView, ThresholdCompressor


@register_compressor("redsync")
class RedSync(ThresholdCompressor):
    """Bisection on ``r`` in ``mean + r·(max − mean)`` until each segment selects k to 2k elements.

    Args:
        density: target fraction of elements per segment.
        iterations: at most this many bisection passes per step.
    """

    state_fields = ("_ratio",)

    def __init__(self, density: float = 0.01, iterations: int = 8) -> None:
        super().__init__(density)
        self.iterations = int(iterations)
        self._ratio = PerSegment(fill=0.5)

    def thresholds(self, view: SegmentView, step: int) -> np.ndarray:
        self._mean = view.means()
        return self._mean + self._ratio.of(view.segments.names) * (view.max - self._mean)

    def refine(self, view, thresholds, counts, step):
        r, k = self._ratio.of(view.segments.names), view.k
        lo, hi = np.zeros(len(r)), np.ones(len(r))
        for _ in range(self.iterations):
            off = np.flatnonzero(view.live & ((counts < k) | (counts > 2 * k)))
            if not off.size:
                break
            many = counts[off] > 2 * k[off]
            lo[off[many]] = r[off[many]]  # too many: raise the threshold
            hi[off[~many]] = r[off[~many]]  # too few: lower it
            r[off] = (lo[off] + hi[off]) / 2
            view.apply(self._mean + r * (view.max - self._mean), off)
            counts = view.counts()

    def propose_on_device(self, view: DeviceView, step: int) -> Proposal:
        """All ``iterations`` bisection passes (a device cannot stop early without reading the
        counts back), every segment at once; the ratio found is kept once the buffer is finite."""
        names = view.segments.names
        state = self._ratio.on(names, view.flat.device)
        mean, span = view.mean, view.max - view.mean
        r, lo, hi = state.clone(), torch.zeros_like(state), torch.ones_like(state)
        for _ in range(self.iterations):
            counts = view.counts(mean + r * span)
            off = view.live & ((counts < view.k) | (counts > 2 * view.k))
            many = counts > 2 * view.k
            lo, hi = torch.where(off & many, r, lo), torch.where(off & ~many, r, hi)
            r = torch.where(off, (lo + hi) / 2, r)

        def commit(counts: torch.Tensor) -> None:
            state.copy_(r)
            self._ratio.mark(names)

        return view.propose(mean + r * span, commit)
