"""``topk``: exact top-k by magnitude, per segment (Aji & Heafield 2017; SAFusion §2.3).

With one segment per tensor (``ahead``) every tensor keeps ``max(1, round(density·n))`` elements,
which is the guarantee of SAFusion §3.1 that no tensor goes missing. On CPU all segments are
selected in one compiled call by radix selection on the magnitudes' bits — two passes over the
buffer whatever k and the number of segments
(:meth:`~horovod_safusion.compressors.segmented.NumbaKernels.select_top`): per-segment
``torch.topk`` pays a call per tensor, so selecting ahead (one segment per tensor) cost more than
selecting the same elements behind, and NumPy's ``partition`` slows down on the gradients' many
exact zeros (``benchmarks/bench_compressors.py`` times ahead against behind). Other devices and
dtypes use ``torch.topk``, with segments of equal size (common: a network repeats its layer
shapes) stacked into one batched call.
"""
from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

import numpy as np
import torch

from ..kernels import constant
from ..segment import Segments
from .base import DEFAULT_DENSITY, Compressor, register_compressor
from .device import on_host
from .segmented import NumbaKernels
from .segmented import IndexScratch


@lru_cache(maxsize=256)
def _groups(segments: Segments, density: float) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """``(size, k, offsets)`` per group of segments with equal size and k (an empty segment, e.g.
    a parameter with no elements, selects nothing)."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for o, n, k in zip(segments.offsets, segments.sizes, segments.k_array(density).tolist()):
        if n:
            groups[(n, min(k, n))].append(o)
    return tuple((n, k, tuple(offsets)) for (n, k), offsets in groups.items())


@register_compressor("topk")
class TopK(Compressor):
    """Exact per-segment top-k of ``|x|``; deterministic (ties: the lowest indices on CPU)."""

    def __init__(self, density: float = DEFAULT_DENSITY) -> None:
        super().__init__(density)
        self._scratch = IndexScratch()

    def select_at(self, flat: torch.Tensor, segments: Segments, step: int, density: float) -> torch.Tensor:
        if on_host(flat):
            kernels = NumbaKernels(segments.offset_array, segments.size_array)
            return kernels.to_indices(kernels.select_top(flat.numpy(), segments.k_array(density), self._scratch))
        parts = []
        for n, k, offsets in _groups(segments, density):
            if len(offsets) == 1:
                parts.append(torch.topk(flat[offsets[0]:offsets[0] + n].abs(), k, sorted=False).indices + offsets[0])
            else:
                starts = constant(np.asarray(offsets, dtype=np.int64), flat.device)
                idx = torch.topk(flat.unfold(0, n, 1)[starts].abs_(), k, dim=1, sorted=False).indices
                parts.append((idx + starts.unsqueeze(1)).flatten())
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=flat.device)
