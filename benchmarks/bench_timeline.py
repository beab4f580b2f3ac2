"""Cost of the timeline recorder, and the training-time breakdown of fusion schemes (SAFusion §5
Experiment 3, Figure 15) from its files.

    horovodrun -np 2 -H localhost:2 --gloo --timeline-filename out/bench_timeline/horovod.json \\
        python benchmarks/bench_timeline.py [--fusions safusion,layerwise --reps 5 --steps 10]

One job trains the same model (CIFAR-style ResNet-18, 62 parameter tensors) on real data
(scikit-learn's digits) with every fusion scheme of ``--fusions``, with the plugin's timeline off
and on, in interleaved repetitions so that machine noise hits all alike. ``layerwise`` is one
buffer per tensor (``NaivePlanner(capacity_bytes=1)``, WFBP's layer-wise communication); any other
name is passed to ``fusion=`` (e.g. ``safusion``, ``safusion-inter``, ``wfbp``). Each run warms up
(and, for profiled planners, profiles and switches plans) before its timed steps.

Printed: the median time per step (slowest rank) with the timeline off and on, and the overhead,
from separate runs and from alternating on/off blocks within one run per scheme (the recorder's
``pause()``/``resume()``);
the recorder's own cost per event, measured alone, times the events of an iteration ("x cost": an
estimate of the overhead that machine noise does not blur); then the breakdown table of the last
repetition's timelines (each merged with Horovod's Timeline when ``--timeline-filename`` was given;
Horovod is still writing it, which the merger tolerates).
Files go to ``--out``: per-run plugin timelines, merged traces, ``breakdown.png``, ``results.json``.
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
from digits import DigitsCNN, load_digits_split  # noqa: E402
from models import resnet18  # noqa: E402

import horovod_safusion as saf  # noqa: E402
from horovod_safusion.fusion import NaivePlanner  # noqa: E402
from horovod_safusion.timeline.breakdown import breakdown, plot, table  # noqa: E402
from horovod_safusion.timeline.merge import merge  # noqa: E402
from horovod_safusion.observer import COMPRESS  # noqa: E402
from horovod_safusion.timeline.trace import load_events, write_trace  # noqa: E402


def fusion_arg(name: str):
    return NaivePlanner(capacity_bytes=1) if name == "layerwise" else name


def run(fusion: str, timeline: str | None, args, data) -> tuple[float, float]:
    """Median seconds per timed step of one training run, wall and CPU of the training thread
    (each the slowest rank's). The recorder's work is CPU time of that thread, which other
    processes on a shared machine disturb far less than wall time."""
    x_tr, y_tr = data
    torch.manual_seed(args.seed)
    model = resnet18(width=args.width)
    recorder = saf.TimelineRecorder(timeline, model=model) if timeline else None  # exact forward times
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(), compressor=args.compressor,
                                   density=args.density, fusion=fusion_arg(fusion), profile_steps=args.profile_steps,
                                   timeline=recorder)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    warm = 1 + args.profile_steps + 2
    times, cpu = [], []
    for step in range(warm + args.steps):
        i = ((step * hvd.size() + hvd.rank()) * args.batch_size) % (len(x_tr) - args.batch_size)
        xb, yb = x_tr[i:i + args.batch_size], y_tr[i:i + args.batch_size]
        if step >= warm:
            hvd.allreduce(torch.zeros(1), name="bench.barrier")  # start timed steps together
            t0, c0 = time.perf_counter(), time.thread_time()
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        if step >= warm:
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    if opt.timeline:
        opt.timeline.close()
    medians = torch.tensor([float(np.median(times)), float(np.median(cpu))])
    wall, cpu_s = hvd.allreduce(medians, op=hvd.Max, name="bench.median").tolist()
    return wall, cpu_s


def alternating(fusion: str, path: str, args, data) -> dict:
    """Per-step seconds with the recorder on and off in alternating blocks of one run (pattern
    on, off, off, on, ...): the same process, model and plan, so slow drifts of a shared machine's
    load fall on both alike. Returns the medians (the slowest rank's) of wall and thread CPU time."""
    x_tr, y_tr = data
    torch.manual_seed(args.seed)
    model = resnet18(width=args.width)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(), compressor=args.compressor,
                                   density=args.density, fusion=fusion_arg(fusion), profile_steps=args.profile_steps,
                                   timeline=path)
    rec = opt.timeline
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    warm = 1 + args.profile_steps + 2
    samples = {True: ([], []), False: ([], [])}
    for step in range(warm + args.blocks * args.block):
        block = (step - warm) // args.block
        on = step < warm or block % 4 in (0, 3)
        if step >= warm and (step - warm) % args.block == 0:
            rec.resume() if on else rec.pause()
        i = ((step * hvd.size() + hvd.rank()) * args.batch_size) % (len(x_tr) - args.batch_size)
        xb, yb = x_tr[i:i + args.batch_size], y_tr[i:i + args.batch_size]
        hvd.allreduce(torch.zeros(1), name="bench.barrier")
        t0, c0 = time.perf_counter(), time.thread_time()
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        if step >= warm:
            samples[on][0].append(time.perf_counter() - t0)
            samples[on][1].append(time.thread_time() - c0)
    rec.close()
    medians = torch.tensor([float(np.median(v)) for on in (False, True) for v in samples[on]])
    off_wall, off_cpu, on_wall, on_cpu = hvd.allreduce(medians, op=hvd.Max, name="bench.alt").tolist()
    return {"fusion": fusion, "steps_each": len(samples[True][0]), "off_wall": off_wall, "on_wall": on_wall,
            "off_cpu": off_cpu, "on_cpu": on_cpu}


def seconds_per_event(path: str, steps: int = 200, per_step: int = 250) -> float:
    """Host seconds the recorder spends per event: marking, recording, converting and writing."""
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), fusion=NaivePlanner(capacity_bytes=1),
                                   timeline=path)
    rec = opt.timeline
    t0 = time.perf_counter()
    for _ in range(steps):
        rec.synchronize_begins()
        for _ in range(per_step - 4):  # + SYNCHRONIZE, FORWARD, OPTIMIZER_STEP, ITERATION
            rec.span(COMPRESS, rec.mark(), buffer=0)
        rec.synchronize_ends()
        rec.step_ends()
    rec.close()
    return (time.perf_counter() - t0) / (steps * per_step)


