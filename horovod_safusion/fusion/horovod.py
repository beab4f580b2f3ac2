"""``fusion="horovod"``: Horovod's own dense allreduce, the reference every speed-up is measured
against (SAFusion §5): one collective per tensor, merged by Horovod's Tensor Fusion."""
from __future__ import annotations

from .degree import NamedDegreePlanner
from .planner import register_planner


@register_planner("horovod")
class HorovodPlanner(NamedDegreePlanner):
    """Horovod's dense allreduce: one collective per tensor, fused by Horovod itself.

    ``dense = True``: the optimizer then uses the ``none`` compressor and the ``allreduce``
    communicator, and rejects a sparsifying compressor.
    """

    dense = True
    fixed_degree = 0.0
