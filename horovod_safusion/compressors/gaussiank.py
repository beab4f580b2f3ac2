"""``gaussiank``: threshold from a Gaussian fit of the gradient (Shi et al., 2019, "Understanding
Top-k Sparsification in Distributed Deep Learning"; evaluated by SAFusion §5 Experiment 4).

Gradients are close to normally distributed, so the threshold selecting a fraction ``density`` of
``|x|`` is ``|μ| + σ · Φ⁻¹(1 − density / 2)`` with the segment's mean μ and standard deviation σ —
two reductions instead of a sort. Real gradients have heavier tails than a Gaussian, so the
estimate selects too many or too few; up to ``refine_passes`` corrections multiply a segment's
threshold by ``step_up`` while it selects more than ``4k/3`` and by ``step_down`` while it selects
fewer than ``2k/3`` (the bounds of the reference implementation). The corrections happen in the
selection pass, segment by segment while the segment is in cache
(:meth:`~horovod_safusion.compressors.segmented.NumbaKernels.select_stepped`): a raised threshold
filters the segment's selection, a lowered one compares the segment anew.

Under error feedback this is the algorithm's weak point, not a defect of this code: the buffer
holds gradient *plus residual*, whose distribution drifts far from a Gaussian as residuals build
up and are sent, so the selected count swings far from the target, most at low densities
(``benchmarks/bench_compressors.py`` reports the achieved density on real gradients). Carrying a
tensor's correction from step to step, or more correction passes, overshoots on other tensors.
Use ``dgc`` or ``topk`` where the density must hold.
"""
from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch
from scipy.special import ndtri  # Φ⁻¹ as a bare ufunc, without norm.ppf's per-call argument checking

from .base import DEFAULT_DENSITY, register_compressor
from .device import Proposal
from .segmented import Steps
from .threshold import ThresholdCompressor, View

Array = TypeVar("Array", np.ndarray, torch.Tensor)


def gaussian_threshold(mean: Array, square: Array, score: Array) -> Array:
    """Per segment, ``|μ| + σ · score`` from the means of ``x`` and of ``x²``: float64 NumPy
    arrays on the host path, device tensors on the device path (the operations are the ones both
    have; ``** 0.5`` is a square root in both). ``score`` is :func:`standard_score` of the
    segment's density."""
    sigma = (square - mean * mean).clip(min=0.0) ** 0.5
    return abs(mean) + sigma * score


def standard_score(density: np.ndarray) -> np.ndarray:
    """``Φ⁻¹(1 − density / 2)``: the threshold, in standard deviations, above which a density's
    share of a normal's magnitudes lies. The densities are the step's, one per segment: a
    density warm-up changes them between steps, and a spread gradient's floor raises its own."""
    return ndtri(1.0 - density / 2.0)


@register_compressor("gaussiank")
class GaussianK(ThresholdCompressor):
    """Normal percent-point threshold per segment, refined by count.

    Args:
        density: target fraction of elements per segment.
        refine_passes: corrections after the Gaussian estimate (each one more pass over the buffer).
        step_up, step_down: threshold factors when too many / too few elements were selected.
    """

    def __init__(self, density: float = DEFAULT_DENSITY, refine_passes: int = 3, step_up: float = 1.3,
                 step_down: float = 0.7) -> None:
        super().__init__(density)
        self.refine_passes = int(refine_passes)
        self.step_up, self.step_down = float(step_up), float(step_down)

    @staticmethod
    def band(k: "np.ndarray | torch.Tensor") -> tuple:
        """The counts a segment with target ``k`` may end with: ``[2k/3, 4k/3]``."""
        return 2 * k / 3, 4 * k / 3

    def decide(self, view: View, step: int) -> "torch.Tensor | Proposal":
        """The Gaussian estimate, corrected by steps in the selection pass (on the device view
        every one of ``refine_passes`` passes compares the whole buffer: a device cannot skip the
        segments in band without reading their counts back)."""
        low, high = self.band(view.k)
        score = view.array(standard_score(view.segments.density_array(view.density)))
        view.apply(gaussian_threshold(*view.moments(), score),
                   correction=Steps(low=low, high=high, up=self.step_up, down=self.step_down, passes=self.refine_passes))
        return view.finish()
