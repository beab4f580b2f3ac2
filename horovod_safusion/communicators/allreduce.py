"""``allreduce``: dense synchronisation of a fusion buffer, as Horovod's own fusion does.

The buffer's gradients are reduced in place, as one group (``hvd.grouped_allreduce_async_``),
with Horovod's op and scale factors, so with the ``none`` compressor (or a dense step of a sparse
compressor: a warm-up step, the dense choice) the result equals ``hvd.DistributedOptimizer``'s and
the plugin holds no copy of the gradients: Horovod fuses them in its own fusion buffer, as it
does for ``hvd.DistributedOptimizer``. With a sparsifying compressor the selected values are
placed into the zeroed gradients first, which isolates the effect of sparsification on accuracy
from any traffic saving.
"""
from __future__ import annotations

import torch
import horovod.torch as hvd

from ..session import collective
from .base import Communicator, Outgoing, Pending, Reduction, register_communicator, wait


@register_communicator("allreduce")
class Allreduce(Communicator):
    """Dense in-place allreduce of a buffer's gradients (``op`` and scale factors passed through to
    Horovod)."""

    dense = True

    def start(self, out: Outgoing, reduction: Reduction) -> Pending:
        if out.target is None:  # a sweep: its values are the dense buffer
            tensors = [out.values]
        else:
            tensors = list(out.target.tensors)
            if out.values is not None:  # a sparse selection, sent dense
                out.target.zero()
                out.target.add(out.values, out.indices)
        compressed = [self.compression.compress(t) for t in tensors]
        sent = [c for c, _ in compressed]
        handle = hvd.grouped_allreduce_async_(sent, name=collective(f"saf.ar.{out.tag}"), op=reduction.op,
                                              prescale_factor=reduction.prescale,
                                              postscale_factor=reduction.postscale, process_set=self.process_set)

        def decode(reduced: list[torch.Tensor]) -> None:
            for t, r, (c, ctx) in zip(tensors, reduced, compressed):
                if c is not t:  # wire compression: the reduced copy back into the gradient
                    t.copy_(self.compression.decompress(r, ctx))

        return Pending(lambda: wait(handle), decode, sum(c.numel() * c.element_size() for c in sent))
