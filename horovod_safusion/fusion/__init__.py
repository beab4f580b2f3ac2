"""Fusion planning: what ``fusion=`` accepts, one module per name, and the cost model they plan
with (SAFusion §4 "Generator module", Figure 12).

Planners see :class:`~horovod_safusion.plan.TensorInfo` records and, if they need one, a
:class:`Profile`; they return a :class:`~horovod_safusion.plan.FusionPlan`. Nothing here runs
a collective or touches the model: measuring the profile is the runtime's job
(:mod:`horovod_safusion.profiling`).

* :mod:`.planner` — the interface and the registry of names;
* :mod:`.safusion`, :mod:`.safusion_inter`, :mod:`.safusion_naive` — SAFusion's planners;
* :mod:`.cupcake`, :mod:`.omgs`, :mod:`.wfbp`, :mod:`.oktopk`, :mod:`.horovod` — the schemes it is
  compared with (:mod:`.degree` holds the fusion-degree axis the last three lie on);
* :mod:`.groups` — Horovod's ``groups=``;
* :mod:`.profile`, :mod:`.costs`, :mod:`.simulator` — measured costs and the pipeline they predict.
"""
from ..plan import FusionPlan, TensorInfo
from .costs import CostCurve
from .cupcake import CupcakePlanner
from .degree import FusionDegreePlanner
from .groups import GroupsPlanner
from .horovod import HorovodPlanner
from .oktopk import OkTopkPlanner
from .omgs import OMGSPlanner
from .planner import Planner, available_planners, make_planner, register_planner
from .profile import Profile
from .safusion import SAFusionPlanner
from .safusion_inter import InterPlanner
from .safusion_naive import NaivePlanner
from .simulator import Schedule, simulate
from .wfbp import WFBPPlanner

__all__ = ["CostCurve", "CupcakePlanner", "FusionDegreePlanner", "FusionPlan", "GroupsPlanner", "HorovodPlanner",
           "InterPlanner", "NaivePlanner", "OMGSPlanner", "OkTopkPlanner", "Planner", "Profile",
           "SAFusionPlanner", "Schedule", "TensorInfo", "WFBPPlanner", "available_planners", "make_planner",
           "register_planner", "simulate"]
