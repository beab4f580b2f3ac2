"""Multi-process checks, run by pytest under ``horovodrun`` (Gloo or MPI, 2–4 workers).

Each scenario runs on every rank with rank-dependent data and writes one JSON record per rank;
``test_multiproc.py`` asserts on them. References are computed independently of the plugin's
wire path: from every rank's dense local gradient and residual, gathered with
``hvd.allgather_object``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
import warnings

# The device path's scenario runs the Triton kernels through their interpreter; Triton reads this
# when it is first imported, which an earlier scenario may do (pytest's conftest sets it too).
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
import horovod.torch as hvd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits import DigitsCNN, accuracy, load_digits_split  # noqa: E402

import horovod_safusion as saf  # noqa: E402
from horovod_safusion.fusion import NaivePlanner  # noqa: E402
from horovod_safusion.plan import FusionPlan  # noqa: E402
from horovod_safusion.trial import SCHEDULE, TRIAL_MAX_STEPS  # noqa: E402

DATA = None
#: Steps that cover the warm-up, a profile of 2 steps and a trial's longest blocks.
TRIAL_LENGTH = 1 + 2 + len(SCHEDULE) * (1 + TRIAL_MAX_STEPS) + 2


def batch(step: int, n: int = 32):
    """A different batch on every rank and step (rank-dependent gradients)."""
    x, y, _, _ = DATA
    start = ((step * hvd.size() + hvd.rank()) * n) % (len(x) - n)
    return x[start:start + n], y[start:start + n]


def make(seed=0, width=8):
    torch.manual_seed(seed)
    return DigitsCNN(width=width)


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def params(m):
    return [p.detach().clone() for p in m.parameters()]


def grads(m):
    return [p.grad.detach().clone() for p in m.parameters()]


# ---------------------------------------------------------------------------------------------
def scenario_dense_equality():
    """density 1 / compressor none give hvd.DistributedOptimizer's gradients and parameters."""
    out = {}
    variants = {"none": dict(compressor="none"), "dgc@1": dict(compressor="dgc", density=1.0),
                "topk@1-allgather": dict(compressor="topk", density=1.0, communicator="allgather"),
                "none-predivide": dict(compressor="none", gradient_predivide_factor=2.0)}
    for label, kw in variants.items():
        ref_m, our_m = make(), make()
        pre = kw.pop("gradient_predivide_factor", 1.0)
        ref = hvd.DistributedOptimizer(torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=ref_m.named_parameters(), gradient_predivide_factor=pre)
        ours = saf.DistributedOptimizer(torch.optim.SGD(our_m.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=our_m.named_parameters(), gradient_predivide_factor=pre,
                                        fusion=NaivePlanner(capacity_bytes=8192), **kw, dense=False, min_selected=0)
        gd, pd = 0.0, 0.0
        for step in range(3):
            x, y = batch(step)
            for m, o in ((ref_m, ref), (our_m, ours)):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.synchronize()
            gd = max(gd, max_diff(grads(ref_m), grads(our_m)))
            for o in (ref, ours):
                with o.skip_synchronize():
                    o.step()
            pd = max(pd, max_diff(params(ref_m), params(our_m)))
        out[label] = {"grad_diff": gd, "param_diff": pd, "buffers": len(ours.plan.buffers)}
    return out


def scenario_dense_choice():
    """fusion="safusion" prices a dense allreduce, settles it by a measured trial on every rank
    alike; forced dense (dense=True) gives hvd.DistributedOptimizer's gradients and parameters from
    the first step, and its profile times the dense allreduce alone.
    Without critical regimes, whose dense intervals the trial waits out (unit-tested), so that the
    trial falls within these few steps."""
    out = {}
    m = make()
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), named_parameters=m.named_parameters(),
                                   profile_steps=2, critical_regimes=None)
    user_stream = torch.get_rng_state()  # the model draws nothing: only the plugin could
    for step in range(TRIAL_LENGTH):  # warm-up, profile, and a trial's blocks
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    every = hvd.allgather_object(torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy(), name="dc.eq")
    out["auto"] = {"dense": opt.plan.dense, "trial_done": opt.settled, "whole": sent_whole(opt),
                   "rng_untouched": torch.equal(user_stream, torch.get_rng_state()),
                   "priced": opt.profile.dense_allreduce is not None and opt.profile.prices_dense,
                   "communicators": sorted(opt.profile.communicators), "pruned": opt.profile.meta["pruned"],
                   "plan_communicator": opt.plan.communicator,
                   "sends_over": opt.communicator.name,
                   "replicas_equal": all(np.array_equal(every[0], e) for e in every[1:])}
    # every communicator "auto" may choose, switched to between steps on every rank alike
    switched = []
    for step, name in enumerate(("zen", "allgather")):
        opt.set_plan(dataclasses.replace(opt.plan, dense=False, communicator=name))
        x, y = batch(100 + step)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        switched.append(opt.last_stats.bytes_sent > 0 and opt.communicator.name)
    every = hvd.allgather_object(torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy(), name="dc.sw")
    out["switched"] = {"sent_over": switched, "replicas_equal": all(np.array_equal(every[0], e) for e in every[1:])}
    # forced dense: Horovod's average from the first step (the provisional plan too), under the
    # SGD's own momentum (no correction: nothing is ever sparse)
    ref_m, our_m = make(), make()
    ref = hvd.DistributedOptimizer(torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=ref_m.named_parameters())
    ours = saf.DistributedOptimizer(torch.optim.SGD(our_m.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=our_m.named_parameters(), profile_steps=2, dense=True)
    diffs, param_diffs, plans = [], [], []
    for step in range(6):
        x, y = batch(step)
        for mod, o in ((ref_m, ref), (our_m, ours)):
            o.zero_grad()
            F.cross_entropy(mod(x), y).backward()
            o.synchronize()
        plans.append(ours.plan.planner)
        diffs.append(max_diff(grads(ref_m), grads(our_m)))
        for o in (ref, ours):
            with o.skip_synchronize():
                o.step()
        param_diffs.append(max_diff(ref_m.parameters(), our_m.parameters()))
    # forced sparse: the dense allreduce timed up to the small tensors' bytes, to price them
    sparse_m = make()
    sparse = saf.DistributedOptimizer(torch.optim.SGD(sparse_m.parameters(), lr=0.05),
                                      named_parameters=sparse_m.named_parameters(), profile_steps=2,
                                      critical_regimes=None, dense=False)
    for step in range(4):
        x, y = batch(step)
        sparse.zero_grad()
        F.cross_entropy(sparse_m(x), y).backward()
        sparse.step()
    out["sparse"] = {"whole": sent_whole(sparse), "swept_up_to": float(sparse.profile.dense_allreduce.sizes[-1]),
                     "small_bytes": sum(t.nbytes for t in sparse.profile.tensors if t.name in sparse.profile.small()),
                     "prices_dense": sparse.profile.prices_dense}
    out["forced"] = {"dense": ours.plan.dense, "grad_diffs": diffs, "param_diffs": param_diffs, "plans": plans,
                     "momentum_correction": ours.momentum_correction,
                     "sweeps": sorted(ours.profile.meta["sweeps_s"]), "priced": sorted(ours.profile.communicators),
                     "held": sorted(ours._controller.communicators)}
    return out


def sent_whole(opt) -> dict:
    """The job's small-tensor rule as its profile carries it, the tensors its sparse plan (the
    planner's choice from that profile, or where that is dense its runner-up) sends whole, those
    the profile says it does, and those the plan running sends whole (``None`` where it is dense:
    the trial may have switched to either)."""
    planned = opt.planner.plan(opt.profile.tensors, opt.profile)
    plan = planned if not planned.dense else FusionPlan.from_dict(planned.meta["runner_up"])
    profile = opt.profile if plan.density is None else opt.profile.at(plan.density)
    return {"rule": [profile.min_selected, profile.dense_share],
            "planned": sorted(n for i in plan.dense_buffers for n in plan.buffers[i]),
            "small": sorted(profile.small()), "running": sorted(n for b in opt._controller.buffers if b.dense
                                                               for n in b.names) if not opt.plan.dense else None}


class LocalGradients:
    """The gradients back-propagation computes for ``named`` parameters, recorded by tensor hooks
    as they arrive (a dense step adds residual and momentum into ``p.grad`` in place, so
    ``p.grad`` after ``backward()`` is what is sent, not what was computed)."""

    def __init__(self, named):
        self.grads = {}
        self._hooks = [p.register_hook(lambda g, n=n: self.grads.__setitem__(n, g.detach().reshape(-1).clone()))
                       for n, p in named]

    def remove(self):
        for h in self._hooks:
            h.remove()


def gather_dense(tensors):
    """Every rank's list of flat tensors, as numpy float64 arrays."""
    return [[np.asarray(t, dtype=np.float64) for t in r]
            for r in hvd.allgather_object([t.double().numpy() for t in tensors], name="ref.gather")]


def residuals_of(opt, named):
    """This rank's residual of each of ``named`` (flat), copied."""
    return [opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in named]


def conservation_diff(named, acc, after, scale: float = 1.0) -> float:
    """The largest difference, over ``named`` parameters, between the job's aggregate ``p.grad``
    and ``scale`` times the mean over ranks of what left each rank: what it held before sending
    (``acc``: residual plus new gradient) less what it holds after (``after``: the new residual)."""
    all_acc, all_after = gather_dense(acc), gather_dense(after)
    worst = 0.0
    for i, (_, p) in enumerate(named):
        sent_mean = scale * np.mean([a[i] - r[i] for a, r in zip(all_acc, all_after)], axis=0)
        worst = max(worst, float(np.abs(p.grad.detach().view(-1).double().numpy() - sent_mean).max()))
    return worst


def scenario_sparse_aggregation():
    """density 0.01: the aggregate equals a reference computed from all ranks' accumulators."""
    out = {}
    for compressor in ("topk", "dgc"):
        m = make(width=16)
        opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                       named_parameters=m.named_parameters(), compressor=compressor,
                                       density=0.01, fusion=NaivePlanner(capacity_bytes=16384), dense=False, min_selected=0)
        named = list(m.named_parameters())
        worst_ref, worst_cons, missing = 0.0, 0.0, 0
        for step in range(4):
            before = residuals_of(opt, named)
            opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(m(x), y).backward()
            acc = [p.grad.detach().view(-1) + r for (_, p), r in zip(named, before)]
            opt.synchronize()
            after = residuals_of(opt, named)
            all_acc, all_after = gather_dense(acc), gather_dense(after)
            for i, (_, p) in enumerate(named):
                got = p.grad.detach().view(-1).double().numpy()
                # Conservation over the job: mean over ranks of what left each rank.
                sent_mean = np.mean([a[i] - r[i] for a, r in zip(all_acc, all_after)], axis=0)
                worst_cons = max(worst_cons, float(np.abs(got - sent_mean).max()))
                if compressor == "topk":
                    # Independent reference: exact top-k of each rank's accumulator, summed, averaged.
                    k = max(1, round(0.01 * got.size))
                    ref = np.zeros_like(got)
                    for a in all_acc:
                        idx = np.argpartition(-np.abs(a[i]), k - 1)[:k]
                        ref[idx] += a[i][idx]
                    worst_ref = max(worst_ref, float(np.abs(got - ref / hvd.size()).max()))
            missing += opt.last_stats.missing
            with opt.skip_synchronize():
                opt.step()
        out[compressor] = {"ref_diff": worst_ref, "conservation_diff": worst_cons, "missing": missing,
                           "density": opt.last_stats.density}
    return out


