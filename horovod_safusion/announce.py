"""What the plugin tells the user as it decides: one line on rank 0's standard error.

The measured choices (dense or sparse, the communicator, the density, the transport of the
point-to-point rounds) are said where they are made, once, by rank 0, so that a user sees in the
job's log what was chosen and why without asking the optimizer.
"""
from __future__ import annotations

import sys

import horovod.torch as hvd


def announce(text: str) -> None:
    """One line on rank 0's standard error, after ``horovod_safusion: ``."""
    if hvd.rank() == 0:
        print(f"horovod_safusion: {text}", file=sys.stderr, flush=True)
