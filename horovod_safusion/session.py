"""Collective names carry the Horovod session, so that nothing of a failed session can clash.

Horovod elastic shuts Horovod down after a failure and initialises it again (``hvd.elastic.run``).
Horovod 0.28's background thread marks itself shut down and then empties its tensor queue; a
collective that the training thread enqueues between the two stays in the queue into the next
session, under its name, unfinished. The plugin names its collectives after its fusion buffers,
the same names every step, so the next step's collective of that buffer would fail with Horovod's
"a tensor with the same name as another tensor that is currently being processed" and end the
job. Every name the plugin submits therefore passes through :func:`collective`, which appends the
session's number after the first reset; the elastic sync (:func:`begin`) numbers sessions alike on
every rank (rank 0's number plus one).
"""
from __future__ import annotations

_number = 0


def collective(name: str) -> str:
    """``name`` as submitted to Horovod in this session."""
    return name if _number == 0 else f"{name}~{_number}"


def number() -> int:
    """This session's number (0 until the first elastic reset)."""
    return _number


def begin(previous: int) -> None:
    """A new Horovod session follows session ``previous`` (rank 0's, so that every rank agrees)."""
    global _number
    _number = previous + 1
