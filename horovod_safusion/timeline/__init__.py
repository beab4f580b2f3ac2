"""Timeline: the plugin's phases as Chrome-trace events, merged with Horovod's Timeline, and the
training-time breakdown of SAFusion §5 Experiment 3 (Figure 15).

* :mod:`.recorder` — per rank, while training (``timeline=`` / ``$HOROVOD_SAFUSION_TIMELINE``);
* :mod:`.merge` — Horovod's file and the plugin's files on one time axis;
* :mod:`.breakdown` — per-iteration means per run, a table and a stacked-bar PNG;
* :mod:`.trace` — reading (also unclosed files), writing, nesting checks.
"""
from .recorder import ENV, TimelineRecorder
from .trace import TraceError, load_events

__all__ = ["ENV", "TimelineRecorder", "TraceError", "load_events"]
