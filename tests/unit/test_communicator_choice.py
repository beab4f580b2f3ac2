"""``communicator="auto"``: the planner prices each communicator the profile swept and names the
fastest in the plan; the controller sends over the plan's communicator; checkpoints keep it."""
import dataclasses
import warnings

import pytest
import torch

import horovod_safusion as saf
from horovod_safusion.communicators.base import AUTO_SPARSE, contenders
from horovod_safusion.fusion import CostCurve, Profile, SAFusionPlanner, simulate
from horovod_safusion.plan import FusionPlan
from horovod_safusion.trial import start
from synthetic import synthetic_profile
from test_checkpoint import model, through_file, train

SIZES = [400_000, 40_000, 400_000, 4_000]


def line(latency: float, per_byte: float) -> CostCurve:
    return CostCurve([0, 1e8], [latency, latency + per_byte * 1e8])


def priced(dense_per_byte=None, **per_byte) -> Profile:
    """A sparse job (density 0.01) whose communicators cost 1 ms + ``per_byte[name]`` s per byte
    offered, the first in use; a dense allreduce priced too where ``dense_per_byte`` is given."""
    p = synthetic_profile(SIZES, [0.0, 0.01, 0.02, 0.03], cp=(1e-4, 1e-9))
    curves = {name: line(1e-3, b) for name, b in per_byte.items()}
    dense = None if dense_per_byte is None else line(5e-5, dense_per_byte)
    return dataclasses.replace(p, density=0.01, dense_comm=False, communicate=next(iter(curves.values())),
                               communicators=curves, dense_allreduce=dense)


def test_with_two_workers_the_allgather_is_priced_without_zen():
    held = {name: object() for name in AUTO_SPARSE}
    assert list(contenders(held, 2, "allgather")) == ["allgather"]
    # the one in use is priced whatever the count (a job shrunk to two keeps its plan priced)
    assert list(contenders(held, 2, "zen")) == ["allgather", "zen"]
    for workers in (1, 3, 4, 5, 8):
        assert list(contenders(held, workers, "allgather")) == list(AUTO_SPARSE)
    # without the allgather there is nothing to prefer: every one is priced
    assert list(contenders({"spardl": 1, "zen": 2}, 2, "spardl")) == ["spardl", "zen"]


def test_the_planner_names_the_communicator_priced_fastest_and_the_runner_up():
    profile = priced(allgather=1e-6, spardl=1e-8, zen=1e-7)
    plan = SAFusionPlanner().plan(profile.tensors, profile)
    options = plan.meta["predicted_options_s"]
    assert plan.communicator == "spardl" and not plan.dense
    assert list(options) == ["spardl", "zen", "allgather"]  # fastest first
    assert simulate(profile.over("spardl"), plan).iteration == pytest.approx(options["spardl"])
    runner_up = FusionPlan.from_dict(plan.meta["runner_up"])
    assert runner_up.communicator == "zen" and runner_up.meta["predicted_iteration_s"] == options["zen"]
    assert runner_up.meta["predicted_options_s"] == options  # kept by the trial, it still says what it beat
    # a cheap dense allreduce beats them all; the best communicator is then the runner-up
    cheap = dataclasses.replace(profile, dense_allreduce=line(5e-5, 1e-12))
    plan = SAFusionPlanner().plan(cheap.tensors, cheap)
    assert plan.dense and FusionPlan.from_dict(plan.meta["runner_up"]).communicator == "spardl"
    assert plan.meta["predicted_dense_s"] < plan.meta["predicted_sparse_s"] == plan.meta["predicted_options_s"]["spardl"]
    # dense=False still chooses among the communicators; dense=True sends dense, no runner-up
    assert SAFusionPlanner(dense=False).plan(cheap.tensors, cheap).communicator == "spardl"
    forced = SAFusionPlanner(dense=True).plan(cheap.tensors, cheap)
    assert forced.dense and forced.meta["runner_up"] is None


def test_which_communicator_wins_follows_the_prices_not_a_fixed_order():
    for fastest in AUTO_SPARSE:
        profile = priced(**{name: 1e-8 if name == fastest else 1e-6 for name in AUTO_SPARSE})
        assert SAFusionPlanner().plan(profile.tensors, profile).communicator == fastest


