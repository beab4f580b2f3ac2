"""Segmented kernels: threshold selection over every segment of a fused buffer in one call.

SAFusion §3.1 (Step-1) selects ``|G_l| ≥ τ_l`` per tensor *before* fusion, and its §5 measured the
per-tensor selection at +4.5–6.2 % over selecting once per fused buffer. Vectorised array
libraries offer two ways to apply one threshold per segment, and both cost per segment or per
element more than the selection itself: a call per segment (a microsecond or more each, with
dozens of tensors per buffer) or the thresholds spread over the whole buffer (a second pass as
long as the buffer). The loops here, compiled by Numba, visit every segment in one call: a
segment costs nanoseconds, an element one comparison, and the selected indices come out
ascending with their count per segment, with no mask and no ``nonzero``.

:class:`NumbaKernels` (CPU, float32 and float64) does these operations on ``|x|``, taken element
by element from the buffer itself (no copy of ``|x|``), with the per-segment arguments as NumPy
arrays (other devices and dtypes take the device path, :mod:`~horovod_safusion.compressors.device`,
which reads nothing back to the host). Selected indices go into an :class:`IndexScratch` that the
kernels grow when a selection runs past it, so it is as long as the largest selection, not as the
buffer:

* :meth:`select` — every segment against its threshold;
* :meth:`select_within` — the same, with counts outside a :class:`Band` corrected while the
  segment is in cache: too many trimmed to the k largest (DGC's hierarchical selection), too few
  compared again at a threshold lowered along an exponential tail;
* :meth:`select_stepped` — the same, with counts outside :class:`Steps` corrected by multiplying
  the threshold up or down a few times (GaussianK's refinement), segment by segment;
* :meth:`reselect` — some segments again: a raised threshold filters the segment's current
  selection (cost ∝ selected; DGC's hierarchical selection), others are compared anew;
* :meth:`select_top` (compiled only) — exactly the k largest per segment, by radix selection
  (:func:`_radix`);
* :meth:`kth_largest` — the k-th largest ``|x|`` of runs of ``x`` (exact thresholds, by the same
  radix selection, which copies no more of the run than the bin holding the k-th) or of
  ``x[idx]`` (DGC's samples, the hierarchical step among a segment's candidates);
* :meth:`exceedance_moments` — count, mean and variance of ``|x| − η`` over ``|x| > η`` per
  segment (SIDCo's multi-stage fits);
* :meth:`abs_stats`, :meth:`sums` — per-segment ``max |x|`` and ``Σ |x|`` in one pass, ``Σ x``
  and ``Σ x²``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..kernels.host import compiled

_jit = compiled  # Numba, cached (kernels.host.compiled)
#: The lowest threshold applied: an exact zero is never selected, however low a threshold falls.
#: (An embedding's gradient is zero outside the batch's rows: a threshold lowered to 0 would send
#: the whole tensor, zeros included.)
POSITIVE = float(np.finfo(np.float64).tiny)


#: How many times one selection pass lowers a reused threshold that selected too few
#: (:func:`_select_within`).
LOWERINGS = 3

#: :func:`_compare` makes room for this many more indices at a time (a block of the segment).
COMPARE_BLOCK = 4096

#: The largest buffer whose selected indices :class:`IndexScratch` holds as int32.
INT32_INDEX_LIMIT = int(np.iinfo(np.int32).max)


@_jit
def _grow(out, n, more=1):  # pragma: no cover - compiled
    """``out`` with room for ``more`` indices after its first ``n`` (at least doubled), its first
    ``n`` kept."""
    bigger = np.empty(max(2 * out.size, n + more, 1024), dtype=out.dtype)
    bigger[:n] = out[:n]
    return bigger


@_jit
def _compare(x, o, size, t, out, n):  # pragma: no cover - compiled
    """Append the indices ``i`` in ``[o, o + size)`` with ``|x[i]| >= t`` to ``out[n:]`` (grown
    when full); ``(out, the new n)``. Never selects an exact zero. The room left is checked once
    per block of :data:`COMPARE_BLOCK` elements, so that the inner loop neither checks nor
    reallocates: a check per selected element made the whole loop about ten times slower. (It
    iterates over the slice, rather than indexing ``x[i]``, which compiles to a loop without index
    checks.)"""
    t = max(t, POSITIVE)
    end = o + size
    b = o
    while b < end:
        e = min(b + COMPARE_BLOCK, end)
        if out.size - n < e - b:
            out = _grow(out, n, e - b)
        i = b
        for v in x[b:e]:
            if abs(v) >= t:
                out[n] = i
                n += 1
            i += 1
        b = e
    return out, n


@_jit
def _keep(x, src, start, stop, t, dst, n):  # pragma: no cover - compiled
    """Append the indices ``i`` of ``src[start:stop]`` with ``|x[i]| >= t`` to ``dst[n:]`` (grown
    when full); ``(dst, the new n)``. ``dst`` may be ``src`` with ``n <= start`` (filtering a run
    in place, which never grows it). Never keeps an exact zero."""
    t = max(t, POSITIVE)
    for j in range(start, stop):
        i = src[j]
        if abs(x[i]) >= t:
            if n == dst.size:
                dst = _grow(dst, n)
            dst[n] = i
            n += 1
    return dst, n


@_jit
def _select(x, offsets, sizes, thr, out, counts):  # pragma: no cover - compiled
    n = 0
    for s in range(offsets.size):
        first = n
        if thr[s] < np.inf:  # an infinite threshold (an all-zero segment) selects nothing
            out, n = _compare(x, offsets[s], sizes[s], thr[s], out, n)
        counts[s] = n - first
    return out, n


@_jit
def _abs_stats(x, offsets, sizes, mx, total):  # pragma: no cover - compiled
    """Per segment, ``max |x|`` and ``Σ |x|`` (float64 accumulation) in one pass."""
    for s in range(offsets.size):
        m, acc = 0.0, 0.0
        for v in x[offsets[s]:offsets[s] + sizes[s]]:
            a = abs(v)
            if a > m:
                m = a
            acc += a
        mx[s], total[s] = m, acc


@_jit
def _sums(x, offsets, sizes, squares, out):  # pragma: no cover - compiled
    """Per segment, ``Σ x`` (``squares``: ``Σ x²``), float64 accumulation."""
    for s in range(offsets.size):
        acc = 0.0
        for v in x[offsets[s]:offsets[s] + sizes[s]]:
            w = np.float64(v)
            acc += w * w if squares else w
        out[s] = acc


@_jit
def _split(hist, lo, hi, k):  # pragma: no cover - compiled
    """In ``hist[lo:hi + 1]`` (zeroed on the way): the highest bin ``b`` such that bins ``>= b``
    hold at least ``k``, how many bins ``> b`` hold, and how many bin ``b`` holds."""
    above, b = 0, lo
    for h in range(hi, lo - 1, -1):
        if above + hist[h] >= k:
            b = h
            break
        above += hist[h]
    inside = hist[b]
    hist[lo:hi + 1] = 0
    return b, above, inside


@compiled(inline="always")
def _radix(bits, mask, o, size, need, nbits, hist, cand, out, n):  # pragma: no cover - compiled
    """Radix selection of the ``need`` largest of ``bits[o:o + size] & mask`` (the values' IEEE
    bits without the sign, as unsigned integers, which order magnitudes as the floats do;
    ``1 <= need <= size``): a histogram of the top 12 bits finds the bin of the need-th largest,
    one more pass keeps the bin's elements as candidates (and, unless ``out`` is None, appends the
    positions above it to ``out[n:]``), and the next 12 bits split the candidates until the count
    is exact; candidates whose bits are all equal (ties) are taken first come, first served. Only
    the bins between the lowest and the highest one used are scanned and cleared, so a small run
    costs little. ``cand`` grows to the largest candidate bin. Returns ``(the need-th largest's
    bits, the new n, cand)``; with an ``out``, exactly ``need`` positions were appended. (Numba
    compiles the two kinds of ``out`` apart, each without the other's branch.)"""
    shift = nbits - 12
    lo, hi = 4095, 0
    for x in bits[o:o + size]:
        h = np.int64((x & mask) >> shift)
        hist[h] += 1
        lo, hi = min(lo, h), max(hi, h)
    b, above, inside = _split(hist, lo, hi, need)
    if inside > cand.size:
        cand = np.empty(inside, dtype=cand.dtype)
    c, i = 0, o
    for x in bits[o:o + size]:
        h = np.int64((x & mask) >> shift)
        if h > b:
            if out is not None:
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
            h = np.int64(((bits[cand[j]] & mask) >> shift) & 4095)
            hist[h] += 1
            lo, hi = min(lo, h), max(hi, h)
        b, above, inside = _split(hist, lo, hi, need)
        kept = 0
        for j in range(c):
            h = np.int64(((bits[cand[j]] & mask) >> shift) & 4095)
            if h > b:
                if out is not None:
                    out[n] = cand[j]
                    n += 1
            elif h == b:
                cand[kept] = cand[j]
                kept += 1
        need, c = need - above, kept
    kth = bits[cand[0]] & mask  # the need-th largest: the least of the candidates taken
    for j in range(need):
        kth = min(kth, bits[cand[j]] & mask)
        if out is not None:
            out[n] = cand[j]
            n += 1
    return kth, n, cand


@_jit
def _select_top(bits, mask, offsets, sizes, ks, nbits, out, counts, cand):  # pragma: no cover - compiled
    """Exactly ``min(ks[s], sizes[s])`` indices per segment, of its largest magnitudes
    (:func:`_radix`). ``out`` holds ``Σ min(ks, sizes)``; returns ``(n, cand)``."""
    hist = np.zeros(4096, dtype=np.int64)
    n = 0
    for s in range(offsets.size):
        first = n
        need = min(ks[s], sizes[s])
        if need > 0:
            _, n, cand = _radix(bits, mask, offsets[s], sizes[s], need, nbits, hist, cand, out, n)
        counts[s] = n - first
    return n, cand


@_jit
def _trim(x, out, first, n, k, scratch, s):  # pragma: no cover - compiled
    """Keep the ``k`` largest magnitudes of the selection ``out[first:n]`` (DGC's hierarchical
    selection): their minimum becomes the threshold ``scratch[s]``; the new n."""
    c = n - first
    scratch[s] = np.partition(np.abs(x[out[first:n]]), c - k)[c - k]
    return _keep(x, out, first, n, scratch[s], out, first)[1]


@_jit
def _select_within(x, offsets, sizes, thr, ks, low, high, lower, scale, out, counts,
                   chosen):  # pragma: no cover - compiled
    """:func:`_select`, corrected per segment while the segment is in cache: a count above
    ``high[s]`` is trimmed to the ``ks[s]`` largest; one below ``low[s]``, where ``lower[s]``,
    lowers the threshold along an exponential tail of scale ``scale[s]`` (``count ∝ exp(−τ/scale)``,
    so ``τ − scale · ln(k / count)`` selects about k) and compares the segment again, at most
    :data:`LOWERINGS` times, then trims to ``ks[s]``. ``chosen[s]`` receives the threshold
    applied in the end (in ``x``'s dtype)."""
    n = 0
    for s in range(offsets.size):
        first, t = n, thr[s]
        chosen[s] = t
        if t < np.inf:
            out, n = _compare(x, offsets[s], sizes[s], t, out, n)
            lowered = False
            if lower[s]:
                tries = 0
                while n - first < low[s] and tries < LOWERINGS and t > 0:
                    chosen[s] = max(t - scale[s] * np.log(ks[s] / max(n - first, 1)), 0.0)
                    t = chosen[s]  # rounded to x's dtype
                    out, n = _compare(x, offsets[s], sizes[s], t, out, first)
                    lowered, tries = True, tries + 1
            if n - first > high[s] or (lowered and n - first > ks[s]):
                n = _trim(x, out, first, n, ks[s], chosen, s)
        counts[s] = n - first
    return out, n


@_jit
def _select_stepped(x, offsets, sizes, start, top, low, high, up, down, passes, out, counts,
                    chosen):  # pragma: no cover - compiled
    """:func:`_select` from the thresholds ``start`` (float64, unclipped), then per segment, while
    its count is outside ``[low[s], high[s]]`` and at most ``passes`` times, the threshold times
    ``up`` (too many: the selection is filtered) or ``down`` (too few: the segment is compared
    anew); what is applied is clipped to the segment's maximum ``top[s]``, and ``chosen[s]``
    receives the threshold applied in the end (in ``x``'s dtype)."""
    n = 0
    for s in range(offsets.size):
        first, u = n, start[s]
        chosen[s] = min(u, top[s]) if u < np.inf else u
        if u < np.inf:
            t = chosen[s]
            out, n = _compare(x, offsets[s], sizes[s], t, out, n)
            for _ in range(passes):
                c = n - first
                if low[s] <= c <= high[s]:
                    break
                u *= up if c > high[s] else down
                chosen[s] = min(u, top[s])
                raised, t = chosen[s] >= t, chosen[s]
                if raised:  # a subset of the selection
                    n = _keep(x, out, first, n, t, out, first)[1]
                else:
                    out, n = _compare(x, offsets[s], sizes[s], t, out, first)
        counts[s] = n - first
    return out, n


class Reselection(enum.IntEnum):
    """What :meth:`NumbaKernels.reselect` does with a segment's current selection."""

    KEPT = 0      # keep it as it is
    FILTERED = 1  # a raised threshold: keep the subset with |x| >= the new threshold
    COMPARED = 2  # compare the whole segment anew


@_jit
def _reselect(x, offsets, sizes, idx, counts, mode, thr, out, new_counts):  # pragma: no cover
    n = pos = 0
    for s in range(offsets.size):
        first, t, c = n, thr[s], counts[s]
        if mode[s] == Reselection.KEPT:
            for j in range(pos, pos + c):
                if n == out.size:
                    out = _grow(out, n)
                out[n] = idx[j]
                n += 1
        elif mode[s] == Reselection.FILTERED:
            out, n = _keep(x, idx, pos, pos + c, t, out, n)
        elif t < np.inf:  # Reselection.COMPARED
            out, n = _compare(x, offsets[s], sizes[s], t, out, n)
        new_counts[s] = n - first
        pos += c
    return out, n


@_jit
def _kth_largest(bits, mask, nbits, starts, lengths, ks, out):  # pragma: no cover - compiled
    """``out[j]``: the bits of the ``ks[j]``-th largest magnitude of run ``j`` (0 if empty), by
    :func:`_radix` without collecting."""
    hist = np.zeros(4096, dtype=np.int64)
    cand = np.empty(0, dtype=np.int64)
    for j in range(starts.size):
        n = lengths[j]
        if n == 0:
            out[j] = 0
            continue
        kth, _, cand = _radix(bits, mask, starts[j], n, min(max(ks[j], 1), n), nbits, hist, cand, None, 0)
        out[j] = kth


@_jit
def _kth_largest_at(x, idx, starts, lengths, ks, out):  # pragma: no cover - compiled
    for j in range(starts.size):
        n = lengths[j]
        k = min(max(ks[j], 1), n)
        out[j] = np.partition(np.abs(x[idx[starts[j]:starts[j] + n]]), n - k)[n - k] if n > 0 else 0.0


@_jit
def _exceedance_moments(x, offsets, sizes, eta, inclusive, count, mean, var):  # pragma: no cover
    for j in range(offsets.size):
        c, s1, s2, e = 0, 0.0, 0.0, eta[j]
        for y in x[offsets[j]:offsets[j] + sizes[j]]:
            d = abs(y) - e
            if d > 0.0 or (inclusive and d == 0.0):
                c += 1
                s1 += d
                s2 += d * d
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


class IndexScratch:
    """Room for the selected indices of one buffer at a time, in two slots (a re-selection reads
    the previous selection from one while it writes the other). A slot starts at the size the
    caller expects (about ``2 Σ k``: a selection is corrected into a band around k) and the
    kernels grow it (doubling) when a selection runs past it, so the scratch is as long as the
    selections need, not as the buffer (which would be 8 bytes per gradient element, twice).

    What a selection grew stays only while selections need it: every :data:`WINDOW` reservations
    (a buffer's selection each), a slot more than :data:`SLACK` times the most that was expected or
    used in them (and a block of :func:`_compare`'s room) goes back to that size. So the first
    selections after a plan switch, which run far past k before their thresholds settle, do not
    hold their size for the rest of training, and the doubling's spare half is not shrunk and
    regrown back and forth.

    Indices are int32 (4 bytes each) while every buffer selected from has at most
    :data:`INT32_INDEX_LIMIT` elements, as the wire's indices are; a larger buffer widens the
    scratch to int64 for good (:meth:`fit`). The kernels compile for both widths."""

    WINDOW = 64
    SLACK = 2

    def __init__(self) -> None:
        self.dtype: type = np.int32
        self._slots: list[np.ndarray] = [np.empty(0, dtype=self.dtype), np.empty(0, dtype=self.dtype)]
        self.candidates = np.empty(0, dtype=np.int64)  # :meth:`NumbaKernels.select_top`'s bin
        self._reserved = 0  # reservations in this window
        self._needed = 0  # the most expected or used in this window

    def fit(self, numel: int) -> None:
        """Widen the indices to int64 (once, emptying the slots) if a buffer of ``numel`` elements
        has indices past int32's."""
        if numel > INT32_INDEX_LIMIT and self.dtype is np.int32:
            self.dtype = np.int64
            self._slots = [np.empty(0, dtype=self.dtype), np.empty(0, dtype=self.dtype)]

    def reserve(self, expected: int, numel: int) -> None:
        """Make both slots at least ``expected`` long (what the next selections from a buffer of
        ``numel`` elements should need), and at the end of a window give back what the window did
        not need."""
        self.fit(numel)
        self._needed = max(self._needed, expected)
        self._reserved += 1
        if self._reserved >= self.WINDOW:
            needed = self._needed + COMPARE_BLOCK  # the kernels grow a slot a block ahead
            for slot in (0, 1):
                if self._slots[slot].size > self.SLACK * needed:
                    self._slots[slot] = np.empty(needed, dtype=self.dtype)
            self._reserved = self._needed = 0
        for slot in (0, 1):
            if self._slots[slot].size < expected:
                self._slots[slot] = np.empty(expected, dtype=self.dtype)

    def get(self, slot: int, expected: int = 0) -> np.ndarray:
        """Slot ``slot``, at least ``expected`` long."""
        if self._slots[slot].size < expected:
            self._slots[slot] = np.empty(expected, dtype=self.dtype)
        return self._slots[slot]

    def keep(self, slot: int, grown: np.ndarray, used: int) -> None:
        """Keep what a kernel returned for slot ``slot`` (itself, or a grown copy) after it wrote
        ``used`` indices."""
        self._slots[slot] = grown
        self._needed = max(self._needed, used)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._slots) + self.candidates.nbytes


