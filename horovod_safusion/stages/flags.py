"""What every rank must agree on in a step: :class:`StepFlags`, the step's one small allreduce (the
maximum over ranks): whether any rank dropped non-finite gradient elements on a sparse step, how
many parameters ranks are about to add, per parameter whether its gradient arrived on any rank,
and, while some parameter is undecided, each rank's vote on whether its gradient is spread
(:mod:`horovod_safusion.spread`). A step some rank could not send whole arrives as NaN on every
rank (:func:`poison`), so the user's finiteness check (or GradScaler's) skips it on all ranks
alike, as with Horovod, and every rank takes back what it sent into its residuals; nothing finite
is lost and no rank keeps a NaN.

**The flags carried.** Horovod runs a step's collectives one after another, so a collective of
its own costs every step a negotiation and a pass round the ranks after the buffers' own, which a
slow link between hosts makes long. Where the step's last buffer goes dense (a dense step, or a
sparse plan's buffer of small tensors, :func:`~horovod_safusion.plan.send_small_dense`) and no
vote is due, the flags ride in that buffer's allreduce instead, as one more element of its group
(:meth:`StepFlags.carry`): this rank's count of what it has to tell (1 where it dropped a
non-finite element, adds parameters, or lacks a gradient, else 0), summed with the gradients. A
sum of zero tells every rank the usual flags: nothing dropped, nothing joining, every gradient
arrived somewhere. Any other sum, the same on every rank, sends the flags' own allreduce after
all, so the rare steps keep their exact maximum.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import horovod.torch as hvd

from ..buffer import FusionBuffer
from ..communicators.base import wait
from ..session import collective
from .record import InFlight

POISONED, JOINING_MAX, JOINING_MIN, ARRIVED = 0, 1, 2, 3  # positions in the flags


class StepFlags:
    """The step's flags, one allreduce (``hvd.Max``) per step over ``process_set``.

    Args:
        names: the synchronised parameters, in the same order on every rank.
    """

    def __init__(self, names: Sequence[str], process_set: Any) -> None:
        self.process_set = process_set
        self.position = {name: i for i, name in enumerate(names)}
        self.arrived = np.ones(len(self.position), dtype=bool)  # per position: its gradient arrived here
        self._handle: int | None = None
        self._result: np.ndarray | None = None
        #: where the step's last buffer carries the flags: this rank's (poisoned, joining), and
        #: that buffer's collective (:meth:`carry`, :meth:`carried`)
        self._told: tuple[bool, int] | None = None
        self._carrier: InFlight | None = None

    def arrive(self, name: str, arrived: bool) -> None:
        """Whether ``name``'s gradient arrived on this rank in this step."""
        self.arrived[self.position[name]] = arrived

    def start(self, poisoned: bool, joining: int, votes: np.ndarray | None = None) -> None:
        """Start the allreduce: submitted after every buffer's collective, so that it waits behind
        none of them. ``votes``: this rank's on each parameter's spread, where some parameter is
        undecided (every rank knows alike whether one is, so every rank sends as many flags)."""
        n = len(self.arrived)
        flags = np.empty(ARRIVED + n + (0 if votes is None else len(votes)), dtype=np.int32)
        flags[POISONED] = poisoned
        flags[JOINING_MAX], flags[JOINING_MIN] = joining, -joining
        flags[ARRIVED:ARRIVED + n] = self.arrived
        if votes is not None:
            flags[ARRIVED + n:] = votes
        self._result, self._told, self._carrier = None, None, None
        self._handle = hvd.allreduce_async(torch.from_numpy(flags), op=hvd.Max, name=collective("saf.step"),
                                           process_set=self.process_set)

    def carry(self, poisoned: bool, joining: int) -> float:
        """This rank's count of what it has to tell, for the step's last buffer to carry in its
        allreduce (see the module's docstring): 1.0 where it dropped a non-finite element, adds
        parameters or lacks a gradient, else 0.0. :meth:`carried` says how to read the sum."""
        self._result, self._handle, self._told, self._carrier = None, None, (poisoned, joining), None
        return float(poisoned or joining != 0 or not self.arrived.all())

    def carried(self, carrier: InFlight) -> None:
        """``carrier``: the collective of the buffer that carries the flags (its rider holds their
        sum over ranks once it is collected)."""
        self._carrier = carrier

    def result(self) -> np.ndarray:
        """The flags of every rank (waits for them the first time)."""
        if self._result is None and self._told is not None:
            self._carrier.pending.collect()
            if self._carrier.rider.item() == 0.0:  # every rank's flags are the usual ones: no allreduce of their own
                self._result = np.concatenate([np.zeros(ARRIVED, dtype=np.int32),
                                               np.ones(len(self.arrived), dtype=np.int32)])
            else:  # the same sum on every rank: every rank sends its flags
                self.start(*self._told)
        if self._result is None:
            self._result = wait(self._handle).numpy()
            self._handle = None
        return self._result

    @property
    def poisoned(self) -> bool:
        """Whether some rank dropped a non-finite gradient element."""
        return bool(self.result()[POISONED])

    @property
    def joining(self) -> tuple[int, int]:
        """How many parameters ranks add: the minimum and the maximum over ranks."""
        flags = self.result()
        return -int(flags[JOINING_MIN]), int(flags[JOINING_MAX])

    def votes(self) -> np.ndarray:
        """The maximum over ranks of each parameter's vote (empty where none were sent)."""
        return self.result()[ARRIVED + len(self.arrived):]

    def arrived_anywhere(self, name: str) -> bool:
        """Whether ``name``'s gradient arrived on some rank."""
        return bool(self.result()[ARRIVED + self.position[name]])


def poison(buf: FusionBuffer, flight: InFlight) -> None:
    """A step some rank could not send whole: the buffer arrives as NaN everywhere, and this rank
    takes what it sent back into its residuals (gradient + residual, as if nothing had been
    selected), so the step the user skips loses no finite gradient."""
    if flight.selected is not None:
        buf.flat.index_add_(0, flight.selected.indices, flight.selected.values)
    for t in flight.target.tensors:
        t.fill_(float("nan"))
