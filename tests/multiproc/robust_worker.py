"""Ordinary Horovod training code that must run with the plugin as it runs with Horovod.

Launched by ``test_robustness.py`` under ``horovodrun`` (Gloo ×2, Gloo ×3, MPI ×2), it runs one
scenario per call — ``robust_worker.py OUT SCENARIO [ARGS]`` — and writes one JSON record per rank.
Every scenario runs every compressor with every communicator it can pair with:

* ``edge``: parameters toggling ``requires_grad``, used on some steps or some ranks only, or
  multiplied by zero; a two-head model whose loss uses one head per step (another per rank);
  one-element tensors; ``synchronize()`` then ``step()`` under ``skip_synchronize()``;
  ``zero_grad(set_to_none=True)``. Records the job's conservation error
  (P · applied − Σ_ranks (accumulator − residual after)) and whether replicas agree.
* ``nonfinite``: rank 0's batch is NaN at one step, and one gradient element is Inf at
  another; the user skips steps whose gradients are not finite. Horovod's optimizer runs the same.
* ``scaler``: a GradScaler whose scale grows every 3 steps, against the same run unscaled.
* ``fp16``: ``compression=hvd.Compression.fp16``: what each rank sent is exactly float16 and
  ``residual_after + sent == residual_before + grad`` bit for bit.
* ``save``/``resume``: train, save (each rank its own ``state_dict()``, and rank 0 the gathered
  ``state_dict(all_ranks=True)``), train on — and in fresh processes load and train the same steps.
* ``dropin``: (``frozen``) a layer frozen mid-training, a ``step()`` without backward while it is
  frozen, the layer unfrozen, and a layer used on rank 0 only; SGD with and without momentum, the
  default, ``dense=False``, ``dense=True``, momentum correction, leftover-handing protocols and a
  switch to a dense plan while frozen. Records how far frozen parameters moved, whether their
  residuals and momenta stayed bit for bit, the job's conservation error, and whether replicas
  agree. (``join``) a parameter group added by ``add_param_group`` at step 3 (initialised
  differently on every rank) and a layer frozen at construction made trainable at step 5.
* ``join_mismatch``: one rank adds a group that the others do not (``one``), or with another
  shape (``shape``): every rank must raise the same clear error.
* ``spread``: which gradients are spread, as the ranks vote (``horovod_safusion.spread``): an
  embedding of a few tokens (concentrated on every rank), a layer whose input is one column on
  rank 0 (concentrated there) and Gaussian on the others (spread), and a layer no rank uses before
  step 2; the defaults (a spread tensor at no less than 0.1) with top-k and every tensor sparsified.
  Records this rank's votes, the decisions and the step each was taken, each tensor's k, what the
  mixed layer sent per step, the job's conservation error, and whether replicas agree.
* ``tiny``: a tiny regression MLP (``Linear(10, 32)``, ``Tanh``, ``Linear(32, 1)``) fitting a
  teacher MLP, SGD lr 0.05 momentum 0.9, 300 steps, DGC's compressor: Horovod's optimizer, the
  plugin's defaults, ``dense=False``, ``dense=False`` with every tensor sparsified
  (``min_selected=0``: a gradient two steps late already diverges this SGD,
  ``benchmarks/bench_staleness.py``, and error feedback holds an element for tens of steps), the
  same with DGC's momentum factor masking in every tensor (``momentum_masking=True``) and with no
  masking (``False``) under the default's momentum correction, and the default at density 0.01
  (k = 1 element of the smallest tensors). Records the evaluation loss at the start and the end
  of each.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
import horovod.torch as hvd

import horovod_safusion as saf
from horovod_safusion.communicators import SparDL
from horovod_safusion.fusion import NaivePlanner
from horovod_safusion import regime
from horovod_safusion.plan import FusionPlan

COMPRESSORS = ("dgc", "topk", "gaussiank", "redsync", "sidco", "randomk", "exdyna")
COMMUNICATORS = ("allgather", "allreduce", "spardl", "zen")


#: Communicators asked for by name with one compressor each: ExDyna's with its own, ScaleCom's
#: (which sends the leader's selection whatever compressor made it) with the default.
NAMED = (("exdyna", "exdyna"), ("dgc", "scalecom"))


def pairs(compressors=COMPRESSORS, communicators=COMMUNICATORS, named=NAMED):
    return [(c, m) for c in compressors for m in communicators] + [p for p in named if p[0] in compressors]


def covering_pairs():
    """Every compressor once and every communicator once (for the slower oversubscribed jobs)."""
    return ([(c, "allgather") for c in COMPRESSORS] + [("dgc", m) for m in COMMUNICATORS if m != "allgather"]
            + list(NAMED))


def matrix(which):
    return pairs() if which == "all" else covering_pairs()


class Net(nn.Module):
    """A trunk, two heads, a branch used on rank 0 only, a frozen-then-thawed layer, a layer
    multiplied by zero, and a one-element parameter."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(12, 24)
        self.head_a = nn.Linear(24, 3)
        self.head_b = nn.Linear(24, 3)
        self.only_rank0 = nn.Linear(24, 3)
        self.toggled = nn.Linear(24, 3)
        self.zeroed = nn.Linear(24, 3)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x, step):
        h = torch.relu(self.trunk(x)) * self.gain
        head = self.head_a if (step + hvd.rank() * (step % 3 == 0)) % 2 == 0 else self.head_b
        y = head(h) + 0.0 * self.zeroed(h)
        if hvd.rank() == 0:
            y = y + self.only_rank0(h)
        if self.toggled.weight.requires_grad:
            y = y + self.toggled(h)
        return y


