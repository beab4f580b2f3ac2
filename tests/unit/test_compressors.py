"""Compressors select correctly per segment on constructed inputs; registry errors are clear."""
import math

import numpy as np

import pytest
import torch
from hypothesis import given, settings, strategies as st

from horovod_safusion.compressors import (COMPRESSORS, DGC, Compressor, ExDyna, GaussianK, RandomK, RedSync, SIDCo, TopK,
                                          available_compressors, make_compressor, register_compressor)
from horovod_safusion.compressors.sidco import quantile
from horovod_safusion.compressors.threshold import SegmentView
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
    for seg in (0, 1):  # within the drift band; the small-magnitude tensor keeps its share
        assert k[seg] / dgc.drift <= counts[seg] <= dgc.drift * (k[seg] + 1)
    assert counts[2] >= 1 and counts[3] == 0     # all-zero segment: nothing to send


def test_dgc_reuses_thresholds_between_estimations_and_corrects_drift():
    torch.manual_seed(0)
    s = segs(10_000)
    dgc = DGC(density=0.01, interval=5)
    dgc.select(torch.randn(10_000), s, step=0)
    thr = dgc._threshold["s0"]
    for step, scale in ((1, 1.0), (2, 1e-3)):  # same shape, any scale: the relative threshold is reused
        idx = dgc.select(scale * torch.randn(10_000), s, step=step)
        assert dgc._threshold["s0"] == thr and dgc._estimated_at["s0"] == 0 and 50 <= idx.numel() <= 200
    heavy = torch.randn(10_000)
    heavy[:500] *= 100  # 5 % outliers: far too many selected -> hierarchical selection, exactly k
    assert dgc.select(heavy, s, step=3).numel() == 100 and dgc._estimated_at["s0"] == 0
    spiky = torch.randn(10_000)
    spiky[:20] = 1000.0  # 20 spikes lift the mean: far too few selected -> estimated anew
    idx = dgc.select(spiky, s, step=4)
    assert dgc._estimated_at["s0"] == 4 and 50 <= idx.numel() <= 202
    dgc.select(torch.randn(10_000), s, step=9)
    assert dgc._estimated_at["s0"] == 9  # and re-estimated on schedule


def test_dgc_clips_a_reused_threshold_to_the_segment_maximum():
    s = segs(10_000)
    dgc = DGC(density=0.01, interval=5, drift=math.inf)
    dgc.select(torch.randn(10_000), s, step=0)
    flat = torch.ones(10_000)  # every element below the reused threshold (≈ 3 mean |x|)
    flat[1234] = 1.5
    assert dgc.select(flat, s, step=1).tolist() == [1234]


def test_registry_and_density_errors():
    assert set(available_compressors()) >= {"none", "topk", "dgc", "gaussiank", "redsync", "sidco", "exdyna", "randomk"}
    with pytest.raises(ValueError, match="unknown compressor 'zip'; known compressors: dgc, exdyna, gaussiank, none, "
                                         "randomk, redsync, sidco, topk \\(or pass a Compressor instance\\)"):
        make_compressor("zip", None)
    for bad in (0, -0.1, 1.5, "0.1", True):
        with pytest.raises(ValueError, match="density must"):
            make_compressor("topk", bad)
    with pytest.raises(ValueError, match="compressor 'none' sends every element"):
        make_compressor("none", 0.01)
    assert make_compressor("dgc", None).density == 0.03  # the default: density.DEFAULT
    inst = TopK(0.05)
    assert make_compressor(inst, None) is inst
    with pytest.raises(ValueError, match="contradicts"):
        make_compressor(inst, 0.1)


def test_register_compressor_by_decorator():
    @register_compressor("every-other-test")
    class EveryOther(Compressor):
        def select_at(self, flat, segments, step, density):
            return torch.arange(0, flat.numel(), 2)

    assert "every-other-test" in available_compressors()
    assert make_compressor("every-other-test", 0.5).select(torch.ones(5), segs(5), 0).tolist() == [0, 2, 4]
    with pytest.raises(TypeError):
        register_compressor("bad")(object)


# ---- the compressors of the registry on constructed inputs ------------------------------------------
def gaussian_segments(seed=0):
    """Three tensors of very different scales, and an all-zero one."""
    g = torch.Generator().manual_seed(seed)
    s = segs(200_000, 30_000, 64, 16)
    flat = torch.cat([torch.randn(200_000, generator=g), 1e-3 * torch.randn(30_000, generator=g),
                      torch.randn(64, generator=g), torch.zeros(16)])
    return s, flat


