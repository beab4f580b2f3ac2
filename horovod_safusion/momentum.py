"""Momentum correction, momentum factor masking and local gradient clipping (DGC, Lin et al.,
ICLR'18, §3.2 "Improving the local gradient accumulation" and §3.3 "Overcoming the staleness
effect").

Plain error feedback accumulates *gradients* and lets the wrapped SGD apply momentum to the sparse
aggregate. DGC shows that this loses momentum's discounting for the elements that wait in the
residual, and corrects it by accumulating *momentum* locally instead (§3.2, Eq. 6)::

    u_t = m · u_{t−1} + (g_t + wd · w)     (per worker; Nesterov: sent increment g + wd·w + m·u_t)
    v_t = v_{t−1} + u_t                     (v is the error-feedback residual)
    send the selected elements of v_t, keep the rest in v

and the wrapped SGD then applies the aggregate *without* momentum or weight decay. Momentum
factor masking (§3.3) clears ``u`` where ``v`` was sent, so that a sent element does not keep
pushing in a stale direction. Steps sent dense (warm-up, the dense choice, density 1) keep ``u``
whole, as DGC's uncompressed tensors do: at density 1 this is SGD with momentum (to rounding).
Where DGC's code hands the wrapped optimizer the aggregate itself, ``synchronize()`` here leaves
``(1 − m)`` of it in ``.grad`` and the step runs at ``lr/(1 − m)`` (:func:`to_gradient_scale`):
the same step, with ``.grad`` at the gradient's scale. A clip between ``synchronize()`` and
``step()`` (Horovod's recipe) still bounds an aggregate of momenta, not each step's gradient
before momentum: where it binds, every step runs at the bound, longer than Horovod's (DGC §3.2
clips locally instead: ``local_clipping``). So ``momentum_correction="auto"`` watches the first
step (:class:`GradientWatch`) and, where the script changed the gradients, turns the correction
off and leaves the momentum to the SGD; that first step's ``u`` is the bare gradient, the weight
decay left to the SGD, so that it is the SGD's own first step either way
(:func:`first_gradient_scale`, :meth:`MomentumCorrection.add_weight_decay`).

:class:`MomentumCorrection` owns ``u``: per parameter, a view of its fusion buffer's momentum
plane (:mod:`horovod_safusion.buffer`), one flat tensor per gradient element, updated in place
while the gradient joins the residual (:func:`horovod_safusion.kernels.host.fill` on the host
path). A non-finite gradient element leaves its momentum as it was. Momenta are per parameter, so
a new fusion plan keeps them (:func:`horovod_safusion.buffer.gather`), and they are part of the
optimizer's ``state_dict()``.

:class:`LocalClipping` (§3.2, "Local gradient clipping"): a worker clips each tensor's gradient to
``max_norm · N^(−1/2)`` before it enters error feedback, so that the sum of N workers' gradients
keeps the global norm bound. DGC's reference code clips per tensor too; a whole-model norm is not
known while back-propagation streams tensors into buffers that are already launched.

**EF21-SGDM** (Fatkhullin, Tyurin and Richtárik, "Momentum Provably Improves Error Feedback!",
NeurIPS'23, Algorithm 1) keeps the same local momentum but compresses its *increments*, and the
model moves by a dense estimate that every rank keeps alike::

    v_i ← (1 − η)·v_i + η·∇f_i(x)           g_i ← g_i + C(v_i − g_i)
    g ← g + mean_i C(v_i − g_i)             x ← x − γ·g

With ``u = v/η`` (η = 1 − m, so ``u ← m·u + d`` is SGD's own momentum buffer) and the residual
``r = u − g_i/η``, a step adds ``u``'s increment ``d − (1 − m)·u`` to the residual, sends the
selection of ``r`` (``r`` keeps the rest, exactly as in error feedback), and the wrapped SGD runs
with momentum 1 and no dampening, so that its momentum buffer accumulates the aggregate of what
was sent: that buffer is ``g/η``, and its step is ``x ← x − lr·g/η``. Top-k commutes with a
positive scale, so this is Algorithm 1 with γ = lr/η; where everything is sent it is SGD with
momentum, to rounding. Why it matters for training: classic error feedback (and DGC's
correction) moves a parameter only where an element was sent, and releases what waited in the
residual in bursts that the optimizer's momentum then carries on; EF21-SGDM moves every element
by the estimate at every step, and only the estimate's error waits. The plugin holds ``u`` and
the residual; ``g/η`` is the wrapped SGD's own momentum buffer.

**Masking by tensor** (``momentum_masking="auto"``, where ``momentum_correction="auto"`` turned the
correction on). DGC masks every tensor (§3.3). Masking helps where an element is sent after it
waited: ``u`` then holds a push that the sent residual has already delivered, and kept, it would
push again. It hurts where the same elements are sent at almost every step, as in an embedding's
rows of frequent tokens or a vocabulary decoder: there the top elements of each gradient hold
nearly all of it, and masking leaves them moving without momentum. So a tensor is masked where
its gradient is spread and not where it concentrates, as every rank agreed by the tensor's first
gradient (:mod:`horovod_safusion.spread`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

import torch

from .density import AUTO
from .residual import ResidualStore, holds
from .spread import Spread

MOMENTUM_KEYS = ("momentum", "nesterov", "weight_decay")  # what the wrapped step runs without

#: How the errors name an option that takes over the wrapped SGD's momentum, its paper, and the
#: way out.
MOMENTUM_CORRECTION = ("momentum_correction=True", "DGC §3.2", "momentum_correction=False")
EF21_SGDM = ('error_feedback="ef21-sgdm"', "EF21-SGDM, Algorithm 1", 'error_feedback="classic"')


def check_momentum_groups(optimizer: torch.optim.Optimizer, option: tuple[str, str, str] = MOMENTUM_CORRECTION,
                          nesterov: bool = True) -> None:
    """Raise a clear ``ValueError`` unless ``optimizer`` is an SGD whose momentum the plugin can take
    over for ``option``: some group with ``momentum > 0``, none with ``dampening`` or
    ``maximize``, and none with Nesterov unless ``nesterov``."""
    name, paper, instead = option
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"{name} takes over the momentum of torch.optim.SGD ({paper}); "
                         f"got {type(optimizer).__name__}: pass {instead}")
    groups = optimizer.param_groups
    if not any(g["momentum"] > 0 for g in groups):
        raise ValueError(f"{name} needs the wrapped SGD's momentum, but every parameter "
                         f"group has momentum=0: construct SGD(..., momentum=0.9) or pass {instead}")
    for i, g in enumerate(groups):
        if g.get("dampening", 0) != 0:
            raise ValueError(f"{name} supports dampening=0 only; parameter group {i} has "
                             f"dampening={g['dampening']!r}")
        if g.get("maximize", False):
            raise ValueError(f"{name} does not support maximize=True (parameter group {i})")
        if g.get("nesterov", False) and not nesterov:
            raise ValueError(f"{name} does not support nesterov=True (parameter group {i}): "
                             f"construct SGD(..., nesterov=False) or pass {instead}")


def takes_over_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``momentum_correction="auto"`` turns DGC's correction on for ``optimizer``: a
    ``torch.optim.SGD`` with momentum in some group, and none with ``dampening`` or ``maximize``
    (what :func:`check_momentum_groups` accepts). Classic error feedback lets that SGD apply its
    momentum to the aggregate, on top of the residual's release, and the steps stay larger than
    dense's; momentum accumulated before sparsification is applied once."""
    groups = optimizer.param_groups
    return (isinstance(optimizer, torch.optim.SGD) and any(g["momentum"] > 0 for g in groups)
            and all(g.get("dampening", 0) == 0 and not g.get("maximize", False) for g in groups))


