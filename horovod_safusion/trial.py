"""Sparse or dense, and which communicator, settled by measured step times (the choices of
``fusion="safusion"``).

Ours, extending the generator of SAFusion §4 (Figure 12), which profiles and plans but always
sparsifies: SAFusion §5 evaluates slow links, where sparsification pays; on a fast link a dense
allreduce overlapped with back-propagation can be faster, and a user must never lose to it.

The planner predicts the iteration time of its best sparse plan and of its best dense-allreduce
plan from the profile (:class:`~horovod_safusion.fusion.SAFusionPlanner`, "Dense
choice") and returns the faster. A prediction leaves out what the profile cannot see — the
decoding's memory traffic, the threads competing for the cores, Horovod's negotiation — so when
the two predictions are within :data:`TRIAL_MARGIN` of each other, the job runs the plans in
blocks of measured steps (:func:`block_steps`: 3 to 12, enough to span 0.2 s), A B B A (a drift
of the machine's speed hits both alike; the first step after each switch pays for new buffers
and is not measured), and keeps the one measured faster. When the prediction was decisive, the
chosen plan is still measured for one block after the switch, and the trial goes on only if it
measured slower than the other plan was predicted. A step is timed from the script's
``zero_grad()`` (:meth:`~horovod_safusion.profiling.OnlineProfiler.step_starts`), else from the
previous step's end, so that an evaluation between steps is no plan's step. Every rank measures
its own step times; their
medians are reduced by the maximum (the job is as fast as its slowest rank), so every rank
decides alike and switches at the same step. Residuals are per parameter: a sparse plan keeps
them, and the first dense step sends them along, so the trial loses no gradient.

The same trial settles the communicator (``communicator="auto"``): the planner ranks the sparse
plan over each communicator it priced and the dense plan, and the two fastest are the trial's
plans. It settles the density too (``density="auto"``, :mod:`~horovod_safusion.density`): of two
plans at different densities the denser is kept unless the other measured more than
:data:`~horovod_safusion.density.MARGIN` faster.

Rank 0 says once what was chosen, with the predicted (and measured) times.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import horovod.torch as hvd

from .announce import announce
from .density import MARGIN, density_of, preferred
from .plan import FusionPlan
from .session import collective

#: Try both plans when the slower prediction is at most this factor above the faster one.
TRIAL_MARGIN = 1.5
#: Measured steps per block of a trial, at least.
TRIAL_STEPS = 3
#: A block spans at least this many seconds of predicted iteration time, up to
#: :data:`TRIAL_MAX_STEPS` steps. Steps of some tens of milliseconds vary widely from one to the
#: next on a busy host, so a block of a few of them can rank two plans that train equally fast
#: by noise (docs/benchmarks.md, "The measured trial", has the runs).
TRIAL_SECONDS = 0.2
TRIAL_MAX_STEPS = 12
#: The order of a trial's blocks: 0 is the plan predicted faster, 1 the other.
SCHEDULE = (0, 1, 1, 0)


def block_steps(iteration_s: float) -> int:
    """Measured steps per block for plans predicted at ``iteration_s`` seconds an iteration: enough
    to span :data:`TRIAL_SECONDS`, from :data:`TRIAL_STEPS` to :data:`TRIAL_MAX_STEPS`. The
    prediction comes from the profile every rank shares, so every rank sizes its blocks alike."""
    if not iteration_s > 0:  # no prediction (nan), or none that can be trusted
        return TRIAL_STEPS
    return min(TRIAL_MAX_STEPS, max(TRIAL_STEPS, math.ceil(TRIAL_SECONDS / iteration_s)))


def describe(plan: FusionPlan) -> str:
    if plan.dense:
        return "dense allreduce"
    at = "" if plan.density is None else f" at density {plan.density:g}"
    return f"sparse{at}" if plan.communicator is None else f"sparse{at} over {plan.communicator}"


def predicted(plan: FusionPlan, chosen: dict) -> float:
    """The iteration seconds predicted for ``plan``, one of the plans the planner's choice (whose
    meta is ``chosen``) compared."""
    key = "predicted_dense_s" if plan.dense else "predicted_sparse_s"  # a plan of an older version
    return float(plan.meta.get("predicted_iteration_s", chosen.get(key, float("nan"))))


class PlanTrial:
    """Two plans measured against each other: what it settles is whatever the two differ in —
    sparse or dense, the communicator, the density. Measures ``first`` and ``second`` in the block
    order :data:`SCHEDULE` (A B B A, so that a drift of the machine's speed during the trial hits
    both alike) and keeps the faster (of two densities, the denser unless the other measured
    more than :data:`~horovod_safusion.density.MARGIN` faster).

    Args:
        first: the plan predicted faster (in use when the trial starts).
        second: the other one.
        steps: measured steps per block.
        confirm_below: when the prediction was decisive: after the first block, ``first`` is
            kept without trying ``second`` if it measured below this many seconds (``second``'s
            predicted time); otherwise the trial goes on.
    """

    def __init__(self, first: FusionPlan, second: FusionPlan, steps: int = TRIAL_STEPS,
                 confirm_below: float | None = None) -> None:
        self.plans = (first, second)
        self.steps = steps
        self.confirm_below = confirm_below
        self.blocks: list[list[float]] = [[] for _ in SCHEDULE]
        self._block: int | None = 0
        self._skip = 1  # steps not measured: the first step on a plan allocates its buffers
        self.measured: list[float] | None = None

    def step_ends(self, seconds: float, process_set: Any) -> FusionPlan | None:
        """Record one step's seconds; returns the plan to switch to, if any (every rank alike).
        :attr:`done` tells when the trial has decided."""
        if self._skip:
            self._skip -= 1
            return None
        block = self.blocks[self._block]
        block.append(seconds)
        if len(block) < self.steps:
            return None
        self._block += 1
        if self._block == 1 and self.confirm_below is not None and self._confirmed(process_set):
            return None
        if self._block < len(SCHEDULE):
            if SCHEDULE[self._block] == SCHEDULE[self._block - 1]:
                return None
            self._skip = 1
            return self.plans[SCHEDULE[self._block]]
        return self._decide(process_set)

    def _confirmed(self, process_set: Any) -> bool:
        """Whether the first plan measured faster than the other was predicted (then it stays)."""
        first = float(np.median(self.blocks[0]))
        first = hvd.allreduce(torch.tensor([first], dtype=torch.float64), op=hvd.Max,
                              name=collective("saf.choice.confirm"), process_set=process_set).item()
        if first >= self.confirm_below:
            announce(f"{describe(self.plans[0])} measured {first:.3f} s/iteration, more than the "
                     f"{self.confirm_below:.3f} s predicted for {describe(self.plans[1])}: measuring both")
            return False
        self.measured, self._block = [first, float("nan")], None
        return True

    def _decide(self, process_set: Any) -> FusionPlan | None:
        per_plan = [float(np.mean([np.median(b) for b, k in zip(self.blocks, SCHEDULE) if k == i])) for i in (0, 1)]
        medians = hvd.allreduce(torch.tensor(per_plan, dtype=torch.float64), op=hvd.Max,
                                name=collective("saf.choice.measured"), process_set=process_set)
        self.measured = medians.tolist()
        self._block = None
        winner = int(np.argmin(self.measured))
        denser, factor = preferred(*(density_of(p) for p in self.plans))
        if denser is not None and self.measured[denser] <= factor * self.measured[1 - denser]:
            winner = denser  # density="auto": the denser plan unless the other is clearly faster
        first, second = self.plans
        expected = [predicted(p, first.meta) for p in self.plans]  # the planner's choice carries them
        announce(f"{describe(self.plans[winner])} chosen after measuring both: "
                 f"{describe(first)} {self.measured[0]:.3f} s/iteration, {describe(second)} {self.measured[1]:.3f} s "
                 f"(predicted: {expected[0]:.3f} s, {expected[1]:.3f} s); pass dense=True or dense=False, a "
                 "communicator or a density, to DistributedOptimizer to force either")
        return None if winner == SCHEDULE[-1] else self.plans[winner]

    def state_dict(self) -> dict:
        """Where the trial stands (JSON-safe), so that a resumed job finishes it."""
        return {"plans": [p.to_dict() for p in self.plans], "steps": self.steps,
                "confirm_below": self.confirm_below, "blocks": self.blocks,
                "block": self._block, "skip": self._skip, "measured": self.measured}

    @classmethod
    def from_state(cls, state: dict) -> "PlanTrial":
        trial = cls(*(FusionPlan.from_dict(p) for p in state["plans"]), steps=state["steps"],
                    confirm_below=state.get("confirm_below"))
        trial.blocks = [list(b) for b in state["blocks"]]
        trial._block, trial._skip, trial.measured = state["block"], state["skip"], state["measured"]
        return trial

    @property
    def done(self) -> bool:
        return self._block is None


def start(plan: FusionPlan) -> PlanTrial | None:
    """After planning: say what was planned, and start a trial against ``plan.meta``'s runner-up:
    a full one when the predictions are close, else a check that the chosen plan measures below
    the runner-up's prediction."""
    runner_up = plan.meta.get("runner_up")
    options = plan.meta.get("predicted_options_s") or {}
    if len(options) > 2 or plan.communicator is not None:
        announce(f"{describe(plan)} planned; predicted s/iteration: "
                 + ", ".join(f"{k} {v:.3f}" for k, v in options.items()))
    if runner_up is None:
        if plan.dense:
            announce("sending dense (dense=True)")
        return None
    other = FusionPlan.from_dict(runner_up)
    mine, theirs = predicted(plan, plan.meta), predicted(other, plan.meta)
    denser, factor = preferred(density_of(plan), density_of(other))
    if plan.density is not None:
        announce(f"density {plan.density:g} chosen: the highest whose predicted iteration is within "
                 f"{MARGIN:.0%} of the fastest option's ({mine:.3f} s; measured against {describe(other)}, "
                 f"predicted {theirs:.3f} s)")
    steps = block_steps(min(mine, theirs))
    if theirs > TRIAL_MARGIN * mine:
        if plan.dense:
            announce(f"dense allreduce predicted faster than sparse: {mine:.3f} s/iteration against "
                     f"{theirs:.3f} s; sending dense (pass dense=False to DistributedOptimizer to force sparse)")
        # the chosen plan stays if it measures below the other's prediction (times the margin
        # the denser of the two is allowed)
        return PlanTrial(plan, other, steps=steps,
                          confirm_below=theirs * (factor if denser == 0 else 1.0 / factor))
    return PlanTrial(plan, other, steps=steps)
