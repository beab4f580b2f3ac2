"""``zen``: ZEN's Balanced Parallelism and Hierarchical Centralization, chosen by Eqs. (1)–(2).

ZEN (OSDI'25):

* **Balanced Parallelism** (Definition 6, §3): *push* — every worker splits its selected
  (value, index) pairs by the shared hash h0 (an affine permutation of the buffer's indices cut
  into n ranges, :class:`~.zen_hash.AffinePartition`, so that no index set is stored) with
  lossless hierarchical hashing (Algorithm 1, :mod:`.zen_hash`) and sends partition i to worker i
  in one round (:mod:`.rounds`); the owner aggregates (values of equal indices add up).
  *Pull* — every owner announces its aggregated values with a hash bitmap over its index set
  𝕀_i (Algorithm 2), or with COO positions where its aggregate is sparser than 1/32 of 𝕀_i and
  COO is the smaller (:func:`~.zen_hash.pull_encode`), in one ``hvd.allgather``; every worker
  decodes them and writes the values. Both steps are balanced because h0 is universal
  (Theorem 2; imbalance ratios, Definition 8, are kept in :attr:`Zen.history`).
* **Hierarchical Centralization** (Definition 7): recursive doubling over the whole sparse tensor
  with aggregation at every stage; a worker count that is not a power of two first folds the extra
  workers into the first ones and sends them the result at the end.
* **Automatic choice** (§2.3, Theorem 1): for its first ``choice_steps`` steps a buffer runs
  Hierarchical Centralization and measures, per stage, the size of the aggregated union it
  receives (the densification ratios γ^(2^(i−1))) and the final union (γ^n). The measurements are
  averaged over workers with one small allreduce, so every worker takes the same decision:
  Balanced Parallelism if Eq. (1) ``(n−1)/n · (γ^n + 1)`` is at most Eq. (2)'s measured
  ``Σ_i γ^(2^(i−1))`` (the stage volumes HC actually received, in units of one worker's selection),
  with the pull priced as it travels (bitmap or COO) and, for n not a power of two, HC's fold and
  unfold added (:func:`choose_scheme`).

The hash seeds are drawn on rank 0 and broadcast in :meth:`Zen.setup` (ZEN §4). Indices travel as
int32 bits; a server's bitmap marks the indices it *received* (not the nonzero sums), so an exact
zero sum is delivered as the zero it is.
"""
from __future__ import annotations

import math
import secrets
from collections import deque

import numpy as np
import torch
import horovod.torch as hvd

from ..session import collective
from .base import HISTORY, Communicator, Outgoing, Pending, Reduction, register_communicator, wait
from .p2p import RowCodec, SparseSum
from .rounds import Round, RoundsCommunicator
from .zen_hash import COO, AffinePartition, hash_family, hierarchical_hash, pull_decode, pull_encode

SCHEMES = ("auto", "bp", "hc")


