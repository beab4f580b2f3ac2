"""Job for ``test_timeline_merge.py``: a short real training run with the plugin's timeline on, launched
by ``horovodrun --timeline-filename`` so that Horovod writes its own Timeline beside it.

    horovodrun -np 2 -H localhost:2 --gloo --timeline-filename OUT/horovod.json \
        python tests/multiproc/timeline_job.py OUT

Writes ``OUT/saf.rank{R}.json`` (the plugin's timeline) and ``OUT/rank{R}.json`` (what the test
compares it with: the wall time of every step measured around it, the plan's buffer count).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import horovod.torch as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits import DigitsCNN, load_digits_split  # noqa: E402

import horovod_safusion as saf  # noqa: E402

STEPS, PROFILE_STEPS = 14, 3


def main() -> None:
    out = sys.argv[1]
    hvd.init()
    torch.set_num_threads(1)
    x, y, _, _ = load_digits_split()
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compressor="dgc", density=0.05,
                                   fusion="safusion", profile_steps=PROFILE_STEPS,
                                   timeline=os.path.join(out, "saf.json"), dense=False, min_selected=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    walls = []
    for step in range(STEPS):
        i = ((step * hvd.size() + hvd.rank()) * 32) % (len(x) - 32)
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
        opt.step()
        walls.append(time.perf_counter() - t0)
    opt.timeline.close()
    with open(os.path.join(out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump({"walls": walls, "buffers": len(opt.plan.buffers), "planner": opt.plan.planner,
                   "timeline": opt.timeline.path}, f)


if __name__ == "__main__":
    main()
