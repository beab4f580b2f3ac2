"""The generator: cost curves, profiles, the pipeline simulator and SAFusion's worked examples."""
import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from horovod_safusion.fusion import (CostCurve, InterPlanner, NaivePlanner, Profile, SAFusionPlanner,
                                        TensorInfo, simulate)
from horovod_safusion.plan import FusionPlan
from horovod_safusion.profiling import fixed_cost
from synthetic import synthetic_profile

MS = 1e-3


# ---- cost curves ----------------------------------------------------------------------------------
def test_cost_curve_interpolates_extrapolates_and_is_monotone():
    c = CostCurve([100, 200, 200, 400, 300], [1.0, 2.0, 4.0, 3.0, 2.5])
    assert c.sizes.tolist() == [100, 200, 300, 400]
    assert c.seconds.tolist() == [1.0, 3.0, 3.0, 3.0]  # median of repeats, then a running maximum
    assert c(150) == pytest.approx(2.0)
    assert c(10_000) == pytest.approx(3.0)  # flat last segment extrapolates flat
    assert CostCurve([0, 10], [1, 2])(1e9) == pytest.approx(1 + 1e8)  # linear beyond the range, never raises
    assert CostCurve([10, 20], [1, 2])(0) == 0.0  # never negative
    assert CostCurve([5], [0.3])(1e6) == 0.3
    assert CostCurve.alpha_beta(1e-4, 1e9)(1e6) == pytest.approx(1e-4 + 1e-3)
    np.testing.assert_allclose(c(np.array([100, 400])), [1.0, 3.0])
    with pytest.raises(ValueError, match="non-negative"):
        CostCurve([1, 2], [1, -1])


def test_profile_json_round_trip(tmp_path):
    p = synthetic_profile([400, 800], [1 * MS, 2 * MS], cp=(0.5 * MS, 0), cm=(1 * MS, 1e-6), segment_cost=1e-4,
                          buffer_cost=3e-4)
    p.meta["note"] = "x"
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    plan = FusionPlan([["t0", "t1"]])
    assert simulate(q, plan) == simulate(p, plan) and q.meta == {"note": "x"}
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["segment_cost"] == 1e-4 and saved["buffer_cost"] == 3e-4
    del saved["buffer_cost"]  # a profile saved before the field existed
    assert Profile.from_dict(saved).buffer_cost == 0.0


# ---- the simulator against a hand-computed schedule ---------------------------------------------
def test_simulator_matches_a_hand_computed_schedule():
    # a, b, c of 400, 400, 800 B ready at 1, 2, 4 ms; compression 0.5 ms a pass + 0.1 ms a further
    # segment; communication 1 ms + 1 µs/B; prefix 3 ms, suffix 1 ms.
    p = synthetic_profile([400, 400, 800], [1 * MS, 2 * MS, 4 * MS], cp=(0.5 * MS, 0), cm=(1 * MS, 1e-6),
                          segment_cost=0.1 * MS, prefix=3 * MS, suffix=1 * MS)
    s = simulate(p, FusionPlan([["t0", "t1"], ["t2"]]))
    b0, b1 = s.buffers
    # buffer 0: fused at 2 + 0.6; sends 800 B: 1.8 ms, until 4.4
    assert (b0.t_b, b0.t_cp, b0.t_cm, b0.fused, b0.comm_end) == pytest.approx((2 * MS, 0.6 * MS, 1.8 * MS, 2.6 * MS, 4.4 * MS))
    # buffer 1: backward 2 ms more, fused at 4 + 0.6 + 0.5 = 5.1; the link idled 0.7 ms; done at 6.9
    assert (b1.t_b, b1.fused, b1.wait, b1.comm_start, b1.comm_end) == pytest.approx((2 * MS, 5.1 * MS, 0.7 * MS, 5.1 * MS, 6.9 * MS))
    assert s.noct == pytest.approx(1.8 * MS)
    assert s.iteration == pytest.approx(10.9 * MS)
    assert "predicted iteration 10.90 ms" in s.table()


