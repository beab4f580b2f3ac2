"""The fusion buffer: one flat tensor per buffer of the fusion plan, cut into one segment per tensor.

SAFusion §3.1 Steps 1–2 and §4 "Controller module": gradients are added into their segments as
their hooks fire, and one selection and one collective run per buffer. The flat tensor is also
where the buffer's error-feedback residuals live between steps: the selection zeroes what it sent
and leaves the rest in place, and the next step adds its gradients on top (no copy, no second
buffer). So a sparse job holds one flat tensor per gradient element, which error feedback needs
anyway. A dense step (Horovod's allreduce) reduces the gradients in place and needs no flat: a
buffer allocates its flat at its first sparse step and gives it up when a dense step has sent its
residuals along.

With momentum correction (DGC §3.2) a buffer keeps a second flat of the same layout for the
momentum ``u``. Both are *planes* of the buffer: a per-parameter store (:class:`~horovod_safusion.
residual.ResidualStore`) maps each parameter to its view of a plane, so that a new fusion plan
and a checkpoint see per-parameter tensors; :func:`gather` moves them into the planes of a new plan.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Mapping, Sequence

import numpy as np
import torch

from . import kernels
from .residual import ResidualStore, holds
from .segment import Segments


class FusionBuffer:
    """One fusion buffer: its parameters, their segments of one flat tensor, and the planes that
    live across steps. What one step makes of it is a record of its own
    (:mod:`horovod_safusion.stages.record`).

    Attributes:
        segments: one segment per tensor, in the plan's order.
        selection: the segments one selection runs over: :attr:`segments` (``ahead``) or one
            segment for the whole buffer (``behind``), with the least density of each
            (:meth:`set_floors`).
        flat: ``gradient + residual`` while a sparse step fills it, the residuals between steps;
            ``None`` until the first sparse step, and after a dense one.
        momentum: DGC's momentum ``u`` in the same layout, when momentum correction is on.
    """

    def __init__(self, index: int, names: Sequence[str], params: Sequence[torch.Tensor], order: str,
                 dense: bool = False) -> None:
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"fusion buffer {index} mixes dtypes {sorted(map(str, dtypes))} or devices "
                             f"{sorted(map(str, devices))}; one buffer is one flat tensor")
        self.index = index
        self.dense = dense  # sent dense at every step (small tensors), never sparsified
        self.tag = str(index)
        self.names = tuple(names)
        self.params = tuple(params)
        self.dtype, self.device = params[0].dtype, params[0].device
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        self.on_host = kernels.on_host(probe)  # the host path fills and selects it (else the device path)
        self.triton = not self.on_host and kernels.uses_triton(probe)  # the device path's Triton kernels
        self.segments = Segments(self.names, tuple(p.numel() for p in params), self.device)
        # Selection segments: one per tensor (ahead) or one for the whole buffer (behind).
        self.selection = (self.segments if order == "ahead" else
                          Segments((f"{self.names[0]}..{self.names[-1]}",), (self.segments.numel,), self.device))
        self.numel = self.segments.numel
        self.bounds = np.append(self.segments.offset_array, self.numel)  # the segments' bounds
        self.flat: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None
        self.siblings = [weakref.ref(self)]  # the plan's buffers allocated together (link())

    def set_floors(self, floors: Mapping[str, float], density: float) -> None:
        """Select each tensor named in ``floors`` at no less than its floor (a spread gradient's,
        :mod:`~horovod_safusion.spread`) from now on. A buffer selected whole (``behind``) selects
        as many as its tensors would at the job's ``density``: its floor is their mean density."""
        per = tuple(float(floors.get(n, 0.0)) for n in self.names)
        whole = self.selection is not self.segments
        self.segments = dataclasses.replace(self.segments, floors=per if any(per) else ())
        if not whole:
            self.selection = self.segments
            return
        mean = float(np.dot(self.segments.size_array, np.maximum(density, per))) / max(1, self.numel)
        self.selection = dataclasses.replace(self.selection, floors=(mean,) if mean > density else ())

    def segment(self, slot: int) -> slice:
        off = self.segments.offsets[slot]
        return slice(off, off + self.segments.sizes[slot])

    def allocate(self, plane: str) -> torch.Tensor:
        """The flat tensor of ``plane`` (``"flat"`` or ``"momentum"``). If the buffer has none, one
        zeroed tensor is allocated for it and every buffer of its plan (of its dtype and device,
        :func:`link`) that has none either, each taking its consecutive slice in plan order: the
        planes of a plan lie one after the other in one storage, so a later plan whose buffers
        are consecutive runs of the same order takes them over without a copy (:func:`gather`)."""
        t = getattr(self, plane)
        if t is None:
            lacking = [b for b in (ref() for ref in self.siblings) if b is not None and getattr(b, plane) is None]
            arena = torch.zeros(sum(b.numel for b in lacking), dtype=self.dtype, device=self.device)
            at = 0
            for b in lacking:
                setattr(b, plane, arena[at:at + b.numel])
                at += b.numel
            t = getattr(self, plane)
        return t