def test_profiles_and_plans_carry_the_communicator_through_json_and_the_digest():
    profile = priced(allgather=1e-6, spardl=1e-8)
    again = Profile.from_dict(profile.to_dict())
    assert set(again.communicators) == {"allgather", "spardl"} and again.over("spardl").communicate(1e6) == \
        profile.communicators["spardl"](1e6)
    with pytest.raises(ValueError, match=r"no communicator 'zen'; it prices \['allgather', 'spardl'\]"):
        profile.over("zen")
    plan = SAFusionPlanner().plan(profile.tensors, profile)
    assert FusionPlan.from_json(plan.to_json()) == plan
    other = dataclasses.replace(plan, communicator="allgather")
    assert other.digest() != plan.digest()
    assert other.first_difference(plan) == "communicator differs: 'allgather' vs 'spardl'"
    # a plan that names none has the digest of earlier versions
    assert dataclasses.replace(plan, communicator=None).digest() == FusionPlan(plan.buffers, order=plan.order).digest()


def test_start_says_what_was_planned_with_every_prediction(hvd, capsys):
    zen = FusionPlan([["x"]], planner="safusion", communicator="zen", meta={"predicted_iteration_s": 1.1})
    plan = FusionPlan([["x"]], planner="safusion", communicator="spardl",
                      meta={"predicted_iteration_s": 1.0, "runner_up": zen.to_dict(),
                            "predicted_options_s": {"spardl": 1.0, "zen": 1.1, "dense": 2.0}})
    trial = start(plan)
    assert "sparse over spardl planned; predicted s/iteration: spardl 1.000, zen 1.100, dense 2.000" \
        in capsys.readouterr().err
    assert trial.plans == (plan, zen) and trial.confirm_below is None  # close: measured A B B A


def make(m, **kw):
    kw.setdefault("critical_regimes", None)  # sparse from the first step, over the plan's communicator
    return saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=m.named_parameters(), density=0.05, min_selected=0,
                                    profile_steps=2, **kw)


