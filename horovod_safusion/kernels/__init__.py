"""The kernels of the per-buffer data path: Numba on the host, Triton on a GPU, and PyTorch
everywhere else (the reference the others are tested against).

``cuda/README.md`` points here: kernels must be importable by the package, so they live in it.
The operations of SAFusion's per-buffer data path (§3.1 Steps 1–3):

* :func:`accumulate` — error feedback into one tensor's segment, ``x = g + scale · r`` in place,
  a non-finite gradient element dropped and counted (the Triton kernel also takes the segment's
  ``max |x|`` and ``Σ |x|`` on the way); :func:`segment_stats` takes them for a whole buffer;
* :func:`selection` — the per-segment threshold compare: counts at once, then the selected values
  and raw index bits straight into the wire tensor, zeroed in the buffer (the residual);
* :func:`scatter_add`, :func:`decode_rows` — every rank's values added into the gradients of the
  buffer's parameters, one tensor per segment, so the reduced buffer needs no memory of its own;
* :func:`accumulator_at` — a rank's accumulator at indices the job agreed on (ExDyna's and
  ScaleCom's all-reduce).

Which path runs: the host path (:mod:`.host`, compiled by Numba) for CPU float32/float64 buffers
unless ``HOROVOD_SAFUSION_DEVICE_PATH=1`` sends them down the device path (tests, benchmarks).
On the device path ``HOROVOD_SAFUSION_KERNELS=torch`` or ``triton`` forces one implementation (the
tests run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``); otherwise Triton for
CUDA tensors when it is installed, PyTorch otherwise. Triton is imported only when chosen. Both
variables are read once, at the first selection (:func:`paths`), not on every call.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

import torch

import numpy as np

from .blocks import BlockTable, block_table
from . import host, reference

__all__ = ["BlockTable", "block_table", "segment_stats", "accumulate", "selection", "scatter_add", "decode_rows",
           "accumulator_at",
           "uses_triton", "on_host", "paths", "reread", "Paths", "to_device", "constant"]

CHOICES = ("torch", "triton")


@dataclass(frozen=True)
class Paths:
    """Which path and which kernels run, read from the environment once (:func:`paths`):
    ``device_path`` — ``HOROVOD_SAFUSION_DEVICE_PATH=1`` sends CPU float32/float64 buffers down
    the device path too; ``kernels`` — ``HOROVOD_SAFUSION_KERNELS``, ``""`` (Triton for CUDA
    tensors where it is installed) or one of :data:`CHOICES`."""

    device_path: bool
    kernels: str


@functools.lru_cache(maxsize=None)
def paths() -> Paths:
    """The :class:`Paths` of this process, read at the first selection (set the variables before
    it; :func:`reread` reads them again)."""
    forced = os.environ.get("HOROVOD_SAFUSION_KERNELS", "")
    if forced and forced not in CHOICES:
        raise ValueError(f"HOROVOD_SAFUSION_KERNELS must be one of {CHOICES}, got {forced!r}")
    return Paths(device_path=os.environ.get("HOROVOD_SAFUSION_DEVICE_PATH", "0") == "1", kernels=forced)


def reread() -> Paths:
    """Read the variables of :class:`Paths` again (tests and benchmarks that switch paths)."""
    paths.cache_clear()
    return paths()


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` (a buffer, a gradient) takes the host path: CPU float32 or float64, and
    ``HOROVOD_SAFUSION_DEVICE_PATH`` is not ``1``."""
    return host.handles(t) and not paths().device_path


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array as a tensor on ``device`` without making the host wait: on CUDA through
    pinned memory, non-blocking (a copy from pageable memory waits for the device's stream, as a
    value read back does); elsewhere an ordinary copy."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def constant(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """:func:`to_device` of a small host array that stays the same from step to step (a layout's
    offsets, sizes, targets ``k``, a band's bounds, a sample's sizes): copied once per content and
    device, then reused. The device path needs such arrays at every selection; on a GPU each copy
    costs the host a pinned allocation and a copy call, host time that adds to every buffer's
    selection. The tensor is shared: read it, never write it."""
    a = np.ascontiguousarray(a)
    return _constant(a.dtype.str, a.shape, a.tobytes(), device)


@functools.lru_cache(maxsize=1024)
def _constant(dtype: str, shape: tuple[int, ...], data: bytes, device: torch.device) -> torch.Tensor:
    return to_device(np.frombuffer(data, dtype=dtype).reshape(shape).copy(), device)


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels handle ``t``."""
    forced = paths().kernels
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


def accumulate(out: torch.Tensor, grad: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor | None,
               stats: bool = False) -> tuple:
    """Error feedback into one tensor's segment of a sparse step, on the device path:
    ``out = grad + scale · residual`` (flat, contiguous; ``residual`` may be ``out`` itself or
    ``None``); a non-finite gradient element is dropped (``out`` keeps ``scale · residual``
    there). Returns the number of dropped elements as a 0-dim device tensor, and with ``stats``
    (Triton only) also ``max |out|`` and ``Σ |out|`` as 0-dim float64 device tensors — so that
    the selection does not read the buffer once more for them."""
    if not uses_triton(out):
        return reference.accumulate(out, grad, residual, scale)
    from ..segment import Segments
    table = block_table(Segments(("x",), (out.numel(),), out.device), out.device)
    mx, sm, bad = _triton().segment_stats(out, table, grad=grad.contiguous(),
                                          residual=out if residual is None else residual, scale=scale,
                                          keep=residual is not None)
    dropped = bad.sum()
    return (dropped, mx.amax().double(), sm.double().sum()) if stats else (dropped,)


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


def scatter_add(targets: tuple[torch.Tensor, ...], bounds: np.ndarray, indices: torch.Tensor,
                values: torch.Tensor) -> None:
    """Add ``values`` at buffer-relative ``indices`` into ``targets``, the flat tensors of the
    buffer's segments (segment ``s`` holds indices ``[bounds[s], bounds[s + 1])``); equal indices
    add up."""
    if indices.numel() == 0:
        return
    t = targets[0]
    if on_host(t):
        host.scatter_add(targets, bounds, indices, values)
    elif uses_triton(t):
        _triton().scatter_add(values, indices, targets, bounds)
    else:
        reference.scatter_add(targets, bounds, indices, values)


def accumulator_at(agreed: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                   residual: torch.Tensor | None) -> torch.Tensor:
    """A rank's accumulator — ``values`` selected at ``indices`` plus its ``residual`` (the
    buffer's unselected rest, or ``None``) — at the ``agreed`` indices; both index lists
    ascending, int64."""
    if on_host(values) and (residual is None or residual.is_contiguous()):
        return host.accumulator_at(agreed, indices, values, residual)
    return reference.accumulator_at(agreed, indices, values, residual)


def decode_rows(rows: torch.Tensor, targets: tuple[torch.Tensor, ...], bounds: np.ndarray) -> None:
    """Add every wire row's value into ``targets`` at its index (equal indices add up)."""
    if rows.shape[0] == 0:
        return
    t = targets[0]
    if uses_triton(t) and not on_host(t):
        _triton().decode_rows(rows, targets, bounds)
        return
    from .. import wire
    values, indices = wire.unpack(rows, t.dtype)
    scatter_add(targets, bounds, indices, values)
