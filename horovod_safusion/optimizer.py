"""``DistributedOptimizer``: the drop-in replacement for ``hvd.DistributedOptimizer``.

Same arguments in the same positions with the same meanings, errors and warnings as
``horovod.torch.DistributedOptimizer`` (0.28.1); the SAFusion options are keyword-only. Like
Horovod, it returns an instance of a class made on the fly that inherits from the user's optimizer
class, so ``isinstance`` checks, ``param_groups`` and learning-rate schedulers keep working.
Gradients travel through the :class:`~horovod_safusion.controller.Controller` (SAFusion §4):
per-tensor sparsification ahead of fusion, one collective per fusion buffer.

Differences to Horovod, all deliberate:

* hooks are registered even with one worker, so a single process sparsifies exactly as each worker
  of a job does (Horovod skips its no-op allreduce there);
* ``op`` must be ``hvd.Average`` or ``hvd.Sum``: Adasum, Min, Max and Product have no meaning for
  sparse values that ranks select independently;
* ``groups`` becomes the fusion plan (one buffer per group), so it cannot be combined with ``fusion=``;
* ``zero_grad`` accepts ``set_to_none`` like torch's;
* ``state_dict()`` also carries the error-feedback residuals, the compressor's and
  communicator's state and the fusion plan, so a resumed job continues bit for bit;
  ``state_dict(all_ranks=True)`` (a collective) gathers every rank's residuals, so one file
  restores a job of any size without losing unsent gradient (see :meth:`load_state_dict`);
* ``grad_scaler=`` keeps residuals right when a ``GradScaler``'s loss scale changes;
* a step in which some rank's gradient is not finite arrives as NaN on every rank (the user's
  check or GradScaler skips it, as with Horovod), and residuals stay finite;
* a parameter that got no gradient on any rank (frozen, unused, no backward) keeps its ``.grad``
  (``None`` after ``zero_grad()``), so the wrapped optimizer does not move it, momentum included
  (Horovod gives it a zero gradient); its error-feedback residual waits (see the controller);
* parameters that join after construction (a group added by ``add_param_group``, or a parameter
  frozen at construction and trainable now) are synchronised from the step at which they join,
  after a check that every rank added the same ones (Horovod never synchronises them).
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Any

import torch
import horovod.torch as hvd
import horovod.torch.optimizer as _hvd_optimizer
from horovod.torch.mpi_ops import rocm_built

from .communicators import Communicator, make_communicators
from .compressors import Compressor, make_compressor
from . import checkpoint, session
from .controller import Controller, StepStats
from .fusion import GroupsPlanner, Planner, Profile, make_planner
from .fusion.safusion import check_dense_choice
from .momentum import (EF21_SGDM, MOMENTUM_CORRECTION, LocalClipping, MomentumCorrection, check_momentum_groups,
                       momentum_suspended, takes_over_momentum, to_gradient_scale)
from .plan import MIN_SELECTED, FusionPlan, TensorInfo, check_plan_across_ranks
from .profiling import OnlineProfiler
from .stages.collect import assign_grad
from .timeline.recorder import TimelineRecorder, make_recorder
from .density import AUTO, CANDIDATES, check_auto, is_auto
from .warmup import DensityWarmup

DEFAULT_FUSION = "safusion"
_SUPPORTED_OPS = {hvd.Average: "hvd.Average", hvd.Sum: "hvd.Sum"}
_OP_NAMES = {hvd.Adasum: "hvd.Adasum", hvd.Min: "hvd.Min", hvd.Max: "hvd.Max", hvd.Product: "hvd.Product"}
_STATE_KEY = "safusion"


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=hvd.Average,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=hvd.global_process_set, *, compressor=None, density=None,
                 communicator="auto", fusion=None, profile_steps=10, replan_every=None, timeline=None,
                 grad_scaler=None, dense=None, momentum_correction=AUTO, momentum_masking=None,
                 local_clipping=None, warmup_steps=0, warmup_schedule="exponential", min_selected=MIN_SELECTED,
                 error_feedback="classic"):
        super(self.__class__, self).__init__(params)
        self._ef21 = _check_error_feedback(error_feedback, momentum_correction)
        self._compression = compression
        named_parameters = self._named(named_parameters)
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        self._launched: dict[torch.Tensor, bool] = {}  # parameter → its gradient went to the controller
        self._hook_handles = []
        self._synchronized = False
        self._should_synchronize = True

        trainable = [p for g in self.param_groups for p in g['params'] if p.requires_grad]
        for p in trainable:
            _check_floating(self._parameter_names[p], p)
        # what _joining() watches: the parameters of param_groups, and those not trainable yet
        self._counted = sum(len(g['params']) for g in self.param_groups)
        self._dormant = [p for g in self.param_groups for p in g['params'] if not p.requires_grad]
        # Back-propagation roughly visits parameters in reverse registration order (as PyTorch
        # DDP's buckets assume); the profiled planners replace it by measured ready times.
        self._named_trainable = [(self._parameter_names[p], p) for p in reversed(trainable)]
        self._planner = GroupsPlanner(_group_names(groups, self._parameter_names)) if groups is not None \
            else make_planner(fusion if fusion is not None else DEFAULT_FUSION)
        _set_dense_choice(self._planner, dense)
        check_auto(density)
        comp = make_compressor(_compressor_for(self._planner, compressor), None if is_auto(density) else density)
        self._momentum_correction = momentum_correction is True or (
            momentum_correction == AUTO and not self._ef21 and not comp.dense and comp.density < 1.0
            and comp.auto_momentum_correction and takes_over_momentum(self))
        self._check_momentum()  # an instance of the user's optimizer class, with its groups
        if momentum_masking is None:  # DGC's masking where asked for by name; none where chosen here
            momentum_masking = momentum_correction is True
        densities = _density_candidates(self._planner, comp, density)
        comms = make_communicators(communicator, comp.dense, process_set, compression)
        self._profiler = OnlineProfiler(self._planner, [_tensor_info(n, p) for n, p in self._named_trainable],
                                        {n: p.dtype for n, p in self._named_trainable},
                                        process_set, profile_steps=profile_steps, replan_every=replan_every)
        self._controller = self._make_controller(
            comp, comms, grad_scaler, DensityWarmup(warmup_steps, warmup_schedule, 1.0 if comp.dense else comp.density),
            momentum_masking, local_clipping, min_selected, densities)
        self._start(comp, comms, make_recorder(timeline))

    def _check_momentum(self) -> None:
        """Where the plugin takes over the wrapped SGD's momentum (DGC's correction, EF21-SGDM),
        check that it can, as its groups stand now."""
        if self._momentum_correction:
            check_momentum_groups(self, MOMENTUM_CORRECTION)
        elif self._ef21:
            check_momentum_groups(self, EF21_SGDM, nesterov=False)

    def _named(self, named_parameters) -> list[tuple[str, torch.Tensor]]:
        """``named_parameters`` checked as Horovod checks them (unique names, every parameter
        named), or Horovod's names for unnamed parameters."""
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f'allreduce.noname.{i}.{j}', v)
                                for i, param_group in enumerate(self.param_groups)
                                for j, v in enumerate(param_group['params'])]
        # make sure that named_parameters are tuples
        if any([not isinstance(p, tuple) for p in named_parameters]):
            raise ValueError('named_parameters should be a sequence of '
                             'tuples (name, parameter), usually produced by '
                             'model.named_parameters().')

        dups = _hvd_optimizer._DistributedOptimizer.find_duplicates([k for k, _ in named_parameters])
        if len(dups) > 0:
            raise ValueError('Parameter names in named_parameters must be unique. '
                             'Found duplicates: %s' % ', '.join(dups))

        all_param_ids = {id(v) for param_group in self.param_groups for v in param_group['params']}
        named_param_ids = {id(v) for k, v in named_parameters}
        unnamed_param_ids = all_param_ids - named_param_ids
        if len(unnamed_param_ids):
            raise ValueError('named_parameters was specified, but one or more model '
                             'parameters were not named. Python object ids: '
                             '%s' % ', '.join(str(id) for id in unnamed_param_ids))
        return named_parameters

    def _make_controller(self, comp: Compressor, comms: dict[str, Communicator], grad_scaler: Any, warmup: DensityWarmup,
                         momentum_masking: bool, local_clipping: float | None, min_selected: Any,
                         densities: tuple[float, ...]) -> Controller:
        """The controller of the trainable parameters, on the profiler's first plan, with DGC's
        techniques where asked for."""
        prescale, postscale = ((1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor)
                               if self.op == hvd.Average else (1.0, 1.0))
        return Controller(
            self._named_trainable, self._profiler.initial_plan(), comp, comms, self.op, prescale, postscale,
            self.sparse_as_dense, loss_scale=_loss_scale(grad_scaler),
            momentum=MomentumCorrection(self.param_groups, momentum_masking, dict(self._named_trainable),
                                        increments=self._ef21)
            if self._momentum_correction or self._ef21 else None,
            clipping=None if local_clipping is None else LocalClipping(local_clipping, self.process_set.size()),
            warmup=warmup if warmup.steps else None, min_selected=_check_min_selected(min_selected),
            densities=densities)

    def _start(self, comp: Compressor, comms: dict[str, Communicator], recorder: TimelineRecorder | None) -> None:
        """Check the plan across ranks, set the communicator up, register the hooks and attach
        the timeline. Under Horovod elastic a worker may be built while the others are already
        training, so the collectives wait for hvd.elastic.TorchState's sync, which every worker
        reaches."""
        self._timeline: TimelineRecorder | None = None
        self._awaiting_sync = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._world_size = self.process_set.size()
        self._reset_delays()
        if self.process_set.included():
            if not self._awaiting_sync:
                check_plan_across_ranks(self._controller.plan, self.process_set)
                for comm in comms.values():  # may run collectives: every rank of the process set is here
                    comm.setup(comp)
            self._register_hooks()
            if recorder is not None:
                self._timeline = recorder.attach(self._controller, hvd.rank(), hvd.size())

    # ---- SAFusion's view ---------------------------------------------------------------------
    @property
    def plan(self) -> FusionPlan:
        """The fusion plan in use (buffers of parameter names in back-propagation order)."""
        return self._controller.plan

    def set_plan(self, plan: FusionPlan) -> None:
        """Switch every rank to ``plan`` (a collective: call it on all ranks between steps). A
        trial under way (dense against sparse, or one communicator against another) stops, so
        that it does not switch away from the plan given."""
        if self._launched:
            raise RuntimeError("set_plan() was called after loss.backward() but before step() or "
                               "synchronize(); change the plan between steps")
        self._profiler.stop_trial()
        if self.process_set.included():
            self._controller.switch_plan(plan)
        else:
            self._controller.set_plan(plan)

    @property
    def profile(self) -> Profile | None:
        """The profile the current plan was made from (``None`` until profiling is done, and for
        planners that need none)."""
        return self._profiler.profile

    @property
    def compressor(self) -> Compressor:
        return self._controller.compressor

    @property
    def communicator(self) -> Communicator:
        return self._controller.communicator

    @property
    def planner(self) -> Planner:
        return self._planner

    @property
    def timeline(self) -> TimelineRecorder | None:
        """This rank's timeline recorder (``None`` when off); ``timeline.close()`` finishes the file."""
        return self._timeline

    @property
    def settled(self) -> bool:
        """Whether the plan is final for now: the profile is taken and no sparse-against-dense
        trial is under way (the same on every rank). Benchmarks time steps after this."""
        profiler = self._profiler
        return not profiler.planner.needs_profile or (profiler.profile is not None
                                                      and (profiler.trial is None or profiler.trial.done))

    @property
    def last_stats(self) -> StepStats:
        """What the last synchronisation sent: density, missing tensors, bytes (this rank)."""
        return self._controller.last_stats

    @property
    def residuals(self):
        """The per-parameter error-feedback store."""
        return self._controller.residuals

    @property
    def target_density(self) -> float:
        """The density selected at once any warm-up is over: ``density=`` as given, the one the
        plan chose under ``density="auto"``, or 1 for a dense compressor."""
        return self._controller.target_density

    @property
    def local_momentum(self) -> MomentumCorrection | None:
        """The local momentum ``u`` per parameter (``momentum(name)``), where the optimizer keeps
        it in place of the wrapped SGD's buffer (DGC's momentum correction, EF21-SGDM); ``None``
        where the wrapped optimizer keeps its own."""
        return self._controller.momentum

    # ---- Horovod's contract -------------------------------------------------------------------
    def load_state_dict(self, *args, **kwargs):
        """Torch's ``load_state_dict`` plus horovod-safusion's state (see :meth:`state_dict`).

        Residuals: with the world size of the checkpoint, each rank takes its own. With another
        world size, a checkpoint saved with ``state_dict(all_ranks=True)`` moves old rank j's
        residuals to rank ``j mod size`` (the job's total unsent gradient is kept); the fusion plan
        is then profiled anew. A checkpoint without this rank's residuals (``state_dict()`` called
        on rank 0 only), one from ``hvd.DistributedOptimizer``, or one saved with another
        compressor or density loads with a warning and leaves the residuals as they are (empty in
        a fresh process). A residual whose size does not fit its parameter is an error.
        Not a collective: it may run on any subset of ranks (e.g. Horovod elastic's restore)."""
        self._synchronized = False
        self._should_synchronize = True
        state_dict = dict(args[0] if args else kwargs.pop('state_dict'))
        saved = state_dict.pop(_STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict, *args[1:], **kwargs)
        self._reset_step()
        if saved is None:
            warnings.warn("the optimizer state holds no horovod_safusion state (saved by "
                          "hvd.DistributedOptimizer?): error-feedback residuals start empty")
            return
        _load_safusion_state(self, saved)

    def state_dict(self, *args, all_ranks: bool = False, **kwargs):
        """Torch's ``state_dict`` plus, under ``"safusion"``: this rank's error-feedback residuals,
        the compressor's and communicator's state, the fusion plan and profile, and the step count,
        as tensors and plain data (``torch.load`` with ``weights_only=True`` reads it).

        ``all_ranks=True`` gathers the residuals of every rank into the state of every rank. It is
        a collective, like ``hvd.broadcast_optimizer_state``: call it on every rank (then save on
        rank 0 alone if you like). Plain ``state_dict()`` is no collective, so the common
        ``if hvd.rank() == 0: torch.save(optimizer.state_dict(), ...)`` keeps working; it saves
        rank 0's residuals only, and the other ranks warn when such a checkpoint is loaded."""
        state = super(self.__class__, self).state_dict(*args, **kwargs)
        state[_STATE_KEY] = _safusion_state(self, all_ranks)
        return state

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        self._reset_delays()

    def _reset_delays(self) -> None:
        """Every synchronised parameter waits for ``backward_passes_per_step`` more passes."""
        self._allreduce_delay = {p: self.backward_passes_per_step for p in self._controller.params.values()}

    def _reset_step(self) -> None:
        """Forget the step in flight (a state loaded, an elastic reset): the hooks' counts, the
        controller's buffers, the step the profiler watches."""
        self._launched = {}
        self._reset_delays()
        self._controller.reset_step()
        self._profiler.reset_step(self._controller)

    def _register_hooks(self, named=None):
        for _, p in self._named_trainable if named is None else named:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(*ignore):
            if self._awaiting_sync:
                raise RuntimeError("horovod_safusion.DistributedOptimizer under Horovod elastic must be "
                                   "synchronised by hvd.elastic.TorchState: pass it as "
                                   "hvd.elastic.TorchState(model, optimizer, ...) and train inside "
                                   "@hvd.elastic.run")
            if self._launched.get(p):
                if self._allreduce_delay[p] <= 0:
                    raise AssertionError(
                        "Gradients were computed more than "
                        "backward_passes_per_step times before call "
                        "to step(). Increase backward_passes_per_step to "
                        "accumulate gradients locally.")
            assert not p.grad.requires_grad
            assert self._allreduce_delay[p] > 0
            self._allreduce_delay[p] -= 1
            launched = self._allreduce_delay[p] == 0
            if launched:
                self._controller.grad_ready(p)
            self._launched[p] = launched
        return hook

    def synchronize(self):
        if not self.process_set.included():
            self._synchronized = True
            return
        joining = self._joining()
        self._controller.synchronize(self._launched, len(joining))
        if self._controller.joining[1]:  # some rank adds parameters: every rank checks, then all add
            self._join(joining)
        if self._momentum_correction:
            to_gradient_scale(self.param_groups)
        self._reset_delays()
        self._launched.clear()
        self._synchronized = True

    def _joining(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters of ``param_groups`` that require a gradient and are not synchronised yet:
        those of a group added by ``add_param_group``, and those frozen at construction that are
        trainable now; in group order. Named as given to ``named_parameters``, else as Horovod
        names unnamed parameters (``allreduce.noname.<group>.<index>``). Costs a count of the
        groups' parameters when nothing changed."""
        count = sum(len(g['params']) for g in self.param_groups)
        if count == self._counted and not any(p.requires_grad for p in self._dormant):
            return []
        synchronised = {id(p) for p in self._controller.params.values()}
        joining, self._dormant = [], []
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group['params']):
                if id(p) in synchronised:
                    continue
                if p.requires_grad:
                    joining.append((self._parameter_names.get(p, f"allreduce.noname.{i}.{j}"), p))
                else:
                    self._dormant.append(p)
        self._counted = count
        return joining

    def _join(self, joining: list[tuple[str, torch.Tensor]]) -> None:
        """Synchronise the parameters that join at this step on every rank (a collective, reached
        by every rank when :meth:`_joining` found some on any rank). Every rank must add the
        same parameters, names, shapes and dtypes alike, or every rank raises a ``RuntimeError``
        naming the first rank that differs. Then their values are broadcast from the process
        set's first rank (as ``hvd.broadcast_parameters``), this step's gradients are reduced
        densely (as ``hvd.DistributedOptimizer`` does: zeros from a rank without one, ``.grad``
        left as it was where no rank has one), and their hooks and fusion buffers take over from
        the next step on."""
        ctl, ps = self._controller, self.process_set
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
            _check_floating(name, p)
            if name in ctl.params:
                raise ValueError(f"a parameter that joins at step {step} is named {name!r}, the name of a "
                                 "parameter already synchronised: pass named_parameters covering it")
        self._check_momentum()
        handles = [hvd.broadcast_async_(p.detach(), root_rank=ranks[0], name=session.collective(f"saf.join.{name}"),
                                        process_set=ps) for name, p in joining]
        for handle in handles:
            hvd.synchronize(handle)
        self._reduce_joining([(name, p) for k, (name, p) in enumerate(joining) if any(e["grads"][k] for e in every)])
        named = list(reversed(joining))  # roughly back-propagation order, as at construction
        for name, p in named:
            self._parameter_names[p] = name
        self._register_hooks(named)
        ctl.add_params(named)
        self._profiler.add([_tensor_info(n, p) for n, p in named], {n: p.dtype for n, p in named})

    def _reduce_joining(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The gradients of ``named`` in the step they join, reduced densely as Horovod does
        (``compression``, ``op`` and the scale factors of the job); a rank without one sends zeros."""
        if not named:
            return
        grads = []
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        red = self._controller.reduction
        reduced = hvd.grouped_allreduce(grads, name=session.collective("saf.join.grads"), compression=self._compression,
                                        op=red.op, prescale_factor=red.prescale, postscale_factor=red.postscale,
                                        process_set=self.process_set)
        for (_, p), r in zip(named, reduced):
            assign_grad(p, r)

    @contextmanager
    def skip_synchronize(self):
        """
        A context manager used to specify that optimizer.step() should
        not perform synchronization.

        It's typically used in a following pattern:

        .. code-block:: python

            optimizer.synchronize()
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without "
                              "optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        if self._momentum_correction or self._ef21:  # the plugin applied momentum and weight decay
            # before sparsifying; EF21-SGDM's SGD buffer sums the aggregate increments (momentum 1)
            with momentum_suspended(self.param_groups, momentum=1 if self._ef21 else 0,
                                    rescaled=self._momentum_correction):
                loss = super(self.__class__, self).step(closure)
        else:
            loss = super(self.__class__, self).step(closure)
        if self._profiler.active and self.process_set.included():
            self._profiler.step_ends(self._controller)
        if self._timeline is not None:
            self._timeline.step_ends()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._launched:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)


