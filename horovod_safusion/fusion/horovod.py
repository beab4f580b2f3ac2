"""``fusion="horovod"``: Horovod's own dense allreduce, the reference every speed-up is measured
against (SAFusion §5): one collective per tensor, merged by Horovod's Tensor Fusion."""
from __future__ import annotations

from .degree import FusionDegreePlanner
from .planner import register_planner


@register_planner("horovod")
class HorovodPlanner(FusionDegreePlanner):
    """Horovod's dense allreduce: one collective per tensor, fused by Horovod itself.

    ``dense = True``: the optimizer then uses the ``none`` compressor and the ``allreduce``
    communicator, and rejects a sparsifying compressor.
    """

    dense = True

    def __init__(self) -> None:
        super().__init__(0.0, "behind")

    def __repr__(self) -> str:
        return "HorovodPlanner()"
