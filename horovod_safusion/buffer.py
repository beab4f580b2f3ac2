"""The fusion buffer: one flat tensor per buffer of the fusion plan, cut into one segment per tensor.

SAFusion §3.1 Steps 1–2 and §4 "Controller module": gradients are copied into their segments as
their hooks fire, and one selection and one collective run per buffer. Each buffer keeps two flat
tensors and fills them in turn, so the residuals left by one step's selection stay where they are
(as views) while the next step fills the other (:meth:`FusionBuffer.begin`,
:meth:`FusionBuffer.rest_kept`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .communicators import Pending
from .compressors.device import SegmentStats
from .segment import Segments


class FusionBuffer:
    """One fusion buffer: its parameters, their segments of one flat tensor, and its state.

    Attributes:
        segments: one segment per tensor, in the plan's order.
        selection: the segments one selection runs over: :attr:`segments` (``ahead``) or one
            segment for the whole buffer (``behind``).
    """

    def __init__(self, index: int, names: Sequence[str], params: Sequence[torch.Tensor], order: str) -> None:
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"fusion buffer {index} mixes dtypes {sorted(map(str, dtypes))} or devices "
                             f"{sorted(map(str, devices))}; one buffer is one flat tensor")
        self.index = index
        self.tag = str(index)
        self.names = tuple(names)
        self.params = tuple(params)
        self.dtype, self.device = params[0].dtype, params[0].device
        self.segments = Segments(self.names, tuple(p.numel() for p in params), self.device)
        # Selection segments: one per tensor (ahead) or one for the whole buffer (behind).
        self.selection = (self.segments if order == "ahead" else
                          Segments((f"{self.names[0]}..{self.names[-1]}",), (self.segments.numel,), self.device))
        self.numel = self.segments.numel
        # Two flat tensors, used in turn: the selection leaves the unsent rest in the one it read,
        # and the residuals stay there as views (no copy-back); the next step fills the other.
        self._flats: list[torch.Tensor | None] = [None, None]
        self._filling = 0
        self.holds_residuals: int | None = None  # which of the two the residuals are views into
        self.flat: torch.Tensor | None = None  # the one this step fills
        self.filled: set[int] = set()
        self.pending: Pending | None = None
        self.indices: torch.Tensor | None = None  # what the last launch selected
        self.values: torch.Tensor | None = None  # what it sent for them (after wire rounding)
        self.poisoned = False  # this rank's error-compensated gradient was not finite
        self.stats: SegmentStats | None = None  # taken while filling (the device path's Triton kernels)

    def reset(self) -> None:
        """Forget the step in flight (after synchronize, or when a step is abandoned)."""
        self.pending, self.indices, self.values, self.poisoned, self.stats = None, None, None, False, None
        self.filled.clear()

    def begin(self) -> None:
        """Pick the flat tensor this step fills: the one that does not hold the residuals (a step
        in which this buffer was not selected from leaves them where they were)."""
        i = 0 if self.holds_residuals is None else 1 - self.holds_residuals
        if self._flats[i] is None:
            self._flats[i] = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.flat, self._filling = self._flats[i], i

    def rest_kept(self) -> None:
        """The residuals are now views into the flat tensor this step filled."""
        self.holds_residuals = self._filling

    def segment(self, slot: int) -> slice:
        off = self.segments.offsets[slot]
        return slice(off, off + self.segments.sizes[slot])
