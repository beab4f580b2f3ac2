"""Every rank's accumulator at indices the job agreed on: the all-reduce half of ExDyna's
aggregation (ExDyna §IV, Alg. 1 lines 12–13), shared with ScaleCom's CLT-k.

When the job has agreed on a set of buffer indices U (ExDyna: the union of the exclusive
selections; ScaleCom: one leader's selection), each rank sends its *accumulator* there — the value
it selected, where it selected one, plus its residual — so that one all-reduce of |U| values
delivers the job's exact sum at U. Every element the rank selected goes back to its residual and
what it sent at U leaves it, through ``Pending.leftover``: an element selected outside U stays, one
sent at U is cleared (its value in and out again, exactly), so error feedback conserves every
element.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import horovod.torch as hvd

from .. import kernels
from .base import Reduction


@dataclass(frozen=True)
class AtAgreed:
    """This rank's contribution at the agreed indices and what it hands back.

    Attributes:
        agreed: the agreed indices, ascending (every rank the same order: the all-reduce's).
        contrib: the accumulator at each agreed index (selected value + residual), unscaled, as
            the wire carries it once :meth:`for_wire` has rounded it.
        indices, values: this rank's selection (ascending), every value of which goes back.
    """

    agreed: torch.Tensor
    contrib: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor

    def for_wire(self, compression: Any, reduction: Reduction) -> tuple["AtAgreed", torch.Tensor, Any]:
        """The contribution as Horovod's wire compression carries it (prescaled) with its context,
        and this accumulator with ``contrib`` as the wire delivers it: what rounding to float16
        drops is not handed back as sent, so it stays in the residual (as the allgather's
        selection keeps it: :mod:`horovod_safusion.stages.select`)."""
        sent, ctx = compression.compress(reduction.prescaled(self.contrib))
        if compression is hvd.Compression.none:
            return self, sent, ctx
        carried = reduction.unprescaled(compression.decompress(sent, ctx).to(self.contrib.dtype))
        return replace(self, contrib=carried), sent, ctx

    def leftover(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(indices, values)`` for ``Pending.leftover`` (buffer-relative, unscaled; equal indices
        add up): every selected value, and the contribution at the agreed indices negated, or
        ``None`` when nothing goes back."""
        if not self.indices.numel() and not self.agreed.numel():
            return None
        return torch.cat([self.indices, self.agreed]), torch.cat([self.values, -self.contrib])


def ascending(indices: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``indices`` (distinct) in ascending order, and ``more`` in the same order (a compressor's
    selection usually comes ascending already: then nothing is copied)."""
    if indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all()):
        return (indices, *more)
    order = torch.argsort(indices)
    return (indices[order], *(t[order] for t in more))


def at_agreed(agreed: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
              residual: torch.Tensor | None) -> AtAgreed:
    """The accumulator of this rank (``values`` selected at ``indices``, ascending — see
    :func:`ascending` —, the rest in ``residual``, which is zero where a value was selected) at
    the ``agreed`` indices (distinct, int64, in any order)."""
    (agreed,) = ascending(agreed)
    contrib = kernels.accumulator_at(agreed, indices, values, residual)
    return AtAgreed(agreed, contrib, indices, values)
