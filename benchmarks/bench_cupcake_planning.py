"""Planning time of Cupcake's Algorithm 1 (MLSys'23 §4.2) at the paper's model sizes, 161 and 314 tensors.

    python benchmarks/bench_cupcake_planning.py [--repeats 3 --out out/bench_cupcake_planning]

The tensors are the exact parameter shapes of ResNet-50 (161 tensors) and ResNet-101 (314
tensors) for 224×224 inputs — the models of Cupcake's Table 1 — written out here, so no model
library is needed. Everything else is SYNTHETIC, labelled as such: back-propagation time is spread
over the tensors in proportion to each layer's multiply-adds (``--backward-ms`` in total; BN
tensors get a small fixed share), compression follows the shape Cupcake §3.2 / Figure 2 reports
for DGC (flat ``--cp-floor-ms`` up to 4 MB, then linear), communication is α–β over a sparse
message (8 B per selected element). Two regimes: *communication-bound* (1 Gbit/s, density 0.05)
and *compute-bound* (10 Gbit/s, density 0.01: communication hides behind back-propagation and
many strategies tie within fractions of a millisecond, the search's hard case). With these
measured-like curves the prunings are the paper's heuristic, not proven exact
(``plan.meta["exact"]`` is ``False``); the search stops after ``--max-states`` states
(``complete`` says whether it finished).

Each model is planned ``--repeats`` times; the table gives the median planning seconds, the states
Algorithm 1 explored (FindOptFusion calls, one complete strategy each), the candidate groups each
pruning skipped (bound / start / dominance), the buffers chosen, and the simulator's predicted
iteration time for Cupcake's plan, the best even split (the bootstrap), one buffer, and OMGS. Cupcake's own Table 1 (2.8 s and
6.6 s, on the authors' machine and code) is printed beside ours only as the paper's numbers.
A PNG and a JSON file go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from horovod_safusion.fusion import (CostCurve, CupcakePlanner, OMGSPlanner, Profile,  # noqa: E402
                                        TensorInfo, simulate)
from horovod_safusion.plan import FusionPlan  # noqa: E402

PAPER_SECONDS = {161: 2.8, 314: 6.6}  # Cupcake Table 1, Algorithm 1 with both prunings


def resnet_layers(blocks: list[int]) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, output pixels) of every parameter of a bottleneck ResNet, forward order."""
    out = [("conv1.weight", (64, 3, 7, 7), 112 * 112), ("bn1.weight", (64,), 0), ("bn1.bias", (64,), 0)]
    inplanes = 64
    for stage, (count, width, side) in enumerate(zip(blocks, (64, 128, 256, 512), (56, 28, 14, 7)), start=1):
        for b in range(count):
            p = f"layer{stage}.{b}."
            shapes = [(width, inplanes, 1, 1), (width, width, 3, 3), (4 * width, width, 1, 1)]
            for c, shape in enumerate(shapes, start=1):
                out += [(f"{p}conv{c}.weight", shape, side * side), (f"{p}bn{c}.weight", (shape[0],), 0),
                        (f"{p}bn{c}.bias", (shape[0],), 0)]
            if b == 0:
                out += [(f"{p}downsample.0.weight", (4 * width, inplanes, 1, 1), side * side),
                        (f"{p}downsample.1.weight", (4 * width,), 0), (f"{p}downsample.1.bias", (4 * width,), 0)]
            inplanes = 4 * width
    return out + [("fc.weight", (1000, 2048), 1), ("fc.bias", (1000,), 0)]


def synthetic_profile(layers, args) -> Profile:
    """A SYNTHETIC profile for these shapes (see the module docstring)."""
    backward = list(reversed(layers))  # gradients arrive output layer first
    numel = [int(np.prod(shape)) for _, shape, _ in backward]
    work = np.array([n * max(pixels, 1) for n, (_, _, pixels) in zip(numel, backward)], dtype=float)
    work = np.where([pixels == 0 for _, _, pixels in backward], 0.002 * work.mean(), work)
    ready = np.cumsum(work / work.sum() * args.backward_ms * 1e-3)
    ready -= ready[0]
    tensors = [TensorInfo(name, n, 4, "torch.float32@cuda:0") for (name, _, _), n in zip(backward, numel)]
    floor, big = 4 * 2**20, 4 * 2**30
    compress = CostCurve([0, floor, big], [args.cp_floor_ms * 1e-3, args.cp_floor_ms * 1e-3,
                                           args.cp_floor_ms * 1e-3 + (big - floor) / (args.cp_gbps * 1e9)])
    communicate = CostCurve.alpha_beta(args.latency_ms * 1e-3, args.bandwidth_gbps * 1e9 / 8)
    return Profile(tensors=tensors, ready=ready.tolist(), prefix=args.forward_ms * 1e-3, suffix=0.0,
                   compress=compress, communicate=communicate, density=args.density,
                   wire_bytes={t.name: 8 for t in tensors}, meta={"synthetic": True})


REGIMES = {"comm-bound": {"bandwidth_gbps": 1.0, "density": 0.05},
           "compute-bound": {"bandwidth_gbps": 10.0, "density": 0.01}}


