"""Compressors select correctly per segment on constructed inputs; registry errors are clear."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from horovod_safusion.compressors import (DGC, Compressor, TopK, available_compressors,
                                          make_compressor, register_compressor)
from horovod_safusion.segment import Segments


def segs(*sizes):
    return Segments(tuple(f"s{i}" for i in range(len(sizes))), sizes)


def test_topk_selects_exact_largest_per_segment():
    flat = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, 0.0, -0.01, 0.02, 7.0, 1.0])
    idx = TopK(density=0.25).select(flat, segs(4, 2, 4), step=0)
    # k = max(1, round(0.25 * n)) = 1, 1 (0.5 rounds to 0 -> 1), 1
    assert sorted(idx.tolist()) == [1, 4, 8] or sorted(idx.tolist()) == [1, 5, 8]
    assert TopK(density=1.0).select(flat, segs(10), 0) is None


@settings(deadline=None, max_examples=30)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=8), st.sampled_from([0.001, 0.01, 0.1]),
       st.integers(0, 2**16))
def test_topk_every_segment_keeps_its_k(sizes, density, seed):
    torch.manual_seed(seed)
    s = segs(*sizes)
    flat = torch.randn(s.numel) * torch.repeat_interleave(torch.rand(len(sizes)) * 100, torch.tensor(sizes))
    idx = TopK(density).select(flat, s, 0)
    assert torch.equal(s.counts(idx), s.k(density))
    assert idx.unique().numel() == idx.numel()
    for off, n, k in zip(s.offsets, s.sizes, s.k(density).tolist()):
        chosen = idx[(idx >= off) & (idx < off + n)]
        kth = torch.topk(flat[off:off + n].abs(), k).values.min()
        assert bool((flat[chosen].abs() >= kth).all())


def test_dgc_counts_near_target_and_no_nonzero_segment_empty():
    torch.manual_seed(0)
    s = segs(100_000, 50_000, 7, 3)
    flat = torch.cat([torch.randn(100_000), 1e-4 * torch.randn(50_000), torch.randn(7), torch.zeros(3)])
    dgc = DGC(density=0.01)
    counts = s.counts(dgc.select(flat, s, 0))
    k = s.k(0.01)
    assert 0.7 * k[0] <= counts[0] <= 1.3 * k[0]
    assert 0.7 * k[1] <= counts[1] <= 1.3 * k[1]  # the small-magnitude tensor keeps its share
    assert counts[2] >= 1 and counts[3] == 0     # all-zero segment: nothing to send


def test_dgc_reuses_thresholds_between_estimations_and_re_estimates_on_drift():
    s = segs(10_000)
    dgc = DGC(density=0.01, interval=5)
    dgc.select(torch.randn(10_000), s, step=0)
    thr = dgc._threshold["s0"]
    idx = dgc.select(torch.randn(10_000), s, step=1)  # same distribution: reused
    assert dgc._threshold["s0"] == thr and 50 <= idx.numel() <= 200
    idx = dgc.select(1e-3 * torch.randn(10_000), s, step=2)  # drifted far below: re-estimated at once
    assert dgc._threshold["s0"] < thr / 100 and 50 <= idx.numel() <= 200
    dgc.select(torch.randn(10_000), s, step=7)
    assert dgc._estimated_at["s0"] == 7  # and re-estimated on schedule


def test_dgc_clips_a_reused_threshold_to_the_segment_maximum():
    s = segs(10_000)
    dgc = DGC(density=0.01, interval=5, drift=math.inf)
    dgc.select(torch.randn(10_000), s, step=0)
    small = 1e-3 * torch.randn(10_000)  # every element below the reused threshold
    assert dgc.select(small, s, step=1).tolist() == [int(small.abs().argmax())]


def test_registry_and_density_errors():
    assert {"none", "topk", "dgc"} <= set(available_compressors())
    with pytest.raises(ValueError, match="unknown compressor 'zip'; known compressors: dgc, none, topk"):
        make_compressor("zip", None)
    for bad in (0, -0.1, 1.5, "0.1", True):
        with pytest.raises(ValueError, match="density must"):
            make_compressor("topk", bad)
    with pytest.raises(ValueError, match="compressor 'none' sends every element"):
        make_compressor("none", 0.01)
    assert make_compressor("dgc", None).density == 0.01
    inst = TopK(0.05)
    assert make_compressor(inst, None) is inst
    with pytest.raises(ValueError, match="contradicts"):
        make_compressor(inst, 0.1)


def test_register_compressor_by_decorator():
    @register_compressor("every-other-test")
    class EveryOther(Compressor):
        def select(self, flat, segments, step):
            return torch.arange(0, flat.numel(), 2)

    assert "every-other-test" in available_compressors()
    assert make_compressor("every-other-test", 0.5).select(torch.ones(5), segs(5), 0).tolist() == [0, 2, 4]
    with pytest.raises(TypeError):
        register_compressor("bad")(object)
