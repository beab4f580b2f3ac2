"""Triton kernels of the GPU path: segment statistics, threshold selection into the wire, decode.

SAFusion §4 runs selection on the GPU beside NCCL; §3.1 Step-1 selects ``|G_l| ≥ τ_l`` per tensor
and Steps 2–3 gather (value, index) pairs and add them up. Each kernel here does in one or two
passes what the PyTorch path (:mod:`~horovod_safusion.kernels.reference`, the reference and
fallback) does in several, and none reads anything back to the host:

* :func:`segment_stats` — per block of a segment, ``max |x|`` and ``Σ |x|`` (float32 or wider
  accumulation), and a count of non-finite elements; optionally fused with error feedback,
  ``x = g + scale · r`` written on the way (the residual add of the gradient hook), a non-finite
  gradient element dropped and counted;
* :func:`count_selected` / :func:`write_selected` — the threshold compare in two passes: counts per
  block, then (after the one host read that sizes the wire) every selected element's value and raw
  index bits written straight into its wire row, ascending, and zeroed in the buffer (which then
  holds the residual);
* :func:`decode_rows`, :func:`scatter_add` — every rank's rows (or values at indices) added with
  atomic adds (equal indices add up, as ``index_add_`` does) straight into the gradients of the
  buffer's parameters: each row finds its segment by binary search over the segments' bounds and
  writes through a table of the segments' addresses, so the reduced buffer needs no memory of its
  own.

A wire row is ``[value bytes | int32 index bytes]`` (:mod:`horovod_safusion.wire`): 6, 8 or 12
bytes, so rows are read and written as 16-bit words, which are aligned in every row. Importing this
module imports Triton; the package imports it only for CUDA tensors or when
``HOROVOD_SAFUSION_KERNELS=triton`` asks for it (the tests, with ``TRITON_INTERPRET=1`` on CPU).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import constant
from .blocks import BlockTable

_WORD_INT = {1: tl.int16, 2: tl.int32, 4: tl.int64}  # value words → the integer of the value's width


@triton.jit
def _stats_kernel(x_ptr, g_ptr, r_ptr, scale_ptr, seg_ptr, start_ptr, stop_ptr, max_ptr, sum_ptr, bad_ptr,
                  ACC: tl.constexpr, FUSED: tl.constexpr, KEEP: tl.constexpr, SCALED: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start, stop = tl.load(start_ptr + pid), tl.load(stop_ptr + pid)
    offs = start + tl.arange(0, BLOCK)
    m = offs < stop
    if FUSED:  # in the accumulation precision, rounded once (half-precision arithmetic is not
        # portable: Triton's interpreter has no bfloat16 arithmetic)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(ACC)
        ok = (g == g) & (tl.abs(g) != float("inf"))  # a non-finite gradient element is dropped
        x = tl.where(ok, g, 0.0)
        if KEEP:  # r_ptr may be x_ptr: every element is read before it is written
            r = tl.load(r_ptr + offs, mask=m, other=0.0).to(ACC)
            if SCALED:
                r = r * tl.load(scale_ptr).to(ACC)
            x = x + r
        fine = (x == x) & (tl.abs(x) != float("inf"))  # a residual rescaled out of range: cleared
        x = tl.where(fine, x, 0.0).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + offs, x, mask=m)
        bad = ~ok | ~fine
        # the statistics of what was written: where the gradient was dropped, x = scale · r counts
        a = tl.where(m, tl.abs(x.to(ACC)), 0.0)
    else:
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        a = tl.abs(x.to(ACC))
        bad = (a != a) | (a == float("inf"))
        a = tl.where(m & ~bad, a, 0.0)
    tl.store(max_ptr + pid, tl.max(a, axis=0))
    tl.store(sum_ptr + pid, tl.sum(a, axis=0))
    tl.store(bad_ptr + pid, tl.sum((bad & m).to(tl.int32), axis=0))


@triton.jit
def _selected(x_ptr, thr_ptr, seg_ptr, start_ptr, stop_ptr, pid, BLOCK: tl.constexpr):
    start, stop = tl.load(start_ptr + pid), tl.load(stop_ptr + pid)
    offs = start + tl.arange(0, BLOCK)
    m = offs < stop
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    a = tl.abs(x)
    t = tl.load(thr_ptr + tl.load(seg_ptr + pid))
    return x, offs, m & (a >= t) & (a > 0)  # an exact zero is never selected


@triton.jit
def _count_kernel(x_ptr, thr_ptr, seg_ptr, start_ptr, stop_ptr, count_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    _, _, sel = _selected(x_ptr, thr_ptr, seg_ptr, start_ptr, stop_ptr, pid, BLOCK)
    tl.store(count_ptr + pid, tl.sum(sel.to(tl.int32), axis=0))


@triton.jit
def _write_kernel(x_ptr, thr_ptr, seg_ptr, start_ptr, stop_ptr, first_ptr, words_ptr,
                  VALUE_WORDS: tl.constexpr, WORD_INT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    x, offs, sel = _selected(x_ptr, thr_ptr, seg_ptr, start_ptr, stop_ptr, pid, BLOCK)
    s = sel.to(tl.int32)
    row = tl.load(first_ptr + pid) + tl.cumsum(s, axis=0) - s  # ascending: rows in element order
    base = row.to(tl.int64) * (VALUE_WORDS + 2)
    bits = x.to(WORD_INT, bitcast=True).to(tl.int64)
    for w in tl.static_range(VALUE_WORDS):
        tl.store(words_ptr + base + w, ((bits >> (16 * w)) & 0xFFFF).to(tl.int16), mask=sel)
    index = offs.to(tl.int64)
    tl.store(words_ptr + base + VALUE_WORDS, (index & 0xFFFF).to(tl.int16), mask=sel)
    tl.store(words_ptr + base + VALUE_WORDS + 1, ((index >> 16) & 0xFFFF).to(tl.int16), mask=sel)
    tl.store(x_ptr + offs, tl.zeros_like(x), mask=sel)  # sent: what stays is the residual


@triton.jit
def _segment_of(index, mask, bounds_ptr, segments, LOG: tl.constexpr):
    """The segment ``s`` with ``bounds[s] <= index < bounds[s + 1]`` (binary search, LOG steps)."""
    lo = tl.zeros(index.shape, dtype=tl.int64)
    hi = tl.zeros(index.shape, dtype=tl.int64) + segments
    for _ in tl.static_range(LOG):
        mid = (lo + hi) // 2
        go = index >= tl.load(bounds_ptr + mid, mask=mask, other=0)
        lo, hi = tl.where(go, mid, lo), tl.where(go, hi, mid)
    return lo


@triton.jit
def _add_at(index, value, mask, bounds_ptr, ptrs_ptr, segments, OUT_TYPE: tl.constexpr, LOG: tl.constexpr):
    """``value`` added at buffer index ``index`` of the segments' own tensors (their addresses
    in ``ptrs_ptr``), with atomic adds (equal indices add up, as ``index_add_`` does)."""
    seg = _segment_of(index, mask, bounds_ptr, segments, LOG)
    base = tl.load(bounds_ptr + seg, mask=mask, other=0)
    address = tl.load(ptrs_ptr + seg, mask=mask, other=0)
    target = address.to(tl.pointer_type(OUT_TYPE))
    tl.atomic_add(target + (index - base), value.to(OUT_TYPE), mask=mask)


@triton.jit
def _scatter_kernel(values_ptr, index_ptr, n, bounds_ptr, ptrs_ptr, segments, OUT_TYPE: tl.constexpr,
                    LOG: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < n
    index = tl.load(index_ptr + r, mask=m, other=0).to(tl.int64)
    value = tl.load(values_ptr + r, mask=m, other=0.0)
    _add_at(index, value, m, bounds_ptr, ptrs_ptr, segments, OUT_TYPE, LOG)


@triton.jit
def _decode_kernel(words_ptr, rows, bounds_ptr, ptrs_ptr, segments, VALUE_WORDS: tl.constexpr,
                   WORD_INT: tl.constexpr, VALUE_TYPE: tl.constexpr, OUT_TYPE: tl.constexpr, LOG: tl.constexpr,
                   BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < rows
    base = r.to(tl.int64) * (VALUE_WORDS + 2)
    bits = tl.zeros([BLOCK], dtype=tl.int64)
    for w in tl.static_range(VALUE_WORDS):
        word = tl.load(words_ptr + base + w, mask=m, other=0).to(tl.int64) & 0xFFFF
        bits = bits | (word << (16 * w))
    value = bits.to(WORD_INT).to(VALUE_TYPE, bitcast=True)
    lo = tl.load(words_ptr + base + VALUE_WORDS, mask=m, other=0).to(tl.int64) & 0xFFFF
    hi = tl.load(words_ptr + base + VALUE_WORDS + 1, mask=m, other=0).to(tl.int64) & 0xFFFF
    index = (lo | (hi << 16)).to(tl.int32).to(tl.int64)  # the int32's bits, sign included
    _add_at(index, value, m, bounds_ptr, ptrs_ptr, segments, OUT_TYPE, LOG)


def _value_words(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() // 2


def segment_stats(flat: torch.Tensor, table: BlockTable, grad: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, scale: torch.Tensor | None = None, keep: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: ``max |x|``, ``Σ |x|`` (float32, float64 for float64 buffers) over its finite
    elements, and how many are not finite. With ``grad`` (flat, like ``flat``), the error feedback
    ``flat = grad + scale · residual`` (``residual`` may be ``flat`` itself; none unless ``keep``)
    is written on the way, a non-finite gradient element dropped and counted as not finite."""
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    mx = torch.empty(table.blocks, dtype=acc, device=flat.device)
    sm = torch.empty_like(mx)
    bad = torch.empty(table.blocks, dtype=torch.int32, device=flat.device)
    fused = grad is not None
    _stats_kernel[(table.blocks,)](flat, grad if fused else flat, residual if residual is not None else flat,
                                   scale if scale is not None else mx, table.segment, table.start, table.stop,
                                   mx, sm, bad, ACC=_OUT_TYPE[acc], FUSED=fused, KEEP=fused and keep,
                                   SCALED=scale is not None, BLOCK=table.block)
    return mx, sm, bad


