"""Controller: push sparsified gradients into fusion buffers and pull aggregated ones back.

SAFusion §4 "Controller module" and §3.1 Steps 1–3. The controller keeps the mapping
tensor → fusion buffer of the current :class:`FusionPlan`. When a gradient is ready (its hook
fires) it is added to the parameter's error-feedback residual and copied into its segment of the
buffer; when the buffer's *last* tensor is in, one selection runs over the buffer — per segment
(= per tensor) for ``ahead``, over the whole buffer for ``behind`` — the unselected rest becomes
the new residual, and ONE asynchronous collective starts, overlapping the rest of
back-propagation. :meth:`Controller.synchronize` submits every buffer that has not started (so no
rank hangs when a parameter got no gradient), waits, splits the aggregated flat buffer into
tensors and writes ``p.grad``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .communicators import Communicator, Pending
from .compressors import Compressor
from .plan import FusionPlan
from .residual import ResidualStore
from .segment import Segments
from .timeline.recorder import COMPRESS, DECOMPRESS, MEMCPY_IN, MEMCPY_OUT


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


class FusionBuffer:
    """One fusion buffer: its parameters, their segments of one flat tensor, and its state."""

    def __init__(self, index: int, names: Sequence[str], params: Sequence[torch.Tensor], order: str) -> None:
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"fusion buffer {index} mixes dtypes {sorted(map(str, dtypes))} or devices "
                             f"{sorted(map(str, devices))}; one buffer is one flat tensor")
        self.index = index
        self.tag = str(index)
        self.names = tuple(names)
        self.params = tuple(params)
        self.dtype, self.device = params[0].dtype, params[0].device
        self.tensors = Segments(self.names, tuple(p.numel() for p in params), self.device)
        # Selection segments: one per tensor (ahead) or one for the whole buffer (behind).
        self.selection = (self.tensors if order == "ahead" else
                          Segments((f"{self.names[0]}..{self.names[-1]}",), (self.tensors.numel,), self.device))
        self.numel = self.tensors.numel
        self.flat: torch.Tensor | None = None
        self.filled: set[int] = set()
        self.pending: Pending | None = None
        self.indices: torch.Tensor | None = None  # what the last launch selected

    def segment(self, slot: int) -> slice:
        off = self.tensors.offsets[slot]
        return slice(off, off + self.tensors.sizes[slot])


def sparsify(compressor: Compressor, flat: torch.Tensor, segments: Segments,
             step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Select from ``flat`` and leave the unselected rest in it (it becomes the residual).

    Returns ``(values, indices)``; ``indices`` is ``None`` when everything is sent, and then
    ``values`` is ``flat`` itself.
    """
    indices = None if compressor.dense else compressor.select(flat, segments, step)
    if indices is None:
        return flat, None
    values = flat[indices]
    flat.index_fill_(0, indices, 0)
    return values, indices


