"""``fusion="oktopk"``: every tensor in one buffer selected once (fusion degree 100 %), as
SAFusion §6.2 characterises Ok-Topk's global top-k over the flattened gradient."""
from __future__ import annotations

from .degree import NamedDegreePlanner
from .planner import register_planner


@register_planner("oktopk")
class OkTopkPlanner(NamedDegreePlanner):
    """Every tensor in one buffer, selected once over the whole flattened gradient."""

    fixed_degree = 1.0