def _check_min_selected(min_selected: Any) -> int:
    """``min_selected`` as an int, or a ``ValueError`` naming the value and what is accepted."""
    if isinstance(min_selected, bool) or not isinstance(min_selected, int) or min_selected < 0:
        raise ValueError(f"min_selected must be an integer >= 0 (0 sparsifies every tensor), got {min_selected!r}")
    return min_selected


def _check_floating(name: str, p: torch.Tensor) -> None:
    if not p.is_floating_point():
        raise ValueError(f"parameter {name!r} has dtype {p.dtype}; horovod_safusion fuses floating-point "
                         "gradients only (float16, bfloat16, float32, float64)")


def _tensor_info(name: str, p: torch.Tensor) -> TensorInfo:
    """What the planners know of parameter ``p``'s gradient."""
    return TensorInfo(name, p.numel(), p.element_size(), f"{p.dtype}@{p.device}")


def _describe(params: list[tuple], other: list[tuple]) -> str:
    """``params`` (name, shape, dtype) for an error message: how many, and the first that is not
    in ``other``."""
    if not params:
        return "no parameter"
    odd = next((p for p in params if p not in other), params[0])
    return (f"{len(params)} parameter{'s' if len(params) > 1 else ''} "
            f"({odd[0]!r} of shape {list(odd[1])} and dtype {odd[2]}{', ...' if len(params) > 1 else ''})")


