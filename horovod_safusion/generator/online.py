"""Online profiling and re-planning: the generator's loop of SAFusion §4 (Figure 12).

The optimizer starts on a provisional plan (one buffer per tensor). After ``warmup_steps`` it
profiles ``profile_steps`` iterations: every hook records when its gradient arrived and how long
the plugin worked in it (copy into the buffer, compression), so back-propagation's own pace can be
separated from the plugin's. At the end of the last profiled step, on every rank at the same
point, a short sweep measures the compressor (one buffer of each size, locally, on a copy of the
compressor) and the active communicator (one collective of each message size, all ranks in
lockstep). The communicator is timed by this sweep, not inside the training step: Horovod reports
no completion time for an asynchronous collective, and waiting for one inside a gradient hook
deadlocks ranks whose graphs differ (a parameter used on one rank only). Measurements are reduced
across ranks — back-propagation and compression times by the element-wise maximum (the slowest
rank sets the pace), collective times by the minimum (the last rank to arrive sees the
collective's own duration, the others also their wait for it), message sizes by the maximum — so every rank builds the same
:class:`Profile` and hence the same plan, and all switch at the same step. Residuals are per parameter, so nothing is lost across the switch. ``replan_every=R``
re-profiles (on the current plan) every R steps.

Timestamps come from :class:`Clock`: ``time.perf_counter`` on CPU, CUDA events on GPU (resolved
at the end of the step, so hooks never wait for the device to measure time).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import horovod.torch as hvd

from ..clock import Clock
from ..plan import FusionPlan, check_plan_across_ranks
from ..segment import Segments
from ..communicators.base import Outgoing, Reduction, wait
from . import choice
from .base import Planner, TensorInfo
from .costs import CostCurve
from .profile import Profile

SWEEP_POINTS = 12
#: The dense allreduce is timed up to this many bytes and extrapolated linearly beyond (it costs
#: latency + bytes / bandwidth), so that pricing it on a slow link takes seconds, not minutes.
DENSE_SWEEP_BYTES = 4 << 20


@dataclass
class StepRecorder:
    """Marks of one profiled step, filled by the controller's hooks."""

    clock: Clock
    previous_end: Any
    hooks: list = field(default_factory=list)      # (name, enter mark, exit mark)
    aggregations: list = field(default_factory=list)  # (decode start, write-back end) per buffer
    sync_end: Any = None
    _pending: tuple | None = None

    def gradient_ready(self, name: str) -> None:
        self._pending = (name, self.clock.mark())

    def hook_done(self) -> None:
        name, enter = self._pending
        self.hooks.append((name, enter, self.clock.mark()))

    def aggregated(self, t0: Any, t1: Any) -> None:
        self.aggregations.append((t0, t1))

    def synchronized(self) -> None:
        self.sync_end = self.clock.mark()

    def resolve(self, step_end: Any) -> dict:
        """Seconds: pure ready offsets per tensor, prefix and suffix."""
        sec = self.clock.seconds
        ready, busy = {}, 0.0
        first = self.hooks[0][1] if self.hooks else self.sync_end
        for name, enter, leave in self.hooks:
            ready[name] = sec(first, enter) - busy
            busy += sec(enter, leave)
        # After the last collective: decoding and write-back of every buffer, then the optimizer's
        # own step. Waiting for collectives is communication, which the simulator models itself.
        suffix = sum(sec(a, b) for a, b in self.aggregations) + sec(self.sync_end, step_end)
        return {"ready": ready, "prefix": sec(self.previous_end, first), "suffix": suffix}


