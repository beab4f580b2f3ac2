"""``exdyna``: ExDyna's online threshold scaling (Algorithm 5, ExDyna §IV.D).

"Instead of deriving a new threshold using a computation-intensive method for each iteration,
ExDyna focuses on minimizing the density error by scaling the threshold on-the-fly." Each segment
keeps its threshold δ across steps; after a step selected k′ elements against the target k, the
next threshold is ``δ · sf`` with (Algorithm 5, lines 1–8)::

    exam = k′ / k
    sf = 1 + γ       if exam > β
         1 + γ / 4   elif exam > 1 / β
         1 − γ       otherwise

so selection costs one comparison pass and the actual density settles at the target over
iterations. A segment's first threshold is its exact k-th largest magnitude. ExDyna's block
partitioning and partition allocation (Algorithms 2–4) belong to the ``exdyna`` communicator.
"""
from __future__ import annotations

import torch

from .base import register_compressor
from .threshold import SegmentView, ThresholdCompressor, kth_largest


@register_compressor("exdyna")
class ExDyna(ThresholdCompressor):
    """Per-segment thresholds scaled by Algorithm 5 after every step.

    Args:
        density: target fraction of elements per segment.
        beta: β > 1, the band ``(1/β, β]`` of ``k′/k`` in which the threshold is only nudged up.
        gamma: γ in (0, 1), the scaling step. Smaller settles more finely and more slowly.
    """

    def __init__(self, density: float = 0.01, beta: float = 1.1, gamma: float = 0.05) -> None:
        super().__init__(density)
        if beta <= 1.0:
            raise ValueError(f"beta must be > 1, got {beta!r}")
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"gamma must satisfy 0 < gamma < 1, got {gamma!r}")
        self.beta, self.gamma = float(beta), float(gamma)
        self._threshold: dict[str, float] = {}

    def thresholds(self, view: SegmentView, step: int) -> torch.Tensor:
        for s, name in enumerate(view.segments.names):
            if name not in self._threshold:  # δ_0
                self._threshold[name] = float(kth_largest(view.part(s), int(view.k[s])))
        return torch.tensor([self._threshold[n] for n in view.segments.names], device=view.abs.device)

    def refine(self, view, thresholds, counts, step):
        exam = counts.to(torch.float64) / view.k.to(torch.float64)
        sf = torch.where(exam > self.beta, 1 + self.gamma,
                         torch.where(exam > 1 / self.beta, 1 + self.gamma / 4, 1 - self.gamma))
        live = view.max > 0  # an all-zero segment says nothing about its threshold
        nxt = torch.where(live, thresholds.to(torch.float64) * sf, thresholds.to(torch.float64))
        self._threshold.update(zip(view.segments.names, nxt.tolist()))
