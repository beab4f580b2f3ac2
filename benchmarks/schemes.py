"""The fusion schemes compared side by side (SAFusion §5), built the same way for every benchmark.

Every sparse scheme uses the same compressor, density and error feedback; only ``fusion=`` differs,
so a comparison isolates the fusion scheme. ``horovod`` is Horovod's own dense allreduce
(``fusion="horovod"``: no compressor, one collective per tensor merged by Horovod's Tensor Fusion).
"""
from __future__ import annotations

import torch

SCHEMES = ("horovod", "wfbp", "oktopk", "omgs", "cupcake", "safusion")


def make_optimizer(scheme: str, model: torch.nn.Module, lr: float, compressor: str, density: float,
                   profile_steps: int) -> torch.optim.Optimizer:
    """SGD with momentum wrapped by ``saf.DistributedOptimizer`` for ``scheme``."""
    import horovod_safusion as saf  # here: the peers' jobs import this module without it

    if scheme not in saf.available_planners():
        raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(saf.available_planners())}")
    sparse = {} if scheme == "horovod" else {"compressor": compressor, "density": density}
    return saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                    named_parameters=model.named_parameters(), fusion=scheme,
                                    profile_steps=profile_steps, **sparse)


#: PowerSGD's ``matrix_approximation_rank`` in every benchmark: its documentation's example value,
#: and the rank the papers compare against.
POWERSGD_RANK = 4


def ddp_powersgd(model: torch.nn.Module, start_iter: int, one_bucket: bool = False) -> torch.nn.Module:
    """``model`` in PyTorch DDP with its PowerSGD hook, as its users set it up: DDP's default
    buckets, rank :data:`POWERSGD_RANK`, dense for the first ``start_iter`` steps
    (``start_powerSGD_iter``). DDP broadcasts rank 0's weights. ``one_bucket``: one bucket holding
    the whole model, where Gloo needs it — the hook starts its second and third allreduce from
    completion callbacks, and with several buckets Gloo ranks can start them in different orders
    (seen as an abort, "op.preamble.length <= op.nbytes", in a job that also ran Horovod)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ddp = torch.nn.parallel.DistributedDataParallel(model, **({"bucket_cap_mb": int(mb) + 1} if one_bucket else {}))
    ddp.register_comm_hook(P.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                           start_powerSGD_iter=start_iter), P.powerSGD_hook)
    return ddp


def batch(step: int, rank: int, size: int, batch_size: int, n: int) -> slice:
    """This rank's slice of the data at ``step`` (ranks read disjoint consecutive batches)."""
    i = ((step * size + rank) * batch_size) % (n - batch_size)
    return slice(i, i + batch_size)