def test_the_optimizer_sends_over_the_plans_communicator_and_a_checkpoint_keeps_it(hvd):
    m = model()
    opt = make(m)
    assert opt.communicator.name == "allgather"  # "auto" starts on SAFusion's allgather
    train(m, opt, 4)
    opt.set_plan(dataclasses.replace(opt.plan, communicator="zen"))
    assert opt.communicator.name == "zen"
    train(m, opt, 2, first=4)
    ckpt = through_file({"model": m.state_dict(), "optimizer": opt.state_dict()})
    train(m, opt, 3, first=6)

    m2 = model(seed=1)
    opt2 = make(m2)
    m2.load_state_dict(ckpt["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(ckpt["optimizer"])
    assert opt2.communicator.name == "zen" and opt2.plan == opt.plan
    train(m2, opt2, 3, first=6)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_a_plan_naming_a_communicator_the_job_does_not_hold_is_a_clear_error(hvd):
    m = model()
    opt = make(m, communicator="allgather")
    with pytest.raises(ValueError, match=r"communicator 'zen', which this optimizer does not hold; it holds "
                                         r"\['allgather'\] \(pass communicator='zen' or 'auto', without dense=True\)"):
        opt.set_plan(dataclasses.replace(opt.plan, communicator="zen"))
    assert opt.communicator.name == "allgather"


def test_auto_does_not_hold_spardl_whose_step_applies_fewer_elements(hvd):
    """SparDL applies the top k/P of each merged block, not every rank's selection: ``"auto"``
    does not choose it by step time, so a plan naming it asks for it by name."""
    m = model()
    opt = make(m)  # communicator="auto"
    assert "spardl" not in AUTO_SPARSE
    with pytest.raises(ValueError, match=r"communicator 'spardl', which this optimizer does not hold; it holds "
                                         r"\['allgather', 'zen'\] \(pass communicator='spardl'\)$"):
        opt.set_plan(dataclasses.replace(opt.plan, communicator="spardl"))


def test_a_checkpoint_naming_a_communicator_this_optimizer_does_not_hold_keeps_the_one_asked_for(hvd):
    m = model()
    opt = make(m)
    train(m, opt, 4)
    opt.set_plan(dataclasses.replace(opt.plan, communicator="zen"))
    saved = opt.state_dict()
    m2 = model()
    opt2 = make(m2, communicator="allgather")
    with pytest.warns(UserWarning, match="sends over communicator 'zen', which this optimizer does not hold; "
                                         "it sends over 'allgather', as asked"):
        opt2.load_state_dict(saved)
    assert opt2.communicator.name == "allgather" and opt2.plan.communicator is None
    assert opt2.plan.buffers == opt.plan.buffers
    train(m2, opt2, 2, first=4)


def pruning_sweeps(hvd, monkeypatch, margin: float, sweep_bytes: int | None = None, give_up: float | None = None,
                   runs: list | None = None):
    """The profile's communicator sweeps of a small job over ``AUTO_SPARSE`` (a real one-worker
    Horovod), the allgather first, with ``sweeps.PRUNE_MARGIN = margin`` (and ``sweeps.GIVE_UP =
    give_up``); ``runs`` receives the name of the communicator of every collective run."""
    from horovod_safusion import sweeps
    from horovod_safusion.communicators.base import make_communicators
    from horovod_safusion.plan import TensorInfo

    monkeypatch.setattr(sweeps, "PRUNE_MARGIN", margin)
    if sweep_bytes is not None:
        monkeypatch.setattr(sweeps, "SWEEP_BYTES", sweep_bytes)
    if give_up is not None:
        monkeypatch.setattr(sweeps, "GIVE_UP", give_up)
    comms = make_communicators("auto", False, hvd.global_process_set, hvd.Compression.none)
    for c in comms.values():
        c.setup(None)
        if runs is not None:
            def start(outgoing, reduction, _start=c.start, _name=c.name):
                runs.append(_name)
                return _start(outgoing, reduction)
            monkeypatch.setattr(c, "start", start)
    tensors = [TensorInfo(f"t{i}", n, 4, "torch.float32:cpu") for i, n in enumerate((5_000, 20_000, 300))]
    took = {}
    swept, pruned = sweeps.communicator_sweeps(comms, tensors, 0.03, torch.float32, torch.device("cpu"),
                                               "allgather", hvd.global_process_set, sweeps.Stopwatch(took))
    counts, _, _ = sweeps.message_counts(comms["allgather"], tensors, 0.03, torch.float32)
    return swept, pruned, took, len(counts)


def test_a_contender_slower_at_the_largest_message_is_not_swept_further(hvd, monkeypatch):
    swept, pruned, took, points = pruning_sweeps(hvd, monkeypatch, margin=0.0)
    assert list(swept) == ["allgather"] and len(swept["allgather"][0]) == points
    assert list(pruned) == ["zen"]
    p = pruned["zen"]
    assert p.best == "allgather" and p.nbytes == swept["allgather"][0][-1] and p.seconds > 0
    assert set(took) == {"communicate:allgather", "communicate:zen"}


def test_a_contender_far_beyond_the_margin_is_pruned_on_its_first_run(hvd, monkeypatch):
    # a margin any time exceeds; GIVE_UP = 0: a bar of 0 s, which any first run exceeds; GIVE_UP
    # huge: a bar no run reaches, so the counted runs decide (and prune it at that margin)
    runs = []
    _, pruned, _, _ = pruning_sweeps(hvd, monkeypatch, margin=1e-9, give_up=0.0, runs=runs)
    assert list(pruned) == ["zen"] and runs.count("zen") == 1
    runs = []
    _, pruned, _, _ = pruning_sweeps(hvd, monkeypatch, margin=1e-9, give_up=1e300, runs=runs)
    assert list(pruned) == ["zen"] and runs.count("zen") == 3  # the warm-up and two counted runs


def test_a_contender_within_the_margin_is_swept_in_full_in_ascending_sizes(hvd, monkeypatch):
    swept, pruned, _, points = pruning_sweeps(hvd, monkeypatch, margin=float("inf"))
    assert pruned == {} and list(swept) == ["allgather", "zen"]
    assert swept["zen"][0] == swept["allgather"][0] and len(swept["zen"][1]) == points


def test_a_contender_is_not_pruned_where_the_sweep_stops_short_of_the_jobs_largest_message(hvd, monkeypatch):
    # beyond SWEEP_BYTES the curves are extrapolated: a contender's slope could still win there
    swept, pruned, _, _ = pruning_sweeps(hvd, monkeypatch, margin=0.0, sweep_bytes=1024)
    assert pruned == {} and list(swept) == ["allgather", "zen"]
