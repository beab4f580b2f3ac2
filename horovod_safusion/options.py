"""The SAFusion options of :func:`~horovod_safusion.DistributedOptimizer`, declared once.

Horovod's arguments keep their positions in the factory; these are keyword-only. :class:`Options`
holds them with their defaults and their documentation: the factory's signature
(:func:`signature`), its docstring (:func:`docstring`) and the optimizer class all read this one
declaration. The checks that need nothing but the values run when an :class:`Options` is
made (:meth:`Options.__post_init__`); those that need the planner or the compressor run where
those are made (:mod:`horovod_safusion.assembly`).
"""
from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .density import AUTO
from .plan import DENSE_SHARE, MIN_SELECTED

#: The values of ``error_feedback=``.
ERROR_FEEDBACK = ("classic", "ef21-sgdm")


def _option(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Options:
    """The keyword-only options, as given (``None`` where the default depends on others)."""

    compressor: Any = _option(None, """
        name of a registered compressor (``"dgc"``, ``"topk"``, ``"none"``, ...; see
        ``horovod_safusion.available_compressors()``) or a ``Compressor`` instance; default
        ``"dgc"``, or ``"none"`` for the dense scheme ``fusion="horovod"``.""")
    density: Any = _option(None, """
        fraction of each tensor's elements sent per step, ``0 < density <= 1`` (default 0.03; a
        tensor whose gradient is spread sends at least ``spread_density``). Lower saves traffic;
        too low slows convergence. ``"auto"`` (with ``fusion="safusion"``): the
        densest of 0.03, 0.1 and dense whose iteration time, predicted from the profile and
        confirmed by a measured trial, is within 20 % of the fastest — the most the link hides
        behind back-propagation; lower densities learn too slowly per step to pay (0.03 until the
        first plan; rank 0 says what it chose; a warm-up ends at the chosen density).""")
    fusion: Any = _option(None, """
        name of a fusion planner (default ``"safusion"``: aligned, adaptively sized buffers planned
        from an online profile; see ``horovod_safusion.available_planners()``) or a ``Planner``
        instance. Cannot be combined with Horovod's ``groups``.""")
    communicator: Any = _option("auto", """
        ``"auto"`` (the default: dense allreduce for ``compressor="none"``; otherwise sparse
        allgather at first, and with ``fusion="safusion"`` the faster of allgather and ZEN at this
        job's worker count (the allgather alone with two workers), priced from the profile's sweeps
        and tried for a few steps when close; rank 0 says on standard error what it chose), a
        registered name, or a ``Communicator`` instance. SparDL applies fewer elements per step
        than those two (the top k/P of each merged block), so it runs only when named.""")
    profile_steps: int = _option(10, """
        iterations measured before planning (after one warm-up iteration), for planners that need a
        profile. They train as usual, communication overlapped; after the last one (or, while
        critical regimes send the next step dense, after the first step before one that they do
        not), short sweeps time the compressor and one collective per message size on every rank.""")
    replan_every: Any = _option(None, """
        re-profile and re-plan every this many iterations (default: plan once).""")
    timeline: Any = _option(None, """
        record the plugin's phases as Chrome-trace events to this file (one per rank: ``saf.json``
        → ``saf.rank0.json``; ``{rank}`` in the path is replaced instead), or a
        ``horovod_safusion.timeline.TimelineRecorder`` (e.g. given the model, for exact forward
        times). Default: ``$HOROVOD_SAFUSION_TIMELINE``, else off. Merge with Horovod's Timeline by
        ``python -m horovod_safusion timeline merge``.""")
    grad_scaler: Any = _option(None, """
        the ``torch.amp.GradScaler`` that scales this optimizer's loss, if any. Residuals hold
        scaled gradient; told the scaler, the optimizer rescales them when the scale changes, so
        training matches an unscaled run (bit for bit while scales are powers of two, GradScaler's
        default). Without it a changing scale distorts the residuals.""")
    dense: Any = _option(None, """
        with ``fusion="safusion"``, whether to send dense with Horovod's allreduce instead of
        sparsifying: ``"auto"`` (the default) prices both from the profile, tries both for a few
        steps when the predictions are close, and keeps the faster (on a fast link, or for a small
        model, a dense allreduce can win); ``True`` always sends dense, from the first step, under
        the SGD's own momentum (Horovod's average), ``False`` never. Rank 0 says on standard error
        when it sends dense.""")
    momentum_correction: Any = _option(AUTO, """
        DGC's momentum correction (Lin et al., ICLR'18, §3.2): the wrapped ``torch.optim.SGD``'s
        momentum (and weight decay, and Nesterov) is accumulated per worker *before*
        sparsification, and the SGD then steps without them (its ``param_groups`` keep the values
        you set, read every step); ``synchronize()`` leaves ``(1 − m)`` times the aggregate in
        ``.grad``, the gradient's scale, and the step runs at ``lr/(1 − m)``. A clip after
        ``synchronize()`` then bounds that aggregate of momenta, not each step's gradient as under
        Horovod (use ``local_clipping``). ``"auto"`` (the default): on for an SGD with momentum (no
        ``dampening``, no ``maximize``) whose gradients are sparsified, off otherwise (other
        optimizers, ``compressor="none"`` or ``"exdyna"``, ``dense=True``,
        ``error_feedback="ef21-sgdm"``), and turned off at the first step where the script changes
        the gradients between ``synchronize()`` and ``step()`` (a clip), so that the SGD's momentum
        takes them as under Horovod. ``True`` needs an SGD with ``momentum > 0``; anything else is
        then an error, so momentum is never applied twice. ``False``: classic error feedback under
        the SGD's own momentum.""")
    momentum_masking: Any = _option(None, """
        with momentum correction, clear the momentum of the elements a sparse step sent (DGC's
        momentum factor masking, §3.3). ``True``: in every tensor, as DGC. ``"auto"``: in the
        tensors whose gradient is spread (a convolution's, a dense layer's), not in those whose
        gradient concentrates in a few elements (an embedding's, a vocabulary decoder's), which are
        sent at almost every step and would then move without momentum; each tensor is decided by
        its first gradient, alike on every rank (:mod:`horovod_safusion.spread`). ``False``:
        nowhere. Default (``None``): ``True`` with ``momentum_correction=True``, ``"auto"`` where
        ``momentum_correction="auto"`` turned the correction on (docs/benchmarks.md, "Masking by
        tensor", has the runs).""")
    spread_density: Any = _option(None, """
        the least density of a tensor whose gradient is spread over its elements (a convolution's,
        a dense layer's), as every rank agrees by the tensor's first gradient
        (:mod:`horovod_safusion.spread`); a tensor whose gradient concentrates in a few elements (an
        embedding's, a vocabulary decoder's) selects at ``density``. The largest few percent of a
        spread gradient hold a small part of it, so at a low density most of it waits in the
        residual. A number ``0 < spread_density <= 1``. Default (``None``): 0.1 where ``density`` is
        left to its default or ``"auto"``; none where ``density`` (or a compressor instance's) is
        given, so that a given density is every tensor's (docs/benchmarks.md, "Density by tensor",
        has the runs).""")
    local_clipping: Any = _option(None, """
        DGC's local gradient clipping: the global ``max_norm`` you would clip to; each worker clips
        each tensor's gradient to ``max_norm / sqrt(workers)`` before error feedback. Default
        ``None`` (off).""")
    warmup_steps: int = _option(0, """
        send at a higher density for the first this many steps (DGC's warm-up); every rank switches
        at the same step and residuals carry over. Default 0 (off).""")
    warmup_schedule: str = _option("exponential", """
        ``"exponential"`` (four stages at ``density^(1/5)``, ``^(2/5)``, ``^(3/5)``, ``^(4/5)``:
        DGC's 25 %, 6.25 %, 1.6 %, 0.4 % for 0.001) or ``"dense"`` (every element, like PowerSGD's
        ``start_powerSGD_iter``).""")
    critical_regimes: Any = _option(AUTO, """
        Accordion's critical learning regimes (Agarwal et al., MLSys'21, Algorithm 1): every this many
        steps, compare the root mean square of the update's norm with the previous interval's; where
        it changed by half or more, the next interval is sent dense, and the first two always are. It
        spends bandwidth where sparse steps would learn least (fast change, early training) and
        pulls back a run that error feedback's delay makes diverge. ``"auto"`` (the default):
        intervals of 10 steps where the job sparsifies with ``fusion="safusion"`` and
        ``dense="auto"``, off otherwise (``dense=False`` never sends dense). ``None``: off. Where
        the profile measured a float16 dense allreduce faster, critical steps go as float16 with
        the rounding error kept in the residual (rank 0 says which).""")
    min_selected: int = _option(MIN_SELECTED, """
        a tensor that would send fewer than this many elements per step (``ceil(density · numel)``:
        biases, norms, small heads) is sent whole, in one dense buffer shared by all such tensors,
        with Horovod's allreduce (default 64; ``0`` sparsifies every tensor, as the papers do,
        ``dense_share``'s included). Error feedback on a tensor that sends one or a few elements
        per step holds its gradient back for many steps and releases it in bursts that momentum
        amplifies; see the user guide.""")
    dense_share: float = _option(DENSE_SHARE, """
        the smallest tensors that together hold at most this share of the model's elements are sent
        whole too, in the same dense buffer (default 0.15; ``0`` turns it off). They cost little
        sent whole, and error feedback's delay costs a tensor whose gradient is spread over all its
        elements (a recurrent layer's weights) more than an embedding or a vocabulary decoder,
        whose gradient gathers in the batch's rows; see the user guide.""")
    error_feedback: str = _option("classic", """
        what waits for a later step when a step sends only a selection. ``"classic"`` (the default;
        Seide et al.'s error feedback): the unsent gradient, in a residual added to the next step's
        gradient; the wrapped optimizer applies the aggregate of what was sent. ``"ef21-sgdm"``
        (Fatkhullin, Tyurin and Richtárik, NeurIPS'23, Algorithm 1): each worker keeps the wrapped
        SGD's momentum itself and sends a selection of how far it moved from what was sent before;
        every rank then moves every element by the aggregate estimate, at every step. Needs
        ``torch.optim.SGD`` with ``momentum > 0`` (not Nesterov), whose momentum buffer holds the
        estimate; not with ``momentum_correction``.""")

    def __post_init__(self) -> None:
        """The checks that need only the values: a clear ``ValueError`` naming the value and what
        is accepted."""
        if self.error_feedback not in ERROR_FEEDBACK:
            raise ValueError(f"error_feedback must be one of {', '.join(map(repr, ERROR_FEEDBACK))}, "
                             f"got {self.error_feedback!r}")
        mc = self.momentum_correction
        if not (mc is True or mc is False or mc == AUTO):
            raise ValueError(f"momentum_correction must be True, False or {AUTO!r}, got {mc!r}")
        mm = self.momentum_masking
        if not (mm is None or mm is True or mm is False or mm == AUTO):
            raise ValueError(f"momentum_masking must be True, False, {AUTO!r} or None (the default), got {mm!r}")
        sd = self.spread_density
        if sd is not None and (isinstance(sd, bool) or not isinstance(sd, (int, float)) or not 0 < sd <= 1):
            raise ValueError(f"spread_density must be a number with 0 < spread_density <= 1, or None (the "
                             f"default), got {sd!r}")
        if self.ef21 and mc is True:
            raise ValueError('error_feedback="ef21-sgdm" keeps the momentum itself; it cannot be combined '
                             "with momentum_correction=True: pass one of them")
        ms = self.min_selected
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
            raise ValueError(f"min_selected must be an integer >= 0 (0 sparsifies every tensor), got {ms!r}")
        share = self.dense_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
            raise ValueError(f"dense_share must be a number with 0 <= dense_share < 1 (0 turns it off), "
                             f"got {share!r}")

    @property
    def ef21(self) -> bool:
        """Whether ``error_feedback`` asks for EF21-SGDM."""
        return self.error_feedback == "ef21-sgdm"

    @classmethod
    def of(cls, kwargs: dict[str, Any], caller: str) -> "Options":
        """The options given to ``caller`` as keywords; an unknown keyword is the ``TypeError``
        Python gives a function that does not take it."""
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
        return cls(**kwargs)


def signature(factory: Callable) -> inspect.Signature:
    """``factory``'s signature as its users see it: Horovod's parameters in Horovod's positions
    (``factory`` declares them, then ``**options``), then the options, keyword-only."""
    hints = {"compressor": "str | Compressor | None", "density": "float | str | None",
             "fusion": "str | Planner | None", "communicator": "str | Communicator",
             "replan_every": "int | None", "timeline": "str | TimelineRecorder | None",
             "dense": "bool | str | None", "momentum_correction": "bool | str",
             "momentum_masking": "bool | str | None", "spread_density": "float | None",
             "local_clipping": "float | None",
             "critical_regimes": "int | None"}
    horovods = list(inspect.signature(factory).parameters.values())[:-1]
    return inspect.Signature(horovods + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                                           annotation=hints.get(f.name, f.type))
                                         for f in fields(Options)])


