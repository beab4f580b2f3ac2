"""``hard``: a hard threshold — every element whose accumulated magnitude reaches a fixed ``λ``
(Sahu et al., "Rethinking gradient sparsification as total error minimization", NeurIPS'21, §3).

Top-k sends a fixed number of elements per step. Under error feedback that budget is what lets
the residual grow: when gradients are large for a while, what does not fit waits, and it leaves
later in bursts. Sahu et al. show that, for the total error over training, a hard threshold is
the better sparsifier under error feedback: it sends whatever reaches ``λ``, so every residual
element stays below ``λ`` at every step, and the volume sent follows the gradients instead of a
budget.

``λ`` here is one number per segment (per tensor under ``ahead``), fixed once: the ``k``-th largest
``|x|`` of the segment the first time it holds a nonzero gradient, at the target density — the
first sparse step sends what top-k would, later steps whatever crosses it. ``density`` is
therefore the density of that first step, not of every step: the fraction sent falls as gradients
shrink during training and rises when they grow. The threshold is clipped to the segment's
maximum as in every threshold compressor, so a tensor with a nonzero gradient sends at least its
largest element each step. ``λ`` is compressor state: it is saved in checkpoints and follows a
parameter into a new fusion plan.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import register_compressor
from .device import DeviceView, Proposal
from .state import PerSegment
from .threshold import SegmentView, ThresholdCompressor


@register_compressor("hard")
class HardThreshold(ThresholdCompressor):
    """``|x| >= λ`` per segment, ``λ`` the ``k``-th largest ``|x|`` of the segment's first nonzero
    gradient (``k = ceil(density · size)``), then fixed.

    Args:
        density: the density ``λ`` is calibrated at.
    """

    state_fields = ("_lambda",)

    def __init__(self, density: float = 0.01) -> None:
        super().__init__(density)
        self._lambda = PerSegment()  # NaN until the segment's first nonzero gradient

    def thresholds(self, view: SegmentView, step: int) -> np.ndarray:
        lam = self._lambda.of(view.segments.names)
        new = np.flatnonzero(np.isnan(lam) & view.live)
        if new.size:
            lam[new] = view.kth_largest(new, view.k[new])
        return lam.copy()  # NaN only where the segment is all zero: it selects nothing

    def propose_on_device(self, view: DeviceView, step: int) -> Proposal:
        """The same on the device: a segment without ``λ`` takes its ``k``-th largest. That is
        computed only while some segment of the layout has never been calibrated; whether all are
        now is read with the selected count, in the buffer's one host read."""
        names = view.segments.names
        lam = self._lambda.on(names, view.flat.device)
        if not self._lambda.unseen(names):
            return view.propose(lam)
        thresholds = torch.where(torch.isnan(lam) & view.live, view.kth, lam)

        def commit(counts: torch.Tensor) -> None:
            lam.copy_(thresholds)
            if proposal.flagged:  # every segment has its λ now
                self._lambda.mark(names)

        proposal = view.propose(thresholds, commit, flag=~torch.isnan(thresholds).any())
        return proposal
