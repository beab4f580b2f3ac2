"""``bench_convergence --diagnostics``, ``--steps`` and ``--eval-every`` in a one-worker job: the
diagnostics' gradient hooks change nothing, and what they report matches what the optimizer holds
and sends (in one worker the aggregate is what this rank sent)."""
import argparse
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_convergence as bench  # noqa: E402


def options(**kw) -> argparse.Namespace:
    base = dict(digits_epochs=1, lstm_epochs=1, lstm_lr=0.5, lstm_clip=0.25, evals=4, valid_tokens=1000,
                warmup_fraction=0.1, steps=None, eval_every=None, diagnostics=False, digits_width=8, digits_lr=0.05)
    base.update(kw)
    return argparse.Namespace(**base)


def test_evaluation_steps():
    per_epoch, evals = 22, 4
    original = sorted({max(1, round(per_epoch * (j + 1) / evals)) for j in range(evals)})
    expected = {e * per_epoch + j for e in range(8) for j in original}
    assert bench.eval_steps(per_epoch, 8 * per_epoch, options(evals=evals)) == expected
    assert bench.eval_steps(22, 6, options(steps=6, eval_every=2)) == {2, 4, 6}
    assert bench.eval_steps(22, 5, options(steps=5, eval_every=2)) == {2, 4, 5}
    assert bench.eval_steps(22, 30, options(steps=30)) == {6, 11, 16, 22, 28, 30}
    assert bench.lag_steps(66) == [11, 22, 44, 66] and bench.lag_steps(6) == [6]


@pytest.mark.parametrize("task", ["digits", "lstm"])
def test_evaluation_shards_add_up_to_the_whole_set(task):
    """Three ranks' shards (contiguous, sizes within one of each other) cover every held-out item
    once, and their summed (sum, count) give the metric of the whole set; the metric matches the
    examples' own accuracy on the digits."""
    from digits import accuracy

    args, same = options(), (lambda t: t)
    whole = bench.TASKS[task](args, 0, 1, same)
    torch.manual_seed(0)
    model = whole.model().eval()
    with torch.no_grad():
        parts = [bench.TASKS[task](args, r, 3, same) for r in range(3)]
        sums = [p.shard_sums(model) for p in parts]
        total, count = (sum(s[i] for s in sums) for i in (0, 1))
        expected = whole.shard_sums(model)
    assert torch.equal(torch.cat([p.shard(101) for p in parts]), torch.arange(101))
    assert total == pytest.approx(expected[0], rel=1e-9) and count == expected[1]
    assert max(s[1] for s in sums) - min(s[1] for s in sums) <= (whole.bptt if task == "lstm" else 1)
    if task == "digits":
        assert whole.evaluate(model) == pytest.approx(accuracy(model, whole.x_te, whole.y_te))


# sparse from the first step (the benchmark's default critical regimes would send these steps dense)
@pytest.mark.parametrize("key", ["horovod", "safusion@0.05+classic:critical_regimes=none",
                                 "safusion@0.05:critical_regimes=none", "safusion@0.05+mc:critical_regimes=none"])
def test_diagnostics_change_nothing(hvd, key):
    runs = {}
    for diagnostics in (False, True):
        args = options(steps=5, eval_every=2, diagnostics=diagnostics)
        task = bench.Digits(args, hvd.rank(), hvd.size(), bench.horovod_sum)
        model, opt, clip = bench.build(key, task, 0, 5, args)
        run = bench.fit(model, opt, clip, task, 0, args)
        runs[diagnostics] = (run, [p.detach().clone() for p in model.parameters()])
    (plain, x0), (diag, x1) = runs[False], runs[True]
    assert all(torch.equal(a, b) for a, b in zip(x0, x1))
    assert [p["step"] for p in diag["curve"]] == [2, 4, 5] and diag["steps"] == 5
    assert [p["metric"] for p in plain["curve"]] == [p["metric"] for p in diag["curve"]]
    recs = diag["diagnostics"]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and "diagnostics" not in plain
    if key.startswith(("horovod", "safusion@0.05+classic")):  # the SGD's momentum: the update is lr times its buffer
        for r in recs:
            assert r["update_norm"] == pytest.approx(0.05 * r["momentum_norm"], rel=1e-4)
    if key == "horovod":  # the first step is lr times the gradient (the momentum buffer starts at it)
        assert recs[0]["update_cosine"] == pytest.approx(1.0, abs=1e-9) and recs[0]["momentum_cosine"] is None
        assert "residual_norm" not in recs[0]
    else:
        assert recs[0]["residual_age"] == 1.0 and recs[0]["released_age"] == 0.0
        assert all(r["residual_norm"] > 0 and 0 < r["sent_fraction"] < 1 for r in recs)


