"""Recording the plugin's phases of one rank as Chrome-trace events.

Horovod's Timeline takes no events from Python, so the plugin writes its own file per rank, in
the same form (:mod:`.trace`), and :mod:`.merge` puts both on one time axis. The phases are those
that SAFusion argues with: §3.2 / Figure 7 (``MEMCPY_IN_FUSION_BUFFER``,
``MEMCPY_OUT_FUSION_BUFFER`` and the collective) and §5 Experiment 3 / Figure 15 (forward,
sparsification, backward, non-overlapped communication).

Rows of process "safusion rank R" (``pid`` = :data:`PID_BASE` + R):

* ``iterations``: ``ITERATION`` from the end of one ``step()`` to the end of the next.
* ``main``: ``FORWARD`` (start of the iteration → first gradient hook, or the model's own forward
  when :meth:`TimelineRecorder.watch` was given the model), ``BACKWARD`` (→ ``synchronize()``),
  ``SYNCHRONIZE`` containing, per buffer, ``WAIT_FOR_COLLECTIVE`` (the non-overlapped part of
  communication), ``DECOMPRESS`` and ``MEMCPY_OUT_FUSION_BUFFER`` (and the copy, compression and
  submission of buffers that no hook launched), then ``OPTIMIZER_STEP``.
* ``gradient hooks``: ``GRADIENT_READY`` per tensor (its ``ts`` is when back-propagation produced
  the gradient) containing ``MEMCPY_IN_FUSION_BUFFER``, and for a buffer's last tensor ``COMPRESS``
  and ``SUBMIT`` (handing the buffer to Horovod).
* ``collective buffer i``: ``COLLECTIVE`` from submission until ``synchronize()`` has the result.
  Horovod reports no completion to Python, so "done" is when the wait returned: an upper bound on
  the collective's end; Horovod's own rows in the merged file show when it really ran.

Timestamps come from :class:`~horovod_safusion.clock.Clock` (``perf_counter`` on CPU, CUDA
events on GPU); marks are kept raw while a step runs and converted after it: on CPU at once, on
GPU one step later, when the events are long complete, so recording never waits for the device.
Events are written every ``flush_every`` steps and at exit.
"""
from __future__ import annotations

import atexit
import json
import os
from collections import deque
from typing import Any

import torch

from ..clock import Clock
from ..observer import GRADIENT_READY, SUBMIT, SYNCHRONIZE, WAIT, Observer
from .trace import START_KEY

PID_BASE = 1_000_000  # far above Horovod's per-tensor pids (1, 2, ...)
RANK_KEY = "safusion_rank"
ITERATIONS, MAIN, HOOKS, COLLECTIVES = 0, 1, 2, 100  # rows (tid); buffer i's collective on 100 + i
ROW_NAMES = {ITERATIONS: "iterations", MAIN: "main", HOOKS: "gradient hooks"}

# The rows' own events, besides the controller's phases (:mod:`horovod_safusion.observer`):
ITERATION, FORWARD, BACKWARD, OPTIMIZER_STEP = "ITERATION", "FORWARD", "BACKWARD", "OPTIMIZER_STEP"
COLLECTIVE = "COLLECTIVE"
ENV = "HOROVOD_SAFUSION_TIMELINE"


