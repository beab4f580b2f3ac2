"""Convergence of every fusion scheme side by side (SAFusion §5 Experiment 1, at small scale).

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_accuracy.py [--epochs 10]

The same model (a CIFAR-style ResNet-18, 62 parameter tensors), data (scikit-learn's digits),
seeds and epochs for the dense baseline (``horovod``) and each sparse scheme at density 0.01 with
DGC; every sparse scheme uses the same compressor and error feedback, so only fusion differs.
Prints the test accuracy per epoch and the final one per scheme, with the mean tensor missing rate,
and draws the accuracy curves (PNG) into ``--out``.
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
from schemes import SCHEMES, batch, make_optimizer  # noqa: E402


def train(scheme: str, args, data) -> dict:
    x, y, x_te, y_te = data
    torch.manual_seed(args.seed)
    model = resnet18(width=args.width)
    opt = make_optimizer(scheme, model, args.lr, args.compressor, args.density, args.profile_steps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    per_epoch = len(x) // (args.batch_size * hvd.size())
    curve, missing = [], []
    for epoch in range(args.epochs):
        model.train()
        for i in range(per_epoch):
            sl = batch(epoch * per_epoch + i, hvd.rank(), hvd.size(), args.batch_size, len(x))
            opt.zero_grad()
            F.cross_entropy(model(x[sl]), y[sl]).backward()
            opt.step()
            missing.append(opt.last_stats.missing_rate)
        curve.append(accuracy(model, x_te, y_te))
    return {"scheme": scheme, "accuracy": curve, "final": curve[-1], "missing": float(np.mean(missing)),
            "buffers": len(opt.plan.buffers)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    ap.add_argument("--compressor", default="dgc")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--width", type=int, default=8, help="ResNet-18 base width")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_accuracy")
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    data = load_digits_split()
    rows = [train(s, args, data) for s in tqdm(args.schemes, desc="schemes", disable=hvd.rank() != 0)]
    if hvd.rank() != 0:
        return
    print(f"\nResNet-18 w{args.width} on digits, {hvd.size()} workers, batch {args.batch_size}/worker, "
          f"{args.compressor}@{args.density:g} (horovod: dense), {args.epochs} epochs, seed {args.seed}")
    print(f"{'scheme':<10} {'buffers':>7} {'missing':>8} {'final acc':>9}   accuracy per epoch")
    for r in rows:
        print(f"{r['scheme']:<10} {r['buffers']:>7} {100 * r['missing']:>7.1f}% {r['final']:>9.4f}   "
              + " ".join(f"{a:.3f}" for a in r["accuracy"]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "workers": hvd.size(), "rows": rows}, f, indent=1)
    plot(rows, args, os.path.join(args.out, "accuracy.png"))
    print(f"wrote {args.out}/results.json, accuracy.png")


def plot(rows, args, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for r in rows:
        ax.plot(range(1, len(r["accuracy"]) + 1), r["accuracy"], marker=".", label=f"{r['scheme']} ({r['final']:.3f})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"ResNet-18 w{args.width}, {args.compressor}@{args.density:g}, {hvd.size()} workers", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
