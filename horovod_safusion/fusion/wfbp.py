"""``fusion="wfbp"``: wait-free back-propagation, one buffer per tensor (fusion degree 0 %,
SAFusion §2.4); each buffer is sent as soon as its gradient is ready."""
from __future__ import annotations

from .degree import NamedDegreePlanner
from .planner import register_planner


@register_planner("wfbp")
class WFBPPlanner(NamedDegreePlanner):
    """One buffer per tensor: layer-wise communication, wait-free back-propagation."""

    fixed_degree = 0.0
