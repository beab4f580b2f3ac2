"""DGC's accuracy techniques through the real optimizer in a one-worker Horovod job: momentum
correction and factor masking (exact conservation of the new state, masking in every tensor and
by tensor, equivalence with SGD's momentum when everything is sent, EF21-SGDM's too), local
gradient clipping, and the density warm-up."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import horovod_safusion as saf
from horovod_safusion.fusion import NaivePlanner
from horovod_safusion.spread import CONCENTRATED, CONCENTRATION_SAMPLE, concentration
from horovod_safusion.warmup import STAGES, DensityWarmup
from corpus import stdlib_corpus
from digits import DigitsCNN, load_digits_split
from models import LSTMLanguageModel

DATA = load_digits_split()


def make(momentum=0.9, nesterov=False, weight_decay=0.0, seed=0, width=8, **kwargs):
    torch.manual_seed(seed)
    model = DigitsCNN(width=width)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, nesterov=nesterov,
                          weight_decay=weight_decay)
    kwargs.setdefault("fusion", NaivePlanner(capacity_bytes=4096))
    opt = saf.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), min_selected=0, **kwargs)
    return model, opt


def backward(model, step):
    x, y, _, _ = DATA
    sl = slice(step * 64, (step + 1) * 64)
    F.cross_entropy(model(x[sl]), y[sl]).backward()


@pytest.mark.parametrize("nesterov,weight_decay", [(False, 0.0), (True, 0.0), (False, 5e-4)])
def test_momentum_correction_conserves_and_masks(hvd, nesterov, weight_decay):
    """Per parameter and step: u_t = m·u_{t−1} + g + wd·w, the residual gains u_t (Nesterov:
    g + wd·w + m·u_t), ``residual_after + sent == residual_before + u_t`` exactly, u is cleared
    exactly where the step sent, and ``.grad`` holds ``(1 − m)·sent`` (the gradient's scale)."""
    model, opt = make(nesterov=nesterov, weight_decay=weight_decay, compressor="topk", density=0.05,
                      momentum_correction=True)
    m = 0.9
    names = dict(model.named_parameters())
    ctl = opt.controller
    sent_somewhere = 0
    for step in range(5):
        before = {n: opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in names.items()}
        u_before = {n: ctl.momentum.momentum(n).clone() for n in names}
        weights = {n: p.detach().view(-1).clone() for n, p in names.items()}
        opt.zero_grad()
        backward(model, step)
        grads = {n: p.grad.detach().view(-1).clone() for n, p in names.items()}
        opt.synchronize()
        for n, p in names.items():
            d = grads[n] if weight_decay == 0 else torch.add(grads[n], weights[n], alpha=weight_decay)
            u = torch.add(d, u_before[n], alpha=m)
            increment = torch.add(d, u, alpha=m) if nesterov else u
            after = opt.residuals.get(n, p.grad.view(-1))
            picked = p.grad.view(-1) != 0
            total = before[n] + increment
            sent = torch.where(picked, total, torch.zeros_like(total))  # what the residual released
            assert torch.equal(after + sent, total), f"{n}: mass lost at step {step}"
            assert torch.equal(p.grad.view(-1), sent * (1 - m)), f"{n}: .grad is not (1 − m)·sent"
            u_after = ctl.momentum.momentum(n)
            assert torch.equal(u_after[picked], torch.zeros_like(u_after[picked])), f"{n}: not masked"
            assert torch.equal(u_after[~picked], u[~picked]), f"{n}: momentum changed where nothing was sent"
            sent_somewhere += int(picked.sum())
        with opt.skip_synchronize():
            opt.step()
        for g in opt.param_groups:  # the user's values are back after the step
            assert g["momentum"] == m and g["weight_decay"] == weight_decay and g["nesterov"] == nesterov
    assert sent_somewhere > 0


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.just(0.0), st.floats(2.0 ** -20, 2.0 ** 20, width=32),
                                 st.floats(-(2.0 ** 20), -(2.0 ** -20), width=32)),
                       min_size=1, max_size=400),
       exponent=st.integers(-10, 10))  # no square underflows or overflows in float32
