"""The schedules and data structures behind ``spardl``, ``exdyna`` and ``zen``, in one process.

The protocols themselves run under ``horovodrun`` in ``tests/multiproc/test_collectives.py``; here
their pieces are checked exhaustively or with hypothesis: SparDL's bag schedule (Theorem 3.1) and
Bruck all-gather for every worker count, ExDyna's partitions (Algorithms 2–3), ZEN's lossless
hierarchical hashing (Algorithm 1), hash bitmap (Algorithm 2) and choice by Eqs. (1)–(2), plus a
one-worker Horovod job through the optimizer.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

from horovod_safusion.communicators.accumulator import ascending, at_agreed
from horovod_safusion.kernels import reference
from horovod_safusion.communicators.exdyna import Partitions, allocation
from horovod_safusion.communicators.spardl import BSAGStep, SparDL, block_bounds, bruck_steps, srs_steps
from horovod_safusion.communicators.zen import Zen, choose_scheme
from horovod_safusion.communicators.zen_hash import (BITMAP, COO, AffinePartition, bitmap_decode, bitmap_encode,
                                                     hash_family, hierarchical_hash, pull_decode, pull_encode)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**31 - 1), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.booleans(),
       st.sampled_from(["none", "fp16"]))
def test_the_accumulator_at_agreed_indices_sends_or_keeps_every_element(numel, seed, picked, agreed_share, residual,
                                                                          wire):
    """ExDyna's and ScaleCom's all-reduce half: what this rank contributes at the agreed indices
    plus what it hands back into its residual is its whole accumulator, element for element, and
    at an agreed index it contributes its selected value plus its residual there. With Horovod's
    ``Compression.fp16`` the contribution is what float16 carries, and the rounding stays behind."""
    import horovod.torch as hvd
    from horovod_safusion.communicators.base import Reduction
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(numel, generator=g, dtype=torch.float64)
    chosen = torch.rand(numel, generator=g) < picked
    indices = torch.nonzero(chosen).view(-1)[torch.randperm(int(chosen.sum()), generator=g)]  # any order
    rest = torch.where(chosen, 0.0, acc) if residual else None  # None: a protocol without a residual view
    if rest is None:
        acc = torch.where(chosen, acc, 0.0)
    agreed = torch.nonzero(torch.rand(numel, generator=g) < agreed_share).view(-1)
    agreed = agreed[torch.randperm(agreed.numel(), generator=g)]  # ExDyna's union comes in rank order
    got = at_agreed(agreed, *ascending(indices, acc[indices]), rest)
    assert torch.equal(got.agreed, torch.sort(agreed).values)  # one order on every rank: the all-reduce's
    assert torch.equal(got.contrib, acc[got.agreed])
    assert torch.equal(reference.accumulator_at(got.agreed, *ascending(indices, acc[indices]), rest), got.contrib)
    compression = hvd.Compression.fp16 if wire == "fp16" else hvd.Compression.none
    got, on_wire, ctx = got.for_wire(compression, Reduction(hvd.Sum))
    assert torch.equal(compression.decompress(on_wire, ctx).to(torch.float64), got.contrib)
    assert wire == "none" or torch.equal(got.contrib.half().double(), got.contrib)
    after = (rest.clone() if rest is not None else torch.zeros(numel, dtype=torch.float64))
    if got.leftover() is not None:
        after.index_add_(0, *got.leftover())
    sent = torch.zeros(numel, dtype=torch.float64).index_add_(0, got.agreed, got.contrib)
    assert torch.equal(after + sent, acc)  # bit for bit: each value goes in and out whole
    assert torch.equal(after[got.agreed], acc[got.agreed] - got.contrib)  # zero, or the rounding error


@pytest.mark.parametrize("P", range(1, 34))
def test_spar_reduce_scatter_schedule_reduces_every_block_onto_its_owner(P):
    """Theorem 3.1: received blocks are always held; each worker ends with block w summed over all."""
    held = [{(w + j) % P: {w} for j in range(P)} for w in range(P)]  # block -> contributing workers
    steps = srs_steps(P)
    assert len(steps) == (int(np.ceil(np.log2(P))) if P > 1 else 0)
    for dist, first, stop in steps:
        sent = [{(w + j) % P: held[w].pop((w + j) % P) for j in range(first, stop)} for w in range(P)]
        for w in range(P):
            got = sent[(w - dist) % P]
            assert set(got) <= set(held[w]), (P, dist, w)  # Theorem 3.1
            for block, contributors in got.items():
                held[w][block] |= contributors
    for w in range(P):
        assert held[w] == {w: set(range(P))}


@pytest.mark.parametrize("P", range(1, 34))
def test_bruck_all_gather_collects_every_block_once(P):
    collected = [[w] for w in range(P)]
    for dist, blocks in bruck_steps(P):
        sent = [list(c[:blocks]) for c in collected]
        for w in range(P):
            collected[w] += sent[(w + dist) % P]
    for w in range(P):
        assert collected[w] == [(w + j) % P for j in range(P)]


@given(st.integers(0, 5000), st.integers(1, 17))
def test_block_bounds_cover_the_buffer(numel, P):
    b = block_bounds(numel, P)
    assert b[0] == 0 and b[-1] == numel and all(x <= y for x, y in zip(b, b[1:]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200_000), st.integers(1, 9), st.integers(1, 64),
       st.lists(st.floats(0, 1000), min_size=9, max_size=9), st.integers(0, 20))
# a total count whose share per worker underflows to zero (found by a CI run): nothing to balance
@example(numel=1, n=2, per_worker=1, counts=[0.0] * 8 + [5e-324], rounds=8)
def test_exdyna_partitions_stay_disjoint_and_cover_the_buffer(numel, n, per_worker, counts, rounds):
    parts = Partitions(numel, n, per_worker * n)
    for _ in range(rounds):
        parts.counts = counts[:n]
        parts.adjust(alpha=1.1, blk_move=1, min_blk=1)
        ranges = [parts.bounds(i) for i in range(n)]
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(p >= 1 or numel < n for p in parts.blk_part)
        counts = counts[1:] + counts[:1]
    assert sorted(allocation(3, r, n) for r in range(n)) == list(range(n))  # exclusive ownership


def test_exdyna_adjustment_moves_blocks_from_the_busy_partition():
    parts = Partitions(64 * 100, 2, 64)
    before = list(parts.blk_part)
    parts.counts = [300.0, 10.0]  # partition 0 selected far more than k'/n
    parts.adjust(alpha=1.1, blk_move=2, min_blk=1)
    assert parts.blk_part == [before[0] - 2, before[1] + 2]
    parts.counts = [100.0, 100.0]  # balanced: no move
    parts.adjust(alpha=1.1, blk_move=2, min_blk=1)
    assert parts.blk_part == [before[0] - 2, before[1] + 2]


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 8), st.integers(1, 40), st.integers(0, 4), st.integers(0, 10**6),
       st.floats(0.0, 1.0))
def test_hierarchical_hashing_is_lossless(numel, n, r1, k, seed, density):
    """Every index lands in exactly one partition, h0's, however small the memory (Algorithm 1)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(numel, generator=g)[:max(1, int(density * numel))]
    h0 = hash_family(seed, 1, n)[0]
    out = hierarchical_hash(idx, h0, hash_family(seed + 1, k, r1), r1, max(1, r1 // 10))
    allpos = torch.cat(out.positions)
    assert torch.equal(torch.sort(allpos).values, torch.arange(idx.numel()))
    for p, pos in enumerate(out.positions):
        assert bool((h0(idx[pos]) == p).all())
    assert sum(out.serial) <= idx.numel()


def test_tiny_hash_memory_forces_the_serial_area():
    idx = torch.randperm(10_000)[:2_000]
    h0 = hash_family(7, 1, 4)[0]
    roomy = hierarchical_hash(idx, h0, hash_family(8, 3, 1000), 1000, 100)
    tiny = hierarchical_hash(idx, h0, hash_family(8, 1, 1), 1, 1)
    assert sum(tiny.serial) == idx.numel() - 4 and tiny.overflow > 0  # one slot per partition
    assert sum(roomy.serial) < 0.1 * idx.numel()  # twice the load, 3 rehashes: few overflow
    for a, b in zip(roomy.positions, tiny.positions):
        assert set(a.tolist()) == set(b.tolist())


@given(st.lists(st.booleans(), max_size=200))
def test_bitmap_round_trip(bits):
    t = torch.tensor(bits, dtype=torch.bool)
    packed = bitmap_encode(t)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(bits) + 7) // 8
    assert torch.equal(bitmap_decode(packed, len(bits)), t)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 9), st.integers(0, 10**6))
