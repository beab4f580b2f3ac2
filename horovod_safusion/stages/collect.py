"""The last stage: each buffer's aggregate into ``p.grad``, the residuals put back, the step counted.

SAFusion §3.1 Step 3: the communicator decodes a buffer's aggregate straight into where its
parameters' gradients go (``p.grad`` itself where it is dense and contiguous). What the protocol
did not deliver goes back into the residuals, momentum masking clears ``u`` where the step sent
(DGC §3.3; by default only in the tensors whose gradient is spread), residuals set aside for a parameter without gradient go back, and a buffer of small
tensors, reduced packed in its flat tensor, is unpacked. A parameter whose ``.grad`` is sparse or
strided, or that got no gradient here, received its aggregate in a stand-in (:class:`WriteBack`),
written into ``p.grad`` at the end — for one without gradient only if some rank had one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..buffer import FusionBuffer
from .record import InFlight


@dataclass
class StepStats:
    """What one synchronisation sent (this rank's contribution).

    Attributes:
        tensors: gradient tensors synchronised.
        missing: tensors of which no element was selected (SAFusion §2.4's tensor missing).
        selected: elements sent; ``elements``: elements in all buffers.
        bytes_sent: payload bytes this rank submitted to collectives.
        bytes_received: payload bytes this rank received from other ranks (where the
            communicator can tell; 0 for a dense allreduce).
        buffers: collectives started (one per fusion buffer).
    """

    tensors: int = 0
    missing: int = 0
    selected: int = 0
    elements: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    buffers: int = 0

    @property
    def density(self) -> float:
        """Actual fraction of elements sent."""
        return self.selected / self.elements if self.elements else 0.0

    @property
    def missing_rate(self) -> float:
        return self.missing / self.tensors if self.tensors else 0.0


class Tally:
    """Counts a step's buffers into a :class:`StepStats`; tensors that sent nothing are counted
    on the device and read once per step."""

    def __init__(self, buffers: int) -> None:
        self.stats = StepStats(buffers=buffers)
        self._missing: list[torch.Tensor] = []

    def count(self, buf: FusionBuffer, flight: InFlight) -> None:
        stats, pending, indices = self.stats, flight.pending, flight.indices
        stats.tensors += len(buf.names)
        stats.elements += buf.numel
        stats.bytes_sent += pending.bytes_sent
        stats.bytes_received += pending.bytes_received or 0
        if pending.selected is not None:
            stats.selected += pending.selected
        elif indices is None:
            stats.selected += buf.numel
        else:
            stats.selected += indices.numel()
            self._missing.append((buf.segments.counts(indices) == 0).sum())

    def total(self) -> StepStats:
        self.stats.missing = int(torch.stack(self._missing).sum()) if self._missing else 0
        return self.stats


class WriteBack:
    """Stand-ins for the reduced gradients that cannot be written in place."""

    def __init__(self) -> None:
        self._rewrite: list[tuple[torch.Tensor, torch.Tensor]] = []       # (parameter, stand-in)
        self._absent: list[tuple[torch.Tensor, torch.Tensor, str]] = []   # (parameter, stand-in, name)

    def grad_of(self, p: torch.Tensor) -> torch.Tensor:
        """Where the reduced gradient of ``p`` goes, flat: ``p.grad`` itself where it is dense and
        contiguous (made, zero, where ``p`` has none, as Horovod does); otherwise a dense
        stand-in that :meth:`finish` copies into ``p.grad``."""
        g = p.grad
        if g is None:
            p.grad = g = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        if not g.is_sparse and g.is_contiguous():
            return g.view(-1)
        stand_in = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        self._rewrite.append((p, stand_in))
        return stand_in

    def absent(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """Where the reduced gradient of ``p``, which got no gradient here, goes: zeros (this
        rank's contribution) that :meth:`finish` writes into ``p.grad`` only if some rank had a
        gradient; otherwise ``p.grad`` stays as it was."""
        stand_in = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        self._absent.append((p, stand_in, name))
        return stand_in

    def finish(self, arrived_anywhere) -> None:
        """Write the stand-ins back; ``arrived_anywhere(name)`` tells whether a parameter that got
        no gradient here got one on some rank."""
        for p, stand_in in self._rewrite:
            assign_grad(p, stand_in)
        for p, stand_in, name in self._absent:
            if arrived_anywhere(name):
                assign_grad(p, stand_in)
        self.clear()

    def clear(self) -> None:
        self._rewrite, self._absent = [], []


def unpack(buf: FusionBuffer, flight: InFlight) -> None:
    """A buffer of small tensors arrived reduced in its flat tensor: each segment to where its
    parameter's gradient goes."""
    for slot, dst in enumerate(flight.filling.grads):
        dst.copy_(buf.flat[buf.segment(slot)])


def keep_leftover(buf: FusionBuffer, flight: InFlight) -> None:
    """What the protocol did not deliver (``Pending.leftover``) goes back into the residuals."""
    leftover = flight.pending.leftover
    if leftover is not None:
        buf.flat.index_add_(0, *leftover)


def assign_grad(p: torch.Tensor, flat: torch.Tensor) -> None:
    """``flat``, a reduced gradient of ``p``'s size, into ``p.grad``, whether that is sparse,
    strided or ``None``."""
    value = flat.view(p.shape)
    if p.grad is None:
        p.grad = value
    elif p.grad.is_sparse:
        # Sparse grads do not support copy_ from dense; Horovod uses the same equivalent.
        p.grad.zero_().add_(value.to_sparse())
    else:
        p.grad.copy_(value)