def data(step, n=16, nan=False, seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * step + hvd.rank())
    x = torch.randn(n, 12, generator=g)
    if nan:
        x[0, 0] = float("nan")
    return x, torch.randint(0, 3, (n,), generator=g)


def build(comp, comm, seed=0, **kw):
    """Classic error feedback unless ``kw`` says otherwise: the scenarios check its conservation
    element by element against the gradient (momentum correction's is checked by
    ``test_dgc_techniques`` and the frozen scenario's ``momentum_correction`` variant)."""
    torch.manual_seed(seed)
    model = Net()
    kw.setdefault("profile_steps", 2)
    kw.setdefault("momentum_correction", False)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compressor=comp,
                                   communicator=comm, **kw, dense=False, min_selected=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return model, opt


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def replicas_equal(model, name):
    every = hvd.allgather_object(flat_params(model).numpy(), name=name)
    return all(np.array_equal(every[0], e) for e in every[1:])


class Computed:
    """The gradients back-propagation computes for ``named``'s parameters, recorded by tensor hooks
    registered now (after any hook that changes them): what ``p.grad`` receives. A buffer sent
    dense writes what it sends into ``p.grad`` in its hook, so ``p.grad`` after ``backward()`` is
    not the computed gradient there; a parameter that received none reads as zeros."""

    def __init__(self, named):
        self.grads = {}
        self._hooks = [p.register_hook(lambda g, n=n: self.grads.__setitem__(n, g.detach().reshape(-1).clone()))
                       for n, p in named if p.requires_grad]

    def of(self, name, p):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return self.grads.get(name, torch.zeros(p.numel()))


def residual_of(opt, name, p):
    return opt.residuals.get(name, p.detach().reshape(-1)).clone()


# ---------------------------------------------------------------------------------------------
def scenario_edge(which):
    out = {}
    for comp, comm in matrix(which):
        model, opt = build(comp, comm, density=0.1)
        named = list(model.named_parameters())
        worst = 0.0
        for step in range(8):
            model.toggled.weight.requires_grad_(step % 4 < 2)  # toggles during training
            opt.zero_grad(set_to_none=True)
            before = {n: residual_of(opt, n, p) for n, p in named}
            x, y = data(step)
            computed = Computed(named)
            F.cross_entropy(model(x, step), y).backward()
            acc = {n: computed.of(n, p) + before[n] for n, p in named}
            if step % 2:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)  # between synchronize and step
                with opt.skip_synchronize():
                    opt.step()
                continue  # clipping changed p.grad: conservation is checked on the other steps
            opt.step()
            sent = {n: acc[n] - residual_of(opt, n, p) for n, p in named}
            total = hvd.allreduce(torch.cat([sent[n] for n, _ in named]).double(), op=hvd.Sum, name=f"edge.{comp}.{comm}.{step}")
            applied = torch.cat([p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                 for _, p in named]).double() * hvd.size()  # None: no rank had a gradient
            worst = max(worst, float((applied - total).abs().max()))
        out[f"{comp}+{comm}"] = {"conservation": worst, "replicas_equal": replicas_equal(model, f"edge.{comp}.{comm}"),
                                 "finite": bool(torch.isfinite(flat_params(model)).all()),
                                 "planner": opt.plan.planner}
    return out