@register_communicator("zen")
class Zen(RoundsCommunicator):
    """ZEN's sparse synchronisation.

    Args:
        scheme: ``"auto"`` (measure, then choose by Eqs. (1)–(2)), ``"bp"`` (Balanced Parallelism)
            or ``"hc"`` (Hierarchical Centralization).
        choice_steps: steps of measurement per buffer before ``"auto"`` decides.
        rehash: k, rehash functions before the serial area (the paper uses 3).
        memory: parallel slots r1 per partition in units of the partition's expected load
            (the paper's r1 = 2·|G|·d_G; the serial area r2 = r1 / 10).
        hash_slots: a fixed r1 instead (tests force collisions with a tiny one).
        seed: hash seed; ``None`` draws one on rank 0 and broadcasts it in :meth:`setup`.
        rounds: how the rounds travel (:mod:`.rounds`): ``"auto"``, ``"horovod"``, ``"gloo"``, or
            ``None`` (the default): ``$HOROVOD_SAFUSION_ROUNDS``, else ``"auto"``.
    """

    state_fields = ("seed", "choice", "gamma_stats", "_measured", "numels")  # carried by the optimizer's state_dict()

    def __init__(self, process_set=None, compression=hvd.Compression.none, *, scheme: str = "auto",
                 choice_steps: int = 3, rehash: int = 3, memory: float = 2.0, hash_slots: int | None = None,
                 seed: int | None = None, rounds: str | None = None) -> None:
        super().__init__(process_set, compression, rounds=rounds)
        if scheme not in SCHEMES:
            raise ValueError(f"unknown ZEN scheme {scheme!r}; known schemes: {', '.join(SCHEMES)}")
        if not isinstance(choice_steps, int) or choice_steps < 1:
            raise ValueError(f"choice_steps must be a positive integer, got {choice_steps!r}")
        if not isinstance(rehash, int) or rehash < 0:
            raise ValueError(f"rehash must be a non-negative integer, got {rehash!r}")
        if memory <= 0:
            raise ValueError(f"memory must be > 0, got {memory!r}")
        if hash_slots is not None and (not isinstance(hash_slots, int) or hash_slots < 1):
            raise ValueError(f"hash_slots must be a positive integer or None, got {hash_slots!r}")
        self.scheme, self.choice_steps, self.rehash = scheme, choice_steps, rehash
        self.memory, self.hash_slots, self.seed = float(memory), hash_slots, seed
        self.choice: dict[str, str] = {}  # per buffer tag, once decided
        self.gamma_stats: dict[str, np.ndarray] = {}  # the worker-averaged measurements behind it
        self._measured: dict[str, list[np.ndarray]] = {}
        self.history: deque[dict] = deque(maxlen=HISTORY)  # the last HISTORY buffer synchronisations

    def setup(self, compressor) -> None:
        if self.seed is None:  # ZEN §4: random seeds on one worker, broadcast to all (drawn from
            # the OS: Python's own random stream is the user's, which rank 0 alone would advance)
            self.seed = hvd.broadcast_object(secrets.randbelow(1 << 30), root_rank=0, name=collective("saf.zen.seed"),
                                             process_set=self.process_set)
        super().setup(compressor)

    def scheme_for(self, tag: str) -> str:
        """The scheme the buffer ``tag`` uses next."""
        if self.scheme != "auto":
            return self.scheme
        return self.choice.get(tag, "hc")

    def start(self, out: Outgoing, reduction: Reduction) -> Pending:
        if self.seed is None:
            raise RuntimeError("the zen communicator has no hash seed: DistributedOptimizer calls setup(); "
                               "pass seed= when driving a Controller yourself")
        if self.renewed(out):  # a new plan measures anew
            for table in (self.choice, self.gamma_stats, self._measured):
                table.pop(out.tag, None)
        run = (_BalancedParallelism if self.scheme_for(out.tag) == "bp" else _HierarchicalCentralization)
        return run(self, out, reduction).pending

    # ---- Eqs. (1)–(2) ---------------------------------------------------------------------------
    def measured(self, tag: str, stats: np.ndarray, weight: float, numel: int) -> None:
        """HC's per-worker measurements ``[|I_w|, received per stage..., |I|]`` of one step of the
        buffer ``tag`` of ``numel`` elements (weight 0 for workers folded out of the recursive
        doubling); after ``choice_steps`` steps, decide (a collective: called in buffer order on
        every worker)."""
        if self.scheme != "auto" or tag in self.choice:
            return
        self._measured.setdefault(tag, []).append(np.concatenate([[weight], weight * stats]))
        if len(self._measured[tag]) < self.choice_steps:
            return
        total = hvd.allreduce(torch.from_numpy(np.sum(self._measured.pop(tag), axis=0)), op=hvd.Sum,
                              name=collective(f"saf.zen.gamma.{tag}"), process_set=self.process_set).numpy()
        self.gamma_stats[tag] = total[1:] / total[0]
        self.choice[tag] = choose_scheme(self.process_set.size(), total[1:] / total[0], numel)


