"""``safusion-inter``: aligned inter-worker gradient fusion (SAFusion §3.2, Figure 8).

Buffers closed at a fixed *size* hold different numbers of sparsified tensors on different
workers, because thresholds estimated by sampling select different counts; a tensor then waits a
whole fusion phase for its peers (Figure 6). Alignment fixes the *number* of tensors instead:
buffer ``i`` holds ``N_i = ⌈L / M⌉`` gradients in back-propagation order (Step-1), the same on every
worker, whatever each selected (Steps 2–4). Example (Figure 8): L = 6, M = 2 gives 3 + 3.
"""
from __future__ import annotations

import math
from typing import Sequence

from ..plan import FusionPlan, TensorInfo, split_at_group_changes
from .planner import Planner, register_planner


@register_planner("safusion-inter")
class InterPlanner(Planner):
    """``M`` buffers of ``⌈L / M⌉`` consecutive gradients each (the last may hold fewer).

    Args:
        num_buffers: M, the number of fusion phases per iteration. More phases start
            communication earlier; each phase pays the collective's start-up cost once.
    """

    def __init__(self, num_buffers: int = 4) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers!r}")
        self.num_buffers = int(num_buffers)

    def plan(self, tensors: Sequence[TensorInfo], profile=None) -> FusionPlan:
        names = profile.names if profile is not None else [t.name for t in tensors]
        per = math.ceil(len(names) / self.num_buffers)
        buffers = [names[i:i + per] for i in range(0, len(names), per)]
        group = {t.name: t.group for t in (profile.tensors if profile is not None else tensors)}
        return FusionPlan(split_at_group_changes(buffers, group), order=self.order, planner=self.name,
                          meta={"num_buffers": self.num_buffers, "per_buffer": per})

    def __repr__(self) -> str:
        return f"InterPlanner(num_buffers={self.num_buffers})"