def train_skipping(opt, model, steps, nan_step, inf_step):
    """The usual pattern: skip a step whose synchronised gradients are not finite."""
    skipped, named = [], list(model.named_parameters())
    selected_after = []
    take_back = None
    for step in range(steps):
        opt.zero_grad()
        x, y = data(step, nan=(step == nan_step and hvd.rank() == 0))
        handle = None
        if step == inf_step and hvd.rank() == 0:
            handle = model.trunk.weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                                              torch.tensor(float("inf"))))
        before = {n: residual_of(opt, n, p) for n, p in named} if hasattr(opt, "residuals") else None
        computed = Computed(named)
        F.cross_entropy(model(x, 0), y).backward()
        acc = {n: computed.of(n, p) + before[n] for n, p in named} if before else None
        if handle is not None:
            handle.remove()
        opt.synchronize()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        if not finite:
            skipped.append(step)
            if acc is not None and step == nan_step and hvd.rank() == 1:  # rank 1 was finite: it takes back what it sent
                take_back = max(float((residual_of(opt, n, p) - acc[n]).abs().max()) for n, p in named)
            continue
        with opt.skip_synchronize():
            opt.step()
        if hasattr(opt, "last_stats"):
            selected_after.append(opt.last_stats.selected)
    out = {"skipped": skipped, "params_finite": bool(torch.isfinite(flat_params(model)).all())}
    if hasattr(opt, "residuals"):
        out["residuals_finite"] = all(bool(torch.isfinite(r).all()) for r in opt.residuals.state_dict().values())
        out["selected_last"] = selected_after[-1]
        out["take_back_diff"] = take_back
    return out


def scenario_nonfinite(which):
    out = {}
    torch.manual_seed(0)
    ref = Net()
    hvd.broadcast_parameters(ref.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.05), named_parameters=ref.named_parameters())
    out["horovod"] = train_skipping(opt, ref, 9, nan_step=3, inf_step=6)
    for comp, comm in matrix(which):
        model, opt = build(comp, comm, fusion=NaivePlanner(capacity_bytes=1024))
        out[f"{comp}+{comm}"] = train_skipping(opt, model, 9, nan_step=3, inf_step=6)
        out[f"{comp}+{comm}"]["replicas_equal"] = replicas_equal(model, f"nf.{comp}.{comm}")
    return out


def amp_run(comp, scaler_kind):
    """SGD on the two-head net; ``scaler_kind``: None (unscaled), "told" (grad_scaler=) or "untold"."""
    torch.manual_seed(0)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3) if scaler_kind else None
    kw = {"grad_scaler": scaler} if scaler_kind == "told" else {}
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    if comp == "horovod":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        opt = saf.DistributedOptimizer(base, named_parameters=model.named_parameters(), compressor=comp,
                                       density=0.1, profile_steps=2, **kw, dense=False, communicator="allgather",
                                       min_selected=0)  # no measured choice: the runs must repeat bit for bit
        assert not kw or opt.controller.loss_scale.current is not None
    scales = []
    for step in range(15):
        opt.zero_grad()
        x, y = data(step)
        loss = F.cross_entropy(model(x, 0), y)
        (scaler.scale(loss) if scaler else loss).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            if scaler:
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                opt.step()
    return flat_params(model), scales


def scenario_scaler():
    out = {}
    for comp in ("horovod", "dgc", "topk", "randomk"):
        plain, _ = amp_run(comp, None)
        told, scales = amp_run(comp, "told" if comp != "horovod" else "untold")
        rec = {"told_diff": float((told - plain).abs().max()), "scales": scales}
        if comp != "horovod":
            untold, _ = amp_run(comp, "untold")
            rec["untold_rel"] = float((untold - plain).norm() / (plain.norm()))
        out[comp] = rec
    return out