# dgc: its drift band; from a 1 % sample (20 of 2,000 above the estimate) a count scatters by ±21 %
# (200 seeds on segment 0: mean 0.96 k, 11 % of them below 0.7 k)
@pytest.mark.parametrize("name,low,high", [("gaussiank", 2 / 3, 4 / 3), ("redsync", 1.0, 2.0), ("dgc", 0.5, 2.0),
                                           ("sidco", 0.4, 1.5), ("topk", 1.0, 1.0), ("randomk", 0.99, 1.0)])
def test_each_compressor_selects_about_k_per_segment(name, low, high):
    s, flat = gaussian_segments()
    idx = make_compressor(name, 0.01).select(flat.clone(), s, step=0)
    counts, k = s.counts(idx), s.k(0.01)
    assert idx.unique().numel() == idx.numel()
    for seg in (0, 1):  # large segments: the count is the compressor's accuracy
        assert low * k[seg] <= counts[seg] <= high * k[seg], (name, counts.tolist(), k.tolist())
    assert counts[2] >= 1  # a small nonzero tensor is never missing
    if name != "randomk":  # magnitude-based: the largest of every tensor travels
        assert counts[3] == (1 if name == "topk" else 0)  # exact top-k sends k even of zeros
        for seg in (0, 1, 2):
            off, n = s.offsets[seg], s.sizes[seg]
            assert int(flat[off:off + n].abs().argmax()) + off in set(idx.tolist())


def test_gaussiank_threshold_is_the_normal_percent_point():
    g = torch.Generator().manual_seed(1)
    flat = 3.0 * torch.randn(400_000, generator=g)
    c = GaussianK(0.05, refine_passes=0)
    view = SegmentView(flat, segs(400_000), 0.05)
    c.decide(view, 0)
    assert float(view.applied()[0]) == pytest.approx(3.0 * 1.959964, rel=0.01)  # Φ⁻¹(0.975) σ
    view = SegmentView(flat, segs(400_000), 0.01)  # the step's density, as a density warm-up sets it
    c.decide(view, 1)
    assert float(view.applied()[0]) == pytest.approx(3.0 * 2.575829, rel=0.01)  # Φ⁻¹(0.995) σ


def test_exdyna_scales_thresholds_by_algorithm_5():
    c = ExDyna(density=0.01, beta=1.1, gamma=0.1, relative=False)
    s, flat = gaussian_segments()
    c.select(flat.clone(), s, 0)  # δ_0: exact k-th largest, so k' = k: exam = 1 in (1/β, β] → ×(1 + γ/4)
    first = dict(c._threshold)
    k0 = float(torch.topk(flat[:200_000].abs(), 2000).values.min())
    assert first["s0"] == pytest.approx(k0 * 1.025, rel=1e-6)
    assert first["s3"] == 0.0  # the all-zero tensor: its k-th largest, never scaled
    c._threshold.update(s0=0.0, s1=0.0)  # s0, s1 select (almost) everything: exam > β → ×(1 + γ)
    c.select(flat.clone(), s, 1)
    # each threshold by its own count: s2 selected its k again → ×(1 + γ/4), not its neighbours' ×(1 + γ)
    assert c._threshold["s2"] == pytest.approx(first["s2"] * 1.025, rel=1e-6)
    assert c._threshold["s0"] == 0.0  # 0 × (1 + γ)
    c._threshold.update(s0=1e9, s1=1e9, s2=1e9)  # only each maximum: exam < 1/β → ×(1 − γ)
    c.select(flat.clone(), s, 2)
    assert c._threshold["s0"] == pytest.approx(1e9 * 0.9)


def test_exdyna_relative_threshold_follows_the_gradient_scale():
    s = segs(50_000)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(50_000, generator=g)
    counts = {}
    for relative in (True, False):
        c = ExDyna(density=0.01, relative=relative)
        n0 = s.counts(c.select(base, s, 0))[0].item()
        n1 = s.counts(c.select(100 * base, s, 1))[0].item()  # the next batch's gradient is 100x larger
        counts[relative] = (n0, n1)
    assert counts[True][0] == 500 and 0.85 * 500 <= counts[True][1] <= 500  # only Alg. 5's small nudge
    assert counts[False][1] > 40 * 500  # an absolute threshold lets almost everything through