def measure(label: str, profile: Profile, repeats: int, max_states: int) -> dict:
    seconds, plan = [], None
    for _ in tqdm(range(repeats), desc=label, leave=False):
        start = time.perf_counter()
        plan = CupcakePlanner(max_states=max_states).plan(profile.tensors, profile)
        seconds.append(time.perf_counter() - start)
    one_buffer = simulate(profile, FusionPlan([profile.names], order="behind")).iteration
    omgs = OMGSPlanner().plan(profile.tensors, profile)
    return {"model": label, "tensors": len(profile.tensors), "median_s": statistics.median(seconds),
            "runs_s": seconds, "states": plan.meta["states_explored"],
            "pruned_bound": plan.meta["pruned_by_bound"], "pruned_start": plan.meta["pruned_by_start"],
            "pruned_dominance": plan.meta["pruned_by_dominance"], "complete": plan.meta["complete"],
            "buffers": len(plan.buffers), "cupcake_ms": 1e3 * simulate(profile, plan).iteration,
            "even_ms": 1e3 * plan.meta["bootstrap_s"], "one_buffer_ms": 1e3 * one_buffer,
            "omgs_ms": 1e3 * omgs.meta["predicted_s"], "omgs_buffers": len(omgs.buffers),
            "exact": plan.meta["exact"], "paper_s": PAPER_SECONDS.get(len(profile.tensors))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backward-ms", type=float, default=60.0, help="synthetic back-propagation time")
    ap.add_argument("--forward-ms", type=float, default=30.0, help="synthetic forward time (prefix)")
    ap.add_argument("--cp-floor-ms", type=float, default=0.3, help="compression time up to 4 MB")
    ap.add_argument("--cp-gbps", type=float, default=40.0, help="compression GB/s beyond 4 MB")
    ap.add_argument("--latency-ms", type=float, default=0.2, help="collective start-up α")
    ap.add_argument("--max-states", type=int, default=1_000_000, help="stop a search after this many states")
    ap.add_argument("--out", default=os.path.join("out", "bench_cupcake_planning"))
    args = ap.parse_args()
    models = {"ResNet-50 shapes": resnet_layers([3, 4, 6, 3]), "ResNet-101 shapes": resnet_layers([3, 4, 23, 3])}
    rows = []
    for regime, settings in REGIMES.items():
        for label, layers in models.items():
            profile = synthetic_profile(layers, argparse.Namespace(**{**vars(args), **settings}))
            rows.append({"regime": regime, **measure(label, profile, args.repeats, args.max_states)})

    print(f"Cupcake planning on SYNTHETIC profiles (shapes real, costs synthetic), {args.repeats} runs each, "
          f"at most {args.max_states:,} states")
    print(f"{'regime':<13} {'model':<17} {'tensors':>7} {'median s':>8} {'states':>7} {'done':>5} "
          f"{'pruned bound/start/dominance':>28} {'buffers':>7} {'cupcake ms':>10} {'even ms':>8} "
          f"{'1-buf ms':>8} {'omgs ms':>8} {'paper s':>7}")
    for r in rows:
        pruned = f"{r['pruned_bound']:,}/{r['pruned_start']:,}/{r['pruned_dominance']:,}"
        print(f"{r['regime']:<13} {r['model']:<17} {r['tensors']:>7} {r['median_s']:>8.2f} {r['states']:>7,} "
              f"{str(r['complete']):>5} {pruned:>28} {r['buffers']:>7} {r['cupcake_ms']:>10.2f} "
              f"{r['even_ms']:>8.2f} {r['one_buffer_ms']:>8.2f} {r['omgs_ms']:>8.2f} {r['paper_s']:>7}")
    print("paper s: Cupcake's Table 1 (their hardware, their code and profiles) — not comparable one to one.")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(rows))
    names = [f"{r['regime']}\n{r['tensors']} tensors" for r in rows]
    a.bar(x - 0.2, [r["median_s"] for r in rows], 0.4, label="ours (median; hatched: stopped at max states)")
    for xi, r in zip(x, rows):
        if not r["complete"]:
            a.bar(xi - 0.2, r["median_s"], 0.4, fill=False, hatch="//")
    a.bar(x + 0.2, [r["paper_s"] for r in rows], 0.4, label="paper's Table 1 (other hardware, other profiles)")
    a.set_xticks(x, names, fontsize=8)
    a.set_ylabel("planning seconds")
    a.legend(fontsize=8)
    keys = [("cupcake_ms", "cupcake"), ("even_ms", "best even split"), ("one_buffer_ms", "one buffer"), ("omgs_ms", "omgs")]
    for j, (key, label) in enumerate(keys):
        b.bar(x + (j - 1.5) * 0.2, [r[key] for r in rows], 0.2, label=label)
    b.set_xticks(x, names, fontsize=8)
    b.set_ylabel("predicted iteration ms (synthetic)")
    b.legend(fontsize=8)
    fig.suptitle("Cupcake Algorithm 1 on synthetic profiles")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "cupcake_planning.png"), dpi=120)
    print(f"written: {args.out}/results.json, {args.out}/cupcake_planning.png")


if __name__ == "__main__":
    main()