@pytest.mark.parametrize("mc", [False, True])
def test_diagnostics_match_the_optimizer(hvd, mc):
    """Local gradient, residual norm and age, and the released age weighted by what was sent."""
    import horovod_safusion as saf
    from digits import DigitsCNN, load_digits_split
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, y, _, _ = load_digits_split()
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), density=0.05, dense=False,
                                   momentum_correction=mc)
    diag = bench.Diagnostics(model, opt, hvd.size())
    names = dict(model.named_parameters())
    ages: dict = {}
    for step in range(6):
        diag.begin()
        opt.zero_grad()
        loss = F.cross_entropy(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32])
        loss.backward()
        local = {n: p.grad.detach().reshape(-1).clone() for n, p in names.items()}
        assert all(torch.equal(local[n], diag.grads[n]) for n in names)
        assert diag.grad_sq == pytest.approx(sum(float(g.double().pow(2).sum()) for g in local.values()))
        opt.synchronize()
        sent = {n: p.grad.detach().reshape(-1).clone() for n, p in names.items()}
        with opt.skip_synchronize():
            opt.step()
        x_before = diag.x0.clone()
        scale = 1 / (1 - 0.9) if mc else 1.0  # .grad holds (1 − m) of the aggregate under the correction
        pending = {n: (opt.residuals.get(n, names[n].detach().reshape(-1)) + scale * sent[n]).double() for n in names}
        u = {n: opt.local_momentum.momentum(n).detach().reshape(-1).double().clone() for n in names} if mc else None
        held = [n for n in names if n in opt.residuals.names() or n in ages]
        before = {n: ages.get(n, torch.zeros(names[n].numel(), dtype=torch.int32)) for n in held}
        rec = diag.end(float(loss.detach()))
        num = den = 0.0
        res_sq = age_num = age_den = 0.0
        tensors = {}
        for n in held:
            r = opt.residuals.get(n, names[n].detach().reshape(-1))
            out = (r == 0)
            num += float((sent[n].abs() * before[n])[out].double().sum())
            den += float(sent[n].abs()[out].double().sum())
            ages[n] = torch.where(out, torch.zeros_like(before[n]), before[n] + 1)
            res_sq += float(r.double().pow(2).sum())
            age_num += float((r.abs().double() * ages[n]).sum())
            age_den += float(r.abs().double().sum())
            if r.abs().sum() > 0:
                tensors[n] = float((r.abs().double() * ages[n]).sum() / r.abs().double().sum())
        descent = x_before - torch.cat([p.detach().reshape(-1).double() for p in names.values()])
        grad = torch.cat([local[n].double() for n in names])  # one worker: the mean gradient is its own
        assert rec["update_cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(descent, grad, dim=0)))
        if mc:
            flat_u = torch.cat([u[n] for n in names])
            assert rec["momentum_cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(descent, flat_u, dim=0)))
        else:
            assert rec["momentum_cosine"] is None
        assert rec["kept_energy"] == pytest.approx(res_sq / sum(float(pending[n].pow(2).sum()) for n in held))
        assert held and all(torch.equal(ages[n], diag.age[n]) for n in held)
        assert rec["residual_norm"] == pytest.approx(res_sq ** 0.5)
        assert rec["residual_age"] == pytest.approx(age_num / age_den)
        assert rec["released_age"] == pytest.approx(num / den, rel=1e-4)
        assert rec["momentum_norm"] is not None
        assert {n: t["residual_age"] for n, t in rec["tensors"].items()} == pytest.approx(tensors)
    diag.close()
