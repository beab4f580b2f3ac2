"""The first stage: a gradient into its fusion buffer, with error feedback (SAFusion §3.1 Step 1).

A tensor's first gradients are measured for the vote on whether it is spread
(:mod:`~horovod_safusion.spread`), until every rank agreed. The gradient is locally clipped and
momentum-corrected if either is on (DGC §3.2, :mod:`~horovod_safusion.momentum`); then, on a
sparse step, ``segment = gradient + scale · residual`` is written into the parameter's segment of
the buffer's flat tensor, which *is* where the residual lives (in place, no copy). A non-finite
gradient element does not join the residual (the residual keeps its value there) and is counted,
for the step's flags. On a dense step, or for a buffer of small tensors, gradient plus any
residual goes to where the reduced gradient goes (``p.grad``, or the buffer's packed flat), and
the residual is sent along: whole at density 1, a chunk per step after sparse steps
(:func:`release`).

A parameter without gradient on this rank (frozen, unused in this rank's forward, ``step()``
without ``backward()``) sends zeros, so every rank submits the same collectives, and its
residual stays as it is — not added, not sent, not delivered: on a sparse step it is set aside
while the buffer's collective runs (:meth:`Filler.restore` puts it back).

What a step's fill produces is the buffer's :class:`~horovod_safusion.stages.record.Filling`
(:meth:`Filler.begin`), which the selection, the send and the collect stages take.
"""
from __future__ import annotations

import math

import torch

from .. import kernels
from ..buffer import FusionBuffer
from ..compressors.device import SegmentStats
from ..kernels import host
from ..momentum import LocalClipping, MomentumCorrection
from ..residual import ResidualStore, holds
from ..spread import Spread
from .collect import WriteBack
from .flags import StepFlags
from .mode import StepMode
from .record import Aside, Filling