class OnlineGenerator:
    """Drives provisional plan → profile → plan for planners that need a profile.

    Args:
        planner: the planner to switch to (``needs_profile`` planners profile first).
        profile_steps: K, iterations measured per profile. More average out noise.
        warmup_steps: iterations skipped before profiling (caches, allocator, Horovod's warm-up).
        replan_every: re-profile and re-plan every this many steps; ``None`` plans once.
    """

    def __init__(self, planner: Planner, profile_steps: int = 10, warmup_steps: int = 1,
                 replan_every: int | None = None) -> None:
        if profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {profile_steps!r}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (the first step has no previous step end), "
                             f"got {warmup_steps!r}")
        if replan_every is not None and replan_every <= profile_steps:
            raise ValueError(f"replan_every must be larger than profile_steps={profile_steps}, "
                             f"got {replan_every!r}")
        self.planner = planner
        self.profile_steps = profile_steps
        self.warmup_steps = warmup_steps
        self.replan_every = replan_every
        self.profile: Profile | None = getattr(planner, "profile", None)
        self.steps = 0
        self._record_from = warmup_steps
        self._samples: list[dict] = []
        self.local: dict = {}  # this rank's own measurements before the reduction, for inspection
        self.trial: choice.DenseTrial | None = None  # sparse against dense, measured
        self._last_end: Any = None

    @property
    def active(self) -> bool:
        """Whether this generator still has profiling to do (otherwise the optimizer can drop it)."""
        return self.planner.needs_profile and (self.profile is None or self.replan_every is not None
                                               or (self.trial is not None and not self.trial.done))

    def initial_plan(self, tensors: Sequence[TensorInfo]) -> FusionPlan:
        """The planner's plan if it needs no measurements, else one buffer per tensor."""
        if not self.planner.needs_profile:
            return self.planner.plan(tensors)
        if self.profile is not None:
            return self.planner.plan(tensors, self.profile)
        return FusionPlan([[t.name] for t in tensors], order=self.planner.order, planner="provisional")

    def restart(self) -> None:
        """Profile again from the next step on (after ``warmup_steps``), on the current plan: after
        a change of world size, whose costs differ. Every rank must restart at the same step."""
        if not self.planner.needs_profile:
            return
        self.profile, self._samples = None, []
        self._record_from = self.steps + self.warmup_steps

    def state_dict(self) -> dict:
        """Where the loop stands: steps, the next profiled step and the profile (JSON). Timings of a
        profile under way are not kept: a resumed job measures that profile again."""
        return {"steps": self.steps, "record_from": self._record_from,
                "profile": None if self.profile is None else json.dumps(self.profile.to_dict()),
                "trial": None if self.trial is None else json.dumps(self.trial.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.profile = None if state["profile"] is None else Profile.from_dict(json.loads(state["profile"]))
        trial = state.get("trial")
        self.trial = None if trial is None else choice.DenseTrial.from_state(json.loads(trial))
        self._samples = []
        record_from = state["record_from"]
        # a profile under way starts again at the next step
        self._record_from = None if record_from is None else max(int(record_from), self.steps)

    # ---- called by the optimizer at the end of every step() ------------------------------------
    def step_ends(self, controller, tensors: Sequence[TensorInfo], process_set) -> None:
        clock = Clock(controller.buffers[0].device)
        now = clock.mark()
        if controller.recorder is not None:
            self._samples.append(controller.recorder.resolve(now))
            controller.recorder = None
        self.steps += 1
        # (not after a resume, and not while the density warms up: those steps do not time the plan)
        if self.trial is not None and not self.trial.done and self._last_end is not None \
                and not controller.warming_up:
            switch = self.trial.step_ends(clock.seconds(self._last_end, now), process_set)
            if switch is not None:
                controller.set_plan(switch)
                check_plan_across_ranks(switch, process_set)
        self._last_end = now
        if len(self._samples) == self.profile_steps:
            self.profile = self.build_profile(controller, tensors, process_set)
            plan = self.planner.plan(tensors, self.profile)
            controller.set_plan(plan)
            check_plan_across_ranks(plan, process_set)
            self.trial = choice.start(plan)
            self._samples = []
            self._record_from = self.steps + self.replan_every - self.profile_steps if self.replan_every else None
        if self._record_from is not None and self.steps >= self._record_from:
            controller.recorder = StepRecorder(clock, now)

    # ---- measurements → profile ----------------------------------------------------------------
    def build_profile(self, controller, tensors: Sequence[TensorInfo], process_set) -> Profile:
        """Reduce the recorded steps and the sweeps across ranks into one shared profile."""
        names = [t.name for t in tensors]
        s = self._samples
        ready = [float(np.median([x["ready"].get(n, np.nan) for x in s])) for n in names]
        ready = [0.0 if np.isnan(r) else r for r in ready]
        prefix = float(np.median([x["prefix"] for x in s]))
        suffix = float(np.median([x["suffix"] for x in s]))
        buf = max(controller.buffers, key=lambda b: b.numel)
        comp = planned_compressor(controller)
        cp_sizes, cp_secs, per_segment = compression_sweep(comp, [t.numel for t in tensors], buf.dtype, buf.device)
        cm_bytes, cm_secs = communication_sweep(controller, tensors, process_set)
        # one worker has no link to price: it keeps sparsifying as each worker of a job does
        priced = (getattr(self.planner, "prices_dense", False) and not comp.dense
                  and not controller.communicator.dense and process_set.size() > 1)
        dense_bytes, dense_secs = dense_allreduce_sweep(controller, tensors, process_set) if priced else ([], [])
        self.local = {"ready": dict(zip(names, ready)), "prefix": prefix, "suffix": suffix}

        slowest = _allreduce(ready + [prefix, suffix, per_segment] + cp_secs, hvd.Max, "safusion.profile.max",
                             process_set)
        fastest = _allreduce(cm_secs + dense_secs, hvd.Min, "safusion.profile.min", process_set)
        cm_secs, dense_secs = fastest[:len(cm_secs)], fastest[len(cm_secs):]
        # what a rank sends depends on its data in some protocols (ZEN's hash partitions): the
        # curve's sizes must be the same on every rank, or so would not be the plans
        cm_bytes = _allreduce(cm_bytes, hvd.Max, "safusion.profile.bytes", process_set)
        L, C = len(names), len(cp_secs)
        ready, (prefix, suffix, per_segment), cp_secs = slowest[:L], slowest[L:L + 3], slowest[L + 3:L + 3 + C]

        order = sorted(range(L), key=lambda i: (ready[i], i))
        comm = controller.communicator
        wire = _wire_bytes(comm, {t.name: controller.params[t.name].dtype for t in tensors})
        return Profile(
            tensors=[tensors[i] for i in order], ready=[ready[i] for i in order], prefix=prefix, suffix=suffix,
            compress=CostCurve(cp_sizes, cp_secs), segment_cost=per_segment, communicate=CostCurve(cm_bytes, cm_secs),
            density=1.0 if comp.dense else comp.density, wire_bytes=wire, dense_comm=comm.dense,
            workers=process_set.size(), dense_allreduce=CostCurve(dense_bytes, dense_secs) if priced else None,
            meta={"compressor": repr(comp), "communicator": comm.name, "iterations": len(s),
                  "profiled_plan": controller.plan.planner, "step": self.steps})


def planned_compressor(controller):
    """The job's compressor at the density the plan is for (a copy during a density warm-up, whose
    steps select more): plans are made for the steady state."""
    comp = controller.compressor
    if comp.dense or comp.density == controller.target_density:
        return comp
    comp = copy.deepcopy(comp)
    comp.density = controller.target_density
    return comp


def _allreduce(values: list[float], op: int, name: str, process_set) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    return hvd.allreduce(t, op=op, name=name, process_set=process_set).tolist()


def _wire_bytes(communicator, dtypes: dict[str, torch.dtype]) -> dict[str, int]:
    """Bytes per selected element on the wire: the (possibly fp16-compressed) value + int32 index."""
    return {name: communicator.compression.compress(torch.zeros(1, dtype=dtype))[0].element_size() + 4
            for name, dtype in dtypes.items()}


def _sizes(lo: int, hi: int) -> list[int]:
    return sorted({int(round(v)) for v in np.geomspace(max(1, lo), max(1, hi), SWEEP_POINTS)})


def time_compression(compressor, seg_sizes: Sequence[int], dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu", steps: int = 10) -> float:
    """Mean seconds of one selection (with residual bookkeeping) of a buffer cut into ``seg_sizes``,
    on a copy of ``compressor`` so that the caller's state is untouched."""
    from ..controller import sparsify

    device = torch.device(device)
    comp = copy.deepcopy(compressor)
    seg = Segments(tuple(f"sweep.{i}" for i in range(len(seg_sizes))), tuple(seg_sizes), device)
    data = torch.randn(seg.numel, dtype=dtype, device=device)
    flat = data.clone()
    sparsify(comp, flat, seg, 0)  # warm-up
    clock = Clock(device)
    a = clock.mark()
    for step in range(1, steps + 1):
        flat.copy_(data)
        sparsify(comp, flat, seg, step)
    return clock.seconds(a, clock.mark()) / steps


def compression_sweep(compressor, numels: Sequence[int], dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> tuple[list[int], list[float], float]:
    """Compression cost curve of ``compressor`` over the size range of ``numels``.

    Returns the swept dense sizes in bytes, the seconds to compress a one-segment buffer of each,
    and the extra seconds per additional segment (a buffer cut into 16 segments against one),
    because the controller selects a whole buffer in one pass. The first two are a
    :class:`CostCurve`'s points.
    """
    sizes = _sizes(min(numels), max(numels))
    element = torch.empty((), dtype=dtype).element_size()
    if compressor.dense:
        return [n * element for n in sizes], [0.0] * len(sizes), 0.0
    seconds = [time_compression(compressor, (n,), dtype, device) for n in sizes]
    n = max(16, int(np.median(numels)) * 16)
    per_segment = max(0.0, (time_compression(compressor, (n // 16,) * 16, dtype, device)
                            - time_compression(compressor, (n // 16 * 16,), dtype, device)) / 15)
    return [n * element for n in sizes], seconds, per_segment


def communication_sweep(controller, tensors: Sequence[TensorInfo], process_set,
                        reps: int = 3) -> tuple[list[float], list[float]]:
    """Seconds of one collective of the job's communicator for swept message sizes (all ranks)."""
    comm = controller.communicator
    buf = max(controller.buffers, key=lambda b: b.numel)
    total = sum(t.numel for t in tensors)
    density = controller.target_density
    most = total if comm.dense else max(1, int(1.5 * density * total) + len(tensors))
    clock = Clock(buf.device)
    nbytes, seconds = [], []
    for j, count in enumerate(_sizes(1, most)):
        numel = count if comm.dense or density >= 1.0 else max(count, int(count / density))
        values = torch.randn(count, dtype=buf.dtype, device=buf.device)
        indices = None if comm.dense else torch.arange(count, device=buf.device) * (numel // count)
        times = []
        for r in range(reps + 1):  # the first run warms Horovod's caches up and is not counted
            a = clock.mark()
            pending = comm.start(Outgoing(f"sweep.{j}", values, indices, numel), Reduction(hvd.Sum))
            pending.wait()
            if r:
                times.append(clock.seconds(a, clock.mark()))
        nbytes.append(float(pending.bytes_sent))
        seconds.append(float(np.median(times)))
    comm.release_outputs("sweep.")
    return nbytes, seconds


def dense_allreduce_sweep(controller, tensors: Sequence[TensorInfo], process_set,
                          reps: int = 2) -> tuple[list[float], list[float]]:
    """Seconds of one Horovod dense allreduce for swept buffer sizes up to the model's gradient
    bytes or :data:`DENSE_SWEEP_BYTES`, whichever is smaller (all ranks): the price of sending
    dense, for the planner's dense choice."""
    buf = max(controller.buffers, key=lambda b: b.numel)
    element = torch.empty((), dtype=buf.dtype).element_size()
    total = sum(t.numel for t in tensors)
    compression = controller.communicator.compression
    clock = Clock(buf.device)
    nbytes, seconds = [], []
    for j, count in enumerate(_sizes(1024, min(total, DENSE_SWEEP_BYTES // element))):
        dense = torch.randn(count, dtype=buf.dtype, device=buf.device)
        times = []
        for r in range(reps + 1):  # the first run warms Horovod's caches up and is not counted
            a = clock.mark()
            sent, ctx = compression.compress(dense)
            wait(hvd.allreduce_async_(sent, name=f"safusion.sweep.dense.{j}", op=hvd.Sum, process_set=process_set))
            compression.decompress(sent, ctx)
            if r:
                times.append(clock.seconds(a, clock.mark()))
        nbytes.append(float(count * element))
        seconds.append(float(np.median(times)))
    return nbytes, seconds
