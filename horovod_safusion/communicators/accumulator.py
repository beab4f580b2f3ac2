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

from dataclasses import dataclass

import torch

from .. import kernels


@dataclass(frozen=True)
class AtAgreed:
    """This rank's contribution at the agreed indices and what it hands back.

    Attributes:
        agreed: the agreed indices, ascending (every rank the same order: the all-reduce's).
        contrib: the accumulator at each agreed index (selected value + residual).
        back_indices, back_values: buffer-relative, unscaled, for ``Pending.leftover``: every
            selected value (positive) and the contribution at U (negative); equal indices add up.
    """

    agreed: torch.Tensor
    contrib: torch.Tensor
    back_indices: torch.Tensor
    back_values: torch.Tensor

    def leftover(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(indices, values)`` for ``Pending.leftover``, or ``None`` when nothing goes back."""
        return (self.back_indices, self.back_values) if self.back_indices.numel() else None


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
    return AtAgreed(agreed, contrib, torch.cat([indices, agreed]), torch.cat([values, -contrib]))
