"""Multi-process checks of the seeds' sparse collectives (``spardl``, ``exdyna``, ``zen``) and
ScaleCom's (``scalecom``), run by ``test_collectives.py`` under ``horovodrun`` with 2, 3 and 4
workers.

Each scenario runs on every rank with rank-dependent data (real gradients of the digits CNN) and
writes one JSON record per rank. References are computed independently of the communicators:
Horovod's own dense ``DistributedOptimizer``, or every rank's dense gradient and residuals
gathered with ``hvd.allgather_object``.

    horovodrun -np 3 -H localhost:3 --gloo python tests/multiproc/collectives_worker.py OUT_DIR [scenario,...] [comm,...]
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
import horovod.torch as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits import DigitsCNN, accuracy, load_digits_split  # noqa: E402

import horovod_safusion as saf  # noqa: E402
from horovod_safusion.communicators import SparDL, Zen  # noqa: E402
from horovod_safusion.fusion import NaivePlanner  # noqa: E402

DATA = None
COMMS = ["spardl", "spardl-teams", "exdyna", "zen-bp", "zen-hc", "zen-collide",
         "spardl-gloo", "spardl-horovod", "zen-bp-gloo", "zen-hc-gloo", "zen-bp-sparse", "scalecom",
         "scalecom-sparse", "exdyna-predivide", "scalecom-predivide"]
#: The conservation scenario's density where it is not 0.05: ZEN's pull sends COO, not the bitmap,
#: where an owner's aggregate is sparser than 1/32 of its index set; so does ScaleCom's leader.
CONSERVATION_DENSITY = {"zen-bp-sparse": 0.005, "scalecom-sparse": 0.005}
FACTORIES = {"allgather": lambda: "allgather", "spardl": lambda: "spardl", "exdyna": lambda: "exdyna", "zen": lambda: "zen",
             "scalecom": lambda: "scalecom", "scalecom-sparse": lambda: "scalecom",
             # Horovod's prescale and postscale (gradient_predivide_factor): what goes back is unscaled
             "exdyna-predivide": lambda: "exdyna", "scalecom-predivide": lambda: "scalecom",
             "zen-bp": lambda: Zen(scheme="bp"), "zen-hc": lambda: Zen(scheme="hc"),
             "zen-bp-sparse": lambda: Zen(scheme="bp"),
             # the rounds' transports by name (the others measure: "auto")
             "spardl-gloo": lambda: SparDL(rounds="gloo"), "spardl-horovod": lambda: SparDL(rounds="horovod"),
             "zen-bp-gloo": lambda: Zen(scheme="bp", rounds="gloo"), "zen-hc-gloo": lambda: Zen(scheme="hc", rounds="gloo"),
             # one parallel slot per partition, one rehash: nearly every index collides (Horovod's rounds)
             "zen-collide": lambda: Zen(scheme="bp", hash_slots=1, rehash=1, rounds="horovod"),
             # SparDL §3.3: 2 teams use R-SAG (2 workers: teams of 1; 4 workers: teams of 2), 3 teams B-SAG
             "spardl-teams": lambda: SparDL(teams=3 if hvd.size() == 3 else 2)}


def comm_args(label: str, compressor: str = "topk") -> dict:
    """``communicator=`` and its compressor (``exdyna`` always goes with ``exdyna``), and Horovod's
    ``gradient_predivide_factor`` for the ``-predivide`` labels."""
    args = {"communicator": FACTORIES[label](), "compressor": "exdyna" if label.startswith("exdyna") else compressor}
    return args | ({"gradient_predivide_factor": 2.0} if label.endswith("-predivide") else {})


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


def scenario_density_one():
    """At density 1 every communicator gives Horovod's dense average (to float rounding)."""
    out = {}
    for comm in COMMS:
        ref_m, our_m = make(), make()
        ref = hvd.DistributedOptimizer(torch.optim.SGD(ref_m.parameters(), lr=0.1),
                                       named_parameters=ref_m.named_parameters())
        ours = saf.DistributedOptimizer(torch.optim.SGD(our_m.parameters(), lr=0.1),
                                        named_parameters=our_m.named_parameters(), density=1.0,
                                        fusion=NaivePlanner(capacity_bytes=8192), **comm_args(comm), dense=False, min_selected=0)
        worst = 0.0
        for step in range(2):
            x, y = batch(step)
            for m, o in ((ref_m, ref), (our_m, ours)):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()
            worst = max(worst, max_diff([p.grad for p in ref_m.parameters()], [p.grad for p in our_m.parameters()]))
        scale = max(float(p.grad.abs().max()) for p in ref_m.parameters())
        out[comm] = {"grad_diff": worst, "grad_scale": scale, "buffers": len(ours.plan.buffers),
                     "leftover_abs": sum(float(r.abs().sum()) for r in ours.residuals.state_dict().values())}
    return out


