"""Horovod's cycle time for a job that submits one collective per fusion buffer.

Horovod's background thread negotiates in cycles: every ``HOROVOD_CYCLE_TIME`` milliseconds
(1 ms by default in Horovod 0.28) all ranks agree, through a small cross-rank bitwise
allreduce, on which of the tensors they submitted are ready. It does so whether or not anything
was submitted, so an idle job's thread keeps cycling and takes CPU from the core its rank trains
on. Short cycles suit ``hvd.DistributedOptimizer``, which submits one tensor per parameter as
back-propagation produces them. This plugin submits one collective per fusion buffer (SAFusion
§3.1, Step 3) — a handful per step, each ready well before the next — and its buffers are sized so
that communication hides behind back-propagation (SAFusion §3.3), so a longer cycle delays each
buffer by at most one cycle while the thread costs the training core less.

That trade pays only where the workers of a host share its cores: there the background threads'
CPU is taken from training, and a longer cycle gives it back. Where each worker has a core of its
own, the thread costs training little, and the longer cycle's wait shows in every short step. So
the package lengthens the cycle only where the host's workers outnumber its logical CPUs
(:func:`shares_cores`); elsewhere Horovod keeps its own default. The number of workers on the host
comes from the launcher's environment (:mod:`~horovod_safusion.launcher`: ``horovodrun``'s, Open
MPI's, MPICH's); a process launched without one is one worker. docs/benchmarks.md, "Horovod's
cycle time", has the measurements on both sides.

Horovod reads the variable once, in ``hvd.init()``. Importing this package sets it, unless the
user chose a cycle time already (``HOROVOD_CYCLE_TIME``, which ``horovodrun --cycle-time-ms``
sets too), Horovod's autotuner is on (``HOROVOD_AUTOTUNE``, which tunes the cycle time itself),
Horovod is already initialised (then the job keeps Horovod's), or the workers do not share cores.
"""
from __future__ import annotations

import os
import re
from typing import Mapping, MutableMapping

from .launcher import local_workers

#: The cycle time (ms) this package gives Horovod where the host's workers share its cores.
CYCLE_TIME_MS = 5.0

ENV = "HOROVOD_CYCLE_TIME"

#: What :func:`set_default` answered when the package was imported (``None``: the import has not
#: got that far), so that ``doctor`` can tell who chose the cycle time in force.
set_on_import: bool | None = None


def set_default(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Give Horovod :data:`CYCLE_TIME_MS` through ``environ`` where nobody chose a cycle time,
    ``hvd.init()`` has not run yet and the host's workers share its CPUs (:func:`shares_cores`).
    Returns whether it did."""
    import horovod.torch as hvd  # here, not above: ``doctor`` reads this module where Horovod is broken
    if ENV in environ or autotune(environ) or hvd.is_initialized() or not shares_cores(environ):
        return False
    environ[ENV] = f"{CYCLE_TIME_MS:g}"
    return True


def shares_cores(environ: Mapping[str, str], cpus: int | None = None) -> bool:
    """Whether the host's workers outnumber its logical CPUs (``cpus``, default
    ``os.cpu_count()``). The host's count, not this process's affinity: a launcher that binds
    each worker to a core of its own narrows the affinity without sharing anything."""
    return local_workers(environ) > (cpus if cpus is not None else os.cpu_count() or 1)


def autotune(environ: Mapping[str, str]) -> bool:
    """Whether Horovod's autotuner is on: ``HOROVOD_AUTOTUNE`` a positive integer, as Horovod reads it."""
    number = re.match(r"\s*[+-]?\d+", environ.get("HOROVOD_AUTOTUNE", ""))
    return number is not None and int(number.group()) > 0
