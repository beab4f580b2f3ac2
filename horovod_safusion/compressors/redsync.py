"""``redsync``: RedSync's threshold search (Fang et al., JPDC 2019; evaluated by SAFusion §5 Exp. 4).

The threshold of a segment is ``mean + r · (max − mean)`` of ``|x|``; RedSync searches the ratio
``r`` by bisection until the selected count lies in ``[k, 2k]`` ("trimmed top-k"), one pass over the
buffer per bisection step, all segments at once. The ratio found is the next step's starting
point, so steps after the first usually need few passes.
"""
from __future__ import annotations

import torch

from .base import DEFAULT_DENSITY, register_compressor
from .device import Proposal
from .state import PerSegment
from .threshold import ThresholdCompressor, View


@register_compressor("redsync")
class RedSync(ThresholdCompressor):
    """Bisection on ``r`` in ``mean + r·(max − mean)`` until each segment selects k to 2k elements.

    Args:
        density: target fraction of elements per segment.
        iterations: at most this many bisection passes per step.
    """

    state_fields = ("_ratio",)

    def __init__(self, density: float = DEFAULT_DENSITY, iterations: int = 8) -> None:
        super().__init__(density)
        self.iterations = int(iterations)
        self._ratio = PerSegment(fill=0.5)

    def decide(self, view: View, step: int) -> "torch.Tensor | Proposal":
        """Bisection from the last ratio, every segment at once (on the device view all
        ``iterations`` passes run: it cannot stop early without reading the counts back); the
        ratio found is kept."""
        names, k = view.segments.names, view.k
        state = view.state(self._ratio, names)
        mean, span = view.mean, view.max - view.mean
        r, lo, hi = state, view.full(len(names), 0.0), view.full(len(names), 1.0)
        counts = view.apply(mean + r * span)
        for _ in range(self.iterations):
            off = view.live & ((counts < k) | (counts > 2 * k))
            if not view.any(off):
                break
            many = counts > 2 * k
            lo, hi = view.where(off & many, r, lo), view.where(off & ~many, r, hi)  # too many: raise it
            r = view.where(off, (lo + hi) / 2, r)
            counts = view.apply(mean + r * span, off)

        def commit(_) -> None:
            state[:] = r
            self._ratio.mark(names)

        return view.finish(commit)