def test_exdyna_density_settles_at_the_target():
    g = torch.Generator().manual_seed(2)
    s = segs(50_000)
    c = ExDyna(density=0.01)
    densities = []
    for step in range(200):  # a drifting, noisy scale
        flat = (1 + step / 100) * (0.5 + torch.rand(1, generator=g)) * torch.randn(50_000, generator=g)
        densities.append(s.counts(c.select(flat, s, step))[0].item() / 50_000)
    tail = densities[50:]
    assert 0.009 <= sum(tail) / len(tail) <= 0.011


def test_redsync_bisection_lands_in_k_to_2k_and_reuses_the_ratio():
    s, flat = gaussian_segments()
    c = RedSync(0.01)
    c.select(flat.clone(), s, 0)
    r = dict(c._ratio)
    assert 0 < r["s0"] < 1
    c.select(flat.clone(), s, 1)
    assert c._ratio["s0"] == r["s0"]  # the same data needs no new bisection


def test_sidco_tail_quantiles_and_stages():
    g = torch.Generator().manual_seed(3)
    e = torch.empty(1_000_000).exponential_(2.0, generator=g)  # mean 0.5
    m, v = np.array([float(e.double().mean())]), np.array([float(e.double().var(unbiased=False))])
    expected, p = -0.5 * math.log(0.01), np.array([0.01])
    assert quantile(m, v, p, "exponential")[0] == pytest.approx(expected, rel=0.01)
    assert quantile(m, v, p, "gpareto")[0] == pytest.approx(expected, rel=0.05)  # ξ ≈ 0
    assert quantile(m, v, p, "gamma")[0] == pytest.approx(expected, rel=0.05)  # shape ≈ 1
    s = segs(1_000_000)
    for dist in ("exponential", "gpareto", "gamma-gpareto"):
        n = s.counts(SIDCo(0.001, distribution=dist, stages=2).select(e, s, 0))[0].item()
        assert 500 <= n <= 2000, (dist, n)  # an exponential is what these fits model well
    with pytest.raises(ValueError, match="distribution must be one of"):
        SIDCo(0.01, distribution="cauchy")


def test_randomk_is_shared_per_step_and_changes_between_steps():
    s, flat = gaussian_segments()
    a = RandomK(0.01, seed=7).select(flat, s, 3)
    b = RandomK(0.01, seed=7).select(torch.zeros_like(flat), s, 3)  # values play no role
    assert torch.equal(a, b)
    assert not torch.equal(a, RandomK(0.01, seed=7).select(flat, s, 4))


def test_topk_batched_path_equals_per_segment_topk():
    torch.manual_seed(4)
    s = segs(500, 500, 500, 37, 500)
    flat = torch.randn(s.numel)
    idx = set(TopK(0.02).select(flat, s, 0).tolist())
    expect = set()
    for off, n, k in zip(s.offsets, s.sizes, s.k(0.02).tolist()):
        expect |= {i + off for i in torch.topk(flat[off:off + n].abs(), k).indices.tolist()}
    assert idx == expect


def _carried(name: str, steps: int = 12, dtype: torch.dtype = torch.float32,
             density: float = 0.01, **options) -> tuple[list[torch.Tensor], dict]:
    """A compressor's selections step after step, with residuals carried as the controller
    carries them (so reused thresholds and corrections are exercised), and its per-segment state
    in the end. The segments differ in scale and shape: one is all zero; one is uniform (a light
    tail, where fitted tails select far too few); one has fewer nonzeros than k (an embedding's
    gradient: sampled thresholds are zero and select too few, effort after effort); one is
    Cauchy and one mostly tiny with rare spikes (where a new estimate with more effort selects
    too many); one changes its shape from step to step (Gaussian, then heavy-tailed), so that
    reused thresholds select too many and too few. ``options`` go to the compressor's class."""
    c = make_compressor(COMPRESSORS.get(name)(density=density, **options), None)  # tests/gpu wraps make_compressor
    s = segs(50_000, 3_000, 700, 64, 5, 20_000, 8_000, 30_000, 20_000, 20_000)
    heavy, uniform, sparse, cauchy, spiky = s.offsets[5:]
    residual, out = torch.zeros(s.numel, dtype=dtype), []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        scale = torch.repeat_interleave(torch.tensor([1.0, 0.01, 3.0, 0.5, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0], dtype=dtype),
                                        torch.tensor(s.sizes))
        scale[heavy:uniform] *= torch.exp(torch.randn(20_000, generator=g, dtype=dtype) * (step % 3))
        scale[cauchy:spiky] /= torch.randn(20_000, generator=g, dtype=dtype).abs()  # a ratio of normals
        scale[spiky:] *= torch.where(torch.rand(20_000, generator=g) < 0.004, 5.0, 0.001).to(dtype)
        flat = torch.randn(s.numel, generator=g, dtype=dtype) * scale + residual
        flat[uniform:sparse] += torch.rand(8_000, generator=g, dtype=dtype)
        flat[sparse + torch.randperm(30_000, generator=g)[:100]] += 1.0
        idx = c.select(flat, s, step)
        residual = flat.index_fill(0, idx, 0)
        out.append(idx)
    state = {f: [v for n, v in sorted(getattr(c, f).items())] for f in c.state_fields}
    return out, state


