"""Generator: planners that turn tensors (and later, profiles) into fusion plans (SAFusion §4)."""
from .base import Planner, TensorInfo, available_planners, make_planner, register_planner
from .groups import GroupsPlanner
from .naive import NaivePlanner

__all__ = ["GroupsPlanner", "NaivePlanner", "Planner", "TensorInfo", "available_planners",
           "make_planner", "register_planner"]
