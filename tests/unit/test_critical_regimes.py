"""Accordion's critical regimes (``critical_regimes=``, :mod:`horovod_safusion.regime`): the rule on
given norms, the optimizer sending dense exactly in critical intervals, and a resume that continues
bit for bit."""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import horovod_safusion as saf
from horovod_safusion import sweeps
from horovod_safusion.buffer import FusionBuffer
from horovod_safusion.clock import Clock
from horovod_safusion.fusion import NaivePlanner
from horovod_safusion.regime import DEFAULT_INTERVAL, ETA, HALF_MARGIN, CriticalRegimes
from horovod_safusion.stages.half import round_to_half
from horovod_safusion.stages.record import Filling
from horovod_safusion.trial import PlanTrial
from test_dgc_techniques import backward, make


def feed(regimes: CriticalRegimes, norm: float) -> None:
    regimes.observe([torch.tensor([norm])])


def test_an_interval_is_critical_after_a_change_of_half_or_more():
    r = CriticalRegimes(2)
    assert r.critical  # the first interval always is
    for norm in (1.0, 1.0):
        feed(r, norm)
    assert r.critical and r.previous == pytest.approx(1.0)  # no previous interval to compare with
    for norm in (1.25, 1.25):  # +25 %
        feed(r, norm)
    assert not r.critical
    feed(r, 1.25 * (1 + ETA))
    assert not r.critical  # decided at the interval's end only
    feed(r, 1.25 * (1 + ETA))
    assert r.critical  # +50 %, exactly (binary fractions)
    for norm in (0.5, 0.5):  # −72 %: a fall counts as a change too
        feed(r, norm)
    assert r.critical
    for norm in (3.0, 4.0):  # the root mean square of the steps' norms: sqrt(12.5) against 0.5
        feed(r, norm)
    assert r.critical and r.previous == pytest.approx(12.5 ** 0.5)
    for norm in (float("nan"), 1.0):  # a non-finite interval decides nothing
        feed(r, norm)
    assert r.critical and r.previous == pytest.approx(12.5 ** 0.5)


def test_the_decision_resumes_from_its_state():
    a, b = CriticalRegimes(3), CriticalRegimes(3)
    for norm in (1.0, 1.0, 1.0, 1.1):
        feed(a, norm)
    b.load_state_dict(a.state_dict())
    for norm in (1.1, 2.5, 2.5, 2.5, 2.5):
        feed(a, norm)
        feed(b, norm)
        assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_a_bad_interval_is_a_clear_error(hvd, bad):
    with pytest.raises(ValueError, match=f"critical_regimes must be 'auto', None or a positive int .*got {bad!r}"):
        make(compressor="topk", density=0.01, critical_regimes=bad)
    with pytest.raises(ValueError, match=f"critical_regimes must be 'auto', None or a positive int .*got {bad!r}"):
        CriticalRegimes(bad)