THRESHOLD_COMPRESSORS = ["dgc", "exdyna", "gaussiank", "redsync", "sidco"]


def test_the_list_names_every_threshold_compressor():
    from horovod_safusion.compressors import COMPRESSORS
    from horovod_safusion.compressors.threshold import ThresholdCompressor
    assert sorted(n for n in available_compressors()
                  if issubclass(COMPRESSORS.get(n), ThresholdCompressor)) == THRESHOLD_COMPRESSORS


@pytest.mark.parametrize("dtype,density", [(torch.float32, 0.01), (torch.float64, 0.01), (torch.float32, 0.001)])
@pytest.mark.parametrize("name", THRESHOLD_COMPRESSORS)
def test_device_path_selects_as_the_host_path(name, dtype, density, paths):
    """CPU buffers select in compiled loops; GPU buffers take the device path
    (``HOROVOD_SAFUSION_DEVICE_PATH=1`` sends CPU buffers there too), which takes every branch for
    every segment and keeps the host's. Both select the same elements, step after step — through
    reused thresholds, DGC's and SIDCo's trims, lowerings and new estimates with more effort,
    and DGC's periodic estimate at step 10 — and end with the same state."""
    host, host_state = _carried(name, dtype=dtype, density=density)
    paths(device_path=True)
    device, device_state = _carried(name, dtype=dtype, density=density)
    for step, (a, b) in enumerate(zip(host, device)):
        assert a.dtype == b.dtype == torch.int64
        assert torch.equal(a, b), (step, a.numel(), b.numel())
    for field, values in host_state.items():
        np.testing.assert_allclose(device_state[field], values, rtol=1e-9, err_msg=field)


@pytest.mark.parametrize("name,options", [("sidco", dict(stages=3)), ("sidco", dict(distribution="gamma-gpareto")),
                                          ("exdyna", dict(relative=False)), ("dgc", dict(interval=1))])
def test_device_path_selects_as_the_host_path_under_other_options(name, options, paths):
    """As above, with settings that take other branches of the one algorithm: three SIDCo stages
    (an estimate fits the same segment at several efforts in one call), the gamma fit, ExDyna's
    absolute thresholds, DGC estimating at every step."""
    host, host_state = _carried(name, **options)
    paths(device_path=True)
    device, device_state = _carried(name, **options)
    for step, (a, b) in enumerate(zip(host, device)):
        assert torch.equal(a, b), (step, a.numel(), b.numel())
    for field, values in host_state.items():
        np.testing.assert_allclose(device_state[field], values, rtol=1e-9, err_msg=field)


