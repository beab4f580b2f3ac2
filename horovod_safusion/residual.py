"""Error-feedback memory: every unsent gradient element is kept and added back next step.

Residuals are per parameter (never per buffer), so a new fusion plan keeps them, and they are
part of the optimizer's ``state_dict()`` so a checkpoint loses nothing. The invariant, checked by
the tests for every parameter and step, is exact::

    residual_after + sent == residual_before + grad
"""
from __future__ import annotations

import torch


class ResidualStore:
    """Flat residual tensors keyed by parameter name, created lazily as zeros."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The flat residual of ``name``, shaped and typed like ``like`` flattened."""
        r = self._residuals.get(name)
        if r is None or r.numel() != like.numel() or r.dtype != like.dtype or r.device != like.device:
            r = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
            self._residuals[name] = r
        return r

    def pop(self, name: str) -> torch.Tensor | None:
        """Take ``name``'s residual out of the store (``None`` if it has none)."""
        return self._residuals.pop(name, None)

    def bind(self, name: str, rest: torch.Tensor) -> None:
        """Make ``rest`` (flat, e.g. a fusion buffer's segment, not copied) ``name``'s residual."""
        self._residuals[name] = rest

    def discard(self, name: str) -> None:
        """Forget ``name``'s residual (equivalent to zeros): used when every element was sent."""
        self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: r.clone() for n, r in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {n: r.detach().clone() for n, r in state.items()}
