"""Compressors on real gradients: actual density, missing tensors, and ahead-vs-behind cost.

    python benchmarks/bench_compressors.py [--iterations 200 --densities 0.01 0.001]

A CIFAR-style ResNet-18 (62 parameter tensors) trains on scikit-learn's digits with plain SGD;
at every iteration every compressor, at every density, in both orders — ``ahead`` (one segment per
tensor, SAFusion §3.1) and ``behind`` (one segment per fusion buffer, §2.4) — selects from the same
gradients on the same four aligned fusion buffers, each configuration with its own error-feedback
residuals, in an order shuffled anew every iteration (whichever runs first after back-propagation
pays for cold caches and fresh memory: run first every time, a configuration measured up to 40 %
slower). After ``--warmup`` iterations it records the actual density (the fraction of elements
selected), the fraction of tensors with a nonzero gradient but no selected element ("missing",
§2.4), and the selection time per iteration: its mean is the cost training pays and the ratio
compared; the ratio of medians is printed beside it (a median leaves out the periodic
re-estimations where they fall on the same iterations — every buffer's, behind — but not where
refinements spread them over iterations, ahead: on SIDCo it flattered ``behind`` by up to 20 %).
It prints a table, draws a PNG, and writes each compressor's cost curve (seconds against dense
bytes, plus the per-segment cost) as JSON in the format of
:class:`horovod_safusion.fusion.CostCurve`.

``--device cuda`` trains and selects on a GPU: every compressor then takes the device path
(:meth:`Compressor.propose` and one host read per buffer, as the controller's
:class:`~horovod_safusion.stages.select.DeviceSelection` does), and each selection is timed
between two synchronisations of the device. On the GPU machines Horovod is not installed: run it
through ``tests/gpu/gpu_env.py`` (``benchmarks/gpu_check.sh`` does).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from digits import load_digits_split  # noqa: E402
from models import resnet18  # noqa: E402

from horovod_safusion.compressors import available_compressors, make_compressor  # noqa: E402
from horovod_safusion.compressors import sparsify  # noqa: E402
from horovod_safusion.compressors.device import on_host  # noqa: E402
from horovod_safusion.fusion import InterPlanner, TensorInfo  # noqa: E402
from horovod_safusion.segment import Segments  # noqa: E402

COMPRESSORS = [c for c in available_compressors() if c != "none"]


class Config:
    """One compressor at one density in one order, with its own residual per buffer."""

    def __init__(self, name, density, order, buffers, device):
        self.name, self.density, self.order = name, density, order
        self.compressor = make_compressor(name, density)
        self.residual = [torch.zeros(sum(b.sizes), device=device) for b in buffers]
        self.density_log, self.missing_log, self.seconds_log = [], [], []
        # What the compressor promises: k = max(1, round(density * n)) per segment.
        self.whole = [Segments((f"buffer{b}",), (s.numel,), device) for b, s in enumerate(buffers)]
        segs = buffers if order == "ahead" else self.whole
        self.promised = sum(int(s.k(density).sum()) for s in segs) / sum(b.numel for b in buffers)

    def step(self, step, grads, buffers, record):
        selected = missing = live = 0
        elapsed = 0.0
        for b, (tensor_segs, grad) in enumerate(zip(buffers, grads)):
            acc = self.residual[b].add_(grad)  # in place, as the controller's fusion buffer
            segs = tensor_segs if self.order == "ahead" else self.whole[b]
            synchronize(acc.device)
            t0 = time.perf_counter()
            indices = select(self.compressor, acc, segs, step)  # acc becomes the residual
            synchronize(acc.device)
            elapsed += time.perf_counter() - t0
            counts = tensor_segs.counts(indices)
            nonzero = torch.stack([p.abs().amax() for p in (grad + 0).split(list(tensor_segs.sizes))]) > 0
            selected += int(counts.sum())
            missing += int(((counts == 0) & nonzero).sum())
            live += int(nonzero.sum())
        if record:
            total = sum(b.numel for b in buffers)
            self.density_log.append(selected / total)
            self.missing_log.append(missing / max(live, 1))
            self.seconds_log.append(elapsed)


def select(compressor, flat: torch.Tensor, segments: Segments, step: int) -> torch.Tensor:
    """The selected indices, by the path the controller takes for ``flat``; the rest stays in it."""
    if on_host(flat):
        return sparsify(compressor, flat, segments, step)[1]
    (_, indices, _), _ = compressor.propose(flat, segments, step).decide()
    return indices


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--width", type=int, default=16, help="ResNet-18 base width")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--buffers", type=int, default=4, help="aligned fusion buffers (safusion-inter's M)")
    ap.add_argument("--compressors", nargs="+", default=COMPRESSORS, choices=COMPRESSORS)
    ap.add_argument("--device", default="cpu", help="cpu (the host path) or cuda (the device path)")
    ap.add_argument("--curves", action=argparse.BooleanOptionalAction, default=True,
                    help="write the cost curves (they need Horovod: --no-curves on the GPU machines)")
    ap.add_argument("--out", default="out/bench_compressors")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(args.device)

    x, y, _, _ = load_digits_split()
    x, y = x.to(device), y.to(device)
    model = resnet18(width=args.width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = [(n, p) for n, p in model.named_parameters()][::-1]  # back-propagation order
    plan = InterPlanner(args.buffers).plan([TensorInfo(n, p.numel(), 4, "f32") for n, p in named])
    params = dict(named)
    buffers = [Segments(tuple(b), tuple(params[n].numel() for n in b), device) for b in plan.buffers]
    configs = [Config(c, d, o, buffers, device) for d in args.densities for c in args.compressors for o in ("ahead", "behind")]

    for it in tqdm(range(args.iterations), desc="iterations"):
        i = (it * args.batch_size) % (len(x) - args.batch_size)
        opt.zero_grad()
        F.cross_entropy(model(x[i:i + args.batch_size]), y[i:i + args.batch_size]).backward()
        opt.step()
        grads = [torch.cat([params[n].grad.reshape(-1) for n in b]) for b in plan.buffers]
        for cfg in random.Random(it).sample(configs, len(configs)):
            cfg.step(it, grads, buffers, record=it >= args.warmup)

    rows = report(configs, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    plot(rows, args, os.path.join(args.out, "compressors.png"))
    print(f"wrote {args.out}/results.json, compressors.png")
    if args.curves:
        write_curves(args, [p.numel() for p in params.values()], device)


def write_curves(args, numels: list[int], device: torch.device) -> None:
    """Each compressor's cost curve at density 0.01, as the profile sweeps it."""
    from horovod_safusion.sweeps import compression_sweep, sweep_source  # imports Horovod

    curves = {}
    for name in tqdm(args.compressors, desc="cost curves"):
        sizes, seconds, per_segment = compression_sweep(make_compressor(name, 0.01), numels,
                                                        sweep_source([], max(numels), torch.float32, device))
        curves[name] = {"sizes": sizes, "seconds": seconds, "segment_cost": per_segment}
    with open(os.path.join(args.out, "cost_curves.json"), "w") as f:
        json.dump(curves, f, indent=1)
    print(f"wrote {args.out}/cost_curves.json")


