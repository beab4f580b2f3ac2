"""Piecewise-linear cost curves fitted with ``scipy.interpolate.interp1d`` (SAFusion §4).

"The communication and compression time are fitted based on the piecewise interp1d function."
A :class:`CostCurve` maps a size in bytes to seconds. Measurements are noisy, so repeated sizes are
reduced to their median and the curve is made monotone (a running maximum: sending or compressing
more never costs less); beyond the measured range it extrapolates linearly from the nearest
segment, so a tensor larger than any profiled one never raises, and it never returns a negative time.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.interpolate import interp1d


class CostCurve:
    """Monotone piecewise-linear time(bytes) through measured ``(sizes, seconds)`` samples."""

    def __init__(self, sizes: Sequence[float], seconds: Sequence[float]) -> None:
        x = np.asarray(sizes, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        if x.shape != y.shape or x.size == 0:
            raise ValueError(f"a cost curve needs equally many sizes and times, got {x.size} and {y.size}")
        if np.any(~np.isfinite(x)) or np.any(~np.isfinite(y)) or np.any(x < 0) or np.any(y < 0):
            raise ValueError("cost-curve samples must be finite and non-negative")
        ux = np.unique(x)
        uy = np.array([np.median(y[x == v]) for v in ux])
        self.sizes = ux
        self.seconds = np.maximum.accumulate(uy)
        if ux.size == 1:  # a single size: a constant
            self._f = lambda v: np.full_like(np.asarray(v, dtype=np.float64), self.seconds[0])
        else:
            self._f = interp1d(self.sizes, self.seconds, kind="linear", fill_value="extrapolate",
                               assume_sorted=True)

    def __call__(self, nbytes):
        """Seconds for ``nbytes`` (scalar or array)."""
        out = np.maximum(self._f(np.asarray(nbytes, dtype=np.float64)), 0.0)
        return float(out) if np.ndim(out) == 0 else out

    def to_dict(self) -> dict:
        return {"sizes": self.sizes.tolist(), "seconds": self.seconds.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(d["sizes"], d["seconds"])

    @classmethod
    def alpha_beta(cls, latency: float, bandwidth: float, max_bytes: float = 2**30) -> "CostCurve":
        """The α–β model ``latency + bytes / bandwidth`` as a curve, for what-if planning."""
        return cls([0.0, max_bytes], [latency, latency + max_bytes / bandwidth])

    def __repr__(self) -> str:
        return f"CostCurve({self.sizes.size} points, {self.sizes[0]:.0f}..{self.sizes[-1]:.0f} B)"
