"""``randomk``: k random elements per segment, the same on every rank (Stich et al., NeurIPS'18).

Positions come from a counter-based hash (SplitMix64) of ``(seed, step, segment name, draw)``,
which every rank shares, so all ranks select the same indices in a step; error feedback keeps what
was not sent. Keyed by the segment's name, a tensor's positions do not depend on which fusion
buffer holds it or where, so a new fusion plan (planned from measured, hence varying, timings)
does not change the selection. It is the cheapest
selection (no pass over the values) and the usual lower baseline for magnitude-based compressors.
Positions are drawn uniformly with replacement and duplicates collapse, so a segment sends
``k·(1 − k/2n)`` distinct elements on average — within 0.5 % of ``k`` at density 0.01.

With error feedback a position waits about ``1/density`` steps and then carries all of them at
once. The wrapped SGD's momentum then multiplies that update again. At learning rates tuned for
dense training this diverges. It is the algorithm's nature: memory SGD with random-k needs step
sizes scaled by the density (Stich et al.). Use ``topk`` or ``dgc`` unless the positions must be
the same on every rank (docs/benchmarks.md, "How accurate", has runs of it against ``topk``).
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

from ..kernels import to_device
from ..segment import Segments
from .base import DEFAULT_DENSITY, Compressor, register_compressor


@register_compressor("randomk")
class RandomK(Compressor):
    """Shared-seed uniform positions per segment.

    Args:
        density: target fraction of elements per segment.
        seed: shared by all ranks; the step number is mixed in, so positions change every step.
    """

    def __init__(self, density: float = DEFAULT_DENSITY, seed: int = 0) -> None:
        super().__init__(density)
        self.seed = int(seed)

    def select_at(self, flat: torch.Tensor, segments: Segments, step: int, density: float) -> torch.Tensor:
        ks = np.minimum(segments.k_array(density), segments.size_array)  # an empty segment draws none
        keys = np.array([zlib.crc32(n.encode()) for n in segments.names], dtype=np.uint64)
        owner = np.repeat(np.arange(len(ks)), ks)
        draw = np.arange(len(owner), dtype=np.uint64) - np.repeat(np.cumsum(ks) - ks, ks).astype(np.uint64)
        key = _splitmix64(np.uint64(self.seed & (2**64 - 1)) ^ (np.uint64(step) << np.uint64(32)))
        bits = _splitmix64(_splitmix64(key ^ keys[owner]) ^ draw) >> np.uint64(11)  # 53 random bits
        u = bits.astype(np.float64) * 2.0 ** -53  # uniform in [0, 1), exactly
        pos = np.unique((u * segments.size_array[owner]).astype(np.int64) + segments.offset_array[owner])
        return to_device(pos, flat.device)


def _splitmix64(x: np.ndarray | np.uint64) -> np.ndarray:
    """SplitMix64's finaliser (Steele et al., OOPSLA'14): a bijective mix of 64-bit counters."""
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        x = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