def _set_dense_choice(planner: Planner, dense: "bool | str | None") -> None:
    """Pass ``dense=`` to a planner that can choose (``fusion="safusion"``); other planners never
    send dense, so ``False`` and ``"auto"`` leave them as they are, and ``True`` is an error."""
    if dense is None:
        return
    check_dense_choice(dense)
    if planner.chooses_dense:
        planner.dense_choice = dense
    elif dense is True:
        raise ValueError(f"dense=True sends a sparse compressor's job dense, which fusion='safusion' can do; "
                         f"fusion={planner.name!r} cannot (use fusion='horovod' for a dense scheme)")


def _density_candidates(planner: Planner, compressor: Compressor, density: Any) -> tuple[float, ...]:
    """The densities ``density="auto"`` chooses among (none for a given density): a sparse
    compressor's, chosen by a planner that can (``fusion="safusion"``)."""
    if not is_auto(density):
        return ()
    if compressor.dense:
        raise ValueError(f"density='auto' chooses a sparse compressor's density; compressor {compressor!r} "
                         "sends every element")
    if not planner.chooses_density:
        raise ValueError(f"density='auto' is chosen from the online profile by fusion='safusion'; "
                         f"fusion={planner.name!r} cannot choose it (pass a density, 0 < density <= 1)")
    return CANDIDATES


