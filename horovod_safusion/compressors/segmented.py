"""Segmented kernels: threshold selection over every segment of a fused buffer in one call.

SAFusion §3.1 (Step-1) selects ``|G_l| ≥ τ_l`` per tensor *before* fusion, and its §5 measured the
per-tensor selection at +4.5–6.2 % over selecting once per fused buffer. Vectorised array
libraries offer two ways to apply one threshold per segment, and both cost per segment or per
element more than the selection itself: a call per segment (a microsecond or more each, with
dozens of tensors per buffer) or the thresholds spread over the whole buffer (a second pass as
long as the buffer). The loops here, compiled by Numba, visit every segment in one call: a
segment costs nanoseconds, an element one comparison, and the selected indices come out
ascending with their count per segment, with no mask and no ``nonzero``.

:class:`NumbaKernels` (CPU, float32 and float64) does these operations on ``a = |x|``, taking the
per-segment arguments as NumPy arrays (other devices and dtypes take the device path,
:mod:`~horovod_safusion.compressors.device`, which reads nothing back to the host):

* :meth:`select` — every segment against its threshold;
* :meth:`select_within` — the same, with counts outside a :class:`Band` corrected while the
  segment is in cache: too many trimmed to the k largest (DGC's hierarchical selection), too few
  compared again at a threshold lowered along an exponential tail;
* :meth:`select_stepped` — the same, with counts outside :class:`Steps` corrected by multiplying
  the threshold up or down a few times (GaussianK's refinement), segment by segment;
* :meth:`reselect` — some segments again: a raised threshold filters the segment's current
  selection (cost ∝ selected; DGC's hierarchical selection), others are compared anew;
* :meth:`select_top` (compiled only) — exactly the k largest per segment, by radix selection;
* :meth:`kth_largest` — the k-th largest of runs of ``a`` or of ``a[idx]`` (exact thresholds,
  DGC's samples, the hierarchical step among a segment's candidates);
* :meth:`exceedance_moments` — count, mean and variance of ``a − η`` over ``a > η`` per segment
  (SIDCo's multi-stage fits).
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

_jit = numba.njit(cache=True, nogil=True)
#: The lowest threshold applied: an exact zero is never selected, however low a threshold falls.
#: (A lowered threshold reached 0 on an LSTM's embedding, whose gradient is zero outside the
#: batch's rows, and the whole tensor was sent, zeros included: a third of the model per step.)
POSITIVE = float(np.finfo(np.float64).tiny)


@_jit
def _compare(a, o, size, t, out, n):  # pragma: no cover - compiled
    """Append the indices ``i`` in ``[o, o + size)`` with ``a[i] >= t`` to ``out[n:]``; the new n.
    (Iterating over the slice, rather than indexing ``a[i]``, compiles to a loop without index
    checks.) Never selects an exact zero."""
    t = max(t, POSITIVE)
    i = o
    for x in a[o:o + size]:
        if x >= t:
            out[n] = i
            n += 1
        i += 1
    return n


@_jit
def _keep(a, src, start, stop, t, dst, n):  # pragma: no cover - compiled
    """Append the indices ``i`` of ``src[start:stop]`` with ``a[i] >= t`` to ``dst[n:]``; the new n.
    ``dst`` may be ``src`` with ``n <= start`` (filtering a run in place). Never keeps an exact zero."""
    t = max(t, POSITIVE)
    for j in range(start, stop):
        if a[src[j]] >= t:
            dst[n] = src[j]
            n += 1
    return n


@_jit
def _select(a, offsets, sizes, thr, out, counts):  # pragma: no cover - compiled
    n = 0
    for s in range(offsets.size):
        first = n
        if thr[s] < np.inf:  # an infinite threshold (an all-zero segment) selects nothing
            n = _compare(a, offsets[s], sizes[s], thr[s], out, n)
        counts[s] = n - first
    return n


@_jit
def _split(hist, lo, hi, k):  # pragma: no cover - compiled
    """In ``hist[lo:hi + 1]`` (zeroed on the way): the highest bin ``b`` such that bins ``>= b``
    hold at least ``k``, and how many bins ``> b`` hold."""
    above, b = 0, lo
    for h in range(hi, lo - 1, -1):
        if above + hist[h] >= k:
            b = h
            break
        above += hist[h]
    hist[lo:hi + 1] = 0
    return b, above


@_jit
def _select_top(bits, offsets, sizes, ks, nbits, out, counts, cand):  # pragma: no cover - compiled
    """Exactly ``min(ks[s], sizes[s])`` indices per segment, of its largest values, by radix
    selection on ``bits`` (the values' IEEE bits as unsigned integers, which order non-negative
    floats as the floats): a histogram of the top 12 bits finds the bin of the k-th largest, one
    more pass takes everything above it and keeps the bin's elements as candidates, and the next
    12 bits split the candidates until the count is exact; candidates whose bits are all equal
    (ties) are taken first come, first served. Only the bins between the lowest and the highest
    one used are scanned and cleared, so a small segment costs little."""
    hist = np.zeros(4096, dtype=np.int64)
    n = 0
    for s in range(offsets.size):
        first, o, size = n, offsets[s], sizes[s]
        need = min(ks[s], size)
        shift = nbits - 12
        lo, hi = 4095, 0
        for x in bits[o:o + size]:
            h = x >> shift
            hist[h] += 1
            lo, hi = min(lo, h), max(hi, h)
        b, above = _split(hist, lo, hi, need)
        c, i = 0, o
        for x in bits[o:o + size]:
            h = x >> shift
            if h > b:
                out[n] = i
                n += 1
            elif h == b:
                cand[c] = i
                c += 1
            i += 1
        need -= above
        while need < c and shift > 0:
            shift = max(shift - 12, 0)
            lo, hi = 4095, 0
            for j in range(c):
                h = (bits[cand[j]] >> shift) & 4095
                hist[h] += 1
                lo, hi = min(lo, h), max(hi, h)
            b, above = _split(hist, lo, hi, need)
            kept = 0
            for j in range(c):
                h = (bits[cand[j]] >> shift) & 4095
                if h > b:
                    out[n] = cand[j]
                    n += 1
                elif h == b:
                    cand[kept] = cand[j]
                    kept += 1
            need, c = need - above, kept
        for j in range(need):
            out[n] = cand[j]
            n += 1
        counts[s] = n - first
    return n


@_jit
def _trim(a, out, first, n, k, scratch, s):  # pragma: no cover - compiled
    """Keep the ``k`` largest of the selection ``out[first:n]`` (DGC's hierarchical selection):
    their minimum becomes the threshold ``scratch[s]``; the new n."""
    c = n - first
    scratch[s] = np.partition(a[out[first:n]], c - k)[c - k]
    return _keep(a, out, first, n, scratch[s], out, first)


@_jit
def _select_within(a, offsets, sizes, thr, ks, low, high, lower, scale, out, counts,
                   chosen):  # pragma: no cover - compiled
    """:func:`_select`, corrected per segment while the segment is in cache: a count above
    ``high[s]`` is trimmed to the ``ks[s]`` largest; one below ``low[s]``, where ``lower[s]``,
    lowers the threshold along an exponential tail of scale ``scale[s]`` (``count ∝ exp(−τ/scale)``,
    so ``τ − scale · ln(k / count)`` selects about k) and compares the segment again, at most
    three times, then trims to ``ks[s]``. ``chosen[s]`` receives the threshold applied in the end
    (in ``a``'s dtype)."""
    n = 0
    for s in range(offsets.size):
        first, t = n, thr[s]
        chosen[s] = t
        if t < np.inf:
            n = _compare(a, offsets[s], sizes[s], t, out, n)
            lowered = False
            if lower[s]:
                tries = 0
                while n - first < low[s] and tries < 3 and t > 0:
                    chosen[s] = max(t - scale[s] * np.log(ks[s] / max(n - first, 1)), 0.0)
                    t = chosen[s]  # rounded to a's dtype
                    n = _compare(a, offsets[s], sizes[s], t, out, first)
                    lowered, tries = True, tries + 1
            if n - first > high[s] or (lowered and n - first > ks[s]):
                n = _trim(a, out, first, n, ks[s], chosen, s)
        counts[s] = n - first
    return n


@_jit
def _select_stepped(a, offsets, sizes, start, top, low, high, up, down, passes, out, counts,
                    chosen):  # pragma: no cover - compiled
    """:func:`_select` from the thresholds ``start`` (float64, unclipped), then per segment, while
    its count is outside ``[low[s], high[s]]`` and at most ``passes`` times, the threshold times
    ``up`` (too many: the selection is filtered) or ``down`` (too few: the segment is compared
    anew); what is applied is clipped to the segment's maximum ``top[s]``, and ``chosen[s]``
    receives the threshold applied in the end (in ``a``'s dtype)."""
    n = 0
    for s in range(offsets.size):
        first, u = n, start[s]
        chosen[s] = min(u, top[s]) if u < np.inf else u
        if u < np.inf:
            t = chosen[s]
            n = _compare(a, offsets[s], sizes[s], t, out, n)
            for _ in range(passes):
                c = n - first
                if low[s] <= c <= high[s]:
                    break
                u *= up if c > high[s] else down
                chosen[s] = min(u, top[s])
                raised, t = chosen[s] >= t, chosen[s]
                if raised:  # a subset of the selection
                    n = _keep(a, out, first, n, t, out, first)
                else:
                    n = _compare(a, offsets[s], sizes[s], t, out, first)
        counts[s] = n - first
    return n


@_jit
def _reselect(a, offsets, sizes, idx, counts, mode, thr, out, new_counts):  # pragma: no cover
    n = pos = 0
    for s in range(offsets.size):
        first, t, c = n, thr[s], counts[s]
        if mode[s] == 0:  # kept
            for j in range(pos, pos + c):
                out[n] = idx[j]
                n += 1
        elif mode[s] == 1:  # a raised threshold: a subset of the current selection
            n = _keep(a, idx, pos, pos + c, t, out, n)
        elif t < np.inf:  # compared anew
            n = _compare(a, offsets[s], sizes[s], t, out, n)
        new_counts[s] = n - first
        pos += c
    return n


@_jit
def _kth_largest(a, starts, lengths, ks, out):  # pragma: no cover - compiled
    for j in range(starts.size):
        n = lengths[j]
        k = min(max(ks[j], 1), n)
        out[j] = np.partition(a[starts[j]:starts[j] + n], n - k)[n - k] if n > 0 else 0.0


@_jit
def _kth_largest_at(a, idx, starts, lengths, ks, out):  # pragma: no cover - compiled
    for j in range(starts.size):
        n = lengths[j]
        k = min(max(ks[j], 1), n)
        out[j] = np.partition(a[idx[starts[j]:starts[j] + n]], n - k)[n - k] if n > 0 else 0.0


@_jit
def _exceedance_moments(a, offsets, sizes, eta, inclusive, count, mean, var):  # pragma: no cover
    for j in range(offsets.size):
        c, s1, s2, e = 0, 0.0, 0.0, eta[j]
        for y in a[offsets[j]:offsets[j] + sizes[j]]:
            x = y - e
            if x > 0.0 or (inclusive and x == 0.0):
                c += 1
                s1 += x
                s2 += x * x
        count[j] = c
        m = s1 / c if c else 0.0
        mean[j], var[j] = m, max(s2 / c - m * m, 0.0) if c else 0.0


@dataclass(frozen=True)
class Steps:
    """Per segment, the counts ``[low, high]`` a selection may end with, corrected by multiplying
    the threshold by ``up`` (too many) or ``down`` (too few) at most ``passes`` times."""

    low: np.ndarray
    high: np.ndarray
    up: float
    down: float
    passes: int


@dataclass(frozen=True)
class Band:
    """Per segment, the counts a selection may end with: ``k`` the target, ``low`` and ``high``
    the band (a count below ``low`` is too few, above ``high`` too many), ``lower`` whether a
    count below ``low`` may lower the threshold, ``scale`` the tail scale for lowering it."""

    k: np.ndarray
    low: np.ndarray
    high: np.ndarray
    lower: np.ndarray
    scale: np.ndarray


class NumbaKernels:
    """The segmented operations on CPU NumPy arrays (views of the tensors' memory), compiled."""

    DTYPES = (torch.float32, torch.float64)

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.offsets, self.sizes = offsets, sizes

    @staticmethod
    def wrap(t: torch.Tensor) -> np.ndarray:
        return t.numpy()

    def segment_max(self, a: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(a, self.offsets).astype(np.float64)

    def segment_sum(self, a: np.ndarray) -> np.ndarray:
        """Per-segment sums in ``a``'s precision, returned as float64: a float32 ``reduceat`` into
        a float64 accumulator converts every element and is several times slower."""
        return np.add.reduceat(a, self.offsets, dtype=a.dtype).astype(np.float64)

    def select(self, a: np.ndarray, thr: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``a >= thr[s]`` in every segment ``s``: ascending indices (a view of ``out``, whose
        length bounds the count) and the count per segment."""
        counts = np.empty(len(self.offsets), dtype=np.int64)
        n = _select(a, self.offsets, self.sizes, thr, out, counts)
        return out[:n], counts

    def select_top(self, a: np.ndarray, ks: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """Indices of the ``ks[s]`` largest of each segment ``s`` of ``a`` (``a >= 0``), exactly
        that many (ties: the first ones); ``scratch`` holds candidates (as long as a segment)."""
        counts = np.empty(len(self.offsets), dtype=np.int64)
        bits = a.view(np.uint32 if a.dtype == np.float32 else np.uint64)
        n = _select_top(bits, self.offsets, self.sizes, ks, 8 * a.itemsize, out, counts, scratch)
        return out[:n]

    def select_within(self, a: np.ndarray, thr: np.ndarray, band: Band,
                      out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`select` with the counts held in ``band``: the indices, the counts and the
        threshold each segment ended with."""
        counts = np.empty(len(self.offsets), dtype=np.int64)
        chosen = thr.copy()
        n = _select_within(a, self.offsets, self.sizes, thr, band.k, band.low, band.high, band.lower,
                           band.scale, out, counts, chosen)
        return out[:n], counts, chosen

    def select_stepped(self, a: np.ndarray, start: np.ndarray, steps: Steps, top: np.ndarray,
                       out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`select` from the unclipped float64 thresholds ``start`` (infinite: the segment
        selects nothing), with the counts corrected by ``steps`` and what is applied clipped to
        ``top``: the indices, the counts and the threshold each segment ended with."""
        counts = np.empty(len(self.offsets), dtype=np.int64)
        chosen = top.copy()
        n = _select_stepped(a, self.offsets, self.sizes, start, top, steps.low, steps.high, steps.up, steps.down,
                            steps.passes, out, counts, chosen)
        return out[:n], counts, chosen

    def reselect(self, a: np.ndarray, idx: np.ndarray, counts: np.ndarray, mode: np.ndarray, thr: np.ndarray,
                 out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The selection ``idx`` (ascending, in runs of ``counts``) with segment ``s`` kept
        (``mode[s] == 0``), filtered to ``a >= thr[s]`` (1) or compared anew (2)."""
        new_counts = np.empty_like(counts)
        n = _reselect(a, self.offsets, self.sizes, idx, counts, mode, thr, out, new_counts)
        return out[:n], new_counts

    @staticmethod
    def kth_largest(a: np.ndarray, starts: np.ndarray, lengths: np.ndarray, ks: np.ndarray,
                    idx: np.ndarray | None = None) -> np.ndarray:
        """The ``ks[j]``-th largest (clamped to ``[1, lengths[j]]``) of run ``j`` of ``a`` — or of
        ``a[idx]`` when ``idx`` is given — starting at ``starts[j]``; 0 for an empty run."""
        out = np.empty(len(starts), dtype=np.float64)
        if idx is None:
            _kth_largest(a, starts, lengths, ks, out)
        else:
            _kth_largest_at(a, idx, starts, lengths, ks, out)
        return out

    def exceedance_moments(self, a: np.ndarray, segs: np.ndarray, eta: np.ndarray,
                           inclusive: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per segment ``segs[j]``: count, mean and (population) variance of ``a − eta[j]`` over
        the elements with ``a > eta[j]`` (``>=`` if ``inclusive``), in float64."""
        count, mean, var = (np.empty(len(segs), dtype=t) for t in (np.int64, np.float64, np.float64))
        _exceedance_moments(a, self.offsets[segs], self.sizes[segs], eta.astype(np.float64), inclusive,
                            count, mean, var)
        return count, mean, var

    @staticmethod
    def to_indices(idx: np.ndarray) -> torch.Tensor:
        """A tensor of its own (``idx`` may be scratch memory that the next selection reuses)."""
        if not len(idx):  # torch.from_numpy gives an empty array stride 0, which breaks byte views
            return torch.empty(0, dtype=torch.int64)
        return torch.from_numpy(idx.astype(np.int64, copy=True))


def warm_up() -> None:
    """Compile every kernel for float32 and float64 now. Numba caches compiled kernels beside this
    module, so the install does this once and training's first step does not pay for it (tens of
    seconds on a small CPU)."""
    offsets, sizes = np.array([0, 6], dtype=np.int64), np.array([6, 4], dtype=np.int64)
    ks = np.array([2, 1], dtype=np.int64)
    for dtype in (np.float32, np.float64):
        a = np.linspace(0, 1, 10).astype(dtype)
        kernels, out, scratch = NumbaKernels(offsets, sizes), np.empty(10, dtype=np.int64), np.empty(10, dtype=np.int64)
        thr = np.array([0.5, 2.0], dtype=dtype)
        idx, counts = kernels.select(a, thr, out)
        kernels.reselect(a, idx.copy(), counts, np.array([1, 2], dtype=np.int8), thr, scratch)
        band = Band(k=ks, low=ks / 2 - 1, high=2.0 * (ks + 1), lower=np.array([True, True]), scale=np.ones(2))
        kernels.select_within(a, thr, band, out)
        kernels.select_stepped(a, np.array([0.5, 2.0]), Steps(ks / 2, 2.0 * ks, 1.3, 0.7, 3), np.ones(2, dtype=dtype), out)
        kernels.select_top(a, ks, out, scratch)
        kernels.kth_largest(a, offsets, sizes, ks)
        kernels.kth_largest(a, offsets, sizes, ks, idx=np.arange(10, dtype=np.int64))
        kernels.exceedance_moments(a, np.arange(2), np.zeros(2), True)
