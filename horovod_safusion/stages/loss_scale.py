"""The loss scale the residuals are kept at: with a ``GradScaler``, residuals are kept at the scale
of the step that made them and rescaled by ``new_scale / old_scale`` when added to the next
gradient, so a changing scale neither inflates nor shrinks them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class LossScale:
    """The loss scale residuals are kept at.

    Args:
        current: returns the scale of the step being back-propagated (a ``GradScaler``'s), or
            ``None``; ``None`` itself: no loss scaling.
    """

    def __init__(self, current: Callable[[], torch.Tensor | None] | None) -> None:
        self.current = current
        self.residuals: torch.Tensor | None = None  # the scale the residuals are at
        self._step: torch.Tensor | None = None      # the scale of the step in flight

    def begin(self, rescales: bool) -> torch.Tensor | None:
        """The step's first gradient: the ratio of its scale to the residuals' as a 0-dim tensor (no
        host synchronisation; it keeps the residual's dtype), or ``None`` where none applies
        (``rescales`` false: nothing is kept from step to step)."""
        scale = self.current() if self.current is not None else None
        self._step = scale
        if scale is None or self.residuals is None or not rescales:
            return None
        return (scale / self.residuals).reshape(())

    def end(self) -> None:
        """The step synchronised: its residuals are at its scale."""
        self.residuals = self._step


def scaler_scale(scaler: Any) -> Callable[[], torch.Tensor | None] | None:
    """A function returning the scale ``scaler`` (a ``torch.amp.GradScaler``, or ``None``)
    multiplies the loss by now: :class:`LossScale`'s ``current``.

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
