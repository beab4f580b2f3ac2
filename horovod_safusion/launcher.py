"""What a launcher's environment says about the job this process is a worker of.

``horovodrun`` (Gloo), Open MPI (``mpirun``, ``horovodrun --mpi``) and MPICH's Hydra each export
the job's worker count and the count on this host, under names of their own, before the script
starts: the package reads them at import, before ``hvd.init()``, to decide what it sets up early
(Horovod's cycle time, :mod:`~horovod_safusion.cycle`; the selection kernels' loading,
:mod:`~horovod_safusion.compressors.loading`). Nothing here imports Horovod, so ``doctor`` reads
it where Horovod is broken.
"""
from __future__ import annotations

from typing import Mapping, Sequence

#: Where launchers say how many workers run on this host. The first one set counts.
LOCAL_SIZE = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
#: Where launchers say how many workers the job has. The first one set counts.
WORLD_SIZE = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def count(environ: Mapping[str, str], names: Sequence[str]) -> int:
    """The first positive integer among ``names`` in ``environ``; 1 where none is set (a process
    started on its own: a test, a tool, an interactive session)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def local_workers(environ: Mapping[str, str]) -> int:
    """The workers on this host (:data:`LOCAL_SIZE`)."""
    return count(environ, LOCAL_SIZE)


def workers(environ: Mapping[str, str]) -> int:
    """The workers of the whole job (:data:`WORLD_SIZE`)."""
    return count(environ, WORLD_SIZE)