class Controller:
    """Fills fusion buffers from gradient hooks and synchronises one collective per buffer.

    Args:
        named_params: ``(name, parameter)`` of every trainable parameter.
        plan: the fusion plan; must hold each name exactly once.
        compressor: selects the elements to send (``dense`` compressors skip selection).
        communicator: synchronises one buffer per collective.
        op, prescale, postscale: Horovod's reduction op and scale factors.
        sparse_as_dense: densify sparse gradients (as in Horovod) instead of rejecting them.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], plan: FusionPlan,
                 compressor: Compressor, communicator: Communicator, op: int,
                 prescale: float = 1.0, postscale: float = 1.0, sparse_as_dense: bool = False) -> None:
        self.params = dict(named_params)
        self.compressor = compressor
        self.communicator = communicator
        self.op, self.prescale, self.postscale = op, prescale, postscale
        self.sparse_as_dense = sparse_as_dense
        self.residuals = ResidualStore()
        self.steps = 0
        self.last_stats = StepStats()
        self.recorder = None  # a StepRecorder while the generator profiles this step
        self.timeline = None  # a TimelineRecorder when the timeline is on (horovod_safusion.timeline)
        self.set_plan(plan)

    # ---- plan ----------------------------------------------------------------------------
    def set_plan(self, plan: FusionPlan) -> None:
        """Switch to ``plan`` between steps; residuals are per parameter and carry over."""
        if any(b.pending is not None or b.filled for b in getattr(self, "buffers", ())):
            raise RuntimeError("the fusion plan can only change between steps (after synchronize())")
        plan.validate(self.params, {n: p.numel() for n, p in self.params.items()})
        self.plan = plan
        self.buffers = [FusionBuffer(i, names, [self.params[n] for n in names], plan.order)
                        for i, names in enumerate(plan.buffers)]
        self._slot = {id(self.params[n]): (b, slot) for b in self.buffers for slot, n in enumerate(b.names)}

    # ---- push: called from the gradient hooks ----------------------------------------------
    def grad_ready(self, p: torch.Tensor) -> None:
        """Copy ``p``'s error-compensated gradient into its buffer; launch the buffer when full."""
        buf, slot = self._slot[id(p)]
        if slot in buf.filled:
            return
        rec, tl = self.recorder, self.timeline
        if rec:
            rec.gradient_ready(buf.names[slot])
        t = tl.mark() if tl else None
        self._fill(buf, slot)
        if len(buf.filled) == len(buf.names):
            self._launch(buf)
        if tl:
            tl.gradient_ready(buf.names[slot], t)
        if rec:
            rec.hook_done()

    def _gradient(self, buf: FusionBuffer, slot: int) -> torch.Tensor:
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

    def _fill(self, buf: FusionBuffer, slot: int) -> None:
        tl = self.timeline
        t = tl.mark() if tl else None
        if buf.flat is None:
            buf.flat = torch.empty(buf.numel, dtype=buf.dtype, device=buf.device)
        seg = buf.flat[buf.segment(slot)]
        g = self._gradient(buf, slot)
        if self.compressor.dense:
            seg.copy_(g)
        else:
            torch.add(g, self.residuals.get(buf.names[slot], seg), out=seg)
        buf.filled.add(slot)
        if tl:
            tl.span(MEMCPY_IN, t, tensor=buf.names[slot])

    def _launch(self, buf: FusionBuffer) -> None:
        tl = self.timeline
        t = tl.mark() if tl else None
        values, indices = sparsify(self.compressor, buf.flat, buf.selection, self.steps)
        if indices is None:
            for name in buf.names:
                self.residuals.discard(name)  # everything was sent
        else:
            for slot, name in enumerate(buf.names):  # what stayed behind is the new residual
                rest = buf.flat[buf.segment(slot)]
                self.residuals.get(name, rest).copy_(rest)
        buf.indices = indices  # counted in synchronize(), not here in the gradient hook
        if tl:
            t = tl.span(COMPRESS, t, buffer=buf.index, elements=buf.numel, selected=values.numel())
        extra = {"residual": buf.flat if indices is not None else None} if self.communicator.wants_residual else {}
        buf.pending = self.communicator.start(buf.tag, values, indices, buf.numel, self.op,
                                              self.prescale, self.postscale, **extra)
        if tl:
            tl.submitted(buf.index, t)

    # ---- pull: called from optimizer.synchronize() -------------------------------------------
    def synchronize(self) -> StepStats:
        """Start what has not started, wait for every buffer, write the aggregated ``p.grad``."""
        rec, tl = self.recorder, self.timeline
        if tl:
            tl.synchronize_begins()
        for buf in self.buffers:  # same order on every rank
            if buf.pending is None:
                for slot in range(len(buf.names)):
                    if slot not in buf.filled:
                        self._fill(buf, slot)
                self._launch(buf)
        stats = StepStats(buffers=len(self.buffers))
        for buf in self.buffers:
            t = tl.mark() if tl else None
            buf.pending.collect()  # waiting: communication
            t0 = rec.clock.mark() if rec else None
            t = tl.collected(buf.index, t) if tl else None
            out = buf.pending.wait()  # decoding and write-back: computation after communication
            t = tl.span(DECOMPRESS, t, buffer=buf.index) if tl else None
            leftover = buf.pending.leftover  # what the protocol dropped: back into error feedback
            for slot, p in enumerate(buf.params):
                self._write_grad(p, out[buf.segment(slot)])
                if leftover is not None:
                    rest = leftover[buf.segment(slot)]
                    self.residuals.get(buf.names[slot], rest).add_(rest)
            if tl:
                tl.span(MEMCPY_OUT, t, buffer=buf.index)
            if rec:
                rec.aggregated(t0, rec.clock.mark())
            stats.tensors += len(buf.names)
            stats.elements += buf.numel
            stats.bytes_sent += buf.pending.bytes_sent
            stats.bytes_received += buf.pending.bytes_received or 0
            if buf.pending.selected is not None:
                stats.selected += buf.pending.selected
            elif buf.indices is None:
                stats.selected += buf.numel
            else:
                counts = buf.tensors.counts(buf.indices)
                stats.selected += int(counts.sum())
                stats.missing += int((counts == 0).sum())
            buf.pending, buf.indices = None, None
            buf.filled.clear()
        self.steps += 1
        self.last_stats = stats
        if rec:
            rec.synchronized()
        if tl:
            tl.synchronize_ends()
        return stats

    @staticmethod
    def _write_grad(p: torch.Tensor, flat: torch.Tensor) -> None:
        value = flat.view(p.shape)
        if p.grad is None:
            p.grad = value.clone()
        elif p.grad.is_sparse:
            # Sparse grads do not support copy_ from dense; Horovod uses the same equivalent.
            p.grad.zero_().add_(value.to_sparse())
        else:
            p.grad.copy_(value)
