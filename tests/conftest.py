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
