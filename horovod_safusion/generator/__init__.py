"""Generator: profiles, cost curves, the pipeline simulator and the planners (SAFusion §4, Figure 12)."""
from .adaptive import SAFusionPlanner
from .baselines import FusionDegreePlanner, HorovodPlanner, OkTopkPlanner, WFBPPlanner
from .base import Planner, TensorInfo, available_planners, make_planner, register_planner
from .costs import CostCurve
from .cupcake import CupcakePlanner
from .groups import GroupsPlanner
from .inter import InterPlanner
from .naive import NaivePlanner
from .omgs import OMGSPlanner
from .profile import Profile
from .simulator import Schedule, simulate

__all__ = ["CostCurve", "CupcakePlanner", "FusionDegreePlanner", "GroupsPlanner", "HorovodPlanner",
           "InterPlanner", "NaivePlanner", "OMGSPlanner", "OkTopkPlanner", "Planner", "Profile",
           "SAFusionPlanner", "Schedule", "TensorInfo", "WFBPPlanner", "available_planners", "make_planner",
           "register_planner", "simulate"]
