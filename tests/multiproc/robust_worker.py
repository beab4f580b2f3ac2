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
from horovod_safusion.fusion import NaivePlanner

COMPRESSORS = ("dgc", "topk", "gaussiank", "redsync", "sidco", "randomk", "exdyna")
COMMUNICATORS = ("allgather", "allreduce", "spardl", "zen")


def pairs(compressors=COMPRESSORS, communicators=COMMUNICATORS):
    out = [(c, m) for c in compressors for m in communicators]
    return out + ([("exdyna", "exdyna")] if "exdyna" in compressors else [])


def covering_pairs():
    """Every compressor once and every communicator once (for the slower oversubscribed jobs)."""
    return ([(c, "allgather") for c in COMPRESSORS] + [("dgc", m) for m in COMMUNICATORS if m != "allgather"]
            + [("exdyna", "exdyna")])


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
    torch.manual_seed(seed)
    model = Net()
    kw.setdefault("profile_steps", 2)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compressor=comp,
                                   communicator=comm, **kw, dense=False)
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
                grads = {n: p.grad.detach().reshape(-1).clone() for n, p in named}
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
                grads = None
            if grads is not None:
                continue  # clipping changed p.grad: conservation is checked on the other steps
            sent = {n: acc[n] - residual_of(opt, n, p) for n, p in named}
            total = hvd.allreduce(torch.cat([sent[n] for n, _ in named]).double(), op=hvd.Sum, name=f"edge.{comp}.{comm}.{step}")
            applied = torch.cat([p.grad.detach().reshape(-1) for _, p in named]).double() * hvd.size()
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
                                       density=0.1, profile_steps=2, **kw, dense=False)
        assert not kw or opt._controller.loss_scale is not None
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
    for comp, comm in pairs(("topk", "dgc"), ("allgather", "allreduce")):
        torch.manual_seed(0)
        model = Net()
        opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.fp16, compressor=comp, communicator=comm, density=0.1, dense=False)
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


# ---- checkpoints ----------------------------------------------------------------------------
RESUME_PAIRS = [(c, "allgather") for c in COMPRESSORS] + [("dgc", "spardl"), ("dgc", "zen"), ("exdyna", "exdyna")]
SAVE_AT, TOTAL = 6, 10


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