def scenario_density_choice():
    """density="auto": every candidate density priced, one chosen by the trial on every rank
    alike; exact conservation ``before + g = after + sent`` per parameter across density changes;
    a checkpoint taken after the choice resumes bit for bit."""
    import copy
    import io

    def auto(m):  # classic error feedback: the density switches below check its conservation
        return saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                        named_parameters=m.named_parameters(), density="auto", dense=False,
                                        profile_steps=2, momentum_correction=False)

    def train(m, opt, steps, first):
        for step in range(first, first + steps):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

    m = make(width=16)
    opt = auto(m)
    train(m, opt, TRIAL_LENGTH, 0)  # warm-up, profile, and the trial's blocks
    plan = opt.plan
    out = {"priced": sorted(opt.profile.densities), "settled": opt.settled, "density": plan.density,
           "dense": plan.dense, "target": opt.target_density}
    # a checkpoint after the choice: the next steps, and the same steps resumed in a fresh optimizer
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, buf)
    train(m, opt, 3, 30)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    m2 = make(seed=1, width=16)
    m2.load_state_dict(ckpt["model"])
    opt2 = auto(m2)
    opt2.load_state_dict(ckpt["optimizer"])
    resumed_plan = opt2.plan.density, opt2.plan.dense
    train(m2, opt2, 3, 30)
    out["resumed"] = {"plan": list(resumed_plan), "identical": all(torch.equal(a, b) for a, b in
                                                                 zip(m.parameters(), m2.parameters()))}
    # density changes between steps: nothing lost
    named = list(m.named_parameters())
    worst, densities = 0.0, []
    for step, d in enumerate((0.1, 0.1, 0.001, 0.03, 0.003)):
        opt.set_plan(dataclasses.replace(plan, dense=False, density=d))
        before = residuals_of(opt, named)
        opt.zero_grad()
        x, y = batch(200 + step)
        local = LocalGradients(named)
        F.cross_entropy(m(x), y).backward()
        local.remove()
        opt.synchronize()
        densities.append(opt.controller.mode.density)
        acc = [b + local.grads[n] for b, (n, _) in zip(before, named)]
        worst = max(worst, conservation_diff(named, acc, residuals_of(opt, named)))
        with opt.skip_synchronize():
            opt.step()
    every = hvd.allgather_object(torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy(), name="dch.eq")
    out["switched"] = {"densities": densities, "conservation_diff": worst,
                       "replicas_equal": all(np.array_equal(every[0], e) for e in every[1:])}
    return out