def report(configs, args):
    by = {(c.name, c.density, c.order): c for c in configs}
    rows = []
    print(f"\nResNet-18 w{args.width} on digits ({args.device}), {len(configs[0].residual)} aligned buffers, "
          f"{args.iterations} iterations ({args.warmup} warm-up); density = selected / elements, "
          f"(x target); [x promised]: promised = sum over segments of max(1, round(target * n)) / elements")
    print("ms: mean selection time per iteration (what training pays, periodic re-estimations included); "
          "ahead/behind of the means, and of the medians")
    print(f"{'compressor':<10} {'target':>7} | {'ahead density':>26} {'missing':>7} {'ms':>6} | "
          f"{'behind density':>26} {'missing':>7} {'ms':>6} | {'ahead/behind':>12} {'(medians)':>9}")
    for d in args.densities:
        for name in args.compressors:
            a, b = by[(name, d, "ahead")], by[(name, d, "behind")]
            row = {"compressor": name, "target": d}
            for tag, c in (("ahead", a), ("behind", b)):
                row[tag] = {"density_mean": float(np.mean(c.density_log)), "density_std": float(np.std(c.density_log)),
                            "promised": c.promised, "missing_mean": float(np.mean(c.missing_log)),
                            "ms_mean": 1e3 * float(np.mean(c.seconds_log)),
                            "ms_median": 1e3 * float(np.median(c.seconds_log))}
            row["time_ratio"] = row["ahead"]["ms_mean"] / row["behind"]["ms_mean"]
            row["time_ratio_median"] = row["ahead"]["ms_median"] / row["behind"]["ms_median"]
            rows.append(row)
            fmt = lambda r: (f"{r['density_mean']:.5f}±{r['density_std']:.5f} ({r['density_mean'] / d:4.2f}x)"
                             f" [{r['density_mean'] / r['promised']:4.2f}x]"
                             f" {100 * r['missing_mean']:6.1f}% {r['ms_mean']:6.2f}")
            print(f"{name:<10} {d:>7g} | {fmt(row['ahead'])} | {fmt(row['behind'])} | "
                  f"{row['time_ratio']:>11.2f}x {row['time_ratio_median']:>8.2f}x")
    return rows


def plot(rows, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in ((axes[0], "density", "actual / target density (ahead)"),
                           (axes[1], "missing", "tensors missing (%)"),
                           (axes[2], "ms", "selection ms per iteration (mean)")):
        for j, d in enumerate(args.densities):
            sub = [r for r in rows if r["target"] == d]
            xs = np.arange(len(sub)) + (j - 0.5) * 0.4
            if key == "density":
                ax.bar(xs, [r["ahead"]["density_mean"] / d for r in sub], 0.4, label=f"d={d:g}",
                       yerr=[r["ahead"]["density_std"] / d for r in sub])
            elif key == "missing":
                ax.bar(xs, [100 * r["behind"]["missing_mean"] for r in sub], 0.4, label=f"behind d={d:g}")
                ax.plot(xs, [100 * r["ahead"]["missing_mean"] for r in sub], "k_", ms=10)
            else:
                ax.bar(xs, [r["behind"]["ms_mean"] for r in sub], 0.4, label=f"behind d={d:g}", alpha=0.6)
                ax.plot(xs, [r["ahead"]["ms_mean"] for r in sub], "k^", ms=5, label="ahead" if j == 0 else None)
        names = [r["compressor"] for r in rows if r["target"] == args.densities[0]]
        ax.set_xticks(np.arange(len(names)), names, rotation=45, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[1].set_ylabel("% of tensors with a nonzero gradient (— ahead)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
