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

import warnings
from contextlib import contextmanager

import torch
import horovod.torch as hvd
import horovod.torch.optimizer as _hvd_optimizer

from . import checkpoint, options as _options
from .assembly import assemble, check_floating, check_horovod_arguments, checked_names
from .communicators import Communicator
from .compressors import Compressor
from .controller import Controller, StepStats
from .elastic import Membership
from .fusion import Planner, Profile
from .joining import Joining
from .compressors import loading
from .announce import announce
from .density import AUTO
from .momentum import (GradientWatch, MomentumCorrection, first_gradient_scale, momentum_suspended,
                       to_gradient_scale)
from .options import Options
from .plan import FusionPlan, check_plan_across_ranks
from .profiling import OnlineProfiler
from .timeline.recorder import TimelineRecorder, make_recorder

#: Where ``state_dict()`` keeps horovod-safusion's state.
STATE_KEY = "safusion"


class SAFusionOptimizer:
    """Marks the optimizers ``DistributedOptimizer`` makes (for ``isinstance`` checks and for
    Horovod elastic's state handlers)."""


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=hvd.Average,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=hvd.global_process_set, options: Options = Options()):
        super(self.__class__, self).__init__(params)
        self._options = options
        self._compression = compression
        named_parameters = checked_names(self, named_parameters)
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
            check_floating(self._parameter_names[p], p)
        self._joining = Joining(self)
        # Back-propagation roughly visits parameters in reverse registration order (as PyTorch
        # DDP's buckets assume); the profiled planners replace it by measured ready times.
        self._named_trainable = [(self._parameter_names[p], p) for p in reversed(trainable)]
        parts = assemble(self, options, groups, self._named_trainable, self._parameter_names)
        self._planner, self._profiler, self._controller = parts.planner, parts.profiler, parts.controller
        # momentum_correction="auto" decides at the first step whether the script changes the
        # gradients between synchronize() and step() (see _first_corrected_step)
        if parts.momentum_correction and options.momentum_correction == AUTO:
            self._controller.momentum.decay = False
        self._watch = GradientWatch()
        if not parts.compressor.dense and options.dense is not True:  # loaded while the first steps wait
            loading.load(p.dtype for _, p in self._named_trainable if p.device.type == "cpu")
        self._start(parts.compressor, parts.communicators, make_recorder(options.timeline))

    def _start(self, comp: Compressor, comms: dict[str, Communicator], recorder: TimelineRecorder | None) -> None:
        """Check the plan across ranks, set the communicator up, register the hooks and attach
        the timeline; under Horovod elastic, the collectives wait for ``TorchState``'s sync."""
        self._timeline: TimelineRecorder | None = None
        self._membership = Membership(self.process_set)
        self._reset_delays()
        if self.process_set.included():
            if not self._membership.awaiting_sync:
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
    def momentum_correction(self) -> bool:
        """Whether the plugin applies the wrapped SGD's momentum (DGC's momentum correction), as
        ``momentum_correction=`` asked or ``"auto"`` decided (``"auto"`` turns it off at the first
        step where the script changes the gradients between ``synchronize()`` and ``step()``)."""
        return self._controller.momentum is not None and not self._options.ef21

    @property
    def _correction_pending(self) -> bool:
        """Whether ``"auto"``'s first step is still to decide: until then its ``u`` takes no weight
        decay (:attr:`~horovod_safusion.momentum.MomentumCorrection.decay`)."""
        momentum = self._controller.momentum
        return momentum is not None and not momentum.decay

    @property
    def controller(self) -> Controller:
        """The runtime behind the hooks (SAFusion §4): fusion buffers, mode, step count, observer
        (read it; change the plan through :meth:`set_plan`)."""
        return self._controller

    @property
    def profiler(self) -> OnlineProfiler:
        """The online profiler: what this rank measured, the trial under way."""
        return self._profiler

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
        saved = state_dict.pop(STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict, *args[1:], **kwargs)
        self._reset_step()
        if saved is None:
            warnings.warn("the optimizer state holds no horovod_safusion state (saved by "
                          "hvd.DistributedOptimizer?): error-feedback residuals start empty")
            return
        checkpoint.unpack(self._controller, self._profiler, saved)
        if self._correction_pending and int(saved.get("steps", 0)) > 0:  # decided by the run saved
            self._controller.momentum.decay = True
            if saved.get("local_momentum") is False:
                self._controller.drop_momentum()

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
        state[STATE_KEY] = checkpoint.pack(self._controller, self._profiler, self.process_set, all_ranks)
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
            self._membership.check_synced()
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
        joining = self._joining.pending()
        self._controller.synchronize(self._launched, len(joining))
        if self._controller.joining[1]:  # some rank adds parameters: every rank checks, then all add
            self._joining.join(joining)
        if self.momentum_correction:
            if self._correction_pending:  # the first u is the gradient: .grad in its units
                first_gradient_scale(self.param_groups)
                self._watch.record(self._controller.params.values())
            else:
                to_gradient_scale(self.param_groups)
        self._reset_delays()
        self._launched.clear()
        self._synchronized = True

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
        if self._correction_pending:
            loss = self._first_corrected_step(closure)
        elif self.momentum_correction or self._options.ef21:  # the plugin applied momentum and weight decay
            # before sparsifying; EF21-SGDM's SGD buffer sums the aggregate increments (momentum 1)
            with momentum_suspended(self.param_groups, momentum=1 if self._options.ef21 else 0,
                                    rescaled=self.momentum_correction):
                loss = super(self.__class__, self).step(closure)
        else:
            loss = super(self.__class__, self).step(closure)
        if self._profiler.active and self.process_set.included():
            self._profiler.step_ends(self._controller)
        if self._timeline is not None:
            self._timeline.step_ends()
        return loss

    def _first_corrected_step(self, closure):
        """The first step where ``momentum_correction="auto"`` turned DGC's correction on.

        Under the correction, a clip between ``synchronize()`` and ``step()`` bounds the aggregate
        of accumulated momenta, not each step's gradient as it does under Horovod, and a script
        tuned for Horovod then takes steps several times longer. So the first step decides. Its
        ``u`` is the gradient (the weight decay left to the SGD), and ``.grad`` holds its
        aggregate unscaled, the gradient's units. Where the script changed the gradients
        (:class:`~horovod_safusion.momentum.GradientWatch`), the correction is off for the rest of
        training (classic error feedback under the SGD's own momentum), and this step is the SGD's
        own first step: on a dense step, Horovod's. Elsewhere ``u`` takes the weight decay and the
        step is DGC's first (with Nesterov, its weight decay is not multiplied by ``1 + m``). On a
        sparse first step, the SGD applies the weight decay to every element at once. The
        residuals keep what they hold."""
        if self._watch.changed():
            self._controller.drop_momentum()
            announce("the script changes the gradients between synchronize() and step() (a clip, an "
                     "unscale_): momentum correction off, so that the SGD's momentum takes them as with "
                     "Horovod (momentum_correction=True keeps it)")
            return super(self.__class__, self).step(closure)
        first_gradient_scale(self.param_groups, back=True)
        self._controller.momentum.add_weight_decay()
        with momentum_suspended(self.param_groups, momentum=0, decay=True):
            return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._launched:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        if self._profiler.active and self.process_set.included():
            self._profiler.step_starts(self._controller.device)
        return super(self.__class__, self).zero_grad(set_to_none)



def DistributedOptimizer(optimizer, named_parameters=None,
                         compression=hvd.Compression.none,
                         backward_passes_per_step=1,
                         op=hvd.Average,
                         gradient_predivide_factor=1.0,
                         num_groups=0, groups=None,
                         sparse_as_dense=False,
                         process_set=hvd.global_process_set,
                         **options):
    groups = check_horovod_arguments(backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
                                     options.get("fusion"))
    opts = Options.of(options, "DistributedOptimizer")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, SAFusionOptimizer),
               dict(_DistributedOptimizer.__dict__,
                    # hvd.broadcast_optimizer_state() initialises the state of a fresh optimizer with
                    # the *base* class's step() only when the optimizer's module is Horovod's; any
                    # other module makes it call our step(), which would synchronise gradients.
                    __module__=_hvd_optimizer.__name__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, opts)


DistributedOptimizer.__signature__ = _options.signature(DistributedOptimizer)
DistributedOptimizer.__doc__ = _options.docstring()
