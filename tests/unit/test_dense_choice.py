"""The dense choice of ``fusion="safusion"``: priced by the planner, settled by measured steps,
and a dense step that sends the residuals along."""
import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

import horovod_safusion as saf
from horovod_safusion.compressors import loading
from horovod_safusion.fusion import CostCurve, Profile, SAFusionPlanner, simulate
from horovod_safusion.trial import SCHEDULE, TRIAL_MAX_STEPS, TRIAL_STEPS, PlanTrial, block_steps, start
from horovod_safusion.plan import FusionPlan
from digits import DigitsCNN, load_digits_split
from synthetic import synthetic_profile

SIZES = [400_000, 4_000_000, 40_000, 4_000]


def priced(dense_per_byte: float) -> Profile:
    """A sparse job (density 0.01, 8-byte rows, 1 ms per message) with the dense allreduce priced
    at 50 µs + ``dense_per_byte`` s per byte."""
    p = synthetic_profile(SIZES, [0.0, 0.01, 0.02, 0.03], cp=(1e-4, 1e-9), cm=(1e-3, 1e-9))
    big = 4 * sum(SIZES)
    return dataclasses.replace(p, density=0.01, dense_comm=False,
                               dense_allreduce=CostCurve([0, big], [5e-5, 5e-5 + dense_per_byte * big]))


def test_a_cheap_dense_allreduce_is_chosen_and_an_expensive_one_is_not():
    tensors = priced(0).tensors
    fast = SAFusionPlanner().plan(tensors, priced(1e-12))
    slow = SAFusionPlanner().plan(tensors, priced(1e-7))
    assert fast.dense and not slow.dense
    for plan, profile in ((fast, priced(1e-12)), (slow, priced(1e-7))):
        sparse_s, dense_s = plan.meta["predicted_sparse_s"], plan.meta["predicted_dense_s"]
        assert (dense_s < sparse_s) == plan.dense
        runner_up = FusionPlan.from_dict(plan.meta["runner_up"])
        assert runner_up.dense != plan.dense
        chosen_profile = profile.as_dense() if plan.dense else profile
        assert simulate(chosen_profile, plan).iteration == pytest.approx(min(sparse_s, dense_s))
    # forced either way; without a priced dense allreduce there is nothing to choose
    assert SAFusionPlanner(dense=True).plan(tensors, priced(1e-7)).dense
    assert not SAFusionPlanner(dense=False).plan(tensors, priced(1e-12)).dense
    unpriced = dataclasses.replace(priced(0), dense_allreduce=None)
    assert not SAFusionPlanner().plan(tensors, unpriced).dense
    with pytest.raises(ValueError, match="does not price one"):
        SAFusionPlanner(dense=True).plan(tensors, unpriced)


def test_dense_plans_and_priced_profiles_round_trip_and_differ_in_digest():
    plan = SAFusionPlanner().plan(priced(0).tensors, priced(1e-12))
    assert FusionPlan.from_json(plan.to_json()) == plan
    sparse = dataclasses.replace(plan, dense=False)
    assert sparse.digest() != plan.digest() and "dense allreduce differs" in plan.first_difference(sparse)
    p = priced(1e-9)
    q = Profile.from_dict(p.to_dict())
    assert q.dense_allreduce(1e6) == p.dense_allreduce(1e6)


def test_bad_dense_values_name_the_value_and_the_accepted_ones(hvd):
    m = DigitsCNN(width=4)
    with pytest.raises(ValueError, match=r"dense must be 'auto', True or False, got 'yes'"):
        saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                 dense="yes")
    with pytest.raises(ValueError, match="fusion='wfbp' cannot"):
        saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                 fusion="wfbp", dense=True)
    # never dense is what every other planner does anyway
    saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                             fusion="wfbp", dense=False)


def test_forced_dense_neither_loads_the_selection_kernels_nor_holds_contenders(hvd, monkeypatch):
    """dense=True never selects: the optimizer does not load the host kernels beside its first
    steps, and ``communicator="auto"`` holds one communicator, so that ZEN's rounds are not set up
    (a process group of their own, probed). The default does both."""
    from horovod_safusion import optimizer
    loads = []
    monkeypatch.setattr(optimizer.loading, "load", lambda dtypes: loads.append(list(dtypes)))
    m = DigitsCNN(width=4)
    forced = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                      dense=True)
    assert loads == [] and sorted(forced._controller.communicators) == ["allgather"]
    default = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    assert loads == [[torch.float32] * len(list(m.parameters()))]
    assert sorted(default._controller.communicators) == ["allgather", "zen"]


