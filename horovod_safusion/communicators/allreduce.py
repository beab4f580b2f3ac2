"""``allreduce``: dense synchronisation of the fused buffer, as Horovod's own fusion does.

Selected values are placed into a zero buffer of the full size (all values when nothing was
dropped) and reduced with ``hvd.allreduce`` using Horovod's op and scale factors, so with the
``none`` compressor the result equals ``hvd.DistributedOptimizer``'s. With a sparsifying
compressor it isolates the effect of sparsification on accuracy from any traffic saving.
"""
from __future__ import annotations

import torch
import horovod.torch as hvd

from ..session import collective
from .base import Communicator, Outgoing, Pending, Reduction, register_communicator, wait


@register_communicator("allreduce")
class Allreduce(Communicator):
    """Dense fused allreduce (``op`` and scale factors passed through to Horovod)."""

    dense = True

    def start(self, out: Outgoing, reduction: Reduction) -> Pending:
        dtype = out.dtype
        if out.indices is None:
            dense = out.values.contiguous()
        else:
            dense = self.output(out.tag, out.numel, dtype, out.device).index_copy_(0, out.indices, out.values)
        sent, ctx = self.compression.compress(dense)
        handle = hvd.allreduce_async_(sent, name=collective(f"saf.ar.{out.tag}"), op=reduction.op,
                                      prescale_factor=reduction.prescale, postscale_factor=reduction.postscale,
                                      process_set=self.process_set)

        def decode(reduced: torch.Tensor) -> torch.Tensor:
            return self.compression.decompress(reduced, ctx).to(dtype)

        return Pending(lambda: wait(handle), decode, sent.numel() * sent.element_size())
