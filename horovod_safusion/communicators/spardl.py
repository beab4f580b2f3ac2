"""``spardl``: SparDL's Spar-Reduce-Scatter, global residual collection and Bruck all-gather.

SparDL (VLDB) §3.1 and Algorithm 1, for any worker count P:

1. **Dividing.** The buffer is cut into P equal index blocks; worker w keeps block w in its
   preservation bag B_0 and puts the next 2^0 blocks into B_1, the next 2^1 into B_2, ..., the
   remaining E = P − 2^(l−1) blocks into B_l, with l = ⌈log2 P⌉ (blocks on a circle).
2. **Transmission with sparsification** (non-recursive, Theorem 3.1). At step i = 1..l worker w
   sends bag B_(l−i+1) to w + 2^(l−i) and receives the same bag from w − 2^(l−i); the received
   blocks are a subset of the blocks it still holds (Theorem 3.1), so it adds them in (values of
   equal indices add up) and, before the next step, keeps only the top-b values of each block it
   is about to send (the "optimization for SRS": sparsify only the blocks sent next). After l steps
   worker w holds only block w, which it also cuts to its top-b (Alg. 1 line 10).
3. **Bruck all-gather** (§2, Figure 2b) of the final blocks: ⌈log2 P⌉ steps, at step t worker w
   sends its first min(2^t, P − 2^t) collected blocks to w − 2^t and receives as many from w + 2^t.

**Global residual collection** (§3.2): every value dropped by those selections — in-procedure
and end-procedure residuals, which may come from other workers — is kept by the worker that
dropped it (Alg. 1 line 8): the communicator hands it back through ``Pending.leftover`` and the
controller adds it to that worker's *per-parameter* residuals. Local residuals (the compressor's
unselected elements) stay where the controller keeps them. So across the job nothing is lost::

    Σ_ranks residual_after + P · applied == Σ_ranks (gradient + residual_before)

The per-block budget b is this worker's selected count spread over the blocks in proportion to
their sizes (the paper's k/P for equal blocks and equal k; with threshold compressors the workers'
counts differ, which the protocol does not need to agree on). At density 1 every budget is the
whole block and the result is the dense sum. Received volume per worker: about 2k(P−1)/P rows
([value | index], the paper's 4k(P−1)/P words, Eq. 3).

**Teams** (§3.3, ``teams=d``): the workers form d teams of P/d; SRS and the final Bruck all-gather
run inside each team (P/d blocks, budget L = dk/P per block), and between them the workers at the
same position of every team synchronise their one block by Spar-All-Gather:

* **R-SAG** (d a power of two): recursive doubling; after each exchange both sides add and keep
  the top-L. The 2^s workers that now hold identical sums dropped identical values, so each keeps
  1/2^s of them (the paper's "half" is right for the first stage only; 1/2^s keeps the sum exact).
* **B-SAG** (otherwise): each keeps its top-h, Bruck all-gathers across the teams, adds the d
  blocks (in team order, so every worker rounds alike), keeps the top-L and each keeps 1/d of
  what that dropped. h starts at k/P and moves by Algorithm 2 (a CWnd-like step that doubles
  after two moves the same way and halves and turns when the count N_t after B-SAG crosses L),
  clamped to [k/P, dk/P].
"""
from __future__ import annotations

import math

import torch
import horovod.torch as hvd

from .base import Outgoing, Pending, Reduction, register_communicator
from .p2p import RowCodec, SparseSum
from .rounds import Round, RoundsCommunicator


def srs_steps(size: int) -> list[tuple[int, int, int]]:
    """Spar-Reduce-Scatter schedule: per step ``(distance, first, stop)`` — worker w sends the
    blocks ``w + first .. w + stop − 1`` (mod P) to ``w + distance`` and keeps ``w .. w + first − 1``.

    ``distance = first = 2^(l−i)`` and ``stop = min(2^(l−i+1), P)`` at step i (SparDL §3.1)."""
    levels = math.ceil(math.log2(size)) if size > 1 else 0
    return [(1 << (levels - i), 1 << (levels - i), min(1 << (levels - i + 1), size)) for i in range(1, levels + 1)]


def bruck_steps(size: int) -> list[tuple[int, int]]:
    """Bruck all-gather schedule: per step ``(distance, blocks)`` — worker w sends its first
    ``blocks`` collected blocks to ``w − distance`` and receives as many from ``w + distance``."""
    out, dist = [], 1
    while dist < size:
        out.append((dist, min(dist, size - dist)))
        dist <<= 1
    return out


