"""The host path's kernels (CPU, float32 and float64), compiled by Numba: error feedback into a
fusion buffer's segment, and every rank's selected values added into the gradients.

SAFusion §3.1 Step 1 adds each gradient to its residual as it is copied into the fusion buffer,
and Step 3 adds up the values the ranks sent. Both run once per element of every step, so each
reads every element once or a few times, with no temporary as large as a tensor:

* :func:`fill` — ``x = g + scale · r`` written into the segment (which may hold ``r`` itself).
  On a sparse step a non-finite gradient element is dropped: its residual stays as it was, and
  it is counted, so that the controller can tell every rank that the step must be skipped.
  (Where the gradient is finite and no loss scale changed, PyTorch's vectorised add does it.)
* :func:`scatter_add` — values at buffer-relative indices added into the gradient tensors of the
  buffer's segments (one tensor per segment, so the reduced gradient needs no buffer of its own):
  a counting sort by segment in one compiled call, then one ``index_add_`` per segment.
* :func:`accumulator_at` — a rank's accumulator at indices the job agreed on (ExDyna's and
  ScaleCom's all-reduce), one merge of two ascending index lists.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numba
import numpy as np
import torch



def compiled(func: Callable | None = None, *, inline: str = "never") -> Callable:
    """``func`` compiled by Numba, its machine code cached beside the module (or in Numba's user
    cache where the package folder is read-only). Where no cache folder is writable at all (a
    read-only install with a read-only home; ``NUMBA_CACHE_DIR`` names one), it still compiles,
    once per process, instead of failing the import. ``inline="always"`` (as
    ``@compiled(inline="always")``) compiles a helper into each kernel that calls it, so that a
    call per segment costs no call."""
    if func is None:
        return lambda f: compiled(f, inline=inline)
    try:
        return numba.njit(cache=True, nogil=True, inline=inline)(func)
    except RuntimeError as error:  # Numba: "cannot cache function ...: no locator available"
        if "cannot cache" not in str(error):
            raise
        return numba.njit(nogil=True, inline=inline)(func)


_jit = compiled

DTYPES = (torch.float32, torch.float64)


def handles(t: torch.Tensor) -> bool:
    """Whether ``t`` (a flat buffer or gradient) is one the compiled kernels take."""
    return t.device.type == "cpu" and t.dtype in DTYPES


@_jit
def _fill(dst, g, r, has_r, scale, drop):  # pragma: no cover - compiled
    bad = 0
    zero = dst.dtype.type(0)
    for i in range(dst.size):
        x = g[i]
        if has_r:
            y = r[i] * scale
            if drop and not np.isfinite(x):
                bad += 1
                x = zero
            y = x + y
        else:
            y = x
            if drop and not np.isfinite(x):
                bad += 1
                y = zero
        if drop and not np.isfinite(y):  # a residual rescaled out of range: cleared
            bad += 1
            y = zero
        dst[i] = y
    return bad


def fill(dst: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None, scale: float | None,
         drop: bool = True) -> int:
    """``dst = g + scale · residual`` (flat, contiguous; ``residual`` may be ``dst`` itself or
    ``None``), in ``dst``'s dtype; returns how many elements were not finite (dropped when
    ``drop``: the residual keeps its value there).

    Without a scale, where ``g``'s sum is finite (so is every element: one that is not makes the
    sum inf or NaN), PyTorch's vectorised add writes ``dst`` and the sum of ``dst`` tells whether
    an addition overflowed (then those elements are cleared and counted, as in the compiled
    kernel): three vectorised passes cost less than the compiled kernel's one, whose per-element
    finiteness branches do not vectorise."""
    if scale is None and (not drop or math.isfinite(g.sum().item())):
        if residual is None:
            dst.copy_(g)
        else:
            torch.add(g, residual, out=dst)
        return int(_clear(dst.numpy())) if drop and not math.isfinite(dst.sum().item()) else 0
    ty = np.float32 if dst.dtype == torch.float32 else np.float64
    d = dst.numpy()
    r = residual.numpy() if residual is not None else d
    return int(_fill(d, g.numpy(), r, residual is not None, ty(1.0 if scale is None else scale), bool(drop)))


@_jit
def _clear(dst):  # pragma: no cover - compiled
    """Zero the elements of ``dst`` that are not finite; how many."""
    bad = 0
    zero = dst.dtype.type(0)
    for i in range(dst.size):
        if not np.isfinite(dst[i]):
            dst[i] = zero
            bad += 1
    return bad


@_jit
def _by_segment(indices, values, bounds, local, sorted_values, counts):  # pragma: no cover - compiled
    """Counting sort of (index, value) pairs by the segment ``[bounds[s], bounds[s + 1])`` that
    holds the index; ``local`` receives the index within its segment."""
    segments = bounds.size - 1
    owner = np.empty(indices.size, dtype=np.int64)
    for j in range(indices.size):
        s = np.searchsorted(bounds, indices[j], side="right") - 1
        owner[j] = s
        counts[s] += 1
    at = np.empty(segments, dtype=np.int64)
    acc = 0
    for s in range(segments):
        at[s] = acc
        acc += counts[s]
    for j in range(indices.size):
        s = owner[j]
        local[at[s]] = indices[j] - bounds[s]
        sorted_values[at[s]] = values[j]
        at[s] += 1


def scatter_add(targets: Sequence[torch.Tensor], bounds: np.ndarray, indices: torch.Tensor,
                values: torch.Tensor) -> None:
    """Add ``values`` at buffer-relative ``indices`` into ``targets`` (flat tensors, one per
    segment ``[bounds[s], bounds[s + 1])``); equal indices add up (``index_add_``)."""
    if indices.numel() == 0:
        return
    if len(targets) == 1:
        targets[0].index_add_(0, indices, values)
        return
    counts = np.zeros(len(targets), dtype=np.int64)
    local = np.empty(indices.numel(), dtype=np.int64)
    ordered = np.empty(indices.numel(), dtype=values.numpy().dtype)
    _by_segment(indices.numpy(), values.numpy(), bounds, local, ordered, counts)
    local_t, ordered_t = torch.from_numpy(local), torch.from_numpy(ordered)
    at = 0
    for target, n in zip(targets, counts.tolist()):
        if n:
            target.index_add_(0, local_t[at:at + n], ordered_t[at:at + n])
            at += n


@_jit
def _merge_at(agreed, indices, values, residual, has_r, contrib):  # pragma: no cover - compiled
    """One merge of two ascending index lists: the value selected at each agreed index (zero where
    none was) plus the residual there."""
    j, k = 0, indices.size
    zero = contrib.dtype.type(0)
    for i in range(agreed.size):
        a = agreed[i]
        while j < k and indices[j] < a:
            j += 1
        v = values[j] if j < k and indices[j] == a else zero
        contrib[i] = v + residual[a] if has_r else v


def accumulator_at(agreed: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                   residual: torch.Tensor | None) -> torch.Tensor:
    """The accumulator (``values`` selected at ``indices``, plus ``residual``) at ``agreed``; both
    index lists ascending, int64."""
    contrib = torch.empty(agreed.numel(), dtype=values.dtype)
    r = residual if residual is not None else values[:0]
    _merge_at(agreed.numpy(), indices.numpy(), values.numpy(), r.numpy(), residual is not None, contrib.numpy())
    return contrib


def warm_up(dtypes: Sequence[torch.dtype] = DTYPES) -> None:
    """Compile the kernels for ``dtypes`` (default: float32 and float64) now (Numba caches them
    beside this module; where they are cached, this loads them)."""
    for dtype in dtypes:
        x = torch.zeros(4, dtype=dtype)
        fill(x, torch.ones(4, dtype=dtype), x, 0.5)
        fill(x, torch.ones(4, dtype=dtype), None, None, drop=False)
        _clear(x.numpy())
        scatter_add([torch.zeros(2, dtype=dtype), torch.zeros(2, dtype=dtype)], np.array([0, 2, 4]),
                    torch.tensor([3, 0, 1]), torch.ones(3, dtype=dtype))
        accumulator_at(torch.tensor([0, 2]), torch.tensor([2, 3]), torch.ones(2, dtype=dtype), x)
