"""The Triton kernels equal their PyTorch reference (``horovod_safusion.kernels.reference``).

They run here on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set in
``tests/conftest.py``): indices and wire rows bit for bit, values to rounding, on random and
adversarial inputs — ties, zeros, NaN and Inf, empty and one-element segments, segments and
buffers not a multiple of the block size, half precision.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("triton")

from horovod_safusion import kernels, wire  # noqa: E402
from horovod_safusion.kernels import reference, triton_ops  # noqa: E402
from horovod_safusion.segment import Segments  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def buffers(draw):
    """A segmented buffer with adversarial values, a small block size (so that blocks, segments
    and the buffer end in every relative position) and per-segment thresholds that tie with
    elements."""
    dtype = draw(st.sampled_from(DTYPES))
    sizes = draw(st.lists(st.integers(0, 300), min_size=1, max_size=6).filter(any))  # empty segments too
    n = sum(sizes)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    kind = draw(st.sampled_from(["plain", "ties", "zeros", "nonfinite"]))
    if kind == "ties":
        x = torch.round(x * 2) / 2  # few distinct magnitudes: thresholds tie with many elements
    elif kind == "zeros":
        x[torch.rand(n, generator=g) < 0.5] = 0.0
    elif kind == "nonfinite":
        special = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
        picks = torch.randint(0, n, (max(1, n // 50),), generator=g)
        x[picks] = special[torch.randint(0, 3, (len(picks),), generator=g)]
    x = x.to(dtype)
    segments = Segments(tuple(f"s{i}" for i in range(len(sizes))), tuple(sizes))
    block = draw(st.sampled_from([16, 32, 64]))
    table = kernels.block_table(segments, torch.device("cpu"), block)
    a = x.abs().double()
    thr = []
    for o, size in zip(segments.offsets, segments.sizes):  # an element's own value: a tie
        run = a[o:o + size]
        thr.append(float(run[int(draw(st.integers(0, size - 1)))]) if size and draw(st.booleans()) else 1.0)
    return x, segments, table, torch.tensor(thr, dtype=torch.float64).to(dtype)


@contextlib.contextmanager
def triton_kernels():
    """The package's kernels forced to Triton's (hypothesis runs many examples per test, so no
    function-scoped ``monkeypatch``)."""
    before = os.environ.get("HOROVOD_SAFUSION_KERNELS")
    os.environ["HOROVOD_SAFUSION_KERNELS"] = "triton"
    kernels.reread()
    try:
        yield
    finally:
        if before is None:
            del os.environ["HOROVOD_SAFUSION_KERNELS"]
        else:
            os.environ["HOROVOD_SAFUSION_KERNELS"] = before
        kernels.reread()


@SETTINGS
@given(case=buffers())
def test_segment_stats_equal_the_reference(case):
    x, _, table, _ = case
    ref_max, ref_sum, ref_finite = reference.segment_stats(x, table)
    with triton_kernels():
        mx, sm, finite = kernels.segment_stats(x, table)
    assert bool(finite) == bool(ref_finite) == bool(torch.isfinite(x).all())
    assert torch.equal(mx, ref_max)  # a maximum is exact
    torch.testing.assert_close(sm, ref_sum, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(case=buffers())
def test_selection_writes_the_same_wire_rows_and_residual(case):
    x, _, table, thr = case
    ref_flat, tri_flat = x.clone(), x.clone()
    ref = reference.Selection(ref_flat, thr, table)
    with triton_kernels():
        tri = kernels.selection(tri_flat, thr, table)
        assert torch.equal(tri.counts, ref.counts) and int(tri.total) == int(ref.total)
        total = int(ref.total)
        ref_values, ref_idx, ref_rows = ref.take(total)
        values, idx, rows = tri.take(total)
    assert torch.equal(rows, ref_rows)  # values' and indices' bits, row for row
    assert torch.equal(idx, ref_idx)
    assert torch.equal(values.view(torch.uint8) if values.numel() else values, ref_values.view(torch.uint8)
                       if ref_values.numel() else ref_values)
    same = (tri_flat == ref_flat) | (tri_flat.isnan() & ref_flat.isnan())
    assert bool(same.all())  # the residual: selected elements zeroed, the rest untouched
    assert bool((tri_flat[idx] == 0).all())


def test_fused_statistics_count_the_residual_where_the_gradient_was_dropped():
    """A dropped (non-finite) gradient element leaves ``x = scale · r`` in the buffer, and the
    statistics are those of what was written, as in the reference (found by hypothesis: the
    kernel left such elements out of the segment's maximum)."""
    g = torch.tensor([float("nan"), 0.25], dtype=torch.float16)
    table = kernels.block_table(Segments(("s0",), (2,), torch.device("cpu")), torch.device("cpu"))
    out = torch.empty_like(g)
    mx, sm, dropped = triton_ops.segment_stats(out, table, grad=g, residual=torch.tensor([0.5, 0.0], dtype=g.dtype),
                                               scale=torch.tensor(1.0, dtype=g.dtype))
    ref_max, ref_sum, _ = reference.segment_stats(out, table)
    assert out.tolist() == [0.5, 0.25] and int(dropped.sum()) == 1
    assert float(mx.max()) == float(ref_max[0]) == 0.5 and float(sm.sum()) == float(ref_sum[0]) == 0.75


def fused_residual_case(g: torch.Tensor, scale: float):
    """``(r, s, expected, bad)`` for error feedback fused into the statistics: a finite residual
    ``r`` made from ``g``, the scale as a tensor, ``x = g + s · r`` computed wide and rounded once
    (as the kernel does) with a non-finite gradient element dropped, and how many were dropped."""
    r = torch.nan_to_num(torch.flip(g, [0]), nan=0.5, posinf=1.0, neginf=-1.0)  # residuals are finite
    s = torch.tensor(scale, dtype=g.dtype)
    wide = torch.float64 if g.dtype == torch.float64 else torch.float32
    gw = g.to(wide)
    x = torch.where(torch.isfinite(gw), gw, 0) + r.to(wide) * s.to(wide)
    bad = int((~torch.isfinite(gw) | ~torch.isfinite(x)).sum())
    return r, s, torch.where(torch.isfinite(x), x, 0).to(g.dtype), bad


@SETTINGS
@given(case=buffers(), scale=st.floats(0.25, 4.0))
def test_fused_residual_add_and_statistics(case, scale):
    """Kernel (a) with error feedback fused: ``x = g + scale · r`` written (a non-finite gradient
    element dropped: ``x = scale · r`` there, counted), its statistics taken; the same in place
    (the residual is the buffer itself) and in the PyTorch reference."""
    g, _, table, _ = case
    r, s, expected, bad = fused_residual_case(g, scale)
    wide = torch.float64 if g.dtype == torch.float64 else torch.float32
    out = torch.empty_like(g)
    mx, sm, dropped = triton_ops.segment_stats(out, table, grad=g, residual=r, scale=s)
    torch.testing.assert_close(out, expected)
    assert int(dropped.sum()) == bad
    ref_max, ref_sum, ref_finite = reference.segment_stats(out, table)
    per_segment = torch.zeros_like(ref_max).scatter_reduce_(0, table.segment, mx.double(), "amax")
    assert bool(ref_finite) and torch.equal(per_segment, ref_max)
    in_place = r.clone()
    triton_ops.segment_stats(in_place, table, grad=g, residual=in_place, scale=s)
    assert torch.equal(in_place, out)
    ref = r.clone()
    (ref_dropped,) = reference.accumulate(ref, g, ref, s)
    assert int(ref_dropped) == int((~torch.isfinite(g)).sum())
    torch.testing.assert_close(ref.to(wide), expected.to(wide), rtol=2e-2 if g.element_size() < 4 else 1e-6, atol=1e-2)


def split(numel: int, seed: int) -> np.ndarray:
    """Bounds of a few segments of ``numel`` elements (empty ones too)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, numel + 1, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g)
    return np.array([0, *sorted(cuts.tolist()), numel], dtype=np.int64)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(0, 2000), numel=st.integers(1, 500),
       seed=st.integers(0, 2**31 - 1))
def test_decode_adds_every_rank_s_rows_into_the_segments_like_index_add(dtype, rows, numel, seed):
    """Every rank's rows, indices shared across ranks included, added into the tensors of the
    buffer's segments (the parameters' gradients) as ``index_add_`` adds them into one buffer;
    the PyTorch reference and the Triton kernel alike."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, generator=g).to(dtype)
    indices = torch.randint(0, numel, (rows,), generator=g)
    packed = wire.pack(values, indices)
    bounds = split(numel, seed)
    exact = torch.zeros(numel, dtype=torch.float64).index_add_(0, indices, values.double())
    # Any order of n additions in a precision of unit roundoff u is within (n + 1) · u · Σ|x| of the
    # exact sum (n − 1 additions and the rounding into the result): the kernels add up in float32,
    # the reference in the values' own precision, and the bound holds for both.
    u = torch.finfo(dtype).eps / 2
    count = torch.zeros(numel, dtype=torch.float64).index_add_(0, indices, torch.ones(rows, dtype=torch.float64))
    bound = (count + 1) * u * torch.zeros(numel, dtype=torch.float64).index_add_(0, indices, values.double().abs())
    for decode in (lambda t: reference.scatter_add(t, bounds, *reversed(wire.unpack(packed, dtype))),
                   lambda t: triton_ops.decode_rows(packed, t, bounds),
                   lambda t: triton_ops.scatter_add(values, indices, t, bounds)):
        targets = tuple(torch.zeros(int(hi - lo), dtype=dtype) for lo, hi in zip(bounds[:-1], bounds[1:]))
        decode(targets)
        out = torch.cat(targets).double()
        assert bool(((out - exact).abs() <= bound).all()), float(((out - exact).abs() - bound).max())


