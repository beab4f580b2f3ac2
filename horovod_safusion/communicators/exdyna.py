"""``exdyna``: ExDyna's exclusive, dynamically balanced partitions (ExDyna §IV, Algorithms 1–4).

Per fusion buffer and step:

* **Block-based partitioning** (Alg. 2, once per buffer): the buffer is cut into ``n_b`` blocks of
  ``sz_blk`` elements (a multiple of 32 where the buffer is large enough; the remainder goes to
  the last partition), grouped into one contiguous partition per worker.
* **Dynamic partition allocation** (Alg. 3, every step): adjacent partitions whose last counts lie
  above ``α · k′/n`` and below ``k′/(α n)`` trade ``blk_move`` blocks (never shrinking one below
  ``min_blk`` blocks); then partition ``(t + rank) mod n`` goes to this worker (cyclic order).
* **Exclusive selection** (Alg. 4): of the elements the ``exdyna`` compressor selects with its
  thresholds (``|acc| ≥ δ``), this worker keeps those inside its partition — exactly Alg. 4's
  selection for the same δ. The others are not sent and go back to the residual (``leftover``).
* **Aggregation** (Alg. 1 lines 11–13, 18): an all-gather of the exclusive indices (int32 bits)
  gives every worker the same disjoint union U and the per-partition counts k_i; then every worker
  all-reduces *its accumulator* at U — its selected values and its residual there — and clears
  those positions (the residual part is removed through a negative ``leftover``). With
  exclusive partitions nothing builds up: |U| = Σ k_i.
* **Online threshold scaling** (Alg. 5, lines 14–15): the compressor is switched to global
  feedback; the job's k′ = |U| goes back to it through ``Pending.feedback``, and it scales its
  thresholds against its target k.

Statistics per buffer and step are kept in :attr:`ExDynaCommunicator.history`: the counts k_i, the actual
density k′/n_g and the all-gather padding overhead f(t) = n · max k_i / Σ k_i (Eq. 5) — the cost a
fixed-size all-gather would pay; Horovod's all-gather moves variable sizes without padding.
Selection itself runs over the whole buffer in the compressor (the controller's interface), so
this implementation keeps ExDyna's traffic properties but not its parallelised selection cost.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import horovod.torch as hvd

from .. import wire
from ..compressors.exdyna import ExDyna
from ..session import collective
from .accumulator import ascending, at_agreed
from .base import HISTORY, Communicator, Outgoing, Pending, Reduction, register_communicator, wait


@dataclass
class Partitions:
    """Block-based partitions of one flat buffer (ExDyna Alg. 2) and their adjustment (Alg. 3).

    Attributes:
        numel: elements of the buffer; ``workers``: n.
        sz_blk: elements per block; ``blk_part[i]``, ``blk_pos[i]``: blocks in / first block of
            partition i; ``counts[i]``: elements partition i selected at the last step.
    """

    numel: int
    workers: int
    blocks: int
    sz_blk: int = 0
    blk_part: list[int] = field(default_factory=list)
    blk_pos: list[int] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:  # Algorithm 2
        n = self.workers
        blocks = max(n, min(self.blocks, self.numel))
        temp = self.numel // blocks
        self.sz_blk = max(1, temp - temp % 32 if temp >= 32 else temp)
        n_b = self.numel // self.sz_blk
        quotient, remainder = divmod(n_b, n)
        self.blk_part = [quotient + 1 if i < remainder else quotient for i in range(n)]
        self.blk_pos = [0] * n
        for i in range(1, n):
            self.blk_pos[i] = self.blk_part[i - 1] + self.blk_pos[i - 1]

    def adjust(self, alpha: float, blk_move: int, min_blk: int) -> None:
        """Algorithm 3 lines 7–28: move blocks between adjacent partitions towards balance."""
        k = list(self.counts)
        total = sum(k)
        pk_prev, den_prev = total / self.workers, total / self.numel
        if not k or pk_prev <= 0:  # nothing selected, or too little to divide by: nothing to balance
            return
        k_move = blk_move * self.sz_blk * den_prev
        for i in range(self.workers - 1):
            det, det2 = k[i] / pk_prev, k[i + 1] / pk_prev
            if det > alpha and det2 < 1 / alpha:
                if self.blk_part[i] - blk_move < min_blk:
                    continue
                self.blk_part[i] -= blk_move
                self.blk_part[i + 1] += blk_move
                self.blk_pos[i + 1] -= blk_move
                k[i] -= k_move
                k[i + 1] += k_move
            if det < 1 / alpha and det2 > alpha:
                if self.blk_part[i + 1] - blk_move < min_blk:
                    continue
                self.blk_part[i] += blk_move
                self.blk_part[i + 1] -= blk_move
                self.blk_pos[i + 1] += blk_move
                k[i] += k_move
                k[i + 1] -= k_move

    def bounds(self, i: int) -> tuple[int, int]:
        """Element range of partition i (the last one also takes the remainder)."""
        lo = self.blk_pos[i] * self.sz_blk
        hi = self.numel if i == self.workers - 1 else (self.blk_pos[i] + self.blk_part[i]) * self.sz_blk
        return lo, hi

    def starts(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.bounds(i)[0] for i in range(self.workers)], dtype=torch.int64, device=device)


def allocation(step: int, rank: int, workers: int) -> int:
    """The partition a worker owns at ``step`` (Alg. 3 line 29: cyclic order)."""
    return (step % workers + rank) % workers


@register_communicator("exdyna")
class ExDynaCommunicator(Communicator):
    """ExDyna: exclusive dynamic partitions; all-gather of indices, all-reduce of values.

    Args:
        alpha: α > 1, the imbalance ratio that triggers a block move (Alg. 3).
        blk_move: blocks moved per adjustment; ``min_blk``: fewest blocks a partition keeps.
        blocks_per_worker: n_b / n, the granularity of the partitions (Alg. 2).
    """

    state_fields = ("partitions", "steps")  # carried by the optimizer's state_dict()

    def __init__(self, process_set=None, compression=hvd.Compression.none, *, alpha: float = 1.1,
                 blk_move: int = 2, min_blk: int = 1, blocks_per_worker: int = 64) -> None:
        super().__init__(process_set, compression)
        if alpha <= 1.0:
            raise ValueError(f"alpha must be > 1, got {alpha!r}")
        for arg, v in (("blk_move", blk_move), ("min_blk", min_blk), ("blocks_per_worker", blocks_per_worker)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{arg} must be a positive integer, got {v!r}")
        self.alpha, self.blk_move, self.min_blk, self.blocks_per_worker = float(alpha), blk_move, min_blk, blocks_per_worker
        self.partitions: dict[str, Partitions] = {}
        self.steps: dict[str, int] = {}
        self.history: deque[dict] = deque(maxlen=HISTORY)  # the last HISTORY buffer synchronisations

    def setup(self, compressor) -> None:
        if not isinstance(compressor, ExDyna):
            raise ValueError(f"communicator='exdyna' selects with ExDyna's thresholds and needs "
                             f"compressor='exdyna', got {compressor!r}")
        compressor.scaled_globally()

    def start(self, out: Outgoing, reduction: Reduction) -> Pending:
        ps = self.process_set
        n, me = ps.size(), ps.rank()
        tag, numel, residual, device, dtype = out.tag, out.numel, out.residual, out.device, out.dtype
        parts = self.partitions.get(tag)
        if parts is None or parts.numel != numel or parts.workers != n:
            parts = self.partitions[tag] = Partitions(numel, n, self.blocks_per_worker * n)
        t = self.steps.get(tag, 0)
        self.steps[tag] = t + 1
        if t > 0:
            parts.adjust(self.alpha, self.blk_move, self.min_blk)
        lo, hi = parts.bounds(allocation(t, me, n))
        indices, values = out.indices, out.values
        mine = (indices >= lo) & (indices < hi)  # Alg. 4: exclusive selection in the partition
        exclusive = indices[mine]
        handle = hvd.allgather_async(exclusive.to(wire.INDEX_DTYPE), name=collective(f"saf.exdyna.{tag}.idx"), process_set=ps)
        state: dict = {}

        def collect():
            gathered = wait(handle).to(torch.int64)  # U: disjoint, same on every rank
            acc = at_agreed(gathered, *ascending(indices, values), residual)  # Alg. 1 line 12
            acc, sent, ctx = acc.for_wire(self.compression, reduction)  # rounding stays in the residual
            reduced = wait(hvd.allreduce_async(sent, name=collective(f"saf.exdyna.{tag}.val"), op=hvd.Sum, process_set=ps))
            state.update(gathered=acc.agreed, sent=sent, leftover=acc.leftover())
            return self.compression.decompress(reduced, ctx).to(dtype)

        def decode(reduced):
            gathered = state["gathered"]
            self.decode_into(out, reduction, reduced, gathered)
            counts = torch.bincount(torch.bucketize(gathered, parts.starts(device), right=True) - 1,
                                    minlength=n).tolist()
            parts.counts = counts
            total = sum(counts)
            self.history.append({"tag": tag, "step": t, "counts": counts, "density": total / max(1, numel),
                                 "padding": n * max(counts) / total if total else 1.0})
            pending.feedback = total  # k′ = |U|, for Algorithm 5 (ExDyna Alg. 1 line 14)
            pending.selected = gathered.numel()
            pending.bytes_sent = exclusive.numel() * 4 + state["sent"].numel() * state["sent"].element_size()
            # all-gather: the other workers' indices; all-reduce: a ring's 2(n-1)/n of the values
            pending.bytes_received = (gathered.numel() - exclusive.numel()) * 4 + \
                int(2 * (n - 1) / n * state["sent"].numel() * state["sent"].element_size())
            pending.leftover = state["leftover"]  # raw values and residuals: not prescaled

        pending = Pending(collect, decode, exclusive.numel() * 4)
        return pending