def _compressor_for(planner: Planner, compressor: "str | Compressor | None") -> "str | Compressor":
    """The compressor to use: the default for the planner, or the user's if it fits the planner."""
    if compressor is None:
        return "none" if planner.dense else "dgc"
    if planner.dense and not (compressor == "none" or getattr(compressor, "dense", False)):
        raise ValueError(f"fusion={planner.name!r} is a dense scheme and sends every element; it cannot use "
                         f"compressor={compressor!r}: leave compressor unset or pass compressor='none'")
    return compressor


def _group_names(groups, names: dict) -> "int | list[list[str]]":
    """Horovod's ``groups`` validated as Horovod does, as parameter names."""
    if not (isinstance(groups, list) or groups > 0):
        raise ValueError('groups should be a non-negative integer or '
                         'a list of list of torch.Tensor.')
    if not isinstance(groups, list):
        return int(groups)
    seen, out = set(), []
    for group in groups:
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError('groups must consist of torch.Tensor.')
            if id(p) in seen:
                raise ValueError('A parameter can only appear once in groups.')
            seen.add(id(p))
        out.append([names[p] for p in group if p in names and p.requires_grad])
    return out


def DistributedOptimizer(optimizer, named_parameters=None,
                         compression=hvd.Compression.none,
                         backward_passes_per_step=1,
                         op=hvd.Average,
                         gradient_predivide_factor=1.0,
                         num_groups=0, groups=None,
                         sparse_as_dense=False,
                         process_set=hvd.global_process_set,
                         *,
                         compressor: "str | Compressor | None" = None,
                         density: "float | str | None" = None,
                         fusion: "str | Planner | None" = None,
                         communicator: "str | Communicator" = "auto",
                         profile_steps: int = 10,
                         replan_every: int | None = None,
                         timeline: "str | TimelineRecorder | None" = None,
                         grad_scaler: Any = None,
                         dense: "bool | str | None" = None,
                         momentum_correction: "bool | str" = "auto",
                         momentum_masking: bool | None = None,
                         local_clipping: float | None = None,
                         warmup_steps: int = 0,
                         warmup_schedule: str = "exponential",
                         min_selected: int = MIN_SELECTED,
                         error_feedback: str = "classic"):
    """
    An optimizer that wraps another ``torch.optim.Optimizer`` and synchronises sparsified
    gradients with sparsification-ahead tensor fusion (SAFusion, HPDC'25).

    Every gradient tensor is sparsified on its own as soon as back-propagation produces it, the
    selected elements are merged into a fusion buffer, and one collective per buffer starts as soon
    as the buffer's last tensor is in, overlapping the rest of back-propagation. ``step()`` waits
    for all buffers, adds up the values of all ranks (``index_add_``), averages and applies the
    update. Unsent elements are kept as per-parameter error-feedback residuals.

    Horovod's arguments (``optimizer`` … ``process_set``) keep their positions and meanings; see
    ``horovod.torch.DistributedOptimizer``. The SAFusion options are keyword-only:

    Arguments:
        compressor: name of a registered compressor (``"dgc"``, ``"topk"``, ``"none"``, ...;
                    see ``horovod_safusion.available_compressors()``) or a ``Compressor`` instance;
                    default ``"dgc"``, or ``"none"`` for the dense scheme ``fusion="horovod"``.
        density: fraction of each tensor's elements sent per step, ``0 < density <= 1``
                 (default 0.01). Lower saves traffic; too low slows convergence. ``"auto"`` (with
                 ``fusion="safusion"``): the densest of 0.03, 0.1 and dense whose iteration
                 time, predicted from the profile and confirmed by a measured trial, is within
                 20 % of the fastest — the most the link hides behind back-propagation; lower
                 densities learn too slowly per step to pay (0.03 until the first plan; rank 0
                 says what it chose; a warm-up ends at the chosen density).
        fusion: name of a fusion planner (default ``"safusion"``: aligned, adaptively sized
                buffers planned from an online profile; see ``horovod_safusion.available_planners()``)
                or a ``Planner`` instance. Cannot be combined with Horovod's ``groups``.
        communicator: ``"auto"`` (the default: dense allreduce for ``compressor="none"``;
                      otherwise sparse allgather at first, and with ``fusion="safusion"`` the
                      fastest of allgather, SparDL and ZEN at this job's worker count (the
                      allgather alone with two workers), priced from the profile's sweeps and
                      tried for a few steps when close; rank 0 says on standard error what it
                      chose), a registered name, or a ``Communicator`` instance.
        profile_steps: iterations measured before planning (after one warm-up iteration), for
                       planners that need a profile. They train as usual, communication
                       overlapped; after the last one, short sweeps time the compressor and
                       one collective per message size on every rank.
        replan_every: re-profile and re-plan every this many iterations (default: plan once).
        timeline: record the plugin's phases as Chrome-trace events to this file (one per rank:
                  ``saf.json`` → ``saf.rank0.json``; ``{rank}`` in the path is replaced instead),
                  or a ``horovod_safusion.timeline.TimelineRecorder`` (e.g. given the model, for
                  exact forward times). Default: ``$HOROVOD_SAFUSION_TIMELINE``, else off. Merge with
                  Horovod's Timeline by ``python -m horovod_safusion timeline merge``.
        grad_scaler: the ``torch.amp.GradScaler`` that scales this optimizer's loss, if any.
                     Residuals hold scaled gradient; told the scaler, the optimizer rescales them
                     when the scale changes, so training matches an unscaled run (bit for bit
                     while scales are powers of two, GradScaler's default). Without it a changing
                     scale distorts the residuals.
        dense: with ``fusion="safusion"``, whether to send dense with Horovod's allreduce instead
               of sparsifying: ``"auto"`` (the default) prices both from the profile, tries both
               for a few steps when the predictions are close, and keeps the faster (on a fast
               link, or for a small model, a dense allreduce can win); ``True`` always sends
               dense, ``False`` never. Rank 0 says on standard error when it sends dense.
        momentum_correction: DGC's momentum correction (Lin et al., ICLR'18, §3.2): the wrapped
               ``torch.optim.SGD``'s momentum (and weight decay, and Nesterov) is accumulated per
               worker *before* sparsification, and the SGD then steps without them (its
               ``param_groups`` keep the values you set, read every step); ``synchronize()``
               leaves ``(1 − m)`` times the aggregate in ``.grad``, the gradient's scale, and the
               step runs at ``lr/(1 − m)``, so a clip after ``synchronize()`` bounds what it
               bounds without the plugin. ``"auto"`` (the default): on for an SGD with momentum
               (no ``dampening``, no ``maximize``) whose gradients are sparsified, off otherwise
               (other optimizers, ``compressor="none"`` or ``"exdyna"``, ``error_feedback="ef21-sgdm"``).
               ``True`` needs an SGD with ``momentum > 0``; anything else is then an error, so
               momentum is never applied twice. ``False``: classic error feedback under the
               SGD's own momentum.
        momentum_masking: with momentum correction, clear the momentum of the elements a sparse
               step sent (DGC's momentum factor masking, §3.3). Default: on with
               ``momentum_correction=True`` (as in DGC), off where ``"auto"`` turned the
               correction on. An element sent at every step then moves without momentum, which
               can cost more accuracy than masking saves (docs/benchmarks.md, "The early lag",
               has the runs).
        local_clipping: DGC's local gradient clipping: the global ``max_norm`` you would clip to;
               each worker clips each tensor's gradient to ``max_norm / sqrt(workers)`` before
               error feedback. Default ``None`` (off).
        warmup_steps: send at a higher density for the first this many steps (DGC's warm-up);
               every rank switches at the same step and residuals carry over. Default 0 (off).
        warmup_schedule: ``"exponential"`` (four stages at ``density^(1/5)``, ``^(2/5)``, ``^(3/5)``,
               ``^(4/5)``: DGC's 25 %, 6.25 %, 1.6 %, 0.4 % for 0.001) or ``"dense"`` (every element,
               like PowerSGD's ``start_powerSGD_iter``).
        min_selected: a tensor that would send fewer than this many elements per step
               (``ceil(density · numel)``: biases, norms, small heads) is sent whole, in one
               dense buffer shared by all such tensors, with Horovod's allreduce (default 64;
               ``0`` sparsifies every tensor, as the papers do). Error feedback on a tensor that
               sends one or a few elements per step holds its gradient back for many steps and
               releases it in bursts that momentum amplifies; see the user guide.
        error_feedback: what waits for a later step when a step sends only a selection.
               ``"classic"`` (the default; Seide et al.'s error feedback): the unsent gradient, in a
               residual added to the next step's gradient; the wrapped optimizer applies the
               aggregate of what was sent. ``"ef21-sgdm"`` (Fatkhullin, Tyurin and Richtárik,
               NeurIPS'23, Algorithm 1): each worker keeps the wrapped SGD's momentum itself and
               sends a selection of how far it moved from what was sent before; every rank then
               moves every element by the aggregate estimate, at every step. Needs
               ``torch.optim.SGD`` with ``momentum > 0`` (not Nesterov), whose momentum buffer
               holds the estimate; not with ``momentum_correction``.

    The returned optimizer has ``plan``, ``profile``, ``set_plan()``, ``last_stats``, ``residuals`` and
    ``timeline`` besides Horovod's ``synchronize()``, ``skip_synchronize()`` and ``set_backward_passes_per_step()``.
    """
    if gradient_predivide_factor != 1.0:
        if rocm_built():
            raise ValueError('gradient_predivide_factor not supported yet with ROCm')
        if op != hvd.Average:
            raise ValueError('gradient_predivide_factor not supported with op != Average')

    if num_groups != 0:
        warnings.warn('Parameter `num_groups` has been replaced by `groups` '
                      'and will be removed in v0.23.0.', DeprecationWarning)
        if groups is None:
            groups = num_groups

    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")

    if op not in _SUPPORTED_OPS:
        raise ValueError(f"op={_OP_NAMES.get(op, repr(op))} cannot be used with sparse aggregation: "
                         "values that ranks select independently can only be summed or averaged; "
                         "horovod_safusion accepts op=hvd.Average or op=hvd.Sum")
    if groups is not None and fusion is not None:
        raise ValueError(f"groups={groups!r} and fusion={fusion!r} both define the fusion buffers; "
                         "pass one of them")

    cls = type(optimizer.__class__.__name__, (optimizer.__class__, SAFusionOptimizer),
               dict(_DistributedOptimizer.__dict__,
                    # hvd.broadcast_optimizer_state() initialises the state of a fresh optimizer with
                    # the *base* class's step() only when the optimizer's module is Horovod's; any
                    # other module makes it call our step(), which would synchronise gradients.
                    __module__=_hvd_optimizer.__name__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set,
               compressor=compressor, density=density, communicator=communicator, fusion=fusion,
               profile_steps=profile_steps, replan_every=replan_every, timeline=timeline,
               grad_scaler=grad_scaler, dense=dense, momentum_correction=momentum_correction,
               momentum_masking=momentum_masking,
               local_clipping=local_clipping, warmup_steps=warmup_steps, warmup_schedule=warmup_schedule,
               min_selected=min_selected, error_feedback=error_feedback)


ERROR_FEEDBACK = ("classic", "ef21-sgdm")


def _check_error_feedback(error_feedback: Any, momentum_correction: Any) -> bool:
    """Whether ``error_feedback`` asks for EF21-SGDM; a clear ``ValueError`` for anything not in
    :data:`ERROR_FEEDBACK`, for a ``momentum_correction`` other than True, False and ``"auto"``, or
    for EF21-SGDM with DGC's momentum correction (both would take over the same momentum)."""
    if error_feedback not in ERROR_FEEDBACK:
        raise ValueError(f"error_feedback must be one of {', '.join(map(repr, ERROR_FEEDBACK))}, "
                         f"got {error_feedback!r}")
    if not (momentum_correction is True or momentum_correction is False or momentum_correction == AUTO):
        raise ValueError(f"momentum_correction must be True, False or {AUTO!r}, got {momentum_correction!r}")
    if error_feedback == "ef21-sgdm" and momentum_correction is True:
        raise ValueError('error_feedback="ef21-sgdm" keeps the momentum itself; it cannot be combined '
                         "with momentum_correction=True: pass one of them")
    return error_feedback == "ef21-sgdm"


class SAFusionOptimizer:
    """Marks the optimizers ``DistributedOptimizer`` makes (for ``isinstance`` checks and for
    Horovod elastic's state handlers)."""


def _elastic_sync(opt) -> None:
    """After a Horovod elastic reset (and when training starts), on every worker: drop the step
    that failed, take rank 0's fusion plan, profiler state, step count and communicator state
    (a joining worker has none), and profile again if the world size changed. Residuals stay
    with the worker that holds them, so none is duplicated; those of a worker that died are lost
    with it, as its gradient of the failed step."""
    ctl, profiler, ps = opt._controller, opt._profiler, opt.process_set
    opt._reset_step()
    rank0 = hvd.broadcast_object({"plan": ctl.plan.to_json(), "profiler": profiler.state_dict(), "steps": ctl.steps,
                                  "world_size": opt._world_size, "session": session.number(),
                                  "communicators": {name: c.state_dict() for name, c in ctl.communicators.items()}},
                                 root_rank=0, name="saf.elastic.sync", process_set=ps)
    session.begin(rank0["session"])  # collectives of the failed session may linger in Horovod's queue
    for name, comm in ctl.communicators.items():  # the same on every rank: setup() may run collectives
        comm.load_state_dict(rank0["communicators"][name])
        comm.setup(ctl.compressor)
    profiler.load_state_dict(rank0["profiler"])
    ctl.steps = rank0["steps"]
    ctl.switch_plan(FusionPlan.from_json(rank0["plan"]))
    if rank0["world_size"] != ps.size():
        profiler.restart()
    opt._world_size = ps.size()
    opt._awaiting_sync = False


def _loss_scale(scaler: Any):
    """A function returning the scale ``scaler`` multiplies the loss by now, or ``None``.

    GradScaler keeps it in the 1-element tensor ``_scale`` (made by its first ``scale()``, updated
    in place by ``update()``); reading the tensor, not ``get_scale()``, avoids a host
    synchronisation on GPUs."""
    if scaler is None:
        return None
    if not hasattr(scaler, "is_enabled") or not hasattr(scaler, "get_scale"):
        raise ValueError(f"grad_scaler must be a torch.amp.GradScaler (or None), got {scaler!r}")

    def scale():
        if not scaler.is_enabled():
            return None
        current = getattr(scaler, "_scale", None)
        if isinstance(current, torch.Tensor):
            return current.detach().reshape(()).to(torch.float32).clone()
        return torch.tensor(float(scaler.get_scale()), dtype=torch.float32)
    return scale


def _safusion_state(opt, all_ranks: bool) -> dict:
    """What ``state_dict()`` adds: per rank (this one, or all with ``all_ranks``) the controller's
    rank state (residuals, momenta, compressor and communicator state); for the job, the
    controller's state (step, loss scale, plan) and the profiler's."""
    ps = opt.process_set
    size, rank = ps.size(), ps.rank()
    local = opt._controller.rank_state()
    if all_ranks and size > 1:
        per_rank = dict(enumerate(checkpoint.gather(local, "saf.state_dict", ps)))
    else:
        per_rank = {rank: local}
    return {"format": 1, "world_size": size, "rank": rank, "all_ranks": bool(all_ranks or size == 1),
            "ranks": per_rank, **opt._controller.state_dict(), "profiler": opt._profiler.state_dict()}


def _load_safusion_state(opt, saved: dict) -> None:
    """Load what :func:`_safusion_state` saved (the profiler's state is ``"generator"`` in
    checkpoints of version 0.1.0)."""
    plan_taken = opt._controller.load_state_dict(saved, saved["ranks"], int(saved["world_size"]),
                                                 bool(saved["all_ranks"]))
    opt._profiler.load_state_dict(saved["profiler"] if "profiler" in saved else saved["generator"])
    if not plan_taken:  # other costs (world size) or other parameters: profile again, from the plan in use
        opt._profiler.restart()
