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
iterations. A segment's first threshold is its exact k-th largest magnitude. ExDyna selects with
one threshold over the whole gradient, so its Algorithm 1 (line 14) scales by totals; here every
segment (every tensor under ``ahead``) has a threshold of its own, and each is scaled by its own
``k′/k`` — with one segment per buffer (``behind``) that is the paper's rule. (Scaled together by
the buffer's totals, thresholds drifted apart unseen: the buffer's total stayed on target while
its largest tensor sent almost nothing and its small ones many times their share.)

With ``relative=True`` (the default, our addition) δ is kept in units of the segment's current mean
magnitude: the threshold applied is ``δ · mean|x|``. The gradient's scale changes from one
mini-batch to the next far faster than a 5 % step per iteration can follow — on small batches the
actual density then swings by an order of magnitude around the target — while its shape, which is
what δ has to learn, changes slowly. ``relative=False`` is the paper's absolute threshold.
ExDyna's block partitioning and partition allocation (Algorithms 2–4) belong to the ``exdyna``
communicator. Paired with it (:meth:`ExDyna.scaled_globally`), the compressor stops scaling from
its own count: ExDyna's k′ is the number selected by *all* workers in their exclusive partitions
(Alg. 1 lines 11–15), which only the synchronisation sees; it comes back through
:meth:`ExDyna.feedback`, and Algorithm 5 scales the thresholds of the selection it reports on.
"""
from __future__ import annotations

import numpy as np
import torch

from ..segment import Segments
from .base import DEFAULT_DENSITY, register_compressor
from .device import Proposal
from .state import PerSegment
from .threshold import ThresholdCompressor, View


@register_compressor("exdyna")
class ExDyna(ThresholdCompressor):
    """Per-segment thresholds scaled by Algorithm 5 after every step.

    Args:
        density: target fraction of elements per segment.
        beta: β > 1, the band ``(1/β, β]`` of ``k′/k`` in which the threshold is only nudged up.
        gamma: γ in (0, 1), the scaling step. Smaller settles more finely and more slowly. The
            paper gives no value, only that the threshold must be "fine-tuned"; with error feedback
            a coarse step feeds back on itself (a threshold raised after an overshoot leaves more in
            the residuals, which overshoot again), so a coarse γ overshoots the per-tensor target
            counts and a fine one settles close to them (``benchmarks/bench_compressors.py``
            reports the density each achieves on real gradients).
        relative: keep δ in units of the segment's mean magnitude (see above).
    """

    state_fields = ("_threshold",)
    #: ExDyna runs classic error feedback (its paper's); under ``momentum_correction="auto"`` it
    #: stays so. Its threshold follows the counts the residual produces from step to step, and an
    #: element held back by the exclusive partitions is released in a burst that an unmasked
    #: momentum carries on (docs/benchmarks.md, "The early lag").
    auto_momentum_correction = False

    def __init__(self, density: float = DEFAULT_DENSITY, beta: float = 1.1, gamma: float = 0.01,
                 relative: bool = True) -> None:
        super().__init__(density)
        if beta <= 1.0:
            raise ValueError(f"beta must be > 1, got {beta!r}")
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"gamma must satisfy 0 < gamma < 1, got {gamma!r}")
        self.beta, self.gamma, self.relative = float(beta), float(gamma), bool(relative)
        self._threshold = PerSegment()  # δ per segment (relative to mean|x| if relative)
        self._global = False
        # scaled globally: per selection layout, (names of the segments its selection scales, target k)
        self._selected: dict[tuple[str, ...], tuple[tuple[str, ...], int]] = {}

    def scaled_globally(self) -> None:
        """Scale by the job's k′ (the ``exdyna`` communicator's :attr:`Pending.feedback`) rather
        than by this worker's own count: :meth:`feedback` applies Algorithm 5 after each step."""
        self._global = True

    def feedback(self, segments: Segments, feedback: int) -> None:
        """Algorithm 5 with ``exam = k′ / k`` (``feedback`` = k′) on the thresholds of the
        segments the last selection of ``segments`` scaled, against its target k."""
        selected = self._selected.pop(segments.names, None)
        if selected is None:
            return
        names, target = selected
        sf = float(self._factor(feedback / max(1, target)))
        for n in names:
            self._threshold[n] *= sf

    def _factor(self, exam: "float | np.ndarray | torch.Tensor") -> "np.ndarray | torch.Tensor":
        """Algorithm 5's scaling factor for ``exam = k′/k`` (a number, or one per segment, as a
        NumPy array or a device tensor)."""
        factors = 1 + self.gamma, 1 + self.gamma / 4, 1 - self.gamma
        if isinstance(exam, torch.Tensor):  # in exam's dtype: a scalar pair would give float32
            up, nudge, down = (torch.full_like(exam, f) for f in factors)  # filled there, not copied over
            return torch.where(exam > self.beta, up, torch.where(exam > 1 / self.beta, nudge, down))
        up, nudge, down = factors
        return np.where(exam > self.beta, up, np.where(exam > 1 / self.beta, nudge, down))

    def decide(self, view: View, step: int) -> "torch.Tensor | Proposal":
        """δ per segment — a segment never seen starts from its exact k-th largest — applied once,
        and scaled by Algorithm 5 from its own count, or (scaled globally) left for
        :meth:`feedback` to scale the live segments (which are all-zero only the host path knows:
        the device path hands every segment to it)."""
        names = view.segments.names
        state = view.state(self._threshold, names)
        unit = view.unit if self.relative else view.full(len(names), 1.0)
        delta, new = state, view.unseen(self._threshold, names)
        if new is not None:  # δ_0: the exact k-th largest
            delta = view.where(new, view.kth(new) / unit, delta)
        view.apply(delta * unit)

        def commit(counts) -> None:
            if self._global:
                live = view.known_live()
                self._selected[names] = (tuple(n for n, alive in zip(names, live.tolist()) if alive),
                                         int(view.k_host[live].sum()))
                state[:] = delta
            else:  # k'/k per segment (Alg. 5 per threshold); an all-zero segment says nothing
                state[:] = view.where(view.live, delta * self._factor(counts / view.k.clip(min=1)), delta)
            self._threshold.mark(names)

        return view.finish(commit)
