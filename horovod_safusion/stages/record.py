"""What one fusion buffer's step produces, stage by stage (SAFusion §3.1 Steps 1–3).

A :class:`~horovod_safusion.buffer.FusionBuffer` keeps only what lives across steps: its
segments and its planes (the residuals, the momenta). What a step makes of it is a record that
the stage producing it returns and the next stage takes, and that is dropped when the step ends:

* :class:`Filling` — the fill stage's, built up tensor by tensor as the gradient hooks fire:
  where each tensor's reduced gradient goes, which tensors are in, the non-finite gradient
  elements dropped, the device path's per-segment statistics, and the residuals set aside for
  tensors without a gradient here.
* :class:`Selected` — the selection stage's: the values and indices to send, the wire rows the
  kernels wrote them into, and whether this rank's buffer held a non-finite gradient.
* :class:`InFlight` — the send stage's: the pending collective, where it writes, and what was
  sent — what the collect stage, the step's flags and the statistics read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..communicators import Pending, Target
from ..compressors.device import SegmentStats


class Aside(NamedTuple):
    """A tensor's residual and momentum set aside while its buffer's collective runs (no gradient
    here this step); ``None`` where it is not in the buffer's plane, which the step leaves alone."""

    slot: int
    residual: torch.Tensor | None
    momentum: torch.Tensor | None


@dataclass
class Filling:
    """One buffer's step while its tensors come in.

    Attributes:
        grads: per tensor, where its reduced gradient goes (``p.grad`` flat, or a stand-in).
        filled: the tensors filled so far.
        dropped: non-finite gradient elements the host path's fill dropped.
        dropped_on_device: the same, counted on the device (the device path), read back with the
            selected count; ``None`` until the device path fills.
        stats: per-segment statistics taken while filling (the device path's Triton kernels).
        aside: residuals (and momenta) set aside for tensors without a gradient here.
    """

    grads: list[torch.Tensor | None]
    stats: SegmentStats | None = None
    filled: set[int] = field(default_factory=set)
    dropped: int = 0
    dropped_on_device: torch.Tensor | None = None
    aside: list[Aside] = field(default_factory=list)

    @property
    def full(self) -> bool:
        """Whether every tensor of the buffer is in."""
        return len(self.filled) == len(self.grads)


class Selected(NamedTuple):
    """One buffer's selection: ``values`` at buffer-relative int64 ``indices``, the wire ``rows``
    where the kernels wrote them (or ``None``), and whether this rank dropped a non-finite
    gradient element in the buffer (``poisoned``, decided with the selection)."""

    values: torch.Tensor
    indices: torch.Tensor
    rows: torch.Tensor | None
    poisoned: bool


@dataclass(frozen=True)
class InFlight:
    """One buffer's collective, started.

    Attributes:
        pending: the communicator's handle.
        target: where the aggregate is written (the tensors' ``grads``, or a dense buffer's flat).
        filling: the step's fill (the gradients' destinations, the residuals set aside).
        selected: what this rank sent, or ``None`` for a dense buffer (all of it).
        half: the buffer went as float16 (:mod:`.half`); ``target`` is then the float16 wire.
        rider: the step's flags where this buffer carries them (:mod:`.flags`), reduced in place
            once ``pending`` is collected; else ``None``.
    """

    pending: Pending
    target: Target
    filling: Filling
    selected: Selected | None = None
    half: bool = False
    rider: torch.Tensor | None = None

    @property
    def poisoned(self) -> bool:
        """Whether this rank's buffer held a non-finite gradient element (a sparse step's)."""
        return self.selected is not None and self.selected.poisoned

    @property
    def indices(self) -> torch.Tensor | None:
        """The buffer-relative indices sent, or ``None`` (dense)."""
        return None if self.selected is None else self.selected.indices
