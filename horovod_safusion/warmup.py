"""Warm-up training: a higher density for the first iterations (DGC, Lin et al., ICLR'18, §3.3).

Early in training the weights and gradients change fast, and stale residuals hurt most. DGC
therefore starts with a less aggressive sparsity and raises it exponentially over the first four
epochs — densities 25 %, 6.25 %, 1.5625 %, 0.4 %, then the target 0.1 %. :class:`DensityWarmup`
gives the density of every step:

* ``"exponential"``: :data:`STAGES` equal stages over ``steps`` iterations, stage ``s`` at
  ``target^((s + 1) / (STAGES + 1))`` — for a target of 0.001 exactly DGC's schedule (0.251,
  0.063, 0.0158, 0.0040), and the same shape for any other target;
* ``"dense"``: every element sent for ``steps`` iterations (as PyTorch's PowerSGD hook does before
  ``start_powerSGD_iter``).

Densities change in stages, not every step, because compressors reuse thresholds across steps
(SAFusion §4): each change costs one re-estimation. The step count is the controller's, the same
on every rank, so every rank switches at the same step; residuals carry over.
"""
from __future__ import annotations

SCHEDULES = ("exponential", "dense")
STAGES = 4  # DGC's four warm-up epochs


class DensityWarmup:
    """The density of each step of a warm-up of ``steps`` iterations towards ``target``."""

    def __init__(self, steps: int, schedule: str, target: float) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {steps!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"warmup_schedule={schedule!r} is not a schedule; accepted: "
                             f"{', '.join(repr(s) for s in SCHEDULES)}")
        self.steps, self.schedule, self.target = steps, schedule, float(target)

    def active(self, step: int) -> bool:
        """Whether ``step`` (0-based) is still warming up."""
        return step < self.steps

    def density_at(self, step: int) -> float:
        """The density of step ``step`` (0-based)."""
        if not self.active(step) or self.target >= 1.0:
            return self.target
        if self.schedule == "dense":
            return 1.0
        stage = step * STAGES // self.steps
        return self.target ** ((stage + 1) / (STAGES + 1))

    def __repr__(self) -> str:
        return f"DensityWarmup(steps={self.steps}, schedule={self.schedule!r}, target={self.target})"