def scenario_dgc_techniques():
    """Momentum correction with masking, local clipping and a density warm-up under dgc at 0.01:
    per step, the job's aggregate is the mean of what left every rank (``before + u − after``,
    with ``u = m·u_prev + g`` computed here; ``.grad`` holds ``1 − m`` of it), u is masked exactly where the rank sent, and every
    rank selects at the same density and sends dense at the same steps. Records the final
    parameters' checksum (ranks must agree bit for bit)."""
    out = {}
    for schedule in ("exponential", "dense"):
        m = make(width=16)
        opt = saf.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), named_parameters=m.named_parameters(),
            compressor="dgc", density=0.01, fusion=NaivePlanner(capacity_bytes=16384), dense=False, min_selected=0,
            momentum_correction=True, local_clipping=5.0, warmup_steps=6, warmup_schedule=schedule)
        ctl = opt.controller
        named = list(m.named_parameters())
        worst_cons, mask_violations, densities, dense_steps = 0.0, 0, [], []
        for step in range(9):
            before = residuals_of(opt, named)
            u_prev = [ctl.momentum.momentum(n).clone() for n, _ in named]
            opt.zero_grad()
            x, y = batch(step)
            local = LocalGradients(named)
            F.cross_entropy(m(x), y).backward()
            local.remove()
            clipped = [ctl.clipping(local.grads[n]) for n, _ in named]
            opt.synchronize()
            densities.append(ctl.mode.density)
            dense_steps.append(bool(ctl.mode.dense))
            u_new = [torch.add(g, u, alpha=0.9) for g, u in zip(clipped, u_prev)]
            acc = [r + u for r, u in zip(before, u_new)]
            after = residuals_of(opt, named)
            for (n, _), u, a, r in zip(named, u_new, acc, after):
                got = ctl.momentum.momentum(n)
                masked = got != u
                mask_violations += int((got[masked] != 0).sum()) + int((a[masked] == r[masked]).sum())
            worst_cons = max(worst_cons, conservation_diff(named, acc, after, scale=1 - 0.9))
            with opt.skip_synchronize():
                opt.step()
        out[schedule] = {"conservation_diff": worst_cons, "mask_violations": mask_violations,
                         "densities": densities, "dense_steps": dense_steps,
                         "checksum": float(sum(p.detach().double().sum() for p in m.parameters())),
                         "final_density": opt.last_stats.density}
    return out


