"""A flat fusion buffer cut into segments, the unit of selection.

SAFusion §3.1 selects per tensor *before* fusion; the traditional scheme selects over the whole
fused buffer (§2.4). Both are one selection over a flat buffer with a per-segment rule: one
segment per tensor for ``ahead``, one segment for the whole buffer for ``behind``. Compressors
therefore see a flat tensor and a :class:`Segments` object, never parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class Segments:
    """Consecutive segments ``[offsets[s], offsets[s] + sizes[s])`` of a flat buffer.

    Attributes:
        names: a stable key per segment (a parameter name under ``ahead``, the buffer's name
            under ``behind``); compressors key per-segment state (e.g. thresholds) by it, so state
            survives a change of plan.
        sizes: element count per segment.
        device: the device of the flat buffer.
        floors: the least density of each segment, or empty: a segment selects at the larger of
            the step's density and its floor (a spread gradient's, :mod:`horovod_safusion.spread`).
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    floors: tuple[float, ...] = ()

    def __len__(self) -> int:
        return len(self.sizes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.sizes:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @cached_property
    def starts(self) -> torch.Tensor:
        """Offsets as an int64 tensor on the buffer's device."""
        return torch.tensor(self.offsets, dtype=torch.int64, device=self.device)

    @cached_property
    def offset_array(self) -> np.ndarray:
        """Offsets as an int64 NumPy array (per-segment arithmetic on the host)."""
        return np.asarray(self.offsets, dtype=np.int64)

    @cached_property
    def size_array(self) -> np.ndarray:
        """Sizes as an int64 NumPy array."""
        return np.asarray(self.sizes, dtype=np.int64)

    def density_array(self, density: float) -> np.ndarray:
        """The density each segment selects at at the step's ``density``: the larger of it and the
        segment's floor (float64 NumPy array; read, do not modify)."""
        cache = self.__dict__.setdefault("_density_array", {})
        if density not in cache:
            at = np.full(len(self.sizes), float(density))
            cache[density] = np.maximum(at, self.floors) if self.floors else at
        return cache[density]

    def k_array(self, density: float) -> np.ndarray:
        """:meth:`k` as an int64 NumPy array (read, do not modify)."""
        cache = self.__dict__.setdefault("_k_array", {})
        if density not in cache:  # np.round, as torch.round, rounds half to even
            cache[density] = np.maximum(np.round(self.size_array * self.density_array(density)), 1).astype(np.int64)
        return cache[density]

    def k(self, density: float) -> torch.Tensor:
        """Target selected count per segment: ``max(1, round(d · size))`` at the segment's density
        ``d`` (:meth:`density_array`), as an int64 tensor."""
        return torch.from_numpy(self.k_array(density))

    def counts(self, indices: torch.Tensor) -> torch.Tensor:
        """Selected elements per segment for buffer-relative ``indices`` (cost ∝ selected, not numel)."""
        owner = torch.searchsorted(self.starts, indices, right=True) - 1
        # not bincount: its output size depends on the largest index, read back on a GPU
        return torch.zeros(len(self.sizes), dtype=torch.int64, device=indices.device).scatter_add_(
            0, owner, torch.ones_like(owner))
