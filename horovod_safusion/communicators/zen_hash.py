"""ZEN's hashing: universal hash functions, hierarchical hashing (Alg. 1) and the hash bitmap (Alg. 2).

ZEN (OSDI'25) §3.2: a shared universal hash h0 maps every index of a tensor
to one of n partitions ("servers"), which balances push and pull whatever the distribution of the
non-zero gradients (Theorem 2). Algorithm 1 writes the indices into a per-partition memory of
``r1`` parallel slots, trying k rehash functions h1..hk and falling back to a serial overflow
area (an atomic counter per partition), so that *no index is lost* to collisions; the
partitioned sets are then read back from the memory. Here the parallel writes are vectorised:
per round, the free slots each take one of their candidates (``scatter_reduce`` with ``amax``),
the losers rehash; the serial area takes whatever is left and grows as needed (its planned size
``r2`` only counts overflows in :attr:`HashResult.serial`). The memory holds *positions* into the
input (plus one; 0 = empty) rather than the indices themselves, so values are read with the same
gather. A CUDA kernel for the hashing is not part of this module (PyTorch runs everywhere).

Algorithm 2: the set of indices owned by partition i, 𝕀_i = {idx | h0(idx) = i}, is computed
once per tensor size and sorted; a server announces its aggregated indices as a bitmap over 𝕀_i
(|𝕀_i|/8 bytes) instead of COO indices, and receivers decode ``𝕀_i[nonzero(bits)]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

PRIME = (1 << 31) - 1  # Mersenne prime > every int32 index


class UniversalHash:
    """``h(x) = ((a·x + b) mod p) mod m`` with p = 2^31 − 1 (Carter–Wegman), on int64 tensors."""

    def __init__(self, a: int, b: int, buckets: int) -> None:
        if not (1 <= a < PRIME and 0 <= b < PRIME and buckets >= 1):
            raise ValueError(f"need 1 <= a < p, 0 <= b < p, buckets >= 1; got a={a}, b={b}, buckets={buckets}")
        self.a, self.b, self.buckets = a, b, buckets

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * self.a + self.b) % PRIME) % self.buckets


def hash_family(seed: int, count: int, buckets: int) -> list[UniversalHash]:
    """``count`` hash functions into ``buckets`` drawn from ``seed`` (same seed → same family)."""
    g = torch.Generator().manual_seed(seed)
    ab = torch.randint(1, PRIME, (count, 2), generator=g).tolist()
    return [UniversalHash(a, b % PRIME, buckets) for a, b in ab]


@dataclass
class HashResult:
    """Output of :func:`hierarchical_hash`.

    Attributes:
        positions: per partition, positions into the input index array (each input exactly once).
        serial: indices that went to the serial area after k failed rehashes, per partition.
        overflow: indices beyond the planned serial size ``r2`` (kept all the same).
    """

    positions: list[torch.Tensor]
    serial: list[int]
    overflow: int


def hierarchical_hash(indices: torch.Tensor, h0: UniversalHash, rehash: list[UniversalHash],
                      r1: int, r2: int) -> HashResult:
    """ZEN Algorithm 1 over unique int64 ``indices``: partition by ``h0``, k rehash rounds into
    ``r1`` slots per partition, then the serial area; lossless by construction."""
    n = h0.buckets
    device = indices.device
    part = h0(indices)
    memory = torch.zeros(n * r1, dtype=torch.int64, device=device)
    todo = torch.arange(indices.numel(), device=device)
    for h in rehash:  # lines 6–16: parallel writes, losers rehash
        if todo.numel() == 0:
            break
        slot = part[todo] * r1 + h(indices[todo]) % r1
        free = memory[slot] == 0
        cand, cslot = todo[free], slot[free]
        memory.scatter_reduce_(0, cslot, cand + 1, reduce="amax")  # one writer per free slot wins
        won = memory[cslot] == cand + 1
        todo = torch.cat([todo[~free], cand[~won]])
    # lines 8–10: the serial area, an atomic counter per partition (a stable sort emulates it)
    left_part = part[todo]
    order = torch.argsort(left_part, stable=True)
    serial_sorted = todo[order]
    serial_counts = torch.bincount(left_part, minlength=n)
    serial = list(torch.split(serial_sorted, serial_counts.tolist()))
    # lines 19–23: extract each partition's entries from its memory
    table = memory.view(n, r1)
    positions = [torch.cat([table[i][table[i] > 0] - 1, serial[i]]) for i in range(n)]
    counts = serial_counts.tolist()
    return HashResult(positions, counts, sum(max(0, c - r2) for c in counts))


@lru_cache(maxsize=64)
def owned_sets(numel: int, a: int, b: int, n: int, device: str = "cpu") -> tuple[list[torch.Tensor], torch.Tensor]:
    """𝕀_i for every partition (sorted int64 index tensors) and each index's position in its 𝕀_i
    (int64, ``numel``). Computed once per tensor size and hash (ZEN §3.3.2)."""
    idx = torch.arange(numel, device=device)
    owner = UniversalHash(a, b, n)(idx)
    order = torch.argsort(owner, stable=True)
    sizes = torch.bincount(owner, minlength=n)
    sets = list(torch.split(idx[order], sizes.tolist()))
    starts = torch.cumsum(sizes, 0) - sizes
    where = torch.empty(numel, dtype=torch.int64, device=device)
    where[order] = torch.arange(numel, device=device) - starts[owner[order]]
    return sets, where


_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def bitmap_encode(bits: torch.Tensor) -> torch.Tensor:
    """Bool tensor → packed uint8 bitmap (``ceil(len/8)`` bytes, most significant bit first)."""
    pad = (-bits.numel()) % 8
    b = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    return (b << _SHIFTS.to(b.device)).sum(1, dtype=torch.uint8)


def bitmap_decode(packed: torch.Tensor, length: int) -> torch.Tensor:
    """Packed uint8 bitmap → bool tensor of ``length``."""
    return ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).view(-1)[:length].bool()