class Branchy(nn.Module):
    """The digits CNN plus a head used on rank 0 only: a parameter without gradient elsewhere."""

    def __init__(self):
        super().__init__()
        self.net = DigitsCNN(width=8)
        self.only_rank0 = nn.Linear(10, 10)

    def forward(self, x):
        h = self.net(x)
        return h + self.only_rank0(h) if hvd.rank() == 0 else h


def scenario_conservation():
    """density 0.05 (:data:`CONSERVATION_DENSITY` where not): Σ_ranks residual_after + P·applied ==
    Σ_ranks (gradient + residual_before), with threshold compressors (each rank selects its own
    count) and a parameter only rank 0 uses. ZEN records which format its pulls used."""
    out = {}
    for comm in COMMS:
        torch.manual_seed(0)
        m = Branchy()
        opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), named_parameters=m.named_parameters(),
                                       density=CONSERVATION_DENSITY.get(comm, 0.05), fusion=NaivePlanner(capacity_bytes=16384),
                                       **comm_args(comm, "dgc"), dense=False, min_selected=0)  # a threshold: counts differ by rank
        named = list(m.named_parameters())
        worst, scale, same = 0.0, 0.0, True
        for step in range(4):
            before = [opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in named]
            opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(m(x), y).backward()
            acc = [(p.grad.detach().view(-1) if p.grad is not None else torch.zeros(p.numel())) + r
                   for (_, p), r in zip(named, before)]
            opt.synchronize()
            after = [opt.residuals.get(n, p.detach().view(-1)).clone() for n, p in named]
            applied_all = [p.grad.detach().view(-1).double().numpy() for _, p in named]
            everyone = hvd.allgather_object(([a.double().numpy() for a in acc], [a.double().numpy() for a in after],
                                             applied_all), name=f"cons.{comm}")
            same = same and all(np.array_equal(a, b) for r in everyone[1:] for a, b in zip(everyone[0][2], r[2]))
            for i, (_, p) in enumerate(named):
                applied = p.grad.detach().view(-1).double().numpy()
                lhs = sum(r[1][i] for r in everyone) + hvd.size() * applied
                rhs = sum(r[0][i] for r in everyone)
                worst = max(worst, float(np.abs(lhs - rhs).max()))
                scale = max(scale, float(np.abs(rhs).max()))
            with opt.skip_synchronize():
                opt.step()
        out[comm] = {"conservation_diff": worst, "scale": scale, "density": opt.last_stats.density, "same_update": same,
                     "bytes_received": opt.last_stats.bytes_received,
                     "serial": sum(h.get("serial", 0) for h in getattr(opt.communicator, "history", [])),
                     "pull_coo": sum(h.get("pull_coo", 0) for h in getattr(opt.communicator, "history", []))}
    return out


def scenario_training():
    """``fusion="safusion"`` end to end: a short run learns and the replicas stay identical."""
    out = {}
    for comm in TRAINED:
        m = make(width=16)
        opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05 * hvd.size(), momentum=0.9),
                                       named_parameters=m.named_parameters(), density=TRAINED_DENSITY.get(comm, 0.1),
                                       fusion="safusion",
                                       profile_steps=3, **comm_args(comm), dense=False, min_selected=0)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        for step in range(60):
            opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(m(x), y).backward()
            opt.step()
        _, _, x_te, y_te = DATA
        same = hvd.allgather_object([p.detach().numpy() for p in m.parameters()], name=f"train.{comm}")
        out[comm] = {"acc": accuracy(m, x_te, y_te), "planner": opt.plan.planner,
                     "zen_choice": sorted(set(getattr(opt.communicator, "choice", {}).values())),
                     "replicas_equal": all(np.array_equal(a, b) for r in same[1:] for a, b in zip(same[0], r))}
    return out


TRAINED = ["spardl", "exdyna", "zen", "scalecom"]
#: ScaleCom applies one leader's k elements of the sum a step, where the others apply up to P·k
#: (the union of the ranks' selections): it trains at a density that applies about as many.
TRAINED_DENSITY = {"scalecom": 0.3}


def main():
    global DATA, COMMS, TRAINED
    hvd.init()
    torch.set_num_threads(1)
    DATA = load_digits_split()
    out_dir = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else \
        [n[len("scenario_"):] for n in globals() if n.startswith("scenario_")]
    if len(sys.argv) > 3:
        COMMS = TRAINED = sys.argv[3].split(",")
    results = {"size": hvd.size(), "rank": hvd.rank(), "seconds": {}, "communicators": COMMS}
    for name in names:
        try:
            t0 = time.perf_counter()
            results[name] = globals()[f"scenario_{name}"]()
            results["seconds"][name] = time.perf_counter() - t0
        except Exception:  # record, so pytest shows which scenario failed and why
            results[name] = {"exception": traceback.format_exc()}
            raise
        finally:
            with open(os.path.join(out_dir, f"rank{hvd.rank()}.json"), "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
