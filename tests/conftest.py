import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="session")
def hvd():
    """Horovod initialised in this process: a real one-worker job (size 1)."""
    import horovod.torch as hvd
    hvd.init()
    yield hvd