def test_affine_partition_enumerates_the_index_sets(numel, n, seed):
    """h0 of Balanced Parallelism partitions the buffer's indices; each index's bit position in
    its owner's set decodes back to it (Algorithm 2's 𝕀_i[bits], without a stored 𝕀_i)."""
    h0 = AffinePartition(seed, numel, n)
    idx = torch.arange(numel)
    owner = h0(idx)
    assert bool(((owner >= 0) & (owner < n)).all())
    seen = []
    for i in range(n):
        mine = idx[owner == i]
        assert mine.numel() == h0.size(i)
        pos = h0.position(mine, i)
        assert torch.equal(torch.sort(pos).values, torch.arange(h0.size(i)))  # a bijection onto the bits
        assert torch.equal(h0.members(i, pos), mine)
        seen.append(mine)
    assert torch.equal(torch.sort(torch.cat(seen)).values, idx)


def test_affine_partition_balances_a_run_of_hot_indices():
    """The hot rows of an embedding are a run of consecutive indices: h0 spreads them over the
    partitions about evenly (Theorem 2's balance), as it does random ones."""
    numel, n = 1_000_003, 8
    for seed in range(5):
        h0 = AffinePartition(seed, numel, n)
        for idx in (torch.arange(50_000, 60_000), torch.randperm(numel)[:10_000]):
            counts = torch.bincount(h0(idx), minlength=n)
            assert int(counts.max()) * n / idx.numel() < 1.1, counts.tolist()


