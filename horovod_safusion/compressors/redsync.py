"""``redsync``: RedSync's threshold search (Fang et al., JPDC 2019; evaluated by SAFusion §5 Exp. 4).

The threshold of a segment is ``mean + r · (max − mean)`` of ``|x|``; RedSync searches the ratio
``r`` by bisection until the selected count lies in ``[k, 2k]`` ("trimmed top-k"), one pass over the
buffer per bisection step, all segments at once. The ratio found is the next step's starting
point, so steps after the first usually need few passes.
"""
from __future__ import annotations

import torch

from .base import register_compressor
from .threshold import SegmentView, ThresholdCompressor


@register_compressor("redsync")
class RedSync(ThresholdCompressor):
    """Bisection on ``r`` in ``mean + r·(max − mean)`` until each segment selects k to 2k elements.

    Args:
        density: target fraction of elements per segment.
        iterations: at most this many bisection passes per step.
    """

    def __init__(self, density: float = 0.01, iterations: int = 8) -> None:
        super().__init__(density)
        self.iterations = int(iterations)
        self._ratio: dict[str, float] = {}

    def thresholds(self, view: SegmentView, step: int) -> torch.Tensor:
        self._mean = view.means().to(view.max.dtype)
        r = torch.tensor([self._ratio.get(n, 0.5) for n in view.segments.names], dtype=view.max.dtype,
                         device=view.max.device)
        self._r = r
        return self._mean + r * (view.max - self._mean)

    def refine(self, view, thresholds, counts, step):
        r = self._r
        lo, hi = torch.zeros_like(r), torch.ones_like(r)
        k = view.k
        for _ in range(self.iterations):
            many, few = counts > 2 * k, counts < k
            off = torch.nonzero((many | few) & (view.max > 0)).flatten().tolist()
            if not off:
                break
            lo = torch.where(many, r, lo)   # too many: raise the threshold
            hi = torch.where(few, r, hi)    # too few: lower it
            r = torch.where(many | few, (lo + hi) / 2, r)
            view.apply(self._mean + r * (view.max - self._mean), off)
            counts = view.counts()
        self._ratio.update(zip(view.segments.names, r.tolist()))
