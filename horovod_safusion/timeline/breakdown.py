"""Training-time breakdown per iteration from the plugin's timeline (SAFusion §5 Experiment 3).

Figure 15 splits an iteration into forward, sparsification (compression), backward and
non-overlapped communication time (NOCT); Figure 7 (§3.2) adds the copies into and out of the
fusion buffer. From the events of :mod:`.recorder`, per rank and ``ITERATION``:

* ``forward`` — ``FORWARD`` (derived: iteration start → first gradient hook, so it includes data
  loading and ``zero_grad``; exact when the recorder watched the model);
* ``backward`` — ``BACKWARD`` minus the plugin's work in the gradient hooks (``GRADIENT_READY``);
* ``compress``, ``copy in``, ``submit``, ``decompress``, ``copy out`` — their events, in hooks and
  in ``synchronize()``;
* ``NOCT`` — ``WAIT_FOR_COLLECTIVE``: waiting in ``synchronize()`` for collectives that
  back-propagation did not hide;
* ``step`` — ``OPTIMIZER_STEP``;
* ``other`` — the iteration minus all of the above: hook and ``synchronize()`` bookkeeping and
  the gaps between phases. A small ``other`` says the parts account for the iteration.

``collective`` (not a part of the sum) is the wall time during which at least one of the
iteration's collectives was in flight (submission → result in ``synchronize()``), i.e. overlapped
plus non-overlapped communication. Profiled iterations (the last one also runs the profile's
sweeps and switches the plan) and the first ``skip`` iterations are left out. Values are means over
iterations, then over ranks, in seconds.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..observer import COMPRESS, DECOMPRESS, GRADIENT_READY, MEMCPY_IN, MEMCPY_OUT, SUBMIT, WAIT
from . import recorder as R
from .trace import load_events

PARTS = ("forward", "backward", "compress", "copy in", "submit", "NOCT", "decompress", "copy out", "step",
         "other")
_EVENT_PARTS = {COMPRESS: "compress", MEMCPY_IN: "copy in", SUBMIT: "submit", WAIT: "NOCT",
                DECOMPRESS: "decompress", MEMCPY_OUT: "copy out", R.OPTIMIZER_STEP: "step",
                R.FORWARD: "forward"}


@dataclass
class Breakdown:
    """Mean seconds per iteration of one run (one file): the parts (they add up to ``iteration``),
    the wall time with a collective in flight, collectives per iteration, and each rank's means."""

    label: str
    parts: dict[str, float]
    iteration: float
    collective: float
    iterations: int
    ranks: int
    buffers: float
    per_rank: list[dict] = field(default_factory=list)


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def iterations_of_rank(events: list[dict], skip: int = 1) -> list[dict]:
    """Per kept iteration of one rank's events: seconds of every part, the iteration and collectives."""
    spans = [e for e in events if e.get("ph") == "X"]
    iters = sorted((e for e in spans if e["name"] == R.ITERATION), key=lambda e: e["ts"])
    iters = [e for e in iters if not e.get("args", {}).get("profiling")][skip:]
    starts = np.array([float(e["ts"]) for e in iters])
    by_iter: list[list[dict]] = [[] for _ in iters]
    for e in spans:
        if e["name"] == R.ITERATION:
            continue
        i = int(np.searchsorted(starts, float(e["ts"]), side="right")) - 1
        if i >= 0 and float(e["ts"]) < float(iters[i]["ts"]) + float(iters[i]["dur"]):
            by_iter[i].append(e)
    out = []
    for it, evs in zip(iters, by_iter):
        s, total = float(it["ts"]), float(it["dur"])
        sums: dict[str, float] = defaultdict(float)
        hooks = backward = 0.0
        collectives = []
        for e in evs:
            name, dur = e["name"], float(e["dur"])
            if name in _EVENT_PARTS:
                sums[_EVENT_PARTS[name]] += dur
            elif name == GRADIENT_READY:
                hooks += dur
            elif name == R.BACKWARD:
                backward += dur
            elif name == R.COLLECTIVE:
                collectives.append((max(float(e["ts"]), s), min(float(e["ts"]) + dur, s + total)))
        sums["backward"] = backward - hooks
        parts = {k: sums.get(k, 0.0) / 1e6 for k in PARTS if k != "other"}
        parts["other"] = total / 1e6 - sum(parts.values())
        out.append({"parts": parts, "iteration": total / 1e6, "collective": _union(collectives) / 1e6,
                    "buffers": len(collectives), "step": it.get("args", {}).get("step")})
    return out