def test_device_view_fits_repeated_segments_as_the_host_view(paths):
    """The views' exceedance fits per entry, with a segment asked for several times (the device
    view passes over the buffer once per layer of distinct segments)."""
    from horovod_safusion.compressors.device import DeviceView

    s, flat = gaussian_segments()
    which, eta = np.array([0, 1, 0, 2, 0, 1, 3]), np.array([0.5, 1e-3, 1.0, 0.1, 2.0, 0.0, 0.0])
    count, mean, var = SegmentView(flat, s, 0.01).exceedance_moments(which, eta)
    paths(device_path=True)
    got = DeviceView(flat, s, 0.01).exceedance_moments(which, torch.from_numpy(eta))
    assert got[0].tolist() == count.tolist()
    np.testing.assert_allclose(got[1].numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(got[2].numpy(), var, rtol=1e-5, atol=1e-18)


def test_segment_view_reselecting_some_segments_equals_selecting_afresh():
    s, flat = gaussian_segments()
    first = np.array([1.0, 1e-3, 1.0, 1.0])
    # segment 1 up while it selects about a third of itself (compared anew), 2 down (compared anew)
    raised = np.array([1.0, 2e-3, 0.5, 1.0])
    # segment 1 up again while it selects about 5 % (its re-selection filtered)
    second = np.array([1.0, 3e-3, 0.5, 1.0])
    view = SegmentView(flat, s, 0.01)
    view.apply(first)
    view.apply(raised, np.array([1, 2]))
    view.apply(second, np.array([1]))
    fresh = SegmentView(flat, s, 0.01)
    fresh.apply(second)
    assert torch.equal(view.indices(), fresh.indices())
    assert np.array_equal(view.counts(), fresh.counts())
    sizes = torch.tensor(s.sizes)
    live = torch.repeat_interleave(torch.from_numpy(fresh.live), sizes)  # the all-zero segment sends nothing
    clipped = torch.from_numpy(np.minimum(second, fresh.max)).float()
    expected = (flat.abs() >= torch.repeat_interleave(clipped, sizes)) & live
    assert torch.equal(view.indices(), torch.nonzero(expected).squeeze(1))
    assert view.counts().tolist() == s.counts(view.indices()).tolist()


def test_segment_view_kth_largest_and_exceedance_moments():
    s, flat = gaussian_segments()
    view = SegmentView(flat, s, 0.01)
    a = flat.abs().double()
    which = np.array([0, 1, 2])
    kth = view.kth_largest(which, np.array([7, 300, 64]))
    for j, (o, n, k) in enumerate(((0, 200_000, 7), (200_000, 30_000, 300), (230_000, 64, 64))):
        assert kth[j] == float(torch.topk(a[o:o + n], k).values.min())
    view.apply(np.array([2.0, 1e-3, 0.0, 1.0]))
    chosen = view.kth(np.array([True, True, False, False]), selected=True)  # k = 1 % of the segment
    assert chosen[0] == kth_ref(a[:200_000], 2000) and chosen[1] == kth_ref(a[200_000:230_000], 300)
    assert np.isnan(chosen[2:]).all()
    eta = np.array([1.0, 0.0])
    count, mean, var = view.exceedance_moments(np.array([0, 3]), eta)
    tail = a[:200_000][a[:200_000] > 1.0] - 1.0
    assert count.tolist() == [tail.numel(), 0]
    assert mean[0] == pytest.approx(float(tail.mean()), rel=1e-9)
    assert var[0] == pytest.approx(float(tail.var(unbiased=False)), rel=1e-6)


def kth_ref(x, k):
    return float(torch.topk(x, k).values.min())


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(1, 2000), min_size=1, max_size=6), st.sampled_from([0.001, 0.01, 0.3, 1.0 - 1e-9]),
       st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**16))
def test_topk_is_exact_with_ties_and_zeros(sizes, density, dtype, seed):
    """Gradients hold many exact zeros and repeated values: radix selection still returns exactly
    k per segment, and nothing it leaves out is larger than anything it takes."""
    g = torch.Generator().manual_seed(seed)
    s = segs(*sizes)
    levels = torch.tensor([0.0, 0.0, 0.0, 1e-30, 0.5, 0.5, 2.0, 3.0], dtype=dtype)
    flat = levels[torch.randint(len(levels), (s.numel,), generator=g)] * torch.where(
        torch.rand(s.numel, generator=g) < 0.5, -1.0, 1.0).to(dtype)
    idx = TopK(density).select(flat, s, 0)
    assert idx.unique().numel() == idx.numel()
    assert torch.equal(s.counts(idx), s.k(density))
    taken = torch.zeros(s.numel, dtype=torch.bool)
    taken[idx] = True
    for off, n in zip(s.offsets, s.sizes):
        a, t = flat[off:off + n].abs(), taken[off:off + n]
        if t.any() and (~t).any():
            assert a[t].min() >= a[~t].max()


def test_topk_compiled_and_torch_select_the_same(paths):
    s, flat = gaussian_segments()
    flat[-16:] = torch.arange(1.0, 17.0)  # no ties (an all-zero segment would tie: either zero may go)
    compiled = set(TopK(0.01).select(flat, s, 0).tolist())
    paths(device_path=True)
    assert set(TopK(0.01).select(flat, s, 0).tolist()) == compiled