def test_concentration_is_0_for_equal_magnitudes_1_for_one_element_and_free_of_scale(values, exponent):
    g = torch.tensor(values, dtype=torch.float32)
    c = concentration(g)
    if not g.any():
        assert c is None  # nothing to decide by
        return
    assert -1e-6 <= c <= 1 + 1e-6
    assert concentration(g * 2.0 ** exponent) == c  # a power of two scales every square exactly
    flat = torch.full_like(g, 3.0) * torch.sign(g).where(g != 0, torch.ones_like(g))
    assert concentration(flat) == pytest.approx(0.0, abs=1e-6)
    one = torch.zeros(g.numel() + 1)
    one[len(values) // 2] = -5.0
    assert concentration(one) == (0.0 if one.numel() == 1 else 1.0)
    assert concentration(torch.full_like(g, float("nan"))) is None


def test_concentration_of_a_large_tensor_is_read_on_a_sample_that_keeps_the_decision():
    """A tensor larger than the sample: a Gaussian stays spread (its largest 1 % hold about 8 %
    of the squared norm), and one whose squared norm sits in 1 % of its elements, scattered as a
    batch's rows of an embedding are, stays concentrated."""
    n = 7 * CONCENTRATION_SAMPLE + 5
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(n, generator=gen)
    assert concentration(spread) < 0.1
    rows = torch.randperm(n // 100, generator=gen)[: n // 10_000]  # 1 % of 100-element rows
    concentrated = torch.randn(n, generator=gen) * 1e-3
    concentrated.view(-1)[: n // 100 * 100].view(-1, 100)[rows] += 1.0
    assert concentration(concentrated) > CONCENTRATED


def word_model_and_batches(capacity: int):
    """The examples' LSTM word model, small, on the standard library's source, under the
    default's momentum correction with every tensor sparsified in buffers of ``capacity`` bytes."""
    ids, itos = stdlib_corpus(vocab=1000, max_chars=300_000)
    torch.manual_seed(0)
    model = LSTMLanguageModel(len(itos), embed=32, hidden=32, layers=1, dropout=0.0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt = saf.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compressor="topk",
                                   density=0.05, min_selected=0, dense_share=0,
                                   fusion=NaivePlanner(capacity_bytes=capacity))
    windows = ids[:4 * 16 * 21].view(4, 16, 21)
    return model, opt, windows, len(itos)


@pytest.mark.parametrize("capacity", [1 << 22, 4096])  # one buffer of every tensor; about a buffer per tensor
def test_masking_by_tensor_keeps_the_momentum_of_concentrated_gradients(hvd, capacity):
    """The default's masking (``"auto"``): each tensor is decided by its first gradient; the word
    model's embedding and decoder, whose gradients concentrate in a few rows, keep ``u`` where a
    step sent, while its spread recurrent weights have ``u`` cleared exactly there; in every
    tensor ``residual_after + sent == residual_before + u`` exactly, and the decisions travel in
    the checkpoint."""
    model, opt, windows, vocab = word_model_and_batches(capacity)
    m = 0.9
    names = dict(model.named_parameters())
    momentum = opt.local_momentum
    assert opt.momentum_correction is True and momentum.masking == "auto"
    sparse_steps = 0
    for step, batch in enumerate(windows):
        before = {n: opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in names.items()}
        u_before = {n: momentum.momentum(n).clone() for n in names}
        opt.zero_grad()
        F.cross_entropy(model(batch[:, :-1]).reshape(-1, vocab), batch[:, 1:].reshape(-1)).backward()
        grads = {n: p.grad.detach().view(-1).clone() for n, p in names.items()}
        if step == 0:
            expected = {n: concentration(g) < CONCENTRATED for n, g in grads.items()}
        opt.synchronize()
        assert momentum.masked == expected
        sparse_steps += opt.last_stats.density < 1
        for n, p in names.items():
            u = torch.add(grads[n], u_before[n], alpha=m)
            picked = p.grad.view(-1) != 0
            total = before[n] + u
            sent = torch.where(picked, total, torch.zeros_like(total))
            assert torch.equal(opt.residuals.get(n, p.grad.view(-1)) + sent, total), f"{n}: mass lost"
            kept = torch.where(picked, torch.zeros_like(u), u) if expected[n] else u
            assert torch.equal(momentum.momentum(n), kept), f"{n}: masked {expected[n]}, u is wrong"
        with opt.skip_synchronize():
            opt.step()
    assert sparse_steps >= 2
    assert not expected["encoder.weight"] and not expected["decoder.weight"]  # rows of frequent tokens
    assert expected["lstm.weight_ih_l0"]
    saved = opt.state_dict()
    _, resumed, _, _ = word_model_and_batches(capacity)
    resumed.load_state_dict(saved)
    assert resumed.local_momentum.masked == expected


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e38])
def test_momentum_correction_keeps_u_where_the_gradient_is_not_finite(hvd, bad):
    """A gradient element that is not finite leaves u as it was there (u elsewhere advances), the
    step arrives as NaN, and no residual takes a NaN. ``3e38`` is finite but the tensor's sum
    overflows: the masked path then gives what the unmasked one would."""
    model, opt = make(compressor="topk", density=0.05, momentum_correction=True, momentum_masking=False)
    names = dict(model.named_parameters())
    ctl = opt.controller
    for step in range(2):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    name = max(names, key=lambda n: names[n].numel())
    p = names[name]
    u_before = ctl.momentum.momentum(name).clone()
    opt.zero_grad()
    mask = torch.zeros(p.numel(), dtype=torch.bool)
    mask[:2] = True
    hook = p.register_hook(lambda g: torch.where(mask.view(g.shape), torch.full_like(g, bad), g))
    backward(model, 2)  # the hook puts `bad` into the gradient before the plugin's hook reads it
    hook.remove()
    grad = p.grad.detach().view(-1).clone()
    opt.synchronize()
    u_after = ctl.momentum.momentum(name)
    expected = torch.add(grad, u_before, alpha=0.9)
    if math.isfinite(bad):
        assert torch.equal(u_after, expected)
    else:
        assert torch.equal(u_after[:2], u_before[:2]), "u changed where the gradient was not finite"
        assert torch.equal(u_after[2:], expected[2:])
        assert torch.isnan(p.grad).all(), "a non-finite step must arrive as NaN"
        for n in names:
            assert torch.isfinite(opt.residuals.get(n, names[n].detach().view(-1))).all(), n
    with opt.skip_synchronize():
        opt.step()


@pytest.mark.parametrize("nesterov,technique", [(False, {"momentum_correction": True}),
                                                 (True, {"momentum_correction": True}),
                                                 (False, {"error_feedback": "ef21-sgdm"})])
def test_taking_over_the_momentum_at_density_1_is_sgd_with_momentum(hvd, nesterov, technique):
    """Everything sent (dense, no masking), with DGC's momentum correction or EF21-SGDM: the same
    trajectory as the wrapped SGD's own momentum, to float rounding (the order of additions
    differs)."""
    ref_model, ref = make(nesterov=nesterov, weight_decay=1e-3, compressor="none", fusion="horovod")
    model, opt = make(nesterov=nesterov, weight_decay=1e-3, compressor="topk", density=1.0, **technique)
    for step in range(6):
        for mdl, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            backward(mdl, step)
            o.step()
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{n} diverged")
    if "momentum_correction" in technique:  # EF21-SGDM's estimate is the SGD's buffer
        assert all(not opt.state[p] for p in model.parameters())  # SGD kept no momentum buffer of its own


def test_momentum_correction_leaves_the_gradient_scale_for_a_clip_after_synchronize(hvd):
    """Horovod's clipping recipe (clip between ``synchronize()`` and ``step()``) under momentum
    correction: ``.grad`` holds the aggregate momentum times ``1 − m``, so at density 1 the clip
    bounds what it bounds without the plugin — the norm of the current step's momentum times
    ``1 − m`` — and a bound above that norm changes nothing: the run stays SGD with momentum."""
    m = 0.9
    ref_model, ref = make(compressor="none", fusion="horovod")
    model, opt = make(compressor="topk", density=1.0, momentum_correction=True)
    for step in range(4):
        for mdl, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            backward(mdl, step)
            o.synchronize()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        momenta = torch.cat([opt.local_momentum.momentum(n) for n, _ in model.named_parameters()])
        assert math.isclose(norm, (1 - m) * float(momenta.norm()), rel_tol=1e-5)
        for o in (ref, opt):
            with o.skip_synchronize():
                o.step()
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{n} diverged")
    for g in opt.param_groups:  # the step's lr/(1 − m) is not left behind
        assert g["lr"] == ref.param_groups[0]["lr"]


def test_momentum_correction_needs_sgd_with_momentum(hvd):
    torch.manual_seed(0)
    model = DigitsCNN(width=4)
    with pytest.raises(ValueError, match="every parameter group has momentum=0"):
        saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), momentum_correction=True)
    with pytest.raises(ValueError, match="got Adam"):
        saf.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                 named_parameters=model.named_parameters(), momentum_correction=True)
    with pytest.raises(ValueError, match="dampening=0.1"):
        saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1),
                                 named_parameters=model.named_parameters(), momentum_correction=True)