class Filler:
    """Fills buffers' segments from gradients.

    Args:
        residuals: the per-parameter error-feedback store (views of the buffers' flat tensors).
        momentum: momentum correction (DGC), or ``None``.
        clipping: local gradient clipping (DGC), or ``None``.
        sparse_as_dense: densify sparse gradients (as Horovod) instead of rejecting them.
        spread: the votes on which gradients are spread, or ``None`` where nothing follows them.
    """

    def __init__(self, residuals: ResidualStore, momentum: MomentumCorrection | None,
                 clipping: LocalClipping | None, sparse_as_dense: bool, spread: Spread | None = None) -> None:
        self.residuals, self.momentum, self.clipping = residuals, momentum, clipping
        self.sparse_as_dense, self.spread = sparse_as_dense, spread

    @staticmethod
    def begin(buf: FusionBuffer, mode: StepMode) -> Filling:
        """The buffer's record for this step, before its first tensor: on the device path's
        Triton kernels a sparse buffer selected per tensor takes its statistics while filling."""
        stats = (SegmentStats(len(buf.names), buf.device)
                 if buf.triton and buf.selection is buf.segments and not mode.sends_dense(buf) else None)
        return Filling([None] * len(buf.names), stats)

    def fill(self, buf: FusionBuffer, step: Filling, slot: int, mode: StepMode, flags: StepFlags,
             out: WriteBack, arrived: bool = True) -> None:
        """Fill the buffer's tensor ``slot`` with its gradient (``arrived``: its hook fired on this
        rank in this step), or with zeros, its residual kept (no gradient here)."""
        p, name = buf.params[slot], buf.names[slot]
        flags.arrive(name, arrived)
        if arrived:
            g = self._gradient(p, name)
            step.grads[slot] = out.grad_of(p)  # where the reduced gradient will go
            if self.clipping is not None:
                g = self.clipping(g)
            if self.spread is not None and self.spread.voting:
                self.spread.measure(name, g)
            if mode.sends_dense(buf):
                self._fill_dense(buf, step, slot, g, mode)
            else:
                self._fill_sparse(buf, step, slot, g, mode)
        else:
            step.grads[slot] = out.absent(p, name)
            self._keep(buf, step, slot, mode)
        step.filled.add(slot)

    def _gradient(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """``p.grad`` flat (a view where it is dense and contiguous), zeros if ``p`` has none."""
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

    def _fill_sparse(self, buf: FusionBuffer, step: Filling, slot: int, g: torch.Tensor, mode: StepMode) -> None:
        """``segment = gradient + scale · residual`` in the buffer, in place where the residual is
        the segment itself; non-finite gradient elements are dropped and counted."""
        flat = buf.allocate("flat")
        seg = buf.segment(slot)
        view = flat[seg]
        r = self.residuals.peek(buf.names[slot])
        residual = view if holds(r, flat, seg) else r
        if self.momentum is not None:
            g = self.momentum.accumulate(buf, slot, g, mode.rescale, buf.on_host)
        if buf.on_host:
            step.dropped += host.fill(view, g, residual, mode.scale)
            return
        if step.stats is not None:
            dropped, mx, total = kernels.accumulate(view, g, residual, mode.rescale, stats=True)
            step.stats.set(slot, (mx, total, torch.ones((), dtype=torch.bool, device=buf.device)))
        else:
            (dropped,) = kernels.accumulate(view, g, residual, mode.rescale)
        step.dropped_on_device = dropped if step.dropped_on_device is None else step.dropped_on_device + dropped

    def _fill_dense(self, buf: FusionBuffer, step: Filling, slot: int, g: torch.Tensor, mode: StepMode) -> None:
        """The gradient as it is sent dense, with the residual of earlier sparse steps and the
        momentum: into ``p.grad`` itself (reduced in place), or, in a buffer of small tensors,
        packed into the buffer's flat tensor. The residual goes along whole at density 1 (a
        warm-up's dense steps, a critical step sent as float16); after sparse steps at a density
        below 1 (the dense plan's steps, a critical step sent as float32) it goes along a chunk
        per step (:func:`release`), as fast as those steps would have sent it."""
        dst = buf.allocate("flat")[buf.segment(slot)] if buf.dense else step.grads[slot]
        name = buf.names[slot]
        r = self.residuals.pop(name)
        if self.momentum is not None:
            g = self.momentum.accumulate(buf, slot, g, mode.rescale, buf.on_host)
        if r is not None and mode.release < 1.0:
            if holds(r, buf.flat, buf.segment(slot)):  # a dense step gives the buffer's flat up
                r = r.clone()
            if dst is not g:
                dst.copy_(g)
            chunk = release(r.numel(), mode)
            part = r[chunk] * mode.rescale if mode.rescale is not None else r[chunk]
            dst[chunk] += part
            r[chunk] = 0
            if mode.rescale is not None:
                r.mul_(mode.rescale)
            if bool(r.any()):
                self.residuals.bind(name, r)
            return
        if buf.on_host and (r is not None or dst is not g):
            host.fill(dst, g, r, mode.scale, drop=False)
            return
        if r is None:
            if dst is not g:
                dst.copy_(g)
        else:
            torch.add(g, r * mode.rescale if mode.rescale is not None else r, out=dst)

    def _keep(self, buf: FusionBuffer, step: Filling, slot: int, mode: StepMode) -> None:
        """No gradient here: the residual (and the momentum) stay as they are, rescaled in place
        to this step's loss scale. A dense step gives the buffer's flat up, so a residual in it
        moves to a tensor of its own; on a sparse step the residual (and a momentum in the
        buffer's plane, which masking would clear) are set aside, and the segment is zeroed
        (this rank's contribution: nothing; its statistics stay zero); :meth:`restore` puts them
        back after the collective."""
        name, seg = buf.names[slot], buf.segment(slot)
        r = self.residuals.peek(name)
        u = self.momentum.momenta.peek(name) if self.momentum is not None else None
        if mode.sends_dense(buf):
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
                step.aside.append(Aside(slot, r, u))
            else:  # u is a tensor of its own (or none), which masking does not touch
                step.aside.append(Aside(slot, r, None))
            flat[seg].zero_()
        if mode.rescale is not None:
            for t in (r, u):
                if t is not None:
                    t.mul_(mode.rescale)

    @staticmethod
    def restore(buf: FusionBuffer, step: Filling) -> None:
        """Put the residuals (and momenta) set aside by :meth:`_keep` back into the buffer's
        planes. The residual is added to what the step left in its segment (zeros, or what the
        protocol handed back), so nothing is lost."""
        for slot, r, u in step.aside:
            seg = buf.segment(slot)
            if r is not None:
                buf.flat[seg].add_(r)
            if u is not None:
                buf.momentum[seg].copy_(u)
        step.aside = []

    def keep_rest(self, buf: FusionBuffer) -> None:
        """What the selection left in the buffer is the new residual: each parameter's residual
        is its segment of the buffer (bound once; the buffer is filled in place from then on)."""
        for slot, name in enumerate(buf.names):
            seg = buf.segment(slot)
            if not holds(self.residuals.peek(name), buf.flat, seg):
                self.residuals.bind(name, buf.flat[seg])


def release(numel: int, mode: StepMode) -> slice:
    """The chunk of a residual that a dense step sends along after sparse steps at ``mode.release``:
    chunk ``step mod K`` of ``K = ceil(1/density)`` equal runs, so that every element goes once in
    ``K`` steps — the rate at which the sparse steps sent — and every rank sends the same chunk.
    At once, a residual of many steps' unsent gradient (and, under momentum correction, momentum)
    is one update many times a step's, which a model can fail to recover from."""
    k = math.ceil(1.0 / mode.release)
    c = mode.step % k
    return slice(c * numel // k, (c + 1) * numel // k)
