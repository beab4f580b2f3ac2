"""Parameters that join a job after the optimizer was built.

A group added by ``add_param_group``, or a parameter frozen at construction and trainable now, has
no hook and no place in any fusion buffer. Horovod never synchronises such parameters, and its
replicas drift apart. Here they join at the step in which they first appear, on every rank at
once: a check that every rank added the same ones, a broadcast of their values, a dense reduction
of this step's gradients as Horovod's would be, and from the next step on hooks and fusion buffers
of their own.
"""
from __future__ import annotations

from typing import Any

import torch
import horovod.torch as hvd

from . import checkpoint, session
from .assembly import check_floating, check_momentum, tensor_info
from .stages.collect import assign_grad

Named = list[tuple[str, torch.Tensor]]


class Joining:
    """Watches ``opt``'s ``param_groups`` for parameters to synchronise and joins them.

    Args:
        opt: the optimizer being built (its groups as the user gave them).
    """

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self._counted = sum(len(g['params']) for g in opt.param_groups)
        self._dormant = [p for g in opt.param_groups for p in g['params'] if not p.requires_grad]

    def pending(self) -> Named:
        """The parameters of ``param_groups`` that require a gradient and are not synchronised yet,
        in group order. Named as given to ``named_parameters``, else as Horovod names unnamed
        parameters (``allreduce.noname.<group>.<index>``). Costs a count of the groups' parameters
        when nothing changed."""
        groups = self.opt.param_groups
        count = sum(len(g['params']) for g in groups)
        if count == self._counted and not any(p.requires_grad for p in self._dormant):
            return []
        synchronised = {id(p) for p in self.opt._controller.params.values()}
        joining, self._dormant = [], []
        for i, group in enumerate(groups):
            for j, p in enumerate(group['params']):
                if id(p) in synchronised:
                    continue
                if p.requires_grad:
                    joining.append((self.opt._parameter_names.get(p, f"allreduce.noname.{i}.{j}"), p))
                else:
                    self._dormant.append(p)
        self._counted = count
        return joining

    def join(self, joining: Named) -> None:
        """Synchronise the parameters that join at this step on every rank (a collective, reached
        by every rank when :meth:`pending` found some on any rank). Every rank must add the same
        parameters, names, shapes and dtypes alike, or every rank raises a ``RuntimeError`` naming
        the first rank that differs. Then their values are broadcast from the process set's first
        rank (as ``hvd.broadcast_parameters``), this step's gradients are reduced densely (as
        ``hvd.DistributedOptimizer`` does: zeros from a rank without one, ``.grad`` left as it was
        where no rank has one), and their hooks and fusion buffers take over from the next step
        on."""
        opt = self.opt
        ctl, ps = opt._controller, opt.process_set
        step = ctl.steps - 1
        mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in joining]
        every = checkpoint.gather({"params": mine, "grads": [p.grad is not None for _, p in joining]},
                                  "saf.join", ps)
        ranks = list(ps.ranks) if getattr(ps, "ranks", None) else list(range(len(every)))
        first = every[0]["params"]
        for rank, theirs in zip(ranks, every):
            if theirs["params"] != first:
                raise RuntimeError(
                    f"parameters join the job on some ranks only: at step {step} rank {rank} adds "
                    f"{_describe(theirs['params'], first)} where rank {ranks[0]} adds "
                    f"{_describe(first, theirs['params'])}. Every rank must add the same parameters "
                    "(add_param_group, or requires_grad turned on for a parameter frozen when the "
                    "optimizer was built) before the same step(), or the replicas would drift apart")
        for name, p in joining:
            check_floating(name, p)
            if name in ctl.params:
                raise ValueError(f"a parameter that joins at step {step} is named {name!r}, the name of a "
                                 "parameter already synchronised: pass named_parameters covering it")
        check_momentum(opt, opt.momentum_correction, opt._options.ef21)
        handles = [hvd.broadcast_async_(p.detach(), root_rank=ranks[0], name=session.collective(f"saf.join.{name}"),
                                        process_set=ps) for name, p in joining]
        for handle in handles:
            hvd.synchronize(handle)
        self._reduce([(name, p) for k, (name, p) in enumerate(joining) if any(e["grads"][k] for e in every)])
        named = list(reversed(joining))  # roughly back-propagation order, as at construction
        for name, p in named:
            opt._parameter_names[p] = name
        opt._register_hooks(named)
        ctl.add_params(named)
        opt._profiler.add([tensor_info(n, p) for n, p in named], {n: p.dtype for n, p in named})

    def _reduce(self, named: Named) -> None:
        """The gradients of ``named`` in the step they join, reduced densely as Horovod does (the
        job's ``compression``, ``op`` and scale factors); a rank without one sends zeros."""
        if not named:
            return
        grads = []
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        red = self.opt._controller.reduction
        reduced = hvd.grouped_allreduce(grads, name=session.collective("saf.join.grads"),
                                        compression=self.opt._compression, op=red.op, prescale_factor=red.prescale,
                                        postscale_factor=red.postscale, process_set=self.opt.process_set)
        for (_, p), r in zip(named, reduced):
            assign_grad(p, r)


def _describe(params: list[tuple], other: list[tuple]) -> str:
    """``params`` (name, shape, dtype) for an error message: how many, and the first that is not
    in ``other``."""
    if not params:
        return "no parameter"
    odd = next((p for p in params if p not in other), params[0])
    return (f"{len(params)} parameter{'s' if len(params) > 1 else ''} "
            f"({odd[0]!r} of shape {list(odd[1])} and dtype {odd[2]}{', ...' if len(params) > 1 else ''})")