def choose_scheme(workers: int, stats: np.ndarray, numel: int | None = None) -> str:
    """``"bp"`` if Eq. (1) ≤ Eq. (2) for worker-averaged ``[|I_w|, received per HC stage..., |I|]``
    of a buffer of ``numel`` elements, both in units of one worker's selection.

    Eq. (1) prices the pull in COO entries (value and index, half of it index). The pull sends the
    smaller of COO and the hash bitmap (:func:`~.zen_hash.pull_encode`): the index half of ``|I|``
    entries, or ``numel/8`` bytes of bitmap, i.e. ``min(|I|/2, numel/64)`` entries of 8 bytes
    (``numel=None``: COO, as the paper). Eq. (2) assumes a power of two; otherwise HC also folds one
    worker's selection into another first and sends the union to it last, on the critical path:
    ``1 + γ^n`` more."""
    local, stages, union = stats[0], stats[1:-1], stats[-1]
    if local <= 0:
        return "bp"
    pull = union if numel is None else union / 2 + min(union / 2, numel / 64)
    t_bp = (workers - 1) / workers * (pull / local + 1)  # Eq. (1) / (2 M d_G / b)
    t_hc = float(np.sum(stages)) / local                  # Eq. (2): Σ_i γ^(2^(i−1))
    if workers & (workers - 1):
        t_hc += 1 + union / local                         # the fold and the unfold
    return "bp" if t_bp <= t_hc else "hc"


class _Run:
    """Common state of one buffer's synchronisation."""

    def __init__(self, comm: Zen, out: Outgoing, reduction: Reduction) -> None:
        ps = comm.process_set
        self.comm, self.ps, self.out, self.reduction = comm, ps, out, reduction
        self.tag, self.numel = out.tag, out.numel
        self.size, self.me = ps.size(), ps.rank()
        self.dtype, self.device = out.dtype, out.device
        self.codec = RowCodec(self.dtype, comm.compression)
        self.indices = out.indices
        self.values = reduction.prescaled(out.values)
        self.bytes_sent = self.bytes_received = 0

    def _finish(self, values: torch.Tensor, indices: torch.Tensor) -> None:
        """The reduced gradient from the aggregated ``values`` at ``indices``."""
        self.pending.bytes_sent, self.pending.bytes_received = self.bytes_sent, self.bytes_received
        self.comm.decode_into(self.out, self.reduction, values, indices)