def block_bounds(numel: int, size: int) -> list[int]:
    """P + 1 boundaries of P nearly equal index blocks of a flat buffer."""
    return [j * numel // size for j in range(size + 1)]


@register_communicator("spardl")
class SparDL(RoundsCommunicator):
    """SparDL: Spar-Reduce-Scatter (any P) + Bruck all-gather, residuals kept globally.

    Args:
        teams: d, the number of teams (must divide the worker count); 1 is plain SparDL, more use
            R-SAG (d a power of two) or B-SAG (otherwise) between the teams.
        rounds: how the rounds travel (:mod:`.rounds`): ``"auto"``, ``"horovod"``, ``"gloo"``, or
            ``None`` (the default): ``$HOROVOD_SAFUSION_ROUNDS``, else ``"auto"``.
    """

    state_fields = ("h_state", "numels")  # carried by the optimizer's state_dict()

    def __init__(self, process_set=None, compression=hvd.Compression.none, *, teams: int = 1,
                 rounds: str | None = None) -> None:
        super().__init__(process_set, compression, rounds=rounds)
        if not isinstance(teams, int) or teams < 1:
            raise ValueError(f"teams must be a positive integer, got {teams!r}")
        self.teams = teams
        self.h_state: dict[str, BSAGStep] = {}  # B-SAG's h per buffer tag (Algorithm 2)

    def setup(self, compressor) -> None:
        self._check(self.process_set.size())
        super().setup(compressor)

    def _check(self, size: int) -> None:
        if size % self.teams:
            raise ValueError(f"teams={self.teams} must divide the worker count {size}; "
                             f"accepted: {[d for d in range(1, size + 1) if size % d == 0]}")

    def start(self, out: Outgoing, reduction: Reduction) -> Pending:
        self._check(self.process_set.size())
        if self.renewed(out):
            self.h_state.pop(out.tag, None)
        return _SparDLRun(self, out, reduction).pending


class BSAGStep:
    """Algorithm 2 (SparDL §3.3): the top-h of B-SAG, adjusted after every step from N_t.

    ``h`` starts at k/P with step 0.01·k(d−1)/P; when ``(N_t > L) xor (step > 0)`` the step goes the
    right way and doubles on every second such step, otherwise it turns and halves."""

    def __init__(self, k: float, d: int, P: int) -> None:
        self.low, self.high = k / P, d * k / P
        self.h, self.step, self.flag = self.low, 0.01 * k * (d - 1) / P, False
        self.L = d * k / P

    def update(self, n_t: int) -> None:
        if (n_t > self.L) != (self.step > 0):
            if self.flag:
                self.step, self.flag = self.step * 2, False
            else:
                self.flag = True
        else:
            self.step, self.flag = -self.step / 2, False
        self.h = min(self.high, max(self.low, self.h + self.step))


class _SparDLRun:
    """One buffer's SparDL synchronisation: step 1 starts here, the rest runs in ``collect``. The
    held blocks and what this worker dropped are sparse (:class:`~.p2p.SparseSum`), so a run
    holds memory in proportion to the selection, not to the buffer."""

    def __init__(self, comm: SparDL, out: Outgoing, reduction: Reduction) -> None:
        ps = comm.process_set
        self.comm, self.ps, self.out, self.reduction = comm, ps, out, reduction
        self.tag = out.tag
        numel = out.numel
        self.world, rank = ps.size(), ps.rank()
        self.d = comm.teams
        self.team_size = self.world // self.d  # workers per team: SRS and the final all-gather run here
        self.team, self.me = divmod(rank, self.team_size)
        self.team_ranks = [self.team * self.team_size + j for j in range(self.team_size)]
        self.cross_ranks = [t * self.team_size + self.me for t in range(self.d)]  # same position, every team
        self.dtype, self.device = out.dtype, out.device
        self.codec = RowCodec(self.dtype, comm.compression)
        # The held values (prescaled) and what this worker dropped (its share, prescaled).
        self.held = SparseSum(out.indices, reduction.prescaled(out.values))
        self.dropped: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bounds = block_bounds(numel, self.team_size)
        self.count = count = out.indices.numel()
        self.budget = [min(hi - lo, math.ceil(count * (hi - lo) / numel)) if numel else 0
                       for lo, hi in zip(self.bounds[:-1], self.bounds[1:])]
        self.steps = srs_steps(self.team_size)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._exchange = self._send_step(0) if self.steps else None
        self.pending = Pending(self._collect, self._decode, self.bytes_sent)

    # ---- Spar-Reduce-Scatter ------------------------------------------------------------------
    def _span(self, block: int) -> slice:
        """Where the values this worker holds in ``block`` are."""
        return self.held.span(self.bounds[block], self.bounds[block + 1])

    def _keep_top(self, block: int, budget: int, share: float = 1.0) -> None:
        """Keep the top-``budget`` held values of ``block``; of the dropped ones this worker keeps
        ``share`` as its residual (1 unless other workers dropped the very same values)."""
        span = self._span(block)
        values = self.held.values[span]
        if values.numel() <= budget:
            return
        keep = torch.zeros(values.numel(), dtype=torch.bool, device=self.device)
        keep[torch.topk(values.abs(), budget, sorted=False).indices] = True
        gone = ~keep
        self.dropped.append((self.held.indices[span][gone], values[gone] * share if share != 1.0 else values[gone]))
        whole = torch.ones(len(self.held), dtype=torch.bool, device=self.device)
        whole[span] = keep
        self.held.remove(whole)

    def _take(self, blocks: list[int]) -> torch.Tensor:
        """Rows of the held values of ``blocks``, which leave this worker."""
        idx, values = self.held.take([self._span(j) for j in blocks])
        return self.codec.encode(values, idx)

    def _round(self, rows: torch.Tensor, dest: int, src: int, label: str) -> Round:
        """Send ``rows`` to rank ``dest`` and receive from rank ``src`` in one round."""
        ex = self.comm.start_round({dest: rows}, [src], f"saf.spardl.{self.tag}.{label}", self.codec.empty(self.device))
        self.bytes_sent += ex.bytes_sent
        return ex

    def _send_step(self, i: int) -> Round:
        dist, first, stop = self.steps[i]
        blocks = [(self.me + rel) % self.team_size for rel in range(first, stop)]
        for j in blocks:  # sparsify only the blocks sent next (SparDL §3.1, "Optimization for SRS")
            self._keep_top(j, self.budget[j])
        return self._round(self._take(blocks), self.team_ranks[(self.me + dist) % self.team_size],
                           self.team_ranks[(self.me - dist) % self.team_size], f"srs{i}")

    def _receive(self, ex: Round) -> torch.Tensor:
        """The rows of a round's one source."""
        got, = ex.wait()
        self.bytes_received += ex.bytes_received
        return got

    def _collect(self) -> list[torch.Tensor]:
        for i in range(len(self.steps)):
            if i > 0:
                self._exchange = self._send_step(i)
            values, indices = self.codec.decode(self._receive(self._exchange))
            self.held.merge(indices, values)  # equal indices add up
        self._keep_top(self.me, self.budget[self.me])  # end of procedure: the preserved block (Alg. 1 l. 10)
        if self.d > 1:
            (self._recursive_sag if self.d & (self.d - 1) == 0 else self._bruck_sag)()
        return self._bruck(self._take([self.me]))

    # ---- Spar-All-Gather between teams (§3.3) -------------------------------------------------
    def _frame(self, blocks: list[tuple[torch.Tensor, torch.Tensor, int]]) -> torch.Tensor:
        """Rows of blocks of the *same* index range, each after two header rows whose indices are
        ``-1 - count`` and ``-1 - budget``: the blocks must stay apart (B-SAG adds them in team
        order) and the workers that merge them must agree on one budget L."""
        out = []
        for values, indices, budget in blocks:
            header = torch.tensor([-1 - indices.numel(), -1 - budget], dtype=torch.int64, device=self.device)
            out.append(self.codec.encode(torch.zeros(2, dtype=self.dtype, device=self.device), header))
            out.append(self.codec.encode(values, indices))
        return torch.cat(out)

    def _unframe(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        values, indices = self.codec.decode(rows)
        out, at = [], 0
        while at < indices.numel():
            n, budget = -1 - int(indices[at]), -1 - int(indices[at + 1])
            out.append((values[at + 2:at + 2 + n], indices[at + 2:at + 2 + n], budget))
            at += 2 + n
        return out

    def _own_block(self, budget: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The held block as it travels (wire-rounded values), taken out of the held values."""
        idx, values = self.held.take([self._span(self.me)])
        return self.codec.round(values), idx, budget

    def _cross(self, rows: torch.Tensor, dest: int, src: int, label: str) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        return self._unframe(self._receive(self._round(rows, dest, src, label)))

    def _add(self, blocks: list[tuple[torch.Tensor, torch.Tensor, int]]) -> int:
        """Add blocks (in the given order) into the held values; their agreed budget L."""
        for values, indices, _ in blocks:
            self.held.merge(indices, values)
        return max(b for _, _, b in blocks)

    def _recursive_sag(self) -> None:
        """R-SAG: recursive doubling between teams, top-L after each exchange. Partners add the
        same two blocks (a + b = b + a) and agree on L = the larger budget, so both keep the same."""
        dist, stage, budget = 1, 1, self.budget[self.me]
        while dist < self.d:
            partner = self.cross_ranks[self.team ^ dist]
            mine = self._own_block(budget)
            theirs = self._cross(self._frame([mine]), partner, partner, f"rsag{dist}")
            budget = self._add([mine, *theirs])
            self._keep_top(self.me, budget, 1.0 / (1 << stage))  # 2^stage workers dropped the same values
            dist, stage = dist << 1, stage + 1

    def _bruck_sag(self) -> None:
        """B-SAG: top-h, Bruck all-gather between teams, sum in team order, top-L (Algorithm 2 for h)."""
        state = self.comm.h_state.get(self.tag)
        if state is None:
            state = self.comm.h_state[self.tag] = BSAGStep(self.count, self.d, self.world)
        self._keep_top(self.me, math.ceil(state.h))  # a local selection: its residual stays here
        blocks = {self.team: self._own_block(self.budget[self.me])}
        collected = [self.team]
        for t, (dist, count) in enumerate(bruck_steps(self.d)):
            got = self._cross(self._frame([blocks[j] for j in collected[:count]]),
                              self.cross_ranks[(self.team - dist) % self.d],
                              self.cross_ranks[(self.team + dist) % self.d], f"bsag{t}")
            for c, blk in enumerate(got):
                j = (self.team + dist + c) % self.d
                blocks[j] = blk
                collected.append(j)
        budget = self._add([blocks[j] for j in range(self.d)])  # team order: identical sums everywhere
        n_t = len(self.held)
        self._keep_top(self.me, budget, 1.0 / self.d)  # d workers dropped the same values
        state.update(n_t)

    # ---- Bruck all-gather ---------------------------------------------------------------------
    def _bruck(self, own: torch.Tensor) -> list[torch.Tensor]:
        collected = [own]  # blocks me, me + 1, ... in order
        for t, (dist, blocks) in enumerate(bruck_steps(self.team_size)):
            ex = self._round(torch.cat(collected[:blocks]), self.team_ranks[(self.me - dist) % self.team_size],
                             self.team_ranks[(self.me + dist) % self.team_size], f"bruck{t}")
            got = self._receive(ex)
            collected.extend(self._split_blocks(got, (self.me + dist) % self.team_size, blocks))
        return collected

    def _split_blocks(self, rows: torch.Tensor, first: int, blocks: int) -> list[torch.Tensor]:
        """Rows of ``blocks`` consecutive blocks starting at ``first`` → one row tensor per block."""
        _, indices = self.codec.decode(rows)
        owner = torch.bucketize(indices, torch.tensor(self.bounds[1:], device=self.device), right=True)
        rel = (owner - first) % self.team_size
        order = torch.argsort(rel, stable=True)
        counts = torch.bincount(rel, minlength=blocks)[:blocks].tolist()
        return list(torch.split(rows[order], counts))

    # ---- decode -------------------------------------------------------------------------------
    def _decode(self, blocks: list[torch.Tensor]) -> None:
        values, indices = self.codec.decode(torch.cat(blocks))
        self.comm.decode_into(self.out, self.reduction, values, indices)
        p = self.pending
        p.bytes_sent, p.bytes_received = self.bytes_sent, self.bytes_received
        if self.dropped:
            gone = SparseSum(torch.cat([i for i, _ in self.dropped]), torch.cat([v for _, v in self.dropped]))
            p.leftover = (gone.indices, self.reduction.unprescaled(gone.values))