def run_trial(trial: PlanTrial, seconds_of, hvd) -> list[int]:
    """Feed ``trial`` the step seconds of the plan in use; returns the plan index per step."""
    current, used = 0, []
    while not trial.done:
        used.append(current)
        switch = trial.step_ends(seconds_of[current], hvd.global_process_set)
        if switch is not None:
            current = trial.plans.index(switch)
    return used + [current]


@pytest.mark.parametrize("faster", [0, 1])
def test_a_trial_runs_a_b_b_a_and_keeps_the_plan_measured_faster(hvd, faster):
    a = FusionPlan([["x"]], planner="safusion", meta={"predicted_sparse_s": 1.0, "predicted_dense_s": 0.9})
    b = FusionPlan([["x"]], planner="safusion", dense=True)
    trial = PlanTrial(a, b)
    seconds = [1.0, 1.0]
    seconds[1 - faster] = 2.0
    used = run_trial(trial, seconds, hvd)
    block = 1 + TRIAL_STEPS  # one unmeasured step after each switch
    assert used[:-1] == [0] * block + [1] * (block + TRIAL_STEPS) + [0] * block
    assert used[-1] == faster and trial.measured == seconds


def test_a_trial_resumes_from_its_state(hvd):
    a = FusionPlan([["x"]], planner="safusion", meta={"predicted_sparse_s": 1.0, "predicted_dense_s": 0.9})
    b = FusionPlan([["x"]], planner="safusion", dense=True)
    trial = PlanTrial(a, b)
    for _ in range(1 + TRIAL_STEPS + 2):
        trial.step_ends(1.0, hvd.global_process_set)
    resumed = PlanTrial.from_state(trial.state_dict())
    assert resumed.blocks == trial.blocks and resumed.plans == trial.plans
    assert len(SCHEDULE) == 4


def test_start_announces_a_decisive_dense_plan_and_tries_close_ones(hvd, capsys):
    sparse = FusionPlan([["x"]], planner="safusion")
    decisive = FusionPlan([["x"]], planner="safusion", dense=True,
                          meta={"predicted_sparse_s": 3.0, "predicted_dense_s": 1.0, "runner_up": sparse.to_dict()})
    check = start(decisive)
    assert "dense allreduce predicted faster than sparse: 1.000 s/iteration against 3.000 s" in capsys.readouterr().err
    assert check.confirm_below == 3.0
    close = dataclasses.replace(decisive, meta=dict(decisive.meta, predicted_sparse_s=1.2))
    assert start(close).confirm_below is None


def test_short_steps_are_measured_in_longer_blocks(hvd):
    assert block_steps(1.0) == TRIAL_STEPS and block_steps(float("nan")) == TRIAL_STEPS
    assert block_steps(0.025) == 8 and block_steps(1e-4) == TRIAL_MAX_STEPS
    # sized by the faster prediction, which every rank shares
    sparse = FusionPlan([["x"]], planner="safusion")
    close = FusionPlan([["x"]], planner="safusion", dense=True,
                       meta={"predicted_sparse_s": 0.03, "predicted_dense_s": 0.025, "runner_up": sparse.to_dict()})
    trial = start(close)
    assert trial.steps == 8
    used = run_trial(trial, [0.03, 0.02], hvd)
    assert used[:-1] == [0] * 9 + [1] * (9 + 8) + [0] * 9 and used[-1] == 1


@pytest.mark.parametrize("measured", [1.0, 5.0])
def test_a_decisive_choice_is_checked_by_measurement_and_tried_out_when_it_misses(hvd, capsys, measured):
    sparse = FusionPlan([["x"]], planner="safusion")
    dense = FusionPlan([["x"]], planner="safusion", dense=True,
                       meta={"predicted_sparse_s": 3.0, "predicted_dense_s": 1.0, "runner_up": sparse.to_dict()})
    trial = start(dense)
    used = run_trial(trial, [measured, 2.0], hvd)
    block = 1 + TRIAL_STEPS
    if measured < 3.0:  # dense measured below sparse's prediction: kept, sparse never tried
        assert used == [0] * (block + 1) and trial.measured[0] == measured
    else:  # it missed: the full A B B A trial, which sparse wins
        assert 1 in used and used[-1] == 1 and "measuring both" in capsys.readouterr().err


