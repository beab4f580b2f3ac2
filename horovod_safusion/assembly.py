"""The parts of a :func:`~horovod_safusion.DistributedOptimizer`, made from its options.

The optimizer keeps Horovod's contract (hooks, ``synchronize``, ``step``, state); what runs
behind it is made here, once, from :class:`~horovod_safusion.options.Options` and the wrapped
optimizer: the fusion planner (SAFusion §3.3, or Horovod's ``groups`` as a fixed plan), the
compressor, whether the plugin takes over the SGD's momentum (DGC §3.2, EF21-SGDM), the
communicators, the online profiler and the :class:`~horovod_safusion.controller.Controller`
(SAFusion §4). The checks that need the planner or the compressor are here too.
"""
from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch
import horovod.torch as hvd
import horovod.torch.optimizer as _hvd_optimizer
from horovod.torch.mpi_ops import rocm_built

from .communicators import Communicator, make_communicators
from .compressors import Compressor, make_compressor
from .controller import Controller
from .density import CANDIDATES, SPREAD, check_auto, is_auto
from .fusion import GroupsPlanner, Planner, make_planner
from .fusion.safusion import check_dense_choice
from .momentum import (EF21_SGDM, MOMENTUM_CORRECTION, LocalClipping, MomentumCorrection, check_momentum_groups,
                       takes_over_momentum)
from .options import AUTO, Options
from .plan import TensorInfo
from .profiling import OnlineProfiler
from .regime import DEFAULT_INTERVAL, CriticalRegimes
from .spread import Spread
from .stages.loss_scale import scaler_scale
from .warmup import DensityWarmup

#: The planner of ``fusion=None``.
DEFAULT_FUSION = "safusion"
_SUPPORTED_OPS = {hvd.Average: "hvd.Average", hvd.Sum: "hvd.Sum"}
_OP_NAMES = {hvd.Adasum: "hvd.Adasum", hvd.Min: "hvd.Min", hvd.Max: "hvd.Max", hvd.Product: "hvd.Product"}


class Parts(NamedTuple):
    """What :func:`assemble` makes."""

    planner: Planner
    compressor: Compressor
    communicators: dict[str, Communicator]
    profiler: OnlineProfiler
    controller: Controller
    momentum_correction: bool  # the plugin applies the SGD's momentum (DGC §3.2)


def assemble(opt: torch.optim.Optimizer, options: Options, groups: Any,
             named: list[tuple[str, torch.Tensor]], names: dict[torch.Tensor, str]) -> Parts:
    """The parts behind ``opt`` (the optimizer being built, with the user's ``param_groups``):
    ``named`` are its trainable parameters in back-propagation order, ``names`` every parameter's
    name, ``groups`` Horovod's argument."""
    planner = GroupsPlanner(group_names(groups, names)) if groups is not None \
        else make_planner(options.fusion if options.fusion is not None else DEFAULT_FUSION)
    set_dense_choice(planner, options.dense)
    check_auto(options.density)
    comp = make_compressor(compressor_for(planner, options.compressor),
                           None if is_auto(options.density) else options.density)
    correction = options.momentum_correction is True or (
        options.momentum_correction == AUTO and not options.ef21 and not comp.dense and comp.density < 1.0
        and options.dense is not True and comp.auto_momentum_correction and takes_over_momentum(opt))
    check_momentum(opt, correction, options.ef21)
    masking = options.momentum_masking
    if masking is None:  # DGC's masking everywhere where asked for; by tensor where "auto" chose the correction
        masking = True if options.momentum_correction is True else AUTO
    floor = spread_floor(options, comp)
    spread = Spread(n for n, _ in named) if floor is not None or (correction and masking == AUTO) else None
    densities = density_candidates(planner, comp, options.density)
    comms = make_communicators(options.communicator, comp.dense, opt.process_set, opt._compression,
                               sends_dense=options.dense is True)
    profiler = OnlineProfiler(planner, [tensor_info(n, p) for n, p in named], {n: p.dtype for n, p in named},
                              opt.process_set, profile_steps=options.profile_steps, replan_every=options.replan_every)
    prescale, postscale = ((1.0 / opt.gradient_predivide_factor, opt.gradient_predivide_factor)
                           if opt.op == hvd.Average else (1.0, 1.0))
    warmup = DensityWarmup(options.warmup_steps, options.warmup_schedule, 1.0 if comp.dense else comp.density)
    controller = Controller(
        named, profiler.initial_plan(), comp, comms, opt.op, prescale, postscale, opt.sparse_as_dense,
        loss_scale=scaler_scale(options.grad_scaler),
        momentum=MomentumCorrection(opt.param_groups, masking, dict(named), increments=options.ef21, spread=spread)
        if correction or options.ef21 else None,
        clipping=None if options.local_clipping is None else LocalClipping(options.local_clipping,
                                                                           opt.process_set.size()),
        warmup=warmup if warmup.steps else None, min_selected=options.min_selected,
        dense_share=options.dense_share, densities=densities,
        regimes=critical_regimes(options.critical_regimes, planner, comp), spread=spread, spread_floor=floor)
    return Parts(planner, comp, comms, profiler, controller, correction)


