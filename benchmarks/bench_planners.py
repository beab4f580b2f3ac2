"""Measured iteration time of SAFusion's planners side by side: naive, inter, inter+intra (§3.1–3.3).

``safusion-paper`` is Steps 1–2 of §3.3 exactly as specified; ``safusion`` (the default) adds the
simulator guard described in :mod:`horovod_safusion.fusion.safusion`.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_planners.py [--reps 3 --steps 10]

One job runs every planner on the same model (CIFAR-style ResNet-18, 62 parameter tensors) and
real data (scikit-learn's digits), in interleaved repetitions so that machine noise hits all alike.
Each run warms up (and, for ``safusion``, profiles online and switches plans) before its timed
steps. The table gives the median time per step over repetitions, its spread, the ratio to
``safusion-naive``, and the pipeline simulator's prediction for each plan under the profile that
the ``safusion`` run measured. A PNG bar chart and a JSON file go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import horovod.torch as hvd
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from digits import load_digits_split  # noqa: E402
from models import resnet18  # noqa: E402

import horovod_safusion as saf  # noqa: E402
from horovod_safusion.fusion import InterPlanner, NaivePlanner, SAFusionPlanner, simulate  # noqa: E402


def planners(args):
    return {"safusion-naive": lambda: NaivePlanner(args.capacity_bytes),
            "safusion-inter": lambda: InterPlanner(args.num_buffers),
            "safusion-paper": lambda: SAFusionPlanner(guard=False),
            "safusion": lambda: SAFusionPlanner()}


def run(name, make_planner, args, data):
    x_tr, y_tr = data
    torch.manual_seed(args.seed)
    model = resnet18(width=args.width)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(), compressor=args.compressor,
                                   density=args.density, fusion=make_planner(), profile_steps=args.profile_steps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    warm = 1 + args.profile_steps + 2
    times = []
    for step in range(warm + args.steps):
        i = ((step * hvd.size() + hvd.rank()) * args.batch_size) % (len(x_tr) - args.batch_size)
        xb, yb = x_tr[i:i + args.batch_size], y_tr[i:i + args.batch_size]
        if step >= warm:
            hvd.allreduce(torch.zeros(1), name="bench.barrier")  # start timed steps together
            t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        if step >= warm:
            times.append(time.perf_counter() - t0)
    # The job is as fast as its slowest rank.
    per_step = hvd.allreduce(torch.tensor(float(np.median(times))), op=hvd.Max, name=f"bench.{name}").item()
    return per_step, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16, help="per worker")
    ap.add_argument("--width", type=int, default=32, help="ResNet-18 base width (64 is the standard)")
    ap.add_argument("--compressor", default="dgc")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--capacity-bytes", type=int, default=25 * 2**20)
    ap.add_argument("--num-buffers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_planners")
    args = ap.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    x_tr, y_tr, _, _ = load_digits_split()
    measured = {n: [] for n in planners(args)}
    plans, profile, chosen = {}, None, None
    total = args.reps * len(measured)
    with tqdm(total=total, desc="runs", disable=hvd.rank() != 0) as bar:
        for rep in range(args.reps):
            for name, make in planners(args).items():
                per_step, opt = run(name, make, args, (x_tr, y_tr))
                measured[name].append(per_step)
                plans[name] = opt.plan
                if name == "safusion":
                    profile = opt.profile
                    chosen = opt.plan.meta.get("chosen")
                bar.update()
    if hvd.rank() != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    predicted = {n: simulate(profile, plans[n]).iteration for n in measured}
    base = float(np.median(measured["safusion-naive"]))
    n_tensors = len(profile.tensors)
    print(f"safusion's guard chose the {chosen} plan")
    print(f"\nResNet-18 (width {args.width}, {n_tensors} tensors), {hvd.size()} workers, batch {args.batch_size}/worker, "
          f"{args.compressor}@{args.density:g}, {args.reps} reps x {args.steps} timed steps")
    print(f"{'planner':<16} {'buffers':>7} {'measured ms':>11} {'min..max':>15} {'vs naive':>8} {'predicted ms':>12}")
    rows = []
    for n, ts in measured.items():
        med = float(np.median(ts))
        rows.append({"planner": n, "buffers": len(plans[n].buffers), "measured_ms": 1e3 * med,
                     "runs_ms": [1e3 * t for t in ts], "speedup_vs_naive": base / med,
                     "predicted_ms": 1e3 * predicted[n]})
        print(f"{n:<16} {len(plans[n].buffers):>7} {1e3 * med:>11.1f} {1e3 * min(ts):>7.1f}..{1e3 * max(ts):<7.1f} "
              f"{base / med:>7.2f}x {1e3 * predicted[n]:>12.1f}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "safusion_plan": plans["safusion"].to_dict()}, f, indent=1)
    profile.save(os.path.join(args.out, "profile.json"))
    plot(rows, os.path.join(args.out, "planners.png"), args)
    print(f"wrote {args.out}/results.json, profile.json, planners.png")


def plot(rows, path, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["planner"] for r in rows]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(x - 0.2, [r["measured_ms"] for r in rows], 0.4, label="measured (median)")
    for i, r in enumerate(rows):
        ax.plot([i - 0.2] * len(r["runs_ms"]), r["runs_ms"], "k.", ms=4)
    ax.bar(x + 0.2, [r["predicted_ms"] for r in rows], 0.4, label="predicted (simulator)", alpha=0.7)
    ax.set_xticks(x, [f"{n}\n({r['buffers']} buffers)" for n, r in zip(names, rows)], fontsize=8)
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"ResNet-18 w{args.width}, {args.compressor}@{args.density:g}, {hvd.size()} workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
