"""The launcher's environment (``launcher.py``): the workers on this host and in the whole job, as
``horovodrun``, Open MPI and MPICH's Hydra export them; the first name set counts, and a process
started on its own (no launcher, an empty or unreadable value) is one worker."""
import pytest

from horovod_safusion import launcher


@pytest.mark.parametrize("count, environ, workers", [
    (launcher.local_workers, {}, 1),
    (launcher.local_workers, {"HOROVOD_LOCAL_SIZE": "4"}, 4),
    (launcher.local_workers, {"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3),
    (launcher.local_workers, {"MPI_LOCALNRANKS": "8"}, 8),
    (launcher.local_workers, {"HOROVOD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "6"}, 2),
    (launcher.local_workers, {"HOROVOD_LOCAL_SIZE": "", "MPI_LOCALNRANKS": "5"}, 5),
    (launcher.local_workers, {"HOROVOD_LOCAL_SIZE": "many"}, 1),
    (launcher.local_workers, {"HOROVOD_LOCAL_SIZE": "0"}, 1),
    (launcher.workers, {}, 1),
    (launcher.workers, {"HOROVOD_SIZE": "4"}, 4),
    (launcher.workers, {"OMPI_COMM_WORLD_SIZE": "3"}, 3),
    (launcher.workers, {"PMI_SIZE": "8"}, 8),
    (launcher.workers, {"HOROVOD_SIZE": "", "PMI_SIZE": "5"}, 5),
    (launcher.workers, {"HOROVOD_SIZE": "many"}, 1),
    (launcher.workers, {"HOROVOD_LOCAL_SIZE": "4"}, 1),  # the host's count is not the job's
])
def test_the_workers_come_from_the_launchers_environment(count, environ, workers):
    assert count(environ) == workers