class NumbaKernels:
    """The segmented operations on CPU NumPy arrays (views of the tensors' memory), compiled.

    ``x`` is the buffer itself (float32 or float64): the kernels compare, sum and rank ``|x|``
    element by element, so no copy of ``|x|`` exists. Methods that select take an
    :class:`IndexScratch` slot and keep whatever it grew into."""

    DTYPES = (torch.float32, torch.float64)

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.offsets, self.sizes = offsets, sizes

    @staticmethod
    def wrap(t: torch.Tensor) -> np.ndarray:
        return t.numpy()

    def abs_stats(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per segment ``max |x|`` (exact, as float64) and ``Σ |x|`` (float64 accumulation), in
        one pass."""
        mx, total = np.empty(len(self.offsets)), np.empty(len(self.offsets))
        _abs_stats(x, self.offsets, self.sizes, mx, total)
        return mx, total

    def sums(self, x: np.ndarray, squares: bool = False) -> np.ndarray:
        """Per segment ``Σ x`` or ``Σ x²`` (float64 accumulation)."""
        out = np.empty(len(self.offsets))
        _sums(x, self.offsets, self.sizes, squares, out)
        return out

    def select(self, x: np.ndarray, thr: np.ndarray, scratch: IndexScratch, slot: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """``|x| >= thr[s]`` in every segment ``s``: ascending indices (a view of the scratch slot)
        and the count per segment."""
        counts = np.empty(len(self.offsets), dtype=np.int64)
        out, n = _select(x, self.offsets, self.sizes, thr, scratch.get(slot), counts)
        scratch.keep(slot, out, n)
        return out[:n], counts

    def select_top(self, x: np.ndarray, ks: np.ndarray, scratch: IndexScratch) -> np.ndarray:
        """Indices of the ``ks[s]`` largest magnitudes of each segment ``s`` of ``x``, exactly that
        many (ties: the first ones)."""
        counts = np.empty(len(self.offsets), dtype=np.int64)
        utype = np.uint32 if x.dtype == np.float32 else np.uint64
        bits = x.view(utype)
        mask = utype(np.iinfo(utype).max >> 1)  # every bit but the sign
        scratch.fit(x.size)
        out = scratch.get(0, int(np.minimum(ks, self.sizes).sum()))
        n, cand = _select_top(bits, mask, self.offsets, self.sizes, ks, 8 * x.itemsize, out, counts,
                              scratch.candidates)
        if cand.size <= 4 * out.size:  # a larger one served a bin of ties once: let it go
            scratch.candidates = cand
        return out[:n]

    def select_within(self, x: np.ndarray, thr: np.ndarray, band: Band, scratch: IndexScratch,
                      slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`select` with the counts held in ``band``: the indices, the counts and the
        threshold each segment ended with."""
        counts = np.empty(len(self.offsets), dtype=np.int64)
        chosen = thr.copy()
        out, n = _select_within(x, self.offsets, self.sizes, thr, band.k, band.low, band.high, band.lower,
                                band.scale, scratch.get(slot), counts, chosen)
        scratch.keep(slot, out, n)
        return out[:n], counts, chosen

    def select_stepped(self, x: np.ndarray, start: np.ndarray, steps: Steps, top: np.ndarray,
                       scratch: IndexScratch, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`select` from the unclipped float64 thresholds ``start`` (infinite: the segment
        selects nothing), with the counts corrected by ``steps`` and what is applied clipped to
        ``top``: the indices, the counts and the threshold each segment ended with."""
        counts = np.empty(len(self.offsets), dtype=np.int64)
        chosen = top.copy()
        out, n = _select_stepped(x, self.offsets, self.sizes, start, top, steps.low, steps.high, steps.up,
                                 steps.down, steps.passes, scratch.get(slot), counts, chosen)
        scratch.keep(slot, out, n)
        return out[:n], counts, chosen

    def reselect(self, x: np.ndarray, idx: np.ndarray, counts: np.ndarray, mode: np.ndarray, thr: np.ndarray,
                 scratch: IndexScratch, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The selection ``idx`` (ascending, in runs of ``counts``; not in slot ``slot``) with
        segment ``s`` kept, filtered to ``|x| >= thr[s]`` or compared anew, as ``mode[s]`` (a
        :class:`Reselection`) says."""
        new_counts = np.empty_like(counts)
        out, n = _reselect(x, self.offsets, self.sizes, idx, counts, mode, thr, scratch.get(slot, idx.size),
                           new_counts)
        scratch.keep(slot, out, n)
        return out[:n], new_counts

    @staticmethod
    def kth_largest(x: np.ndarray, starts: np.ndarray, lengths: np.ndarray, ks: np.ndarray,
                    idx: np.ndarray | None = None) -> np.ndarray:
        """The ``ks[j]``-th largest ``|x|`` (``ks`` clamped to ``[1, lengths[j]]``) of run ``j`` of
        ``x`` — or of ``x[idx]`` when ``idx`` is given — starting at ``starts[j]``; 0 for an
        empty run."""
        if idx is None:  # on the magnitudes' bits, as unsigned integers of the values' width
            utype = np.uint32 if x.dtype == np.float32 else np.uint64
            found = np.empty(len(starts), dtype=utype)
            _kth_largest(x.view(utype), utype(np.iinfo(utype).max >> 1), 8 * x.itemsize, starts, lengths, ks, found)
            return found.view(x.dtype).astype(np.float64)
        out = np.empty(len(starts), dtype=np.float64)
        _kth_largest_at(x, idx, starts, lengths, ks, out)
        return out

    def exceedance_moments(self, x: np.ndarray, segs: np.ndarray, eta: np.ndarray,
                           inclusive: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per segment ``segs[j]``: count, mean and (population) variance of ``|x| − eta[j]`` over
        the elements with ``|x| > eta[j]`` (``>=`` if ``inclusive``), in float64."""
        count, mean, var = (np.empty(len(segs), dtype=t) for t in (np.int64, np.float64, np.float64))
        _exceedance_moments(x, self.offsets[segs], self.sizes[segs], eta.astype(np.float64), inclusive,
                            count, mean, var)
        return count, mean, var

    @staticmethod
    def to_indices(idx: np.ndarray) -> torch.Tensor:
        """A tensor of its own (``idx`` may be scratch memory that the next selection reuses)."""
        if not len(idx):  # torch.from_numpy gives an empty array stride 0, which breaks byte views
            return torch.empty(0, dtype=torch.int64)
        return torch.from_numpy(idx.astype(np.int64, copy=True))


def warm_up(dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64)) -> None:
    """Compile every kernel for ``dtypes`` (default: float32 and float64) now. Numba caches
    compiled kernels beside this module, so the install does this once and training's first step
    does not pay for it (compiling takes far longer than a step; docs/benchmarks.md, "Selection
    kernels", has the time). Where they are cached, this loads them
    (:mod:`~horovod_safusion.compressors.loading`)."""
    offsets, sizes = np.array([0, 6], dtype=np.int64), np.array([6, 4], dtype=np.int64)
    ks = np.array([2, 1], dtype=np.int64)
    for dtype in (torch.empty((), dtype=d).numpy().dtype for d in dtypes):
        x = np.linspace(-1, 1, 10).astype(dtype)
        kernels, scratch = NumbaKernels(offsets, sizes), IndexScratch()
        kernels.abs_stats(x)
        kernels.sums(x, squares=True)
        thr = np.array([0.5, 2.0], dtype=dtype)
        idx, counts = kernels.select(x, thr, scratch, 0)
        kernels.reselect(x, idx.copy(), counts, np.array([1, 2], dtype=np.int8), thr, scratch, 1)
        band = Band(k=ks, low=ks / 2 - 1, high=2.0 * (ks + 1), lower=np.array([True, True]), scale=np.ones(2))
        kernels.select_within(x, thr, band, scratch, 0)
        kernels.select_stepped(x, np.array([0.5, 2.0]), Steps(ks / 2, 2.0 * ks, 1.3, 0.7, 3), np.ones(2, dtype=dtype),
                               scratch, 1)
        kernels.select_top(x, ks, scratch)
        kernels.kth_largest(x, offsets, sizes, ks)
        for positions in (scratch.dtype, np.int64):  # a selection's indices; DGC's sample positions
            kernels.kth_largest(x, offsets, sizes, ks, idx=np.arange(10, dtype=positions))
        kernels.exceedance_moments(x, np.arange(2), np.zeros(2), True)
