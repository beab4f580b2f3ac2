"""Baseline planners of issue 5: Cupcake's optimal fusion (MLSys'23 §4) and OMGS's merging rule."""
import functools
import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from horovod_safusion.fusion import (CostCurve, CupcakePlanner, OMGSPlanner, Profile, TensorInfo,
                                        available_planners, make_planner, simulate)
from horovod_safusion.fusion.cupcake import _Timeline
from horovod_safusion.plan import FusionPlan
from synthetic import synthetic_profile

MS = 1e-3


# ---- an independent brute force: every contiguous partition, scheduled like the simulator -------
def partitions(n):
    """Group-end lists of all 2^(n−1) contiguous partitions of 0..n−1."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        yield [i for i, c in enumerate(cuts) if c] + [n - 1]


def _spans(ends):
    k = 0
    for e in ends:
        yield k, e
        k = e + 1


def brute_force(p: Profile, groups_ok=None):
    """(best iteration, best plans) over all 2^(N−1) contiguous partitions, scheduled as the
    simulator's module docstring states, with costs from Profile.t_cp / t_cm."""
    names = p.names
    cp = functools.lru_cache(None)(lambda k, e: p.t_cp(names[k:e + 1], "behind"))
    cm = functools.lru_cache(None)(lambda k, e: p.t_cm(names[k:e + 1], "behind"))
    best, argbest = float("inf"), []
    for ends in partitions(len(names)):
        spans = list(_spans(ends))
        if groups_ok is not None and not all(groups_ok(k, e) for k, e in spans):
            continue
        cum, free = 0.0, 0.0
        for k, e in spans:
            cum += cp(k, e)
            free = max(p.ready[e] + cum, free) + cm(k, e)
        it = p.prefix + free + p.suffix
        if it < best - 1e-15:
            best, argbest = it, [ends]
        elif abs(it - best) <= 1e-15:
            argbest.append(ends)
    return best, argbest


def assert_valid(plan: FusionPlan, p: Profile):
    assert plan.names == p.names  # every tensor once, back-propagation order kept
    plan.validate(p.names)
    group = {t.name: t.group for t in p.tensors}
    for b in plan.buffers:
        assert len({group[n] for n in b}) == 1, f"buffer mixes dtype/device groups: {b}"


def random_profile(rng: random.Random, n: int) -> Profile:
    """Affine costs (the paper's model) drawn across regimes from layer-wise to one buffer."""
    sizes = [4 * rng.choice([rng.randint(1, 256), rng.randint(1_000, 200_000), rng.randint(200_000, 2_000_000)])
             for _ in range(n)]
    ready = np.cumsum([0.0] + [rng.uniform(0, 3) * MS for _ in range(n - 1)]).tolist()
    cp = (rng.choice([0.0, rng.uniform(0, 1) * MS]), rng.uniform(0, 2e-10))
    cm = (rng.choice([0.0, rng.uniform(0, 2) * MS]), rng.uniform(1e-10, 5e-9))
    return synthetic_profile(sizes, ready, cp=cp, cm=cm, prefix=rng.uniform(0, 5) * MS, suffix=rng.uniform(0, 1) * MS,
                             buffer_cost=rng.choice([0.0, rng.uniform(0, 0.5) * MS]))


# ---- Cupcake -----------------------------------------------------------------------------------
def test_registered_and_profile_required():
    assert {"cupcake", "omgs"} <= set(available_planners())
    for name in ("cupcake", "omgs"):
        planner = make_planner(name)
        assert planner.needs_profile and planner.order == "behind"
        with pytest.raises(ValueError, match=f"'{name}' planner .* a profile is required"):
            planner.plan([TensorInfo("a", 4, 4, "g")])