def test_momentum_survives_a_new_plan_and_a_checkpoint(hvd):
    model, opt = make(compressor="dgc", density=0.05, momentum_correction=True)
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    ctl = opt.controller
    momenta = {n: ctl.momentum.momentum(n).clone() for n, _ in model.named_parameters()}
    assert any(u.abs().sum() > 0 for u in momenta.values())
    opt.set_plan(saf.FusionPlan([[n] for n in opt.plan.names], order="ahead", planner="per-tensor"))
    for n, u in momenta.items():
        assert torch.equal(ctl.momentum.momentum(n), u)
    state = opt.state_dict()
    model2, opt2 = make(compressor="dgc", density=0.05, momentum_correction=True)
    opt2.load_state_dict(state)
    for n, u in momenta.items():
        assert torch.equal(opt2.local_momentum.momentum(n), u)


def test_local_clipping_bounds_each_tensor(hvd):
    """With a bound far below the gradients' norms, each tensor enters error feedback at norm
    max_norm / sqrt(workers) (one worker here): the residual plus what was sent is that."""
    ref, _ = make(momentum=0.0, compressor="none", fusion="horovod")
    backward(ref, 0)
    norms = {n: float(p.grad.norm()) for n, p in ref.named_parameters()}
    model, opt = make(momentum=0.0, compressor="topk", density=0.05, local_clipping=1e-3)
    opt.zero_grad()
    backward(model, 0)
    opt.synchronize()
    clipped = 0
    for n, p in model.named_parameters():
        total = float((opt.residuals.get(n, p.grad.view(-1)) + p.grad.view(-1)).norm())
        if norms[n] > 1e-3:
            assert math.isclose(total, 1e-3, rel_tol=1e-3), n
            clipped += 1
        else:
            assert math.isclose(total, norms[n], rel_tol=1e-3, abs_tol=1e-9), n
    assert clipped > 0
    with pytest.raises(ValueError, match="local_clipping must be a positive finite norm"):
        make(local_clipping=-1.0)