def count_selected(flat: torch.Tensor, thresholds: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """Per block, how many elements satisfy ``|x| >= threshold`` of its segment (and are not 0);
    ``thresholds`` in ``flat``'s dtype."""
    counts = torch.empty(table.blocks, dtype=torch.int32, device=flat.device)
    _count_kernel[(table.blocks,)](flat, thresholds, table.segment, table.start, table.stop, counts,
                                   BLOCK=table.block)
    return counts


def write_selected(flat: torch.Tensor, thresholds: torch.Tensor, table: BlockTable, block_counts: torch.Tensor,
                   rows: torch.Tensor) -> None:
    """Write the selected elements into ``rows`` (the wire, ``(total, row_bytes)`` uint8, sized
    from ``block_counts``' sum) in ascending order, and zero them in ``flat``."""
    first = torch.cumsum(block_counts, 0, dtype=torch.int64) - block_counts
    vw = _value_words(flat.dtype)
    _write_kernel[(table.blocks,)](flat, thresholds, table.segment, table.start, table.stop, first,
                                   rows.view(torch.int16), VALUE_WORDS=vw, WORD_INT=_WORD_INT[vw],
                                   BLOCK=table.block)


_OUT_TYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
             torch.float64: tl.float64}


class _Targets:
    """The segments' tensors as the kernels address them: their bounds and addresses on the
    device, and a float32 stand-in for half precision (atomic adds of bfloat16 are not available
    on every GPU), added into the segments once at the end."""

    def __init__(self, targets: tuple[torch.Tensor, ...], bounds: np.ndarray) -> None:
        device = targets[0].device
        self.targets, self.dtype = targets, targets[0].dtype
        self.half = targets[0].element_size() < 4
        if self.half:
            self.acc = torch.zeros(int(bounds[-1]), dtype=torch.float32, device=device)
            self.bounds, addresses = np.array([0, int(bounds[-1])]), [self.acc.data_ptr()]
        else:
            self.bounds, addresses = bounds, [t.data_ptr() for t in targets]
        self.segments = len(self.bounds) - 1
        self.log = int(np.ceil(np.log2(self.segments))) if self.segments > 1 else 0
        self.bounds_t = constant(np.asarray(self.bounds, dtype=np.int64), device)
        self.ptrs = constant(np.asarray(addresses, dtype=np.int64), device)
        self.out_type = _OUT_TYPE[torch.float32 if self.half else self.dtype]

    def finish(self, bounds: np.ndarray) -> None:
        if self.half:
            for t, lo, hi in zip(self.targets, bounds[:-1].tolist(), bounds[1:].tolist()):
                t.add_(self.acc[lo:hi].to(t.dtype))


