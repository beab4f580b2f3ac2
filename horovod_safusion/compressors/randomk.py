"""``randomk``: k random elements per segment, the same on every rank (Stich et al., NeurIPS'18).

Positions come from a generator seeded by ``(seed, step)``, which every rank shares, so all ranks
select the same indices in a step; error feedback keeps what was not sent. It is the cheapest
selection (no pass over the values) and the usual lower baseline for magnitude-based compressors.
Positions are drawn uniformly with replacement and duplicates collapse, so a segment sends
``k·(1 − k/2n)`` distinct elements on average — within 0.5 % of ``k`` at density 0.01.
"""
from __future__ import annotations

import torch

from ..segment import Segments
from .base import Compressor, register_compressor


@register_compressor("randomk")
class RandomK(Compressor):
    """Shared-seed uniform positions per segment.

    Args:
        density: target fraction of elements per segment.
        seed: shared by all ranks; the step number is mixed in, so positions change every step.
    """

    def __init__(self, density: float = 0.01, seed: int = 0) -> None:
        super().__init__(density)
        self.seed = int(seed)

    def select(self, flat: torch.Tensor, segments: Segments, step: int) -> torch.Tensor | None:
        if self.density >= 1.0:
            return None
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ks = segments.k(self.density)
        u = torch.rand(int(ks.sum()), generator=gen, dtype=torch.float64)
        sizes = torch.tensor(segments.sizes, dtype=torch.float64)
        owner = torch.repeat_interleave(torch.arange(len(segments)), ks)
        pos = (u * sizes[owner]).to(torch.int64) + torch.tensor(segments.offsets)[owner]
        return torch.unique(pos).to(flat.device)