def test_warmup_schedules():
    w = DensityWarmup(100, "exponential", 0.001)
    stages = [w.density_at(s) for s in range(0, 100, 25)]
    assert stages == pytest.approx([0.001 ** ((i + 1) / (STAGES + 1)) for i in range(STAGES)])
    assert stages[0] == pytest.approx(0.251, abs=1e-3) and stages[-1] == pytest.approx(0.00398, abs=1e-5)
    assert w.density_at(24) == w.density_at(0) and w.density_at(100) == 0.001
    d = DensityWarmup(10, "dense", 0.01)
    assert [d.density_at(s) for s in (0, 9, 10)] == [1.0, 1.0, 0.01]
    with pytest.raises(ValueError, match="warmup_schedule='linear' is not a schedule; accepted: 'exponential', 'dense'"):
        DensityWarmup(10, "linear", 0.01)
    with pytest.raises(ValueError, match="warmup_steps must be a non-negative int"):
        DensityWarmup(-1, "dense", 0.01)


@pytest.mark.parametrize("schedule", ["exponential", "dense"])
def test_warmup_sends_more_then_the_target(hvd, schedule):
    """The measured density follows the schedule, dense steps go through Horovod's allreduce with
    the residual sent along, and after warm-up the target density is back."""
    model, opt = make(compressor="topk", density=0.01, warmup_steps=8, warmup_schedule=schedule)
    w = DensityWarmup(8, schedule, 0.01)
    seen = []
    for step in range(10):
        opt.zero_grad()
        backward(model, step)
        opt.step()
        seen.append(opt.last_stats.density)
        if w.density_at(step) < 1:
            assert seen[-1] == pytest.approx(w.density_at(step), rel=0.5)
        else:
            assert seen[-1] == 1.0 and not any(r.abs().sum() for r in opt.residuals.state_dict().values())
    assert seen[-1] < 0.02 and opt.compressor.density == 0.01
    assert opt.state_dict()["safusion"]["density"] == 0.01