def to_gradient_scale(groups: Sequence[dict]) -> None:
    """Scale each parameter's aggregate momentum in ``.grad`` by ``1 − m`` of its group, in place.

    Under DGC's correction the aggregate is a sum of momenta ``u``, about ``1/(1 − m)`` times the
    gradients they accumulate. A script that measures ``.grad`` between ``synchronize()`` and
    ``step()`` then sees the gradient's scale, not momentum ten times larger (m = 0.9);
    :func:`momentum_suspended` with ``rescaled=True`` steps at ``lr/(1 − m)``, so that the step
    is DGC's ``lr · u`` (to rounding). A clip there still acts on momentum (see the module's
    docstring)."""
    for group in groups:
        keep = 1.0 - float(group["momentum"])
        if keep == 1.0:
            continue
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(keep)


@contextmanager
def momentum_suspended(groups: Sequence[dict], momentum: float = 0, rescaled: bool = False,
                       decay: bool = False) -> Iterator[None]:
    """Run the wrapped SGD's step with ``momentum`` and without Nesterov or (unless ``decay``)
    weight decay (the plugin applied momentum and weight decay before sparsification: 0 for DGC's
    correction; 1 for EF21-SGDM, whose buffer sums the aggregate increments), and with
    ``rescaled`` at ``lr/(1 − m)`` (``.grad`` holds ``1 − m`` of the aggregate:
    :func:`to_gradient_scale`), restoring the groups' values afterwards, so that ``param_groups``,
    LR and momentum schedulers and ``state_dict()`` see what the user set."""
    saved = [{k: g[k] for k in MOMENTUM_KEYS + ("lr",) if k in g} for g in groups]
    try:
        for g in groups:
            if rescaled:
                g["lr"] = g["lr"] / (1.0 - float(g["momentum"]))
            g.update(momentum=momentum, nesterov=False, **({} if decay else {"weight_decay": 0}))
        yield
    finally:
        for g, s in zip(groups, saved):
            g.update(s)


