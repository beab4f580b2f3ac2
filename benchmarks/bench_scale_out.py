"""Scale-out on paper: the simulator calibrated on ``bench_scale``'s profiles, checked at its largest
P, and asked about 16–64 workers on fast links.

    python benchmarks/bench_scale_out.py [--results out/bench_scale/results.json] [--link 1gbit]
                                         [--workers 16 32 64] [--rates 10 25 100] [--speedup 50]

``bench_scale`` keeps the profile each of our jobs planned from (rank 0's, in its warm record).
Per model, at the link ``--link``:

1. **Calibration** (:mod:`horovod_safusion.fusion.scaling`): each protocol's sweeps (the
   allgather and ZEN from the default job's ``communicator="auto"`` profile, SparDL's from the job
   that names it, which ``"auto"`` does not price; the dense allreduce) at every measured P are
   fitted by one cost model in P.
2. **Check at the largest P** against the iteration times ``bench_scale`` measured, for each of
   our schemes (the default, each communicator, forced dense), two ways: the job's own prediction
   (its profile at that P, the plan it ran), and the model fitted on the *smaller* P only,
   evaluated at the largest (what extrapolation is worth), with the job's own compute.
3. **16–64 workers** at ``--rates`` Gbit/s: the smallest P's default profile (the least shared
   cores: its compute is closest to a worker of its own), computation ``--speedup`` times faster
   (the GPU assumption: say which), communication from the model fitted on every P, the link's
   seconds per byte swapped for the new rate's. Per cell: the predicted iteration of the
   safusion plan over each communicator and dense, which one ``communicator="auto"`` would plan
   (among the allgather, ZEN and dense),
   and SAFusion's Figure 14 comparison: safusion, cupcake, omgs, oktopk and wfbp, all over the
   allgather (SAFusion's own synchronisation), with safusion's distance to the best of the others
   (negative: safusion ahead).

Prints the tables, writes ``scale_out.json`` and ``bench_scale_out.png`` next to the results.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from horovod_safusion.fusion import (CupcakePlanner, OkTopkPlanner, OMGSPlanner, Profile,  # noqa: E402
                                     SAFusionPlanner, WFBPPlanner, simulate)
from horovod_safusion.communicators.base import AUTO_SPARSE  # noqa: E402
from horovod_safusion.fusion.scaling import curves_of, fit_profiles, scaled  # noqa: E402
from schemes import parse  # noqa: E402

FIGURE_14 = {"safusion": SAFusionPlanner(dense=False), "cupcake": CupcakePlanner(max_states=20_000),
             "omgs": OMGSPlanner(), "oktopk": OkTopkPlanner(), "wfbp": WFBPPlanner()}
OPTIONS = ("allgather", "spardl", "zen", "dense")


def rate_bits(link: str) -> float:
    """``1gbit`` -> 1e9 bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if link.endswith(unit):
            return float(link[:-len(unit)]) * factor
    raise SystemExit(f"--link {link!r}: give a rate such as 1gbit or 200mbit")


def profiles_by_p(raw: dict, model: str, link: str, key: str) -> dict[int, Profile]:
    """Rank 0's profile of scheme ``key`` at every P measured on ``link``."""
    found = {}
    for label, by_model in raw.items():
        hosts, _, rate = label.partition("x")
        job = by_model.get(model, {}).get("jobs", {}).get(key)
        if rate != link or job is None or job["failed"] or not job["warm"]:
            continue
        saved = job["warm"][0].get("profile")
        if saved is not None:
            found[int(hosts)] = Profile.from_dict(saved)
    return dict(sorted(found.items()))


def with_named_sweeps(raw: dict, model: str, link: str, profiles: dict[int, Profile]) -> dict[int, Profile]:
    """``profiles`` (the default job's, by P) with the sweep of each protocol the default does not
    price — SparDL, which ``communicator="auto"`` does not hold — taken from the job that names it,
    at the same P."""
    keys = sorted({k for by_model in raw.values() for k in by_model.get(model, {}).get("jobs", {})})
    named = {parse(k).options.get("communicator"): profiles_by_p(raw, model, link, k) for k in keys}
    out = {}
    for p, profile in profiles.items():
        curves = {k: c for k, c in curves_of(profile).items() if k != "dense"}
        for name, by_p in named.items():
            if name is not None and name not in curves and p in by_p and name in curves_of(by_p[p]):
                curves[name] = curves_of(by_p[p])[name]
        out[p] = dataclasses.replace(profile, communicators=curves)
    return out


