"""Error-feedback memory: every unsent gradient element is kept and added back next step.

Residuals are per parameter (never per buffer), so a new fusion plan keeps them, and they are
part of the optimizer's ``state_dict()`` so a checkpoint loses nothing. The invariant, checked by
the tests for every parameter and step, is exact::

    residual_after + sent == residual_before + grad
"""
from __future__ import annotations

import torch


class ResidualStore:
    """Flat per-parameter tensors keyed by parameter name: views of a fusion buffer's flat tensor
    while training (:mod:`horovod_safusion.buffer`), tensors of their own after a checkpoint was
    loaded. The controller keeps the residuals in one, momentum correction its momenta in
    another."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def peek(self, name: str) -> torch.Tensor | None:
        """The flat tensor of ``name``, or ``None`` (zeros) if it has none."""
        return self._residuals.get(name)

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The flat tensor of ``name``, or zeros shaped and typed like ``like`` flattened if it has
        none (not stored: read, do not modify)."""
        r = self._residuals.get(name)
        return torch.zeros(like.numel(), dtype=like.dtype, device=like.device) if r is None else r

    def names(self) -> list[str]:
        return list(self._residuals)

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


def holds(view: torch.Tensor | None, flat: torch.Tensor | None, seg: slice) -> bool:
    """Whether ``view`` is exactly ``flat[seg]`` (the same memory)."""
    return (view is not None and flat is not None and view.numel() == seg.stop - seg.start
            and view.data_ptr() == flat.data_ptr() + seg.start * flat.element_size())