def first_gradient_scale(groups: Sequence[dict], back: bool = False) -> None:
    """Turn the aggregate of the first step's momentum in ``.grad`` into the gradient the wrapped
    SGD would have stepped on, in place (``back``: the other way). The first ``u`` is the
    gradient (:attr:`MomentumCorrection.decay` off), and with Nesterov what was sent is ``(1 + m)``
    times that (:meth:`MomentumCorrection.accumulate`); without Nesterov nothing changes."""
    for group in groups:
        if group.get("nesterov", False):
            factor = 1.0 + float(group["momentum"])
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor) if back else p.grad.div_(factor)


class GradientWatch:
    """Whether the script changed the aggregated gradients between ``synchronize()`` and
    ``step()``: Horovod's recipe for a clip (``clip_grad_norm_`` scales every gradient in place,
    by 1 where the bound does not bind) or for a ``GradScaler``'s ``unscale_``. A tensor's version
    counter moves with every in-place change, so the watch costs one read per parameter."""

    def __init__(self) -> None:
        self._seen: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def record(self, params: Iterable[torch.Tensor]) -> None:
        """Remember each parameter's ``.grad`` and its version (at the end of ``synchronize()``)."""
        self._seen = [(p, p.grad, p.grad._version) for p in params if p.grad is not None]

    def changed(self) -> bool:
        """Whether some ``.grad`` recorded was changed in place or replaced since; forgets them."""
        seen, self._seen = self._seen, []
        return any(p.grad is not g or g._version != version for p, g, version in seen)


