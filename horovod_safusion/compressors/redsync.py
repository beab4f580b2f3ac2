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
        self._r = [self._ratio.get(n, 0.5) for n in view.segments.names]
        r = torch.tensor(self._r, dtype=view.max.dtype, device=view.max.device)
        return self._mean + r * (view.max - self._mean)

    def refine(self, view, thresholds, counts, step):
        # Bookkeeping on Python numbers: tiny-tensor operations would cost more than the selection.
        r, k, live = self._r, view.segments.k_list(self.density), (view.max > 0).tolist()
        lo, hi = [0.0] * len(r), [1.0] * len(r)
        for _ in range(self.iterations):
            c = counts.tolist()
            off = [s for s in range(len(c)) if live[s] and not k[s] <= c[s] <= 2 * k[s]]
            if not off:
                break
            for s in off:
                if c[s] > 2 * k[s]:
                    lo[s] = r[s]  # too many: raise the threshold
                else:
                    hi[s] = r[s]  # too few: lower it
                r[s] = (lo[s] + hi[s]) / 2
            ratio = torch.tensor(r, dtype=view.max.dtype, device=view.max.device)
            view.apply(self._mean + ratio * (view.max - self._mean), off)
            counts = view.counts()
        self._ratio.update(zip(view.segments.names, r))
