"""Chrome-trace files: robust reading, writing, and the checks a well-formed timeline passes.

Horovod's Timeline (the format of ``horovod/common/timeline.cc``) is a JSON array of Chrome-trace
events written while training runs: a header event of ``pid`` 0 whose ``args`` carry
``start_time_since_epoch_in_micros``, one process row (``pid``) per tensor, and ``B``/``E``/``X``
events whose ``ts`` are microseconds since that start. A file of a job that was killed may lack
its closing ``]`` or end in the middle of an event; the Chrome-trace format allows the former
("the ``]`` at the end is optional") and :func:`load_events` repairs both. The plugin's own files
(:mod:`.recorder`) use the same form.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Iterable

START_KEY = "start_time_since_epoch_in_micros"
PHASES = {"B", "E", "X", "i", "I", "M", "b", "e", "n", "s", "t", "f", "C", "P", "N", "O", "D", "R"}


class TraceError(ValueError):
    """A file that is not a Chrome trace (JSON array of events, or an object with ``traceEvents``)."""


def load_events(path: str) -> list[dict]:
    """The events of a Chrome-trace file, also when it was written incrementally and not closed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise TraceError(f"{path} is not a Chrome trace: not UTF-8 text ({e})") from None
    data = _parse(text, path)
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        events = data["traceEvents"]
    elif isinstance(data, list):
        events = data
    else:
        raise TraceError(f"{path} is not a Chrome trace: expected a JSON array of events or an object "
                         f"with a 'traceEvents' array, got {type(data).__name__}"
                         + (f" with keys {sorted(data)[:5]}" if isinstance(data, dict) else ""))
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") not in PHASES:
            raise TraceError(f"{path} is not a Chrome trace: event {i} is {str(e)[:80]!r}; every event is an "
                             f"object whose 'ph' is one of {''.join(sorted(PHASES))}")
    return events


def _parse(text: str, path: str) -> Any:
    stripped = text.strip()
    if not stripped:
        raise TraceError(f"{path} is not a Chrome trace: the file is empty")
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as first:
        if not stripped.startswith("["):
            raise TraceError(f"{path} is not a Chrome trace: not JSON ({first})") from None
    # An array written incrementally: drop a trailing comma, or cut back to the last complete event.
    body = stripped
    for _ in range(3):
        body = body.rstrip().rstrip(",").rstrip("]")
        try:
            return json.loads(body + "]")
        except json.JSONDecodeError:
            cut = body.rfind("}", 0, len(body) - 1)
            if cut < 0:
                break
            body = body[:cut + 1]
    raise TraceError(f"{path} is not a Chrome trace: a JSON array that cannot be repaired "
                     f"(not even by closing it after its last complete event)")


def start_micros(events: Iterable[dict]) -> float | None:
    """``start_time_since_epoch_in_micros`` from a file's header, if it has one."""
    for e in events:
        if e.get("ph") == "M" and START_KEY in e.get("args", {}):
            return float(e["args"][START_KEY])
    return None


def write_trace(path: str, events: list[dict], meta: dict | None = None) -> None:
    """Write ``events`` as a closed Chrome-trace JSON object (one event a line, for diffing)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit": "ms", "otherData": ' + json.dumps(meta or {}) + ',\n"traceEvents": [\n')
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in events))
        f.write("\n]}\n")


def complete_spans(events: Iterable[dict]) -> dict[tuple, list[tuple[float, float, str]]]:
    """``(pid, tid) → [(start, end, name)]`` of the ``X`` events and matched ``B``/``E`` pairs."""
    rows: dict[tuple, list] = defaultdict(list)
    open_: dict[tuple, list] = defaultdict(list)
    for e in events:
        key, ph = (e.get("pid"), e.get("tid")), e["ph"]
        if ph == "X":
            rows[key].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "")))
        elif ph == "B":
            open_[key].append(e)
        elif ph == "E" and open_[key]:
            b = open_[key].pop()
            rows[key].append((float(b["ts"]), float(e["ts"]), b.get("name", "")))
    return rows


def nesting_violations(events: Iterable[dict], tolerance_us: float = 0.01) -> list[str]:
    """Spans on one row that partly overlap (neither disjoint nor nested): impossible on one thread.

    Chrome's viewer stacks the spans of one ``(pid, tid)`` row as a call stack, so on every row two
    spans must either be disjoint or one must contain the other. ``tolerance_us`` absorbs rounding:
    ``ts`` and ``dur`` are written with 3 decimals, so a span that begins where the previous ends
    (both from one mark) can seem to overlap it by 0.001 µs.
    """
    problems = []
    for key, spans in complete_spans(events).items():
        stack: list[tuple[float, float, str]] = []
        for s, e, name in sorted(spans, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1][1] <= s + tolerance_us:
                stack.pop()
            if stack and e > stack[-1][1] + tolerance_us:
                p = stack[-1]
                problems.append(f"pid {key[0]} tid {key[1]}: {name} [{s:.1f}, {e:.1f}] overlaps "
                                f"{p[2]} [{p[0]:.1f}, {p[1]:.1f}] without nesting in it")
            stack.append((s, e, name))
    return problems
