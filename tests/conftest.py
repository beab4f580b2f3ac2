import os
import sys

# Triton kernels run on CPU tensors through Triton's interpreter (it must be set before Triton is
# imported); nothing imports Triton unless a test asks for the Triton kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="session")
def hvd():
    """Horovod initialised in this process: a real one-worker job (size 1)."""
    import horovod.torch as hvd
    hvd.init()
    yield hvd


@pytest.fixture
def paths(monkeypatch):
    """``paths(device_path=..., kernels=...)`` sets ``HOROVOD_SAFUSION_DEVICE_PATH`` and
    ``HOROVOD_SAFUSION_KERNELS`` for one test and has the package read them again (it reads them
    once per process); after the test, they are restored and read again."""
    from horovod_safusion import kernels

    def use(device_path: bool | None = None, kernels_: str | None = None) -> None:
        if device_path is not None:
            monkeypatch.setenv("HOROVOD_SAFUSION_DEVICE_PATH", "1" if device_path else "0")
        if kernels_ is not None:
            monkeypatch.setenv("HOROVOD_SAFUSION_KERNELS", kernels_)
        kernels.reread()

    yield use
    monkeypatch.undo()
    kernels.reread()


@pytest.fixture(scope="session")
def hosts():
    """Three hosts of a cluster on one machine (``scripts/cluster.sh``), up for the session; skips
    with the reason where it cannot run (not root, no sshd)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "multiproc"))
    import launch

    why = launch.cluster_missing()
    if why:
        pytest.skip(why)
    up = launch.cluster(3)
    if up.returncode != 0:
        launch.cluster_down()
        pytest.fail(f"scripts/cluster.sh up 3 failed:\n{up.stdout}\n{up.stderr}")
    yield 3
    launch.cluster_down()