def scenario_ef21_sgdm():
    """EF21-SGDM at density 0.01 (every tensor sparsified, a dense warm-up of 3 steps): per step,
    the job's aggregate is the mean of what left every rank (``before + δ − after``, with
    ``δ = g − (1 − m)·u_prev`` computed here), and the wrapped SGD's momentum buffer is the sum of
    the aggregates; records the final parameters' checksum (ranks must agree bit for bit)."""
    m = make(width=16)
    opt = saf.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), named_parameters=m.named_parameters(),
        compressor="dgc", density=0.01, fusion=NaivePlanner(capacity_bytes=16384), dense=False, min_selected=0,
        error_feedback="ef21-sgdm", warmup_steps=3, warmup_schedule="dense")
    ctl = opt.controller
    named = list(m.named_parameters())
    worst_cons, worst_buffer, sums = 0.0, 0.0, [torch.zeros(p.numel(), dtype=torch.float64) for _, p in named]
    for step in range(8):
        before = residuals_of(opt, named)
        u_prev = [ctl.momentum.momentum(n).clone() for n, _ in named]
        opt.zero_grad()
        x, y = batch(step)
        local = LocalGradients(named)
        F.cross_entropy(m(x), y).backward()
        local.remove()
        opt.synchronize()
        acc = [r + torch.add(local.grads[n], u, alpha=0.9 - 1) for r, (n, _), u in zip(before, named, u_prev)]
        worst_cons = max(worst_cons, conservation_diff(named, acc, residuals_of(opt, named)))
        for total, (_, p) in zip(sums, named):
            total += p.grad.detach().view(-1).double()
        with opt.skip_synchronize():
            opt.step()
        for total, (_, p) in zip(sums, named):
            buf = opt.state[p]["momentum_buffer"].view(-1).double()
            worst_buffer = max(worst_buffer, float((buf - total).abs().max()))
    return {"conservation_diff": worst_cons, "buffer_diff": worst_buffer,
            "checksum": float(sum(p.detach().double().sum() for p in m.parameters())),
            "final_density": opt.last_stats.density}


