"""Exact error-feedback conservation per parameter, through the real optimizer and hooks.

In a one-worker Horovod job the aggregated gradient equals what this rank sent, so for every
parameter and step ``residual_after + sent == residual_before + grad`` can be checked exactly,
with real gradients of a real CNN on real data (scikit-learn's digits).
"""
import pytest
import torch
import torch.nn.functional as F

import horovod_safusion as saf
from horovod_safusion.fusion import NaivePlanner
from digits import DigitsCNN, load_digits_split


def run_steps(hvd, steps=4, min_selected=0, **kwargs):
    torch.manual_seed(0)
    x, y, _, _ = load_digits_split()
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), min_selected=min_selected, **kwargs)
    names = dict(model.named_parameters())
    for step in range(steps):
        before = {n: opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in names.items()}
        opt.zero_grad()
        F.cross_entropy(model(x[step * 64:(step + 1) * 64]), y[step * 64:(step + 1) * 64]).backward()
        grads = {n: p.grad.detach().view(-1).clone() for n, p in names.items()}
        opt.synchronize()
        for n, p in names.items():
            sent = p.grad.view(-1)
            after = opt.residuals.get(n, sent)
            expected = before[n] + grads[n]
            assert torch.equal(after + sent, expected), f"{n}: mass lost at step {step}"
        yield opt, model, grads
        with opt.skip_synchronize():
            opt.step()


@pytest.mark.parametrize("compressor,density,fusion", [
    ("topk", 0.01, "safusion-naive"), ("dgc", 0.01, "safusion-naive"), ("dgc", 0.05, "behind"),
    ("topk", 1.0, "safusion-naive"), ("gaussiank", 0.01, "safusion-naive"), ("redsync", 0.01, "safusion-naive"),
    ("sidco", 0.01, "safusion-naive"), ("exdyna", 0.01, "safusion-naive"), ("randomk", 0.01, "safusion-naive"),
    ("exdyna", 0.05, "behind")])
def test_conservation_per_parameter(hvd, compressor, density, fusion):
    planner = NaivePlanner(capacity_bytes=4096, order="behind" if fusion == "behind" else "ahead")
    for opt, model, _ in run_steps(hvd, compressor=compressor, density=density, fusion=planner):
        stats = opt.last_stats
        assert stats.tensors == len(list(model.parameters()))
        assert stats.buffers == len(opt.plan.buffers) > 1
        if density < 1 and fusion != "behind":
            assert stats.missing == 0  # sparsification ahead: no tensor goes missing
            if compressor != "exdyna":  # ExDyna's threshold scaling settles over many steps
                assert 0 < stats.density < 4 * density


def test_small_tensors_go_dense_beside_sparse_buffers(hvd):
    """With the floor on (``min_selected``), tensors that would send fewer elements go whole in a
    dense buffer of their own, with no residual, while the others stay sparse: conservation holds
    for both (checked by run_steps), and a small tensor's gradient arrives unchanged."""
    small = None
    for opt, model, grads in run_steps(hvd, min_selected=64, compressor="topk", density=0.05,
                                       fusion=NaivePlanner(capacity_bytes=4096)):
        plan = opt.plan
        small = [n for i in plan.dense_buffers for n in plan.buffers[i]]
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        assert small == [n for n in plan.names if n in small] and len(plan.dense_buffers) == 1
        assert sorted(small) == sorted(n for n in sizes if -(-0.05 * sizes[n] // 1) < 64)
        assert 0 < len(small) < len(sizes)
        for n, p in model.named_parameters():
            if n in small:
                assert torch.equal(p.grad.view(-1), grads[n]) and opt.residuals.peek(n) is None
    assert small


def test_dense_compressor_sends_the_gradient_unchanged(hvd):
    for opt, model, grads in run_steps(hvd, steps=2, compressor="none"):
        for n, p in model.named_parameters():
            assert torch.equal(p.grad.view(-1), grads[n])
        assert opt.communicator.name == "allreduce"
        assert opt.last_stats.bytes_sent == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("path", ["host", "torch", "triton"])
def test_a_frozen_layer_keeps_its_residual_and_moves_by_nothing(hvd, path, paths):
    """A conv layer frozen at step 2 and unfrozen at step 5, and a step() without backward at step
    3 (SGD with momentum, classic error feedback): what got no gradient moves by nothing and keeps its residual bit for
    bit, and the kept residual joins the gradient once the layer is unfrozen —
    ``residual_after + sent == residual_before + grad`` exactly, every parameter, every step (one
    worker: what is sent arrives unscaled), on the host path and on the device path."""
    if path != "host":
        if path == "triton":
            pytest.importorskip("triton")
        paths(device_path=True, kernels_=path)
    torch.manual_seed(0)
    x, y, _, _ = load_digits_split()
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), min_selected=0, compressor="dgc", density=0.05,
                                   fusion=NaivePlanner(capacity_bytes=4096), momentum_correction=False)
    named = dict(model.named_parameters())
    frozen = [n for n in named if n.startswith("features.3.")]
    for step in range(6):
        for n in frozen:
            named[n].requires_grad_(not 2 <= step < 5)
        still = frozen if 2 <= step < 5 and step != 3 else list(named) if step == 3 else []
        opt.zero_grad()
        before = {n: opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in named.items()}
        values = {n: p.detach().clone() for n, p in named.items()}
        if step != 3:
            F.cross_entropy(model(x[step * 64:(step + 1) * 64]), y[step * 64:(step + 1) * 64]).backward()
        grads = {n: torch.zeros(p.numel()) if p.grad is None else p.grad.view(-1).clone() for n, p in named.items()}
        opt.synchronize()
        for n, p in named.items():
            sent = torch.zeros(p.numel()) if p.grad is None else p.grad.view(-1)
            assert torch.equal(opt.residuals.get(n, sent) + sent, before[n] + grads[n]), (n, step)
        for n in still:
            assert named[n].grad is None and torch.equal(opt.residuals.get(n, values[n].view(-1)), before[n]), (n, step)
        with opt.skip_synchronize():
            opt.step()
        for n in still:
            assert torch.equal(named[n].detach(), values[n]), (n, step)
    assert any(float(before[n].abs().sum()) > 0 for n in frozen)  # a residual was kept, and delivered at step 5
