"""``fusion="oktopk"``: every tensor in one buffer selected once (fusion degree 100 %), as
SAFusion §6.2 characterises Ok-Topk's global top-k over the flattened gradient."""
from __future__ import annotations

from .degree import FusionDegreePlanner
from .planner import register_planner


@register_planner("oktopk")
class OkTopkPlanner(FusionDegreePlanner):
    """Every tensor in one buffer, selected once over the whole flattened gradient."""

    def __init__(self) -> None:
        super().__init__(1.0, "behind")

    def __repr__(self) -> str:
        return "OkTopkPlanner()"