def test_each_buffer_pays_its_fixed_work_on_the_training_thread():
    # the hand-computed schedule above with 0.2 ms of fixed work per buffer: buffer 0 fused at
    # 2.8, sent until 4.6; buffer 1 fused at 4 + 0.8 + 0.7 = 5.5, sent until 7.3; and dense alike
    p = synthetic_profile([400, 400, 800], [1 * MS, 2 * MS, 4 * MS], cp=(0.5 * MS, 0), cm=(1 * MS, 1e-6),
                          segment_cost=0.1 * MS, prefix=3 * MS, suffix=1 * MS, buffer_cost=0.2 * MS)
    s = simulate(p, FusionPlan([["t0", "t1"], ["t2"]]))
    assert [b.t_cp for b in s.buffers] == pytest.approx([0.8 * MS, 0.7 * MS])
    assert [b.comm_end for b in s.buffers] == pytest.approx([4.6 * MS, 7.3 * MS])
    assert s.iteration == pytest.approx(11.3 * MS)
    p.dense_allreduce = p.communicate
    dense = p.as_dense()
    assert dense.buffer_cost == 0.2 * MS and dense.t_cp(["t0", "t1"]) == 0.2 * MS
    # one buffer more costs its fixed work more, whichever the plan
    one, three = FusionPlan([["t0", "t1", "t2"]]), FusionPlan([["t0"], ["t1"], ["t2"]])
    free = dataclasses.replace(p, buffer_cost=0.0)
    assert simulate(p, one).compute_end - simulate(free, one).compute_end == pytest.approx(0.2 * MS)
    assert simulate(p, three).compute_end - simulate(free, three).compute_end == pytest.approx(0.6 * MS)


def test_the_fixed_cost_is_the_intercept_of_the_measured_spans():
    rng = np.random.default_rng(0)
    nbytes = np.array([256, 512, 4096, 65536, 1 << 20, 4 << 20, 1024, 300], dtype=float)
    seconds = 150e-6 + 2e-9 * nbytes
    assert fixed_cost(nbytes, seconds) == pytest.approx(150e-6, rel=1e-6)
    noisy = seconds * rng.uniform(0.95, 1.05, nbytes.size)
    assert fixed_cost(nbytes, noisy) == pytest.approx(150e-6, rel=0.1)
    assert fixed_cost(nbytes, 2e-9 * nbytes) == pytest.approx(0.0, abs=1e-9)  # no fixed part
    assert fixed_cost([100, 100, 200], [1e-4, 1e-4, 2e-4]) == 0.0  # two sizes: not told apart


# ---- SAFusion's worked examples ---------------------------------------------------------------------
def test_figure8_aligned_inter_worker_fusion_L6_M2_gives_3_plus_3():
    tensors = [TensorInfo(f"g{i}", n, 4, "f32") for i, n in enumerate([10, 5000, 7, 300, 1, 90])]
    plan = InterPlanner(num_buffers=2).plan(tensors)
    assert plan.buffers == (("g0", "g1", "g2"), ("g3", "g4", "g5"))  # by count, whatever the sizes
    assert [len(b) for b in InterPlanner(3).plan(tensors[:5]).buffers] == [2, 2, 1]


def test_figure10_adaptive_growth_removes_the_waits():
    sizes = [64, 64, 128, 128, 512, 512, 1024, 4096]
    ready = [2.64e-05, 5.28e-05, 8.56e-05, 0.0001484, 0.0002196, 0.0002708, 0.0003732, 0.0008328]
    p = synthetic_profile(sizes, ready, cp=(1e-5, 0), cm=(5e-5, 3e-7))
    fixed = simulate(p, InterPlanner(4).plan(p.tensors))  # Figure 9: four buffers of two gradients
    assert len(fixed.waits) == 3 and all(w > 0 for w in fixed.waits)  # W_1, W_2, W_3
    plan = SAFusionPlanner(long_tail=False, guard=False).plan(p.tensors, p)
    adaptive = simulate(p, plan)
    assert [len(b) for b in plan.buffers] == [3, 1, 1, 2, 1]  # buffers grown by Eq. (1)
    assert all(w == 0 for w in adaptive.waits)
    assert adaptive.iteration < fixed.iteration
    for prev, b in zip(adaptive.buffers, adaptive.buffers[1:]):  # Eq. (1) holds at every boundary
        assert prev.t_cm >= b.t_b + b.t_cp or b.tensors == 1


