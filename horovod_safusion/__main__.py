"""Command line: ``python -m horovod_safusion {list,plan,timeline,doctor} ...``.

* ``list`` — the registered compressors, fusion planners and communicators.
* ``plan`` — the fusion plan of every planner side by side, as the job would run it (its small
  tensors whole, :func:`~horovod_safusion.plan.send_small_dense`, by the rule the profile
  carries), with the pipeline simulator's predicted iteration time, for a saved profile
  (``--profile FILE``) or for a model profiled on the spot in one process (``--model
  package.module:callable --input-shape C,H,W``). One process has no network, so ``--latency``
  and ``--bandwidth`` replace the communication curve by an α–β model for what-if planning.
* ``timeline merge`` — Horovod's Timeline and the plugin's per-rank timelines in one Chrome trace.
* ``timeline breakdown`` — per-iteration means of forward, backward, compression, fusion copies,
  collective time and NOCT per run (SAFusion §5 Experiment 3), as a table and a stacked-bar PNG.
* ``doctor`` — Horovod's build, torch's devices, the compiled kernels, Triton and the cycle time,
  each ok, warning or fatal with what to do (:mod:`.doctor`); exits 1 on a fatal finding.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from . import doctor
from .density import DEFAULT as DEFAULT_DENSITY


def _first_line(obj) -> str:
    return (obj.__doc__ or "").strip().splitlines()[0] if obj.__doc__ else ""


def cmd_list(_: argparse.Namespace) -> int:
    from .communicators.base import COMMUNICATORS
    from .compressors.base import COMPRESSORS
    from .fusion.planner import PLANNERS
    for registry in (COMPRESSORS, PLANNERS, COMMUNICATORS):
        print(f"{registry.plural}:")
        for name, cls in registry.items():
            print(f"  {name:<16} {_first_line(cls)}")
    return 0


def load_model(spec: str):
    """``package.module:Callable`` → the model it returns when called without arguments."""
    module, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--model must look like package.module:Callable, got {spec!r}")
    return getattr(importlib.import_module(module), attr)()


def profile_model(args: argparse.Namespace):
    """Profile a model in this process (a one-worker Horovod job) with the online profiler (no
    critical regimes: they would send the steps dense and hold the profile back)."""
    import torch
    import horovod.torch as hvd
    from tqdm import tqdm
    from .optimizer import DistributedOptimizer

    hvd.init()
    model = load_model(args.model)
    shape = tuple(int(v) for v in args.input_shape.split(","))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
                               compressor=args.compressor, density=args.density, fusion="safusion",
                               profile_steps=args.steps, critical_regimes=None)
    x = torch.randn(args.batch_size, *shape)
    for _ in tqdm(range(args.steps + 1), desc="profiling", file=sys.stderr):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    return opt.profile


def cmd_plan(args: argparse.Namespace) -> int:
    from .fusion import (CostCurve, CupcakePlanner, InterPlanner, NaivePlanner, OMGSPlanner, Profile,
                            SAFusionPlanner, simulate)
    if (args.profile is None) == (args.model is None):
        raise SystemExit("give exactly one of --profile FILE or --model package.module:callable")
    profile = Profile.load(args.profile) if args.profile else profile_model(args)
    if args.save_profile:
        profile.save(args.save_profile)
        print(f"profile written to {args.save_profile}")
    if args.latency is not None or args.bandwidth is not None:
        if args.latency is None or args.bandwidth is None:
            raise SystemExit("--latency and --bandwidth go together")
        profile.communicate = CostCurve.alpha_beta(args.latency, args.bandwidth / 8)
    planners = {"safusion-naive": NaivePlanner(args.capacity_bytes), "safusion-inter": InterPlanner(args.num_buffers),
                "safusion": SAFusionPlanner(), "cupcake": CupcakePlanner(max_states=args.cupcake_max_states),
                "omgs": OMGSPlanner()}
    # as the job would run them: its small tensors whole (the profile carries its rule)
    plans = {name: profile.send_small_dense(p.plan(profile.tensors, profile)) for name, p in planners.items()}
    schedules = {name: simulate(profile, plan) for name, plan in plans.items()}
    total = sum(t.numel for t in profile.tensors)
    print(f"{len(profile.tensors)} gradient tensors, {total:,} elements, density {profile.density:g}, "
          f"{profile.workers} worker(s); {profile.meta.get('communicator', '?')} communication")
    if profile.dense_allreduce is not None and not profile.prices_dense:
        print("no dense plan priced: this profile's job ran with dense=False, and timed the dense allreduce "
              "only for the tensors it sends whole")
    for name in planners:
        print(f"\n[{name}] {len(plans[name].buffers)} buffers")
        print(schedules[name].table())
    print(f"\n{'planner':<16} {'buffers':>7} {'iteration ms':>12} {'NOCT ms':>8} {'vs naive':>8}")
    base = schedules["safusion-naive"].iteration
    for name, s in schedules.items():
        print(f"{name:<16} {len(s.buffers):>7} {1e3 * s.iteration:>12.2f} {1e3 * s.noct:>8.2f} "
              f"{base / s.iteration:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            f.write(plans["safusion"].to_json(indent=1))
        print(f"safusion plan written to {args.json}")
    return 0


def cmd_timeline_merge(args: argparse.Namespace) -> int:
    from .timeline.merge import merge
    from .timeline.trace import write_trace
    events, meta = merge(args.files)
    write_trace(args.output, events, meta)
    print(f"{len(events)} events from {len(args.files)} files written to {args.output} "
          f"(Horovod timeline: {meta['horovod_timeline'] or 'none'})")
    return 0


def cmd_timeline_breakdown(args: argparse.Namespace) -> int:
    from .timeline.breakdown import breakdown, plot, table
    labels = args.labels.split(",") if args.labels else [None] * len(args.files)
    if len(labels) != len(args.files):
        raise SystemExit(f"--labels has {len(labels)} names for {len(args.files)} files")
    runs = [breakdown(f, label, args.skip) for f, label in zip(args.files, labels)]
    print(table(runs))
    if args.png:
        plot(runs, args.png, args.title)
        print(f"stacked bars written to {args.png}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    return doctor.run(args.json)


def main(argv: list[str] | None = None) -> int:
    from .fusion.safusion_naive import DEFAULT_CAPACITY_BYTES
    ap = argparse.ArgumentParser(prog="python -m horovod_safusion", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="registered compressors, planners and communicators").set_defaults(fn=cmd_list)
    p = sub.add_parser("plan", help="plans and predicted iteration times of every planner")
    p.add_argument("--profile", help="a profile saved as JSON (optimizer.profile.save(path))")
    p.add_argument("--model", help="importable constructor, e.g. models:resnet18 (with PYTHONPATH=examples)")
    p.add_argument("--input-shape", default="1,8,8", help="one sample's shape for --model (default 1,8,8)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="profiled iterations for --model")
    p.add_argument("--compressor", default="dgc")
    p.add_argument("--density", type=float, default=DEFAULT_DENSITY)
    p.add_argument("--latency", type=float, help="seconds per collective (α), with --bandwidth")
    p.add_argument("--bandwidth", type=float, help="bits per second (β = 1/bandwidth), with --latency")
    p.add_argument("--capacity-bytes", type=int, default=DEFAULT_CAPACITY_BYTES, help="for safusion-naive")
    p.add_argument("--num-buffers", type=int, default=4, help="M for safusion-inter")
    p.add_argument("--cupcake-max-states", type=int, default=100_000,
                   help="stop Cupcake's search after this many states (default 100000)")
    p.add_argument("--save-profile", help="write the profile used as JSON")
    p.add_argument("--json", help="write the safusion plan as JSON")
    p.set_defaults(fn=cmd_plan)
    t = sub.add_parser("timeline", help="merge timelines; training-time breakdown").add_subparsers(
        dest="timeline_cmd", required=True)
    m = t.add_parser("merge", help="Horovod's Timeline + the plugin's per-rank files -> one Chrome trace")
    m.add_argument("files", nargs="+", help="at most one Horovod timeline and the plugin's files (any order)")
    m.add_argument("-o", "--output", required=True, help="merged Chrome-trace JSON (open in Perfetto)")
    m.set_defaults(fn=cmd_timeline_merge)
    b = t.add_parser("breakdown", help="per-iteration breakdown of each run (a merged or plugin file)")
    b.add_argument("files", nargs="+", help="one file per run: merged, or a plugin timeline")
    b.add_argument("--labels", help="comma-separated run names (default: file names)")
    b.add_argument("--skip", type=int, default=1, help="first iterations left out (default 1; profiling "
                                                         "iterations are always left out)")
    b.add_argument("--png", help="write a stacked-bar chart here")
    b.add_argument("--title", default="")
    b.set_defaults(fn=cmd_timeline_breakdown)
    d = sub.add_parser("doctor", help="what this environment gives the plugin, and what to fix")
    doctor.add_arguments(d)
    d.set_defaults(fn=cmd_doctor)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError) as e:  # bad input files: the message names the file and what is accepted
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