def scenario_fp16():
    out = {}
    for comp, comm in pairs(("topk", "dgc"), ("allgather", "allreduce"), named=()) + list(NAMED):
        torch.manual_seed(0)
        model = Net()
        opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.fp16, compressor=comp, communicator=comm, density=0.1, dense=False, min_selected=0)
        named = list(model.named_parameters())
        not_half, not_exact, bytes_sent = 0, 0, []
        for step in range(5):
            opt.zero_grad()
            before = {n: residual_of(opt, n, p) for n, p in named}
            x, y = data(step)
            computed = Computed(named)
            F.cross_entropy(model(x, 0), y).backward()
            acc = {n: computed.of(n, p) + before[n] for n, p in named}
            opt.step()
            for n, p in named:
                after = residual_of(opt, n, p)
                sent = acc[n] - after
                not_half += int((sent.half().float() != sent).sum())
                not_exact += int((after + sent != acc[n]).sum())
            bytes_sent.append(opt.last_stats.bytes_sent)
        out[f"{comp}+{comm}"] = {"not_half": not_half, "not_exact": not_exact, "bytes_sent": bytes_sent[-1],
                                 "replicas_equal": replicas_equal(model, f"fp16.{comp}.{comm}")}
    return out


# ---- drop-in semantics: frozen, no backward, unused on some ranks, parameters that join ------------
class Mlp(nn.Module):
    """Three layers, ``b`` the one frozen mid-training, and ``side`` used on rank 0 only."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.side = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        y = self.c(h)
        return y + self.side(h) if hvd.rank() == 0 else y


FROZEN_VARIANTS = {  # label: (SGD momentum, DistributedOptimizer keywords)
    "default": (0.0, {}),
    "default+momentum": (0.9, {}),
    "sparse": (0.0, {"dense": False}),
    "sparse+momentum": (0.9, {"dense": False}),  # momentum correction, as momentum_correction="auto" chooses
    "classic+momentum": (0.9, {"dense": False, "momentum_correction": False}),
    "dense+momentum": (0.9, {"dense": True}),
    "momentum_correction": (0.9, {"dense": False, "momentum_correction": True}),
    "topk+spardl": (0.9, {"dense": False, "compressor": "topk", "communicator": "spardl"}),
    "exdyna": (0.9, {"dense": False, "compressor": "exdyna", "communicator": "exdyna"}),
    "sparse, dense while frozen": (0.9, {"dense": False}),
}
FROZEN_COVER = ("default+momentum", "sparse", "dense+momentum", "momentum_correction", "sparse, dense while frozen")
FREEZE, NO_BACKWARD, UNFREEZE, STEPS = 4, 6, 9, 12


def momentum_of(opt, name, p):
    ctl = opt.controller
    return ctl.momentum.momentum(name).clone() if ctl.momentum is not None else torch.zeros(0)


def scenario_dropin(which):
    return {"frozen": frozen_runs(FROZEN_VARIANTS if which == "all" else FROZEN_COVER), "join": join_runs()}


def frozen_runs(labels):
    # critical steps stay float32 here, whatever the wire's timing on this machine: conservation
    # is checked exactly, and a float16 aggregate is the sum's rounding (the half_critical
    # scenario checks that wire)
    regime.HALF_MARGIN = 0.0
    out = {}
    for label in labels:
        momentum, kw = FROZEN_VARIANTS[label]
        torch.manual_seed(0)
        model = Mlp()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                       named_parameters=model.named_parameters(), density=0.1, profile_steps=2, min_selected=0, **kw)
        named = list(model.named_parameters())
        frozen = [(n, p) for n, p in named if n.startswith("b.")]
        rec = {"frozen_moved": 0.0, "frozen_residual_changed": [], "frozen_momentum_changed": [],
               "no_backward_moved": 0.0, "conservation": 0.0, "unfrozen_used": 0.0, "dense_steps": []}
        for step in range(STEPS):
            if step in (FREEZE, UNFREEZE):
                for _, p in frozen:
                    p.requires_grad_(step == UNFREEZE)
            if label.endswith("dense while frozen") and step in (FREEZE + 1, UNFREEZE - 1):
                plan = opt.plan
                opt.set_plan(FusionPlan(plan.buffers, order=plan.order, planner=plan.planner,
                                        dense=step == FREEZE + 1))
            opt.zero_grad()
            values = {n: p.detach().clone() for n, p in named}
            before = {n: residual_of(opt, n, p) for n, p in named}
            moment = {n: momentum_of(opt, n, p) for n, p in named}
            if step == NO_BACKWARD:
                opt.step()
                rec["no_backward_moved"] = max(float((p.detach() - values[n]).abs().max()) for n, p in named)
                rec["no_backward_residuals_equal"] = all(torch.equal(residual_of(opt, n, p), before[n]) for n, p in named)
                continue
            x, y = data(step, seed=7)
            computed = Computed(named)
            F.cross_entropy(model(x), y).backward()
            acc = {n: computed.of(n, p) + before[n] for n, p in named}
            opt.step()
            rec["dense_steps"].append(opt.controller.mode.dense)
            if FREEZE <= step < UNFREEZE:
                rec["frozen_moved"] = max([rec["frozen_moved"]] + [float((p.detach() - values[n]).abs().max())
                                                                   for n, p in frozen])
                rec["frozen_residual_changed"] += [step for n, p in frozen
                                                   if not torch.equal(residual_of(opt, n, p), before[n])]
                rec["frozen_momentum_changed"] += [step for n, p in frozen
                                                   if not torch.equal(momentum_of(opt, n, p), moment[n])]
            if step == UNFREEZE:  # what was kept while frozen joins this step's gradient
                rec["unfrozen_used"] = max(float(before[n].abs().sum()) for n, _ in frozen)
            if opt.local_momentum is not None:
                continue  # the residual accumulates momentum, not gradients: conservation is tested elsewhere
            sent = torch.cat([acc[n] - residual_of(opt, n, p) for n, p in named]).double()
            total = hvd.allreduce(sent, op=hvd.Sum, name=f"frozen.{label}.{step}")
            applied = torch.cat([p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                 for _, p in named]).double() * hvd.size()
            rec["conservation"] = max(rec["conservation"], float((applied - total).abs().max()))
        rec["replicas_equal"] = replicas_equal(model, f"frozen.{label}")
        out[label] = rec
    return out


class Grown(nn.Module):
    """A trunk trained from the start, a layer frozen at construction (``late``) and a frozen
    ``head``, initialised differently on every rank, that joins the optimizer later."""

    def __init__(self):
        super().__init__()
        self.trunk, self.late = nn.Linear(12, 16), nn.Linear(16, 16)
        self.late.requires_grad_(False)
        with torch.random.fork_rng():
            torch.manual_seed(100 + hvd.rank())
            self.head = nn.Linear(16, 3).requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.late(torch.tanh(self.trunk(x)))))


def join_runs():
    """``default``: the defaults but critical regimes, whose dense steps would hold the profile
    back beyond these ten steps."""
    out = {}
    variants = {"default": {"critical_regimes": None}, "sparse": {"dense": False},
                "unnamed": {"dense": False, "named": False},
                "momentum_correction": {"dense": False, "momentum_correction": True}}
    for label, kw in variants.items():
        torch.manual_seed(0)
        model = Grown()
        named = kw.pop("named", True)
        hvd.broadcast_parameters({k: v for k, v in model.state_dict().items() if not k.startswith("head.")},
                                 root_rank=0)
        base = torch.optim.SGD(list(model.trunk.parameters()) + list(model.late.parameters()), lr=0.1, momentum=0.9)
        opt = saf.DistributedOptimizer(base, named_parameters=model.named_parameters() if named else None,
                                       density=0.1, profile_steps=2, min_selected=0, **kw)
        planned = []
        for step in range(10):
            if step == 3:
                model.head.requires_grad_(True)
                opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.05})
            if step == 5:
                model.late.requires_grad_(True)
            opt.zero_grad()
            x, y = data(step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            planned.append(len(opt.plan.names))
        out[label] = {"replicas_equal": replicas_equal(model, f"join.{label}"), "planned": planned,
                      "names": sorted(opt.plan.names),
                      "profiled": sorted(t.name for t in opt.profile.tensors) if opt.profile else []}
    return out


def scenario_join_mismatch(kind):
    torch.manual_seed(0)
    model = Grown()
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.trunk.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), fusion=NaivePlanner())
    for step in range(3):
        if step == 1 and (kind == "shape" or hvd.rank() == 1):
            extra = nn.Linear(3, 2 if kind == "shape" and hvd.rank() == 1 else 3)
            opt.add_param_group({"params": list(extra.parameters())})
        opt.zero_grad()
        x, y = data(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {}


# ---- checkpoints ----------------------------------------------------------------------------
RESUME_PAIRS = [(c, "allgather") for c in COMPRESSORS] + [("dgc", "spardl"), ("dgc", "zen"), ("exdyna", "exdyna")]
SAVE_AT, TOTAL = 6, 10


class Votes(nn.Module):
    """An embedding, a layer whose gradient is concentrated on rank 0 only (one input column there,
    one output), a head, and a layer used from step 2 on."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(400, 8)
        self.mixed = nn.Linear(40, 1, bias=False)
        self.head = nn.Linear(8, 3, bias=False)
        self.late = nn.Linear(8, 3, bias=False)

    def forward(self, tokens, x, step):
        h = torch.tanh(self.words(tokens).mean(1) + self.mixed(x))
        return self.head(h) + (self.late(h) if step >= 2 else 0.0)


