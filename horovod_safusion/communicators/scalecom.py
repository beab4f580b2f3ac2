"""``scalecom``: ScaleCom's cyclic local top-k (CLT-k; Chen et al., NeurIPS'20; not in the
reference set): one leader's selection, every rank's accumulator summed there.

Per fusion buffer and step:

* **A leader in cyclic order.** At the buffer's step ``t`` rank ``t mod P`` leads. Its compressor's
  selection (the rank's own top-k of its accumulator, or its threshold's elements) becomes the
  job's index set U; every other rank's selection is not sent.
* **The leader's indices** travel in one all-gather to which only the leader contributes, so it
  works as a broadcast whose length only the leader knows: as int32 bits, or as a bitmap over the
  buffer where the selection is denser than 1/32 (ZEN's pull format, ZEN §3.3 Alg. 2,
  :func:`~horovod_safusion.communicators.zen_hash.pull_encode`), one bit per element instead of
  32 per selected one.
* **Every rank's accumulator at U** — its selected value where it selected one, plus its residual —
  goes into one all-reduce of |U| values (the all-reduce half of ExDyna's aggregation,
  :mod:`~horovod_safusion.communicators.accumulator`). Every rank applies the job's exact sum at U;
  what a rank selected outside U, and what it sent from its residual, go back through
  ``Pending.leftover``, so error feedback keeps every element.

What it buys: each rank receives the leader's index set and a ring all-reduce's
``2(P − 1)/P · |U|`` values, so the bytes do not grow with the worker count, where the
allgather's ``(P − 1)·k`` rows do. What it costs: two collectives in sequence per buffer, and a
step applies k elements of the sum where the allgather applies the union of the ranks'
selections, up to ``P·k``; the others' large elements wait in their residuals until their rank
leads (the paper relies on the workers' accumulators being alike, which small batches weaken).
The paper's low-pass filter on the error feedback is not built: the residual is the plugin's, as
for every communicator. Asked for by name (``communicator="scalecom"``); ``"auto"`` does not hold
it, because it applies another update.
"""
from __future__ import annotations

import torch
import horovod.torch as hvd

from ..session import collective
from .accumulator import ascending, at_agreed
from .base import Communicator, Outgoing, Pending, Reduction, register_communicator, wait
from .zen_hash import pull_decode, pull_encode


@register_communicator("scalecom")
class ScaleCom(Communicator):
    """CLT-k: a cyclic leader's indices, every rank's accumulator there in one all-reduce."""

    state_fields = ("steps",)  # carried by the optimizer's state_dict(): who leads next

    def __init__(self, process_set=None, compression=hvd.Compression.none) -> None:
        super().__init__(process_set, compression)
        self.steps: dict[str, int] = {}

    def leader(self, tag: str) -> int:
        """The rank that leads the buffer ``tag`` at its next start."""
        return self.steps.get(tag, 0) % self.process_set.size()

    def start(self, out: Outgoing, reduction: Reduction) -> Pending:
        ps = self.process_set
        n, me = ps.size(), ps.rank()
        tag, numel, residual = out.tag, out.numel, out.residual
        indices, values = ascending(out.indices, out.values)
        leads = self.leader(tag) == me
        self.steps[tag] = self.steps.get(tag, 0) + 1
        mine = pull_encode(indices, numel) if leads else indices.new_empty(0, dtype=torch.uint8)
        handle = hvd.allgather_async(mine, name=collective(f"saf.scalecom.{tag}.idx"), process_set=ps)
        state: dict = {}

        def collect():
            announced = wait(handle)
            agreed, _, _ = pull_decode(announced, 0, numel)  # the leader's selection: same on every rank
            acc = at_agreed(agreed, indices, values, residual)
            state["announced"] = announced.numel()
            acc, sent, ctx = acc.for_wire(self.compression, reduction)  # rounding stays in the residual
            reduced = wait(hvd.allreduce_async(sent, name=collective(f"saf.scalecom.{tag}.val"), op=hvd.Sum,
                                               process_set=ps))
            state.update(agreed=acc.agreed, sent=sent, leftover=acc.leftover())
            return self.compression.decompress(reduced, ctx).to(out.dtype)

        def decode(reduced):
            agreed, sent = state["agreed"], state["sent"]
            self.decode_into(out, reduction, reduced, agreed)
            pending.selected = agreed.numel()
            pending.bytes_sent = mine.numel() + sent.numel() * sent.element_size()
            # the leader's index set (the leader receives none), and a ring's 2(n-1)/n of the values
            pending.bytes_received = (0 if leads else state["announced"]) + \
                int(2 * (n - 1) / n * sent.numel() * sent.element_size())
            pending.leftover = state["leftover"]

        pending = Pending(collect, decode, mine.numel())
        return pending