def test_timeline_equals_the_simulator_on_random_partitions():
    rng = random.Random(0)
    piecewise = CostCurve([0, 1e3, 1e5, 4e6, 1e8], [2e-5, 2e-5, 5e-5, 3e-4, 9e-3])
    for trial in range(20):
        p = random_profile(rng, rng.randint(1, 30))
        if trial % 2:  # sparse messages with per-tensor row widths and measured-like curves
            p.dense_comm, p.density = False, rng.choice([0.001, 0.01, 0.3])
            p.wire_bytes = {n: rng.choice([8, 12]) for n in p.names}
            p.compress, p.communicate = piecewise, CostCurve([0, 1e4, 1e7], [1e-4, 1.5e-4, 8e-3])
        t = _Timeline(p)
        for _ in range(10):
            ends = sorted(rng.sample(range(len(p.names) - 1), rng.randint(0, len(p.names) - 1))) + [len(p.names) - 1]
            plan = FusionPlan([p.names[k:e + 1] for k, e in _spans(ends)], order="behind")
            assert t.iteration(t.evaluate(ends)) == simulate(p, plan).iteration


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12))
def test_cupcake_equals_brute_force_on_random_affine_profiles(seed, n):
    p = random_profile(random.Random(seed), n)
    plan = CupcakePlanner().plan(p.tensors, p)
    assert_valid(plan, p)
    best, argbest = brute_force(p)
    iteration = simulate(p, plan).iteration
    assert iteration == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert plan.meta["objective_s"] == pytest.approx(iteration, rel=1e-12)
    assert plan.meta["exact"] is True
    assert plan.meta["states_explored"] <= 2 ** (n - 1)


@pytest.mark.parametrize("seed", range(4))
def test_cupcake_equals_brute_force_at_14_tensors_and_prunes(seed):
    p = random_profile(random.Random(100 + seed), 14)
    plan = CupcakePlanner().plan(p.tensors, p)
    best, _ = brute_force(p)
    assert simulate(p, plan).iteration == pytest.approx(best, rel=1e-12)
    assert plan.meta["states_explored"] < 2 ** 13  # the brute force evaluates 8192 strategies


def test_optimum_of_many_buffers():
    # Free start-ups, expensive bytes, gradients 2 ms apart: send each gradient as soon as it is ready.
    p = synthetic_profile([400_000] * 12, [2 * MS * i for i in range(12)], cp=(0, 1e-10), cm=(0, 4e-9))
    plan = CupcakePlanner().plan(p.tensors, p)
    best, argbest = brute_force(p)
    assert simulate(p, plan).iteration == pytest.approx(best, rel=1e-12)
    assert len(plan.buffers) >= 6 and min(len(ends) for ends in argbest) >= 6


def test_optimum_of_one_buffer():
    # Costly start-ups of compression and collective, tiny tensors ready together: fuse everything.
    p = synthetic_profile([4_000] * 12, [0.01 * MS * i for i in range(12)], cp=(1 * MS, 0), cm=(2 * MS, 1e-9))
    plan = CupcakePlanner().plan(p.tensors, p)
    best, argbest = brute_force(p)
    assert argbest == [[11]] and len(plan.buffers) == 1
    assert simulate(p, plan).iteration == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("prune_bound,prune_start", [(True, False), (False, True), (False, False)])
def test_every_pruning_alone_is_exact_and_both_explore_least(prune_bound, prune_start):
    for seed in range(3):
        p = random_profile(random.Random(200 + seed), 11)
        both = CupcakePlanner(dominance=False).plan(p.tensors, p)
        ablated = CupcakePlanner(prune_bound=prune_bound, prune_start=prune_start, dominance=False).plan(p.tensors, p)
        assert simulate(p, ablated).iteration == pytest.approx(simulate(p, both).iteration, rel=1e-12)
        assert both.meta["states_explored"] <= ablated.meta["states_explored"] <= 2 ** 10
    if not (prune_bound or prune_start):
        assert ablated.meta["states_explored"] == 2 ** 10  # no pruning: every strategy


@pytest.mark.parametrize("seed", [5, 6, 14])
def test_each_pruning_fires_and_both_explore_fewer_states_than_either(seed):
    p = random_profile(random.Random(seed), 12)
    both = CupcakePlanner(dominance=False).plan(p.tensors, p).meta
    bound_only = CupcakePlanner(prune_start=False, dominance=False).plan(p.tensors, p).meta
    start_only = CupcakePlanner(prune_bound=False, dominance=False).plan(p.tensors, p).meta
    assert both["pruned_by_start"] > 0 and both["pruned_by_bound"] > 0
    assert bound_only["pruned_by_start"] == 0 and start_only["pruned_by_bound"] == 0
    assert both["states_explored"] < min(bound_only["states_explored"], start_only["states_explored"])
    assert max(bound_only["states_explored"], start_only["states_explored"]) < 2 ** 11