def scenario_half_critical():
    """Critical steps as float16 (critical_regimes=3, the wire forced to float16): every rank keeps
    exactly what rounding dropped (``residual + sent == residual_before + gradient`` bit for bit,
    ``sent`` the float16 rounding), the aggregate is the mean of what the ranks sent (to float16's
    rounding of the sum), half the bytes go; at step 4 rank 0's gradient overflows float16: the
    buffer goes again in float32 (the aggregate is the float32 mean), and every rank falls back."""
    m = make(width=16)
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
                                   compressor="topk", density=0.01, fusion=NaivePlanner(capacity_bytes=16384),
                                   dense=False, min_selected=0, critical_regimes=3)
    regimes = opt.controller.regimes
    regimes.half = True  # (what the profile chooses on a slow link; NaivePlanner does not profile)
    named = list(m.named_parameters())
    numel = sum(p.numel() for _, p in named)
    records = []
    for step in range(9):
        before = residuals_of(opt, named)
        opt.zero_grad()
        x, y = batch(step)
        local = LocalGradients(named)
        loss = F.cross_entropy(m(x), y)
        (loss * (1e7 if step == 4 and hvd.rank() == 0 else 1.0)).backward()
        local.remove()
        critical, half = regimes.critical, opt.controller.mode.half
        opt.synchronize()
        acc = [r + local.grads[n] for r, (n, _) in zip(before, named)]
        after = residuals_of(opt, named)
        # this rank: the rounding error kept, bit for bit (a float16 step), or nothing kept (float32)
        sent = [a.half().float() if half and not regimes.overflowed else a for a in acc]
        exact = all(torch.equal(r + s, a) for r, s, a in zip(after, sent, acc))
        cons = conservation_diff(named, acc, after)
        scale = max(float(p.grad.abs().max()) for _, p in named)
        records.append({"critical": critical, "half": half, "exact": exact, "relative_diff": cons / scale,
                        "bytes_sent": opt.last_stats.bytes_sent, "numel": numel,
                        "overflowed": regimes.overflowed})
        with opt.skip_synchronize():
            opt.step()
    return {"steps": records, "checksum": float(sum(p.detach().double().sum() for p in m.parameters()))}


def scenario_device_path():
    """The GPU path on CPU tensors (``HOROVOD_SAFUSION_DEVICE_PATH=1``), with the PyTorch kernels
    and with the Triton kernels under their interpreter: dgc at 0.01, ranks selecting different
    counts into one allgather of wire rows the selection wrote itself. Per step, the job's
    aggregate is the mean of what left every rank (``before + g − after``); records the final
    parameters' checksum (ranks must agree bit for bit)."""
    out = {}
    from horovod_safusion import kernels as paths

    saved = {k: os.environ.get(k) for k in ("HOROVOD_SAFUSION_DEVICE_PATH", "HOROVOD_SAFUSION_KERNELS")}
    try:
        for kernels in ("torch", "triton"):
            os.environ["HOROVOD_SAFUSION_DEVICE_PATH"], os.environ["HOROVOD_SAFUSION_KERNELS"] = "1", kernels
            paths.reread()
            m = make(width=16)
            opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), named_parameters=m.named_parameters(),
                                           compressor="dgc", density=0.01, fusion=NaivePlanner(capacity_bytes=16384),
                                           dense=False, min_selected=0)
            named = list(m.named_parameters())
            worst, counts = 0.0, []
            for step in range(4):
                before = residuals_of(opt, named)
                opt.zero_grad()
                x, y = batch(step)
                F.cross_entropy(m(x), y).backward()
                acc = [r + p.grad.detach().view(-1) for r, (_, p) in zip(before, named)]
                opt.synchronize()
                counts.append(opt.last_stats.selected)
                worst = max(worst, conservation_diff(named, acc, residuals_of(opt, named)))
                with opt.skip_synchronize():
                    opt.step()
            out[kernels] = {"conservation_diff": worst, "selected": counts, "missing": opt.last_stats.missing,
                            "density": opt.last_stats.density,
                            "checksum": float(sum(p.detach().double().sum() for p in m.parameters()))}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        paths.reread()
    return out


