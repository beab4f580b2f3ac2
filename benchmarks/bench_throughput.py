"""Training throughput of every fusion scheme side by side (SAFusion §5 Experiments 2, 5, 6, small).

    python benchmarks/bench_throughput.py [--np 2 --densities 0.1 0.05 0.01 --rates 1gbit]

The driver launches one ``horovodrun -np N --gloo`` job per link speed: first on the plain
loopback, then — for each ``--rates`` value — inside a fresh network namespace whose loopback is
limited with ``tc qdisc ... tbf`` (needs root; :mod:`links` keeps the bucket's burst above the
64 KiB loopback MTU).
In each job every fusion scheme (:data:`SCHEMES`, built by :mod:`schemes`) trains the same model
(a CIFAR-style ResNet-18, 62 parameter tensors) on real data (scikit-learn's digits) for every
density, in interleaved repetitions so that machine noise hits all alike; each run warms up (profiling and re-planning for
the profiled planners) before its timed steps. The tables give samples/s (median over
repetitions; the job is as fast as its slowest rank), the ratio to ``wfbp`` and to the best other
scheme; a PNG and a JSON file go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from links import check_link, limited_link  # noqa: E402
from schemes import batch, describe, horovod_optimizer, our_optimizer, parse, print_resolved  # noqa: E402

#: the fusion schemes compared (SAFusion §5); ``horovod`` is Horovod's own optimizer, dense.
SCHEMES = ("horovod", "wfbp", "oktopk", "omgs", "cupcake", "safusion")


def label(fusion: str, density: float | None, args) -> str:
    """The scheme's label in :mod:`schemes`' grammar: Horovod, or ``fusion`` with the run's
    compressor at ``density`` (every sparse scheme the same compressor, density and error feedback,
    so that only ``fusion=`` differs)."""
    if fusion == "horovod":
        return "horovod"
    return f"{fusion}@{density:g}/{args.compressor}:profile_steps={args.profile_steps}"


def worker(args) -> None:
    """One job under horovodrun: every scheme at every density, interleaved repetitions."""
    import torch
    import torch.nn.functional as F
    import horovod.torch as hvd
    from tqdm import tqdm
    from digits import load_digits_split
    from models import resnet18

    hvd.init()
    torch.set_num_threads(1)
    x, y, _, _ = load_digits_split()
    runs = [(s, d) for d in args.densities for s in args.schemes if s != "horovod"]
    if "horovod" in args.schemes:
        runs.insert(0, ("horovod", None))  # dense: the same at every density
    samples: dict[str, list[float]] = {}
    with tqdm(total=args.reps * len(runs), desc="runs", disable=hvd.rank() != 0) as bar:
        for _ in range(args.reps):
            for scheme, density in runs:
                torch.manual_seed(args.seed)
                model = resnet18(width=args.width)
                sc = parse(label(scheme, density, args))
                sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
                opt = horovod_optimizer(sc, sgd, model) if sc.peer else our_optimizer(sgd, model, sc.kwargs())
                warm = 1 + args.profile_steps + 2
                times = []
                for step in range(warm + args.steps):
                    sl = batch(step, hvd.rank(), hvd.size(), args.batch_size, len(x))
                    if step >= warm:
                        hvd.allreduce(torch.zeros(1), name="bench.barrier")  # start timed steps together
                        t0 = time.perf_counter()
                    opt.zero_grad()
                    F.cross_entropy(model(x[sl]), y[sl]).backward()
                    opt.step()
                    if step >= warm:
                        times.append(time.perf_counter() - t0)
                step_s = hvd.allreduce(torch.tensor(float(np.median(times))), op=hvd.Max, name="bench.step").item()
                key = scheme if density is None else f"{scheme}@{density:g}"
                samples.setdefault(key, []).append(args.batch_size * hvd.size() / step_s)
                bar.update()
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"workers": hvd.size(), "samples_per_s": samples}, f)


def drive(args) -> None:
    print_resolved([describe(parse(label(f, d, args))) for d in args.densities for f in args.schemes
                    if f != "horovod" or d == args.densities[0]])  # a malformed one stops here
    for rate in args.rates:
        check_link(rate, option="--rates")  # before the first job, not after it
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for rate in [None, *args.rates]:
        link = rate or "loopback"
        result = os.path.join(args.out, f"raw-{link}.json")
        cmd = ["horovodrun", "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", "--result", result,
               *sum(([f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, list) else [v])]
                     for k, v in vars(args).items() if k in WORKER_ARGS), [])]
        print(f"== {link}: {' '.join(cmd[:6])} ...", flush=True)
        with limited_link(rate, option="--rates") as prefix:
            subprocess.run(prefix + cmd, check=True)
        with open(result) as f:
            results[link] = json.load(f)
    rows = report(results, args)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    plot(rows, args, os.path.join(args.out, "throughput.png"))
    print(f"wrote {args.out}/results.json, throughput.png")


def report(results, args) -> list[dict]:
    rows = []
    for label, res in results.items():
        med = {k: float(np.median(v)) for k, v in res["samples_per_s"].items()}
        print(f"\nResNet-18 w{args.width}, {res['workers']} workers, batch {args.batch_size}/worker, "
              f"{args.compressor}, link: {label}; samples/s, median of {args.reps} reps x {args.steps} steps")
        print(f"{'density':>8} " + " ".join(f"{s:>9}" for s in args.schemes) + f" | {'best':>9} {'vs wfbp':>8} {'vs next':>8}")
        for d in args.densities:
            got = {s: med["horovod" if s == "horovod" else f"{s}@{d:g}"] for s in args.schemes}
            best = max(got, key=got.get)
            others = [v for s, v in got.items() if s != best]
            row = {"link": label, "density": d, "samples_per_s": got, "best": best,
                   "best_vs_wfbp": got[best] / got["wfbp"] if "wfbp" in got else None,
                   "best_vs_next": got[best] / max(others) if others else None,
                   "safusion_vs_wfbp": got["safusion"] / got["wfbp"] if {"safusion", "wfbp"} <= got.keys() else None}
            rows.append(row)
            ratio = lambda v: f"{v:>7.2f}x" if v is not None else f"{'-':>8}"
            print(f"{d:>8g} " + " ".join(f"{got[s]:>9.0f}" for s in args.schemes)
                  + f" | {best:>9} {ratio(row['best_vs_wfbp'])} {ratio(row['best_vs_next'])}")
        if "safusion" in args.schemes and "wfbp" in args.schemes:
            print("safusion vs wfbp: " + ", ".join(f"{r['density']:g}: {r['safusion_vs_wfbp']:.2f}x"
                                                  for r in rows if r["link"] == label))
    return rows


def plot(rows, args, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 3.8), squeeze=False)
    width = 0.8 / len(args.schemes)
    for ax, link in zip(axes[0], links):
        sub = [r for r in rows if r["link"] == link]
        for j, s in enumerate(args.schemes):
            ax.bar(np.arange(len(sub)) + (j - len(args.schemes) / 2 + 0.5) * width,
                   [r["samples_per_s"][s] for r in sub], width, label=s)
        ax.set_xticks(np.arange(len(sub)), [f"density {r['density']:g}" for r in sub])
        ax.set_ylabel("samples/s (median)")
        ax.set_title(f"link: {link}")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


WORKER_ARGS = ("schemes", "densities", "reps", "steps", "profile_steps", "batch_size", "width", "compressor", "seed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2, help="workers")
    ap.add_argument("--rates", nargs="*", default=[], help="also run on a loopback limited to these tc rates, e.g. 1gbit")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.05, 0.01])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16, help="per worker")
    ap.add_argument("--width", type=int, default=32, help="ResNet-18 base width (64 is the standard)")
    ap.add_argument("--compressor", default="dgc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_throughput")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, os.path.join(HERE, "..", "examples"))
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