def test_what_a_script_does_between_its_steps_is_timed_as_no_step(hvd):
    """A pause between ``step()`` and the next ``zero_grad()`` (an evaluation, a checkpoint) is
    neither the profile's forward pass nor a step of the plan that the trial measures then; a
    pause after ``zero_grad()`` is the step's, and is timed. The pause is long next to a step of
    this model even on a loaded machine."""
    torch.manual_seed(0)
    m = DigitsCNN(width=4)
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
                                   profile_steps=3, critical_regimes=None)
    loading.wait()  # the selection kernels load on a thread that would slow the first steps
    x, y, _, _ = load_digits_split()
    pause = 0.3

    def steps(outside: float, inside: float) -> None:
        time.sleep(outside)
        opt.zero_grad()
        time.sleep(inside)
        F.cross_entropy(m(x[:32]), y[:32]).backward()
        opt.step()

    for _ in range(5):  # one settling step, three profiled
        steps(pause, 0.0)
    assert opt.profile is not None and opt.profiler.local["prefix"] < pause / 2
    for outside, inside in ((pause, 0.0), (0.0, pause)):
        trial = opt.profiler.trial = PlanTrial(opt.plan, dataclasses.replace(opt.plan, dense=True))
        while not trial.done:
            steps(outside, inside)
        if inside:
            assert min(trial.measured) > pause
        else:
            assert max(trial.measured) < pause / 2


def test_dense_steps_send_the_residuals_along_a_chunk_per_step_and_lose_nothing(hvd):
    """After sparse steps at density 0.05, a dense plan sends each parameter's gradient plus one
    twentieth of its residual per step (one worker: the average is the sum) and keeps the rest
    bit for bit: ``sent == gradient + residual_before − residual_after``. After 20 dense steps
    every element went once and no residual is left."""
    torch.manual_seed(0)
    m = DigitsCNN(width=4)
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), named_parameters=m.named_parameters(),
                                   fusion="wfbp", compressor="topk", density=0.05)
    x, y, _, _ = load_digits_split()
    for step in range(2):
        opt.zero_grad()
        F.cross_entropy(m(x[32 * step:32 * step + 32]), y[32 * step:32 * step + 32]).backward()
        opt.step()
    names = dict(m.named_parameters())

    def residuals():
        return {n: opt.residuals.get(n, p.detach().reshape(-1)).clone() for n, p in names.items()}

    first = residuals()
    assert any(r.abs().sum() > 0 for r in first.values())
    opt.set_plan(dataclasses.replace(opt.plan, dense=True))
    sent_once = {n: torch.zeros_like(r, dtype=torch.int32) for n, r in first.items()}
    for step in range(20):
        before = residuals()
        opt.zero_grad()
        local = {}  # the gradients back-propagation computes (a dense step adds the residual in place)
        hooks = [p.register_hook(lambda g, n=n: local.__setitem__(n, g.detach().reshape(-1).clone()))
                 for n, p in names.items()]
        F.cross_entropy(m(x[32 * step:32 * step + 32]), y[32 * step:32 * step + 32]).backward()
        for h in hooks:
            h.remove()
        opt.step()
        after = residuals()
        for n, p in names.items():
            moved = before[n] != after[n]
            sent_once[n] += moved.int()
            assert torch.equal(p.grad.reshape(-1)[moved], local[n][moved] + before[n][moved]), n
            assert torch.equal(p.grad.reshape(-1)[~moved], local[n][~moved]), n
            assert torch.equal(after[n][moved], torch.zeros_like(after[n][moved])), n
            assert int(moved.sum()) <= -(-first[n].numel() // 20), n  # at most one chunk of 20
        assert opt.last_stats.density == 1.0
    for n in names:
        assert opt.residuals.pop(n) is None, n
        assert int(sent_once[n].max()) <= 1 and bool((sent_once[n] == 1).eq(first[n] != 0).all()), n
