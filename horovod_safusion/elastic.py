"""Horovod elastic support: ``hvd.elastic.TorchState(model, optimizer)`` with this package's optimizer.

Horovod picks a state handler per object by type. This module puts one in front for the
optimizers :func:`horovod_safusion.DistributedOptimizer` makes:

* ``save()`` / ``restore()``: Horovod's (a deep copy of ``state_dict()`` and ``load_state_dict()``
  of it), which with this package include each worker's own residuals — a worker restores the
  residuals of its last commit, and the failed step in flight is dropped;
* ``sync()`` (on every worker after a reset, and when training starts): Horovod's
  ``broadcast_optimizer_state``, then every worker takes rank 0's fusion plan, step count and
  communicator state, and profiles the plan again if the world size changed
  (:meth:`Membership.sync`). Residuals are not broadcast: each stays with its worker, so a reset
  neither duplicates nor drops them.
"""
from __future__ import annotations

import os
from typing import Any

import horovod.torch as hvd
from horovod.torch.elastic.state import OptimizerStateHandler, get_handler_registry, set_handler_registry

from . import session
from .plan import FusionPlan


class Membership:
    """One optimizer's place in an elastic job: whether it waits for ``TorchState``'s sync (under
    Horovod elastic a worker may be built while the others are already training, so its
    collectives wait for the sync, which every worker reaches) and the world size its plan was
    made for."""

    def __init__(self, process_set: Any) -> None:
        self.awaiting_sync = os.environ.get("HOROVOD_ELASTIC") == "1"
        self.world_size = process_set.size()

    def check_synced(self) -> None:
        """Raise where a gradient arrives before the sync (the script does not use TorchState)."""
        if self.awaiting_sync:
            raise RuntimeError("horovod_safusion.DistributedOptimizer under Horovod elastic must be "
                               "synchronised by hvd.elastic.TorchState: pass it as "
                               "hvd.elastic.TorchState(model, optimizer, ...) and train inside "
                               "@hvd.elastic.run")

    def sync(self, opt: Any) -> None:
        """After a reset (and when training starts), on every worker: drop the step that failed,
        take rank 0's fusion plan, profiler state, step count, communicator state, critical
        regimes and which gradients are spread (a joining worker has none), and profile again if
        the world size changed. Residuals stay with the worker that holds them, so none is
        duplicated; those of a worker that died are lost with it, as its gradient of the failed
        step."""
        ctl, profiler, ps = opt._controller, opt._profiler, opt.process_set
        opt._reset_step()
        rank0 = hvd.broadcast_object({"plan": ctl.plan.to_json(), "profiler": profiler.state_dict(), "steps": ctl.steps,
                                      "world_size": self.world_size, "session": session.number(),
                                      "communicators": {name: c.state_dict() for name, c in ctl.communicators.items()},
                                      # critical intervals and their wire: a new worker's own would send other dtypes
                                      "regimes": ctl.regimes.state_dict() if ctl.regimes is not None else None,
                                      # which gradients are spread: a new worker's votes would make its flags longer
                                      "spread": ctl.spread.decided if ctl.spread is not None else None},
                                     root_rank=0, name="saf.elastic.sync", process_set=ps)
        session.begin(rank0["session"])  # collectives of the failed session may linger in Horovod's queue
        for name, comm in ctl.communicators.items():  # the same on every rank: setup() may run collectives
            comm.load_state_dict(rank0["communicators"][name])
            comm.setup(ctl.compressor)
        profiler.load_state_dict(rank0["profiler"])
        if ctl.regimes is not None and rank0["regimes"] is not None:
            ctl.regimes.load_state_dict(rank0["regimes"])
        if ctl.spread is not None and rank0["spread"] is not None:
            ctl.spread.load(rank0["spread"])
        ctl.steps = rank0["steps"]
        ctl.switch_plan(FusionPlan.from_json(rank0["plan"]))
        if rank0["world_size"] != ps.size():
            profiler.restart()
        self.world_size = ps.size()
        self.awaiting_sync = False


class SAFusionOptimizerStateHandler(OptimizerStateHandler):
    """Horovod's optimizer state handler, plus the plan and communicator sync after a reset."""

    def sync(self) -> None:
        super().sync()
        self.value._membership.sync(self.value)


def register(optimizers: type) -> None:
    """Put the handler first in Horovod's registry for instances of ``optimizers`` (idempotent)."""
    registry = [entry for entry in get_handler_registry() if entry[1] is not SAFusionOptimizerStateHandler]
    set_handler_registry([(optimizers, SAFusionOptimizerStateHandler)] + registry)
