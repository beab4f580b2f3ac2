"""``dgc``: sampled-threshold sparsification of Deep Gradient Compression (Lin et al., ICLR'18).

The threshold of a segment is the ``(1 − density)`` quantile of ``|x|`` estimated from a random
sample of ``sample_rate`` (0.1–1 %) of its elements, then refined from the count it selects: if
far above the target ``k``, the threshold becomes the k-th largest among the candidates (DGC's
hierarchical selection); if far below, the sample is doubled and the estimate repeated. As SAFusion
§4 says, the gradient distribution changes slowly, so thresholds are re-estimated only every
``interval`` steps and reused in between; between estimations one pass over the flat buffer
applies all segment thresholds at once, and a threshold that drifted is re-estimated at once
(:class:`~horovod_safusion.compressors.threshold.PeriodicThreshold`). Samples are drawn by a
counter-based hash (:func:`sample_positions`), so that a resumed job and the device path draw
exactly what the host path draws.
"""
from __future__ import annotations

import zlib
from functools import lru_cache
from typing import TypeVar

import numpy as np
import torch

from ..kernels import constant
from .base import DEFAULT_DENSITY, register_compressor
from .threshold import PeriodicThreshold, View


#: A segment whose sample would exceed 1/EXACT_SHARE of it takes its exact k-th largest instead.
EXACT_SHARE = 16

_M32 = 0xFFFFFFFF
Ints = TypeVar("Ints", np.ndarray, torch.Tensor)


def _mix(h: Ints) -> Ints:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 NumPy arrays or tensors holding
    values below 2^32; the multipliers are below 2^31, so no product leaves int64."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x27D4EB2F) & _M32
    return h ^ (h >> 16)


@lru_cache(maxsize=256)
def _keys(names: tuple[str, ...]) -> np.ndarray:
    """A stable 32-bit key per segment name (CRC-32: Python's ``hash`` of a string changes from
    process to process)."""
    return np.array([zlib.crc32(n.encode()) for n in names], dtype=np.int64)


def _per_draw(values: Ints, counts: np.ndarray, device: torch.device | None) -> Ints:
    """``values[g]`` repeated ``counts[g]`` times: a NumPy array, or a tensor on ``device``
    (sized on the host: nothing is read back; ``values`` a tensor there, or a host array that
    stays the same from step to step)."""
    if device is None:
        return np.repeat(values, counts)
    if isinstance(values, np.ndarray):
        values = constant(values, device)
    return torch.repeat_interleave(values, constant(counts, device), output_size=int(counts.sum()))


def sample_positions(seed: int, step: int, keys: np.ndarray, efforts: np.ndarray, offsets: np.ndarray,
                     sizes: np.ndarray, counts: np.ndarray, device: torch.device | None = None) -> Ints:
    """Buffer positions of ``counts[g]`` draws, uniform with replacement, in the run of
    ``sizes[g]`` elements at ``offsets[g]``, for every group ``g`` (a segment at an effort),
    concatenated by group (int64: a NumPy array on the host, a tensor on ``device``).
    Counter-based: draw ``j`` of a group is a hash of ``(seed, step, keys[g], efforts[g], j)``, so
    a segment's sample does not depend on which other segments are sampled with it — the host
    samples the segments it must estimate, the device every segment at every effort, and both
    draw the same positions. On the device, only the step's hash is new from step to step: the
    groups' arrays are :func:`~horovod_safusion.kernels.constant`, copied once."""
    base = int(_mix(np.int64((seed * 0x9E3779B1 + step) & _M32)))
    if device is not None:
        keys, efforts = constant(keys, device), constant(np.asarray(efforts, dtype=np.int64), device)
    salt = _mix((_mix(keys ^ base) + efforts * 0x85EBCA77) & _M32)
    total = int(counts.sum())
    ordinal = np.arange(total) if device is None else torch.arange(total, device=device)
    j = ordinal - _per_draw(np.cumsum(counts) - counts, counts, device)  # the draw's number in its group
    h = _mix((_per_draw(salt, counts, device) + j * 0x9E3779B9) & _M32)
    u = h.astype(np.float64) if device is None else h.double()  # torch would promote to float32
    within = u * (1.0 / 2 ** 32) * _per_draw(sizes, counts, device)
    within = within.astype(np.int64) if device is None else within.long()
    return _per_draw(offsets, counts, device) + within


@register_compressor("dgc")
class DGC(PeriodicThreshold):
    """Sampled threshold per segment, re-estimated every ``interval`` steps or on drift.

    Args:
        density: target fraction of elements per segment.
        sample_rate: fraction of a segment sampled to estimate its threshold (DGC uses
            0.001–0.01). Larger is more accurate and slower.
        min_samples: the fewest samples per segment; a segment whose sample would be more than
            1/16 of it is thresholded exactly (sampling buys nothing).
        interval: steps between threshold estimations; 1 estimates every step. Larger is cheaper
            but lets the actual density drift while residuals grow.
        drift: a threshold whose count leaves ``[k / drift − 1, drift · (k + 1)]`` is corrected at once
            (hierarchical selection above, a doubled sample below).
        refine_passes: at most this many corrections per step.
        seed: seed of the sampling (:func:`sample_positions`; only counts depend on it, never
            correctness).
    """

    def __init__(self, density: float = DEFAULT_DENSITY, sample_rate: float = 0.01, min_samples: int = 1024,
                 interval: int = 10, drift: float = 2.0, refine_passes: int = 3, seed: int = 0) -> None:
        super().__init__(density, interval, drift, refine_passes)
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must satisfy 0 < sample_rate <= 1, got {sample_rate!r}")
        self.sample_rate = sample_rate
        self.min_samples = int(min_samples)
        self.seed = int(seed)

    max_effort = 6  # a sample up to 64 times larger

    def samples(self, sizes: np.ndarray, effort: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per segment of ``sizes`` at ``effort`` (arrays that broadcast): the sample's size,
        doubled per effort, and whether the segment is thresholded exactly instead — where the
        sample would hold more than 1/:data:`EXACT_SHARE` of it: the exact k-th largest (radix
        selection, a few passes over the segment and no copy) then costs about what sampling does,
        and a sample of a large tensor would take several times the tensor's memory (a position
        and a value per draw)."""
        m = np.minimum(sizes, np.maximum(np.ceil(self.sample_rate * sizes).astype(np.int64),
                                         self.min_samples) << effort)
        return m, m * EXACT_SHARE >= sizes

    def estimate(self, view: View, which: np.ndarray, ks: np.ndarray, effort: np.ndarray,
                 step: int) -> "np.ndarray | torch.Tensor":
        """Per entry, the ``(1 − density)`` quantile of a sample of its segment's ``|x|``
        (:meth:`samples`, :func:`sample_positions`), or its exact k-th largest; the samples of all
        entries are drawn at once and their quantiles taken in one radix selection (on the
        device view every segment at every effort: about an eighth of the buffer in all, as a
        sample that reaches 1/16 of its segment is exact)."""
        n = view.segments.size_array[which]
        m, exact = self.samples(n, effort)
        e, s = np.flatnonzero(exact), np.flatnonzero(~exact)
        parts = [(e, view.kth_largest(which[e], ks[e]))]
        if s.size:
            seg, ms = which[s], m[s]
            idx = sample_positions(self.seed, step, _keys(view.segments.names)[seg], effort[s],
                                   view.segments.offset_array[seg], n[s], ms, view.device)
            density = view.segments.density_array(view.density)[seg]
            parts.append((s, view.kth_largest_at(idx, ms, np.ceil(density * ms).astype(np.int64))))
        return view.assemble(len(which), parts)