def spread_floor(options: Options, comp: Compressor) -> float | None:
    """The least density of a tensor whose gradient is spread (``spread_density``): as given, or
    :data:`~horovod_safusion.density.SPREAD` where the density is left to its default or
    ``"auto"`` (not given by ``density=`` or a compressor instance); none for a dense compressor."""
    if comp.dense:
        return None
    if options.spread_density is not None:
        return float(options.spread_density)
    given = isinstance(options.compressor, Compressor) or (options.density is not None and not is_auto(options.density))
    return None if given else SPREAD


def check_horovod_arguments(backward_passes_per_step: int, op: Any, gradient_predivide_factor: float,
                            num_groups: int, groups: Any, fusion: Any) -> Any:
    """Horovod's arguments checked as Horovod checks them (its errors and warnings), with the
    plugin's own limits on ``op`` and ``groups``; ``groups``, or Horovod's deprecated
    ``num_groups`` in its place."""
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
    return groups


def checked_names(opt: torch.optim.Optimizer, named_parameters: Any) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters`` checked as Horovod checks them (unique names, every parameter
    named), or Horovod's names for unnamed parameters."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f'allreduce.noname.{i}.{j}', v)
                            for i, param_group in enumerate(opt.param_groups)
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

    all_param_ids = {id(v) for param_group in opt.param_groups for v in param_group['params']}
    named_param_ids = {id(v) for k, v in named_parameters}
    unnamed_param_ids = all_param_ids - named_param_ids
    if len(unnamed_param_ids):
        raise ValueError('named_parameters was specified, but one or more model '
                         'parameters were not named. Python object ids: '
                         '%s' % ', '.join(str(id) for id in unnamed_param_ids))
    return named_parameters


def check_momentum(opt: torch.optim.Optimizer, correction: bool, ef21: bool) -> None:
    """Where the plugin takes over the wrapped SGD's momentum (DGC's correction, EF21-SGDM),
    check that it can, as ``opt``'s groups stand now."""
    if correction:
        check_momentum_groups(opt, MOMENTUM_CORRECTION)
    elif ef21:
        check_momentum_groups(opt, EF21_SGDM, nesterov=False)


def check_floating(name: str, p: torch.Tensor) -> None:
    """A clear error for a trainable parameter that is not floating-point."""
    if not p.is_floating_point():
        raise ValueError(f"parameter {name!r} has dtype {p.dtype}; horovod_safusion fuses floating-point "
                         "gradients only (float16, bfloat16, float32, float64)")


def tensor_info(name: str, p: torch.Tensor) -> TensorInfo:
    """What the planners know of parameter ``p``'s gradient."""
    return TensorInfo(name, p.numel(), p.element_size(), f"{p.dtype}@{p.device}")


def set_dense_choice(planner: Planner, dense: "bool | str | None") -> None:
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


def critical_regimes(option: Any, planner: Planner, compressor: Compressor) -> CriticalRegimes | None:
    """Accordion's critical regimes as ``critical_regimes=`` asks: ``"auto"`` (the default) at
    intervals of :data:`~horovod_safusion.regime.DEFAULT_INTERVAL` steps where the job sparsifies
    and may send dense (a planner that chooses, left at ``dense="auto"``), else off; ``None`` off;
    an int, that interval."""
    if isinstance(option, str) and option == AUTO:
        free = planner.chooses_dense and planner.dense_choice == AUTO
        on = free and not compressor.dense and compressor.density < 1.0
        return CriticalRegimes(DEFAULT_INTERVAL) if on else None
    return None if option is None else CriticalRegimes(option)


def density_candidates(planner: Planner, compressor: Compressor, density: Any) -> tuple[float, ...]:
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


def compressor_for(planner: Planner, compressor: "str | Compressor | None") -> "str | Compressor":
    """The compressor to use: the default for the planner, or the user's if it fits the planner."""
    if compressor is None:
        return "none" if planner.dense else "dgc"
    if planner.dense and not (compressor == "none" or getattr(compressor, "dense", False)):
        raise ValueError(f"fusion={planner.name!r} is a dense scheme and sends every element; it cannot use "
                         f"compressor={compressor!r}: leave compressor unset or pass compressor='none'")
    return compressor


def group_names(groups: Any, names: dict[torch.Tensor, str]) -> "int | list[list[str]]":
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
