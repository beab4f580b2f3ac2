"""A critical step's buffer over float16, its rounding error kept in the residual.

Horovod's ``Compression.fp16`` halves a dense step's bytes and drops what rounding to float16
loses. Here the rounding error stays in the buffer as its residual, the error feedback of
quantised SGD (Seide, Fu, Droppo, Li and Yu, "1-Bit Stochastic Gradient Descent", Interspeech'14,
§2; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML'19, Algorithm 2; neither in the
reference set), so nothing is lost: a later step sends it. Used for the steps of a critical
interval (:mod:`horovod_safusion.regime`, "A critical interval's wire"), where the profile
measured float16 faster.

For a float32 value ``x`` and its float16 rounding ``h``, ``x - h`` is exact in float32 (the two
are within a factor of two of each other, or ``h`` is zero or a subnormal on ``x``'s grid), so
``residual + sent == x`` bit for bit. A value beyond float16's range rounds to infinity, and a
sum of ranks' values can overflow where none of them does: every rank sees the same aggregate,
so every rank finds the overflow alike, and the buffer is sent again in float32 from the
gradients, which still hold ``x`` (:func:`deliver` returns ``False``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..buffer import FusionBuffer
from ..residual import ResidualStore, holds

if TYPE_CHECKING:  # (the records import Horovod's collectives; this stage needs none: tests/gpu runs it without)
    from .record import Filling, InFlight


def round_to_half(buf: FusionBuffer, filling: Filling, spare: float | None = None) -> torch.Tensor:
    """This rank's contribution to ``buf`` (gradient plus residual, in ``filling.grads``) rounded
    to a new float16 tensor; each rounding error goes into the buffer's flat tensor. ``spare``:
    one element more at the end, holding that value (the step's flags, :mod:`.flags`), so that
    they travel in the same tensor: Horovod reduces one tensor in place, where a group of two
    goes through its fusion buffer, a copy of the whole buffer in and out."""
    flat = buf.allocate("flat")
    wire = torch.empty(buf.numel + (spare is not None), dtype=torch.float16, device=buf.device)
    if spare is not None:
        wire[buf.numel] = spare
    for slot, x in enumerate(filling.grads):
        seg = buf.segment(slot)
        wire[seg].copy_(x)
        torch.sub(x, wire[seg], out=flat[seg])
    return wire


def deliver(buf: FusionBuffer, flight: InFlight, residuals: ResidualStore) -> bool:
    """The reduced float16 buffer into each tensor's gradient, and each rounding error bound as
    the tensor's residual (with a residual kept aside for a tensor without gradient here, which
    the rounding left at zero). ``False``, with nothing written, if the aggregate is not finite."""
    wire = flight.target.tensors[0]
    if not bool(torch.isfinite(wire).all()):
        buf.flat = None  # the gradients go again whole: no rounding error to keep
        return False
    for slot, dst in enumerate(flight.filling.grads):
        seg, name = buf.segment(slot), buf.names[slot]
        dst.copy_(wire[seg])
        kept = residuals.peek(name)
        if kept is not None and not holds(kept, buf.flat, seg):
            buf.flat[seg].add_(kept.reshape(-1))
        residuals.bind(name, buf.flat[seg])
    return True