def events_per_iteration(path: str) -> float:
    events = load_events(path)
    return sum(e["ph"] == "X" for e in events) / (1 + sum(e.get("name") == "ITERATION" for e in events))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fusions", default="safusion,layerwise", help="comma-separated fusion schemes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16, help="per worker")
    ap.add_argument("--width", type=int, default=32, help="ResNet-18 base width (64 is the standard)")
    ap.add_argument("--compressor", default="dgc")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--blocks", type=int, default=16, help="alternating on/off blocks (a multiple of 4)")
    ap.add_argument("--block", type=int, default=4, help="steps per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_timeline")
    args = ap.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    x_tr, y_tr, _, _ = load_digits_split()
    fusions = args.fusions.split(",")
    os.makedirs(args.out, exist_ok=True)
    measured = {(f, mode): [] for f in fusions for mode in ("off", "on")}
    files = {}
    with tqdm(total=args.reps * len(measured), desc="runs", disable=hvd.rank() != 0) as bar:
        for rep in range(args.reps):
            for fusion in fusions:
                for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    path = os.path.join(args.out, f"{fusion}.rep{rep}.json") if mode == "on" else None
                    measured[(fusion, mode)].append(run(fusion, path, args, (x_tr, y_tr)))
                    if path:
                        files[fusion] = [path.replace(".json", f".rank{r}.json") for r in range(hvd.size())]
                    bar.update()
    alt = [alternating(f, os.path.join(args.out, f"{f}.alternating.json"), args, (x_tr, y_tr)) for f in fusions]
    per_event = seconds_per_event(os.path.join(args.out, "cost.json"))
    if hvd.rank() != 0:
        return

    print(f"\nResNet-18 (width {args.width}), {hvd.size()} workers, batch {args.batch_size}/worker, "
          f"{args.compressor}@{args.density:g}, {args.reps} interleaved reps x {args.steps} timed steps")
    print(f"recorder cost: {1e6 * per_event:.2f} us per event (mark, record, convert, write; measured alone)")
    rows = []
    for fusion in fusions:
        row = {"fusion": fusion, "events_per_iteration": events_per_iteration(files[fusion][0])}
        for k, kind in enumerate(("wall", "cpu")):
            off, on = (np.array([r[k] for r in measured[(fusion, m)]]) * 1e3 for m in ("off", "on"))
            row[kind] = {"off_ms": off.tolist(), "on_ms": on.tolist(),
                         "overhead": float(np.median(on) / np.median(off) - 1)}
        wall_off = float(np.median(row["wall"]["off_ms"]))
        row["estimated_overhead"] = row["events_per_iteration"] * per_event * 1e3 / wall_off
        rows.append(row)
    for kind, what in (("wall", "wall time per step"), ("cpu", "CPU time of the training thread per step")):
        print(f"\n{what}: medians over repetitions (each the median of {args.steps} steps, slowest rank)")
        print(f"{'fusion':<12} {'off ms':>8} {'on ms':>8} {'overhead':>9}   runs off / on (ms)")
        for row in rows:
            r = row[kind]
            print(f"{row['fusion']:<12} {np.median(r['off_ms']):>8.2f} {np.median(r['on_ms']):>8.2f} "
                  f"{100 * r['overhead']:>8.2f}%   {' '.join(f'{v:.0f}' for v in r['off_ms'])} / "
                  f"{' '.join(f'{v:.0f}' for v in r['on_ms'])}")
    print(f"\nalternating blocks of {args.block} steps in one run per fusion ({alt[0]['steps_each']} steps on and off "
          f"each): median ms per step, slowest rank")
    print(f"{'fusion':<12} {'wall off':>9} {'wall on':>9} {'overhead':>9} {'CPU off':>9} {'CPU on':>9} {'overhead':>9}")
    for a in alt:
        print(f"{a['fusion']:<12} {1e3 * a['off_wall']:>9.2f} {1e3 * a['on_wall']:>9.2f} "
              f"{100 * (a['on_wall'] / a['off_wall'] - 1):>8.2f}% {1e3 * a['off_cpu']:>9.2f} {1e3 * a['on_cpu']:>9.2f} "
              f"{100 * (a['on_cpu'] / a['off_cpu'] - 1):>8.2f}%")
    print("\nestimate: events per iteration x cost per event / wall time off")
    for row in rows:
        print(f"{row['fusion']:<12} {row['events_per_iteration']:>6.0f} events "
              f"{100 * row['estimated_overhead']:>6.2f}%")

    horovod_file = os.environ.get("HOROVOD_TIMELINE")
    runs = []
    for fusion in fusions:
        merged_path = os.path.join(args.out, f"{fusion}.merged.json")
        events, meta = merge(([horovod_file] if horovod_file else []) + files[fusion])
        write_trace(merged_path, events, meta)
        runs.append(breakdown(merged_path, fusion, skip=2))
    print(f"\nbreakdown (last repetition, mean over iterations after warm-up and profiling, then ranks)")
    print(table(runs))
    plot(runs, os.path.join(args.out, "breakdown.png"),
         f"ResNet-18 w{args.width}, {args.compressor}@{args.density:g}, {hvd.size()} workers")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "seconds_per_event": per_event, "overhead": rows, "alternating": alt,
                   "breakdown": [{"fusion": r.label, "parts_ms": {k: 1e3 * v for k, v in r.parts.items()},
                                  "iteration_ms": 1e3 * r.iteration, "collective_ms": 1e3 * r.collective,
                                  "buffers": r.buffers} for r in runs]}, f, indent=1)
    print(f"wrote {args.out}/results.json, breakdown.png and the merged traces *.merged.json")


if __name__ == "__main__":
    main()