@pytest.mark.parametrize("build,on,masking", [
    (dict(compressor="dgc", density=0.05), True, "auto"),  # SGD with momentum, sparse: on, masking by tensor
    (dict(compressor="dgc", density=0.05, momentum_masking="auto"), True, "auto"),
    (dict(compressor="dgc", density=0.05, momentum_correction=True), True, True),  # DGC's masking
    (dict(compressor="dgc", density=0.05, momentum_correction=True, momentum_masking=False), True, False),
    (dict(compressor="dgc", density=0.05, momentum_masking=True), True, True),
    (dict(compressor="dgc", density=0.05, momentum_correction=False), False, None),
    (dict(compressor="dgc", density=1.0), False, None),  # nothing waits
    (dict(compressor="exdyna", density=0.05), False, None),  # ExDyna keeps its paper's error feedback
    (dict(compressor="none", fusion="horovod"), False, None),
    (dict(compressor="dgc", density=0.05, error_feedback="ef21-sgdm"), False, None),
    (dict(compressor="dgc", density=0.05, momentum=0.0), False, None),
])
def test_momentum_correction_auto_is_on_for_sgd_with_momentum_and_sparse_gradients(hvd, build, on, masking):
    kw = dict(build)
    model, opt = make(momentum=kw.pop("momentum", 0.9), **kw)
    assert opt.momentum_correction is on
    momentum = opt.local_momentum
    if on:
        assert momentum.masking == masking and type(momentum.masking) is type(masking)
    elif "error_feedback" not in build:
        assert momentum is None


def test_momentum_correction_auto_leaves_other_optimizers_alone_and_rejects_bad_values(hvd):
    torch.manual_seed(0)
    model = DigitsCNN(width=4)
    opt = saf.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                                   compressor="dgc", density=0.05)
    assert opt.momentum_correction is False and opt.local_momentum is None
    with pytest.raises(ValueError, match=r"momentum_correction must be True, False or 'auto', got 'on'"):
        saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=model.named_parameters(), momentum_correction="on")
    with pytest.raises(ValueError, match=r"momentum_masking must be True, False, 'auto' or None \(the default\), "
                                         r"got 'sometimes'"):
        saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=model.named_parameters(), momentum_masking="sometimes")


