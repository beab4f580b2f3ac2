"""The third stage: one collective per fusion buffer, started as soon as the buffer is full
(SAFusion §3.1 Step 2), overlapping the rest of back-propagation.

A sparse buffer goes to the job's communicator (:mod:`~horovod_safusion.communicators`) as an
``Outgoing`` record: its selected values and indices, its residual, the wire rows where the
selection wrote them, and where the aggregate goes (``p.grad`` of each tensor). A dense one —
every buffer of a dense step, and the buffer of small tensors — is reduced with Horovod's
allreduce over the same process set and wire compression; the buffer of small tensors travels
packed in its flat tensor, one tensor for Horovod, whose background thread pays per tensor it
handles. A critical step's buffer may go as float16, its rounding error kept (:mod:`.half`). The
step's last buffer, where it goes dense, may carry the step's flags (:mod:`.flags`): one element
more in its allreduce, of the dtype it travels in.
"""
from __future__ import annotations

import numpy as np
import torch

from ..buffer import FusionBuffer
from ..communicators import Allreduce, Communicator, Outgoing, Reduction
from ..communicators.base import Target
from .half import round_to_half
from .mode import StepMode
from .record import Filling, InFlight, Selected


class Sender:
    """Starts buffers' collectives.

    Args:
        communicator: the job's communicator.
        reduction: Horovod's op and scale factors.
    """

    def __init__(self, communicator: Communicator, reduction: Reduction) -> None:
        self.communicator = communicator
        self.reduction = reduction
        self._allreduce: Communicator | None = None

    @property
    def allreduce(self) -> Communicator:
        """The communicator of dense buffers and steps: the job's own where it is dense, else
        Horovod's allreduce over the same process set and wire compression (made once)."""
        if self.communicator.dense:
            return self.communicator
        if self._allreduce is None:
            self._allreduce = Allreduce(process_set=self.communicator.process_set,
                                        compression=self.communicator.compression)
        return self._allreduce

    def start(self, buf: FusionBuffer, filling: Filling, mode: StepMode, selected: Selected | None,
              flags: float | None = None) -> InFlight:
        """Start ``buf``'s collective: its ``selected`` elements, or all of it (``None``: dense);
        ``flags``: the value of the step's flags this rank adds, where this dense buffer carries
        them (:meth:`~.flags.StepFlags.carry`)."""
        if mode.sends_half(buf):  # the flags in the wire's spare element: one tensor, reduced in place
            half = round_to_half(buf, filling, flags)
            wire = Target((half,), np.array([0, buf.numel]))
            tag = buf.tag if flags is None else f"{buf.tag}.rider"  # (Horovod's response cache keys by name)
            out = Outgoing(tag, None, None, buf.numel, target=wire)
            pending = self.allreduce.start(out, self.reduction)
            rider = None
            if flags is not None:
                rider = half[buf.numel:]
                pending.bytes_sent -= half.element_size()  # the gradient's payload: the flags are not counted
            return InFlight(pending, wire, filling, half=True, rider=rider)
        dense = mode.sends_dense(buf)
        comm = self.allreduce if dense else self.communicator
        target = Target((buf.flat,), np.array([0, buf.numel])) if buf.dense else Target(tuple(filling.grads), buf.bounds)
        values, indices, rows = (None, None, None) if selected is None else selected[:3]
        rider = carrier(flags, target) if dense else None
        pending = comm.start(Outgoing(buf.tag, values, indices, buf.numel, buf.flat, rows, target, rider), self.reduction)
        return InFlight(pending, target, filling, selected, rider=rider)

    def resend(self, buf: FusionBuffer, flight: InFlight) -> None:
        """Reduce ``buf``'s gradients again, in float32, and wait: its float16 aggregate
        overflowed (every rank calls this for the same buffers, in buffer order)."""
        target = Target(tuple(flight.filling.grads), buf.bounds)
        again = self.allreduce.start(Outgoing(f"{buf.tag}.fp32", None, None, buf.numel, target=target), self.reduction)
        again.wait()
        flight.pending.bytes_sent += again.bytes_sent


def carrier(flags: float | None, target: Target) -> torch.Tensor | None:
    """The one-element tensor that carries ``flags`` in a dense buffer's allreduce, of the dtype and
    device of what the buffer sends (``None`` where it carries none)."""
    if flags is None:
        return None
    first = target.tensors[0]
    return torch.full((1,), flags, dtype=first.dtype, device=first.device)
