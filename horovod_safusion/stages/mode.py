"""The mode of one step: decided once, at the step's first gradient, and carried as data.

A step is either sparse or dense. It is dense for a dense compressor, for a plan that the dense
choice made (SAFusion planner, ``dense=``), and for a step of DGC's density warm-up at density 1
(Lin et al., DGC §3.3); then every buffer is reduced in place with Horovod's allreduce. On a
sparse step, the buffers of small tensors (:func:`~horovod_safusion.plan.send_small_dense`) still
go dense. A critical step (:mod:`horovod_safusion.regime`) may travel as float16 with its
rounding error kept (:mod:`.half`). The step's density is an argument of every selection: no
stage writes it into the compressor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..buffer import FusionBuffer


@dataclass(frozen=True)
class StepMode:
    """How one step sends.

    Attributes:
        dense: every buffer is sent dense.
        density: the fraction of each tensor a sparse selection sends (the warm-up's, else the
            compressor's).
        rescale: the ratio of this step's loss scale to the residuals' (``None``: none applies).
        step: the step's number (the optimizer's count of steps, the same on every rank).
        half: a dense step whose float32 buffers (not the small tensors') go as float16, their
            rounding error kept (:mod:`.half`).
        release: the density at which a dense step sends the residuals of earlier sparse steps
            along (:func:`~.fill.release`): below 1 a chunk per step, at 1 whole.
    """

    dense: bool
    density: float
    rescale: torch.Tensor | None = None
    step: int = 0
    half: bool = False
    release: float = 1.0

    def sends_dense(self, buf: FusionBuffer) -> bool:
        """Whether ``buf`` goes dense in this step: a dense step, or a buffer of small tensors."""
        return self.dense or buf.dense

    def sends_half(self, buf: FusionBuffer) -> bool:
        """Whether ``buf`` goes dense as float16 in this step."""
        return self.half and self.dense and not buf.dense and buf.dtype == torch.float32

    @property
    def scale(self) -> float | None:
        """:attr:`rescale` as a Python number (the host kernels take one), or ``None``."""
        return None if self.rescale is None else float(self.rescale)
