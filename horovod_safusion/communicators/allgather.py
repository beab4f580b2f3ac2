"""``allgather``: SAFusion's sparse synchronisation (§3.1 Steps 2–3).

Every rank contributes its selected (value, index) rows of a buffer to one ``hvd.allgather``;
every rank then adds all rows into a zero buffer with ``index_add_`` (equal indices from different
ranks add up, unlike the ``scatter_`` of Cupcake's and Espresso's prototypes), and scales.
Traffic per rank grows with the worker count; the sparse collectives of the seeds
(ZEN, SparDL, ExDyna) are the alternatives.
"""
from __future__ import annotations

import torch
import horovod.torch as hvd

from .. import wire
from .base import Communicator, Pending, register_communicator, wait


@register_communicator("allgather")
class Allgather(Communicator):
    """Sparse allgather of value/index rows, aggregated with ``index_add_``."""

    def start(self, tag, values, indices, numel, op, prescale, postscale) -> Pending:
        dtype, device = values.dtype, values.device
        if indices is None:
            indices = torch.arange(numel, device=device)
        if prescale != 1.0:
            values = values * prescale
        sent, ctx = self.compression.compress(values)
        rows = wire.pack(sent, indices)
        handle = hvd.allgather_async(rows, name=f"saf.ag.{tag}", process_set=self.process_set)
        scale = postscale / (self.process_set.size() if op == hvd.Average else 1)

        def decode(gathered: torch.Tensor) -> torch.Tensor:
            pending.bytes_received = gathered.numel() - rows.numel()  # the other ranks' rows
            got_values, got_indices = wire.unpack(gathered, sent.dtype)
            got_values = self.compression.decompress(got_values, ctx).to(dtype)
            out = self.output(tag, numel, dtype, device)
            out.index_add_(0, got_indices, got_values)
            if scale != 1.0:
                out.mul_(scale)
            return out

        pending = Pending(lambda: wait(handle), decode, rows.numel())
        return pending