def test_choice_by_equations_one_and_two():
    # no overlap between 4 workers: γ^n = 4, BP 3/4·(4 + 1) = 3.75 > HC γ^1 + γ^2 = 1 + 2
    assert choose_scheme(4, np.array([100.0, 100.0, 200.0, 400.0])) == "hc"
    # full overlap: γ = 1 everywhere; BP 3/4·2 = 1.5 ≤ HC 2
    assert choose_scheme(4, np.array([100.0, 100.0, 100.0, 100.0])) == "bp"
    # the pull as it travels, no overlap (HC 1 + 2 = 3): a sparse aggregate pulls in COO, as Eq. (1)
    # prices it (BP 3/4·(4 + 1) = 3.75); a dense one pulls a bitmap of 3200/8 bytes = 50 entries
    # beside the values' 200 (BP 3/4·(2.5 + 1) = 2.625)
    stats = np.array([100.0, 100.0, 200.0, 400.0])
    assert choose_scheme(4, stats, numel=10**6) == "hc"
    assert choose_scheme(4, stats, numel=3200) == "bp"
    # 3 workers (not a power of two): HC also folds one selection in and sends the union out,
    # 1 + γ^n = 4 more than its one doubling stage (1); BP 2/3·(3 + 1) = 2.67
    assert choose_scheme(3, np.array([100.0, 100.0, 300.0])) == "bp"


def test_bsag_h_moves_towards_L_and_stays_in_its_range():
    """SparDL Algorithm 2: h grows while B-SAG delivers fewer than L, shrinks when more."""
    st = BSAGStep(k=1000, d=3, P=6)  # h in [k/P, dk/P] = [166.7, 500], L = 500
    hs = [st.h]
    for _ in range(8):
        st.update(n_t=300)  # too few after B-SAG: h goes up, faster and faster
        hs.append(st.h)
    assert all(b >= a for a, b in zip(hs, hs[1:])) and hs[-1] > hs[1] + 20
    top = st.h
    st.update(n_t=900)  # too many: the step turns and halves
    assert st.h < top
    for _ in range(50):
        st.update(n_t=10**6)
    assert st.h == pytest.approx(1000 / 6)  # clamped at k/P