class Branchy(nn.Module):
    """``only_rank0`` is used on rank 0 only; ``never`` is never used."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.only_rank0 = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if hvd.rank() == 0:
            h = h + self.only_rank0(h)
        return self.b(torch.relu(h))


def scenario_unused_parameters():
    """No hang when ranks use different parameters; a rank's gradient is averaged over all ranks.
    The ``only-rank0`` jobs leave ``never`` out, so rank 0 has every gradient and the others not:
    the step's flags, carried in the last dense buffer (its sum read back through fp16 wire
    compression in one of them), must send their own allreduce on every rank alike."""
    out = {}
    fp16 = hvd.Compression.fp16
    for label, kw in {"none": dict(compressor="none"), "topk@0.25": dict(compressor="topk", density=0.25),
                      "none/only-rank0": dict(compressor="none"),
                      "none-fp16/only-rank0": dict(compressor="none", compression=fp16)}.items():
        torch.manual_seed(0)
        m = Branchy()
        named = [(n, p) for n, p in m.named_parameters() if not (label.endswith("only-rank0") and n.startswith("never"))]
        opt = saf.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                                       named_parameters=named, **kw, dense=False, min_selected=0)
        for step in range(3):
            opt.zero_grad()
            g = torch.Generator().manual_seed(100 * step + hvd.rank())
            m(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            local = m.only_rank0.weight.grad.clone() if m.only_rank0.weight.grad is not None else torch.zeros(4, 4)
            opt.step()
        out[label] = {"never_grad": m.never.weight.grad,  # no rank had one: left as zero_grad() left it
                      "only_rank0_grad_abs": float(m.only_rank0.weight.grad.abs().sum()),
                      "only_rank0_local_abs": float(local.abs().sum())}
    return out


def scenario_backward_passes():
    """backward_passes_per_step=2 equals Horovod's accumulation; a third pass raises Horovod's error."""
    ref_m, our_m = make(), make()
    ref = hvd.DistributedOptimizer(torch.optim.SGD(ref_m.parameters(), lr=0.1),
                                   named_parameters=ref_m.named_parameters(), backward_passes_per_step=2)
    ours = saf.DistributedOptimizer(torch.optim.SGD(our_m.parameters(), lr=0.1),
                                    named_parameters=our_m.named_parameters(), backward_passes_per_step=2,
                                    compressor="none", dense=False, min_selected=0)
    for step in range(2):
        for m, o in ((ref_m, ref), (our_m, ours)):
            o.zero_grad()
            for micro in range(2):
                x, y = batch(2 * step + micro)
                F.cross_entropy(m(x), y).backward()
            o.step()
    diff = max_diff(params(ref_m), params(our_m))
    ours.zero_grad()
    error = ""
    try:
        for micro in range(3):
            x, y = batch(micro)
            F.cross_entropy(our_m(x), y).backward()
    except AssertionError as e:
        error = str(e)
    ours.synchronize()  # leave no collective half-submitted
    return {"param_diff": diff, "error": error}


def scenario_broadcast_and_skip():
    """broadcast_optimizer_state keeps working; synchronize + clip + skip_synchronize matches Horovod."""
    m = make()
    opt = saf.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.001 * (1 + hvd.rank())),
                                   named_parameters=m.named_parameters(), dense=False, min_selected=0)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    lr = opt.param_groups[0]["lr"]
    steps_after_broadcast = opt.controller.steps

    ref_m, our_m = make(), make()
    ref = hvd.DistributedOptimizer(torch.optim.SGD(ref_m.parameters(), lr=0.1), named_parameters=ref_m.named_parameters())
    ours = saf.DistributedOptimizer(torch.optim.SGD(our_m.parameters(), lr=0.1), named_parameters=our_m.named_parameters(),
                                    compressor="none", dense=False, min_selected=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = batch(step)
            for mm, o in ((ref_m, ref), (our_m, ours)):
                o.zero_grad()
                F.cross_entropy(mm(x), y).backward()
                o.synchronize()
                torch.nn.utils.clip_grad_norm_(mm.parameters(), 0.5)
                with o.skip_synchronize():
                    o.step()
    return {"lr": lr, "steps_after_broadcast": steps_after_broadcast,
            "param_diff": max_diff(params(ref_m), params(our_m)), "warnings": [str(w.message) for w in caught]}


def scenario_training():
    """A short real training run learns well above chance (10 classes)."""
    m = make(width=16)
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05 * hvd.size(), momentum=0.9),
                                   named_parameters=m.named_parameters(), compressor="dgc", density=0.01, dense=False, min_selected=0)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    for step in range(120):
        opt.zero_grad()
        x, y = batch(step)
        F.cross_entropy(m(x), y).backward()
        opt.step()
    _, _, x_te, y_te = DATA
    assert opt.plan.planner == "safusion" and opt.profile is not None  # the default profiled and switched
    same = hvd.allgather_object([p.detach().numpy() for p in m.parameters()], name="train.params")
    replicas_equal = all(np.array_equal(a, b) for r in same[1:] for a, b in zip(same[0], r))
    return {"acc": accuracy(m, x_te, y_te), "replicas_equal": replicas_equal}


def scenario_schemes():
    """Every baseline fusion scheme trains end to end: the same update on every rank, and the dense
    baseline learns well above chance (10 classes)."""
    out = {}
    for scheme in [f for f in ("horovod", "wfbp", "oktopk", "omgs", "cupcake") if f in saf.available_planners()]:
        m = make(width=8)
        sparse = {} if scheme == "horovod" else {"compressor": "dgc", "density": 0.01}
        opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05 * hvd.size(), momentum=0.9),
                                       named_parameters=m.named_parameters(), fusion=scheme, profile_steps=3, **sparse, dense=False, min_selected=0)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        missing = []
        for step in range(60):
            opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(m(x), y).backward()
            opt.step()
            missing.append(opt.last_stats.missing_rate)
        same = hvd.allgather_object([p.detach().numpy() for p in m.parameters()], name=f"schemes.{scheme}")
        out[scheme] = {"acc": accuracy(m, *DATA[2:]), "planner": opt.plan.planner, "order": opt.plan.order,
                       "buffers": len(opt.plan.buffers), "missing": float(np.mean(missing)),
                       "replicas_equal": all(np.array_equal(a, b) for r in same[1:] for a, b in zip(same[0], r))}
    return out


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``delay`` seconds: rank-dependent local timings."""

    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.delay)
        return g, None


