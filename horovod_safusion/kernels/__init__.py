"""The GPU path's kernels: Triton for CUDA tensors, PyTorch everywhere else (and as reference).

``cuda/README.md`` points here: kernels must be importable by the package, so they live in it.
The three operations of SAFusion's per-buffer data path (§3.1 Steps 1–3):

* :func:`segment_stats` — per segment ``max |x|``, ``Σ |x|``, and whether the buffer is finite
  (:func:`accumulate`: the same for one tensor while its error-compensated gradient is written);
* :func:`selection` — the per-segment threshold compare: counts at once, then the selected values
  and raw index bits straight into the wire tensor, zeroed in the buffer (the residual);
* :func:`decode_rows` — every rank's rows added into the dense output.

Which implementation runs: ``HOROVOD_SAFUSION_KERNELS=torch`` or ``triton`` forces one (the tests
run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``); otherwise Triton for CUDA
tensors when it is installed, PyTorch otherwise. Triton is imported only when chosen.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch

from .blocks import BlockTable, block_table
from . import reference

__all__ = ["BlockTable", "block_table", "segment_stats", "accumulate", "selection", "decode_rows", "uses_triton"]

CHOICES = ("torch", "triton")


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels handle ``t``."""
    forced = os.environ.get("HOROVOD_SAFUSION_KERNELS", "")
    if forced and forced not in CHOICES:
        raise ValueError(f"HOROVOD_SAFUSION_KERNELS must be one of {CHOICES}, got {forced!r}")
    if forced:
        return forced == "triton"
    return t.is_cuda and _triton_installed()


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    """Whether Triton can be imported (looked up once: a search of the path per call would cost
    on every selection pass of a GPU job without Triton)."""
    return importlib.util.find_spec("triton") is not None


def _triton() -> ModuleType:
    from . import triton_ops
    return triton_ops


def segment_stats(flat: torch.Tensor, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per segment ``max |x|`` and ``Σ |x|`` over the finite elements (float64 device tensors), and
    whether every element is finite (a 0-dim bool tensor)."""
    if not uses_triton(flat):
        return reference.segment_stats(flat, table)
    mx, sm, bad = _triton().segment_stats(flat, table)
    segments = table.bounds.numel() - 1
    seg_max = torch.zeros(segments, dtype=mx.dtype, device=mx.device).scatter_reduce_(0, table.segment, mx, "amax")
    seg_sum = torch.zeros(segments, dtype=torch.float64, device=mx.device).index_add_(0, table.segment, sm.double())
    return seg_max.double(), seg_sum, bad.sum() == 0


def accumulate(out: torch.Tensor, grad: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Error feedback into one tensor's segment with its statistics taken on the way (Triton only):
    ``out = grad + scale · residual`` (flat, contiguous), and its ``max |x|``, ``Σ |x|`` over the
    finite elements and whether all are finite, as 0-dim device tensors — so that the selection
    does not read the buffer once more for them."""
    from ..segment import Segments
    table = block_table(Segments(("x",), (out.numel(),), out.device), out.device)
    mx, sm, bad = _triton().segment_stats(out, table, grad=grad.contiguous(), residual=residual, scale=scale)
    return mx.amax().double(), sm.double().sum(), bad.sum() == 0


class _TritonSelection:
    """:class:`reference.Selection` by the two-pass Triton kernel: counts per block now, the wire
    rows written after the caller read the total."""

    def __init__(self, flat: torch.Tensor, thresholds: torch.Tensor, table: BlockTable) -> None:
        self.flat, self.thresholds, self.table = flat, thresholds, table
        self.block_counts = _triton().count_selected(flat, thresholds, table)
        segments = table.bounds.numel() - 1
        self.counts = torch.zeros(segments, dtype=torch.int64, device=flat.device).index_add_(
            0, table.segment, self.block_counts.long())
        self.total = self.counts.sum()

    def take(self, total: int, zero: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from .. import wire
        rows = torch.empty((total, wire.row_bytes(self.flat.dtype)), dtype=torch.uint8, device=self.flat.device)
        target = self.flat if zero else self.flat.clone()
        _triton().write_selected(target, self.thresholds, self.table, self.block_counts, rows)
        values, indices = wire.unpack(rows, self.flat.dtype)
        return values, indices, rows


def selection(flat: torch.Tensor, thresholds: torch.Tensor, table: BlockTable):
    """The elements with ``|x| >= thresholds[segment]`` (``thresholds`` in ``flat``'s dtype, one
    per segment; an exact zero is never selected): ``.counts`` per segment and ``.total`` as device
    tensors now, ``.take(total)`` → ``(values, int64 indices, wire rows)`` once the caller has read
    the total (the one host read of the buffer)."""
    if uses_triton(flat):
        return _TritonSelection(flat, thresholds, table)
    return reference.Selection(flat, thresholds, table)


def decode_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """Add every wire row's value into ``out`` at its index (equal indices add up)."""
    if uses_triton(out):
        _triton().decode_rows(rows, out)
    else:
        reference.decode_rows(rows, out)
