"""Online profiling and re-planning: the generator's loop of SAFusion §4 (Figure 12).

The optimizer starts on a provisional plan (one buffer per tensor). After ``settle_steps`` it
profiles ``profile_steps`` iterations: a :class:`ProfiledStep` watches the controller
(:mod:`horovod_safusion.observer`) and records when each gradient arrived and how long the plugin
worked in its hook (copy into the buffer, compression), so back-propagation's own pace can be
separated from the plugin's. Profiled steps run as any other: their collectives overlap
back-propagation as usual. At the end of the last profiled step, on every rank at the same
point (where a critical regime sends the next step dense, at the end of the first step before
one that it does not: :meth:`OnlineProfiler._dense_next`), short sweeps
(:mod:`horovod_safusion.sweeps`) measure the compressor (one buffer of each
size, locally, on a copy of the compressor) and the active communicator (one collective of each
message size, all ranks in lockstep; under ``communicator="auto"`` each communicator the job may
choose that can win at its worker count, :func:`~horovod_safusion.communicators.base.contenders`,
for planners that choose one, a contender slower than the best at its largest message not swept
further, :func:`~horovod_safusion.sweeps.communicator_sweeps`; under ``density="auto"`` the
compressor at each candidate density, :mod:`horovod_safusion.density`). Under critical regimes,
before the first profiled step, one dense allreduce in float32 and in float16 chooses the critical
steps' wire (:mod:`horovod_safusion.regime`), so that the critical steps during the profile gain
from it too. The communicator is timed by a sweep, not
inside the training step: Horovod reports no completion time for an asynchronous collective, and
waiting for one inside a gradient hook deadlocks ranks whose graphs differ (a parameter used on
one rank only). Measurements are reduced across ranks — back-propagation and compression times by the
element-wise maximum (the slowest rank sets the pace), collective times by the minimum (the last
rank to arrive sees the collective's own duration, the others also their wait for it); message
sizes are the same on every rank by construction. Each buffer's fixed work on the training thread
(starting its collective, decoding its result) is fitted from the profiled steps' spans
(:func:`fixed_cost`) and priced per buffer (:attr:`~horovod_safusion.fusion.Profile.buffer_cost`). So every rank builds the same
:class:`~horovod_safusion.fusion.Profile` and hence the same plan, and all switch at the same step.
Residuals are per parameter, so nothing is lost across the switch. What the sweeps cost the job
is in the profile's ``meta["sweeps_s"]`` (the slowest rank's seconds per sweep), and rank 0 says it. ``replan_every=R`` re-profiles
(on the current plan) every R steps.

Timestamps come from :class:`~horovod_safusion.clock.Clock`: ``time.perf_counter`` on CPU, CUDA
events on GPU (resolved at the end of the step, so hooks never wait for the device to measure
time).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np
import torch
import horovod.torch as hvd
from scipy.optimize import nnls

from . import sweeps, trial
from .announce import announce
from .clock import Clock
from .communicators.base import contenders
from .controller import Controller
from .fusion import CostCurve, Planner, Profile
from .compressors import loading
from .observer import DECOMPRESS, GRADIENT_READY, MEMCPY_OUT, SUBMIT, SYNCHRONIZE, Observer
from .plan import FusionPlan, TensorInfo, small_tensors
from .regime import CriticalRegimes
from .session import collective

#: Counted runs of each critical wire after its warm-up: one, the wire's time the faster of the
#: two. Where the link dominates, float16 takes about half of float32's time, which one run tells
#: unless a busy host slows it (the warm-up, as long, is the second sample); where it does not,
#: the two are close, one run can choose either, and either costs a critical step a short
#: allreduce. Each run more costs the job's first step an allreduce of the whole model on each wire.
WIRE_REPS = 1


class ProfiledStep(Observer):
    """The marks of one profiled step: its start (the previous step's end, or the script's
    ``zero_grad()`` after it), each gradient hook's start and end, the start of each buffer's
    collective, the decoding and write-back of each buffer, and the end of ``synchronize()``."""

    profiles = True

    def __init__(self, clock: Clock, start: Any) -> None:
        self.clock, self.mark = clock, clock.mark
        self.start = start
        self.hooks: list[tuple[str, Any, Any]] = []        # (tensor, hook start, hook end)
        self.launches: list[tuple[int, Any, Any]] = []     # (buffer, start of its collective's span)
        self.aggregations: list[tuple[int, Any, Any]] = []  # (buffer, decoding or write-back span)
        self.sync_end: Any = None

    def record(self, phase: str, start: Any, end: Any, args: dict | None) -> None:
        if phase == GRADIENT_READY:
            self.hooks.append((args["tensor"], start, end))
        elif phase == SUBMIT:
            self.launches.append((args["buffer"], start, end))
        elif phase == DECOMPRESS or phase == MEMCPY_OUT:
            self.aggregations.append((args["buffer"], start, end))
        elif phase == SYNCHRONIZE:
            self.sync_end = end

    def resolve(self, step_end: Any) -> dict:
        """Seconds: pure ready offsets per tensor, prefix and suffix, and per buffer the start of
        its collective (``launch``) and its decoding and write-back (``decode``)."""
        sec = self.clock.seconds
        ready, busy = {}, 0.0
        first = self.hooks[0][1] if self.hooks else self.sync_end
        for name, enter, leave in self.hooks:
            ready[name] = sec(first, enter) - busy
            busy += sec(enter, leave)
        launch: dict[int, float] = {}
        decode: dict[int, float] = {}
        for spans, into in ((self.launches, launch), (self.aggregations, decode)):
            for buffer, a, b in spans:
                into[buffer] = into.get(buffer, 0.0) + sec(a, b)
        # After the last collective: decoding and write-back of every buffer, then the optimizer's
        # own step. Waiting for collectives is communication, which the simulator models itself.
        suffix = sum(decode.values()) + sec(self.sync_end, step_end)
        return {"ready": ready, "prefix": sec(self.start, first), "suffix": suffix,
                "launch": launch, "decode": decode}


def fixed_cost(nbytes: Sequence[float], seconds: Sequence[float]) -> float:
    """The part of a per-buffer cost that does not grow with the buffer: the intercept ``a`` of
    ``seconds ≈ a + b · nbytes`` fitted non-negative (``scipy.optimize.nnls``) with relative
    errors, so that the small buffers, which tell the intercept, weigh as much as the large.
    0 where fewer than three sizes were measured (the intercept is not told apart)."""
    x = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if len(np.unique(x)) < 3:
        return 0.0
    a = np.stack([np.ones_like(x), x / max(float(x.max()), 1.0)], axis=1)
    w = 1.0 / np.maximum(t, 1e-6)
    (intercept, _), _ = nnls(a * w[:, None], t * w)
    return float(intercept)


class OnlineProfiler:
    """Drives provisional plan → profile → plan for planners that need a profile.

    Args:
        planner: the planner to switch to (``needs_profile`` planners profile first).
        tensors: the job's gradient tensors (registration-reversed order; the profile measures
            the real back-propagation order).
        dtypes: each tensor's dtype (for the bytes a selected element takes on the wire).
        process_set: the ranks that profile and switch together.
        profile_steps: K, iterations measured per profile. More average out noise.
        settle_steps: iterations skipped before profiling (caches, allocator, Horovod's warm-up).
        replan_every: re-profile and re-plan every this many steps; ``None`` plans once.
    """

    def __init__(self, planner: Planner, tensors: Sequence[TensorInfo], dtypes: dict[str, torch.dtype],
                 process_set: Any, profile_steps: int = 10, settle_steps: int = 1,
                 replan_every: int | None = None) -> None:
        if profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {profile_steps!r}")
        if settle_steps < 1:
            raise ValueError(f"settle_steps must be >= 1 (the first step has no previous step end), "
                             f"got {settle_steps!r}")
        if replan_every is not None and replan_every <= profile_steps:
            raise ValueError(f"replan_every must be larger than profile_steps={profile_steps}, "
                             f"got {replan_every!r}")
        self.planner = planner
        self.tensors, self.dtypes, self.process_set = list(tensors), dict(dtypes), process_set
        self.profile_steps = profile_steps
        self.settle_steps = settle_steps
        self.replan_every = replan_every
        self.profile: Profile | None = planner.profile
        self.steps = 0
        self._record_from = settle_steps
        self._samples: list[dict] = []
        self.local: dict = {}  # this rank's own measurements before the reduction, for inspection
        self.trial: trial.PlanTrial | None = None  # two plans measured against each other
        self._last_end: Any = None
        self._start: Any = None  # this step's start, where the script called zero_grad() (step_starts)
        self._watching: ProfiledStep | None = None  # the step being profiled
        #: a critical step's wire as timed before the first profiled step: the bytes, float32's
        #: and float16's seconds (the fastest rank's) and what timing them took (this rank's)
        self._wire: tuple[float, float, float, float] | None = None

    @property
    def active(self) -> bool:
        """Whether this profiler still has profiling to do (otherwise the optimizer can drop it)."""
        return self.planner.needs_profile and (self.profile is None or self.replan_every is not None
                                               or (self.trial is not None and not self.trial.done))

    def initial_plan(self) -> FusionPlan:
        """The planner's plan if it needs no measurements, else one buffer per tensor: sent dense
        where the planner was told to send dense (``dense=True``), so that such a job is Horovod's
        dense average from its first step, not only from its profiled plan on."""
        if not self.planner.needs_profile:
            return self.planner.plan(self.tensors)
        if self.profile is not None:
            return self.planner.plan(self.tensors, self.profile)
        return FusionPlan([[t.name] for t in self.tensors], order=self.planner.order, planner="provisional",
                          dense=self.planner.dense_choice is True)

    def restart(self) -> None:
        """Profile again from the next step on (after ``settle_steps``), on the current plan: after
        a change of world size, whose costs differ. Every rank must restart at the same step."""
        if not self.planner.needs_profile:
            return
        self.profile, self._samples, self._wire = None, [], None
        self._record_from = self.steps + self.settle_steps

    def add(self, tensors: Sequence[TensorInfo], dtypes: dict[str, torch.dtype]) -> None:
        """Tensors that joined the job (the controller appended them to its plan): planned from now
        on. A profile does not know them, so a profiled planner profiles again (and a dense
        trial under way, whose plans lack them, stops). Every rank adds at the same step."""
        self.tensors += tensors
        self.dtypes.update(dtypes)
        if self.planner.needs_profile:
            self.trial = None
            self.restart()

    def state_dict(self) -> dict:
        """Where the loop stands: steps, the next profiled step and the profile (JSON). Timings of a
        profile under way are not kept: a resumed job measures that profile again."""
        return {"steps": self.steps, "record_from": self._record_from,
                "profile": None if self.profile is None else json.dumps(self.profile.to_dict()),
                "trial": None if self.trial is None else json.dumps(self.trial.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.profile = None if state["profile"] is None else Profile.from_dict(json.loads(state["profile"]))
        saved = state.get("trial")
        self.trial = None if saved is None else trial.PlanTrial.from_state(json.loads(saved))
        self._samples = []
        record_from = state["record_from"]
        # a profile under way starts again at the next step
        self._record_from = None if record_from is None else max(int(record_from), self.steps)

    def stop_trial(self) -> None:
        """End a trial under way where it stands (a plan set from outside takes over)."""
        self.trial = None

    def reset_step(self, controller: Controller) -> None:
        """Forget the step being profiled, if any (a step abandoned, a state loaded)."""
        if self._watching is not None:
            controller.unobserve(self._watching)
            self._watching = None

    # ---- called by the optimizer: zero_grad() before a step, the end of every step() ------------
    def step_starts(self, device: torch.device) -> None:
        """The script cleared the gradients for the next step (``zero_grad()``): that step is timed
        from here, for the trial and as the profile's forward pass, rather than from the previous
        step's end. Where a script evaluates, logs or saves between its steps, that work would
        otherwise count as the step of whichever plan the trial measures then, a random one."""
        if self._last_end is None:
            return
        self._start = Clock(device).mark()
        if self._watching is not None:
            self._watching.start = self._start

    def step_ends(self, controller: Controller) -> None:
        """Take the profiled step's marks; run the plan trial; after the last profiled step (or
        the first after it whose next step is not a critical regime's, :meth:`_dense_next`),
        build the profile and switch every rank to the planner's plan; watch the next step if it
        is to be profiled."""
        clock = Clock(controller.device)
        now = clock.mark()
        if self._watching is not None:
            self._samples.append(self._watching.resolve(now))
            self.reset_step(controller)
        self.steps += 1
        # (not after a resume, and not at a warm-up's or a critical regime's density: those steps
        # do not time the plan)
        if self.trial is not None and not self.trial.done and self._last_end is not None \
                and not controller.off_target:
            began = self._last_end if self._start is None else self._start
            switch = self.trial.step_ends(clock.seconds(began, now), self.process_set)
            if switch is not None:
                controller.switch_plan(switch)
        self._last_end, self._start = now, None
        if len(self._samples) == self.profile_steps and not self._dense_next(controller):
            self.profile = self.build_profile(controller)
            announce_sweeps(self.profile.meta)
            plan = self.planner.plan(self.tensors, self.profile)
            controller.switch_plan(plan)
            self.trial = trial.start(plan)
            self._samples = []
            self._record_from = self.steps + self.replan_every - self.profile_steps if self.replan_every else None
        if self._record_from is not None and self.steps >= self._record_from \
                and len(self._samples) < self.profile_steps:
            if self.profile is None and self._wire is None and self._weighs_half(controller):
                self._wire = self._time_wires(controller)
                now = self._last_end = clock.mark()  # the next step starts after the timing
            self._watching = ProfiledStep(clock, now)
            controller.observe(self._watching)

    @staticmethod
    def _dense_next(controller: Controller) -> bool:
        """Whether the next step belongs to a critical regime, which sends dense whatever the plan
        (decided alike on every rank, :mod:`~horovod_safusion.regime`): the profile's sweeps and
        the planning then wait for the first step that is not, so that a sparse plan is priced
        when it is about to be used, and a job whose steps all go dense pays for no sweeps."""
        return controller.regimes is not None and controller.regimes.critical

    # ---- measurements → profile ----------------------------------------------------------------
    def build_profile(self, controller: Controller) -> Profile:
        """Reduce the recorded steps and the sweeps across ranks into one shared profile."""
        tensors, process_set = self.tensors, self.process_set
        names = [t.name for t in tensors]
        s = self._samples
        ready = [float(np.median([x["ready"].get(n, np.nan) for x in s])) for n in names]
        ready = [0.0 if np.isnan(r) else r for r in ready]
        prefix = float(np.median([x["prefix"] for x in s]))
        suffix = float(np.median([x["suffix"] for x in s]))
        buffer_cost, suffix = self._buffer_cost(controller, suffix)
        dtype = self.dtypes[max(tensors, key=lambda t: t.numel).name]  # the sweeps' data
        device = controller.device
        comp = controller.compressor
        comm = controller.communicator
        numels = [t.numel for t in tensors]
        took: dict[str, float] = {}  # each sweep's seconds, for meta["sweeps_s"] (the slowest rank's)
        timed = sweeps.Stopwatch(took)
        # one worker has no link to price: it keeps sparsifying as each worker of a job does
        linked = not comp.dense and not comm.dense and process_set.size() > 1
        priced = linked and self.planner.prices_dense
        # dense=True prices its dense plan alone: no selection or sparse collective to time
        only_dense = priced and self.planner.dense_choice is True
        candidates = controller.densities if linked and self.planner.chooses_density and not only_dense else ()
        if only_dense:
            cp_sizes, cp_secs, per_segment = sweeps.uncompressed(numels, dtype)
            at_density = []
        else:
            loading.wait()  # no kernel loading beside the compressor's timing
            source = sweeps.sweep_source(controller.flats(), max(numels), dtype, device)
            cp_sizes, cp_secs, per_segment = timed(
                "compression", lambda: sweeps.compression_sweep(comp, numels, source, controller.target_density))
            at_density = timed("densities", lambda: [sweeps.compression_sweep(comp, numels, source, d)
                                                     for d in candidates]) if candidates else []
            del source
        chooses = linked and self.planner.chooses_communicator and len(controller.communicators) > 1 \
            and not only_dense
        choices = contenders(controller.communicators, process_set.size(), comm.name) if chooses else {comm.name: comm}
        # the message sizes of the densest candidate, spread tensors at their floors: the curves
        # price every candidate's messages
        floors = controller.floors()
        densest = max((controller.target_density, *candidates))
        if floors:
            total = sum(t.numel for t in tensors)
            densest = sum(t.numel * max(densest, floors.get(t.name, 0.0)) for t in tensors) / max(1, total)
        swept, pruned = ({}, {}) if only_dense else sweeps.communicator_sweeps(
            choices, tensors, densest, dtype, device, comm.name, process_set, timed)
        # the tensors the job sends whole at any density it may select at, which the planner prices
        # as sent: by the dense allreduce, swept up to their bytes where dense plans are not priced
        min_selected = 0 if comp.dense else controller.min_selected
        numel = {t.name: t.numel for t in tensors}
        whole = set().union(*(small_tensors(names, numel, d, min_selected, controller.dense_share)
                              for d in (controller.target_density, *candidates))) \
            if linked and self.planner.prices_whole and not only_dense else set()
        dense_swept = tensors if priced else [t for t in tensors if t.name in whole]
        # the largest size's float32 time is the wire's, where that was timed (the same compression)
        known = self._wire[1] if self._wire is not None and priced else None
        dense_bytes, dense_secs = timed("dense_allreduce", lambda: sweeps.dense_allreduce_sweep(
            comm.compression, dense_swept, dtype, device, process_set, largest_s=known)) if dense_swept else ([], [])
        if self._wire is not None and self.profile is None:  # (a first profile: what it cost)
            took["wires"] = self._wire[3]
        self.local = {"ready": dict(zip(names, ready)), "prefix": prefix, "suffix": suffix}

        # each step's phases and each selection's time are the slowest rank's
        slowest = reduce_by_name({"ready": ready, "prefix": [prefix], "suffix": [suffix], "segment_cost": [per_segment],
                                  "buffer_cost": [buffer_cost], "sweeps_s": list(took.values()),
                                  "compress": cp_secs,
                                  **{f"compress@{d}": secs for d, (_, secs, _) in zip(candidates, at_density)},
                                  **{f"segment_cost@{d}": [seg] for d, (_, _, seg) in zip(candidates, at_density)}},
                                 hvd.Max, "saf.profile.max", process_set)
        # a message's size is the same on every rank (sweeps.communication_sweep); its time is
        # the fastest rank's, the one that did not wait for the others to arrive
        fastest = reduce_by_name({**{f"communicate:{name}": secs for name, (_, secs) in swept.items()},
                                  "dense_allreduce": dense_secs},
                                 hvd.Min, "saf.profile.min", process_set)
        curves = {name: CostCurve(nbytes, fastest[f"communicate:{name}"]) for name, (nbytes, _) in swept.items()}
        dense_curve = CostCurve(dense_bytes, fastest["dense_allreduce"]) if dense_swept else None
        ready, cp_secs = slowest["ready"], slowest["compress"]
        prefix, suffix, per_segment = slowest["prefix"][0], slowest["suffix"][0], slowest["segment_cost"][0]
        buffer_cost = slowest["buffer_cost"][0]
        densities = {d: (CostCurve(sizes, slowest[f"compress@{d}"]), slowest[f"segment_cost@{d}"][0])
                     for d, (sizes, _, _) in zip(candidates, at_density)}
        order = sorted(range(len(names)), key=lambda i: (ready[i], i))
        wire = sweeps.wire_bytes(comm.compression, {t.name: self.dtypes[t.name] for t in tensors})
        return Profile(
            tensors=[tensors[i] for i in order], ready=[ready[i] for i in order], prefix=prefix, suffix=suffix,
            compress=CostCurve(cp_sizes, cp_secs), segment_cost=per_segment, buffer_cost=buffer_cost,
            communicate=dense_curve if only_dense else curves[comm.name],
            density=1.0 if comp.dense else comp.density, wire_bytes=wire, dense_comm=comm.dense,
            workers=process_set.size(),
            dense_allreduce=dense_curve,
            communicators=curves if chooses else {}, densities=densities, floors=floors,
            min_selected=min_selected, dense_share=controller.dense_share, prices_dense=priced,
            meta={"compressor": repr(comp), "communicator": comm.name, "iterations": len(s),
                  "profiled_plan": controller.plan.planner, "step": self.steps,
                  "sweeps_s": {k: round(v, 4) for k, v in zip(took, slowest["sweeps_s"])},
                  "pruned": {name: asdict(p) for name, p in pruned.items()}})

    def _weighs_half(self, controller: Controller) -> bool:
        """Whether this job chooses its critical steps' wire (:mod:`~horovod_safusion.regime`): it
        sparsifies across workers under critical regimes, with no wire compression of its own,
        and its largest tensor is float32."""
        comp, comm = controller.compressor, controller.communicator
        largest = max(self.tensors, key=lambda t: t.numel)
        return not comp.dense and not comm.dense and self.process_set.size() > 1 \
            and controller.regimes is not None and comm.compression is hvd.Compression.none \
            and self.dtypes[largest.name] == torch.float32

    def _time_wires(self, controller: Controller) -> tuple[float, float, float, float]:
        """A critical step's two wires timed and chosen, before the first profiled step, so that
        the critical steps before the profile go as float16 too where that pays: one dense
        allreduce of the dense sweep's largest size in float32 and in float16 (collectives), each
        a warm-up and :data:`WIRE_REPS` counted run, the least of them
        (:func:`~horovod_safusion.sweeps.time_collective`'s ``least``: one run slowed by a busy
        host does not choose the wire), the fastest rank's times (:meth:`choose_critical_wire`).
        Float16 goes first; where it took :data:`~horovod_safusion.sweeps.ONE_RUN_S` or more, the
        link dominates, and float32 is timed by one run right after it, with no warm-up of its own
        (the slowest collective of the profile, run once less). Returns the bytes, the two times
        and this rank's seconds spent; the profile's dense sweep takes float32's time as its own
        largest point rather than timing it again."""
        ps, device = self.process_set, controller.device
        dtype = torch.float32
        start = time.perf_counter()
        nbytes, half = sweeps.dense_allreduce_sweep(hvd.Compression.fp16, self.tensors, dtype, device, ps, largest=True,
                                                    reps=WIRE_REPS, least=True)
        float16_s = reduce_by_name({"wire": half}, hvd.Min, "saf.profile.wire.float16", ps)["wire"][0]
        # the same on every rank (the fastest rank's time): no warm-up where it was slow
        warm = float16_s < sweeps.ONE_RUN_S
        _, full = sweeps.dense_allreduce_sweep(hvd.Compression.none, self.tensors, dtype, device, ps, largest=True,
                                               reps=WIRE_REPS, warm=warm, least=True)
        float32_s = reduce_by_name({"wire": full}, hvd.Min, "saf.profile.wire.float32", ps)["wire"][0]
        self.choose_critical_wire(controller.regimes, float32_s, float16_s, nbytes[0])
        return nbytes[0], float32_s, float16_s, time.perf_counter() - start

    @staticmethod
    def choose_critical_wire(regimes: CriticalRegimes, float32_s: float, float16_s: float, nbytes: float) -> None:
        """Float16 or float32 for critical steps, from one dense allreduce of ``nbytes`` timed in
        each (the same on every rank); rank 0 says what was chosen."""
        wire = "float16, rounding error kept" if regimes.choose_wire(float32_s, float16_s) else "float32"
        announce(f"critical steps go as {wire} (a dense allreduce of {nbytes / 1e6:.2f} MB: "
                 f"{float32_s * 1e3:.1f} ms in float32, {float16_s * 1e3:.1f} ms in float16)")

    def _buffer_cost(self, controller: Controller, suffix: float) -> tuple[float, float]:
        """The fixed work per buffer (:attr:`Profile.buffer_cost`) from the profiled steps: the
        intercepts, against the buffer's dense bytes, of starting its collective and of decoding
        it (medians over the steps, per buffer of the plan profiled); and ``suffix`` without the
        decoding's fixed part, which the profiled plan paid once per buffer and a plan of another
        number of buffers pays as often as it has buffers."""
        nbytes = {b.index: float(sum(p.numel() * p.element_size() for p in b.params)) for b in controller.buffers}
        s = self._samples
        intercepts = []
        for phase in ("launch", "decode"):
            spans = {i: float(np.median([x[phase].get(i, 0.0) for x in s])) for i in nbytes}
            intercepts.append(fixed_cost([nbytes[i] for i in spans], list(spans.values())))
        after = float(np.median([x["suffix"] - sum(x["decode"].values()) for x in s]))
        return sum(intercepts), max(after, suffix - len(nbytes) * intercepts[1])


def announce_sweeps(meta: dict) -> None:
    """Rank 0 says what the profile's sweeps cost (``meta["sweeps_s"]``) and which contenders
    were not priced past their largest message (``meta["pruned"]``)."""
    took = meta["sweeps_s"]
    announce(f"profile's sweeps took {sum(took.values()):.2f} s ("
             + ", ".join(f"{name} {s:.2f}" for name, s in took.items()) + ")")
    for name, p in meta["pruned"].items():
        announce(f"{name} not priced further: {p['seconds'] * 1e3:.1f} ms for a message of "
                 f"{p['nbytes'] / 1e3:.1f} kB, against {p['best_seconds'] * 1e3:.1f} ms over {p['best']}")


def reduce_by_name(records: dict[str, list[float]], op: int, name: str, process_set: Any) -> dict[str, list[float]]:
    """Every record reduced across the ranks of ``process_set`` by ``op``, element by element, in
    one allreduce (a collective). Every rank holds the same names with the same lengths, in the
    same order (they come from the same plan and the same sweeps)."""
    flat = torch.tensor([v for values in records.values() for v in values], dtype=torch.float64)
    reduced = iter(hvd.allreduce(flat, op=op, name=collective(name), process_set=process_set).tolist())
    return {key: [next(reduced) for _ in values] for key, values in records.items()}
