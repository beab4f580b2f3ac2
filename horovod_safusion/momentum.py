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

:class:`MomentumCorrection` owns ``u``, per fusion buffer as two flat tensors used in turn: a step
writes ``u_t`` into the one that does not hold ``u_{t−1}`` (no copy), and only a buffer that was
finite on this rank makes it current, so a skipped non-finite step leaves the momentum as it was.
Momenta are per parameter (views of the current flats), so a new fusion plan keeps them, and they
are part of the optimizer's ``state_dict()``.

:class:`LocalClipping` (§3.2, "Local gradient clipping"): a worker clips each tensor's gradient to
``max_norm · N^(−1/2)`` before it enters error feedback, so that the sum of N workers' gradients
keeps the global norm bound. DGC's reference code clips per tensor too; a whole-model norm is not
known while back-propagation streams tensors into buffers that are already launched.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

MOMENTUM_KEYS = ("momentum", "nesterov", "weight_decay")  # what the wrapped step runs without


def check_momentum_groups(optimizer: torch.optim.Optimizer) -> None:
    """Raise a clear ``ValueError`` unless ``optimizer`` is an SGD whose momentum the plugin can take
    over: some group with ``momentum > 0``, none with ``dampening`` or ``maximize``."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"momentum_correction=True takes over the momentum of torch.optim.SGD (DGC §3.2); "
                         f"got {type(optimizer).__name__}: pass momentum_correction=False")
    groups = optimizer.param_groups
    if not any(g["momentum"] > 0 for g in groups):
        raise ValueError("momentum_correction=True needs the wrapped SGD's momentum, but every parameter "
                         "group has momentum=0: construct SGD(..., momentum=0.9) or pass "
                         "momentum_correction=False")
    for i, g in enumerate(groups):
        if g.get("dampening", 0) != 0:
            raise ValueError(f"momentum_correction=True supports dampening=0 only; parameter group {i} has "
                             f"dampening={g['dampening']!r}")
        if g.get("maximize", False):
            raise ValueError(f"momentum_correction=True does not support maximize=True (parameter group {i})")


@contextmanager
def momentum_suspended(groups: Sequence[dict]) -> Iterator[None]:
    """Run the wrapped SGD's step without its momentum and weight decay (the plugin applied both
    before sparsification), restoring the groups' values afterwards, so that ``param_groups``, LR
    and momentum schedulers and ``state_dict()`` see what the user set."""
    saved = [{k: g[k] for k in MOMENTUM_KEYS if k in g} for g in groups]
    try:
        for g in groups:
            g.update(momentum=0, weight_decay=0, nesterov=False)
        yield
    finally:
        for g, s in zip(groups, saved):
            g.update(s)


class MomentumCorrection:
    """Local momentum ``u`` per parameter, accumulated before sparsification (DGC §3.2–3.3).

    Args:
        groups: the wrapped SGD's parameter groups, read at every step (schedulers may change
            ``momentum`` and ``weight_decay``).
        masking: clear ``u`` where a sparse step sent the residual (momentum factor masking).
    """

    def __init__(self, groups: Sequence[dict], masking: bool = True) -> None:
        self._group = {id(p): g for g in groups for p in g["params"]}
        self.masking = masking
        self._flats: dict[int, list[torch.Tensor]] = {}  # buffer index → its two flats
        self._current: dict[int, int] = {}  # buffer index → which flat holds u
        self._where: dict[str, tuple[int, slice]] = {}  # name → (buffer index, segment)

    def attach(self, buffers) -> None:
        """Give every buffer of a new plan its two momentum flats, carrying every parameter's ``u``."""
        old = {name: self.momentum(name) for name in self._where}
        self._flats, self._current, self._where = {}, {}, {}
        for buf in buffers:
            flats = [torch.zeros(buf.numel, dtype=buf.dtype, device=buf.device) for _ in range(2)]
            self._flats[buf.index], self._current[buf.index] = flats, 0
            for slot, name in enumerate(buf.names):
                self._where[name] = (buf.index, buf.segment(slot))
                if name in old:
                    self.momentum(name).copy_(old[name])

    def accumulate(self, buf, slot: int, g: torch.Tensor, rescale: torch.Tensor | None = None) -> torch.Tensor:
        """``u_t = m · u_{t−1} + g + wd · w`` into the buffer's other flat; returns what joins the
        residual: ``u_t``, or ``g + wd · w + m · u_t`` with Nesterov. ``rescale`` (a 0-dim tensor)
        brings ``u_{t−1}`` to this step's loss scale."""
        p = buf.params[slot]
        group = self._group[id(p)]
        m, wd = float(group["momentum"]), float(group["weight_decay"])
        cur = self._current[buf.index]
        seg = buf.segment(slot)
        u_old, u_new = self._flats[buf.index][cur][seg], self._flats[buf.index][1 - cur][seg]
        d = g if wd == 0 else torch.add(g, p.detach().reshape(-1), alpha=wd)
        if rescale is None:
            torch.add(d, u_old, alpha=m, out=u_new)
        else:
            torch.addcmul(d, u_old, rescale * m, out=u_new)
        return torch.add(d, u_new, alpha=m) if group["nesterov"] else u_new

    def commit(self, buf) -> None:
        """This step's ``u`` of ``buf`` becomes current (its gradient was finite on this rank)."""
        self._current[buf.index] ^= 1

    def mask(self, buf, indices: torch.Tensor) -> None:
        """Momentum factor masking: clear ``u`` where ``indices`` (buffer-relative) were sent."""
        if self.masking:
            self._flats[buf.index][self._current[buf.index]].index_fill_(0, indices, 0)

    def momentum(self, name: str) -> torch.Tensor:
        """The flat ``u`` of parameter ``name`` (a view; read, do not modify)."""
        index, seg = self._where[name]
        return self._flats[index][self._current[index]][seg]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: self.momentum(n).clone() for n in self._where}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, u in state.items():
            if name not in self._where:
                raise ValueError(f"the checkpoint holds a momentum for {name!r}, which is not a trainable "
                                 "parameter of this optimizer")
            mine = self.momentum(name)
            if u.numel() != mine.numel():
                raise ValueError(f"the checkpoint's momentum for {name!r} has {u.numel()} elements; the "
                                 f"parameter has {mine.numel()}")
            mine.copy_(u.reshape(-1))


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
