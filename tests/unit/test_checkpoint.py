"""Checkpoints in a one-worker job: what they hold, how they load, and the clear failures."""
import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import horovod_safusion as saf
from horovod_safusion.checkpoint import decode, encode, redistribute
from horovod_safusion.compressors.state import PerSegment


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 3))


def train(m, opt, steps, first=0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        F.cross_entropy(m(torch.randn(8, 40, generator=g)), torch.randint(0, 3, (8,), generator=g)).backward()
        opt.step()


def make(m, **kw):
    kw.setdefault("compressor", "dgc")
    kw.setdefault("density", 0.05)
    kw.setdefault("critical_regimes", None)  # sparse from the first step: residuals to resume
    return saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=m.named_parameters(), min_selected=0, profile_steps=2, **kw)


def through_file(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True, torch's default


@pytest.mark.parametrize("compressor", ["dgc", "topk", "gaussiank", "redsync", "sidco", "randomk", "exdyna"])
def test_resume_through_a_weights_only_file_is_bit_identical(hvd, compressor):
    m = model()
    opt = make(m, compressor=compressor)
    train(m, opt, 5)
    ckpt = through_file({"model": m.state_dict(), "optimizer": opt.state_dict()})
    train(m, opt, 4, first=5)

    m2 = model(seed=1)
    opt2 = make(m2, compressor=compressor)
    m2.load_state_dict(ckpt["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(ckpt["optimizer"])
    assert opt2.plan == opt.plan and opt2.controller.steps == 5
    train(m2, opt2, 4, first=5)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_a_checkpoint_of_version_0_1_0_names_the_profiler_generator_and_still_resumes_exactly(hvd):
    m = model()
    opt = make(m)
    train(m, opt, 5)
    ckpt = through_file({"model": m.state_dict(), "optimizer": opt.state_dict()})
    saved = ckpt["optimizer"]["safusion"]
    saved["generator"] = saved.pop("profiler")  # as 0.1.0 wrote it
    train(m, opt, 4, first=5)

    m2 = model(seed=1)
    opt2 = make(m2)
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    assert opt2.plan == opt.plan and opt2.profile.to_dict() == opt.profile.to_dict()
    train(m2, opt2, 4, first=5)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_a_plain_horovod_checkpoint_loads_with_empty_residuals_and_a_warning(hvd):
    m = model()
    plain = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=m.named_parameters())
    train(m, plain, 2)
    opt = make(m)
    with pytest.warns(UserWarning, match="holds no horovod_safusion state"):
        opt.load_state_dict(plain.state_dict())
    assert opt.residuals.state_dict() == {}
    assert opt.state_dict()["state"].keys() == plain.state_dict()["state"].keys()


def test_another_compressor_or_density_starts_with_empty_residuals_and_a_warning(hvd):
    m = model()
    opt = make(m, compressor="topk", density=0.05)
    train(m, opt, 3)
    state = opt.state_dict()
    for kw in (dict(compressor="dgc", density=0.05), dict(compressor="topk", density=0.1)):
        other = make(model(), **kw)
        with pytest.warns(UserWarning, match="saved with compressor TopK at density 0.05"):
            other.load_state_dict(state)
        assert other.residuals.state_dict() == {}


def test_a_residual_that_does_not_fit_its_parameter_is_a_clear_error(hvd):
    m = model()
    opt = make(m, compressor="topk")
    train(m, opt, 2)
    state = opt.state_dict()
    name = next(iter(state["safusion"]["ranks"][0]["residuals"]))
    state["safusion"]["ranks"][0]["residuals"][name] = torch.zeros(7)
    with pytest.raises(ValueError, match=rf"residual for '{name}' has 7 elements; the parameter has \d+"):
        make(model(), compressor="topk").load_state_dict(state)


def test_state_round_trips_through_the_encoding():
    state = PerSegment(fill=0.5)
    state.of(("a", "b"))[:] = [1.0, 2.0]
    gen = torch.Generator().manual_seed(3)
    back = decode(through_file(encode({"per": state, "gen": gen, "array": np.arange(3.0), "n": np.int64(4)})))
    assert back["per"]["a"] == 1.0 and back["per"].of(("b",))[0] == 2.0 and back["per"].fill == 0.5
    assert torch.equal(back["gen"].get_state(), gen.get_state())
    assert back["array"].tolist() == [0.0, 1.0, 2.0] and back["n"] == 4
    with pytest.raises(TypeError, match="cannot checkpoint"):
        encode(object())


@settings(max_examples=50, deadline=None)
@given(old=st.integers(1, 6), new=st.integers(1, 6), seed=st.integers(0, 100))
def test_redistribution_keeps_every_residual_and_the_total(old, new, seed):
    g = torch.Generator().manual_seed(seed)
    residuals = {j: {"w": torch.randn(5, generator=g), "b": torch.randn(2, generator=g)} for j in range(old)}
    moved = [redistribute(residuals, old, new, r) for r in range(new)]
    for name in ("w", "b"):
        before = sum((residuals[j][name].double() for j in range(old)), torch.zeros(1, dtype=torch.float64))
        after = sum((m[name].double() for m in moved if name in m), torch.zeros(1, dtype=torch.float64))
        # merged residuals are added in float32: each addition rounds by at most half an ulp of
        # the partial sum, which is bounded by the sum of magnitudes
        magnitude = sum(residuals[j][name].double().abs() for j in range(old))
        assert torch.all((before - after).abs() <= old * torch.finfo(torch.float32).eps * magnitude)
    if new >= old:  # each old residual lands unchanged on one rank: the total is the same bits
        for j in range(old):
            assert torch.equal(moved[j]["w"], residuals[j]["w"])
