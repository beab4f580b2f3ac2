"""``allreduce``: dense synchronisation of a fusion buffer, as Horovod's own fusion does.

The buffer's gradients are reduced in place, as one group (``hvd.grouped_allreduce_async_``),
with Horovod's op and scale factors, so with the ``none`` compressor (or a dense step of a sparse
compressor: a warm-up step, the dense choice) the result equals ``hvd.DistributedOptimizer``'s and
the plugin holds no copy of the gradients: Horovod fuses them in its own fusion buffer, as it
does for ``hvd.DistributedOptimizer``. A buffer larger than Horovod's fusion buffer is reduced
tensor by tensor, each its own allreduce, as ``hvd.DistributedOptimizer`` submits them: Horovod
fuses what fits its fusion buffer; a group larger than the buffer (even a group of one tensor)
would make Horovod grow the buffer to the group's size and keep it at that size
(docs/benchmarks.md, "Memory", has the measurement). With a sparsifying compressor the selected
values are placed into the zeroed gradients first, which isolates the effect of sparsification on
accuracy from any traffic saving. A rider (:attr:`~.base.Outgoing.rider`) goes last in the group,
reduced alike, and is written back in place when the collective completes.
"""
from __future__ import annotations

import os

import torch
import horovod.torch as hvd

from ..session import collective
from .base import Communicator, Outgoing, Pending, Reduction, register_communicator, wait


def fusion_threshold() -> int:
    """Horovod's fusion buffer size in bytes (``HOROVOD_FUSION_THRESHOLD``, 64 MiB by default)."""
    return int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 64 * 1024 * 1024))


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
        riders = [] if out.rider is None else [out.rider]
        compressed = [self.compression.compress(t) for t in tensors + riders]
        sent = [c for c, _ in compressed]

        def decode(reduced: list[torch.Tensor]) -> None:
            for t, r, (c, ctx) in zip(tensors, reduced, compressed):  # (the rider is not decoded)
                if c is not t:  # wire compression: the reduced copy back into the gradient
                    t.copy_(self.compression.decompress(r, ctx))

        def collected(reduced: list[torch.Tensor]) -> list[torch.Tensor]:
            if riders and compressed[-1][0] is not out.rider:  # the rider's reduced copy back in place
                out.rider.copy_(self.compression.decompress(reduced[-1], compressed[-1][1]))
            return reduced

        scale = dict(op=reduction.op, prescale_factor=reduction.prescale, postscale_factor=reduction.postscale,
                     process_set=self.process_set)
        nbytes = sum(c.numel() * c.element_size() for c in sent[:len(tensors)])
        if nbytes > fusion_threshold():
            handles = [hvd.allreduce_async_(c, name=collective(f"saf.ar.{out.tag}.{i}"), **scale)
                       for i, c in enumerate(sent)]
            return Pending(lambda: collected([wait(h) for h in handles]), decode, nbytes)
        # (a group of another composition under another name: Horovod's response cache keys by name)
        name = f"saf.ar.{out.tag}" + (".rider" if riders else "")
        handle = hvd.grouped_allreduce_async_(sent, name=collective(name), **scale)
        return Pending(lambda: collected(wait(handle)), decode, nbytes)
