"""Worker of ``test_memory.py`` (launched by ``horovodrun``): what the plugin holds, measured.

For each configuration — the default, ``dense=False``, each communicator, momentum correction —
a model of 1.7 M weights (an ``EmbeddingBag(6000, 256)`` and two linear layers: one large
tensor, as in the models that barely fit) trains with SGD and momentum until the plugin has
switched to the profiled plan and settled, and a few steps more. Then
:func:`horovod_safusion.memory.held` sums the distinct tensor storages the optimizer, controller,
compressor, communicator and profiler hold, and the peak during the run is read from the same walk
after every step. The resident peak of each configuration (``VmHWM`` restarted when it starts,
over the resident set then) is measured too, and that of ``hvd.DistributedOptimizer`` trained
the same way: the difference is what the plugin adds at its peak, transients within a step
included (the launcher sets a fixed ``MALLOC_MMAP_THRESHOLD_``, so that every large tensor is its
own mapping and the resident set follows allocations and frees page by page). The default
configuration then trains 300 more steps: its resident memory (``VmRSS``, free heap memory handed
back first) is sampled every 10 steps, the Python heap's growth is traced (``tracemalloc``), and
what the plugin holds is walked again at the end. Records go to ``OUT/memory.rank{r}.json``.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import traceback
import tracemalloc

import torch
import torch.nn.functional as F
from torch import nn
import horovod.torch as hvd

import horovod_safusion as saf
from horovod_safusion import memory, regime

MARGIN = regime.HALF_MARGIN

HALF = "critical steps as float16"  # not an optimizer argument: the margin is lifted for the run
CONFIGS = {
    "horovod": None,  # hvd.DistributedOptimizer: the baseline of the resident peaks
    "default": {},
    "dense=False": {"dense": False},
    "allgather": {"communicator": "allgather", "dense": False},
    "allreduce": {"communicator": "allreduce"},
    "spardl": {"communicator": "spardl", "dense": False},
    "zen": {"communicator": "zen", "dense": False},
    "exdyna": {"communicator": "exdyna", "compressor": "exdyna", "dense": False},
    "scalecom": {"communicator": "scalecom", "dense": False},
    "momentum_correction": {"momentum_correction": True, "dense": False},
    "ef21-sgdm": {"error_feedback": "ef21-sgdm", "dense": False},
    # critical intervals of 2 steps sent as float16 whatever the sweep measures (regime.HALF_MARGIN)
    "critical_float16": {"critical_regimes": 2, "dense": False, HALF: True},
}
SETTLED_STEPS = 5  # trained after the plan settled, before the walk
SETTLE_LIMIT = 200  # the default's trial waits out critical regimes, which this model's norm keeps raising
LEAK_STEPS = 300


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(6000, 256, mode="mean")
        self.hidden = nn.Linear(256, 512)
        self.out = nn.Linear(512, 10)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(self.bag(x))))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 6000, (32, 16), generator=g)
    return x, x[:, 0] % 10


def train(opt, model, steps: int, first: int, watch=None) -> int:
    for step in range(first, first + steps):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if watch is not None:
            watch()
    return first + steps


def run_horovod() -> dict:
    """The baseline: Horovod's optimizer trained as long as a configuration, its resident peak
    over the resident set before its model was built."""
    base = memory.resident()
    memory.reset_peak()
    torch.manual_seed(0)
    model = Model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    train(opt, model, 20, 0)
    return {"model_bytes": memory.model_bytes(opt), "peak_rise": memory.rss()["hwm"] - base}


def run_config(kwargs: dict, leak: bool) -> dict:
    kwargs = dict(kwargs)
    regime.HALF_MARGIN = float("inf") if kwargs.pop(HALF, False) else MARGIN
    base = memory.resident()
    memory.reset_peak()
    torch.manual_seed(0)
    model = Model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), profile_steps=4, **kwargs)
    peak = [0]
    rise: dict = {"hwm": 0}  # where the resident peak was set: the step and what the optimizer was doing

    def watch():
        peak[0] = max(peak[0], memory.held(opt).bytes)
        hwm = memory.rss()["hwm"]
        if hwm > rise["hwm"]:
            rise.update(hwm=hwm, step=opt.controller.steps, planner=opt.plan.planner, dense=opt.plan.dense,
                        settled=opt.settled)

    step = 0
    while not opt.settled or opt.plan.planner == "provisional":
        step = train(opt, model, 1, step, watch)
        if step > SETTLE_LIMIT:
            raise RuntimeError(f"the optimizer did not settle in {SETTLE_LIMIT} steps")
    step = train(opt, model, SETTLED_STEPS, step, watch)
    peak_rise = memory.rss()["hwm"] - base
    gc.collect()
    held = memory.held(opt)
    rise.pop("hwm")
    out = {"model_bytes": memory.model_bytes(opt), "held": held.bytes, "peak_held": peak[0], "peak_rise": peak_rise,
           "peak_at": rise, "by_path": dict(list(held.by_path.items())[:8]), "plan": opt.plan.planner,
           "dense": opt.plan.dense, "buffers": len(opt.plan.buffers), "settled_at": step,
           "takes_momentum": opt.local_momentum is not None,  # u: DGC's correction or EF21-SGDM
           # the densest selection: a spread gradient's floor where it is above the target
           "densest": max([opt.controller.target_density, *opt.controller.floors().values()]),
           "half": opt.controller.regimes is not None and opt.controller.regimes.half}
    if leak:
        step = train(opt, model, 20, step)  # allocator and caches warm
        tracemalloc.start()
        samples, python = [], []
        for _ in range(LEAK_STEPS // 10):
            step = train(opt, model, 10, step)
            samples.append(memory.resident())  # collects garbage first
            python.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
        out["rss"], out["python"] = samples, python
        out["held_end"] = memory.held(opt).bytes
    return out



def touch_fusion_buffer() -> None:
    """Write every page of Horovod's fusion buffer once. It is allocated whole but becomes resident
    page by page, as fused tensors first reach each part of it; a measurement that happened to be
    the first to fuse the model's large tensor counted those pages as its own peak (Horovod's
    baseline varied by about the model's size from run to run)."""
    n = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 64 << 20)) // 4 // 8
    hvd.grouped_allreduce([torch.ones(n) for _ in range(8)], name="memory_worker.touch_fusion_buffer")


def main() -> None:
    out_dir = sys.argv[1]
    hvd.init()
    torch.set_num_threads(1)
    records: dict = {}
    try:
        touch_fusion_buffer()
        run_horovod()  # once-per-process allocations (Gloo's buffers, the kernels')
        run_config({"dense": False}, leak=False)  # are made before anything is measured
        for name, kwargs in CONFIGS.items():
            records[name] = run_horovod() if kwargs is None else run_config(kwargs, leak=name == "default")
    except Exception:
        records["exception"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"memory.rank{hvd.rank()}.json"), "w") as f:
        json.dump(records, f)
    if "exception" in records:
        sys.exit(1)


if __name__ == "__main__":
    main()
