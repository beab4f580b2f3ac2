"""``allreduce``: dense synchronisation of the fused buffer, as Horovod's own fusion does.

Selected values are placed into a zero buffer of the full size (all values when nothing was
dropped) and reduced with ``hvd.allreduce`` using Horovod's op and scale factors, so with the
``none`` compressor the result equals ``hvd.DistributedOptimizer``'s. With a sparsifying
compressor it isolates the effect of sparsification on accuracy from any traffic saving.
"""
from __future__ import annotations

import torch
import horovod.torch as hvd

from .base import Communicator, Pending, register_communicator, wait


@register_communicator("allreduce")
class Allreduce(Communicator):
    """Dense fused allreduce (``op`` and scale factors passed through to Horovod)."""

    dense = True

    def start(self, tag, values, indices, numel, op, prescale, postscale) -> Pending:
        dtype = values.dtype
        if indices is None:
            dense = values.contiguous()
        else:
            dense = self.output(tag, numel, dtype, values.device).index_copy_(0, indices, values)
        sent, ctx = self.compression.compress(dense)
        handle = hvd.allreduce_async_(sent, name=f"saf.ar.{tag}", op=op, prescale_factor=prescale,
                                      postscale_factor=postscale, process_set=self.process_set)

        def decode(reduced: torch.Tensor) -> torch.Tensor:
            return self.compression.decompress(reduced, ctx).to(dtype)

        return Pending(lambda: wait(handle), decode, sent.numel() * sent.element_size())
