"""Planner interface and registry: ``fusion=`` names a planner that emits a :class:`FusionPlan`.

SAFusion §4 "Generator module" (Figure 12): the generator takes the gradient tensors in
back-propagation order and groups them into fusion buffers. Planners see only :class:`~horovod_safusion.plan.TensorInfo`
records (name, size, element size, dtype/device group), never the model, so plans are data that
can be made offline, saved, compared and checked across ranks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

from ..plan import FusionPlan, TensorInfo
from ..registry import Registry
from .profile import Profile


class Planner(ABC):
    """Makes a :class:`FusionPlan` from tensors given in back-propagation order.

    Planners with ``needs_profile = True`` plan from measured costs: the optimizer first runs a
    provisional plan, profiles the job online, and then switches every rank to the planner's plan.
    Planners with ``dense = True`` describe a dense scheme (no compressor).
    """

    name: ClassVar[str] = "?"
    order: ClassVar[str] = "ahead"
    needs_profile: ClassVar[bool] = False
    dense: ClassVar[bool] = False
    #: Whether the planner can plan a sparse compressor's job dense (``DistributedOptimizer(dense=)``,
    #: which the optimizer then sets as :attr:`dense_choice`).
    chooses_dense: ClassVar[bool] = False
    #: Whether the planner chooses the communicator (:attr:`FusionPlan.communicator`) from a
    #: profile that prices several (:attr:`Profile.communicators`, ``communicator="auto"``).
    chooses_communicator: ClassVar[bool] = False
    #: Whether the planner chooses the density (:attr:`FusionPlan.density`) from a profile that
    #: prices several (:attr:`Profile.densities`, ``density="auto"``).
    chooses_density: ClassVar[bool] = False
    #: Whether the planner sizes its buffers without the tensors the job sends whole and prices
    #: those as sent (:meth:`Profile.small`), for which the online profile times the dense allreduce.
    prices_whole: ClassVar[bool] = False
    #: ``"auto"`` (plan dense where the profile prices it faster), ``True`` or ``False``.
    dense_choice: "bool | str" = False
    #: A saved profile to plan from at once, instead of profiling the job online first.
    profile: Profile | None = None

    @property
    def prices_dense(self) -> bool:
        """Whether the online profile must price Horovod's dense allreduce for this planner."""
        return self.dense_choice is not False

    @abstractmethod
    def plan(self, tensors: Sequence[TensorInfo], profile: Profile | None = None) -> FusionPlan:
        """Return a plan holding every tensor exactly once, in the given order.

        ``profile`` (same on every rank) is given to planners that need one; its tensor order is
        the measured back-propagation order and takes precedence over ``tensors``' order.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


PLANNERS: Registry = Registry("fusion", "fusion planners", Planner)
register_planner = PLANNERS.register  # class decorator: ``@register_planner("name")``
available_planners = PLANNERS.names   # names accepted by ``fusion=``


def make_planner(spec: "str | Planner | Any") -> Planner:
    """Resolve ``fusion=``: a registered name or a :class:`Planner` instance."""
    if isinstance(spec, Planner):
        return spec
    return PLANNERS.get(spec)()
