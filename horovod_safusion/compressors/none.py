"""``none``: keep every element (the uncompressed baseline of SAFusion §5)."""
from __future__ import annotations

import torch

from ..segment import Segments
from .base import Compressor, register_compressor


@register_compressor("none")
class NoneCompressor(Compressor):
    """Sends every element; the controller then uses a dense allreduce by default.

    ``density`` is accepted for a uniform signature and must be 1.0.
    """

    dense = True

    def __init__(self, density: float = 1.0) -> None:
        super().__init__(density)
        if self.density != 1.0:
            raise ValueError(f"compressor 'none' sends every element, so density={density!r} cannot "
                             "apply; leave density unset or 1.0, or choose a sparsifying compressor")

    def select_at(self, flat: torch.Tensor, segments: Segments, step: int, density: float) -> None:
        return None
