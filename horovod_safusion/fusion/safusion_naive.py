"""``safusion-naive``: sparsification-ahead fusion into fixed-capacity buffers (SAFusion §3.1).

The first design of SAFusion §3.1: every tensor is sparsified on its own and merged into a
*fixed-size* fusion buffer, which is closed and sent when full (Step-2). Capacity is counted in
dense bytes so that every rank, whatever it selects, closes its buffers after the same tensors —
the precondition for pairing buffers across ranks. The profiled planners of §3.2–3.3 improve on
the sizing.
"""
from __future__ import annotations

from typing import Sequence

from ..plan import ORDERS, FusionPlan, TensorInfo, split_at_group_changes, split_by_capacity
from .planner import Planner, register_planner

DEFAULT_CAPACITY_BYTES = 25 * 2**20  # PyTorch DDP's default bucket size


@register_planner("safusion-naive")
class NaivePlanner(Planner):
    """Consecutive tensors (back-propagation order) up to ``capacity_bytes`` dense bytes a buffer.

    Args:
        capacity_bytes: dense bytes per buffer. Smaller buffers start communicating earlier in
            back-propagation (more overlap) but pay the collective's start-up cost more often.
        order: ``"ahead"`` (SAFusion) or ``"behind"`` (select over each whole buffer, the
            traditional scheme) — the same buffers either way, for side-by-side comparisons.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, order: str = "ahead") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.capacity_bytes = int(capacity_bytes)
        self.order = order

    def plan(self, tensors: Sequence[TensorInfo], profile=None) -> FusionPlan:
        names = [t.name for t in tensors]
        buffers = split_by_capacity(names, {t.name: t.nbytes for t in tensors}, self.capacity_bytes)
        buffers = split_at_group_changes(buffers, {t.name: t.group for t in tensors})
        return FusionPlan(buffers, order=self.order, planner=self.name,
                          meta={"capacity_bytes": self.capacity_bytes})

    def __repr__(self) -> str:
        return f"NaivePlanner(capacity_bytes={self.capacity_bytes}, order={self.order!r})"
