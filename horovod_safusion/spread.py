"""Which tensors' gradients are spread: one decision per tensor, agreed by every rank.

Top-k under error feedback sends the largest elements and holds the rest for about ``1/density``
steps (DGC, Lin et al., ICLR'18, §3.3 "Overcoming the staleness effect"). How much that delay
costs depends on the tensor. Where a gradient concentrates in a few elements (an embedding's or a
vocabulary decoder's rows of frequent tokens), the top few percent hold nearly all of it, the same
elements are sent at almost every step, and little waits. Where it is spread (a convolution's, a
dense layer's), the top few percent hold a small part of it, and most of the gradient waits.

Two rules act on that difference, both the plugin's own and chosen by measurement
(docs/benchmarks.md, "Masking by tensor" and "Density by tensor"):

* **masking by tensor** (``momentum_masking="auto"``, :mod:`~horovod_safusion.momentum`): DGC's
  momentum factor masking (§3.3) clears ``u`` where a step sent, which helps where a sent element
  waited and hurts where the same elements go at every step; so only spread tensors are masked;
* **density by tensor** (``spread_density``): a spread tensor selects at no less than a floor,
  :data:`~horovod_safusion.density.SPREAD` by default, so that its gradient waits fewer steps;
  a concentrated one keeps the job's density, which already sends most of it.

The measure is :func:`concentration`: how much more of a gradient's squared norm its largest
:data:`CONCENTRATION_SHARE` of elements hold than they would of equal magnitudes. A tensor is
spread below :data:`CONCENTRATED`. Each rank measures each tensor at its first gradient with a
finite, non-zero norm and votes; the votes travel in the step's flags
(:mod:`~horovod_safusion.stages.flags`), whose maximum over ranks decides: spread where any rank
measured it spread. So every rank selects every tensor at the same density and masks the same
tensors, and a tensor that no rank measured yet (no gradient anywhere) is decided at a later step.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np
import torch

#: The share of a gradient's elements, its largest, whose share of the squared norm
#: :func:`concentration` measures, and the concentration below which a tensor is spread. A
#: Gaussian's largest 1 % hold 8 % of its squared norm (a concentration of 0.07); what the
#: benchmarks' tensors measure is in docs/benchmarks.md ("Masking by tensor").
CONCENTRATION_SHARE = 0.01
CONCENTRATED = 0.5
#: The most elements :func:`concentration` reads of a tensor: a larger one is read every
#: ``stride``-th element, so that the measure's temporaries do not grow with the model.
CONCENTRATION_SAMPLE = 1 << 16

#: A rank's vote on a tensor, in the step's flags (the maximum over ranks wins).
UNDECIDED, CONCENTRATED_VOTE, SPREAD_VOTE = 0, 1, 2


def concentration(g: torch.Tensor, share: float = CONCENTRATION_SHARE) -> float | None:
    """How much more of ``g``'s squared norm its largest ``share`` of elements (at least one) hold
    than they would of a gradient of equal magnitudes: ``(held − k/n) / (1 − k/n)`` for the
    largest ``k`` of ``n`` elements, 0 for equal magnitudes (and a single element), 1 for one
    non-zero element. ``None`` where the squared norm is zero (or underflows) or not finite: nothing
    to decide by yet. A tensor of more than :data:`CONCENTRATION_SAMPLE` elements is measured on
    every ``stride``-th element, at most that many (a view)."""
    flat = g.detach().reshape(-1)
    energy = flat[::-(-flat.numel() // CONCENTRATION_SAMPLE)].float().square()
    n = energy.numel()
    k = max(1, math.ceil(share * n))
    held = float(energy.topk(k).values.sum() / energy.sum())  # one read, at a tensor's first gradient
    if not math.isfinite(held):  # 0/0 where the norm is zero
        return None
    return 0.0 if k == n else (held - k / n) / (1 - k / n)


class Spread:
    """This rank's votes and the decisions every rank agreed on, per parameter.

    Args:
        names: the synchronised parameters, in the same order on every rank.

    Attributes:
        votes: this rank's vote per parameter (:data:`UNDECIDED` until it measured one).
        decided: per parameter agreed on, whether its gradient is spread; part of the job's
            checkpoint, so that a resumed job selects and masks as the saved one did.
        changed: whether :meth:`agree` decided something since the controller last read it.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names: tuple[str, ...] = ()
        self.votes = np.zeros(0, dtype=np.int32)
        self.decided: dict[str, bool] = {}
        self.changed = False
        self.add(names)

    def add(self, names: Iterable[str]) -> None:
        """Vote on parameters that joined too (the same on every rank, between steps)."""
        new = tuple(n for n in names if n not in self.names)
        self.names += new
        self.votes = np.concatenate([self.votes, np.zeros(len(new), dtype=np.int32)])
        self._position = {n: i for i, n in enumerate(self.names)}

    @property
    def voting(self) -> bool:
        """Whether some parameter is still undecided: the step's flags then carry the votes."""
        return len(self.decided) < len(self.names)

    def measure(self, name: str, g: torch.Tensor) -> None:
        """Vote on ``name`` by its gradient ``g`` (flat), if this rank has not voted on it yet and
        ``g``'s norm is finite and not zero."""
        i = self._position[name]
        if self.votes[i] != UNDECIDED or name in self.decided:
            return
        measured = concentration(g)
        if measured is not None:
            self.votes[i] = SPREAD_VOTE if measured < CONCENTRATED else CONCENTRATED_VOTE

    def agree(self, votes: np.ndarray) -> None:
        """Decide every parameter some rank voted on: ``votes`` is the maximum over ranks of
        :attr:`votes`, from the step's flags."""
        for name, vote in zip(self.names, votes.tolist()):
            if vote != UNDECIDED and name not in self.decided:
                self.decided[name] = vote == SPREAD_VOTE
                self.changed = True

    def load(self, decided: Mapping[str, bool]) -> None:
        """Take the decisions of a checkpoint, or rank 0's after an elastic reset (those of
        parameters this job has), in place of this rank's."""
        self.decided = {n: bool(s) for n, s in decided.items() if n in self._position}
        self.changed = True

    def floors(self, floor: float | None) -> dict[str, float]:
        """``floor`` for every parameter decided spread (none where ``floor`` is ``None``)."""
        return {} if floor is None else {n: floor for n, spread in self.decided.items() if spread}
