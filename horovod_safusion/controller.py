"""Controller: push sparsified gradients into fusion buffers and pull aggregated ones back.

SAFusion §4 "Controller module" and §3.1 Steps 1–3. The controller keeps the mapping
tensor → fusion buffer (:class:`~horovod_safusion.buffer.FusionBuffer`) of the current
:class:`FusionPlan`, and reports its phases to whoever observes the step
(:mod:`horovod_safusion.observer`: the online profiler, the timeline). When a gradient is ready (its hook
fires) it is added to the parameter's error-feedback residual in its segment of the buffer (the
buffer's flat tensor *is* where the residuals live); when the buffer's *last* tensor is in, one
selection runs over the buffer — per segment (= per tensor) for ``ahead``, over the whole buffer
for ``behind`` — the unselected rest stays in place as the new residual, and ONE asynchronous
collective starts, overlapping the rest of back-propagation. :meth:`Controller.synchronize`
submits every buffer that has not started (so no rank hangs when a parameter got no gradient),
waits, and the communicator writes the aggregated gradient straight into the parameters' ``.grad``.

A step is either sparse or dense, decided once at its first gradient. A dense step (a plan the
dense choice made, a warm-up step at density 1, a dense compressor) adds any residual into the
gradient itself and reduces the gradients in place with Horovod's allreduce, as
``hvd.DistributedOptimizer`` does: it needs no buffer memory, and a buffer that sent its residuals
along gives its flat tensor up. So the plugin holds, per gradient element, the residual (and the
momentum, with momentum correction) and nothing else of the model's size.

Four rules keep error feedback exact in real training loops:

* **No gradient here** (a frozen parameter, one unused in this rank's forward, or ``step()``
  without ``backward()``: its hook did not fire in this step): the parameter sends zeros, so every
  rank still submits the same collectives, and its residual stays as it is — not added, not sent,
  not delivered, on sparse and dense steps alike (with momentum correction, its momentum is
  neither accumulated nor masked). On a sparse step its residual is set aside while the buffer's
  collective runs (a transient copy of that parameter only) and its segment is zero for the
  selection. The step's one small allreduce tells every rank where a gradient arrived: a
  parameter that got one on no rank keeps the ``.grad`` it had (``None`` after ``zero_grad()``),
  so the wrapped optimizer does not move it at all — momentum included; one that got one on some
  ranks receives the aggregate as usual. So a frozen layer stays frozen, a step without backward
  moves nothing, and ``residual_after + sent == residual_before + grad`` holds per parameter with
  ``grad = 0`` and ``sent = 0``.

* **Non-finite gradients** (a NaN batch, a loss-scale overflow): on a sparse step, a gradient
  element that is not finite does not join the residual (the residual keeps its value there) and
  is counted. The step's small allreduce tells every rank whether any rank counted one; if so,
  every gradient of the step arrives as NaN on every rank, so the user's finiteness check (or
  GradScaler's) skips the step on all ranks, as with Horovod, and every rank takes back what it
  sent into its residuals (nothing finite is lost, and no rank keeps a NaN or stops sending). A
  dense step lets a NaN through to every rank, as Horovod does.
* **Loss scaling**: with a ``GradScaler`` (``loss_scale`` set), residuals are kept at the scale of
  the step that made them and rescaled by ``new_scale / old_scale`` when added to the next
  gradient (a residual kept through a step without gradient is rescaled in place), so a changing
  scale neither inflates nor shrinks them.
* **Wire rounding**: when Horovod's ``compression`` rounds values (``Compression.fp16``), the
  selected values are rounded here, before the collective, and what rounding dropped stays in the
  residual, so ``residual_after + sent == residual_before + grad`` holds for the values that were
  actually sent.

DGC's accuracy techniques (:mod:`~horovod_safusion.momentum`, :mod:`~horovod_safusion.warmup`) act
on what enters the residual: local clipping of each gradient, then momentum correction (the
residual accumulates momentum ``u``, so the invariant reads ``residual_after + sent ==
residual_before + u``, masking clears ``u`` where a sparse step sent), and a warm-up that sets the
density of each step — a step at density 1 is sent dense, with Horovod's allreduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Container, Sequence

import numpy as np
import torch
import horovod.torch as hvd

from . import kernels
from .buffer import FusionBuffer, gather, link
from .communicators import Allreduce, Communicator, Outgoing, Reduction
from .communicators.base import Target, wait
from .compressors import Compressor, sparsify
from .compressors.device import SegmentStats
from .kernels import host
from .momentum import LocalClipping, MomentumCorrection
from .observer import (COMPRESS, DECOMPRESS, GRADIENT_READY, MEMCPY_IN, MEMCPY_OUT, SUBMIT, SYNCHRONIZE, WAIT,
                       Observer, combine)
from .plan import FusionPlan, check_plan_across_ranks, send_small_dense
from .residual import ResidualStore, holds
from .session import collective
from .warmup import DensityWarmup


@dataclass
class StepStats:
    """What one synchronisation sent (this rank's contribution).

    Attributes:
        tensors: gradient tensors synchronised.
        missing: tensors of which no element was selected (SAFusion §2.4's tensor missing).
        selected: elements sent; ``elements``: elements in all buffers.
        bytes_sent: payload bytes this rank submitted to collectives.
        bytes_received: payload bytes this rank received from other ranks (where the
            communicator can tell; 0 for a dense allreduce).
        buffers: collectives started (one per fusion buffer).
    """

    tensors: int = 0
    missing: int = 0
    selected: int = 0
    elements: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    buffers: int = 0

    @property
    def density(self) -> float:
        """Actual fraction of elements sent."""
        return self.selected / self.elements if self.elements else 0.0

    @property
    def missing_rate(self) -> float:
        return self.missing / self.tensors if self.tensors else 0.0


class Controller:
    """Fills fusion buffers from gradient hooks and synchronises one collective per buffer.

    Args:
        named_params: ``(name, parameter)`` of every trainable parameter.
        plan: the fusion plan; must hold each name exactly once.
        compressor: selects the elements to send (``dense`` compressors skip selection).
        communicator: synchronises one buffer per collective.
        op, prescale, postscale: Horovod's reduction op and scale factors.
        sparse_as_dense: densify sparse gradients (as in Horovod) instead of rejecting them.
        loss_scale: returns the loss scale of the step being back-propagated (a ``GradScaler``'s),
            or ``None``; residuals are rescaled when it changes.
        momentum: momentum correction (DGC): the residual accumulates local momentum.
        clipping: local gradient clipping (DGC), applied to each gradient before error feedback.
        warmup: the density of each step while warming up (DGC); the compressor's own density is
            the target.
        min_selected: tensors that would send fewer elements per step than this go dense in a
            shared buffer (:func:`~horovod_safusion.plan.send_small_dense`); 0 sparsifies all.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], plan: FusionPlan,
                 compressor: Compressor, communicator: Communicator, op: int,
                 prescale: float = 1.0, postscale: float = 1.0, sparse_as_dense: bool = False,
                 loss_scale: Callable[[], torch.Tensor | None] | None = None,
                 momentum: MomentumCorrection | None = None, clipping: LocalClipping | None = None,
                 warmup: DensityWarmup | None = None, min_selected: int = 0) -> None:
        self.params = dict(named_params)
        self.compressor = compressor
        self.communicator = communicator
        self.reduction = Reduction(op, prescale, postscale)
        self.sparse_as_dense = sparse_as_dense
        self.residuals = ResidualStore()
        self.loss_scale = loss_scale
        self._residual_scale: torch.Tensor | None = None  # the loss scale the residuals are at
        self._step_scale: torch.Tensor | None = None      # the loss scale of the step in flight
        self._rescale: torch.Tensor | None = None         # their ratio, applied when residuals are added
        self._step_open = False
        self._wire_rounds = communicator.compression is not hvd.Compression.none
        self.steps = 0
        self.last_stats = StepStats()
        self._observers: list[Observer] = []
        self.observer: Observer | None = None  # those watching, as one (None: nobody pays)
        self._dense_communicator: Communicator | None = None
        self.momentum, self.clipping, self.warmup = momentum, clipping, warmup
        self.min_selected = min_selected
        self.target_density = 1.0 if compressor.dense else compressor.density
        self._dense, self._sender = compressor.dense, communicator  # per step: _choose_sender()
        self._rewrite: list[tuple[torch.Tensor, torch.Tensor]] = []  # (.grad, dense stand-in), see _grad_of
        self._absent: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # no gradient here, see _stand_in
        self.joining = (0, 0)  # parameters joining, minimum and maximum over ranks (see synchronize)
        self._number_params()
        self.set_plan(plan)

    # ---- plan ----------------------------------------------------------------------------
    def set_plan(self, plan: FusionPlan) -> None:
        """Switch to ``plan`` between steps, its small tensors sent dense (:attr:`min_selected`,
        :func:`~horovod_safusion.plan.send_small_dense`): the residuals (and momenta) move into the
        new buffers (:func:`~horovod_safusion.buffer.gather`)."""
        if self._step_open:
            raise RuntimeError("the fusion plan can only change between steps (after synchronize())")
        numel = {n: p.numel() for n, p in self.params.items()}
        plan.validate(self.params, numel)
        if not self.compressor.dense:
            group = {n: (p.dtype, p.device) for n, p in self.params.items()}
            plan = send_small_dense(plan, numel, group, self.target_density, self.min_selected)
        self.plan = plan
        self.buffers = [FusionBuffer(i, names, [self.params[n] for n in names], plan.order,
                                     dense=i in plan.dense_buffers)
                        for i, names in enumerate(plan.buffers)]
        link([b for b in self.buffers if not b.dense])  # a dense buffer holds no planes of its own
        self._slot = {id(self.params[n]): (b, slot) for b in self.buffers for slot, n in enumerate(b.names)}
        self.gather()

    def gather(self) -> None:
        """Move every residual and momentum into the planes of the current buffers (after a new
        plan or a loaded checkpoint)."""
        gather(self.buffers, self.residuals, "flat")
        if self.momentum is not None:
            gather(self.buffers, self.momentum.momenta, "momentum")

    def switch_plan(self, plan: FusionPlan) -> None:
        """:meth:`set_plan`, then check that every rank switched to the same plan (a collective
        over the communicator's process set, SAFusion §3.2's alignment)."""
        self.set_plan(plan)
        check_plan_across_ranks(plan, self.communicator.process_set)

    def add_params(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Synchronise ``named_params`` too, from the next step on (parameters that joined the
        job: a parameter group added after construction). They are appended to the plan, one
        buffer per dtype and device; a profiled planner re-plans them later with the others. A
        collective (:meth:`switch_plan`): every rank adds the same parameters between steps."""
        self.params.update(named_params)
        self._number_params()
        if self.momentum is not None:
            self.momentum.add(named_params)
        kinds: dict[tuple, list[str]] = {}
        for name, p in named_params:
            kinds.setdefault((p.dtype, p.device), []).append(name)
        plan = self.plan
        self.switch_plan(FusionPlan(plan.buffers + tuple(tuple(b) for b in kinds.values()), order=plan.order,
                                    planner=plan.planner, dense=plan.dense, meta=plan.meta,
                                    dense_buffers=plan.dense_buffers))

    def _number_params(self) -> None:
        """Each parameter's position in the step's flags (:meth:`_flags_anywhere`): the order of
        :attr:`params`, the same on every rank."""
        self._position = {name: i for i, name in enumerate(self.params)}
        self._arrived = np.ones(len(self.params), dtype=bool)  # per position: its gradient arrived here

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

    def density_at(self, step: int) -> float:
        """The density step ``step`` selects at (the warm-up's, else the target)."""
        return self.warmup.density_at(step) if self.warmup is not None else self.target_density

    @property
    def warming_up(self) -> bool:
        """Whether the next step still belongs to the density warm-up."""
        return self.warmup is not None and self.warmup.active(self.steps)

    def _choose_sender(self) -> None:
        """Whether this step sends dense, and with which communicator: a dense plan (fusion="safusion"
        found a dense allreduce faster) or a warm-up step at density 1 sends every element of a
        sparse compressor's job with Horovod's allreduce, residuals included."""
        density = self.density_at(self.steps)
        if self.warmup is not None and density < 1.0 and not self.compressor.dense:
            self.compressor.density = density
        self._dense = self.compressor.dense or self.plan.dense or density >= 1.0
        self._sender = self._allreduce() if self._dense else self.communicator

    def _allreduce(self) -> Communicator:
        """The communicator of dense buffers and steps: the job's own where it is dense, else
        Horovod's allreduce over the same process set and wire compression (made once)."""
        if self.communicator.dense:
            return self.communicator
        if self._dense_communicator is None:
            self._dense_communicator = Allreduce(
                process_set=self.communicator.process_set, compression=self.communicator.compression)
        return self._dense_communicator

    def _sends_dense(self, buf: FusionBuffer) -> bool:
        """Whether ``buf`` goes dense in this step: a dense step, or a buffer of small tensors."""
        return self._dense or buf.dense

    # ---- push: called from the gradient hooks ----------------------------------------------
    def grad_ready(self, p: torch.Tensor) -> None:
        """Add ``p``'s gradient to its residual in its buffer; launch the buffer when full."""
        buf, slot = self._slot[id(p)]
        if slot in buf.filled:
            return
        if not self._step_open:
            self._open_step()
        obs = self.observer
        t = obs.mark() if obs else None
        self._fill(buf, slot)
        if len(buf.filled) == len(buf.names):
            self._launch(buf)
        if obs:
            obs.span(GRADIENT_READY, t, tensor=buf.names[slot])

    def _open_step(self) -> None:
        """The first gradient of a step: read its loss scale and how residuals must be rescaled."""
        self._step_open = True
        self._choose_sender()
        scale = self.loss_scale() if self.loss_scale is not None else None
        self._step_scale = scale
        if scale is None or self._residual_scale is None or (self.compressor.dense and self.momentum is None):
            self._rescale = None
        else:  # a 0-dim tensor: no host synchronisation, and it keeps the residual's dtype
            self._rescale = (scale / self._residual_scale).reshape(())

    def abandon_step(self) -> None:
        """Drop the step in flight (a collective failed, or a state is being loaded). Buffers
        already filled hold their gradient in their residuals, and residuals set aside go back;
        Horovod elastic's restore then loads the residuals of the last commit."""
        for buf in self.buffers:
            if buf.flat is not None:
                self._restore(buf)
            buf.reset()
        self._rewrite, self._absent = [], []
        self._step_open = False

    def _gradient(self, buf: FusionBuffer, slot: int) -> torch.Tensor:
        """``p.grad`` flat (a view where it is dense and contiguous), zeros if ``p`` has none."""
        p, name = buf.params[slot], buf.names[slot]
        g = p.grad
        if g is None:
            return torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        if g.is_sparse:
            if not self.sparse_as_dense:
                raise ValueError(f"parameter {name!r} has a sparse gradient (e.g. nn.Embedding(sparse=True)); "
                                 "sparse gradients cannot be fused into a buffer: pass "
                                 "sparse_as_dense=True to densify them, as in hvd.DistributedOptimizer")
            g = g.to_dense()
        return g.reshape(-1)

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor:
        """Where the reduced gradient of ``p`` goes, flat: ``p.grad`` itself where it is dense and
        contiguous (made, zero, where ``p`` has none, as Horovod does); otherwise a dense
        stand-in that :meth:`synchronize` copies into ``p.grad`` at the end."""
        g = p.grad
        if g is None:
            p.grad = g = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        if not g.is_sparse and g.is_contiguous():
            return g.view(-1)
        stand_in = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        self._rewrite.append((p, stand_in))
        return stand_in

    def _fill(self, buf: FusionBuffer, slot: int, arrived: bool = True) -> None:
        """Fill the buffer's tensor ``slot`` with its gradient (``arrived``: its hook fired on this
        rank in this step), or with zeros, its residual kept (no gradient here)."""
        obs = self.observer
        t = obs.mark() if obs else None
        self._arrived[self._position[buf.names[slot]]] = arrived
        if arrived:
            g = self._gradient(buf, slot)
            buf.grads[slot] = self._grad_of(buf.params[slot])  # where the reduced gradient will go
            if self.clipping is not None:
                g = self.clipping(g)
            (self._fill_dense if self._sends_dense(buf) else self._fill_sparse)(buf, slot, g)
        else:
            buf.grads[slot] = self._stand_in(buf.params[slot], self._position[buf.names[slot]])
            self._keep(buf, slot)
        buf.filled.add(slot)
        if obs:
            obs.span(MEMCPY_IN, t, tensor=buf.names[slot])

    def _stand_in(self, p: torch.Tensor, position: int) -> torch.Tensor:
        """Where the reduced gradient of ``p``, which got no gradient here, goes: zeros (this
        rank's contribution) that :meth:`synchronize` writes into ``p.grad`` only if some rank had
        a gradient; otherwise ``p.grad`` stays as it was."""
        stand_in = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        self._absent.append((p, stand_in, position))
        return stand_in

    def _keep(self, buf: FusionBuffer, slot: int) -> None:
        """No gradient here: the residual (and the momentum) stay as they are, rescaled in place
        to this step's loss scale. A dense step gives the buffer's flat up, so a residual in it
        moves to a tensor of its own; on a sparse step the residual (and a momentum in the
        buffer's plane, which masking would clear) are set aside, and the segment is filled with
        zeros for the selection; :meth:`_restore` puts them back after the collective."""
        name, seg = buf.names[slot], buf.segment(slot)
        r = self.residuals.peek(name)
        u = self.momentum.momenta.peek(name) if self.momentum is not None else None
        if self._sends_dense(buf):
            if holds(r, buf.flat, seg):
                r = r.clone()
                self.residuals.bind(name, r)
            if buf.dense:  # this rank's contribution to the packed buffer: zeros
                buf.allocate("flat")[seg].zero_()
        else:
            flat = buf.allocate("flat")
            if holds(r, flat, seg):
                r = r.clone()
            if holds(u, buf.momentum, seg):
                u = u.clone()
                buf.aside.append((slot, r, u))
            else:  # u is a tensor of its own (or none), which masking does not touch
                buf.aside.append((slot, r, None))
            self._fill_sparse(buf, slot, buf.grads[slot], keep=True)  # the stand-in: zeros until decoded
        if self._rescale is not None:
            for t in (r, u):
                if t is not None:
                    t.mul_(self._rescale)

    def _restore(self, buf: FusionBuffer) -> None:
        """Put the residuals (and momenta) set aside by :meth:`_keep` back into the buffer's
        planes. The residual is added to what the step left in its segment (zeros, or what the
        protocol handed back), so nothing is lost."""
        for slot, r, u in buf.aside:
            seg = buf.segment(slot)
            if r is not None:
                buf.flat[seg].add_(r)
            if u is not None:
                buf.momentum[seg].copy_(u)
        buf.aside = []

    def _fill_sparse(self, buf: FusionBuffer, slot: int, g: torch.Tensor, keep: bool = False) -> None:
        """``segment = gradient + scale · residual`` in the buffer, in place where the residual is
        the segment itself; non-finite gradient elements are dropped and counted. With ``keep``
        (no gradient here, the residual set aside) the segment takes ``g`` alone."""
        flat = buf.allocate("flat")
        seg = buf.segment(slot)
        view = flat[seg]
        r = None if keep else self.residuals.peek(buf.names[slot])
        residual = view if holds(r, flat, seg) else r
        on_host = kernels.on_host(flat)
        if self.momentum is not None and not keep:
            g = self.momentum.accumulate(buf, slot, g, self._rescale, on_host)
        if on_host:
            scale = None if self._rescale is None else float(self._rescale)
            buf.dropped += host.fill(view, g, residual, scale)
            return
        if not buf.filled and self._fuses_statistics(buf):
            buf.stats = SegmentStats(len(buf.names), buf.device)
        if buf.stats is not None:
            dropped, mx, total = kernels.accumulate(view, g, residual, self._rescale, stats=True)
            buf.stats.set(slot, (mx, total, torch.ones((), dtype=torch.bool, device=buf.device)))
        else:
            (dropped,) = kernels.accumulate(view, g, residual, self._rescale)
        buf.dropped = buf.dropped + dropped

    def _fill_dense(self, buf: FusionBuffer, slot: int, g: torch.Tensor) -> None:
        """The gradient as it is sent dense, with the residual of earlier sparse steps (sent along,
        and kept no more) and the momentum: into ``p.grad`` itself (reduced in place), or, in a
        buffer of small tensors, packed into the buffer's flat tensor (:meth:`_unpack`)."""
        dst = buf.allocate("flat")[buf.segment(slot)] if buf.dense else buf.grads[slot]
        r = self.residuals.pop(buf.names[slot])
        on_host = kernels.on_host(dst)
        if self.momentum is not None:
            g = self.momentum.accumulate(buf, slot, g, self._rescale, on_host)
        if on_host and (r is not None or dst is not g):
            host.fill(dst, g, r, None if self._rescale is None else float(self._rescale), drop=False)
            return
        if r is None:
            if dst is not g:
                dst.copy_(g)
        else:
            torch.add(g, r * self._rescale if self._rescale is not None else r, out=dst)

    def _fuses_statistics(self, buf: FusionBuffer) -> bool:
        """Whether this step takes the buffer's selection statistics while filling it: sparse, on
        the device path with the Triton kernels, and selecting per tensor (one segment per tensor)."""
        return buf.selection is buf.segments and kernels.uses_triton(buf.flat)

    def _launch(self, buf: FusionBuffer) -> None:
        obs = self.observer
        t = obs.mark() if obs else None
        rows = None  # the wire rows, where the selection wrote them itself (the device path)
        dense = self._sends_dense(buf)
        if dense:
            values, indices = None, None
            if not buf.dense:
                buf.flat = None  # its residuals went along with the gradients
        elif not kernels.on_host(buf.flat):
            values, indices, rows = self._select_on_device(buf)
        else:
            buf.poisoned = buf.dropped > 0
            values, indices = sparsify(self.compressor, buf.flat, buf.selection, self.steps)
            if self._wire_rounds:
                values = self._round_for_wire(buf, values, indices)
            self._keep_rest(buf)
        buf.indices, buf.values = indices, values  # counted in synchronize(), not here in the hook
        if obs:
            t = obs.span(COMPRESS, t, buffer=buf.index, elements=buf.numel,
                         selected=buf.numel if values is None else values.numel())
        comm = self._allreduce() if dense else self._sender  # Horovod's allreduce for dense ones
        # A buffer of small tensors travels packed, as one tensor: Horovod's background thread
        # pays per tensor it handles (bench_peers' per-thread CPU shows it)
        buf.target = Target((buf.flat,), np.array([0, buf.numel])) if buf.dense else Target(tuple(buf.grads), buf.bounds)
        buf.pending = comm.start(Outgoing(buf.tag, values, indices, buf.numel, buf.flat, rows, buf.target),
                                 self.reduction)
        if obs:
            obs.span(SUBMIT, t, buffer=buf.index)

    def _select_on_device(self, buf: FusionBuffer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The device path (GPU buffers, half precision): the compressor decides on the device,
        and the buffer is read back once — its selected count, which sizes the collective,
        together with how many gradient elements the fill dropped. Then the compressor's state
        commits, and the selection is taken (straight into the wire rows where the kernels write
        them)."""
        proposal = self.compressor.propose(buf.flat, buf.selection, self.steps, stats=buf.stats)
        if isinstance(buf.dropped, torch.Tensor):  # read along with the count
            proposal.finite = proposal.finite & (buf.dropped == 0)
        total, finite = proposal.read()  # the one host synchronisation of this buffer
        buf.poisoned = not finite
        proposal.commit()
        values, indices, rows = proposal.take(total)
        if self._wire_rounds:
            values, rows = self._round_for_wire(buf, values, indices), None
        self._keep_rest(buf)
        return values, indices, rows

    def _keep_rest(self, buf: FusionBuffer) -> None:
        """What the selection left in the buffer is the new residual: each parameter's residual
        is its segment of the buffer (bound once; the buffer is filled in place from then on)."""
        for slot, name in enumerate(buf.names):
            seg = buf.segment(slot)
            if not holds(self.residuals.peek(name), buf.flat, seg):
                self.residuals.bind(name, buf.flat[seg])

    def _round_for_wire(self, buf: FusionBuffer, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``values`` as Horovod's wire compression delivers them; the rounding error goes back
        into the buffer's unselected rest (zero at ``indices``), i.e. into the residual. The
        difference of a value and its rounding is exact in the value's dtype, so
        ``rest + sent`` gives back the value bit for bit."""
        compression = self.communicator.compression
        wire, ctx = compression.compress(values)
        sent = compression.decompress(wire, ctx).to(values.dtype)
        buf.flat.index_copy_(0, indices, values - sent)
        return sent

    # ---- pull: called from optimizer.synchronize() -------------------------------------------
    def synchronize(self, arrived: Container[torch.Tensor], joining: int = 0) -> StepStats:
        """Start what has not started, wait for every buffer; the communicators write the
        aggregated gradients into ``p.grad``.

        Args:
            arrived: the parameters whose gradient arrived on this rank in this step (their hook
                fired, in any of the ``backward_passes_per_step`` passes); for any other this rank
                has no gradient (see the module's rules).
            joining: how many parameters this rank is about to add (:meth:`add_params`), told to
                every rank by the step's small allreduce: :attr:`joining` is then the minimum and
                the maximum over ranks, so that every rank knows whether any rank adds some.
        """
        obs = self.observer
        if obs:
            t_sync = obs.mark()
            obs.synchronize_begins(self.steps, self.plan.planner, obs.profiles)
        if not self._step_open:
            self._open_step()
        for buf in self.buffers:  # same order on every rank
            if buf.pending is None:
                for slot in range(len(buf.names)):
                    if slot not in buf.filled:
                        self._fill(buf, slot, buf.params[slot] in arrived)
                self._launch(buf)
        flags = self._flags_anywhere(joining)  # a handle, resolved at first use
        stats = StepStats(buffers=len(self.buffers))
        missing: list[torch.Tensor] = []  # per buffer, tensors that sent nothing (device tensors)
        for buf in self.buffers:
            t = obs.mark() if obs else None
            buf.pending.collect()  # waiting: communication
            if not isinstance(flags, np.ndarray):  # submitted last: waits for the others too
                flags = wait(flags).numpy()
            t = obs.span(WAIT, t, buffer=buf.index) if obs else None
            buf.pending.wait()  # decoding into the gradients: computation after communication
            if buf.pending.feedback is not None:
                self.compressor.feedback(buf.selection, buf.pending.feedback)
            t = obs.span(DECOMPRESS, t, buffer=buf.index) if obs else None
            if flags[0]:
                self._skipped(buf)
            else:
                self._keep_leftover(buf)
                if self.momentum is not None and buf.indices is not None:
                    self.momentum.mask(buf, buf.indices)
            if buf.dense:
                self._unpack(buf)
            self._restore(buf)
            if obs:
                obs.span(MEMCPY_OUT, t, buffer=buf.index)
            self._count(buf, stats, missing)
            buf.reset()
        if not isinstance(flags, np.ndarray):
            flags = wait(flags).numpy()
        for p, stand_in in self._rewrite:  # sparse or strided gradients: written back as they are
            _write_back(p, stand_in)
        for p, stand_in, position in self._absent:  # no gradient here: the aggregate, if any rank had one
            if flags[3 + position]:
                _write_back(p, stand_in)
        self._rewrite, self._absent = [], []
        self.joining = (-int(flags[2]), int(flags[1]))
        stats.missing = int(torch.stack(missing).sum()) if missing else 0  # one read per step
        self.steps += 1
        self._residual_scale = self._step_scale
        self._step_open = False
        self.last_stats = stats
        if obs:
            obs.span(SYNCHRONIZE, t_sync)
        return stats

    @staticmethod
    def _unpack(buf: FusionBuffer) -> None:
        """A buffer of small tensors arrived reduced in its flat tensor: each segment to where its
        parameter's gradient goes."""
        for slot, dst in enumerate(buf.grads):
            dst.copy_(buf.flat[buf.segment(slot)])

    def _keep_leftover(self, buf: FusionBuffer) -> None:
        """What the protocol did not deliver (``Pending.leftover``) goes back into the residuals."""
        leftover = buf.pending.leftover
        if leftover is not None:
            buf.flat.index_add_(0, *leftover)

    @staticmethod
    def _count(buf: FusionBuffer, stats: StepStats, missing: list[torch.Tensor]) -> None:
        stats.tensors += len(buf.names)
        stats.elements += buf.numel
        stats.bytes_sent += buf.pending.bytes_sent
        stats.bytes_received += buf.pending.bytes_received or 0
        if buf.pending.selected is not None:
            stats.selected += buf.pending.selected
        elif buf.indices is None:
            stats.selected += buf.numel
        else:
            stats.selected += buf.indices.numel()
            missing.append((buf.segments.counts(buf.indices) == 0).sum())

    def _flags_anywhere(self, joining: int) -> int:
        """Starts the step's one small allreduce, the maximum over ranks of: whether this rank
        dropped non-finite gradient elements (a sparse step), ``joining`` and ``-joining``, and per
        parameter whether its gradient arrived here. Submitted after every buffer's collective, so
        that it waits behind none of them. Returns Horovod's handle."""
        flags = np.empty(3 + len(self._arrived), dtype=np.int32)
        flags[0] = any(b.poisoned for b in self.buffers)
        flags[1], flags[2] = joining, -joining
        flags[3:] = self._arrived
        return hvd.allreduce_async(torch.from_numpy(flags), op=hvd.Max, name=collective("saf.step"),
                                   process_set=self.communicator.process_set)

    def _skipped(self, buf: FusionBuffer) -> None:
        """A step some rank could not send whole (a non-finite gradient): the buffer arrives as NaN
        everywhere, and every rank takes what it sent back into its residuals (gradient +
        residual, as if nothing had been selected), so the step the user skips loses no finite
        gradient."""
        if buf.indices is not None:
            buf.flat.index_add_(0, buf.indices, buf.values)
        for t in buf.target.tensors:
            t.fill_(float("nan"))


def _write_back(p: torch.Tensor, flat: torch.Tensor) -> None:
    """The reduced gradient of a parameter whose ``.grad`` is sparse, strided or ``None``."""
    value = flat.view(p.shape)
    if p.grad is None:
        p.grad = value
    elif p.grad.is_sparse:
        # Sparse grads do not support copy_ from dense; Horovod uses the same equivalent.
        p.grad.zero_().add_(value.to_sparse())
    else:
        p.grad.copy_(value)