def test_bad_options_name_the_value_and_the_accepted_ones(hvd):
    with pytest.raises(ValueError, match=r"teams=4 must divide the worker count 6; accepted: \[1, 2, 3, 6\]"):
        SparDL(teams=4)._check(6)
    with pytest.raises(ValueError, match=r"unknown ZEN scheme 'ring'; known schemes: auto, bp, hc"):
        Zen(scheme="ring")
    with pytest.raises(ValueError, match="hash_slots must be a positive integer"):
        Zen(hash_slots=0)
    from horovod_safusion.communicators import ExDynaCommunicator
    from horovod_safusion.compressors import make_compressor
    with pytest.raises(ValueError, match=r"needs compressor='exdyna', got TopK"):
        ExDynaCommunicator().setup(make_compressor("topk", 0.01))
    with pytest.raises(ValueError, match="alpha must be > 1, got 0.5"):
        ExDynaCommunicator(alpha=0.5)
    for cls in (SparDL, Zen):
        with pytest.raises(ValueError, match=r"rounds must be one of 'auto', 'horovod', 'gloo'; got 'mpi'"):
            cls(rounds="mpi")


def test_rounds_default_to_the_environment_then_auto(hvd, monkeypatch):
    monkeypatch.delenv("HOROVOD_SAFUSION_ROUNDS", raising=False)
    assert SparDL().rounds_asked == "auto"
    monkeypatch.setenv("HOROVOD_SAFUSION_ROUNDS", "horovod")
    assert Zen().rounds_asked == "horovod" and SparDL(rounds="gloo").rounds_asked == "gloo"
    monkeypatch.setenv("HOROVOD_SAFUSION_ROUNDS", "tcp")
    with pytest.raises(ValueError, match=r"HOROVOD_SAFUSION_ROUNDS must be one of 'auto', 'horovod', 'gloo'; got 'tcp'"):
        SparDL()


@pytest.mark.parametrize("rounds", ["auto", "horovod", "gloo"])
def test_one_worker_keeps_horovods_rounds_whatever_rounds_asks(hvd, rounds):
    """With one worker there is no peer to send to: every ``rounds=`` resolves to Horovod's
    alltoall and builds no Gloo group."""
    comm = SparDL(rounds=rounds)
    comm.setup(None)
    assert comm.rounds.name == "horovod" and comm.round_seconds == {}


@pytest.mark.parametrize("communicator", ["spardl", "exdyna", "zen", "scalecom"])
def test_one_worker_job_applies_exactly_what_was_selected(hvd, communicator):
    """With one worker every communicator returns this worker's selection, and selection plus
    residual is the accumulated gradient (nothing lost)."""
    import horovod_safusion as saf
    from digits import DigitsCNN, load_digits_split
    x, y, _, _ = load_digits_split()
    torch.manual_seed(0)
    m = DigitsCNN(width=4)
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   compressor="exdyna" if communicator == "exdyna" else "topk", density=0.1,
                                   communicator=communicator, critical_regimes=None)
    named = list(m.named_parameters())
    for step in range(3):
        before = [opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in named]
        opt.zero_grad()
        F.cross_entropy(m(x[:32]), y[:32]).backward()
        acc = [p.grad.detach().view(-1) + r for (_, p), r in zip(named, before)]
        opt.synchronize()
        for (n, p), a in zip(named, acc):
            r = opt.residuals.get(n, p.detach().view(-1))
            assert torch.allclose(p.grad.view(-1) + r, a, atol=1e-6), n
        with opt.skip_synchronize():
            opt.step()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.floats(0.0, 1.0)), min_size=1, max_size=5), st.integers(0, 2**31 - 1))
def test_the_pull_sends_the_smaller_of_bitmap_and_coo_and_decodes_every_owner_back(owners, seed):
    """ZEN's pull (Algorithm 2): per owner the bitmap where ceil(|I_i|/8) <= 4 (count + positions)
    bytes, else COO; owners laid end to end decode back to their sorted positions, whatever the
    format of each."""
    gen = torch.Generator().manual_seed(seed)
    parts, expected = [], []
    for owned, density in owners:
        positions = torch.nonzero(torch.rand(owned, generator=gen) < density).squeeze(1)
        part = pull_encode(positions, owned)
        bitmap_bytes, coo_bytes = (owned + 7) // 8, 4 * (positions.numel() + 1)
        assert int(part[0]) == (BITMAP if bitmap_bytes <= coo_bytes else COO)
        assert part.numel() == 1 + min(bitmap_bytes, coo_bytes)
        parts.append(part)
        expected.append((positions, int(part[0])))
    raw, offset = torch.cat(parts), 0
    for (owned, _), (positions, fmt) in zip(owners, expected):
        got, offset, got_fmt = pull_decode(raw, offset, owned)
        assert torch.equal(got, positions) and got_fmt == fmt
    assert offset == raw.numel()
