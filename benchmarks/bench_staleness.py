"""Why error feedback with momentum diverges when every tensor goes sparse: the delay it adds.

    python benchmarks/bench_staleness.py [--seeds 0 1 2 --steps 300 --densities 0.01 0.03 0.1 0.3]
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_staleness.py   (same, 2 workers)

Error feedback sends every gradient element, but late: an element waits in the residual until it
is among the largest, so at density δ an element waits about 1/δ steps (the "virtual iterate" of
error feedback runs the dense method on gradients taken at the delayed point; Stich and
Karimireddy, JMLR 2020, §3). Heavy-ball momentum tolerates little delay: delay acts as extra
momentum (Mitliagkas et al., "Asynchrony begets momentum", 2016, §3). DGC's momentum masking
(Lin et al., ICLR'18, §3.2) clears the momentum of what was sent, which damps exactly that.

The problem is the robustness tests' tiny regression MLP (``Linear(10, 32)``, ``Tanh``,
``Linear(32, 1)`` fitting a teacher MLP; SGD, by default lr 0.05, momentum 0.9, batches of 32),
trained two ways:

* ``dense, delay d``: plain PyTorch, each step applies the gradient of d steps before (d = 0 is
  what Horovod computes);
* the plugin with every tensor sparsified (``dense=False, min_selected=0``) at each density, with
  its default error feedback (``momentum_correction="auto"``: DGC's momentum correction with
  masking by tensor for this SGD, ``momentum_masking="auto"``; ``dense=False`` turns the default's
  critical regimes off), the same with masking in every tensor (``mask``,
  ``momentum_masking=True``) and without masking (``nomask``, ``False``), classic error feedback
  (``momentum_correction=False``), the correction forced with masking (``True``), and the
  default with Accordion's critical regimes at the default's interval of 10 steps
  (``critical_regimes=10``, what the default does where it sends sparse: an interval whose
  update's norm changed by half or more sends the next one dense),
  masking and critical regimes together (``mc+mask+regimes``), and EF21-SGDM
  (``error_feedback="ef21-sgdm"``, Fatkhullin et al., NeurIPS'23, Algorithm 1).

The table gives the median over seeds of the final evaluation loss ("diverged" where it is not
finite), its ratio to ``dense, delay 0``, the number of seeds that ended within 10× of it, and the
mean fraction of elements sent. The
curves go to ``--out``/staleness.png, the records to results.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
import horovod.torch as hvd
from tqdm import tqdm

import horovod_safusion as saf
from horovod_safusion.regime import DEFAULT_INTERVAL

VARIANTS = {"default": {}, "mask": {"momentum_masking": True}, "nomask": {"momentum_masking": False},
            "classic": {"momentum_correction": False},
            "mc+mask": {"momentum_correction": True},
            "regimes": {"critical_regimes": DEFAULT_INTERVAL},
            "mc+mask+regimes": {"momentum_correction": True, "critical_regimes": DEFAULT_INTERVAL},
            "ef21": {"error_feedback": "ef21-sgdm", "momentum_correction": False}}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))


def teacher_and_eval() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1234)
    teacher = mlp()
    x = torch.randn(512, 10, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return teacher, x, teacher(x)


def train(args, seed: int, delay: int | None = None, density: float | None = None, variant: str | None = None) -> dict:
    """One run: dense with ``delay`` steps of gradient delay, or the plugin at ``density`` with ``variant``."""
    teacher, x_eval, y_eval = teacher_and_eval()
    torch.manual_seed(seed)
    model = mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = sgd if delay is not None else saf.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(), compressor="dgc", density=density, dense=False,
        min_selected=0, profile_steps=2, **VARIANTS[variant])
    data = torch.Generator().manual_seed(7 + hvd.rank() + 1000 * seed)
    waiting: deque[list[torch.Tensor]] = deque()
    curve, sent = [], []
    for step in range(args.steps):
        x = torch.randn(32, 10, generator=data)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if delay is None:
            opt.step()
            sent.append(opt.last_stats.density)
        else:
            for i, p in enumerate(model.parameters()):
                p.grad = hvd.allreduce(p.grad, name=f"delay.{i}")
            waiting.append([p.grad.clone() for p in model.parameters()])
            if len(waiting) > delay:
                for p, g in zip(model.parameters(), waiting.popleft()):
                    p.grad = g
                opt.step()
        if (step + 1) % args.eval_every == 0:
            with torch.no_grad():
                curve.append(float(F.mse_loss(model(x_eval), y_eval)))
    return {"seed": seed, "delay": delay, "density": density, "variant": variant, "curve": curve,
            "end": curve[-1], "sent": float(np.mean(sent)) if sent else 1.0}


def label(r: dict) -> str:
    return f"dense, delay {r['delay']}" if r["delay"] is not None else f"{r['variant']} @ {r['density']:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--delays", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default="out/bench_staleness")
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    runs = [{"delay": d} for d in args.delays] + \
        [{"density": p, "variant": v} for v in args.variants for p in args.densities]
    rows = [train(args, s, **r) for r in tqdm(runs, desc="runs", disable=hvd.rank() != 0) for s in args.seeds]
    if hvd.rank() != 0:
        return
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(label(r), []).append(r)
    reference = float(np.median([r["end"] for r in groups["dense, delay 0"]])) if 0 in args.delays else math.nan
    print(f"\ntiny MLP, {hvd.size()} worker(s), SGD lr {args.lr:g} momentum {args.momentum:g}, {args.steps} steps, "
          f"seeds {args.seeds}; final evaluation loss (median), against dense without delay")
    print(f"{'run':<20} {'final loss':>11} {'÷ dense':>9} {'within 10×':>10} {'sent':>6}")
    for name, rs in groups.items():
        end = float(np.median([r["end"] if math.isfinite(r["end"]) else math.inf for r in rs]))
        within = sum(math.isfinite(r["end"]) and r["end"] <= 10 * reference for r in rs)
        shown = f"{end:>11.3g} {end / reference:>9.3g}" if math.isfinite(end) else f"{'diverged':>11} {'':>9}"
        print(f"{name:<20} {shown} {within:>6}/{len(rs):<3} {np.mean([r['sent'] for r in rs]):>6.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "workers": hvd.size(), "rows": rows}, f, indent=1)
    plot(groups, args, os.path.join(args.out, "staleness.png"))
    print(f"wrote {args.out}/results.json, staleness.png")


def plot(groups: dict[str, list[dict]], args, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [args.eval_every * (i + 1) for i in range(args.steps // args.eval_every)]
    fig, axes = plt.subplots(1, 1 + len(args.variants), figsize=(4 * (1 + len(args.variants)), 3.4), sharey=True)
    panels = ["dense"] + list(args.variants)
    for ax, panel in zip(axes, panels):
        for name, rs in groups.items():
            if panel == ("dense" if rs[0]["delay"] is not None else rs[0]["variant"]):
                median = np.median(np.array([r["curve"] for r in rs]), axis=0)
                ax.plot(steps, np.clip(median, 1e-4, 1e6), label=name)
        ax.set_yscale("log")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("evaluation loss (median; clipped at 1e6)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