_INTRODUCTION = """
    An optimizer that wraps another ``torch.optim.Optimizer`` and synchronises sparsified
    gradients with sparsification-ahead tensor fusion (SAFusion, HPDC'25).

    Every gradient tensor is sparsified on its own as soon as back-propagation produces it, the
    selected elements are merged into a fusion buffer, and one collective per buffer starts as soon
    as the buffer's last tensor is in, overlapping the rest of back-propagation. ``step()`` waits
    for all buffers, adds up the values of all ranks (``index_add_``), averages and applies the
    update. Unsent elements are kept as per-parameter error-feedback residuals.

    Horovod's arguments (``optimizer`` … ``process_set``) keep their positions and meanings; see
    ``horovod.torch.DistributedOptimizer``. The SAFusion options are keyword-only
    (:class:`horovod_safusion.options.Options`):

"""

_CLOSING = """
    The returned optimizer has ``plan``, ``profile``, ``set_plan()``, ``last_stats``, ``residuals``,
    ``target_density`` and ``timeline`` besides Horovod's ``synchronize()``, ``skip_synchronize()``
    and ``set_backward_passes_per_step()``.
"""


def docstring() -> str:
    """The factory's docstring, with an "Arguments" entry per option."""
    entries = []
    for f in fields(Options):
        body = textwrap.fill(" ".join(f.metadata["doc"].split()), 96, initial_indent=" " * 12,
                             subsequent_indent=" " * 12)
        entries.append(f"        {f.name}:\n{body}")
    return _INTRODUCTION + "    Arguments:\n" + "\n".join(entries) + "\n" + _CLOSING
