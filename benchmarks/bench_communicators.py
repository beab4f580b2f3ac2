"""Bytes received per worker per step: the seeds' sparse collectives against ``allgather``.

    horovodrun -np 3 -H localhost:3 --gloo python benchmarks/bench_communicators.py [--steps 30]

One job trains the same model (CIFAR-style ResNet-18 on scikit-learn's digits, real gradients) with
each communicator in turn — ``allgather``, ``spardl``, ``exdyna``, ``zen`` with Balanced Parallelism
(``zen-bp``) and with Hierarchical Centralization (``zen-hc``) — and records, per step and worker,
the payload bytes received from other workers (``StepStats.bytes_received``). After ``--warmup``
steps it reports medians over steps and workers, the ratio to allgather, and each communicator's
measured property (issue 7, item 3):

* ZEN BP: push and pull imbalance ratios (ZEN Definition 8), median over buffers and steps, the
  worst worker's push ratio;
* SparDL: received rows per worker against 2k(P−1)/P rows (the paper's 4k(P−1)/P words, Eq. 3;
  k = the worker's selected elements);
* ExDyna: actual density k′/n_g against the target and the all-gather padding overhead f(t)
  (ExDyna Eq. 5).

ExDyna's value all-reduce is counted as a ring's 2(P−1)/P of its bytes (Horovod hides it); all
other bytes are what arrived. The table goes to stdout, ``results.json`` and a PNG to ``--out``.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from digits import load_digits_split  # noqa: E402
from models import resnet18  # noqa: E402

import horovod_safusion as saf  # noqa: E402
from horovod_safusion.communicators import Zen  # noqa: E402
from horovod_safusion.fusion import NaivePlanner  # noqa: E402
from horovod_safusion.wire import row_bytes  # noqa: E402

COMMUNICATORS = {"allgather": lambda: "allgather", "spardl": lambda: "spardl", "exdyna": lambda: "exdyna",
                 "zen-bp": lambda: Zen(scheme="bp"), "zen-hc": lambda: Zen(scheme="hc")}


def run(name: str, args, data) -> dict:
    """Train ``args.steps`` steps with one communicator; per-step measurements of this worker."""
    x_tr, y_tr = data
    torch.manual_seed(args.seed)
    model = resnet18(width=args.width)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compressor="exdyna" if name == "exdyna" else args.compressor,
                                   density=args.density, communicator=COMMUNICATORS[name](),
                                   fusion=NaivePlanner(args.capacity_bytes))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    received, selected = [], []
    for step in range(args.steps):
        i = ((step * hvd.size() + hvd.rank()) * args.batch_size) % (len(x_tr) - args.batch_size)
        opt.zero_grad()
        F.cross_entropy(model(x_tr[i:i + args.batch_size]), y_tr[i:i + args.batch_size]).backward()
        opt.step()
        received.append(opt.last_stats.bytes_received)
        selected.append(opt.last_stats.selected)
    out = {"received": received[args.warmup:], "selected": selected[args.warmup:],
           "numel": sum(p.numel() for p in model.parameters()), "buffers": len(opt.plan.buffers)}
    history = list(getattr(opt.communicator, "history", []))
    first = args.warmup * len(opt.plan.buffers)  # history has one entry per buffer and step
    if name == "zen-bp":
        out["push"] = [h["push_imbalance"] for h in history[first:]]
        out["pull"] = [h["pull_imbalance"] for h in history[first:]]
    if name == "exdyna":
        per_step = {}
        for h in history:
            s = per_step.setdefault(h["step"], [0, 0, []])
            s[0] += sum(h["counts"])
            s[2].append(h["padding"])
        out["density"] = [per_step[s][0] / out["numel"] for s in sorted(per_step)][args.warmup:]
        out["padding"] = [float(np.median(per_step[s][2])) for s in sorted(per_step)][args.warmup:]
    if name == "spardl":  # k per worker: what the compressor selected, i.e. the local selection
        out["k"] = selected[args.warmup:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    ap.add_argument("--batch-size", type=int, default=16, help="per worker")
    ap.add_argument("--width", type=int, default=8, help="ResNet-18 base width (64 is the standard)")
    ap.add_argument("--compressor", default="topk", help="for every communicator but exdyna (which needs exdyna)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--capacity-bytes", type=int, default=1 << 20, help="fusion buffer size (NaivePlanner)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_communicators")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")

    hvd.init()
    torch.set_num_threads(1)
    data = load_digits_split()[:2]
    mine = {}
    for name in tqdm(COMMUNICATORS, desc="communicators", disable=hvd.rank() != 0):
        mine[name] = run(name, args, data)
    everyone = hvd.allgather_object(mine, name="bench.comm.gather")
    if hvd.rank() == 0:
        rows = table(everyone, args)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"results_np{hvd.size()}.json")
        with open(path, "w") as f:
            json.dump({"args": vars(args), "workers": hvd.size(), "rows": rows}, f, indent=1)
        plot(rows, os.path.join(args.out, f"bytes_np{hvd.size()}.png"), args)
        print(f"wrote {path} and bytes_np{hvd.size()}.png")


def table(everyone: list[dict], args) -> list[dict]:
    P = len(everyone)
    numel = everyone[0]["allgather"]["numel"]
    rb = row_bytes(torch.float32)
    base = float(np.median([v for w in everyone for v in w["allgather"]["received"]]))
    print(f"\nResNet-18 width {args.width} ({numel} parameters, {everyone[0]['allgather']['buffers']} buffers), "
          f"P = {P}, {args.compressor}@{args.density:g}, medians over steps {args.warmup}..{args.steps - 1} and workers")
    print(f"{'communicator':<12} {'KiB recv/worker/step':>21} {'max worker':>10} {'vs allgather':>12}  measured property")
    rows = []
    for name in COMMUNICATORS:
        recv = [v for w in everyone for v in w[name]["received"]]
        med = float(np.median(recv))
        worst = max(float(np.median(w[name]["received"])) for w in everyone)
        row = {"communicator": name, "workers": P, "recv_bytes_median": med, "recv_bytes_worst_worker": worst,
               "vs_allgather": med / base if base else float("nan")}
        note = ""
        if name == "zen-bp":
            row["push_imbalance"] = float(np.median([v for w in everyone for v in w[name]["push"]]))
            row["pull_imbalance"] = float(np.median(everyone[0][name]["pull"]))
            row["push_imbalance_worst"] = float(max(v for w in everyone for v in w[name]["push"]))
            note = (f"imbalance push {row['push_imbalance']:.3f} (worst {row['push_imbalance_worst']:.3f}), "
                    f"pull {row['pull_imbalance']:.3f}")
        if name == "spardl":
            ratio = [r / rb / (2 * k * (P - 1) / P) for w in everyone for r, k in zip(w[name]["received"], w[name]["k"]) if k]
            row["recv_vs_2k(P-1)/P_rows"] = float(np.median(ratio))
            note = f"received / 2k(P-1)/P rows = {row['recv_vs_2k(P-1)/P_rows']:.3f}"
        if name == "exdyna":
            row["density"] = float(np.median(everyone[0][name]["density"]))
            row["density_error"] = row["density"] / args.density - 1
            row["padding_f"] = float(np.median(everyone[0][name]["padding"]))
            note = f"density {row['density']:.5f} ({100 * row['density_error']:+.1f}% of target), f(t) {row['padding_f']:.3f}"
        rows.append(row)
        print(f"{name:<12} {med / 1024:>21.1f} {worst / 1024:>10.1f} {row['vs_allgather']:>11.2f}x  {note}")
    return rows


def plot(rows: list[dict], path: str, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.bar([r["communicator"] for r in rows], [r["recv_bytes_median"] / 1024 for r in rows])
    ax.set_ylabel("KiB received / worker / step (median)")
    ax.set_title(f"ResNet-18 w{args.width}, {args.compressor}@{args.density:g}, P = {rows[0]['workers']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
