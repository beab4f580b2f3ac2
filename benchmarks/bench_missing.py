"""Tensor missing against fusion degree, behind vs ahead (SAFusion §2.4, Observation #1, Figure 3).

    python benchmarks/bench_missing.py [--degrees 0 0.25 0.5 0.75 1 --epochs 3]
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_missing.py   (same, 2 workers)

A CIFAR-style ResNet-18 (62 parameter tensors) trains on scikit-learn's digits with DGC at density
0.01 through ``horovod_safusion.DistributedOptimizer``; the buffers hold ``degree · N`` consecutive
tensors each ("fusion degree = 100 % means all the tensors are fused together in a single buffer",
§2.4), selected over each whole buffer (``behind``) or per tensor on the same buffers
(``ahead``). After each step the optimizer reports the fraction of tensors of which no element
was selected (``last_stats.missing_rate``); the table gives its mean after warm-up, and the test
accuracy after the last epoch, per degree and order. A PNG and a JSON file go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
import horovod.torch as hvd
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from digits import accuracy, load_digits_split  # noqa: E402
from models import resnet18  # noqa: E402
from schemes import batch  # noqa: E402

import horovod_safusion as saf  # noqa: E402
from horovod_safusion.fusion import FusionDegreePlanner  # noqa: E402


def run(degree: float, order: str, args, data) -> dict:
    x, y, x_te, y_te = data
    torch.manual_seed(args.seed)
    model = resnet18(width=args.width)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), compressor=args.compressor,
                                   density=args.density, fusion=FusionDegreePlanner(degree, order))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    steps = args.epochs * (len(x) // (args.batch_size * hvd.size()))
    missing = []
    for step in range(steps):
        sl = batch(step, hvd.rank(), hvd.size(), args.batch_size, len(x))
        model.train()
        opt.zero_grad()
        F.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.step()
        if step >= args.warmup:
            missing.append(opt.last_stats.missing_rate)
    rate = hvd.allreduce(torch.tensor(float(np.mean(missing))), name="missing").item()
    return {"degree": degree, "order": order, "buffers": len(opt.plan.buffers), "missing": rate,
            "accuracy": accuracy(model, x_te, y_te)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--degrees", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--compressor", default="dgc")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5, help="steps before missing rates are recorded")
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--width", type=int, default=8, help="ResNet-18 base width")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_missing")
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    data = load_digits_split()
    rows = [run(d, o, args, data) for d in tqdm(args.degrees, desc="fusion degrees", disable=hvd.rank() != 0)
            for o in ("behind", "ahead")]
    if hvd.rank() != 0:
        return
    print(f"\nResNet-18 w{args.width} on digits, {hvd.size()} worker(s), {args.compressor}@{args.density:g}, "
          f"{args.epochs} epochs; missing = tensors with no element selected / all tensors (mean per step)")
    print(f"{'degree':>7} {'buffers':>7} | {'behind missing':>14} {'accuracy':>8} | {'ahead missing':>13} {'accuracy':>8}")
    by = {(r["degree"], r["order"]): r for r in rows}
    for d in args.degrees:
        b, a = by[(d, "behind")], by[(d, "ahead")]
        print(f"{100 * d:>6.0f}% {b['buffers']:>7} | {100 * b['missing']:>13.1f}% {b['accuracy']:>8.3f} | "
              f"{100 * a['missing']:>12.1f}% {a['accuracy']:>8.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "workers": hvd.size(), "rows": rows}, f, indent=1)
    plot(by, args, os.path.join(args.out, "missing.png"))
    print(f"wrote {args.out}/results.json, missing.png")


def plot(by, args, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [100 * d for d in args.degrees]
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for order, style in (("behind", "o-"), ("ahead", "s--")):
        ax.plot(xs, [100 * by[(d, order)]["missing"] for d in args.degrees], style, label=f"missing, {order}")
    ax.set_xlabel("fusion degree (%)")
    ax.set_ylabel("tensor missing rate (%)")
    ax2 = ax.twinx()
    for order, style in (("behind", "o:"), ("ahead", "s:")):
        ax2.plot(xs, [by[(d, order)]["accuracy"] for d in args.degrees], style, alpha=0.6, label=f"accuracy, {order}")
    ax2.set_ylabel("test accuracy")
    fig.legend(fontsize=7, loc="upper center", ncol=2)
    ax.set_title(f"ResNet-18 w{args.width}, {args.compressor}@{args.density:g}", fontsize=9, pad=28)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