def test_dominance_is_exact_and_only_removes_states():
    pruned = 0
    for seed in range(6):
        p = random_profile(random.Random(300 + seed), 12)
        on = CupcakePlanner().plan(p.tensors, p)
        off = CupcakePlanner(dominance=False).plan(p.tensors, p)
        assert simulate(p, on).iteration == pytest.approx(simulate(p, off).iteration, rel=1e-12)
        assert on.meta["states_explored"] <= off.meta["states_explored"]
        pruned += on.meta["pruned_by_dominance"]
    assert pruned > 0


def test_max_states_stops_with_the_best_plan_found():
    p = random_profile(random.Random(1), 12)
    plan = CupcakePlanner(max_states=1).plan(p.tensors, p)
    assert plan.meta["complete"] is False and plan.meta["states_explored"] == 1
    assert_valid(plan, p)
    assert plan.meta["objective_s"] <= plan.meta["bootstrap_s"]
    assert CupcakePlanner().plan(p.tensors, p).meta["complete"] is True
    with pytest.raises(ValueError, match="max_states must be a positive .* got 0"):
        CupcakePlanner(max_states=0)


def test_bootstrap_is_the_best_even_split():
    p = random_profile(random.Random(7), 10)
    plan = CupcakePlanner().plan(p.tensors, p)
    even = min(simulate(p, FusionPlan([list(c) for c in np.array_split(p.names, m)], order="behind")).iteration
               for m in range(1, 11))
    assert plan.meta["bootstrap_s"] == pytest.approx(even, rel=1e-12)
    assert plan.meta["objective_s"] <= plan.meta["bootstrap_s"]
    unbooted = CupcakePlanner(bootstrap=False).plan(p.tensors, p)
    assert unbooted.meta["bootstrap_s"] is None
    assert simulate(p, unbooted).iteration == pytest.approx(simulate(p, plan).iteration, rel=1e-12)


def test_groups_are_never_mixed_and_the_optimum_respects_them():
    rng = random.Random(3)
    for _ in range(3):
        p = random_profile(rng, 10)
        kinds = ["torch.float32@cpu"] * 4 + ["torch.float16@cpu"] * 3 + ["torch.float32@cpu"] * 3
        p = Profile.from_dict({**p.to_dict(), "tensors": [[t.name, t.numel, t.element_size, g]
                                                          for t, g in zip(p.tensors, kinds)]})
        plan = CupcakePlanner().plan(p.tensors, p)
        assert_valid(plan, p)
        best, _ = brute_force(p, groups_ok=lambda k, e: len(set(kinds[k:e + 1])) == 1)
        assert simulate(p, plan).iteration == pytest.approx(best, rel=1e-12)


def test_planning_time_and_counts_are_recorded():
    # What planning costs is measured in benchmarks/bench_cupcake_planning.py, never asserted here.
    p = random_profile(random.Random(11), 40)
    meta = CupcakePlanner().plan(p.tensors, p).meta
    assert meta["search_s"] >= 0 and meta["states_explored"] >= 1
    assert {"pruned_by_bound", "pruned_by_start", "objective_s", "bootstrap_s"} <= set(meta)


def test_profile_order_wins_over_stored_order():
    p = synthetic_profile([400, 800, 1200], [2 * MS, 0.0, 1 * MS], cp=(0, 1e-9), cm=(0.1 * MS, 1e-9))
    for planner in (CupcakePlanner(), OMGSPlanner()):
        plan = planner.plan(p.tensors, p)
        assert plan.names == ["t1", "t2", "t0"]  # sorted by ready time: back-propagation order