def scenario_spread():
    torch.manual_seed(0)
    model = Votes()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compressor="topk", dense=False,
                                   min_selected=0, dense_share=0, critical_regimes=None, profile_steps=2,
                                   momentum_correction=False)
    named = list(model.named_parameters())
    spread = opt.controller.spread
    decided_at, sent_mixed, worst = {}, [], 0.0
    for step in range(8):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        tokens = torch.randint(0, 2, (16, 4), generator=g)  # two rows of the embedding
        x = torch.randn(16, 40, generator=g)
        if hvd.rank() == 0:
            x[:, 1:] = 0  # the mixed layer's gradient: one element on rank 0
        before = {n: residual_of(opt, n, p) for n, p in named}
        computed = Computed(named)
        opt.zero_grad()
        F.cross_entropy(model(tokens, x, step), torch.randint(0, 3, (16,), generator=g)).backward()
        acc = {n: computed.of(n, p) + before[n] for n, p in named}
        opt.step()
        sent = {n: acc[n] - residual_of(opt, n, p) for n, p in named}
        sent_mixed.append(int((sent["mixed.weight"] != 0).sum()))
        total = hvd.allreduce(torch.cat([sent[n] for n, _ in named]).double(), op=hvd.Sum, name=f"spread.{step}")
        applied = torch.cat([p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                             for _, p in named]).double() * hvd.size()
        worst = max(worst, float((applied - total).abs().max()))
        for n in spread.decided:
            decided_at.setdefault(n, step)
    target = opt.controller.target_density
    k = {n: int(k) for b in opt.controller.buffers for n, k in zip(b.names, b.selection.k_array(target))}
    return {"votes": dict(zip(spread.names, spread.votes.tolist())), "decided": spread.decided,
            "decided_at": decided_at, "k": k, "sent_mixed": sent_mixed, "conservation": worst,
            "replicas_equal": replicas_equal(model, "spread")}


