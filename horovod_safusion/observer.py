"""What the controller tells whoever watches a step: its phases, by name, timed by one clock.

The phases are those SAFusion argues with: §3.2 / Figure 7 (copying into and out of the fusion
buffer around the collective) and §5 Experiment 3 / Figure 15 (sparsification, non-overlapped
communication). Two observers implement this interface: the online profiler's
:class:`~horovod_safusion.profiling.ProfiledStep` (SAFusion §4, "Generator module": back-propagation's
own pace with the plugin's work removed) and the timeline's
:class:`~horovod_safusion.timeline.TimelineRecorder`. The controller holds at most one observer
(a :class:`Fanout` when both watch), so a step nobody watches pays one check per phase.

A span is reported when it ends, with the mark it started at: marks are the observer's
:class:`~horovod_safusion.clock.Clock` marks (``perf_counter`` on CPU, CUDA events on GPU),
taken by the controller through :meth:`Observer.mark`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

#: A gradient hook, from its gradient's arrival until the gradient is in its buffer (and, for a
#: buffer's last tensor, the buffer is submitted). Args: ``tensor``.
GRADIENT_READY = "GRADIENT_READY"
#: The error-compensated gradient copied into its segment of the buffer. Args: ``tensor``.
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
#: Selection over the buffer. Args: ``buffer``, ``elements``, ``selected``.
COMPRESS = "COMPRESS"
#: The buffer handed to the communicator (its first collective submitted). Args: ``buffer``.
SUBMIT = "SUBMIT"
#: ``synchronize()`` waiting for a buffer's collective: the non-overlapped communication. Args: ``buffer``.
WAIT = "WAIT_FOR_COLLECTIVE"
#: Decoding the collective's output into the dense buffer. Args: ``buffer``.
DECOMPRESS = "DECOMPRESS"
#: The aggregated buffer written into the gradients. Args: ``buffer``.
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"
#: The whole of ``synchronize()``.
SYNCHRONIZE = "SYNCHRONIZE"


class Observer:
    """Receives the spans of the controller's phases. Subclasses set :attr:`mark` (their clock's)
    and implement :meth:`record`; the rest has defaults.

    Attributes:
        profiles: whether this observer profiles the step (the online profiler's does); the
            timeline marks such iterations, whose collectives the profile's sweeps re-time.
    """

    profiles: bool = False
    mark: Callable[[], Any]

    def span(self, phase: str, start: Any, **args: Any) -> Any:
        """``phase`` ran from ``start`` until now; returns now's mark (the next phase's start)."""
        end = self.mark()
        self.record(phase, start, end, args or None)
        return end

    def record(self, phase: str, start: Any, end: Any, args: dict | None) -> None:
        """One span of ``phase`` (see the module's phase names) with its arguments."""

    def synchronize_begins(self, step: int, planner: str, profiled: bool) -> None:
        """``synchronize()`` of step ``step`` begins (buffers not launched by a hook start in it),
        on a plan made by ``planner``; ``profiled``: whether a profiler watches this step."""


class Fanout(Observer):
    """Several observers as one: marks from the first one's clock (all use the clock of the
    buffers' device), every span to each."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)
        self.mark = self.observers[0].mark
        self.profiles = any(o.profiles for o in self.observers)

    def record(self, phase: str, start: Any, end: Any, args: dict | None) -> None:
        for o in self.observers:
            o.record(phase, start, end, args)

    def synchronize_begins(self, step: int, planner: str, profiled: bool) -> None:
        for o in self.observers:
            o.synchronize_begins(step, planner, profiled)


def combine(observers: Sequence[Observer]) -> Observer | None:
    """``None`` for none, the observer itself for one, a :class:`Fanout` for more."""
    if not observers:
        return None
    return observers[0] if len(observers) == 1 else Fanout(observers)
