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

Algorithm 2: a server announces its aggregated indices as a bitmap over the set of indices it
owns, 𝕀_i = {idx | h0(idx) = i} (|𝕀_i|/8 bytes), instead of COO indices, and receivers decode
``𝕀_i[nonzero(bits)]``; where the aggregate is sparser than 1/32 of 𝕀_i, COO is smaller, and the
pull sends that instead (:func:`pull_encode`). Balanced Parallelism's h0 is an :class:`AffinePartition`, whose sets
are enumerated on the fly rather than stored (a stored 𝕀_i costs the buffer's length in
indices); the rehash functions h1..hk of Algorithm 1 are Carter–Wegman hashes.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

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


def hierarchical_hash(indices: torch.Tensor, h0: "UniversalHash | AffinePartition", rehash: list[UniversalHash],
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


class AffinePartition:
    """h0 of Balanced Parallelism over one buffer of ``numel`` indices, with index sets that are
    enumerated rather than stored: ``π(x) = (a·x + b) mod numel`` with ``a`` coprime to ``numel``
    is a permutation of the buffer's indices, and partition ``i`` owns the indices whose ``π``
    falls in the i-th of ``n`` equal ranges. An index's position in 𝕀_i (its hash-bitmap bit,
    Algorithm 2) is ``π(x)`` minus the range's start, and the owner of bit ``j`` decodes as
    ``π⁻¹(start + j)``. ZEN §3.3.2 computes the sets 𝕀_i once per tensor size and keeps them: for
    a Carter–Wegman h0 that is the buffer's length in indices, 8 bytes per gradient element (a
    second model's worth of memory per layout), which this h0 does not need. A random ``a``
    spreads a run of consecutive indices (an embedding's hot rows) over all ranges, as h0's
    balance (Theorem 2) requires; :attr:`Zen.history` records the imbalance actually seen.

    Args:
        seed: shared by all workers (ZEN §4: drawn on one worker and broadcast).
        numel: the buffer's size; ``n``: the number of partitions.
    """

    def __init__(self, seed: int, numel: int, n: int) -> None:
        rng = random.Random(seed * 1_000_003 + numel)
        a = rng.randrange(1, max(2, numel))
        while math.gcd(a, numel) != 1:
            a = rng.randrange(1, max(2, numel))
        self.a, self.b, self.numel, self.buckets = a, rng.randrange(0, max(1, numel)), numel, n
        self.inverse = pow(a, -1, numel) if numel > 1 else 0
        self.bounds = [-(-i * numel // n) for i in range(n + 1)]  # π ∈ [bounds[i], bounds[i + 1]) ⟺ owner i

    def _pi(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.a + self.b) % self.numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The partition (owner) of every index of ``x`` (int64)."""
        return self._pi(x) * self.buckets // self.numel

    def position(self, x: torch.Tensor, owner: int) -> torch.Tensor:
        """Positions in 𝕀_owner of indices ``x`` that ``owner`` owns."""
        return self._pi(x) - self.bounds[owner]

    def members(self, owner: int, positions: torch.Tensor) -> torch.Tensor:
        """The indices at ``positions`` of 𝕀_owner."""
        return (positions + self.bounds[owner] - self.b) % self.numel * self.inverse % self.numel

    def size(self, owner: int) -> int:
        """|𝕀_owner|."""
        return self.bounds[owner + 1] - self.bounds[owner]


_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def bitmap_encode(bits: torch.Tensor) -> torch.Tensor:
    """Bool tensor → packed uint8 bitmap (``ceil(len/8)`` bytes, most significant bit first)."""
    pad = (-bits.numel()) % 8
    b = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    return (b << _SHIFTS.to(b.device)).sum(1, dtype=torch.uint8)


def bitmap_decode(packed: torch.Tensor, length: int) -> torch.Tensor:
    """Packed uint8 bitmap → bool tensor of ``length``."""
    return ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).view(-1)[:length].bool()


#: The format byte that opens an owner's pull: the hash bitmap (Algorithm 2) or COO positions.
BITMAP, COO = 0, 1


def pull_encode(positions: torch.Tensor, owned: int) -> torch.Tensor:
    """The index part of one owner's pull: a format byte, then the hash bitmap over its ``owned``
    index set (Algorithm 2, ``ceil(owned/8)`` bytes) where that is no longer than COO, else COO: an
    int32 count and the int32 ``positions`` (4 bytes each). The bitmap pays off once the owner's
    aggregate is denser than 1/32 of its set (ZEN §3.3: the pull is dense after aggregation); below
    that COO is smaller, as §2.3 prices the pull. ``positions``: sorted, unique, int64, within the
    owner's index set (the order its values travel in)."""
    dev = positions.device
    if (owned + 7) // 8 <= 4 * (positions.numel() + 1):
        bits = torch.zeros(owned, dtype=torch.bool, device=dev)
        bits[positions] = True
        return torch.cat([torch.tensor([BITMAP], dtype=torch.uint8, device=dev), bitmap_encode(bits)])
    count = torch.tensor([positions.numel()], dtype=torch.int32, device=dev)
    return torch.cat([torch.tensor([COO], dtype=torch.uint8, device=dev), count.view(torch.uint8),
                      positions.to(torch.int32).view(torch.uint8)])


def pull_decode(raw: torch.Tensor, offset: int, owned: int) -> tuple[torch.Tensor, int, int]:
    """The sorted positions (int64) that one owner's pull, read from uint8 ``raw`` at ``offset``,
    announces over its ``owned`` index set, the offset after its index part, and its format
    (:data:`BITMAP` or :data:`COO`; see :func:`pull_encode`)."""
    fmt, offset = int(raw[offset]), offset + 1
    if fmt == BITMAP:
        nbytes = (owned + 7) // 8
        return torch.nonzero(bitmap_decode(raw[offset:offset + nbytes], owned)).squeeze(1), offset + nbytes, fmt
    count = int(raw[offset:offset + 4].clone().view(torch.int32))
    start = offset + 4
    return raw[start:start + 4 * count].clone().view(torch.int32).to(torch.int64), start + 4 * count, fmt
