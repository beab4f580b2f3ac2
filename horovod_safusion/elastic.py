"""Horovod elastic support: ``hvd.elastic.TorchState(model, optimizer)`` with this package's optimizer.

Horovod picks a state handler per object by type. This module puts one in front for the
optimizers :func:`horovod_safusion.DistributedOptimizer` makes:

* ``save()`` / ``restore()``: Horovod's (a deep copy of ``state_dict()`` and ``load_state_dict()``
  of it), which with this package include each worker's own residuals — a worker restores the
  residuals of its last commit, and the failed step in flight is dropped;
* ``sync()`` (on every worker after a reset, and when training starts): Horovod's
  ``broadcast_optimizer_state``, then every worker takes rank 0's fusion plan, step count and
  communicator state, and profiles the plan again if the world size changed
  (:func:`horovod_safusion.optimizer._elastic_sync`). Residuals are not broadcast: each stays
  with its worker, so a reset neither duplicates nor drops them.
"""
from __future__ import annotations

from horovod.torch.elastic.state import OptimizerStateHandler, get_handler_registry, set_handler_registry

from .optimizer import SAFusionOptimizer, _elastic_sync


class SAFusionOptimizerStateHandler(OptimizerStateHandler):
    """Horovod's optimizer state handler, plus the plan and communicator sync after a reset."""

    def sync(self) -> None:
        super().sync()
        _elastic_sync(self.value)


def register() -> None:
    """Put the handler first in Horovod's registry (idempotent)."""
    registry = [entry for entry in get_handler_registry() if entry[1] is not SAFusionOptimizerStateHandler]
    set_handler_registry([(SAFusionOptimizer, SAFusionOptimizerStateHandler)] + registry)
