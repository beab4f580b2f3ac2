"""``topk``: exact top-k by magnitude, per segment (Aji & Heafield 2017; SAFusion §2.3).

With one segment per tensor (``ahead``) every tensor keeps ``max(1, round(density·n))`` elements,
which is the guarantee of SAFusion §3.1 that no tensor goes missing. Segments of equal size (common:
a network repeats its layer shapes) are stacked and selected by one batched ``topk`` call.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..segment import Segments
from .base import Compressor, register_compressor


@register_compressor("topk")
class TopK(Compressor):
    """Exact per-segment top-k of ``|x|``; deterministic for inputs without ties."""

    def select(self, flat: torch.Tensor, segments: Segments, step: int) -> torch.Tensor | None:
        if self.density >= 1.0:
            return None
        absx = flat.abs()
        ks = segments.k(self.density).tolist()
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)  # (size, k) -> segments
        for s, (n, k) in enumerate(zip(segments.sizes, ks)):
            groups[(n, k)].append(s)
        parts = []
        for (n, k), members in groups.items():
            starts = torch.tensor([segments.offsets[s] for s in members], device=flat.device)
            rows = absx.unfold(0, n, 1)[starts] if len(members) > 1 else absx[starts[0]:starts[0] + n].unsqueeze(0)
            idx = torch.topk(rows, k, dim=1, sorted=False).indices
            parts.append((idx + starts.unsqueeze(1)).flatten())
        return torch.cat(parts)
