"""Planner interface and registry: ``fusion=`` names a planner that emits a :class:`FusionPlan`.

SAFusion §4 "Generator module" (Figure 12): the generator takes the gradient tensors in
back-propagation order and groups them into fusion buffers. Planners see only :class:`TensorInfo`
records (name, size, element size, dtype/device group), never the model, so plans are data that
can be made offline, saved, compared and checked across ranks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence, TypeVar

from ..plan import FusionPlan

if TYPE_CHECKING:
    from .profile import Profile

_REGISTRY: dict[str, type["Planner"]] = {}
C = TypeVar("C", bound=type)


@dataclass(frozen=True)
class TensorInfo:
    """What a planner knows about one gradient tensor."""

    name: str
    numel: int
    element_size: int
    group: str  # dtype and device: one fusion buffer is one flat tensor, so never mix groups

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


class Planner(ABC):
    """Makes a :class:`FusionPlan` from tensors given in back-propagation order.

    Planners with ``needs_profile = True`` plan from measured costs: the optimizer first runs a
    provisional plan, profiles the job online, and then switches every rank to the planner's plan.
    """

    name: ClassVar[str] = "?"
    order: ClassVar[str] = "ahead"
    needs_profile: ClassVar[bool] = False

    @abstractmethod
    def plan(self, tensors: Sequence[TensorInfo], profile: "Profile | None" = None) -> FusionPlan:
        """Return a plan holding every tensor exactly once, in the given order.

        ``profile`` (same on every rank) is given to planners that need one; its tensor order is
        the measured back-propagation order and takes precedence over ``tensors``' order.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def register_planner(name: str) -> Callable[[C], C]:
    """Class decorator: make a :class:`Planner` selectable as ``fusion=name``."""
    def wrap(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, Planner)):
            raise TypeError(f"@register_planner({name!r}) needs a Planner subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"fusion planner name {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def available_planners() -> list[str]:
    """Names accepted by ``fusion=``."""
    return sorted(_REGISTRY)


def make_planner(spec: "str | Planner | Any") -> Planner:
    """Resolve ``fusion=``: a registered name or a :class:`Planner` instance."""
    if isinstance(spec, Planner):
        return spec
    if not isinstance(spec, str) or spec not in _REGISTRY:
        raise ValueError(f"unknown fusion {spec!r}; known fusion planners: "
                         f"{', '.join(available_planners())} (or pass a Planner instance)")
    return _REGISTRY[spec]()
