"""The step's flags carried in its last dense buffer (:mod:`horovod_safusion.stages.flags`).

Horovod runs a step's collectives one after another, so the flags' own allreduce costs every
step a pass round the ranks after the buffers'. Where the last buffer goes dense, the flags ride
in its allreduce, and their own allreduce runs only on a step where some rank has something to
tell. One-worker Horovod jobs (real collectives); the collectives submitted are watched by
wrapping Horovod's ``allreduce_async`` and ``grouped_allreduce_async_``, which still run. The
multi-worker cases (a parameter used on one rank only, non-finite gradients, joining
parameters) are in ``tests/multiproc``.
"""
import pytest
import torch
import torch.nn.functional as F

import horovod_safusion as saf
from horovod_safusion.fusion import NaivePlanner
from digits import DigitsCNN, load_digits_split
from test_dgc_techniques import backward, make


@pytest.fixture
def groups(hvd, monkeypatch):
    """The allreduces submitted, in order, as (name, the tensors of the call) (Horovod's
    functions still run)."""
    calls: list[tuple[str, list[torch.Tensor]]] = []
    for fn in ("allreduce_async", "grouped_allreduce_async_"):
        real = getattr(hvd, fn)

        def watched(tensors, *args, _real=real, **kwargs):
            calls.append((kwargs.get("name") or "", list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]))
            return _real(tensors, *args, **kwargs)
        monkeypatch.setattr(hvd, fn, watched)
    return calls


def steps(opt, model, count, frozen=None):
    """``count`` steps of the digits CNN; ``frozen``: a parameter that gets no gradient."""
    x, y, _, _ = load_digits_split()
    for step in range(count):
        if frozen is not None:
            frozen.requires_grad_(False)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32]).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.synchronize()
        yield grads
        with opt.skip_synchronize():
            opt.step()


def flags_allreduces(groups) -> int:
    return sum(n.split("~")[0] == "saf.step" for n, _ in groups)  # (~N: an elastic session's suffix)


def carried(groups) -> int:
    return sum(n.split("~")[0].endswith(".rider") for n, _ in groups)


def test_a_dense_step_carries_the_flags_and_sends_no_allreduce_of_its_own(groups):
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compressor="none", fusion=NaivePlanner(capacity_bytes=4096))
    assert len(opt.plan.buffers) > 1
    for grads in steps(opt, model, 3):
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, grads[n])  # one worker: the gradient unchanged, rider or not
    assert flags_allreduces(groups) == 0 and carried(groups) == 3  # one rider a step


def test_a_parameter_without_a_gradient_sends_the_flags_allreduce_and_stays_without_one(groups):
    """A parameter that got no gradient on some rank: the carried sum is not zero, so the flags'
    own allreduce runs (the maximum over ranks, exact), and a gradient that arrived nowhere is
    left as ``zero_grad()`` left it, as Horovod leaves it."""
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compressor="none", fusion=NaivePlanner(capacity_bytes=4096))
    frozen = next(iter(model.parameters()))
    for grads in steps(opt, model, 2, frozen=frozen):
        assert frozen.grad is None
        assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if p is not frozen)
    assert flags_allreduces(groups) == 2 and carried(groups) == 2


def test_a_sparse_step_whose_last_buffer_holds_the_small_tensors_carries_the_flags(groups):
    """A sparse plan sends its small tensors whole in a dense buffer after the sparse ones; that
    buffer carries the flags, and the sparse buffers conserve their mass as before."""
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compressor="topk", density=0.05, min_selected=64,
                                   fusion=NaivePlanner(capacity_bytes=4096))
    plan = opt.plan
    assert plan.dense_buffers == (len(plan.buffers) - 1,)
    for _ in steps(opt, model, 3):
        assert opt.last_stats.density < 1
    assert flags_allreduces(groups) == 0 and carried(groups) == 3


def test_a_sparse_last_buffer_keeps_the_flags_allreduce(groups):
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compressor="topk", density=0.05, min_selected=0,
                                   fusion=NaivePlanner(capacity_bytes=4096))
    assert not opt.plan.dense_buffers
    for _ in steps(opt, model, 2):
        pass
    assert flags_allreduces(groups) == 2 and carried(groups) == 0


def test_a_last_buffer_of_one_gradient_in_float32_keeps_the_flags_allreduce(groups):
    """A group of one gradient and the flags would go through Horovod's fusion buffer (a copy of
    the gradient in and out, and as much memory), where one tensor alone is reduced in place:
    such a buffer goes alone, and the flags' own allreduce runs."""
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compressor="none", fusion=NaivePlanner(capacity_bytes=1))
    assert len(opt.controller.buffers[-1].names) == 1
    for _ in steps(opt, model, 2):
        pass
    assert flags_allreduces(groups) == 2 and carried(groups) == 0
    assert all(len(tensors) == 1 for name, tensors in groups if name.startswith("saf.ar."))


def test_a_float16_critical_step_carries_the_flags_in_a_spare_element_of_its_wire(groups):
    """A critical step's last buffer on the float16 wire holds the flags in one element more at
    its end: one tensor for Horovod, reduced in place; the gradients are the float16 rounding, the
    rounding error is the residual."""
    model, opt = make(momentum=0.0, compressor="topk", density=0.01, critical_regimes=3)
    opt.controller.regimes.half = True
    last = opt.controller.buffers[-1]
    named = list(model.named_parameters())
    for step in range(2):
        opt.zero_grad()
        backward(model, step)
        sent = {n: p.grad.detach().view(-1).clone() for n, p in named}
        opt.synchronize()
        assert opt.controller.mode.half and opt.last_stats.density == 1.0
        assert opt.last_stats.bytes_sent == 2 * sum(p.numel() for _, p in named)  # the flags are not payload
        for n, p in named:
            assert torch.equal(p.grad.view(-1), sent[n].half().float()), n
            assert torch.equal(opt.residuals.get(n, p.detach().view(-1)) + p.grad.view(-1), sent[n]), n
        with opt.skip_synchronize():
            opt.step()
    riders = [tensors for name, tensors in groups if name.split("~")[0].endswith(".rider")]
    assert flags_allreduces(groups) == 0 and len(riders) == 2
    assert all(len(t) == 1 and t[0].dtype == torch.float16 and t[0].numel() == last.numel + 1 for t in riders)
