"""Critical learning regimes: send dense while the gradient changes fast (Accordion, Agarwal, Wang,
Lee, Venkataraman and Papailiopoulos, MLSys'21, Algorithm 1; not in the reference set).

Small gradient errors early in training, or wherever the gradient changes fast, cost accuracy that
later steps do not win back (Achille et al.'s critical learning periods, which Accordion builds
on). Accordion therefore compresses little in such "critical regimes" and much elsewhere, and
detects them by a single test on the gradient's norm over an interval: if it changed by at least
η (0.5) relative to the previous interval's, the next interval is critical (Algorithm 1).
Training starts critical, and the first comparison needs two intervals, so the first two
intervals always are (as in the authors' code). Here a critical interval sends every element
(the step's mode is dense, over Horovod's allreduce); any other sends at the target density. The
residuals of the sparse steps before it go along at the rate those steps sent them, a chunk per
step (:func:`horovod_safusion.stages.fill.release`), as the dense plan's steps send them: all at
once, many steps' residual would make one step several times a step's length, which the loss
does not take well. A critical step sent as float16 sends them whole, so that what the residual
keeps is the rounding error, exactly (:mod:`horovod_safusion.stages.half`).

It also catches what error feedback cannot survive: when every tensor is sparsified, an element
waits about 1/density steps in the residual, and an SGD whose momentum tolerates less delay
diverges (``benchmarks/bench_staleness.py``). The gradient's norm then grows by more than η per
interval, the next interval goes dense, and the dense steps pull the run back.

Where this departs from the paper, and why:

* **An interval is** ``interval`` **steps**, not an epoch: the plugin does not see epochs, and runs
  that reach their target in a few epochs would spend a whole one dense.
* **The norm is the step's aggregate's**, the update every rank applies alike, so every rank
  decides alike with no collective (Accordion decides on rank 0's accumulated gradient and
  broadcasts the decision).
* **It is the root mean square of the steps' norms**, not the norm of the interval's summed
  gradient, which would hold another copy of the model (:mod:`horovod_safusion.memory`'s bound).
* **One decision for the model**, not one per layer: a layer sent dense inside a sparse step would
  travel as indices and values over the allgather, twice its dense bytes times the workers.

A step that some rank could not send whole (non-finite values; the user skips it) is not counted.

**A critical interval's wire.** Where the link is slow, a dense step costs what Horovod's does,
and most of the time a critical interval saves is spent on it. Like Horovod's
``Compression.fp16``, a critical step may then travel as float16, which halves its bytes; unlike
it, the rounding error stays in the residual (:mod:`horovod_safusion.stages.half`), so error
feedback loses nothing and the next steps send it. The profiler decides, by measurement, before its first profiled step (so
that the critical steps while it profiles gain too): it times a dense allreduce of the same size
in float32 and in float16, and the critical steps go as
float16 where that measured at most :data:`HALF_MARGIN` of float32's time (:meth:`choose_wire`;
float16 costs conversions, which a fast link does not repay). A float16 aggregate that overflows
is sent again in float32, and the job's critical steps stay in float32 from then on
(:meth:`fall_back`).

**The default** (``critical_regimes="auto"``) turns the rule on, at intervals of
:data:`DEFAULT_INTERVAL` steps, where the job is free to send dense: ``fusion="safusion"`` with
``dense="auto"`` and a sparse compressor. ``dense=False`` promises never to send dense, and another
planner is a researcher's fixed scheme, so neither gets it unasked. Ten steps: chosen by time to
accuracy over both benchmark models, two links and 2, 4 and 8 hosts, against no regimes and
intervals of five (docs/benchmarks.md, "The default: critical regimes on, chosen over both links").
"""
from __future__ import annotations

import math

import torch

ETA = 0.5  # Accordion's η: the relative change of the norm that marks a critical regime (the authors' value)
DEFAULT_INTERVAL = 10  # the steps of an interval under critical_regimes="auto" (see the module's docstring)
#: A critical step goes as float16 where a float16 dense allreduce measured at most this share of
#: float32's time: the margin covers what the sweep does not time (the rounding error kept, the
#: check for overflow) and the sweep's noise.
HALF_MARGIN = 0.8


class CriticalRegimes:
    """Whether the current interval of ``interval`` steps is critical (sent dense)."""

    def __init__(self, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"critical_regimes must be 'auto', None or a positive int (the steps of an "
                             f"interval), got {interval!r}")
        self.interval = interval
        self.critical = True  # training starts critical (Accordion, Algorithm 1)
        self.previous: float | None = None  # the last complete interval's norm
        self._squares: torch.Tensor | float = 0.0  # the interval's sum of squared norms so far
        self._counted = 0
        self.half = False  # critical steps travel as float16 (chosen by the profiler, :meth:`choose_wire`)
        self.overflowed = False  # a float16 aggregate overflowed: float32 from then on

    def observe(self, grads: list[torch.Tensor]) -> None:
        """Count one step whose aggregate the optimizer applies (``grads``, the same on every rank);
        at an interval's end, decide the next. Reads the device once per interval."""
        if grads:
            self._squares = self._squares + torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32)
                                                         for g in grads]).square().sum()
        self._counted += 1
        if self._counted < self.interval:
            return
        norm = math.sqrt(float(self._squares) / self._counted)
        if math.isfinite(norm):
            self.critical = self.previous is None or self.previous == 0.0 or \
                abs(norm - self.previous) / self.previous >= ETA
            self.previous = norm
        self._squares, self._counted = 0.0, 0

    def choose_wire(self, float32_s: float, float16_s: float) -> bool:
        """Send critical steps as float16 if a dense allreduce of the same buffer measured at most
        :data:`HALF_MARGIN` of float32's seconds (times every rank shares: the profiler's); never
        again after an overflow. Returns the choice."""
        self.half = not self.overflowed and float16_s <= HALF_MARGIN * float32_s
        return self.half

    def fall_back(self) -> None:
        """A float16 aggregate overflowed (every rank sees the same aggregate, so every rank falls
        back alike): critical steps go as float32 for the rest of the job."""
        self.half, self.overflowed = False, True

    def state_dict(self) -> dict:
        """What resumes the decision bit for bit (the same on every rank)."""
        return {"critical": self.critical, "previous": self.previous, "squares": float(self._squares),
                "counted": self._counted, "half": self.half, "overflowed": self.overflowed}

    def load_state_dict(self, state: dict) -> None:
        self.critical, self.previous = bool(state["critical"]), state["previous"]
        self._squares, self._counted = float(state["squares"]), int(state["counted"])
        self.half, self.overflowed = bool(state.get("half", False)), bool(state.get("overflowed", False))

    def __repr__(self) -> str:
        return f"CriticalRegimes(interval={self.interval}, critical={self.critical}, half={self.half})"