def test_figure11_long_tailed_buffers_4_to_6_merge():
    sizes = [2048, 4096, 2048, 1024, 512, 1024, 256, 256]
    ready = [0.0004, 0.0008, 0.0012, 0.0014, 0.0018, 0.002, 0.0022, 0.0024]
    p = synthetic_profile(sizes, ready, cp=(5e-5, 0), cm=(1e-4, 2e-7))
    step1 = SAFusionPlanner(long_tail=False, guard=False).plan(p.tensors, p)
    assert len(step1.buffers) == 6
    plan = SAFusionPlanner(guard=False).plan(p.tensors, p)
    assert plan.meta["long_tail_merged_from"] == 4
    assert plan.buffers[:3] == step1.buffers[:3]
    assert plan.buffers[3] == tuple(n for b in step1.buffers[3:] for n in b)  # Buffer_456
    assert simulate(p, plan).iteration < simulate(p, step1).iteration


def test_first_buffer_by_eq2():
    # Backward 0.1 ms a tensor; 1 ms start-up per collective: fusing two beats sending them apart.
    p = synthetic_profile([400] * 6, [0.1 * MS * i for i in range(6)], cm=(1 * MS, 1e-9))
    assert SAFusionPlanner()._first_size(p, p.names) == 2
    # Backward 5 ms a tensor, no start-up: fusing only delays; the first buffer is one gradient.
    q = synthetic_profile([400] * 6, [5 * MS * i for i in range(6)], cm=(0.0, 1e-6))
    assert SAFusionPlanner()._first_size(q, q.names) == 1


def test_safusion_needs_a_profile():
    with pytest.raises(ValueError, match="plans from a profile"):
        SAFusionPlanner().plan([TensorInfo("a", 1, 4, "f32")])


# ---- invariants over random profiles ------------------------------------------------------------------
@st.composite
def profiles(draw):
    n = draw(st.integers(1, 40))
    sizes = draw(st.lists(st.integers(1, 1 << 20), min_size=n, max_size=n))
    gaps = draw(st.lists(st.floats(0, 5e-3), min_size=n, max_size=n))
    ready = list(np.cumsum(gaps))
    cp = (draw(st.floats(0, 1e-3)), draw(st.floats(0, 1e-8)))
    cm = (draw(st.floats(0, 1e-3)), draw(st.floats(1e-11, 1e-7)))
    return synthetic_profile([4 * s for s in sizes], ready, cp=cp, cm=cm, segment_cost=draw(st.floats(0, 1e-4)),
                             buffer_cost=draw(st.sampled_from([0.0, 2e-4])))


@settings(deadline=None, max_examples=150)
@given(profiles(), st.sampled_from(["naive", "inter", "safusion", "safusion-paper", "safusion-step1"]))
def test_every_planner_keeps_each_tensor_once_in_order_deterministically(p, which):
    planner = {"naive": NaivePlanner(1 << 16), "inter": InterPlanner(3), "safusion": SAFusionPlanner(),
               "safusion-paper": SAFusionPlanner(guard=False),
               "safusion-step1": SAFusionPlanner(long_tail=False, guard=False)}[which]
    plan = planner.plan(p.tensors, p)
    assert plan.names == p.names  # every tensor exactly once, back-propagation order kept
    plan.validate(p.names)
    assert planner.plan(p.tensors, p) == plan  # deterministic
    s = simulate(p, plan)
    assert s.noct >= 0 and s.iteration >= s.compute_end
    assert all(w >= 0 for w in s.waits) and math.isfinite(s.iteration)


@settings(deadline=None, max_examples=80)
@given(profiles())
def test_guard_never_predicts_slower_than_the_papers_plan_or_an_aligned_one(p):
    guarded = SAFusionPlanner().plan(p.tensors, p)
    paper = SAFusionPlanner(guard=False).plan(p.tensors, p)
    best = simulate(p, guarded).iteration
    assert best <= simulate(p, paper).iteration + 1e-12
    assert best <= simulate(p, InterPlanner(4).plan(p.tensors, p)).iteration + 1e-12
    assert guarded.meta["chosen"] in guarded.meta["predicted_s"]
    if guarded.meta["chosen"] == "adaptive":
        assert guarded.buffers == paper.buffers
