"""``allgather``: SAFusion's sparse synchronisation (§3.1 Steps 2–3).

Every rank contributes its selected (value, index) rows of a buffer to one ``hvd.allgather`` (rows
the device path's selection wrote itself travel as they are); every rank then adds all rows into
a zero buffer with ``index_add_`` (:func:`horovod_safusion.kernels.decode_rows`) (equal indices from different
ranks add up, unlike the ``scatter_`` of Cupcake's and Espresso's prototypes), and scales.
Traffic per rank grows with the worker count; the sparse collectives of the seeds
(ZEN, SparDL, ExDyna) are the alternatives.
"""
from __future__ import annotations

import torch
import horovod.torch as hvd

from .. import kernels, wire
from .base import Communicator, Pending, register_communicator, wait


@register_communicator("allgather")
class Allgather(Communicator):
    """Sparse allgather of value/index rows, aggregated with ``index_add_``."""

    takes_rows = True

    def start(self, tag, values, indices, numel, op, prescale, postscale, rows=None) -> Pending:
        dtype, device = values.dtype, values.device
        plain = self.compression is hvd.Compression.none
        if rows is None or prescale != 1.0 or not plain:
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
            out = self.output(tag, numel, dtype, device)
            if plain:
                kernels.decode_rows(gathered, out)
            else:
                got_values, got_indices = wire.unpack(gathered, sent.dtype)
                out.index_add_(0, got_indices, self.compression.decompress(got_values, ctx).to(dtype))
            if scale != 1.0:
                out.mul_(scale)
            return out

        pending = Pending(lambda: wait(handle), decode, rows.numel())
        return pending
