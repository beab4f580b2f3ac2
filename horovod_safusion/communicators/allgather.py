"""``allgather``: SAFusion's sparse synchronisation (§3.1 Steps 2–3).

Every rank contributes its selected (value, index) rows of a buffer to one ``hvd.allgather`` (rows
the device path's selection wrote itself travel as they are); every rank then adds all rows into
the zeroed gradients of the buffer's parameters (:func:`horovod_safusion.kernels.decode_rows`;
equal indices from different ranks add up, unlike the ``scatter_`` of Cupcake's and Espresso's
prototypes), and scales.
Traffic per rank grows with the worker count; the sparse collectives of the seeds
(ZEN, SparDL, ExDyna) are the alternatives.
"""
from __future__ import annotations

import torch
import horovod.torch as hvd

from .. import wire
from ..session import collective
from .base import Communicator, Outgoing, Pending, Reduction, register_communicator, wait


@register_communicator("allgather")
class Allgather(Communicator):
    """Sparse allgather of value/index rows, aggregated with ``index_add_``."""

    def start(self, out: Outgoing, reduction: Reduction) -> Pending:
        plain = self.compression is hvd.Compression.none
        rows = out.rows
        if rows is None or reduction.prescale != 1.0 or not plain:
            sent, ctx = self.compression.compress(reduction.prescaled(out.values))
            rows = wire.pack(sent, out.indices)
        handle = hvd.allgather_async(rows, name=collective(f"saf.ag.{out.tag}"), process_set=self.process_set)

        def decode(gathered: torch.Tensor) -> None:
            pending.bytes_received = gathered.numel() - rows.numel()  # the other ranks' rows
            if plain:
                self.decode_into(out, reduction, rows=gathered)
                return
            got_values, got_indices = wire.unpack(gathered, sent.dtype)
            self.decode_into(out, reduction, self.compression.decompress(got_values, ctx).to(out.dtype), got_indices)

        pending = Pending(lambda: wait(handle), decode, rows.numel())
        return pending