def scatter_add(values: torch.Tensor, indices: torch.Tensor, targets: tuple[torch.Tensor, ...], bounds: np.ndarray,
                block: int = 1024) -> None:
    """``values`` at buffer-relative ``indices`` added into the segments' tensors ``targets``."""
    n = indices.numel()
    if n == 0:
        return
    t = _Targets(targets, bounds)
    _scatter_kernel[(triton.cdiv(n, block),)](values.contiguous(), indices.contiguous(), n, t.bounds_t, t.ptrs,
                                              t.segments, OUT_TYPE=t.out_type, LOG=t.log, BLOCK=block)
    t.finish(bounds)


def decode_rows(rows: torch.Tensor, targets: tuple[torch.Tensor, ...], bounds: np.ndarray, block: int = 1024) -> None:
    """Add every row's value into the segments' tensors ``targets`` at its index (the rows'
    values have the targets' dtype)."""
    n = rows.shape[0]
    if n == 0:
        return
    vw = _value_words(targets[0].dtype)
    t = _Targets(targets, bounds)
    _decode_kernel[(triton.cdiv(n, block),)](rows.view(torch.int16), n, t.bounds_t, t.ptrs, t.segments,
                                             VALUE_WORDS=vw, WORD_INT=_WORD_INT[vw], VALUE_TYPE=_OUT_TYPE[t.dtype],
                                             OUT_TYPE=t.out_type, LOG=t.log, BLOCK=block)
    t.finish(bounds)