def test_measured_curves_are_flagged_inexact():
    p = random_profile(random.Random(5), 8)
    p.dense_comm, p.density, p.wire_bytes = False, 0.01, {n: 8 for n in p.names}
    p.communicate = CostCurve([0, 1e4, 1e7], [1e-4, 1.5e-4, 8e-3])
    plan = CupcakePlanner().plan(p.tensors, p)
    assert plan.meta["exact"] is False
    assert_valid(plan, p)


# ---- OMGS ---------------------------------------------------------------------------------------
def test_omgs_merges_while_the_link_is_busy():
    # A 40 MB first gradient keeps the link busy until ~40.6 ms; t1 comes 5 ms later (waiting for it
    # would cost 5 ms > the 0.6 ms start-ups saved: t0 goes alone), t2..t5 every 5 ms while the link
    # is still busy: waiting for them adds nothing, each merge saves a collective and a selection.
    p = synthetic_profile([40_000_000] + [4_000] * 5, [5 * MS * i for i in range(6)],
                          cp=(0.1 * MS, 0), cm=(0.5 * MS, 1e-9))
    plan = OMGSPlanner().plan(p.tensors, p)
    assert_valid(plan, p)
    assert plan.buffers == (("t0",), ("t1", "t2", "t3", "t4", "t5"))
    assert plan.meta["merges"] == 4 and plan.meta["startup_saved_s"] == pytest.approx(0.6 * MS)
    layerwise = FusionPlan([[n] for n in p.names], order="behind")
    assert simulate(p, plan).iteration < simulate(p, layerwise).iteration


def test_omgs_refuses_when_waiting_exceeds_the_start_up():
    # Gradients 10 ms apart, 0.05 ms start-ups, a fast link: merging would idle the link 10 ms.
    p = synthetic_profile([4_000] * 5, [10 * MS * i for i in range(5)], cp=(0.01 * MS, 0), cm=(0.04 * MS, 1e-10))
    plan = OMGSPlanner().plan(p.tensors, p)
    assert plan.buffers == tuple((f"t{i}",) for i in range(5)) and plan.meta["merges"] == 0


def test_omgs_decides_at_the_threshold():
    # t1 arrives 1 ms after t0 and the link is idle: added wait 1 ms against a start-up of 0.9 or 1.1 ms.
    for startup, merged in ((0.9 * MS, False), (1.1 * MS, True)):
        p = synthetic_profile([400, 400], [0.0, 1 * MS], cm=(startup, 0.0))
        plan = OMGSPlanner().plan(p.tensors, p)
        assert (len(plan.buffers) == 1) is merged
        assert plan.meta["predicted_s"] == pytest.approx(simulate(p, plan).iteration)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 30))
def test_baselines_give_valid_plans_never_mixing_groups(seed, n):
    rng = random.Random(seed)
    p = random_profile(rng, n)
    kinds = [rng.choice(["torch.float32@cpu", "torch.float16@cpu"]) for _ in range(n)]
    p = Profile.from_dict({**p.to_dict(), "tensors": [[t.name, t.numel, t.element_size, g]
                                                      for t, g in zip(p.tensors, kinds)]})
    for planner in (OMGSPlanner(), CupcakePlanner()):
        plan = planner.plan(p.tensors, p)
        assert_valid(plan, p)
        assert plan.planner == planner.name and plan.order == "behind"


# ---- through the optimizer: profile on the provisional plan, then switch ----------------------------
@pytest.mark.parametrize("fusion", ["cupcake", "omgs"])
def test_the_optimizer_profiles_then_switches_to_the_baseline(hvd, fusion):
    import torch
    import torch.nn.functional as F
    import horovod_safusion as saf
    from digits import DigitsCNN, load_digits_split

    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), fusion=fusion, profile_steps=2)
    x, y, _, _ = load_digits_split()
    for s in range(5):
        opt.zero_grad()
        F.cross_entropy(model(x[32 * s:32 * (s + 1)]), y[32 * s:32 * (s + 1)]).backward()
        opt.step()
    assert opt.plan.planner == fusion and opt.plan.order == "behind"
    opt.plan.validate([n for n, _ in model.named_parameters()])
    assert opt.last_stats.buffers == len(opt.plan.buffers)