def predicted(profile: Profile, communicator: str | None, dense: bool) -> float:
    """The iteration the safusion planner's plan gets under ``profile``: dense, or sparse over
    ``communicator`` (``None``: the one the profile uses)."""
    if dense:
        planner, over = SAFusionPlanner(dense=True), profile
    else:
        over = profile.over(communicator) if communicator in profile.communicators else profile
        over = dataclasses.replace(over, communicators={})
        planner = SAFusionPlanner(dense=False)
    plan = planner.plan(over.tensors, over)
    return simulate(over.as_dense() if dense else over, plan).iteration


def check(raw: dict, summary: dict, model: str, link: str) -> list[dict]:
    """Per scheme at the largest P: measured, the job's own prediction, and the prediction of the
    model fitted on the smaller P."""
    rows = []
    default = with_named_sweeps(raw, model, link, profiles_by_p(raw, model, link, "safusion"))
    if len(default) < 3:
        return rows
    largest = max(default)
    fits = fit_profiles({p: prof for p, prof in default.items() if p < largest}, rate_bits(link))
    cell = summary[model][f"{largest}x{link}"]
    for key in cell.get("plans", {}):  # our jobs: the default, each communicator, forced dense
        communicator = parse(key).options.get("communicator")  # None: the plan's choice
        own = profiles_by_p(raw, model, link, key).get(largest)
        info = cell.get("plans", {}).get(key)
        if own is None or info is None or key not in cell["schemes"]:
            continue
        dense = bool(info.get("dense"))
        sent_over = communicator or info.get("communicator")
        extrapolated = scaled(own, fits, largest)
        rows.append({"scheme": key, "P": largest, "measured": cell["schemes"][key]["wall"]["median"],
                     "plan": "dense" if dense else sent_over, "own": info.get("predicted_s"),
                     "fitted_smaller_p": predicted(extrapolated, sent_over, dense)})
    return rows


def outlook(profile: Profile, fits: dict, workers: list[int], rates: list[float], speedup: float) -> list[dict]:
    """The 16–64 table: per (P, rate) each option's predicted iteration, auto's choice, Figure 14."""
    from tqdm import tqdm

    rows = []
    for p in tqdm([(p, r) for p in workers for r in rates], desc="scale-out cells", file=sys.stdout):
        at = scaled(profile, fits, p[0], p[1] * 1e9, speedup)
        options = {name: predicted(at, name, False) for name in OPTIONS[:-1] if name in at.communicators}
        if at.dense_allreduce is not None:
            options["dense"] = predicted(at, None, True)
        held = {name: c for name, c in at.communicators.items() if name in AUTO_SPARSE}
        auto = at if not held else dataclasses.replace(at.over(next(iter(held))),
                                                      communicators=held if len(held) > 1 else {})
        chosen = SAFusionPlanner().plan(auto.tensors, auto)
        allgather = dataclasses.replace(at.over("allgather"), communicators={}, dense_allreduce=None)
        figure = {name: simulate(allgather, planner.plan(allgather.tensors, allgather)).iteration
                  for name, planner in FIGURE_14.items()}
        best_other = min(v for k, v in figure.items() if k != "safusion")
        rows.append({"P": p[0], "gbit": p[1], "options": options,
                     "auto": "dense" if chosen.dense else chosen.communicator,
                     "figure_14": figure, "safusion_vs_best_other": figure["safusion"] / best_other - 1})
    return rows


def print_check(model: str, link: str, rows: list[dict]) -> None:
    print(f"\n{model}, {link}: predicted against measured s/iteration at P = {rows[0]['P']}")
    print(f"  {'scheme':<38} {'plan':>10} {'measured':>9} {'own':>14} {'fitted on smaller P':>22}")
    for r in rows:
        own = "-" if r["own"] is None else f"{r['own']:.3f} ({r['own'] / r['measured'] - 1:+.0%})"
        fx = f"{r['fitted_smaller_p']:.3f} ({r['fitted_smaller_p'] / r['measured'] - 1:+.0%})"
        print(f"  {r['scheme']:<38} {r['plan']:>10} {r['measured']:>9.3f} {own:>14} {fx:>22}")