class MomentumCorrection:
    """Local momentum ``u`` per parameter, accumulated before sparsification (DGC §3.2–3.3).

    Args:
        groups: the wrapped SGD's parameter groups, read at every step (schedulers may change
            ``momentum`` and ``weight_decay``).
        masking: clear ``u`` where a sparse step sent the residual (momentum factor masking):
            ``True`` in every tensor, ``"auto"`` in the tensors whose gradient is spread
            (:attr:`masked`), ``False`` nowhere.
        params: the trainable parameters by name.
        increments: EF21-SGDM: the residual gains ``u``'s increment, not ``u`` (and no masking).
        spread: the decisions of which gradients are spread (the controller's), which
            ``masking="auto"`` follows.

    Attributes:
        momenta: the per-parameter ``u``, views of the buffers' momentum planes.
        decay: whether ``u`` takes the weight decay; off for the first step of
            ``momentum_correction="auto"``, whose weight decay the SGD applies
            (:meth:`add_weight_decay`).
    """

    def __init__(self, groups: Sequence[dict], masking: bool | str = True,
                 params: dict[str, torch.Tensor] | None = None, increments: bool = False,
                 spread: Spread | None = None) -> None:
        self._groups = groups
        self._group = {id(p): g for g in groups for p in g["params"]}
        self.increments = increments
        self.masking = False if increments else masking
        self.params = dict(params or {})
        self.momenta = ResidualStore()
        self.spread = spread
        self.decay = True

    def add(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Take over the momentum of parameters that joined (a group added to ``groups``, the
        wrapped SGD's ``param_groups`` list, after construction); their ``u`` starts at zero."""
        self.params.update(named_params)
        self._group = {id(p): g for g in self._groups for p in g["params"]}

    def of(self, buf, slot: int) -> torch.Tensor:
        """``u`` of the buffer's tensor ``slot``: its view of the buffer's momentum plane, where its
        momentum is moved (from a checkpoint) or started at zero on first use."""
        name, seg = buf.names[slot], buf.segment(slot)
        plane = buf.allocate("momentum")
        u = self.momenta.peek(name)
        if not holds(u, plane, seg):
            view = plane[seg]
            view.copy_(u.reshape(-1)) if u is not None else view.zero_()
            self.momenta.bind(name, view)
            u = view
        return u

    def factors(self, p: torch.Tensor) -> tuple[float, float, bool]:
        """``(momentum, weight_decay, nesterov)`` of ``p``'s group, as the user set them now."""
        group = self._group[id(p)]
        return float(group["momentum"]), float(group["weight_decay"]), bool(group["nesterov"])

    def accumulate(self, buf, slot: int, g: torch.Tensor, rescale: torch.Tensor | None = None,
                   on_host: bool = True) -> torch.Tensor:
        """``u = m · rescale · u + g + wd · w`` in place where the gradient is finite (elsewhere
        ``u = rescale · u``); returns what joins the residual: ``u``, or ``g + wd · w + m · u``
        with Nesterov (not finite where ``g`` is not, so that the residual's fill drops and counts
        those elements). On the host a finite gradient (the common case, one check) updates ``u``
        with no temporary; the device path never reads back and always masks. The check is whether
        the *sum* is finite: a non-finite element makes it inf or NaN, and a finite gradient whose
        sum overflows only takes the masked path, whose result is the same; ``isfinite(d).all()``
        would allocate ``|d|`` and a mask of the tensor's size in every step."""
        p = buf.params[slot]
        m, wd, nesterov = self.factors(p)
        u = self.of(buf, slot)
        d = g if wd == 0 or not self.decay else torch.add(g, p.detach().reshape(-1), alpha=wd)
        if self.increments:
            return self._increment(u, d, m, rescale, on_host)
        finite = on_host and bool(torch.isfinite(d.sum()))
        factor = m if rescale is None else rescale * m
        if finite:
            if rescale is None:
                torch.add(d, u, alpha=m, out=u)
            else:
                torch.addcmul(d, u, factor, out=u)
        else:
            ok = torch.isfinite(d)
            if rescale is not None:
                u.mul_(rescale)
            u.copy_(torch.where(ok, torch.add(d, u, alpha=m), u))
        if nesterov:
            return torch.add(d, u, alpha=m)
        return u if finite else torch.where(torch.isfinite(d), u, d)

    @staticmethod
    def _increment(u: torch.Tensor, d: torch.Tensor, m: float, rescale: torch.Tensor | None,
                   on_host: bool) -> torch.Tensor:
        """EF21-SGDM: ``u ← m·rescale·u + d`` in place where ``d`` is finite, and the increment
        ``d − (1 − m)·rescale·u`` returned (not finite where ``d`` is not, so that the fill drops
        and counts those elements; ``u`` keeps its value there)."""
        if rescale is not None:
            u.mul_(rescale)
        delta = torch.add(d, u, alpha=m - 1.0)
        if on_host and bool(torch.isfinite(d.sum())):
            u.add_(delta)
        else:
            u.add_(torch.where(torch.isfinite(delta), delta, torch.zeros_like(delta)))
        return delta

    def add_weight_decay(self) -> None:
        """``u += wd · w`` for every parameter that has a ``u``, and :attr:`decay` on again: the
        first step's ``u`` is then DGC's ``g + wd·w`` (call it before the weights move)."""
        for name, p in self.params.items():
            u = self.momenta.peek(name)
            wd = float(self._group[id(p)]["weight_decay"])
            if u is not None and wd != 0:
                u.add_(p.detach().reshape(-1), alpha=wd)
        self.decay = True

    @property
    def masked(self) -> dict[str, bool]:
        """Under ``masking="auto"``, whether each parameter decided so far is masked (its gradient
        is spread); empty otherwise."""
        return dict(self.spread.decided) if self.masking == AUTO and self.spread is not None else {}

    def mask(self, buf, indices: torch.Tensor) -> None:
        """Momentum factor masking: clear ``u`` where ``indices`` (buffer-relative) were sent, in
        every tensor or, under ``masking="auto"``, in the buffer's masked tensors."""
        if not self.masking or buf.momentum is None:
            return
        if self.masking == AUTO:
            masked = [self.spread.decided.get(name, False) for name in buf.names]
            if not any(masked):
                return
            if not all(masked):  # the sent elements of the masked tensors: each index's tensor
                starts = torch.as_tensor(buf.bounds[1:-1], dtype=indices.dtype, device=indices.device)
                tensor = torch.bucketize(indices, starts, right=True)
                indices = indices[torch.as_tensor(masked, device=indices.device)[tensor]]
        buf.momentum.index_fill_(0, indices, 0)

    def momentum(self, name: str) -> torch.Tensor:
        """The flat ``u`` of parameter ``name`` (read, do not modify; zeros before its first step)."""
        return self.momenta.get(name, self.params[name].detach().reshape(-1))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.momenta.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], numels: dict[str, int]) -> None:
        """Take the momenta of a checkpoint (``numels``: each parameter's size, for the checks)."""
        for name, u in state.items():
            if name not in numels:
                raise ValueError(f"the checkpoint holds a momentum for {name!r}, which is not a trainable "
                                 "parameter of this optimizer")
            if u.numel() != numels[name]:
                raise ValueError(f"the checkpoint's momentum for {name!r} has {u.numel()} elements; the "
                                 f"parameter has {numels[name]}")
        self.momenta.load_state_dict({n: u.reshape(-1) for n, u in state.items()})


class LocalClipping:
    """Clip each tensor's gradient to ``max_norm · workers^(−1/2)`` (DGC §3.2, local gradient
    clipping), without a host synchronisation (the factor stays a tensor)."""

    def __init__(self, max_norm: float, workers: int) -> None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0 \
                or not math.isfinite(max_norm):
            raise ValueError(f"local_clipping must be a positive finite norm (the global max_norm you would "
                             f"clip to) or None, got {max_norm!r}")
        self.max_norm = float(max_norm)
        self.bound = self.max_norm / math.sqrt(workers)

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(g, dtype=torch.float32 if g.element_size() < 4 else None)
        factor = torch.clamp(self.bound / (norm + 1e-6), max=1.0).to(g.dtype)
        return g * factor