def breakdown(path: str, label: str | None = None, skip: int = 1) -> Breakdown:
    """The breakdown of one run: a merged file or a plugin file (one rank or several)."""
    events = load_events(path)
    ranks = {e["pid"]: e["args"][R.RANK_KEY] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and R.RANK_KEY in e.get("args", {})}
    if not ranks:
        raise ValueError(f"{path} has no horovod_safusion events (no process row named 'safusion rank R'); "
                         "record them with the optimizer's timeline= or $HOROVOD_SAFUSION_TIMELINE, and merge "
                         "with: python -m horovod_safusion timeline merge")
    by_pid: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("pid") in ranks:
            by_pid[e["pid"]].append(e)
    per_rank = []
    for pid in sorted(ranks, key=ranks.get):
        its = iterations_of_rank(by_pid[pid], skip)
        if not its:
            raise ValueError(f"{path}: rank {ranks[pid]} has no complete iteration after skipping {skip} and the "
                             "profiling ones; record more steps or lower --skip")
        per_rank.append({"rank": ranks[pid], "iterations": len(its),
                         "parts": {k: float(np.mean([i["parts"][k] for i in its])) for k in PARTS},
                         "iteration": float(np.mean([i["iteration"] for i in its])),
                         "collective": float(np.mean([i["collective"] for i in its])),
                         "buffers": float(np.mean([i["buffers"] for i in its]))})
    mean = lambda key: float(np.mean([r[key] for r in per_rank]))  # noqa: E731
    return Breakdown(label=label or _stem(path),
                     parts={k: float(np.mean([r["parts"][k] for r in per_rank])) for k in PARTS},
                     iteration=mean("iteration"), collective=mean("collective"),
                     iterations=min(r["iterations"] for r in per_rank), ranks=len(per_rank),
                     buffers=mean("buffers"), per_rank=per_rank)


def _stem(path: str) -> str:
    name = os.path.basename(path)
    return name[:-5] if name.endswith(".json") else name


def table(runs: Sequence[Breakdown]) -> str:
    """Milliseconds per iteration, one column per run."""
    width = max(12, *(len(r.label) + 1 for r in runs))
    head = f"{'ms / iteration':<16}" + "".join(f"{r.label:>{width}}" for r in runs)
    lines = [head, "-" * len(head)]
    for k in PARTS:
        lines.append(f"{k:<16}" + "".join(f"{1e3 * r.parts[k]:>{width}.3f}" for r in runs))
    lines.append("-" * len(head))
    lines.append(f"{'iteration':<16}" + "".join(f"{1e3 * r.iteration:>{width}.3f}" for r in runs))
    lines.append(f"{'collective':<16}" + "".join(f"{1e3 * r.collective:>{width}.3f}" for r in runs))
    lines.append(f"{'buffers':<16}" + "".join(f"{r.buffers:>{width}.1f}" for r in runs))
    lines.append(f"{'iterations':<16}" + "".join(f"{r.iterations:>{width}d}" for r in runs))
    lines.append(f"{'ranks':<16}" + "".join(f"{r.ranks:>{width}d}" for r in runs))
    return "\n".join(lines)


# Figure 15's four parts first, then the rest; colours stay fixed across runs.
_STACK = (("forward", ("forward",)), ("compression", ("compress", "decompress")), ("backward", ("backward",)),
          ("NOCT", ("NOCT",)), ("fusion copies", ("copy in", "copy out")), ("submit", ("submit",)),
          ("optimizer step", ("step",)), ("other", ("other",)))


def plot(runs: Sequence[Breakdown], path: str, title: str = "") -> None:
    """A stacked bar per run (Figure 15's form), in milliseconds per iteration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3.2 + 1.3 * len(runs), 4.2))
    x = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    for (label, keys), colour in zip(_STACK, plt.get_cmap("tab10").colors):
        h = np.array([1e3 * max(0.0, sum(r.parts[k] for k in keys)) for r in runs])  # rounding may make other < 0
        ax.bar(x, h, 0.6, bottom=bottom, label=label, color=colour)
        bottom += h
    for xi, r in zip(x, runs):
        ax.text(xi, 1e3 * r.iteration, f"{1e3 * r.iteration:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [r.label for r in runs])
    ax.set_ylabel("ms per iteration")
    ax.set_title(title or "Training time breakdown", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