class SlowOnSomeRanks(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DigitsCNN(width=8)

    def forward(self, x):
        h = self.inner.features(x)
        return self.inner.head(SlowBackward.apply(h, 0.050 * hvd.rank()))


def scenario_generator_alignment():
    """Ranks measure different timings, yet profile and plan identically; the switch is exact."""
    torch.manual_seed(0)
    m = SlowOnSomeRanks()
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), named_parameters=m.named_parameters(),
                                   compressor="dgc", density=0.01, profile_steps=3, dense=False, min_selected=0)
    planners = []
    for step in range(6):
        opt.zero_grad()
        x, y = batch(step)
        F.cross_entropy(m(x), y).backward()
        opt.step()
        planners.append(opt.plan.planner)
    digests = hvd.allgather_object(opt.plan.digest(), name="gen.digest")
    profiles = hvd.allgather_object(json.dumps(opt.profile.to_dict(), sort_keys=True), name="gen.profile")
    local = opt.profiler.local

    # density 1 through a plan switch: identical to Horovod's dense optimizer at every step
    ref_m, our_m = make(), make()
    ref = hvd.DistributedOptimizer(torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=ref_m.named_parameters())
    ours = saf.DistributedOptimizer(torch.optim.SGD(our_m.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=our_m.named_parameters(), compressor="dgc", density=1.0,
                                    profile_steps=2, dense=False, min_selected=0)
    diff, switched_at = 0.0, None
    for step in range(6):
        x, y = batch(step)
        for mm, o in ((ref_m, ref), (our_m, ours)):
            o.zero_grad()
            F.cross_entropy(mm(x), y).backward()
            o.step()
        diff = max(diff, max_diff(params(ref_m), params(our_m)))
        if switched_at is None and ours.plan.planner == "safusion":
            switched_at = step
    return {"planners": planners, "digests_equal": len(set(digests)) == 1,
            "profiles_equal": len(set(profiles)) == 1, "buffers": len(opt.plan.buffers),
            "local_backward": max(local["ready"].values()),
            "shared_backward": max(opt.profile.ready), "switch_param_diff": diff, "switched_at": switched_at}


def scenario_wire_before_profile():
    """Under critical regimes (on by default) the profiler chooses the critical steps' wire at the
    end of the step before its first profiled one, on every rank alike; the steps it profiles go on
    that wire; the profile (built once the regime lets a step go sparse) takes the wire's float32
    time as its dense sweep's largest point, and times ``sweeps.DENSE_POINTS`` sizes in all."""
    m = make(width=16)
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), named_parameters=m.named_parameters(),
                                   profile_steps=2)
    chosen_at, halves = None, []
    for step in range(100):
        opt.zero_grad()
        x, y = batch(step)
        F.cross_entropy(m(x), y).backward()
        halves.append(opt.controller.mode.half)  # the step's mode, opened by its first gradient
        opt.step()
        if chosen_at is None and opt.profiler._wire is not None:
            chosen_at = step
        if opt.profile is not None:
            break
    nbytes, float32_s, float16_s, _ = opt.profiler._wire
    dense = opt.profile.dense_allreduce
    return {"chosen_at": chosen_at, "half": opt.controller.regimes.half, "wire": [nbytes, float32_s, float16_s],
            "modes": halves,
            "dense_top": [dense.sizes[-1], dense.seconds[-1]], "dense_sizes": list(dense.sizes),
            "sweeps": sorted(opt.profile.meta["sweeps_s"])}