class _BalancedParallelism(_Run):
    """Push by h0 with hierarchical hashing (alltoall), aggregate, pull with hash bitmaps (allgather)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        comm, n = self.comm, self.size
        self.h0 = h0 = AffinePartition(comm.seed, self.numel, n)
        load = max(1, math.ceil(self.indices.numel() / n))
        r1 = comm.hash_slots or max(1, math.ceil(comm.memory * load))
        hashed = hierarchical_hash(self.indices, h0, hash_family(comm.seed + 1, comm.rehash, r1), r1, max(1, r1 // 10))
        self.serial, self.overflow = sum(hashed.serial), hashed.overflow
        parts = [self.codec.encode(self.values[pos], self.indices[pos]) for pos in hashed.positions]
        self.push_counts = [int(pos.numel()) for pos in hashed.positions]
        self.push = comm.start_round(dict(enumerate(parts)), range(n), f"saf.zen.{self.tag}.push", self.codec.empty(self.device))
        self.bytes_sent += self.push.bytes_sent
        self.pending = Pending(self._collect, self._decode, self.bytes_sent)

    def _collect(self):
        got = self.push.wait()
        self.bytes_received += self.push.bytes_received
        values, indices = self.codec.decode(torch.cat(got))
        # aggregation on the owner, in the order of its index set 𝕀_me (the bitmap's order)
        local = SparseSum(self.h0.position(indices, self.me), values)
        sent, _ = self.comm.compression.compress(local.values)
        payload = torch.cat([pull_encode(local.indices, self.h0.size(self.me)), sent.contiguous().view(torch.uint8)])
        gathered = wait(hvd.allgather_async(payload, name=collective(f"saf.zen.{self.tag}.pull"), process_set=self.ps))
        self.bytes_sent += payload.numel()
        self.bytes_received += gathered.numel() - payload.numel()
        return gathered, sent.dtype

    def _decode(self, raw) -> None:
        gathered, wire_dtype = raw
        esize = torch.empty(0, dtype=wire_dtype).element_size()
        offset, indices, values, coo = 0, [], [], 0
        for owner in range(self.size):  # rank order: [bitmap or COO | values] per owner; the owners' index sets are disjoint
            positions, offset, fmt = pull_decode(gathered, offset, self.h0.size(owner))
            coo += fmt == COO
            idx = self.h0.members(owner, positions)
            raw_values = gathered[offset:offset + idx.numel() * esize].clone().view(wire_dtype)
            offset += idx.numel() * esize
            indices.append(idx)
            values.append(self.comm.compression.decompress(raw_values, self.dtype).to(self.dtype))
        pulled = [idx.numel() for idx in indices]
        n, local, union = self.size, max(1, self.indices.numel()), max(1, sum(pulled))
        self.comm.history.append({"tag": self.tag, "scheme": "bp", "push_imbalance": n * max(self.push_counts) / local,
                                  "pull_imbalance": n * max(pulled) / union, "serial": self.serial,
                                  "overflow": self.overflow, "pull_coo": coo, "selected": self.indices.numel(), "union": sum(pulled)})
        self._finish(torch.cat(values), torch.cat(indices))


class _HierarchicalCentralization(_Run):
    """Recursive doubling with aggregation at every stage (folding workers beyond a power of two);
    the aggregate is held sparse (:class:`~.p2p.SparseSum`)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        n = self.size
        self.pow2 = 1 << (n.bit_length() - 1)
        self.acc = SparseSum(self.indices, self.codec.round(self.values))
        self.received: list[int] = []
        # stage 0: fold the workers beyond the largest power of two into the first ones
        dest = self.me - self.pow2 if self.me >= self.pow2 else self.me
        self.exchange = self._send(dest, self.me + self.pow2 if self.me + self.pow2 < n else self.me, "fold")
        self.pending = Pending(self._collect, self._decode, self.bytes_sent)

    def _send(self, dest: int, src: int, label: str) -> Round:
        """A round that sends what is held to ``dest`` and receives from ``src`` (either is this
        rank itself where it sends or receives nothing)."""
        sends = {dest: self.codec.encode(self.acc.values, self.acc.indices)} if dest != self.me else {}
        ex = self.comm.start_round(sends, [src] if src != self.me else [], f"saf.zen.{self.tag}.{label}",
                                   self.codec.empty(self.device))
        self.bytes_sent += ex.bytes_sent
        return ex

    def _absorb(self, ex: Round) -> int:
        got = ex.wait() or [self.codec.empty(self.device)]
        self.bytes_received += ex.bytes_received
        values, indices = self.codec.decode(torch.cat(got))  # nothing is ever sent to oneself
        self.acc.merge(indices, values)
        at = torch.searchsorted(self.acc.indices, indices)
        self.acc.values[at] = self.codec.round(self.acc.values[at])  # what travels next, on both sides
        return indices.numel()

    def _collect(self):
        self._absorb(self.exchange)
        active = self.me < self.pow2
        dist = 1
        while dist < self.pow2:  # recursive doubling among the first pow2 workers
            partner = self.me ^ dist if active else self.me
            self.received.append(self._absorb(self._send(partner, partner, f"rd{dist}")))
            dist <<= 1
        extra = self.me + self.pow2 if self.me + self.pow2 < self.size else self.me
        unfold = self._send(extra, self.me, "unfold") if active else self._send(self.me, self.me - self.pow2, "unfold")
        if not active:  # take the result as it is: the same sums as everywhere else
            self.acc = SparseSum(self.indices[:0], self.values[:0])
        self._absorb(unfold)
        return self.acc

    def _decode(self, _raw) -> None:
        union = len(self.acc)
        stats = np.array([self.indices.numel(), *self.received, union], dtype=np.float64)
        self.comm.history.append({"tag": self.tag, "scheme": "hc", "selected": self.indices.numel(),
                                  "union": union, "stages": list(self.received)})
        self._finish(self.acc.values, self.acc.indices)
        self.comm.measured(self.tag, stats, 1.0 if self.me < self.pow2 else 0.0, self.numel)