def scenario_tiny():
    def mlp():
        return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))

    torch.manual_seed(1234)
    teacher = mlp()
    gen = torch.Generator().manual_seed(99)
    x_eval = torch.randn(512, 10, generator=gen)
    with torch.no_grad():
        y_eval = teacher(x_eval)
    out = {}
    for label, kw in (("horovod", None), ("default", {}), ("dense=False", {"dense": False}),
                      ("every tensor sparse", {"dense": False, "min_selected": 0}),
                      ("every tensor sparse, masking everywhere", {"dense": False, "min_selected": 0,
                                                                  "momentum_masking": True}),
                      ("every tensor sparse, no masking", {"dense": False, "min_selected": 0,
                                                          "momentum_masking": False}),
                      ("every tensor sparse, 0.01", {"dense": False, "min_selected": 0, "density": 0.01})):
        torch.manual_seed(0)
        model = mlp()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters()) if kw is None else \
            saf.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **{
                "compressor": "dgc", "profile_steps": 2, **kw})
        data = torch.Generator().manual_seed(7 + hvd.rank())

        def evaluate():
            with torch.no_grad():
                return float(F.mse_loss(model(x_eval), y_eval))

        start = evaluate()
        for _ in range(300):
            x = torch.randn(32, 10, generator=data)
            with torch.no_grad():
                y = teacher(x)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        out[label] = {"start": start, "end": evaluate(), "replicas_equal": replicas_equal(model, f"tiny.{label}")}
    return out