def rank_path(path: str, rank: int) -> str:
    """``path`` with ``{rank}`` filled in, or ``.rankR`` put before its extension."""
    if "{rank}" in path:
        return path.format(rank=rank)
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class TimelineRecorder(Observer):
    """Records one rank's plugin phases: an :class:`~horovod_safusion.observer.Observer` of the
    controller; the optimizer ends its steps.

    Args:
        path: output file; ``{rank}`` in it is replaced by the rank, otherwise ``.rankR`` is put
            before the extension (``saf.json`` → ``saf.rank0.json``).
        model: if given, its forward pass is timed exactly (see :meth:`watch`).
        flush_every: steps between writes to the file. Fewer writes cost less; a killed job loses
            at most this many steps.

    The first step gets no ``ITERATION`` (and no ``FORWARD``/``BACKWARD``): it has no start.
    """

    def __init__(self, path: str, model: torch.nn.Module | None = None, flush_every: int = 50) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"timeline must be a file path (str) or a TimelineRecorder, got {path!r}")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every!r}")
        self.path_template = str(path)
        self.flush_every = flush_every
        self.path: str | None = None
        self.clock: Clock | None = None
        self._model_hooks: list = []
        self._forward_start: Any = None
        self._watching = model is not None
        if model is not None:
            self.watch(model)
        self._events: list[tuple] = []    # (name, row, start mark, end mark, args) of this step
        self._steps: deque = deque()      # finished steps not yet converted: (anchor, events)
        self._lines: list[str] = []       # converted, not yet written
        self._unwritten_steps = 0
        self._args_json: dict[tuple, str] = {}
        self._forward_end: Any = None
        self._row = HOOKS
        self._prev_end: Any = None
        self._first_ready: Any = None
        self._sync: tuple = ()           # (planner, profiling?, step) of synchronize()
        self._sync_start: Any = None
        self._sync_end: Any = None
        self._submitted: dict[int, Any] = {}
        self._paused = False
        self._file = None

    # ---- set-up --------------------------------------------------------------------------------
    def attach(self, controller: Any, rank: int, size: int) -> "TimelineRecorder":
        """Start recording for ``controller``'s rank; called by the optimizer."""
        self.controller = controller
        self.rank = rank
        self.clock = Clock(controller.device)
        self.mark = self.clock.mark  # now, as a clock mark; bound once: taken hundreds of times a step
        self.path = rank_path(self.path_template, rank)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._anchor = self.clock.anchor()
        self._start_us = int(self.clock.epoch_micros(self._anchor[1], self._anchor))
        pid = PID_BASE + rank
        header = [{"name": "process_name", "ph": "M", "pid": pid,
                   "args": {"name": f"safusion rank {rank}", RANK_KEY: rank, "size": size, START_KEY: self._start_us}},
                  {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": -size + rank}}]
        header += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                   for tid, name in ROW_NAMES.items()]
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.write("[\n" + ",\n".join(json.dumps(e) for e in header))
        self._file.flush()
        self._named_rows = set(ROW_NAMES)
        atexit.register(self.close)
        controller.observe(self)
        return self

    def watch(self, model: torch.nn.Module) -> None:
        """Time ``model``'s forward passes exactly (forward pre-hook → forward hook)."""
        self._watching = True
        self._model_hooks += [model.register_forward_pre_hook(self._forward_begins),
                              model.register_forward_hook(self._forward_ends)]

    def _forward_begins(self, *_: Any) -> None:
        if self.clock is not None:
            self._forward_start = self.mark()

    def _forward_ends(self, *_: Any) -> None:
        if self._forward_start is not None and self._prev_end is not None:
            self._events.append((FORWARD, MAIN, self._forward_start, self.mark(), None))
            self._forward_end = self._events[-1][3]
        self._forward_start = None

    def pause(self) -> None:
        """Stop recording between steps (the controller then pays nothing); :meth:`resume` goes on.

        The step after ``resume()`` gets no ``ITERATION``, like the first step."""
        self.controller.unobserve(self)
        self._paused = True
        self._events, self._first_ready, self._sync, self._prev_end, self._forward_end = [], None, (), None, None
        self._sync_start = None

    def resume(self) -> None:
        self.controller.observe(self)
        self._paused = False

    # ---- called by the controller (Observer) ----------------------------------------------------
    def record(self, phase: str, start: Any, end: Any, args: dict | None) -> None:
        """One phase: gradient hooks on their row (the first one's start is where backward's
        gradients begin), everything else on the current row (the hooks', or ``main`` inside
        ``synchronize()``); a collective's row spans submission to the end of its wait."""
        if phase == GRADIENT_READY:
            if self._first_ready is None:
                self._first_ready = start
            self._events.append((phase, HOOKS, start, end, args))
            return
        self._events.append((phase, self._row, start, end, args))
        if phase == SUBMIT:
            self._submitted[args["buffer"]] = start
        elif phase == WAIT:
            buffer = args["buffer"]
            self._events.append((COLLECTIVE, COLLECTIVES + buffer, self._submitted.pop(buffer, start), end,
                                 {"buffer": buffer}))
        elif phase == SYNCHRONIZE:
            self._sync_start, self._sync_end, self._row = start, end, HOOKS

    def synchronize_begins(self, step: int, planner: str, profiled: bool) -> None:
        self._sync = (planner, profiled, step)
        self._row = MAIN

    # ---- called by the optimizer at the end of step() -------------------------------------------
    def step_ends(self) -> None:
        """The optimizer's ``step()`` ended: close the iteration and convert (or queue) its events."""
        if self._paused:
            return
        end = self.mark()
        if self._prev_end is not None and self._sync and self._sync_start is not None:
            self._close_iteration(end)
        self._steps.append((self._anchor, self._events))
        self._anchor = self.clock.anchor() if self.clock.cuda else self._anchor
        self._events, self._first_ready, self._sync, self._sync_start, self._prev_end = [], None, (), None, end
        self._forward_end = None
        # On GPU, convert the step before this one: its events completed long ago.
        while len(self._steps) > (1 if self.clock.cuda else 0):
            self._convert(*self._steps.popleft())
        if self._unwritten_steps >= self.flush_every:
            self.flush()

    def _close_iteration(self, end: Any) -> None:
        planner, profiling, step = self._sync
        sync_start = self._sync_start
        ev = self._events
        if not self._watching:
            ev.append((FORWARD, MAIN, self._prev_end, self._first_ready or sync_start, None))
        backward_from = self._forward_end if self._watching else self._first_ready
        if backward_from is not None:
            ev.append((BACKWARD, MAIN, backward_from, sync_start, None))
        ev.append((OPTIMIZER_STEP, MAIN, self._sync_end, end, None))
        ev.append((ITERATION, ITERATIONS, self._prev_end, end,
                   {"step": step, "plan": planner, "profiling": profiling}))

    def _convert(self, anchor: tuple, events: list[tuple]) -> None:
        # Formatted by hand: json.dumps per event would cost several times more (names are constants).
        us = self.clock.micros_converter(anchor, self._start_us)
        head = '{"name":"%s","ph":"X","ts":%.3f,"dur":%.3f,"pid":' + str(PID_BASE + self.rank) + ',"tid":%d%s}'
        lines, cache = self._lines, self._args_json
        for name, row, a, b, args in events:
            t0 = us(a)
            if args:
                key = tuple(args.items())
                text = cache.get(key)
                if text is None:
                    text = ',"args":' + json.dumps(args, separators=(",", ":"))
                    if len(cache) < 10_000:  # tensor names repeat every step; selected counts do not
                        cache[key] = text
            else:
                text = ""
            if row not in self._named_rows:
                self._named_rows.add(row)
                lines.append(json.dumps({"name": "thread_name", "ph": "M", "pid": PID_BASE + self.rank, "tid": row,
                                         "args": {"name": f"collective buffer {row - COLLECTIVES}"}}))
            lines.append(head % (name, t0, us(b) - t0, row, text))
        self._unwritten_steps += 1

    def flush(self) -> None:
        """Write what has been converted (the events of finished steps)."""
        if self._file is None:
            return
        if self._lines:
            self._file.write(",\n" + ",\n".join(self._lines))
            self._file.flush()
        self._lines, self._unwritten_steps = [], 0

    def close(self) -> None:
        """Convert and write every finished step, close the JSON array and the file."""
        if self._file is None:
            return
        while self._steps:
            self._convert(*self._steps.popleft())
        self.flush()
        self._file.write("\n]\n")
        self._file.close()
        self._file = None
        for h in self._model_hooks:
            h.remove()
        atexit.unregister(self.close)


def make_recorder(timeline: "str | TimelineRecorder | None") -> TimelineRecorder | None:
    """Resolve the optimizer's ``timeline=`` (or, when ``None``, ``$HOROVOD_SAFUSION_TIMELINE``)."""
    if timeline is None:
        timeline = os.environ.get(ENV) or None
        if timeline is None:
            return None
    if isinstance(timeline, TimelineRecorder):
        return timeline
    if isinstance(timeline, (str, os.PathLike)):
        return TimelineRecorder(timeline)
    raise ValueError(f"timeline must be None, a file path (str) or a TimelineRecorder, got {timeline!r}")
