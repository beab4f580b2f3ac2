"""``topk``: exact top-k by magnitude, per segment (Aji & Heafield 2017; SAFusion §2.3).

With one segment per tensor (``ahead``) every tensor keeps ``max(1, round(density·n))`` elements,
which is the guarantee of SAFusion §3.1 that no tensor goes missing.
"""
from __future__ import annotations

import torch

from ..segment import Segments
from .base import Compressor, register_compressor


@register_compressor("topk")
class TopK(Compressor):
    """Exact per-segment top-k of ``|x|``; deterministic for inputs without ties."""

    def select(self, flat: torch.Tensor, segments: Segments, step: int) -> torch.Tensor:
        if self.density >= 1.0:
            return None
        absx = flat.abs()
        ks = segments.k(self.density).tolist()
        parts = []
        for off, n, k in zip(segments.offsets, segments.sizes, ks):
            idx = torch.topk(absx[off:off + n], k, sorted=False).indices
            parts.append(idx + off)
        return torch.cat(parts)
