"""EF21-SGDM (Fatkhullin, Tyurin and Richtárik, NeurIPS'23, Algorithm 1) through the real
optimizer in a one-worker Horovod job: exact conservation of what joins the residual, the local
momentum, the wrapped SGD's buffer as the sum of what was sent, bit-identical resume, and clear
errors (SGD with momentum at density 1: ``test_dgc_techniques``)."""
import pytest
import torch

import horovod_safusion as saf
from digits import DigitsCNN
from test_dgc_techniques import backward, make as make_sgd

M = 0.9


def make(**kwargs):
    """A digits CNN and its optimizer as the DGC tests make them, with EF21-SGDM by default."""
    kwargs.setdefault("error_feedback", "ef21-sgdm")
    return make_sgd(momentum=kwargs.pop("momentum", M), **kwargs)


@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_ef21_sgdm_conserves_and_sums_what_was_sent(hvd, weight_decay):
    """Per parameter and step: ``u`` moves by its increment ``δ = g + wd·w − (1 − m)·u``,
    ``residual_after + sent == residual_before + δ`` exactly, and the wrapped SGD's momentum
    buffer (momentum 1 during the step) gains exactly what was sent, so that the parameter moves
    by ``lr`` times that buffer; the groups keep the user's values."""
    model, opt = make(weight_decay=weight_decay, compressor="topk", density=0.05)
    names = dict(model.named_parameters())
    ctl = opt.controller
    for step in range(5):
        before = {n: opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in names.items()}
        u_before = {n: ctl.momentum.momentum(n).clone() for n in names}
        weights = {n: p.detach().view(-1).clone() for n, p in names.items()}
        buffers = {n: opt.state[p]["momentum_buffer"].view(-1).clone() if opt.state[p] else torch.zeros_like(weights[n])
                   for n, p in names.items()}
        opt.zero_grad()
        backward(model, step)
        grads = {n: p.grad.detach().view(-1).clone() for n, p in names.items()}
        opt.synchronize()
        sent = {n: p.grad.detach().view(-1).clone() for n, p in names.items()}
        for n in names:
            d = grads[n] if weight_decay == 0 else torch.add(grads[n], weights[n], alpha=weight_decay)
            delta = torch.add(d, u_before[n], alpha=M - 1)
            after = opt.residuals.get(n, sent[n])
            assert torch.equal(after + sent[n], before[n] + delta), f"{n}: mass lost at step {step}"
            assert torch.equal(ctl.momentum.momentum(n), u_before[n] + delta), f"{n}: u at step {step}"
        with opt.skip_synchronize():
            opt.step()
        for n, p in names.items():
            buf = opt.state[p]["momentum_buffer"].view(-1)
            assert torch.equal(buf, buffers[n] + sent[n]) if step else torch.equal(buf, sent[n]), n
            torch.testing.assert_close(p.detach().view(-1), weights[n] - 0.1 * buf, rtol=0, atol=1e-7)
        for g in opt.param_groups:
            assert g["momentum"] == M and g["weight_decay"] == weight_decay and g["nesterov"] is False
    assert any(float(opt.residuals.get(n, p.detach().view(-1)).abs().sum()) > 0 for n, p in names.items())


def test_ef21_sgdm_resumes_bit_for_bit(hvd, tmp_path):
    """A checkpoint (model, the optimizer with its momentum ``u``, residuals and the SGD's buffer)
    taken mid-run continues exactly as the run that was not interrupted."""
    model, opt = make(compressor="dgc", density=0.05)
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    for step in range(3, 6):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    resumed, opt2 = make(compressor="dgc", density=0.05, seed=1)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for step in range(3, 6):
        opt2.zero_grad()
        backward(resumed, step)
        opt2.step()
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("sgd,kwargs,says", [
    (dict(momentum=0.0), {}, "needs the wrapped SGD's momentum"),
    (dict(nesterov=True), {}, "does not support nesterov=True"),
    ({}, dict(momentum_correction=True), "cannot be combined with momentum_correction=True"),
    ({}, dict(error_feedback="ef21"), "error_feedback must be one of 'classic', 'ef21-sgdm', got 'ef21'"),
])
def test_ef21_sgdm_rejects_what_it_cannot_run(hvd, sgd, kwargs, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        make(compressor="dgc", density=0.05, **sgd, **kwargs)


def test_ef21_sgdm_needs_sgd(hvd):
    model = DigitsCNN(width=8)
    with pytest.raises(ValueError, match=r'error_feedback="ef21-sgdm" takes over the momentum of torch.optim.SGD'):
        saf.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                                 error_feedback="ef21-sgdm")