def scenario_wire_runs():
    """The collectives that time the critical wires, by runs: float16's warm-up and one counted
    run, then float32's. Where float16's took ``sweeps.ONE_RUN_S`` or more on the fastest rank
    (``slow``: the bar is set to 0, so every wire is slow), float32's is timed by one run right
    after it, with no warm-up of its own; otherwise (``fast``: the bar is infinite) by a warm-up
    and one counted run (``profiling.WIRE_REPS``)."""
    from horovod_safusion import sweeps

    real, bar = sweeps.time_collective, sweeps.ONE_RUN_S
    out = {}
    for case, limit in (("slow", 0.0), ("fast", float("inf"))):
        runs = []

        def counting(run, *args, **kwargs):
            count = [0]

            def counted():
                count[0] += 1
                run()
            seconds = real(counted, *args, **kwargs)
            runs.append(count[0])
            return seconds

        sweeps.ONE_RUN_S, sweeps.time_collective = limit, counting
        try:
            m = make(width=16)
            opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                           named_parameters=m.named_parameters(), profile_steps=2)
            for step in range(2):
                opt.zero_grad()
                x, y = batch(step)
                F.cross_entropy(m(x), y).backward()
                opt.step()
            out[case] = {"runs": runs[:2], "wired": opt.profiler._wire is not None}
        finally:
            sweeps.ONE_RUN_S, sweeps.time_collective = bar, real
    return out


def scenario_agreed_repetitions():
    """A dense allreduce of the profile is timed once where its warm-up was slow on the fastest
    rank, ``reps`` times otherwise, on every rank alike (the same collectives), whatever each rank
    measured itself. The bar is raised for the test so that a loaded machine's stall of a few
    hundred milliseconds on every rank at once (one of half a second was seen) does not pass for a
    slow warm-up, and the ranks start each case together (a sleeping rank of the case before
    would be waited for)."""
    from horovod_safusion import sweeps
    from horovod_safusion.clock import Clock

    counts = {}
    bar, sweeps.ONE_RUN_S = sweeps.ONE_RUN_S, 1.0
    for case, sleepers in (("all_slow", range(hvd.size())), ("one_slow", [0]), ("none_slow", [])):
        hvd.allreduce(torch.zeros(1), name=f"agreed.{case}.start")
        calls = []

        def run():
            hvd.allreduce(torch.ones(4), name=f"agreed.{case}.{len(calls)}", op=hvd.Sum)
            calls.append(1)
            if hvd.rank() in sleepers:  # after the collective: this rank's own time only
                time.sleep(2 * sweeps.ONE_RUN_S)
        sweeps.time_collective(run, Clock(torch.device("cpu")), 2, f"agreed.{case}", hvd.global_process_set)
        counts[case] = len(calls)
    sweeps.ONE_RUN_S = bar
    return counts


def scenario_randomk_shared_indices():
    """Random-k picks the same positions on every rank, whatever each rank's gradient."""
    from horovod_safusion.compressors import RandomK
    from horovod_safusion.segment import Segments
    seg = Segments(("a", "b"), (10_000, 300))
    flat = torch.randn(10_300, generator=torch.Generator().manual_seed(hvd.rank()))
    picks = [RandomK(0.01, seed=5).select(flat, seg, step).tolist() for step in range(3)]
    gathered = hvd.allgather_object(picks, name="randomk.picks")
    # and through the optimizer: every rank sends rows for the same indices, so the aggregate has
    # exactly as many nonzeros as one rank selected
    m = make()
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   compressor="randomk", density=0.05, fusion=NaivePlanner(1 << 20), dense=False, min_selected=0)
    x, y = batch(0)
    F.cross_entropy(m(x), y).backward()
    opt.synchronize()
    nonzero = sum(int((p.grad != 0).sum()) for p in m.parameters())
    return {"equal": all(g == gathered[0] for g in gathered), "nonzero": nonzero,
            "selected": opt.last_stats.selected}


def scenario_plan_mismatch():
    """Different plans on different ranks: a clear error on every rank, naming the buffer."""
    m = make()
    cap = 1 if hvd.rank() == 0 else 10**9  # one buffer per tensor vs one buffer in all
    try:
        saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                 fusion=NaivePlanner(capacity_bytes=cap), dense=False, min_selected=0)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": ""}


def main():
    global DATA
    hvd.init()
    torch.set_num_threads(1)
    DATA = load_digits_split()
    out_dir = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else [n[len("scenario_"):] for n in globals()
                                                               if n.startswith("scenario_")]
    results = {"size": hvd.size(), "rank": hvd.rank()}
    for name in names:
        try:
            results[name] = globals()[f"scenario_{name}"]()
        except Exception:  # record, so pytest shows which scenario failed and why
            results[name] = {"exception": traceback.format_exc()}
            raise
        finally:
            with open(os.path.join(out_dir, f"rank{hvd.rank()}.json"), "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
