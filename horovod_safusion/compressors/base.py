"""Compressor interface and registry (SAFusion §4, "Sparsification compression module").

A compressor decides *which* elements of a flat fusion buffer travel; it never communicates and
never keeps error-feedback memory (that is :mod:`horovod_safusion.residual`), following GRACE's
split into Compressor / Memory / Communicator. New compressors register by decorator::

    @register_compressor("mine")
    class Mine(Compressor):
        def select_at(self, flat, segments, step, density): ...
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from ..checkpoint import Stateful
from ..density import DEFAULT as DEFAULT_DENSITY
from ..registry import Registry
from ..segment import Segments

if TYPE_CHECKING:  # for annotations only: propose() imports them when it runs
    from .device import Proposal, SegmentStats


def check_density(density: float) -> float:
    """Return ``density`` as a float if ``0 < density <= 1``, else raise a clear ``ValueError``."""
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ValueError(f"density must be a number with 0 < density <= 1, got {density!r}")
    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density must satisfy 0 < density <= 1, got {density!r}")
    return float(density)


class Compressor(Stateful, ABC):
    """Selects elements of a flat buffer, per segment.

    Attributes:
        density: the configured fraction of elements selected per segment (0 < density <= 1);
            the runtime passes each step's density (a warm-up's may be higher) to :meth:`select`
            and :meth:`propose`, and nobody writes this one.
        dense: ``True`` for compressors that always keep every element; the controller then
            skips selection and the default communicator becomes a dense allreduce.
        auto_momentum_correction: whether ``momentum_correction="auto"`` takes over an SGD's
            momentum under this compressor (DGC §3.2, without masking); ``False`` keeps classic
            error feedback, as a compressor's paper ran it where the correction does not suit it.
        state_fields: the attributes that change from step to step (thresholds, estimation steps):
            the optimizer's ``state_dict()`` carries them, so a resumed job selects exactly as an
            uninterrupted one.
    """

    name: ClassVar[str] = "?"
    dense: ClassVar[bool] = False
    auto_momentum_correction: ClassVar[bool] = True

    def __init__(self, density: float = DEFAULT_DENSITY) -> None:
        self.density = check_density(density)

    def density_of_step(self, density: float | None) -> float:
        """The density a selection runs at: the step's, or :attr:`density` where none is given."""
        return self.density if density is None else density

    def select(self, flat: torch.Tensor, segments: Segments, step: int,
               density: float | None = None) -> torch.Tensor | None:
        """Return buffer-relative int64 indices of the elements to send (``None`` means all).

        ``flat`` is the error-compensated gradient (gradient + residual) of one fusion buffer;
        ``step`` counts synchronisations, for compressors that re-estimate periodically;
        ``density`` is the step's (:meth:`density_of_step`): at 1 every element is sent, below
        :meth:`select_at` selects.
        """
        density = self.density_of_step(density)
        return None if density >= 1.0 else self.select_at(flat, segments, step, density)

    @abstractmethod
    def select_at(self, flat: torch.Tensor, segments: Segments, step: int, density: float) -> torch.Tensor | None:
        """The selection at ``density < 1`` (see :meth:`select`). Indices must be unique; within a
        segment their order is free."""

    def propose(self, flat: torch.Tensor, segments: Segments, step: int, density: float | None = None,
                stats: SegmentStats | None = None) -> Proposal:
        """The device path's selection (:mod:`~horovod_safusion.compressors.device`): decided on
        ``flat``'s device, taken after one host read; ``stats`` are the segments' statistics if
        they were taken while the buffer was filled. The default wraps :meth:`select`, which must
        then read nothing back from the device (top-k and random-k do not)."""
        from .device import Proposal
        return Proposal.of_indices(flat, self.select(flat, segments, step, density))

    def feedback(self, segments: Segments, feedback: int) -> None:
        """What the job's synchronisation of the buffer whose selection segments are ``segments``
        reported about its last selection (a communicator's ``Pending.feedback``: ExDyna's
        k′ = |U|), after that synchronisation finished. Default: nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(density={self.density})"


COMPRESSORS: Registry = Registry("compressor", "compressors", Compressor)
register_compressor = COMPRESSORS.register  # class decorator: ``@register_compressor("name")``
available_compressors = COMPRESSORS.names   # names accepted by ``compressor=``


def make_compressor(spec: "str | Compressor", density: float | None) -> Compressor:
    """Resolve ``compressor=`` (a registered name or an instance) and ``density=``.

    ``density=None`` means the compressor's own default (:data:`DEFAULT_DENSITY` for sparsifiers)
    for names and the instance's own density for instances; an explicit density that contradicts
    an instance's is an error rather than a silent choice.
    """
    if isinstance(spec, Compressor):
        if density is not None and check_density(density) != spec.density:
            raise ValueError(f"density={density!r} contradicts the compressor instance's density "
                             f"{spec.density!r}; pass one of them")
        return spec
    cls = COMPRESSORS.get(spec)
    return cls() if density is None else cls(density=density)


def sparsify(compressor: Compressor, flat: torch.Tensor, segments: Segments, step: int,
             density: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Select from ``flat`` and leave the unselected rest in it (it becomes the residual):
    SAFusion §3.1 Step 1, on the host path.

    Returns ``(values, indices)``; ``indices`` is ``None`` when everything is sent, and then
    ``values`` is ``flat`` itself.
    """
    indices = None if compressor.dense else compressor.select(flat, segments, step, density)
    if indices is None:
        return flat, None
    values = flat[indices]
    flat.index_fill_(0, indices, 0)
    return values, indices