def link(buffers: Sequence[FusionBuffer]) -> None:
    """Tell each buffer the buffers of its plan that share its dtype and device (its
    ``siblings``, in plan order, itself included), whose planes it allocates together. The
    references are weak: a buffer of a plan given up must not live on (and keep its planes'
    memory) until the garbage collector finds the circle."""
    for buf in buffers:
        buf.siblings = [weakref.ref(b) for b in buffers if (b.dtype, b.device) == (buf.dtype, buf.device)]


def gather(buffers: Sequence[FusionBuffer], store: ResidualStore, plane: str) -> None:
    """Move every parameter's tensor in ``store`` into ``plane`` of the buffer that now holds it,
    and make the store's entries views of it; parameters with none get zeros where a plane is
    made. A buffer that has the plane already (a loaded checkpoint) keeps it; one whose
    parameters' tensors lie one after the other in one storage, in order (an old buffer, or a run
    of an old plan's buffers: they share one storage), takes that memory as it is, so a new plan
    that regroups the same order of tensors copies nothing and needs no memory more — but only
    where the new buffers that can do so take the *whole* old storage between them: a storage
    that some of them kept while the others moved out would stay alive for the rest of training
    with the memory of the tensors that left it. The other buffers get a plane allocated
    (for all of them at once) and filled, and an old storage is freed once no tensor lives in it
    any more."""
    candidates: dict[int, list[tuple[FusionBuffer, torch.Tensor]]] = {}  # per old storage
    for buf in buffers:  # first every buffer that can take its tensors' memory as it is
        if getattr(buf, plane) is None:
            whole = _whole([store.peek(name) for name in buf.names], buf.numel)
            if whole is not None:
                candidates.setdefault(whole.untyped_storage().data_ptr(), []).append((buf, whole))
    for runs in candidates.values():
        storage = runs[0][1].untyped_storage()
        if sum(whole.numel() for _, whole in runs) * runs[0][1].element_size() == storage.nbytes():
            for buf, whole in runs:
                setattr(buf, plane, whole)
    for buf in buffers:
        views = [store.peek(name) for name in buf.names]
        flat = getattr(buf, plane)
        if flat is None:
            if all(v is None for v in views):
                continue
            flat = buf.allocate(plane)
        for slot, (name, v) in enumerate(zip(buf.names, views)):
            seg = buf.segment(slot)
            if holds(v, flat, seg):
                continue
            view = flat[seg]
            view.copy_(v.reshape(-1)) if v is not None else view.zero_()
            store.bind(name, view)


def _whole(views: Sequence[torch.Tensor | None], numel: int) -> torch.Tensor | None:
    """The flat tensor of ``numel`` elements that ``views`` are consecutive pieces of, in one
    storage (a whole old buffer, or a run of an old plan's buffers, which lie one after the other:
    :meth:`FusionBuffer.allocate`), or ``None``."""
    if any(v is None for v in views):
        return None
    storage, first = views[0].untyped_storage(), views[0].storage_offset()
    at = first
    for v in views:
        if v.untyped_storage().data_ptr() != storage.data_ptr() or v.storage_offset() != at or not v.is_contiguous():
            return None
        at += v.numel()
    if at - first != numel:
        return None
    return torch.empty(0, dtype=views[0].dtype, device=views[0].device).set_(storage, first, (numel,), (1,))