def test_rows_and_indices_keep_their_bits_at_large_offsets(paths):
    """Index bits above 2**24 (where a float32 index would round) and an empty selection."""
    n = (1 << 24) + 40
    x = torch.zeros(n)
    x[[0, (1 << 24) + 1, (1 << 24) + 39]] = torch.tensor([2.0, -3.0, 5.0])
    segments = Segments(("big",), (n,))
    table = kernels.block_table(segments, torch.device("cpu"), 1 << 16)
    paths(kernels_="triton")
    sel = kernels.selection(x.clone(), torch.tensor([1.0]), table)
    _, idx, rows = sel.take(int(sel.total))
    assert idx.tolist() == [0, (1 << 24) + 1, (1 << 24) + 39]
    out = torch.zeros(n)
    kernels.decode_rows(rows, (out,), np.array([0, n]))
    assert out[(1 << 24) + 1] == -3.0 and float(out.sum()) == 4.0
    empty = kernels.selection(x.clone(), torch.tensor([float("inf")]), table)
    assert int(empty.total) == 0 and empty.take(0)[2].shape == (0, wire.row_bytes(torch.float32))


@SETTINGS
@given(case=buffers(), share=st.floats(0.0, 1.0))
def test_kth_largest_by_radix_equals_sorting(case, share):
    """The device path's k-th largest ``|x|`` of every segment at once (a radix selection on the
    magnitudes' bits, with ties, zeros, half precision and empty segments) is the sorted
    magnitudes' k-th, and, for float32 and float64, the host kernel's."""
    from horovod_safusion.compressors.segmented import NumbaKernels

    x, segments, table, _ = case
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # buffers are finite when selected
    sizes = segments.size_array
    ks = np.clip(np.round(share * sizes).astype(np.int64), 1, np.maximum(sizes, 1))
    got = reference.kth_largest(x, table.seg_ids(), torch.from_numpy(ks))
    assert got.dtype == x.dtype
    for s, (o, n) in enumerate(zip(segments.offsets, sizes.tolist())):
        want = torch.sort(x[o:o + n].abs(), descending=True).values[ks[s] - 1] if n else x.new_zeros(())
        assert got[s] == want, (s, n, ks[s])
    if x.dtype in (torch.float32, torch.float64):
        host = NumbaKernels.kth_largest(x.numpy(), segments.offset_array, sizes, ks)
        np.testing.assert_array_equal(got.double().numpy(), host)
