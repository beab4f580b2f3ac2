"""The host kernels loaded on a thread of their own while the first steps wait for the link.

The install compiles the host kernels once and Numba caches them (``make install``,
:func:`~horovod_safusion.compressors.segmented.warm_up`), but every worker still loads them from
that cache the first time it selects. That takes a fraction of a second per process, more where
workers share cores, and it fell on the training thread in the profile's compression sweep
(SAFusion §4, "Generator module": the compression time comes from online profiling), which the
whole job waits for. ``DistributedOptimizer`` starts :func:`load` at construction for the dtypes
of its parameters, so that loading runs while the first steps, dense, wait for their allreduces;
the profile calls :func:`wait` before it times the compressor, so that no loading runs beside
the timing. Earlier still, importing the package starts loading the float32 kernels in a worker
of a launched job of several workers (:func:`load_on_import`), so that loading runs while the
script sets itself up (``hvd.init()``'s rendezvous, the data, the model) rather than beside its
first steps, where it competes with them for the worker's core and the interpreter's lock. The
import cannot see the optimizer's options, so a job that will send dense (``dense=True``) loads
them too and holds their memory; ``HOROVOD_SAFUSION_LOAD_ON_IMPORT=0`` (:data:`ON_IMPORT_ENV`)
leaves the loading to the construction, which loads nothing for such a job. Numba
compiles and loads under one lock, so a kernel that the training thread needs meanwhile waits for
it and is never loaded twice. Once per process and dtype: the cache of loaded kernels is the
process's.
"""
from __future__ import annotations

import os
import threading
from typing import Iterable, Mapping

import torch

from .. import launcher
from ..kernels import host
from . import segmented

_threads: dict[torch.dtype, threading.Thread] = {}

#: The environment variable that turns :func:`load_on_import` off (``0``) or on (``1``, the default).
ON_IMPORT_ENV = "HOROVOD_SAFUSION_LOAD_ON_IMPORT"


def load(dtypes: Iterable[torch.dtype]) -> None:
    """Start loading the host kernels of those of ``dtypes`` the host path takes, on a daemon
    thread, unless this process started it already."""
    todo = sorted({d for d in dtypes if d in host.DTYPES and d not in _threads}, key=str)
    if not todo:
        return
    thread = threading.Thread(target=_load, args=(todo,), name="saf-kernel-loading", daemon=True)
    for d in todo:
        _threads[d] = thread
    thread.start()


def load_on_import(environ: Mapping[str, str] = os.environ) -> None:
    """Start loading the float32 host kernels (:func:`load`) where this process is one worker of
    a launched job of several, the case where the first steps would otherwise share their core
    with the loading, unless :data:`ON_IMPORT_ENV` is ``0`` (any value but ``0`` and ``1`` is a
    ``ValueError`` naming it). float32 is what nearly every job trains in; other dtypes load at
    ``DistributedOptimizer``'s construction."""
    if on_import(environ) and launcher.workers(environ) > 1:
        load([torch.float32])


def on_import(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether :data:`ON_IMPORT_ENV` leaves the loading at import on (``1``, or unset) rather than
    off (``0``); any other value is a ``ValueError`` naming it and the accepted ones."""
    asked = environ.get(ON_IMPORT_ENV, "1")
    if asked not in ("0", "1"):
        raise ValueError(f"{ON_IMPORT_ENV} must be one of '0', '1'; got {asked!r}")
    return asked == "1"


def wait() -> None:
    """Return once every loading started in this process is done."""
    for thread in set(_threads.values()):
        thread.join()


def _load(dtypes: list[torch.dtype]) -> None:
    segmented.warm_up(dtypes)
    host.warm_up(dtypes)
