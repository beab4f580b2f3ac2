"""Command line: ``python -m horovod_safusion {list,plan} ...``.

* ``list`` — the registered compressors, fusion planners and communicators.
* ``plan --model MODULE:CALLABLE`` — the fusion plan a planner makes for a model (tensors in
  back-propagation order as the optimizer assumes them), as a table.
"""
from __future__ import annotations

import argparse
import importlib
import sys


def _first_line(obj) -> str:
    return (obj.__doc__ or "").strip().splitlines()[0] if obj.__doc__ else ""


def cmd_list(_: argparse.Namespace) -> int:
    from . import compressors, communicators, generator
    for title, registry in (("compressors", compressors.base._REGISTRY),
                            ("fusion planners", generator.base._REGISTRY),
                            ("communicators", communicators.base._REGISTRY)):
        print(f"{title}:")
        for name, cls in sorted(registry.items()):
            print(f"  {name:<16} {_first_line(cls)}")
    return 0


def load_model(spec: str):
    """``package.module:Callable`` → the model it returns when called without arguments."""
    module, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--model must look like package.module:Callable, got {spec!r}")
    return getattr(importlib.import_module(module), attr)()


def cmd_plan(args: argparse.Namespace) -> int:
    from .generator import NaivePlanner, TensorInfo, make_planner
    model = load_model(args.model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    planner = (NaivePlanner(args.capacity_bytes, args.order) if args.fusion == "safusion-naive"
               else make_planner(args.fusion))
    plan = planner.plan([TensorInfo(n, p.numel(), p.element_size(), f"{p.dtype}@{p.device}") for n, p in named])
    params = dict(named)
    print(f"{args.model}: {len(named)} parameter tensors, "
          f"{sum(p.numel() for p in params.values()):,} elements")
    print(plan.table({n: p.numel() for n, p in params.items()},
                     {n: p.element_size() for n, p in params.items()}))
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json(indent=1))
        print(f"plan written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .generator.naive import DEFAULT_CAPACITY_BYTES
    ap = argparse.ArgumentParser(prog="python -m horovod_safusion", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="registered compressors, planners and communicators").set_defaults(fn=cmd_list)
    p = sub.add_parser("plan", help="print the fusion plan of a model")
    p.add_argument("--model", required=True, help="importable constructor, e.g. torchvision.models:resnet18")
    p.add_argument("--fusion", default="safusion-naive")
    p.add_argument("--capacity-bytes", type=int, default=DEFAULT_CAPACITY_BYTES,
                   help="dense bytes per buffer for safusion-naive")
    p.add_argument("--order", choices=("ahead", "behind"), default="ahead")
    p.add_argument("--json", help="also write the plan as JSON to this file")
    p.set_defaults(fn=cmd_plan)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
