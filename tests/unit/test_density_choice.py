"""``density="auto"``: the planner prices each candidate density and keeps the densest within the
margin of the fastest option; the trial prefers the denser plan the same way; bad input is a
clear error."""
import dataclasses

import pytest
import torch

import horovod_safusion as saf
from horovod_safusion.density import CANDIDATES, MARGIN, densest_within
from horovod_safusion.fusion import Profile, SAFusionPlanner, simulate
from horovod_safusion.plan import FusionPlan
from horovod_safusion.trial import PlanTrial
from test_communicator_choice import line, priced


def at_every_density(profile: Profile) -> Profile:
    """``profile`` with its compression priced alike at every candidate density."""
    return dataclasses.replace(profile, densities={d: (profile.compress, profile.segment_cost) for d in CANDIDATES})


def test_densest_within_the_margin_of_the_fastest():
    density = {"a": 0.001, "b": 0.01, "c": 0.1, "dense": 1.0}
    assert densest_within({"a": 1.0, "b": 1.0 + MARGIN / 2, "c": 1.5, "dense": 3.0}, density) == "b"
    assert densest_within({"a": 1.0, "b": 1.0, "c": 1.0, "dense": 1.0}, density) == "dense"
    assert densest_within({"a": 1.0, "b": 2.0, "c": 3.0, "dense": 4.0}, density) == "a"


def test_a_slow_link_gets_the_lowest_density_a_link_that_hides_everything_the_highest():
    slow = at_every_density(priced(allgather=1e-4))   # 10 kB/s: communication dominates
    plan = SAFusionPlanner().plan(slow.tensors, slow)
    options = plan.meta["predicted_options_s"]
    lowest = min(CANDIDATES)
    assert plan.density == lowest and not plan.dense
    assert set(options) == {f"allgather@{d:g}" for d in CANDIDATES}
    assert simulate(slow.over("allgather").at(lowest), plan).iteration == pytest.approx(options[f"allgather@{lowest:g}"])
    fast = at_every_density(priced(allgather=1e-13))   # a link that carries any density for free
    assert SAFusionPlanner().plan(fast.tensors, fast).density == 0.1
    # ... and where a dense allreduce is as fast, dense is the cap
    free = dataclasses.replace(fast, dense_allreduce=line(1e-3, 1e-13))
    plan = SAFusionPlanner().plan(free.tensors, free)
    assert plan.dense and plan.density is None


def test_the_runner_up_is_the_next_density_down_so_that_the_trial_steps_down_one():
    # a link that prices the lower density faster, but within the margin: the denser is chosen
    # and the trial measures it against the next one down
    profile = at_every_density(priced(allgather=1e-7))
    plan = SAFusionPlanner(dense=False).plan(profile.tensors, profile)
    options = plan.meta["predicted_options_s"]
    seconds = {d: options[f"allgather@{d:g}"] for d in CANDIDATES}
    fastest = min(seconds.values())
    near = [d for d in CANDIDATES if seconds[d] <= (1 + MARGIN) * fastest]
    assert plan.density == max(near) == max(CANDIDATES)
    faster = [d for d in CANDIDATES if seconds[d] < seconds[plan.density] and d < plan.density]
    runner_up = FusionPlan.from_dict(plan.meta["runner_up"])
    assert faster and runner_up.density == max(faster), (seconds, plan.density, runner_up.density)
    # and a link that prices the denser one out keeps the lower
    slower = at_every_density(priced(allgather=2e-7))
    assert SAFusionPlanner(dense=False).plan(slower.tensors, slower).density == min(CANDIDATES)


def test_profiles_and_plans_carry_the_density_through_json_and_the_digest():
    profile = at_every_density(priced(allgather=1e-4))
    again = Profile.from_dict(profile.to_dict())
    assert sorted(again.densities) == list(CANDIDATES) and again.at(0.03).density == 0.03
    with pytest.raises(ValueError, match=r"no density 0.5; it prices \[0.03, 0.1\]"):
        profile.at(0.5)
    plan = SAFusionPlanner().plan(profile.tensors, profile)
    assert FusionPlan.from_json(plan.to_json()) == plan
    other = dataclasses.replace(plan, density=0.1)
    assert other.digest() != plan.digest() and other.first_difference(plan) == "density differs: 0.1 vs 0.03"


def measured(first: FusionPlan, second: FusionPlan, seconds: tuple[float, float], hvd) -> FusionPlan:
    """The plan a full trial keeps when ``first`` measures ``seconds[0]`` and ``second`` ``seconds[1]``."""
    trial = PlanTrial(first, second, steps=1)
    current = first
    while not trial.done:
        current = trial.step_ends(seconds[0 if current is first else 1], hvd.global_process_set) or current
    return current


def test_the_trial_keeps_the_denser_plan_unless_the_other_is_clearly_faster(hvd):
    dense, sparse = FusionPlan([["x"]], density=0.1), FusionPlan([["x"]], density=0.01)
    assert measured(dense, sparse, (1.0 + MARGIN / 2, 1.0), hvd).density == 0.1
    assert measured(dense, sparse, (1.0 + 2 * MARGIN, 1.0), hvd).density == 0.01
    assert measured(sparse, dense, (1.0, 1.0 + MARGIN / 2), hvd).density == 0.1
    # without densities to prefer, the faster wins
    a, b = FusionPlan([["x"]], communicator="zen"), FusionPlan([["x"]], communicator="spardl")
    assert measured(a, b, (1.0 + MARGIN / 2, 1.0), hvd).communicator == "spardl"


def make(density, **kw):
    m = torch.nn.Linear(4, 2)
    return saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                    density=density, **kw)


def test_bad_densities_are_clear_errors(hvd):
    with pytest.raises(ValueError, match=r"density must be a number with 0 < density <= 1 or 'auto', got 'fast'"):
        make("fast")
    with pytest.raises(ValueError, match=r"fusion='wfbp' cannot choose it"):
        make("auto", fusion="wfbp")
    with pytest.raises(ValueError, match=r"chooses a sparse compressor's density; compressor .* sends every element"):
        make("auto", compressor="none")
    opt = make("auto")
    assert opt.target_density == min(CANDIDATES) and opt.controller.densities == CANDIDATES  # provisional
    with pytest.raises(ValueError, match=r"selects at density 0.1, but this optimizer was given density=0.01"):
        make(0.01).set_plan(dataclasses.replace(opt.plan, density=0.1))
