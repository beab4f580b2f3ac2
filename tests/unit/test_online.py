"""The online generator in a one-worker job: provisional plan, profile, switch, re-plan."""
import pytest
import torch
import torch.nn.functional as F

import horovod_safusion as saf
from horovod_safusion.fusion import Profile, SAFusionPlanner
from digits import DigitsCNN, load_digits_split


def train(opt, model, steps):
    x, y, _, _ = load_digits_split()
    seen = []
    for s in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x[32 * s:32 * (s + 1)]), y[32 * s:32 * (s + 1)]).backward()
        opt.step()
        seen.append((opt.plan.planner, opt.profile.meta["step"] if opt.profile else None))
    return seen


def test_profiles_once_by_default_and_replans_every_r_steps(hvd, tmp_path):
    torch.manual_seed(0)
    m = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   profile_steps=2, replan_every=5, critical_regimes=None)
    seen = train(opt, m, 10)
    # warm-up step 0, profiled steps 1-2, switch after step 2; profiled 6-7, re-planned after step 7
    assert [s[0] for s in seen] == ["provisional"] * 2 + ["safusion"] * 8
    assert [s[1] for s in seen] == [None, None] + [3] * 5 + [8] * 3
    p = opt.profile
    assert p.names[0] == "head.3.bias" and p.workers == 1 and p.meta["iterations"] == 2
    assert all(b >= a for a, b in zip(p.ready, p.ready[1:]))  # measured back-propagation order
    assert p.prefix > 0 and p.suffix > 0 and p.compress(1e6) > 0 and p.communicate(1e3) > 0

    # a saved profile plans at once, without profiling
    p.save(tmp_path / "p.json")
    m2 = DigitsCNN(width=8)
    opt2 = saf.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1), named_parameters=m2.named_parameters(),
                                    fusion=SAFusionPlanner(profile=Profile.load(tmp_path / "p.json")))
    assert opt2.plan.planner == "safusion" and not opt2.profiler.active
    assert [s[0] for s in train(opt2, m2, 2)] == ["safusion"] * 2


def test_the_profile_prices_the_fixed_work_of_a_buffer(hvd):
    # every tensor sparse: the provisional plan has a buffer per tensor, of 16 sizes
    torch.manual_seed(0)
    m = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   profile_steps=2, min_selected=0, critical_regimes=None)
    train(opt, m, 4)
    p = opt.profile
    assert p.meta["profiled_plan"] == "provisional"
    assert p.buffer_cost > 0  # starting a collective and decoding it: Python's work per buffer
    assert p.t_cp(p.names[:1]) > p.compress(p.dense_bytes(p.names[:1]))


def test_generator_arguments_are_checked(hvd):
    m = DigitsCNN(width=8)
    for kwargs, message in [(dict(profile_steps=0), "profile_steps must be >= 1, got 0"),
                            (dict(profile_steps=5, replan_every=5), "replan_every must be larger than profile_steps=5")]:
        with pytest.raises(ValueError, match=message):
            saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                     **kwargs)
