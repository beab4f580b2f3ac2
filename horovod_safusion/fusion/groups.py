"""Plans from Horovod's ``groups`` argument, so ``groups=`` keeps its meaning in the drop-in.

``hvd.DistributedOptimizer(groups=...)`` fuses the tensors of one group into one collective. Here a
group becomes one fusion buffer: ``groups=N`` splits the tensors into N buffers of near-equal
tensor count (Horovod's ``split_list``), and a list of tensor lists makes those lists buffers,
every other tensor a buffer of its own.
"""
from __future__ import annotations

from typing import Sequence

from ..plan import FusionPlan, TensorInfo
from .planner import Planner


class GroupsPlanner(Planner):
    """Fusion buffers given explicitly (lists of names) or as a count."""

    name = "groups"

    def __init__(self, groups: "int | Sequence[Sequence[str]]") -> None:
        self.groups = groups

    def plan(self, tensors: Sequence[TensorInfo], profile=None) -> FusionPlan:
        names = [t.name for t in tensors]
        if isinstance(self.groups, int):
            n = min(self.groups, len(names))
            size, extra = divmod(len(names), n)
            buffers, start = [], 0
            for i in range(n):
                stop = start + size + (1 if i < extra else 0)
                buffers.append(names[start:stop])
                start = stop
        else:
            position = {n: i for i, n in enumerate(names)}
            grouped = {n for g in self.groups for n in g if n in position}
            # Each explicit group in back-propagation order of its first-ready member; singletons
            # for the rest, all ordered by readiness so buffers launch as early as possible.
            units = [sorted((n for n in g if n in position), key=position.get) for g in self.groups]
            units = [u for u in units if u] + [[n] for n in names if n not in grouped]
            buffers = sorted(units, key=lambda u: position[u[-1]])
        return FusionPlan(buffers, order=self.order, planner=self.name)
