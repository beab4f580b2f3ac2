"""The PyTorch path of the GPU kernels: the reference the Triton kernels are tested against, and
the fallback where Triton is not installed. No operation here reads a value back to the host:
per-segment results come from prefix sums and gathers at host-known positions, and the
compaction is ``nonzero_static`` with the size the caller read once (SAFusion §3.1 Steps 1–3).
"""
from __future__ import annotations

import torch

from .. import wire
from .blocks import BlockTable


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _per_segment(x: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """Per segment, the sum of ``x`` (exact for integer ``x``): a prefix sum read at the segments'
    bounds."""
    c = torch.cumsum(x, 0)
    c = torch.cat([c.new_zeros(1), c])
    return c[table.bounds[1:]] - c[table.bounds[:-1]]


def segment_stats(flat: torch.Tensor, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per segment ``max |x|`` and ``Σ |x|`` over the finite elements (float64), and whether every
    element of the buffer is finite (0-dim bool)."""
    a = flat.abs().to(_acc(flat.dtype))
    ok = torch.isfinite(a)
    a = torch.where(ok, a, 0.0)
    segments = table.bounds.numel() - 1
    mx = torch.zeros(segments, dtype=a.dtype, device=a.device).scatter_reduce_(0, table.seg_ids(), a, "amax")
    return mx.double(), _per_segment(a.double(), table), ok.all()


def moments(flat: torch.Tensor, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment ``Σ x`` and ``Σ x²`` (float64)."""
    x = flat.double()
    return _per_segment(x, table), _per_segment(x * x, table)


def exceedances(a: torch.Tensor, eta: torch.Tensor, table: BlockTable, inclusive: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per segment: count, sum and sum of squares of ``a − eta`` over ``a > eta`` (``>=``), float64."""
    y = a.double() - eta[table.seg_ids()]
    w = (y >= 0) if inclusive else (y > 0)
    y = torch.where(w, y, 0.0)
    return _per_segment(w.double(), table), _per_segment(y, table), _per_segment(y * y, table)


#: Bits of a magnitude's IEEE pattern ranked per radix pass (the host's radix, ``segmented._radix``, takes as many).
RADIX_BITS = 12
#: On CUDA a pass ranks up to 16 bits while the histograms (groups × bins) stay within 2^HISTOGRAM_BITS
#: counters: the first pass's atomic adds then spread over 16 times as many bins (a tensor's
#: magnitudes share a few exponents, and 12 bits put most of them in a few bins), and a float32
#: takes two passes instead of three (docs/benchmarks.md, "Every compressor's device path on the GPU").
CUDA_RADIX_BITS, HISTOGRAM_BITS = 16, 22
_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def kth_largest(values: torch.Tensor, groups: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """Per group ``g``, the ``ks[g]``-th largest ``|values|`` among the elements with
    ``groups == g`` (``ks`` int64, clamped by the caller to ``[1, the group's size]``; an empty
    group gives 0), in ``values``' dtype, exactly: a radix selection on the magnitudes' IEEE bits
    (which order them as the floats do), :data:`RADIX_BITS` bits per pass (on CUDA up to
    :data:`CUDA_RADIX_BITS`) — a histogram per group
    of the elements whose higher bits match the bins found so far, for every group at once, with
    no boolean mask and no ``bincount`` (both read a size back to the host). The host path's
    ``NumbaKernels.kth_largest`` selects the same way, segment by segment."""
    count = ks.numel()
    radix = RADIX_BITS
    if values.is_cuda:
        radix = max(RADIX_BITS, min(CUDA_RADIX_BITS, HISTOGRAM_BITS - (count + 1).bit_length()))
    nbits = 8 * values.element_size() - 1
    wide = torch.int64 if nbits > 31 else torch.int32  # float32 and narrower: int32 throughout
    bits = values.view(_SIGNED[values.element_size()]).to(wide) & ((1 << nbits) - 1)
    groups = groups.to(wide if (count + 1) << radix < 2 ** 31 else torch.int64)
    prefix = torch.zeros(count, dtype=wide, device=values.device)
    need = ks.to(torch.int64)
    one = torch.ones(1, dtype=torch.int64, device=values.device).expand(values.numel())
    shift = nbits
    while shift > 0:
        width = min(radix, shift)
        shift -= width
        bins = 1 << width
        high = shift + width  # bits at and above it are fixed by the prefix
        # an element whose higher bits left its group's prefix is counted in a spare group, in
        # the bin of its digit: with one spare bin, on a GPU, nearly every element's atomic add
        # went to the same address, one after another
        owner = torch.where((bits >> high) == (prefix >> high)[groups], groups, count)
        keys = ((bits >> shift) & (bins - 1)).to(groups.dtype).add_(owner, alpha=bins)
        hist = torch.zeros((count + 1) * bins, dtype=torch.int64, device=values.device)
        hist = hist.index_add_(0, keys, one)[:count * bins].view(count, bins)
        at_or_above = hist.flip(1).cumsum(1).flip(1)  # per bin b: elements in bins >= b
        b = torch.clamp((at_or_above >= need[:, None]).sum(1) - 1, min=0)  # the highest b holding the k-th
        above = torch.cat([at_or_above, at_or_above.new_zeros(count, 1)], 1).gather(1, (b + 1)[:, None]).squeeze(1)
        need = need - above
        prefix = prefix | (b.to(wide) << shift)
    return prefix.to(_SIGNED[values.element_size()]).view(values.dtype)


class Selection:
    """``|x| >= thresholds[segment]`` (and not an exact zero) over one buffer: counts now, the
    selected elements once the caller knows how many there are."""

    def __init__(self, flat: torch.Tensor, thresholds: torch.Tensor, table: BlockTable) -> None:
        self.flat, self.table = flat, table
        a = flat.abs()
        self.mask = (a >= thresholds[table.seg_ids()]) & (a > 0)
        self.counts = _per_segment(self.mask.to(torch.int64), table)
        self.total = self.counts.sum()

    def take(self, total: int, zero: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(values, int64 indices, wire rows)`` of the ``total`` selected elements, ascending;
        with ``zero`` they are cleared in the buffer, which then holds the residual."""
        idx = torch.nonzero_static(self.mask, size=total).squeeze(1)
        values = self.flat[idx]
        if zero:
            self.flat.index_fill_(0, idx, 0)
        return values, idx, wire.pack(values, idx)


def accumulate(out: torch.Tensor, grad: torch.Tensor, residual: torch.Tensor | None,
               scale: torch.Tensor | None) -> tuple[torch.Tensor]:
    """:func:`horovod_safusion.kernels.accumulate` in PyTorch: ``out = grad + scale · residual``
    with non-finite gradient elements dropped (and a residual rescaled out of range cleared);
    the dropped count as a 0-dim device tensor."""
    ok = torch.isfinite(grad)
    if residual is None:
        out.zero_()
    elif residual is not out:
        out.copy_(residual)
    if scale is not None:
        out.mul_(scale)
    out.add_(torch.where(ok, grad, 0))
    torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)
    return ((~ok).sum(),)


def scatter_add(targets: tuple[torch.Tensor, ...], bounds, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Values at buffer-relative indices added into the segments' tensors, through one dense
    buffer of the buffer's size (the reference: simple, and it reads nothing back)."""
    flat = torch.zeros(int(bounds[-1]), dtype=targets[0].dtype, device=targets[0].device)
    flat.index_add_(0, indices, values.to(flat.dtype))
    for t, lo, hi in zip(targets, bounds[:-1].tolist(), bounds[1:].tolist()):
        t.add_(flat[lo:hi])


def accumulator_at(agreed: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                   residual: torch.Tensor | None) -> torch.Tensor:
    """The accumulator (``values`` selected at ``indices``, plus ``residual``) at ``agreed``; both
    index lists ascending, int64."""
    if indices.numel():
        at = torch.searchsorted(indices, agreed).clamp(max=indices.numel() - 1)
        own = torch.where(indices[at] == agreed, values[at], 0)
    else:
        own = torch.zeros(agreed.numel(), dtype=values.dtype, device=values.device)
    return own + residual[agreed] if residual is not None else own
