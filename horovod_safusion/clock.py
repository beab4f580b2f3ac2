"""Clock: points in time on the host or on the device, without synchronising the two.

Shared by the generator's profiler (SAFusion §4, Figure 12) and the timeline recorder
(:mod:`horovod_safusion.timeline`). On CPU a mark is ``time.perf_counter()``; on GPU it is a CUDA
event recorded on the current stream, so marking never waits for the device. Differences are
resolved later, when the events are long complete.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch


def epoch_offset(samples: int = 32) -> float:
    """Seconds from ``perf_counter()`` to the Unix epoch: ``perf_counter`` is monotonic and precise,
    ``time.time()`` is on the axis of Horovod's Timeline header (``start_time_since_epoch_in_micros``).

    One pair of reads is off by however long the process was descheduled between them, which on
    a busy host shifts a whole rank's timeline against the others. So each ``time.time()`` is
    bracketed by two ``perf_counter()`` reads and the tightest bracket of ``samples`` gives the offset.
    """
    def bracket() -> tuple[float, float]:
        before, wall, after = time.perf_counter(), time.time(), time.perf_counter()
        return after - before, wall - (before + after) / 2

    return min(bracket() for _ in range(samples))[1]


# Taken once, at import.
_EPOCH_OFFSET = epoch_offset()


class Clock:
    """Marks points in time without synchronising the host with the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # mark(): now, as a perf_counter() value on CPU or a recorded CUDA event on GPU — bound
        # here rather than dispatched per call: the timeline and the profiler take hundreds a step.
        self.mark: Callable[[], Any] = self._event if self.cuda else time.perf_counter

    @staticmethod
    def _event() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    def anchor(self) -> tuple[float, Any]:
        """A host time and a mark taken together; :meth:`epoch_micros` places marks relative to it."""
        return time.perf_counter(), self.mark()

    def micros_converter(self, anchor: tuple[float, Any], zero_us: float) -> Callable[[Any], float]:
        """A function: mark → microseconds since ``zero_us`` (epoch microseconds), as :meth:`epoch_micros`.

        On CPU it is one multiply-add, for converting many marks at once."""
        if self.cuda:
            return lambda mark: self.epoch_micros(mark, anchor) - zero_us
        base = _EPOCH_OFFSET * 1e6 - zero_us
        return lambda mark: mark * 1e6 + base

    def epoch_micros(self, mark: Any, anchor: tuple[float, Any]) -> float:
        """Microseconds since the Unix epoch of ``mark``.

        On CPU exact. On GPU the device time elapsed since the anchor's event is added to the
        anchor's host time, which assumes that the device reached the anchor when the host
        recorded it (true when the device is not behind; otherwise events shift later together).
        Waits for ``mark`` to complete, so call it after the step that recorded it.
        """
        if self.cuda:
            host, event = anchor
            mark.synchronize()
            return (host + _EPOCH_OFFSET) * 1e6 + event.elapsed_time(mark) * 1e3
        return (mark + _EPOCH_OFFSET) * 1e6
