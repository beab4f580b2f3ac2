"""Merging Horovod's Timeline with the plugin's per-rank files into one Chrome trace.

Horovod's file (``horovodrun --timeline-filename`` / ``$HOROVOD_TIMELINE``, written by rank 0)
counts ``ts`` from ``start_time_since_epoch_in_micros`` in its header; each plugin file
(:mod:`.recorder`) does the same from its own start. The merged file uses Horovod's start as its
zero and shifts every plugin event by the difference of the starts, so Horovod's per-tensor rows
(``NEGOTIATE_ALLGATHER``, ``ALLGATHER``, ``MEMCPY_IN_FUSION_BUFFER`` … of SAFusion §3.2 / Figure 7)
and the plugin's rows ("safusion rank R", sorted first) share one time axis. Ranks on different
hosts are aligned only as well as their system clocks agree (NTP).
"""
from __future__ import annotations

from typing import Sequence

from .recorder import RANK_KEY
from .trace import START_KEY, TraceError, load_events, start_micros


def is_plugin_file(events: list[dict]) -> bool:
    """Whether ``events`` come from the plugin's recorder (its process rows carry the rank)."""
    return any(e.get("ph") == "M" and RANK_KEY in e.get("args", {}) for e in events)


def merge(paths: Sequence[str]) -> tuple[list[dict], dict]:
    """Merge Horovod's Timeline (at most one) and plugin files; returns ``(events, meta)``.

    Which file is which is read from the files: plugin files name their rank in their process
    rows, Horovod's carries only ``start_time_since_epoch_in_micros`` in its header.
    """
    if not paths:
        raise ValueError("timeline merge needs at least one file")
    horovod, plugins = None, []
    for path in paths:
        events = load_events(path)
        start = start_micros(events)
        if start is None:
            raise TraceError(f"{path} is not a Horovod or horovod_safusion timeline: its header has no "
                             f"{START_KEY!r} (accepted: a file of horovodrun --timeline-filename or "
                             f"$HOROVOD_TIMELINE, or of the optimizer's timeline= / $HOROVOD_SAFUSION_TIMELINE)")
        if is_plugin_file(events):
            plugins.append((path, events, start))
        elif horovod is not None:
            raise ValueError(f"two Horovod timelines given ({horovod[0]} and {path}); merge takes one "
                             "Horovod file and the plugin's per-rank files")
        else:
            horovod = (path, events, start)
    if not plugins:
        raise ValueError(f"no horovod_safusion timeline among {list(paths)}; pass the per-rank files written "
                         "with the optimizer's timeline= or $HOROVOD_SAFUSION_TIMELINE")
    zero = horovod[2] if horovod else min(start for _, _, start in plugins)
    merged = list(horovod[1]) if horovod else []
    seen_pids = set()
    for path, events, start in plugins:
        shift = start - zero
        for e in events:
            if e.get("ph") == "M":
                if e["name"] == "process_name":
                    if e["pid"] in seen_pids:
                        raise ValueError(f"{path} repeats rank {e['args'][RANK_KEY]} of an earlier file; "
                                         "give each rank's file once")
                    seen_pids.add(e["pid"])
                    e = {**e, "args": {k: v for k, v in e["args"].items() if k != START_KEY}}
                merged.append(e)
            else:
                merged.append({**e, "ts": round(float(e["ts"]) + shift, 3)} if "ts" in e else e)
    meta = {START_KEY: zero, "horovod_timeline": horovod[0] if horovod else None,
            "safusion_timelines": [p for p, _, _ in plugins]}
    if horovod is None:  # keep the header that makes the merged file mergeable and readable again
        merged.insert(0, {"name": "process_name", "ph": "M", "pid": 0, "args": {START_KEY: zero}})
    return merged, meta