def test_selection_pass_trims_too_many_and_lowers_too_few():
    """The band of ``PeriodicThreshold``: a count above ``high`` is trimmed to the k largest, one
    below ``low`` (where lowering is allowed) is compared again lower and ends in the band."""
    from horovod_safusion.compressors import segmented

    g = torch.Generator().manual_seed(8)
    s = segs(20_000, 20_000, 20_000)
    flat = torch.randn(60_000, generator=g)
    view = SegmentView(flat, s, 0.01)
    k = view.k  # 200 each
    band = segmented.Band(k=k, low=k / 2 - 1, high=2 * (k + 1), lower=np.array([True, True, False]),
                          scale=view.mean)
    thr = np.array([1.0, 3.5, 3.5])  # ~32 % selected; ~0.05 % (far too few) twice
    view.apply(thr, correction=band)
    counts, applied = view.counts(), view.applied()
    a = flat.abs()
    assert counts[0] == 200 and applied[0] == kth_ref(a[:20_000], 200)  # trimmed: exactly k
    assert band.low[1] <= counts[1] <= 200 and applied[1] < 3.5  # lowered into the band
    assert counts[2] == int((a[40_000:] >= 3.5).sum()) and applied[2] == np.float32(3.5)  # not allowed
    assert np.flatnonzero(view.corrected).tolist() == [0, 1]
    expected = torch.nonzero(a >= torch.repeat_interleave(torch.from_numpy(applied), torch.tensor(s.sizes))).squeeze(1)
    assert torch.equal(view.indices(), expected)


def test_dgc_lowers_a_drifted_threshold_in_the_selection_pass():
    s = segs(10_000)
    g = torch.Generator().manual_seed(9)
    dgc = DGC(density=0.01, interval=5)
    dgc.select(torch.randn(10_000, generator=g), s, step=0)  # about 2.6 σ: 3.2 mean |x|
    flat = 2 * torch.rand(10_000, generator=g) - 1  # uniform: 3.2 mean |x| lies above every element
    idx = dgc.select(flat, s, step=1)
    assert idx.numel() == 100 and dgc._estimated_at["s0"] == 0  # lowered and trimmed, not estimated anew
    assert float(flat[idx].abs().min()) == kth_ref(flat.abs(), 100)
    assert dgc._threshold["s0"] * float(flat.abs().mean()) == pytest.approx(kth_ref(flat.abs(), 100), rel=1e-6)


def test_per_segment_state_survives_a_change_of_plan():
    from horovod_safusion.compressors.state import PerSegment

    state = PerSegment()
    first = state.of(("a", "b", "c"))
    first[:] = [1.0, 2.0, 3.0]
    assert dict(state) == {"a": 1.0, "b": 2.0, "c": 3.0}
    split = state.of(("b", "a"))  # a new plan: a and b move to another buffer, c stays
    assert split.tolist() == [2.0, 1.0] and state["c"] == 3.0
    split[0] = 5.0
    assert state["b"] == 5.0 and np.isnan(state.of(("c", "d"))[1])  # a new name starts empty
    assert "d" not in state and len(state) == 3
    state["d"] = 4.0
    assert state.of(("c", "d")).tolist() == [3.0, 4.0]
    with pytest.raises(KeyError):
        state["zz"]


def test_selection_pass_steps_thresholds_into_the_band():
    """GaussianK's correction: the threshold times ``up`` while too many, times ``down`` while too
    few, at most ``passes`` times, never above the segment's maximum."""
    from horovod_safusion.compressors import segmented

    g = torch.Generator().manual_seed(10)
    s = segs(20_000, 20_000, 50)
    flat = torch.cat([torch.randn(40_000, generator=g), torch.full((50,), 0.25)])
    view = SegmentView(flat, s, 0.01)
    steps = segmented.Steps(low=2 * view.k / 3, high=4 * view.k / 3, up=1.3, down=0.7, passes=3)
    view.apply(np.array([2.0, 3.714, 1.0]), correction=steps)  # ~4.6 %, ~0.02 %, above the maximum
    counts, applied = view.counts(), view.applied()
    a = flat.abs()
    stepped = lambda t, f: np.float32(float(np.float32(t)) * f)  # noqa: E731  (from the rounded start)
    assert applied[0] == stepped(2.0, 1.3) and 133 <= counts[0] <= 267  # one step up: in the band
    assert applied[1] == stepped(3.714, 0.7) and 133 <= counts[1] <= 267  # one step down
    assert counts[2] == 50 and applied[2] == np.float32(0.25)  # clipped to the maximum: all ties kept
    expected = torch.nonzero(a >= torch.repeat_interleave(torch.from_numpy(applied), torch.tensor(s.sizes))).squeeze(1)
    assert torch.equal(view.indices(), expected)
    assert view.counts().tolist() == s.counts(view.indices()).tolist()


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("name", ["dgc", "gaussiank", "redsync", "sidco", "exdyna"])
def test_threshold_compressors_never_send_exact_zeros(name, device_path, paths):
    """An embedding-like segment whose gradient is zero outside a few rows, with fewer nonzeros than
    k: step after step (residuals carried, so thresholds are reused and lowered), no selected
    element is zero, so the segment sends its nonzeros, never itself whole."""
    paths(device_path=device_path)
    c = make_compressor(name, 0.05)
    s = segs(100 * 64, 4_000)
    residual = torch.zeros(s.numel)
    for step in range(12):
        g = torch.Generator().manual_seed(step)
        grad = torch.zeros(s.numel)
        rows = torch.randperm(100, generator=g)[:3]  # 3 rows of 64: 192 nonzeros < k = 320
        for r in rows.tolist():
            grad[r * 64:(r + 1) * 64] = torch.randn(64, generator=g)
        grad[6400:] = torch.randn(4_000, generator=g)
        flat = grad + residual
        idx = c.select(flat, s, step)
        assert bool((flat[idx] != 0).all()), (name, step)
        assert int((idx < 6400).sum()) <= int((flat[:6400] != 0).sum())
        residual = flat.index_fill(0, idx, 0)


