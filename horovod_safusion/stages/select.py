"""The second stage: one selection per fusion buffer (SAFusion §3.1 Step 1, "sparsification ahead").

When a buffer's last tensor is in, one selection runs over ``buf.selection``: one segment per
tensor under ``ahead`` (SAFusion's order), one for the whole buffer under ``behind``. The
unselected rest stays in the buffer's flat tensor and *is* the new residual (views, no copy).
Which path selects is chosen once per plan, from the buffer's dtype and device:

* :class:`HostSelection` — CPU float32/float64: the compressor selects (:func:`~horovod_safusion.
  compressors.sparsify`), with the compiled host kernels.
* :class:`DeviceSelection` — GPU buffers and half precision: the compressor proposes a selection
  on the device; the buffer is read back once — its selected count, which sizes the collective,
  together with whether the fill dropped non-finite elements — then the compressor's state
  commits (if nothing was dropped) and the selection is taken (straight into the wire rows where
  the kernels write them).

When Horovod's wire compression rounds values (``Compression.fp16``), the selected values are
rounded here, before the collective, and what rounding dropped stays in the residual, so
``residual_after + sent == residual_before + grad`` holds for the values actually sent.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import horovod.torch as hvd

from ..buffer import FusionBuffer
from ..compressors import Compressor, sparsify
from .record import Filling, Selected


class Selection(ABC):
    """Selects a full buffer's elements to send, and tells whether this rank dropped a
    non-finite gradient element in it (:attr:`Selected.poisoned`).

    Args:
        compressor: the job's compressor.
        compression: Horovod's wire compression of the values (rounds them if not ``none``).
    """

    def __init__(self, compressor: Compressor, compression: Any) -> None:
        self.compressor = compressor
        self.compression = compression
        self.rounds = compression is not hvd.Compression.none

    def __call__(self, buf: FusionBuffer, filling: Filling, step: int, density: float) -> Selected:
        selected = self.select(buf, filling, step, density)
        if self.rounds:
            return selected._replace(values=self.round_for_wire(buf, selected.values, selected.indices), rows=None)
        return selected

    @abstractmethod
    def select(self, buf: FusionBuffer, filling: Filling, step: int, density: float) -> Selected:
        """The selection of ``buf`` at the step's ``density`` (``filling``: its step's fill);
        the rest stays in ``buf.flat``."""

    def round_for_wire(self, buf: FusionBuffer, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``values`` as Horovod's wire compression delivers them; the rounding error goes back
        into the buffer's unselected rest (zero at ``indices``), i.e. into the residual. The
        difference of a value and its rounding is exact in the value's dtype, so
        ``rest + sent`` gives back the value bit for bit."""
        wire, ctx = self.compression.compress(values)
        sent = self.compression.decompress(wire, ctx).to(values.dtype)
        buf.flat.index_copy_(0, indices, values - sent)
        return sent


class HostSelection(Selection):
    """The compressor's host selection."""

    def select(self, buf: FusionBuffer, filling: Filling, step: int, density: float) -> Selected:
        values, indices = sparsify(self.compressor, buf.flat, buf.selection, step, density)
        return Selected(values, indices, None, filling.dropped > 0)


class DeviceSelection(Selection):
    """The compressor's device proposal, read back once."""

    def select(self, buf: FusionBuffer, filling: Filling, step: int, density: float) -> Selected:
        proposal = self.compressor.propose(buf.flat, buf.selection, step, density, stats=filling.stats)
        # the one host synchronisation of this buffer: the count, read along with the drops
        (values, indices, rows), finite = proposal.decide(dropped=filling.dropped_on_device)
        return Selected(values, indices, rows, not finite)


def selection_for(buf: FusionBuffer, compressor: Compressor, compression: Any) -> Selection:
    """The path that selects ``buf`` (:attr:`FusionBuffer.on_host`: by its dtype and device)."""
    return (HostSelection if buf.on_host else DeviceSelection)(compressor, compression)
