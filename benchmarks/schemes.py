"""The fusion schemes compared side by side (SAFusion §5), built the same way for every benchmark.

Every sparse scheme uses the same compressor, density and error feedback; only ``fusion=`` differs,
so a comparison isolates the fusion scheme. ``horovod`` is Horovod's own dense allreduce
(``fusion="horovod"``: no compressor, one collective per tensor merged by Horovod's Tensor Fusion).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import horovod_safusion as saf  # noqa: E402

SCHEMES = ("horovod", "wfbp", "oktopk", "omgs", "cupcake", "safusion")


def make_optimizer(scheme: str, model: torch.nn.Module, lr: float, compressor: str, density: float,
                   profile_steps: int) -> torch.optim.Optimizer:
    """SGD with momentum wrapped by ``saf.DistributedOptimizer`` for ``scheme``."""
    if scheme not in saf.available_planners():
        raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(saf.available_planners())}")
    sparse = {} if scheme == "horovod" else {"compressor": compressor, "density": density}
    return saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                    named_parameters=model.named_parameters(), fusion=scheme,
                                    profile_steps=profile_steps, **sparse)


def batch(step: int, rank: int, size: int, batch_size: int, n: int) -> slice:
    """This rank's slice of the data at ``step`` (ranks read disjoint consecutive batches)."""
    i = ((step * size + rank) * batch_size) % (n - batch_size)
    return slice(i, i + batch_size)