def test_exdyna_scales_each_tensor_by_its_own_count():
    """A threshold far too high beside one far too low: the totals are on target, yet each
    segment is corrected towards its own k (scaled by the totals, both would stay where they are)."""
    s, flat = segs(20_000, 20_000), torch.randn(40_000, generator=torch.Generator().manual_seed(3))
    c = ExDyna(density=0.01, gamma=0.05, relative=False)
    c.select(flat.clone(), s, 0)
    c._threshold.update(s0=c._threshold["s0"] * 1.3, s1=c._threshold["s1"] * 0.85)
    first = s.counts(c.select(flat.clone(), s, 1))
    assert first[0] < 100 < first[1]
    for step in range(2, 40):
        last = s.counts(c.select(flat.clone(), s, step))
    assert all(0.7 * 200 <= n <= 1.5 * 200 for n in last), last


@pytest.mark.parametrize("family", ["exponential", "gpareto", "gamma"])
def test_sidco_quantiles_equal_scipys(family):
    """SIDCo's one fit for both paths (``quantile``, over NumPy arrays or tensors; the gamma's
    inverse by Newton steps, which PyTorch lacks) gives SciPy's quantiles of the moment-fitted
    distributions on either, and the degenerate moments their documented values."""
    from scipy import stats

    g = np.random.default_rng(3)
    m = g.uniform(0.01, 2.0, 40)
    v = m ** 2 * g.uniform(0.2, 3.0, 40)  # gamma shapes 0.33–5
    p = g.uniform(0.001, 0.3, 40)
    if family == "exponential":
        expected = stats.expon.isf(p, scale=m)
    elif family == "gamma":
        expected = stats.gamma.isf(p, m * m / v, scale=v / m)
    else:
        expected = stats.genpareto.isf(p, 0.5 * (1 - m * m / v), scale=0.5 * m * (1 + m * m / v))
    host = quantile(m, v, p, family)
    np.testing.assert_allclose(host, expected, rtol=1e-6)
    device = quantile(*(torch.from_numpy(a) for a in (m, v, p)), family).numpy()
    np.testing.assert_allclose(device, host, rtol=1e-12)
    for args in ((np.array([0.0, 1.0]), np.array([1.0, 0.0]), np.array([0.1, 0.1])),
                 (torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.1, 0.1]))):
        degenerate = quantile(*args, family)
        assert degenerate.tolist() == [0.0, pytest.approx(-math.log(0.1))]  # no magnitude: 0; no spread: exponential