def clipped_steps(pairs, steps, max_norm=0.05, start=0):
    """Horovod's clipping recipe on each ``(model, optimizer)``: ``synchronize()``, clip,
    ``step()`` under ``skip_synchronize()``."""
    for step in range(start, start + steps):
        for mdl, o in pairs:
            o.zero_grad()
            backward(mdl, step)
            o.synchronize()
            torch.nn.utils.clip_grad_norm_(mdl.parameters(), max_norm)
            with o.skip_synchronize():
                o.step()


@pytest.mark.parametrize("nesterov,weight_decay", [(False, 0.0), (True, 0.0), (False, 1e-3)])
def test_momentum_correction_auto_turns_off_where_the_script_clips(hvd, nesterov, weight_decay):
    """Under DGC's correction a clip after ``synchronize()`` bounds the aggregate of accumulated
    momenta, not each step's gradient: with a bound that binds, the run's dense steps were several
    times Horovod's. ``"auto"`` sees the clip at the first step and turns the correction off, so
    the dense steps (critical intervals) are Horovod's, clip and momentum included, to rounding;
    the momentum planes are freed and a checkpoint keeps the decision."""
    kw = dict(nesterov=nesterov, weight_decay=weight_decay)
    ref_model, ref = make(compressor="none", fusion="horovod", **kw)
    model, opt = make(compressor="dgc", density=0.05, dense=False, critical_regimes=10, **kw)
    assert opt.momentum_correction is True
    clipped_steps([(ref_model, ref), (model, opt)], 6)
    assert opt.momentum_correction is False and opt.local_momentum is None
    assert all(buf.momentum is None for buf in opt.controller.buffers)
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{n} is not Horovod's")
    state = copy.deepcopy((model.state_dict(), opt.state_dict()))  # as if saved to a file
    model2, opt2 = make(compressor="dgc", density=0.05, dense=False, critical_regimes=10, **kw)
    model2.load_state_dict(state[0])
    opt2.load_state_dict(state[1])
    assert opt2.momentum_correction is False
    clipped_steps([(model, opt), (model2, opt2)], 3, start=6)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), f"{n}: the resumed run differs"


@pytest.mark.parametrize("explicit", [False, True])
def test_momentum_correction_auto_stays_on_where_the_script_leaves_the_gradients(hvd, explicit):
    """Without a change between ``synchronize()`` and ``step()`` (reading the gradients is no
    change) ``"auto"`` keeps the correction, and its first step is DGC's: with everything sent,
    SGD with momentum, to rounding."""
    ref_model, ref = make(compressor="none", fusion="horovod", weight_decay=1e-3)
    model, opt = make(compressor="dgc", density=0.05, dense=False, critical_regimes=10, weight_decay=1e-3)
    for step in range(4):
        for mdl, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            backward(mdl, step)
            if explicit:
                o.synchronize()
                float(sum(p.grad.norm() for p in mdl.parameters()))
                with o.skip_synchronize():
                    o.step()
            else:
                o.step()
    assert opt.momentum_correction is True and opt.local_momentum is not None
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{n} diverged")


def test_after_a_clip_turned_the_correction_off_sparse_steps_conserve_the_gradient(hvd):
    """Forced sparse from the first step: once ``"auto"`` has seen the clip, the residual gains
    the bare gradient, and ``residual_after + sent == residual_before + gradient`` exactly, per
    parameter, as under classic error feedback."""
    model, opt = make(compressor="topk", density=0.05, dense=False, weight_decay=1e-3)
    names = dict(model.named_parameters())
    clipped_steps([(model, opt)], 1)
    assert opt.momentum_correction is False
    for step in range(1, 4):
        before = {n: opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in names.items()}
        opt.zero_grad()
        backward(model, step)
        grads = {n: p.grad.detach().view(-1).clone() for n, p in names.items()}
        opt.synchronize()
        for n, p in names.items():
            sent = p.grad.view(-1)
            assert torch.equal(opt.residuals.get(n, sent) + sent, before[n] + grads[n]), f"{n}: step {step}"
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