def print_outlook(model: str, rows: list[dict], speedup: float) -> None:
    print(f"\n{model}: predicted s/iteration at P workers and link rate, computation {speedup:g}x this machine's")
    head = "".join(f"{o:>10}" for o in OPTIONS)
    print(f"  {'P':>3} {'Gbit/s':>6} {head} {'auto':>10} | " + " ".join(f"{n:>9}" for n in FIGURE_14)
          + "  safusion vs the best other")
    for r in rows:
        opts = "".join(f"{r['options'][o]:>10.4f}" if o in r["options"] else f"{'-':>10}" for o in OPTIONS)
        fig = " ".join(f"{r['figure_14'][n]:>9.4f}" for n in FIGURE_14)
        print(f"  {r['P']:>3} {r['gbit']:>6g} {opts} {r['auto']:>10} | {fig}  {r['safusion_vs_best_other']:+.1%}")


def plot(outlooks: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["gbit"] for rows in outlooks.values() for r in rows})
    fig, axes = plt.subplots(len(outlooks), len(rates), figsize=(4.5 * len(rates), 3.6 * len(outlooks)), squeeze=False)
    for i, (model, rows) in enumerate(outlooks.items()):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            cells = [r for r in rows if r["gbit"] == rate]
            for o in OPTIONS:
                ps = [r["P"] for r in cells if o in r["options"]]
                ax.plot(ps, [r["options"][o] for r in cells if o in r["options"]], marker="o", label=o)
            ax.set_title(f"{model}, {rate:g} Gbit/s", fontsize=10)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers P")
            ax.set_ylabel("predicted s/iteration")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="out/bench_scale/results.json", help="bench_scale's results.json")
    ap.add_argument("--link", default="1gbit", help="the measured link rate to calibrate on")
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 25, 100], help="Gbit/s")
    ap.add_argument("--speedup", type=float, default=50.0,
                    help="computation this many times faster than one core of the measuring machine (a GPU)")
    args = ap.parse_args()
    with open(args.results) as f:
        results = json.load(f)
    raw, summary = results["raw"], results["summary"]
    report: dict = {"link": args.link, "speedup": args.speedup, "models": {}}
    outlooks = {}
    for model in summary:
        default = with_named_sweeps(raw, model, args.link, profiles_by_p(raw, model, args.link, "safusion"))
        if len(default) < 2:
            print(f"{model}: fewer than two worker counts with a profile at {args.link}; skipped")
            continue
        rows = check(raw, summary, model, args.link)
        if rows:
            print_check(model, args.link, rows)
        fits = fit_profiles(default, rate_bits(args.link))
        print(f"\n{model}: cost model fitted on P = {', '.join(map(str, default))} at {args.link}")
        for name, f in fits.items():
            print(f"  {name:<10} a0 {f.a0 * 1e3:8.3f} ms  a1 {f.a1 * 1e3:8.3f} ms/round  "
                  f"b0 {f.b0 * 1e9:8.3f} ns/B  b1 {f.b1 * 1e9:8.3f} ns/B received  (median error {f.error:.0%})")
        outlooks[model] = outlook(default[min(default)], fits, args.workers, args.rates, args.speedup)
        print_outlook(model, outlooks[model], args.speedup)
        report["models"][model] = {"check": rows, "fits": {k: dataclasses.asdict(f) for k, f in fits.items()},
                                   "outlook": outlooks[model], "compute_from_p": min(default)}
    out = os.path.dirname(os.path.abspath(args.results))
    with open(os.path.join(out, "scale_out.json"), "w") as f:
        json.dump(report, f, indent=1)
    if outlooks:
        plot(outlooks, os.path.join(out, "bench_scale_out.png"))
    print(f"wrote {out}/scale_out.json" + (", bench_scale_out.png" if outlooks else ""))


if __name__ == "__main__":
    main()