def test_dgc_samples_a_segment_alike_whatever_is_sampled_with_it():
    """DGC's draws are a hash of (seed, step, segment, effort, draw): a segment's sample is the
    same alone or beside others (the host samples the segments it estimates, the device all of
    them) and on either path, stays inside its segment, and covers it evenly; another step or
    effort draws anew."""
    from horovod_safusion.compressors.dgc import sample_positions

    keys, efforts = np.array([11, 22, 33]), np.array([0, 2, 1])
    offsets, sizes, counts = np.array([0, 1000, 1007]), np.array([1000, 7, 90_000]), np.array([50, 3, 20_000])
    together = sample_positions(0, 5, keys, efforts, offsets, sizes, counts)
    alone = sample_positions(0, 5, keys[2:], efforts[2:], offsets[2:], sizes[2:], counts[2:])
    np.testing.assert_array_equal(together[53:], alone)
    on_device = sample_positions(0, 5, keys, efforts, offsets, sizes, counts, torch.device("cpu"))
    np.testing.assert_array_equal(on_device.numpy(), together)
    for run, o, n in zip(np.split(together, np.cumsum(counts)[:-1]), offsets.tolist(), sizes.tolist()):
        assert ((run >= o) & (run < o + n)).all()
    tenths = np.bincount((alone - 1007) * 10 // 90_000, minlength=10)
    assert tenths.min() > 0.9 * 2000 and tenths.max() < 1.1 * 2000, tenths.tolist()
    assert not np.array_equal(alone, sample_positions(0, 6, keys[2:], efforts[2:], offsets[2:], sizes[2:], counts[2:]))
    assert not np.array_equal(alone, sample_positions(0, 5, keys[2:], efforts[2:] + 1, offsets[2:], sizes[2:], counts[2:]))


def test_the_index_scratch_gives_back_what_a_window_of_selections_did_not_need():
    """A selection far past k (as the first ones after a plan switch are) grows the scratch; a
    window of selections near k gives that back. A selection that needs the doubling's spare
    half keeps it, window after window, rather than shrinking and regrowing it."""
    from horovod_safusion.compressors.segmented import COMPARE_BLOCK, IndexScratch, NumbaKernels
    x = np.linspace(-1, 1, 100_000).astype(np.float32)
    kernels, scratch = NumbaKernels(np.array([0]), np.array([x.size])), IndexScratch()
    expected = 2 * 1000 + 1  # 2 Σ k + segments, as a view reserves for k = 1000

    def select(threshold: float, slot: int) -> np.ndarray:
        scratch.reserve(expected, x.size)
        idx, counts = kernels.select(x, np.array([threshold]), scratch, slot)
        np.testing.assert_array_equal(idx, np.flatnonzero(np.abs(x) >= threshold))
        assert counts.tolist() == [idx.size]
        return idx

    big = select(0.5, 1)  # half the buffer
    width = np.dtype(scratch.dtype).itemsize
    assert width == 4  # int32 indices for a buffer of fewer than 2**31 elements
    assert scratch.nbytes >= width * big.size
    for _ in range(2 * IndexScratch.WINDOW):  # the big one's window, then one without it
        near_k = select(0.99, 1)
    room = max(expected, near_k.size) + COMPARE_BLOCK  # what a window of these needs
    assert scratch.nbytes <= 2 * width * IndexScratch.SLACK * room < width * big.size // 2

    grown = [select(0.97, 0) for _ in range(3 * IndexScratch.WINDOW)]  # about 1.5 × expected each
    assert grown[0].size > expected
    assert len({id(idx.base) for idx in grown}) == 1  # grown once by the first, then kept as it is


def test_the_index_scratch_widens_to_int64_for_a_buffer_past_int32():
    """A buffer of more than 2**31 − 1 elements has indices int32 cannot hold: reserving for one
    widens the scratch to int64 for good, and every selection kernel selects the same indices at
    either width."""
    from horovod_safusion.compressors.segmented import INT32_INDEX_LIMIT, IndexScratch, NumbaKernels
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    offsets, sizes = np.array([0, 20_000]), np.array([20_000, 30_000])
    kernels, ks = NumbaKernels(offsets, sizes), np.array([200, 300])

    def selections(scratch: IndexScratch) -> list[np.ndarray]:
        idx, counts = kernels.select(x, np.array([2.0, 2.5]), scratch, 0)
        again, _ = kernels.reselect(x, idx.copy(), counts, np.array([1, 2], dtype=np.int8),
                                    np.array([2.2, 2.0]), scratch, 1)
        return [idx.copy(), again.copy(), kernels.select_top(x, ks, scratch).copy(),
                kernels.kth_largest(x, np.array([0, idx.size // 2]), np.array([idx.size // 2, idx.size - idx.size // 2]),
                                    np.array([3, 4]), idx=idx)]

    narrow, wide = IndexScratch(), IndexScratch()
    narrow.reserve(1000, x.size)
    wide.reserve(1000, INT32_INDEX_LIMIT + 1)
    assert (narrow.dtype, wide.dtype) == (np.int32, np.int64)
    wide.reserve(1000, x.size)  # widened for good: no switching back and forth
    assert wide.dtype == np.int64
    for a, b in zip(selections(narrow), selections(wide)):
        np.testing.assert_array_equal(a, b)
