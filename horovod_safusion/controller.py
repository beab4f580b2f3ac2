"""Controller: push sparsified gradients into fusion buffers and pull aggregated ones back.

SAFusion §4 "Controller module" and §3.1 Steps 1–3. The controller keeps the mapping
tensor → fusion buffer (:class:`~horovod_safusion.buffer.FusionBuffer`) of the current
:class:`FusionPlan` and runs each gradient through the stages of :mod:`horovod_safusion.stages`:

1. at a step's first gradient, its :class:`~horovod_safusion.stages.mode.StepMode` (dense or
   sparse, density, loss-scale ratio), decided once;
2. :mod:`~horovod_safusion.stages.fill` — the gradient, clipped and momentum-corrected, plus its
   error-feedback residual into its segment of the buffer;
3. when the buffer's last tensor is in, :mod:`~horovod_safusion.stages.select` — one selection
   over the buffer (the buffer's flat tensor *is* where the residuals live: the unselected rest
   stays in place) — and :mod:`~horovod_safusion.stages.send` — ONE asynchronous collective,
   overlapping the rest of back-propagation;
4. :meth:`Controller.synchronize` starts every buffer that has not started (so no rank hangs when a
   parameter got no gradient), :mod:`~horovod_safusion.stages.flags` starts the step's flags (or
   the plan's last buffer carries them, where it goes dense), and
   :mod:`~horovod_safusion.stages.collect` writes each aggregate into ``p.grad``.

It reports its phases to whoever observes the step (:mod:`horovod_safusion.observer`: the online
profiler, the timeline).

Four rules keep error feedback exact in real training loops (the stages' docstrings say how):

* **No gradient here** (a frozen parameter, one unused in this rank's forward, or ``step()``
  without ``backward()``): the parameter sends zeros and its residual stays as it is. A parameter
  that got a gradient on no rank keeps the ``.grad`` it had (``None`` after ``zero_grad()``), so
  the wrapped optimizer does not move it at all; one that got one on some ranks receives the
  aggregate as usual. ``residual_after + sent == residual_before + grad`` holds per parameter with
  ``grad = 0`` and ``sent = 0``.
* **Non-finite gradients**: on a sparse step a non-finite element does not join the residual; if
  any rank dropped one, every gradient of the step arrives as NaN on every rank, and every rank
  takes back what it sent into its residuals. A dense step lets a NaN through, as Horovod does.
* **Loss scaling**: residuals are kept at the loss scale of the step that made them.
* **Wire rounding**: what ``Compression.fp16`` rounds off stays in the residual, and so does what
  a critical step sent as float16 rounds off (:mod:`~horovod_safusion.stages.half`); a float16
  aggregate that is not finite is sent again in float32, so a NaN still gets through as it would.

DGC's accuracy techniques (:mod:`~horovod_safusion.momentum`, :mod:`~horovod_safusion.warmup`) act
on what enters the residual: local clipping, then momentum correction (the residual accumulates
momentum ``u``, so the invariant reads ``residual_after + sent == residual_before + u``; masking
clears ``u`` where a sparse step sent, in every tensor or, by default, in those whose gradient is
spread; with EF21-SGDM the residual accumulates ``u``'s increment instead, and nothing is masked),
and a warm-up that sets the density of each step — a step at density 1 is sent dense. Which
gradients are spread every rank agrees on by the step's flags (:mod:`~horovod_safusion.spread`);
by default a spread tensor selects at no less than a floor from the step after (its buffer's
selection segments carry the floors).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Container, Sequence

import torch

from . import checkpoint
from .announce import announce
from .buffer import FusionBuffer, gather, link
from .communicators import Communicator, Reduction
from .communicators.base import AUTO_SPARSE
from .compressors import Compressor
from .density import AUTO
from .momentum import LocalClipping, MomentumCorrection
from .observer import (COMPRESS, DECOMPRESS, GRADIENT_READY, MEMCPY_IN, MEMCPY_OUT, SUBMIT, SYNCHRONIZE, WAIT,
                       Observer, combine)
from .plan import FusionPlan, check_plan_across_ranks, send_small_dense
from .regime import CriticalRegimes
from .residual import ResidualStore
from .spread import Spread
from .stages import half
from .stages.collect import StepStats, Tally, WriteBack, keep_leftover, unpack
from .stages.fill import Filler
from .stages.flags import StepFlags, poison
from .stages.loss_scale import LossScale
from .stages.mode import StepMode
from .stages.record import Filling, InFlight
from .stages.select import Selection, selection_for
from .stages.send import Sender
from .warmup import DensityWarmup

__all__ = ["Controller", "StepStats"]


class Controller:
    """Fills fusion buffers from gradient hooks and synchronises one collective per buffer.

    Args:
        named_params: ``(name, parameter)`` of every trainable parameter.
        plan: the fusion plan; must hold each name exactly once.
        compressor: selects the elements to send (``dense`` compressors skip selection).
        communicator: synchronises one buffer per collective; or the communicators a plan may
            name (:attr:`FusionPlan.communicator`) by name, the first in use until one does.
        op, prescale, postscale: Horovod's reduction op and scale factors.
        sparse_as_dense: densify sparse gradients (as in Horovod) instead of rejecting them.
        loss_scale: returns the loss scale of the step being back-propagated (a ``GradScaler``'s),
            or ``None``; residuals are rescaled when it changes.
        momentum: momentum correction (DGC) or EF21-SGDM: the residual accumulates local momentum
            or its increments.
        clipping: local gradient clipping (DGC), applied to each gradient before error feedback.
        warmup: the density of each step while warming up (DGC); the compressor's own density is
            the target.
        min_selected: tensors that would send fewer elements per step than this go dense in a
            shared buffer (:func:`~horovod_safusion.plan.send_small_dense`); 0 sparsifies all.
        dense_share: so do the smallest tensors that together hold at most this share of the
            model's elements (where ``min_selected`` is above 0).
        regimes: Accordion's critical regimes: the steps of a critical interval are sent dense.
        spread: the votes and decisions on which gradients are spread, where masking by tensor or
            ``spread_floor`` follows them (``None``: nothing measured).
        spread_floor: the least density of a tensor decided spread (``None``: none).
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], plan: FusionPlan,
                 compressor: Compressor, communicator: "Communicator | dict[str, Communicator]", op: int,
                 prescale: float = 1.0, postscale: float = 1.0, sparse_as_dense: bool = False,
                 loss_scale: Callable[[], torch.Tensor | None] | None = None,
                 momentum: MomentumCorrection | None = None, clipping: LocalClipping | None = None,
                 warmup: DensityWarmup | None = None, min_selected: int = 0, dense_share: float = 0.0,
                 densities: Sequence[float] = (), regimes: CriticalRegimes | None = None,
                 spread: Spread | None = None, spread_floor: float | None = None) -> None:
        self.params = dict(named_params)
        self.compressor = compressor
        self.communicators = communicator if isinstance(communicator, dict) else {communicator.name: communicator}
        communicator = self.communicator = next(iter(self.communicators.values()))
        self.reduction = Reduction(op, prescale, postscale)
        self.residuals = ResidualStore()
        self.momentum, self.clipping, self.warmup, self.regimes = momentum, clipping, warmup, regimes
        self.min_selected, self.dense_share = min_selected, dense_share
        self.densities = tuple(densities)  # the candidates of density="auto", else none
        self.loss_scale = LossScale(loss_scale)
        self.spread, self.spread_floor = spread, spread_floor
        self.filler = Filler(self.residuals, momentum, clipping, sparse_as_dense, spread)
        self.sender = Sender(communicator, self.reduction)
        self.write_back = WriteBack()
        self.flags = StepFlags(list(self.params), communicator.process_set)
        self.mode: StepMode | None = None  # the step in flight's (the last step's between steps)
        self._step_open = False
        self.steps = 0
        self.last_stats = StepStats()
        self._observers: list[Observer] = []
        self.observer: Observer | None = None  # those watching, as one (None: nobody pays)
        self.joining = (0, 0)  # parameters joining, minimum and maximum over ranks (see synchronize)
        self.set_plan(plan)

    # ---- plan ----------------------------------------------------------------------------
    def set_plan(self, plan: FusionPlan) -> None:
        """Switch to ``plan`` between steps, its small tensors sent dense (:attr:`min_selected`,
        :attr:`dense_share`, :func:`~horovod_safusion.plan.send_small_dense`): the residuals (and
        momenta) move into the new buffers (:func:`~horovod_safusion.buffer.gather`), and each
        buffer's selection path is chosen."""
        if self._step_open:
            raise RuntimeError("the fusion plan can only change between steps (after synchronize())")
        numel = {n: p.numel() for n, p in self.params.items()}
        plan.validate(self.params, numel)
        self._use(plan.communicator)
        self._aim(plan.density)
        if not self.compressor.dense:
            group = {n: (p.dtype, p.device) for n, p in self.params.items()}
            plan = send_small_dense(plan, numel, group, self.target_density, self.min_selected, self.dense_share)
        self.plan = plan
        self.buffers = [FusionBuffer(i, names, [self.params[n] for n in names], plan.order,
                                     dense=i in plan.dense_buffers)
                        for i, names in enumerate(plan.buffers)]
        link([b for b in self.buffers if not b.dense])  # a dense buffer holds no planes of its own
        self._selections: list[Selection] = [selection_for(b, self.compressor, self.communicator.compression)
                                             for b in self.buffers]
        self._slot = {id(self.params[n]): (b, slot) for b in self.buffers for slot, n in enumerate(b.names)}
        self._set_floors()
        self._clear_records()
        self.gather()

    def _set_floors(self) -> None:
        """Select every tensor decided spread at no less than :attr:`spread_floor`, from the next
        selection on (the buffers' selection segments carry the floors)."""
        if self.spread is None:
            return
        floors = self.spread.floors(self.spread_floor)
        for buf in self.buffers:
            if not buf.dense:
                buf.set_floors(floors, self.target_density)
        self.spread.changed = False

    def _announce_floors(self) -> None:
        """Rank 0 says how many tensors select at the floor, once every tensor is decided."""
        floors = self.floors()
        if not floors:
            return
        total = sum(p.numel() for p in self.params.values())
        share = sum(self.params[n].numel() for n in floors) / max(1, total)
        announce(f"{len(floors)} of {len(self.params)} tensors ({share:.0%} of the elements) have spread gradients: "
                 f"they select at density {self.spread_floor:g} or more (spread_density), the others at "
                 f"density={self.asked_density!r}")

    def floors(self) -> dict[str, float]:
        """The least density of each tensor decided spread (empty where there is no floor)."""
        return self.spread.floors(self.spread_floor) if self.spread is not None else {}

    def _clear_records(self) -> None:
        """Forget the step's records: per buffer its fill, and its collective once started."""
        self._filling: list[Filling | None] = [None] * len(self.buffers)
        self._flight: list[InFlight | None] = [None] * len(self.buffers)

    def _use(self, name: str | None) -> None:
        """Send sparse buffers over the communicator ``name`` from now on (``None``: the one in use)."""
        if name is None or name == self.communicator.name:
            return
        if name not in self.communicators:
            also = " or 'auto', without dense=True" if name in AUTO_SPARSE else ""
            raise ValueError(f"the fusion plan sends over communicator {name!r}, which this optimizer does not "
                             f"hold; it holds {sorted(self.communicators)} (pass communicator={name!r}{also})")
        self.communicator = self.sender.communicator = self.communicators[name]

    @property
    def asked_density(self) -> "float | str":
        """``density=`` as given: ``"auto"``, or the compressor's (1 for a dense one)."""
        return AUTO if self.densities else 1.0 if self.compressor.dense else self.compressor.density

    def _aim(self, density: float | None) -> None:
        """Select at ``density`` from now on, and end a warm-up there (``None``: the compressor's,
        or under ``density="auto"`` the lowest candidate, provisional until a plan chooses)."""
        if density is None and self.densities:
            density = min(self.densities)
        elif density is not None and not self.densities:
            raise ValueError(f"the fusion plan selects at density {density!r}, but this optimizer was given "
                             f"density={self.asked_density!r}; pass density='auto' to let a plan choose it")
        if self.compressor.dense:
            density = 1.0
        self.target_density = self.compressor.density if density is None else density
        if self.warmup is not None:
            self.warmup.target = self.target_density

    def gather(self) -> None:
        """Move every residual and momentum into the planes of the current buffers (after a new
        plan or a loaded checkpoint)."""
        gather(self.buffers, self.residuals, "flat")
        if self.momentum is not None:
            gather(self.buffers, self.momentum.momenta, "momentum")

    def drop_momentum(self) -> None:
        """Give up the local momentum ``u`` (``momentum_correction="auto"`` turned the correction
        off): the wrapped SGD applies its own from now on, and the buffers' momentum planes are
        freed. The residuals stay as they are."""
        self.momentum = self.filler.momentum = None
        for buf in self.buffers:
            buf.momentum = None

    def switch_plan(self, plan: FusionPlan) -> None:
        """:meth:`set_plan`, then check that every rank switched to the same plan (a collective
        over the communicator's process set, SAFusion §3.2's alignment)."""
        self.set_plan(plan)
        check_plan_across_ranks(plan, self.communicator.process_set)

    # ---- checkpoint state -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The job's part of the controller's state, the same on every rank: the step count, the
        loss scale the residuals are at, the fusion plan (JSON), what made the residuals (the
        compressor's class and density, the communicator's class), and whether the plugin holds a
        local momentum."""
        return {"steps": self.steps, "loss_scale": self.loss_scale.residuals,
                "local_momentum": self.momentum is not None,
                "spread": dict(self.spread.decided) if self.spread is not None else {},
                "compressor": type(self.compressor).__name__, "density": self.asked_density,
                "communicator": type(self.communicator).__name__, "plan": self.plan.to_json(),
                "regimes": self.regimes.state_dict() if self.regimes is not None else None}

    def rank_state(self) -> dict:
        """This rank's own part: its residuals and momenta, its compressor's and communicator's
        state."""
        return {"residuals": self.residuals.state_dict(), "compressor": self.compressor.state_dict(),
                "communicator": self.communicator.state_dict(),
                "momenta": self.momentum.state_dict() if self.momentum is not None else {}}

    def load_state_dict(self, state: dict, ranks: dict[int, dict], world_size: int, all_ranks: bool) -> bool:
        """Load :meth:`state_dict` with the :meth:`rank_state` of the ``ranks`` saved (a job of
        ``world_size``; ``all_ranks``: every rank's is there). This rank takes its own state, or that
        of the rank it takes over from (``rank mod world_size``); residuals made by another
        compressor or density start empty, with a warning. Returns whether the saved plan was
        taken; if not (another world size, other parameters), the plan in use stays and the
        residuals move into it, and the caller profiles again."""
        ps = self.communicator.process_set
        size, rank = ps.size(), ps.rank()
        source = ranks.get(rank if world_size == size else rank % world_size) or next(iter(ranks.values()))
        compressor, density = type(self.compressor).__name__, self.asked_density
        if state["compressor"] != compressor or state["density"] != density:
            warnings.warn(f"the checkpoint was saved with compressor {state['compressor']} at density "
                          f"{state['density']}; this optimizer uses {compressor} at density "
                          f"{density}: error-feedback residuals and compressor state start empty")
            self.residuals.load_state_dict({})
        else:
            self.compressor.load_state_dict(source["compressor"])
            self._load_residuals({r: v["residuals"] for r, v in ranks.items()}, world_size, all_ranks)
            self.loss_scale.residuals = state["loss_scale"]
            if self.momentum is not None and source.get("momenta"):  # local state: the rank taken over's
                self.momentum.load_state_dict(source["momenta"], {n: p.numel() for n, p in self.params.items()})
        if self.spread is not None:  # agreed, the same on every rank
            self.spread.load(state.get("spread", {}))
        plan = FusionPlan.from_json(state["plan"])
        if plan.communicator is not None and plan.communicator not in self.communicators:
            warnings.warn(f"the checkpoint's fusion plan sends over communicator {plan.communicator!r}, which this "
                          f"optimizer does not hold; it sends over {self.communicator.name!r}, as asked")
            plan = dataclasses.replace(plan, communicator=None)
        if plan.density is not None and not self.densities:  # the warning above named the densities
            plan = dataclasses.replace(plan, density=None)
        takes_plan = world_size == size and set(plan.names) == set(self.params)
        if takes_plan:
            self._use(plan.communicator)  # the communicator whose state was saved
        if state["communicator"] == type(self.communicator).__name__ and world_size == size:
            self.communicator.load_state_dict(source["communicator"])
        self.steps = int(state["steps"])
        if self.regimes is not None and state.get("regimes") is not None:
            self.regimes.load_state_dict(state["regimes"])
        if takes_plan:
            self.set_plan(plan)
            return True
        self._set_floors()
        self.gather()
        return False

    def _load_residuals(self, ranks: dict[int, dict], world_size: int, all_ranks: bool) -> None:
        """This rank's residuals from those of the ``ranks`` saved: its own, or with another world
        size and ``all_ranks`` its share of all (:func:`~horovod_safusion.checkpoint.redistribute`);
        otherwise it keeps its own, with a warning."""
        ps = self.communicator.process_set
        size, rank = ps.size(), ps.rank()
        if world_size != size and all_ranks:
            mine = checkpoint.redistribute(ranks, world_size, size, rank)
        elif rank in ranks and world_size == size:
            mine = ranks[rank]
        else:
            held = sorted(r for r, res in ranks.items() if res)
            if held:
                warnings.warn(f"the checkpoint holds the error-feedback residuals of rank(s) {held} of a job of "
                              f"{world_size}, not those of rank {rank} of this job of {size}: rank {rank} keeps its "
                              "own (none in a fresh process). Save with optimizer.state_dict(all_ranks=True) on "
                              "every rank to keep every rank's unsent gradient")
            return
        for name, r in mine.items():
            p = self.params.get(name)
            if p is None:
                raise ValueError(f"the checkpoint holds a residual for {name!r}, which is not a trainable "
                                 f"parameter of this optimizer; parameters: {sorted(self.params)[:8]}...")
            if r.numel() != p.numel():
                raise ValueError(f"the checkpoint's residual for {name!r} has {r.numel()} elements; the "
                                 f"parameter has {p.numel()} (shape {tuple(p.shape)})")
        self.residuals.load_state_dict({n: r.to(device=self.params[n].device, dtype=self.params[n].dtype)
                                        for n, r in mine.items()})

    def add_params(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Synchronise ``named_params`` too, from the next step on (parameters that joined the
        job: a parameter group added after construction). They are appended to the plan, one
        buffer per dtype and device; a profiled planner re-plans them later with the others. A
        collective (:meth:`switch_plan`): every rank adds the same parameters between steps."""
        self.params.update(named_params)
        self.flags = StepFlags(list(self.params), self.communicator.process_set)
        if self.spread is not None:
            self.spread.add(n for n, _ in named_params)
        if self.momentum is not None:
            self.momentum.add(named_params)
        kinds: dict[tuple, list[str]] = {}
        for name, p in named_params:
            kinds.setdefault((p.dtype, p.device), []).append(name)
        plan = self.plan
        self.switch_plan(FusionPlan(plan.buffers + tuple(tuple(b) for b in kinds.values()), order=plan.order,
                                    planner=plan.planner, dense=plan.dense, meta=plan.meta,
                                    dense_buffers=plan.dense_buffers))

    def flats(self) -> list[torch.Tensor]:
        """The fusion buffers' flat tensors: between steps they hold the residuals, which the
        profile's compression sweep selects from (and leaves as they were)."""
        return [b.flat for b in self.buffers]

    @property
    def device(self) -> torch.device:
        """The device of the fusion buffers (of the first one, where parameters are spread)."""
        return self.buffers[0].device

    # ---- observers (the online profiler, the timeline) -------------------------------------------
    def observe(self, observer: Observer) -> None:
        """Report every phase of the steps from now on to ``observer`` too."""
        if observer not in self._observers:
            self._observers.append(observer)
            self.observer = combine(self._observers)

    def unobserve(self, observer: Observer) -> None:
        """Stop reporting to ``observer`` (nothing happens if it was not observing)."""
        if observer in self._observers:
            self._observers.remove(observer)
            self.observer = combine(self._observers)

    # ---- the step's mode ------------------------------------------------------------------------
    def density_at(self, step: int) -> float:
        """The density step ``step`` selects at: every element in a critical regime, else the
        warm-up's, else the target."""
        if self.regimes is not None and self.regimes.critical:
            return 1.0
        return self.warmup.density_at(step) if self.warmup is not None else self.target_density

    @property
    def off_target(self) -> bool:
        """Whether the last step sent at a density other than the target: it belonged to the
        density warm-up or to a critical regime."""
        return self.mode is not None and self.mode.density != self.target_density

    def _open_step(self) -> None:
        """The step's first gradient (or its synchronize()): decide its mode. A dense compressor, a
        dense plan (the dense choice found Horovod's allreduce faster) or a warm-up step at
        density 1 sends every element, residuals included, with Horovod's allreduce."""
        self._step_open = True
        density = self.density_at(self.steps)
        rescale = self.loss_scale.begin(rescales=not (self.compressor.dense and self.momentum is None))
        regimes = self.regimes
        critical = regimes is not None and regimes.critical
        as_half = critical and regimes.half and not self.plan.dense
        # a critical step in float32 sends the residuals of the sparse steps before it along a
        # chunk per step, at the rate those steps sent (as the dense plan does); in float16 whole
        release = self.target_density if critical and not as_half else density
        self.mode = StepMode(dense=self.compressor.dense or self.plan.dense or density >= 1.0,
                             density=density, rescale=rescale, step=self.steps, half=as_half, release=release)

    def reset_step(self) -> None:
        """Drop the step in flight (a collective failed, or a state is being loaded). Buffers
        already filled hold their gradient in their residuals, and residuals set aside go back;
        Horovod elastic's restore then loads the residuals of the last commit."""
        for buf, filling in zip(self.buffers, self._filling):
            if filling is not None and buf.flat is not None:
                self.filler.restore(buf, filling)
        self._clear_records()
        self.write_back.clear()
        self._step_open = False

    # ---- push: called from the gradient hooks ----------------------------------------------
    def grad_ready(self, p: torch.Tensor) -> None:
        """Add ``p``'s gradient to its residual in its buffer; launch the buffer when full."""
        buf, slot = self._slot[id(p)]
        filling = self._filling[buf.index]
        if filling is not None and slot in filling.filled:
            return
        if not self._step_open:
            self._open_step()
        obs = self.observer
        t = obs.mark() if obs else None
        filling = self._fill(buf, slot)
        if filling.full and not self._carries_flags(buf):  # (that one starts in synchronize())
            self._launch(buf, filling)
        if obs:
            obs.span(GRADIENT_READY, t, tensor=buf.names[slot])

    def _fill(self, buf: FusionBuffer, slot: int, arrived: bool = True) -> Filling:
        """Fill tensor ``slot`` of ``buf`` (opening the buffer's record of this step); returns
        the record."""
        obs = self.observer
        t = obs.mark() if obs else None
        filling = self._filling[buf.index]
        if filling is None:
            filling = self._filling[buf.index] = self.filler.begin(buf, self.mode)
        self.filler.fill(buf, filling, slot, self.mode, self.flags, self.write_back, arrived)
        if obs:
            obs.span(MEMCPY_IN, t, tensor=buf.names[slot])
        return filling

    def _carries_flags(self, buf: FusionBuffer) -> bool:
        """Whether ``buf`` carries the step's flags (:mod:`~horovod_safusion.stages.flags`): the
        plan's last buffer, where it goes dense and no spread vote is due (the same on every
        rank), unless it sends one gradient of its own in its dtype: a group of that tensor and
        the flags would go through Horovod's fusion buffer, a copy of the gradient in and out (and
        as much memory) where one tensor alone is reduced in place. A float16 wire holds them in
        a spare element (:func:`~horovod_safusion.stages.half.round_to_half`); a group of several
        tensors, or the packed flat of small tensors, is fused by Horovod anyway. It is then
        started by :meth:`synchronize`, which knows the flags, just after the last gradient's
        hook."""
        return buf.index == len(self.buffers) - 1 and self.mode.sends_dense(buf) \
            and not (self.spread is not None and self.spread.voting) \
            and (buf.dense or len(buf.params) > 1 or self.mode.sends_half(buf))

    def _launch(self, buf: FusionBuffer, filling: Filling, flags: float | None = None) -> None:
        """Select (a sparse buffer) and start the buffer's collective (``flags``: this rank's value
        of the step's flags, where the buffer carries them)."""
        obs = self.observer
        t = obs.mark() if obs else None
        selected = None
        if not self.mode.sends_dense(buf):
            selected = self._selections[buf.index](buf, filling, self.steps, self.mode.density)
            self.filler.keep_rest(buf)
        elif not buf.dense and not self.mode.sends_half(buf):
            buf.flat = None  # its residuals went along with the gradients
        if obs:
            t = obs.span(COMPRESS, t, buffer=buf.index, elements=buf.numel,
                         selected=buf.numel if selected is None else selected.values.numel())
        self._flight[buf.index] = self.sender.start(buf, filling, self.mode, selected, flags)
        if obs:
            obs.span(SUBMIT, t, buffer=buf.index)

    # ---- pull: called from optimizer.synchronize() -------------------------------------------
    def synchronize(self, arrived: Container[torch.Tensor], joining: int = 0) -> StepStats:
        """Start what has not started, wait for every buffer; the communicators write the
        aggregated gradients into ``p.grad``.

        Args:
            arrived: the parameters whose gradient arrived on this rank in this step (their hook
                fired, in any of the ``backward_passes_per_step`` passes); for any other this rank
                has no gradient (see the module's rules).
            joining: how many parameters this rank is about to add (:meth:`add_params`), told to
                every rank by the step's flags: :attr:`joining` is then the minimum and the
                maximum over ranks, so that every rank knows whether any rank adds some.
        """
        obs = self.observer
        if obs:
            t_sync = obs.mark()
            obs.synchronize_begins(self.steps, self.plan.planner, obs.profiles)
        if not self._step_open:
            self._open_step()
        carrier = self.buffers[-1] if self.buffers and self._carries_flags(self.buffers[-1]) else None
        for buf in self.buffers:  # same order on every rank
            if self._flight[buf.index] is None:
                filling = self._filling[buf.index]
                for slot in range(len(buf.names)):
                    if filling is None or slot not in filling.filled:
                        filling = self._fill(buf, slot, buf.params[slot] in arrived)
                if buf is carrier:  # the last: every other buffer started, every gradient known
                    self._launch(buf, filling, self.flags.carry(any(f.poisoned for f in self._flight[:-1]), joining))
                else:
                    self._launch(buf, filling)
        flights = self._flight
        votes = self.spread.votes if self.spread is not None and self.spread.voting else None
        if carrier is None:
            self.flags.start(any(f.poisoned for f in flights), joining, votes)
        else:
            self.flags.carried(flights[-1])
        if votes is not None:  # decided before the first masking: waits for the flags (first steps only)
            self.spread.agree(self.flags.votes())
        tally = Tally(len(self.buffers))
        for buf, flight in zip(self.buffers, flights):
            self._collect(buf, flight)
            tally.count(buf, flight)
        if self.spread is not None and self.spread.changed:
            self._set_floors()
            if not self.spread.voting:
                self._announce_floors()
        self._clear_records()
        self.write_back.finish(self.flags.arrived_anywhere)
        if self.regimes is not None and not self.flags.poisoned:
            self.regimes.observe([p.grad for p in self.params.values() if p.grad is not None])
        self.joining = self.flags.joining
        self.last_stats = tally.total()  # one read per step
        self.steps += 1
        self.loss_scale.end()
        self._step_open = False
        if obs:
            obs.span(SYNCHRONIZE, t_sync)
        return self.last_stats

    def _resend(self, buf: FusionBuffer, flight: InFlight) -> None:
        """``buf``'s float16 aggregate overflowed on every rank alike: send it again in float32,
        and critical steps stay float32 from now on."""
        if not self.regimes.overflowed:
            announce("a critical step's float16 aggregate overflowed: sent again in float32, and "
                     "critical steps go as float32 from now on")
        self.regimes.fall_back()
        self.sender.resend(buf, flight)

    def _collect(self, buf: FusionBuffer, flight: InFlight) -> None:
        """Wait for ``buf``'s collective and decode it into ``p.grad``; then what the step left
        goes back into the residuals, or, if some rank had a non-finite gradient, everything it
        sent."""
        obs = self.observer
        t = obs.mark() if obs else None
        pending = flight.pending
        pending.collect()  # waiting: communication
        poisoned = self.flags.poisoned  # submitted last: waits for the others too
        t = obs.span(WAIT, t, buffer=buf.index) if obs else None
        pending.wait()  # decoding into the gradients: computation after communication
        if flight.half and not half.deliver(buf, flight, self.residuals):
            self._resend(buf, flight)
        if pending.feedback is not None:
            self.compressor.feedback(buf.selection, pending.feedback)
        t = obs.span(DECOMPRESS, t, buffer=buf.index) if obs else None
        if poisoned:
            poison(buf, flight)
        else:
            keep_leftover(buf, flight)
            if self.momentum is not None and flight.indices is not None:
                self.momentum.mask(buf, flight.indices)
        if buf.dense:
            unpack(buf, flight)
        self.filler.restore(buf, flight.filling)
        if obs:
            obs.span(MEMCPY_OUT, t, buffer=buf.index)