@pytest.mark.parametrize("half", [False, True])
def test_critical_intervals_are_sent_dense_and_the_rest_at_the_target(hvd, half):
    """Every step of a critical interval sends every element; the others send the target
    density; the first interval is critical. The residuals of sparse steps before a critical
    interval go along as float16 whole (``residual_after + sent == gradient + residual_before``,
    the residual keeping the rounding error), and as float32 a chunk per step at the rate the
    sparse steps sent, as the dense plan's steps do: what moved was sent with the gradient and
    left zero, at most one hundredth of each residual per step at density 0.01, the rest kept bit
    for bit (one worker, no momentum: the aggregate is what this rank sent)."""
    model, opt = make(momentum=0.0, compressor="topk", density=0.01, critical_regimes=3)
    regimes = opt.controller.regimes
    regimes.half = half
    names = dict(model.named_parameters())

    def residuals():
        return {n: opt.residuals.get(n, p.detach().reshape(-1)).clone() for n, p in names.items()}

    kinds, carried = [], 0
    for step in range(30):
        if step == 12:
            regimes.critical = True  # an interval boundary (12 = 4 intervals): force one after sparse steps
        critical = regimes.critical
        before = residuals()
        opt.zero_grad()
        local = {}
        hooks = [p.register_hook(lambda g, n=n: local.__setitem__(n, g.detach().reshape(-1).clone()))
                 for n, p in names.items()]
        backward(model, step % 20)
        for h in hooks:
            h.remove()
        opt.synchronize()
        after = residuals()
        kinds.append(critical)
        if critical:
            assert opt.last_stats.density == 1.0 and opt.controller.mode.half == half
            for n, p in names.items():
                sent = p.grad.detach().reshape(-1)
                if half:
                    assert torch.equal(after[n] + sent, local[n] + before[n]), n
                    continue
                moved = after[n] != before[n]
                carried += int((before[n][moved] != 0).sum())
                assert torch.equal(after[n][moved], torch.zeros_like(after[n][moved])), n
                assert torch.equal(sent[moved], local[n][moved] + before[n][moved]), n
                assert torch.equal(sent[~moved], local[n][~moved]), n
                assert int((moved & (before[n] != 0)).sum()) <= -(-p.numel() // 100), n
        else:
            assert opt.last_stats.density < 0.05
        with opt.skip_synchronize():
            opt.step()
    assert kinds[:3] == [True] * 3 and kinds[12:15] == [True] * 3 and not all(kinds)
    assert half or carried > 0  # float32: a critical step after sparse ones sent residual chunks along


@pytest.mark.parametrize("half", [False, True])
def test_a_resumed_run_continues_bit_for_bit(hvd, half):
    def run(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            backward(model, step)
            opt.step()

    model, opt = make(compressor="dgc", density=0.02, critical_regimes=2)
    opt.controller.regimes.half = half  # critical steps as float16: their rounding error is resumed too
    run(model, opt, range(5))  # mid-interval
    params, state = {n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict()
    model2, opt2 = make(compressor="dgc", density=0.02, critical_regimes=2, seed=1)
    with torch.no_grad():
        for n, p in model2.named_parameters():
            p.copy_(params[n])
    opt2.load_state_dict(state)
    assert opt2.controller.regimes.state_dict() == opt.controller.regimes.state_dict()
    assert opt2.controller.regimes.half == half
    run(model, opt, range(5, 12))
    run(model2, opt2, range(5, 12))
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n
    assert opt2.controller.regimes.state_dict() == opt.controller.regimes.state_dict()


def test_the_default_is_on_where_the_job_may_send_dense(hvd):
    """``"auto"``: intervals of 10 steps with ``fusion="safusion"`` and ``dense="auto"`` on a sparse
    compressor; off where the user fixed the scheme (``dense=False``, another planner), where
    nothing is sparsified (``compressor="none"``, ``dense=True``), and with ``None``."""
    model, opt = make(compressor="topk", density=0.01, fusion=None)
    assert opt.controller.regimes is not None and opt.controller.regimes.interval == DEFAULT_INTERVAL == 10
    for off in ({"dense": False}, {"dense": True}, {"critical_regimes": None}, {}):
        model, opt = make(compressor="topk", density=0.01, fusion=None if off else NaivePlanner(4096), **off)
        assert opt.controller.regimes is None, off
    model, opt = make(compressor="none", fusion=None)
    assert opt.controller.regimes is None
    model, opt = make(compressor="topk", density=0.01, fusion=None, dense=False, critical_regimes=5)
    assert opt.controller.regimes.interval == 5  # asked for, it runs where the default would not
    assert "critical_regimes" in saf.DistributedOptimizer.__doc__


def test_the_plan_trial_times_no_step_of_a_critical_interval(hvd, monkeypatch):
    """The measured trial between two plans (``dense="auto"``, ``density="auto"``) compares step
    times at the target density: the steps of a critical interval, sent dense, are not timed."""
    model, opt = make(compressor="topk", density=0.01, fusion=None, critical_regimes=3, profile_steps=2)
    timed = []
    step_ends = PlanTrial.step_ends

    def spy(trial, seconds, process_set):
        timed.append(opt.controller.mode.density)
        return step_ends(trial, seconds, process_set)

    monkeypatch.setattr(PlanTrial, "step_ends", spy)
    sent, tried = [], False
    for step in range(40):
        if opt.profile is not None and not tried:  # one worker runs no trial of its own: two plans to compare
            opt.profiler.trial, tried = PlanTrial(opt.plan, opt.plan), True
        opt.zero_grad()
        backward(model, step % 20)
        opt.step()
        sent.append(opt.last_stats.density)
    assert 1.0 in sent[5:] and len(timed) >= 5  # critical intervals fell inside the trial, which timed steps
    assert all(d == opt.target_density for d in timed), timed


@pytest.mark.parametrize("interval", [None, 4])
def test_the_profile_prices_a_plan_when_a_step_is_to_use_it(hvd, interval):
    """The profile's sweeps and the planning wait while the next step belongs to a critical
    regime, which sends dense whatever the plan: the profile is built at the end of the first
    step before one that is not, and with no regimes right after the profiled steps (one
    settling step, two profiled)."""
    model, opt = make(compressor="topk", density=0.01, fusion=None, critical_regimes=interval, profile_steps=2)
    built, dense_next = None, []
    for step in range(40):
        opt.zero_grad()
        backward(model, step % 20)
        opt.step()
        dense_next.append(interval is not None and opt.controller.regimes.critical)
        if built is None and opt.profile is not None:
            built = step
    if interval is None:
        assert built == 2
    else:
        assert dense_next[:2 * interval - 1] == [True] * (2 * interval - 1)  # the first two intervals
        assert built == dense_next.index(False), dense_next


def test_the_wire_of_critical_steps_is_chosen_by_measured_time_and_float32_stays_after_an_overflow():
    r = CriticalRegimes(10)
    assert not r.half  # float32 until the profile has measured both
    assert r.choose_wire(0.100, HALF_MARGIN * 0.100) and r.half
    assert not r.choose_wire(0.100, HALF_MARGIN * 0.100 * 1.01) and not r.half
    r.choose_wire(0.100, 0.050)
    r.fall_back()
    assert not r.half and r.overflowed
    assert not r.choose_wire(0.100, 0.010)  # after an overflow, never again
    resumed = CriticalRegimes(10)
    resumed.load_state_dict(r.state_dict())
    assert resumed.overflowed and not resumed.half
    old = {k: v for k, v in r.state_dict().items() if k not in ("half", "overflowed")}  # an older checkpoint
    resumed.load_state_dict(old)
    assert not resumed.half and not resumed.overflowed


@pytest.mark.parametrize("warm", [True, False])
def test_a_wire_is_the_least_of_its_warm_up_and_its_counted_run(warm):
    # a busy host only adds to a run: one slow run of a wire (here the counted one) does not choose
    # it, where the warm-up moved the same bytes faster; with no warm-up, the counted run alone
    durations = iter([0.02, 0.25] if warm else [0.25])

    def run():
        time.sleep(next(durations))
    least = sweeps.time_collective(run, Clock(torch.device("cpu")), 1, warm=warm, least=True)
    assert (least < 0.2) if warm else (least >= 0.25), least
    durations = iter([0.02, 0.25])
    assert sweeps.time_collective(run, Clock(torch.device("cpu")), 1) >= 0.25  # the median of the counted run


def test_a_critical_step_as_float16_keeps_the_rounding_error_as_the_residual(hvd):
    """One worker, critical steps forced to float16: after each, the residual is exactly what
    rounding the step's gradient plus the residual before dropped, and the gradient applied is
    the float16 rounding; sparse steps afterwards start from that residual."""
    model, opt = make(momentum=0.0, compressor="topk", density=0.01, critical_regimes=3)
    opt.controller.regimes.half = True
    named = list(model.named_parameters())
    for step in range(6):  # the first two intervals are critical
        opt.zero_grad()
        backward(model, step)
        sent_grad = {n: p.grad.detach().view(-1).clone() for n, p in named}  # gradient + residual
        opt.synchronize()
        assert opt.controller.mode.half and opt.last_stats.density == 1.0
        kept = 0
        for n, p in named:
            after = opt.residuals.get(n, p.detach().view(-1))
            h = sent_grad[n].half().float()
            assert torch.equal(after + h, sent_grad[n]), n
            assert torch.equal(p.grad.view(-1), h), n  # one worker: the aggregate is what it sent
            kept += int(after.count_nonzero())
        assert kept > 0  # float16 rounded something off, and the residual holds it
        with opt.skip_synchronize():
            opt.step()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-65504.0, max_value=65504.0, width=32), min_size=1, max_size=300),
       st.integers(min_value=-40, max_value=0))
def test_rounding_to_float16_loses_nothing(values, exponent):
    """``residual + sent == x`` bit for bit for any float32 in float16's range, normal, subnormal
    in float16 or below its smallest subnormal (scaled by ``2**exponent``)."""
    x = torch.tensor(values, dtype=torch.float32) * 2.0 ** exponent
    p = torch.nn.Parameter(torch.zeros_like(x))
    buf = FusionBuffer(0, ["p"], [p], "ahead")
    wire = round_to_half(buf, Filling([x.clone()]))
    assert wire.dtype == torch.float16 and torch.equal(wire, x.half())
    assert torch.equal(buf.flat + wire.float(), x)