def run_steps(model, opt, first, last):
    for step in range(first, last):
        opt.zero_grad()
        x, y = data(step)
        F.cross_entropy(model(x, step), y).backward()
        opt.step()


def residual_totals(opt):
    return {n: r.double().numpy().tolist() for n, r in opt.residuals.state_dict().items()}


def scenario_save(out_dir):
    """Train SAVE_AT steps, save, train on to TOTAL (the uninterrupted run)."""
    out = {}
    for comp, comm in RESUME_PAIRS:
        model, opt = build(comp, comm)
        run_steps(model, opt, 0, SAVE_AT)
        tag = f"{comp}+{comm}"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(out_dir, f"{tag}.rank{hvd.rank()}.pt"))
        gathered = opt.state_dict(all_ranks=True)  # a collective, on every rank
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": gathered}, os.path.join(out_dir, f"{tag}.all.pt"))
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(out_dir, f"{tag}.rank0only.pt"))
        saved_residuals = residual_totals(opt)
        run_steps(model, opt, SAVE_AT, TOTAL)
        out[tag] = {"params": flat_params(model).tolist(), "saved_residuals": saved_residuals,
                    "saved_plan": None}
    return out


def scenario_resume(out_dir, source):
    """Fresh processes: load the checkpoint ``source`` ("rank" files, "all", "rank0only") and train
    to TOTAL. With another world size, report the residuals right after loading."""
    out = {}
    for comp, comm in RESUME_PAIRS:
        tag = f"{comp}+{comm}"
        model, opt = build(comp, comm)
        path = os.path.join(out_dir, f"{tag}.rank{hvd.rank()}.pt" if source == "rank" else f"{tag}.{source}.pt")
        ckpt = torch.load(path)  # weights_only=True, torch's default
        model.load_state_dict(ckpt["model"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(ckpt["optimizer"])
        loaded = residual_totals(opt)
        run_steps(model, opt, SAVE_AT, TOTAL)
        out[tag] = {"params": flat_params(model).tolist(), "loaded_residuals": loaded,
                    "warnings": [str(w.message) for w in caught], "planner": opt.plan.planner,
                    "replicas_equal": replicas_equal(model, f"resume.{tag}")}
    return out


def scenario_killed(optimizer):
    """The last rank exits (``os._exit``) at step 3; the others train on to step 30 and record
    how far they got (Horovod's launcher, or the collective that cannot finish, must end them).
    ``optimizer``: ``horovod``, ``safusion`` (its defaults) or ``spardl-gloo`` (SparDL's rounds
    on the Gloo group beside Horovod, every tensor sparse, so the death falls in a round)."""
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    kw = {"communicator": SparDL(rounds="gloo"), "density": 0.1, "dense": False, "min_selected": 0} \
        if optimizer == "spardl-gloo" else {}
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters()) if optimizer == "horovod" else \
        saf.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), profile_steps=2, **kw)
    for step in range(30):
        if step == 3 and hvd.rank() == hvd.size() - 1:
            os._exit(3)
        opt.zero_grad()
        x, y = data(step)
        F.cross_entropy(model(x, step), y).backward()
        opt.step()
    return {"finished": True}


def main():
    hvd.init()
    torch.set_num_threads(1)
    out_dir, name, *args = sys.argv[1:]
    record = {"size": hvd.size(), "rank": hvd.rank()}
    try:
        fn = globals()[f"scenario_{name}"]
        record[name] = fn(out_dir, *args) if name in ("save", "resume") else fn(*args)
    except Exception:
        record["exception"] = traceback.format_exc()
        raise
    finally:
        with open(os.path.join(out_dir, f"{name}{''.join('.' + a for a in args)}.rank{hvd.rank()}.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
