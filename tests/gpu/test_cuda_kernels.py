"""The device path on a CUDA device: Triton kernels compiled for the GPU and the device-side
selection, against the host path and the PyTorch reference.

The CPU suite runs the Triton kernels through Triton's interpreter (``tests/unit/test_kernels.py``)
and the device path on CPU tensors (``HOROVOD_SAFUSION_DEVICE_PATH=1``); here the same cases run on
CUDA tensors, with compiled kernels, and are checked against the reference computed on the CPU:

* segment statistics (maxima bit for bit), the fused error feedback, the threshold selection
  (counts, wire rows, indices, values and the residual bit for bit), the k-th largest ``|x|`` by
  radix selection, decode (within the rounding bound of ``index_add_``, and bit for bit where the
  indices are distinct), index bits above 2**24 — for the Triton kernels and the PyTorch path;
* every compressor with a device path selects on the GPU the elements the host path selects,
  step after step with residuals carried, and ends with the same per-segment state (the case of
  ``tests/unit/test_compressors.py``), its values and wire rows bit for bit;
* at most one synchronising CUDA call per buffer and step (once layouts and thresholds exist) in
  the selection, and none beyond one in the decode — counted by CUDA's sync debug mode
  (``torch.cuda.set_sync_debug_mode``), which sees what the CPU suite's operator counter cannot:
  copies from pageable host memory to the device, which wait for the stream as reads do.

Every test skips where ``torch.cuda.is_available()`` is False. ``SAFUSION_GPU_TESTS_DEVICE=cpu``
runs them on CPU tensors instead (Triton interpreted, the device path forced): a dry run of this
module's code, not a GPU check. On the GPU machines Horovod is not installed: ``conftest.py``
loads the package without its ``__init__`` (see ``gpu_env.py``).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import gpu_env

DEVICE = torch.device(gpu_env.device_name())


def _skip_reason() -> str | None:
    if DEVICE.type == "cpu":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False (SAFUSION_GPU_TESTS_DEVICE=cpu dry-runs on CPU)"
    from horovod_safusion.kernels import triton_ops
    if type(triton_ops._count_kernel).__name__ == "InterpretedFunction":
        return ("Triton runs interpreted in this process (TRITON_INTERPRET=1, set by tests/conftest.py for "
                "the CPU suite): run `python -m pytest tests/gpu` alone")
    return None


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

# the CPU tests' cases and helpers (``tests/unit`` is on the path: conftest.py)
import test_compressors as C  # noqa: E402
import test_kernels as K  # noqa: E402

from horovod_safusion import kernels, wire  # noqa: E402
from horovod_safusion.compressors import available_compressors, make_compressor  # noqa: E402
from horovod_safusion.compressors.threshold import ThresholdCompressor  # noqa: E402
from horovod_safusion.kernels import reference, triton_ops  # noqa: E402
from horovod_safusion.segment import Segments  # noqa: E402

KERNELS = ("triton", "torch")
SETTINGS = K.SETTINGS


@contextlib.contextmanager
def path(kernels_: str | None = None, device_path: bool = True):
    """The device path (CPU buffers too, for the dry run) with ``kernels_`` forced, or the host
    path (``device_path=False``); restored afterwards (hypothesis runs many examples per test, so
    no function-scoped ``monkeypatch``)."""
    names = ("HOROVOD_SAFUSION_KERNELS", "HOROVOD_SAFUSION_DEVICE_PATH")
    before = {n: os.environ.get(n) for n in names}
    os.environ["HOROVOD_SAFUSION_DEVICE_PATH"] = "1" if device_path else "0"
    if kernels_ is None:
        os.environ.pop("HOROVOD_SAFUSION_KERNELS", None)
    else:
        os.environ["HOROVOD_SAFUSION_KERNELS"] = kernels_
    kernels.reread()
    try:
        yield
    finally:
        for n, v in before.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
        kernels.reread()


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits (on the CPU), so that equal means bit for bit (NaN and -0 included)."""
    t = t.detach().cpu().reshape(-1).contiguous()
    return t.view(torch.uint8) if t.numel() else t.to(torch.uint8)


def on_device(x: torch.Tensor, segments: Segments, block: int):
    """A copy of ``x`` on the device (a copy on the CPU too: selections zero what they take) and
    the segments' block table there."""
    return x.to(DEVICE, copy=True), kernels.block_table(segments, DEVICE, block)


# ---- kernels ------------------------------------------------------------------------------------------
@SETTINGS
@given(case=K.buffers())
def test_segment_stats_equal_the_reference(case):
    x, segments, table, _ = case
    ref_max, ref_sum, ref_finite = reference.segment_stats(x, table)
    dx, dtable = on_device(x, segments, table.block)
    for k in KERNELS:
        with path(k):
            mx, sm, finite = kernels.segment_stats(dx, dtable)
        assert bool(finite) == bool(ref_finite), k
        assert torch.equal(mx.cpu(), ref_max), k  # a maximum is exact
        torch.testing.assert_close(sm.cpu(), ref_sum, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(case=K.buffers())
def test_selection_writes_the_reference_wire_rows_and_residual(case):
    """Counts, wire rows, indices, values and the residual left in the buffer, bit for bit, as the
    PyTorch reference on the CPU writes them."""
    x, segments, table, thr = case
    ref_flat = x.clone()
    ref = reference.Selection(ref_flat, thr, table)
    total = int(ref.total)
    ref_values, ref_idx, ref_rows = ref.take(total)
    for k in KERNELS:
        flat, dtable = on_device(x, segments, table.block)
        with path(k):
            sel = kernels.selection(flat, thr.to(DEVICE), dtable)
            assert torch.equal(sel.counts.long().cpu(), ref.counts.long()) and int(sel.total) == total, k
            values, idx, rows = sel.take(total)
        assert torch.equal(rows.cpu(), ref_rows), k
        assert torch.equal(idx.cpu(), ref_idx), k
        assert torch.equal(bits(values), bits(ref_values)), k
        assert torch.equal(bits(flat), bits(ref_flat)), k  # selected elements zeroed, the rest untouched


@SETTINGS
@given(case=K.buffers(), scale=st.floats(0.25, 4.0))
def test_fused_residual_add_and_statistics(case, scale):
    """The Triton kernel's error feedback ``x = g + scale · r`` (a non-finite gradient element
    dropped and counted) with the statistics of what it wrote; in place; and through
    :func:`kernels.accumulate` on both paths."""
    g, segments, table, _ = case
    r, s, expected, bad = K.fused_residual_case(g, scale)
    wide = torch.float64 if g.dtype == torch.float64 else torch.float32
    dg, dtable = on_device(g, segments, table.block)
    dr, ds = r.to(DEVICE), s.to(DEVICE)
    out = torch.empty_like(dg)
    mx, sm, dropped = triton_ops.segment_stats(out, dtable, grad=dg, residual=dr, scale=ds)
    torch.testing.assert_close(out.cpu(), expected)  # a fused multiply-add may round once less
    assert int(dropped.sum()) == bad
    ref_max, ref_sum, ref_finite = reference.segment_stats(out.cpu(), table)
    per_segment = torch.zeros_like(ref_max).scatter_reduce_(0, table.segment, mx.double().cpu(), "amax")
    assert bool(ref_finite) and torch.equal(per_segment, ref_max)
    in_place = dr.clone()
    triton_ops.segment_stats(in_place, dtable, grad=dg, residual=in_place, scale=ds)
    assert torch.equal(bits(in_place), bits(out))
    for k in KERNELS:
        acc = dr.clone()
        with path(k):
            dropped_k = kernels.accumulate(acc, dg, acc, ds)[0]
        assert int(dropped_k) >= int((~torch.isfinite(g)).sum()), k
        torch.testing.assert_close(acc.cpu().to(wide), expected.to(wide),
                                   rtol=2e-2 if g.element_size() < 4 else 1e-6, atol=1e-2)


@SETTINGS
@given(case=K.buffers(), share=st.floats(0.0, 1.0))
def test_kth_largest_by_radix_equals_the_cpu_and_sorting(case, share):
    """The k-th largest ``|x|`` of every segment at once (the device path's exact thresholds),
    bit for bit as on the CPU, and the sorted magnitudes' k-th."""
    x, segments, table, _ = case
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    sizes = segments.size_array
    ks = torch.from_numpy(np.clip(np.round(share * sizes).astype(np.int64), 1, np.maximum(sizes, 1)))
    want = reference.kth_largest(x, table.seg_ids(), ks)
    dx, dtable = on_device(x, segments, table.block)
    got = reference.kth_largest(dx, dtable.seg_ids(), ks.to(DEVICE))
    assert got.dtype == x.dtype and torch.equal(bits(got), bits(want))
    for s, (o, n) in enumerate(zip(segments.offsets, sizes.tolist())):
        if n:
            assert got[s].cpu() == torch.sort(x[o:o + n].abs(), descending=True).values[ks[s] - 1], (s, n)


def test_kth_largest_of_large_segments():
    """Segments of up to a million elements (the radix passes' histograms at scale), with ties."""
    n = (1 << 20, 3, 300_001, 0) if DEVICE.type == "cuda" else (20_000, 3, 3_001, 0)
    segments = Segments(("a", "b", "c", "d"), n)
    g = torch.Generator().manual_seed(5)
    for dtype in K.DTYPES:
        x = (torch.randn(segments.numel, generator=g, dtype=torch.float64) * 8).round().to(dtype)  # ties
        table = kernels.block_table(segments, torch.device("cpu"))
        ks = torch.tensor([1 + n[0] // 100, 2, n[2] // 1000, 1])
        dx, dtable = on_device(x, segments, table.block)
        got = reference.kth_largest(dx, dtable.seg_ids(), ks.to(DEVICE)).cpu()
        for s, (o, size) in enumerate(zip(segments.offsets, n)):
            want = torch.sort(x[o:o + size].abs(), descending=True).values[ks[s] - 1] if size else x.new_zeros(())
            assert got[s] == want, (dtype, s)


def _targets(bounds: np.ndarray, dtype: torch.dtype, base: torch.Tensor | None = None):
    if base is None:
        return tuple(torch.zeros(int(hi - lo), dtype=dtype, device=DEVICE) for lo, hi in zip(bounds[:-1], bounds[1:]))
    return tuple(base[lo:hi].to(DEVICE).clone() for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def _decoders(packed, values, indices, bounds, dtype):
    """Every way rows or values reach the segments' tensors on the device path."""
    dpacked, dvalues, dindices = packed.to(DEVICE), values.to(DEVICE), indices.to(DEVICE)

    def through(k, fn):
        def run(t):
            with path(k):
                fn(t)
        return run
    return {
        "reference.scatter_add": lambda t: reference.scatter_add(t, bounds, *reversed(wire.unpack(dpacked, dtype))),
        "triton_ops.decode_rows": lambda t: triton_ops.decode_rows(dpacked, t, bounds),
        "triton_ops.scatter_add": lambda t: triton_ops.scatter_add(dvalues, dindices, t, bounds),
        **{f"kernels.decode_rows[{k}]": through(k, lambda t: kernels.decode_rows(dpacked, t, bounds)) for k in KERNELS},
        **{f"kernels.scatter_add[{k}]": through(k, lambda t: kernels.scatter_add(t, bounds, dindices, dvalues))
           for k in KERNELS},
    }


@SETTINGS
@given(dtype=st.sampled_from(K.DTYPES), rows=st.integers(0, 4000), numel=st.integers(1, 500),
       seed=st.integers(0, 2**31 - 1))
def test_decode_adds_every_rank_s_rows_like_index_add(dtype, rows, numel, seed):
    """Rows of several ranks, indices shared across ranks included (atomic adds on the GPU), within
    the rounding bound of any order of additions (``tests/unit/test_kernels.py`` derives it)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, generator=g).to(dtype)
    indices = torch.randint(0, numel, (rows,), generator=g)
    packed = wire.pack(values, indices)
    bounds = K.split(numel, seed)
    exact = torch.zeros(numel, dtype=torch.float64).index_add_(0, indices, values.double())
    u = torch.finfo(dtype).eps / 2
    count = torch.zeros(numel, dtype=torch.float64).index_add_(0, indices, torch.ones(rows, dtype=torch.float64))
    bound = (count + 1) * u * torch.zeros(numel, dtype=torch.float64).index_add_(0, indices, values.double().abs())
    for name, decode in _decoders(packed, values, indices, bounds, dtype).items():
        targets = _targets(bounds, dtype)
        decode(targets)
        out = torch.cat(targets).double().cpu()
        assert bool(((out - exact).abs() <= bound).all()), (name, float(((out - exact).abs() - bound).max()))


@SETTINGS
@given(dtype=st.sampled_from(K.DTYPES), numel=st.integers(1, 3000), share=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**31 - 1))
def test_decode_of_distinct_indices_is_index_add_bit_for_bit(dtype, numel, share, seed):
    """One addition per element (one rank's rows): every decoder adds as ``index_add_`` on the CPU
    does, into gradients that already hold values."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g).to(dtype)
    indices = torch.randperm(numel, generator=g)[:int(share * numel)]
    values = torch.randn(indices.numel(), generator=g).to(dtype)
    packed = wire.pack(values, indices)
    bounds = K.split(numel, seed)
    want = base.clone().index_add_(0, indices, values)
    for name, decode in _decoders(packed, values, indices, bounds, dtype).items():
        targets = _targets(bounds, dtype, base)
        decode(targets)
        assert torch.equal(torch.cat(targets).cpu(), want), name


@pytest.mark.parametrize("kern", KERNELS)
def test_rows_and_indices_keep_their_bits_at_large_offsets(kern):
    """Index bits above 2**24 (where a float32 index would round), at the production block size,
    and an empty selection."""
    n = (1 << 24) + 40
    x = torch.zeros(n, device=DEVICE)
    x[[0, (1 << 24) + 1, (1 << 24) + 39]] = torch.tensor([2.0, -3.0, 5.0], device=DEVICE)
    segments = Segments(("big",), (n,))
    table = kernels.block_table(segments, DEVICE, 1 << 16 if DEVICE.type == "cpu" else kernels.blocks.BLOCK)
    with path(kern):
        sel = kernels.selection(x.clone(), torch.tensor([1.0], device=DEVICE), table)
        values, idx, rows = sel.take(int(sel.total))
        assert idx.tolist() == [0, (1 << 24) + 1, (1 << 24) + 39] and values.tolist() == [2.0, -3.0, 5.0]
        out = torch.zeros(n, device=DEVICE)
        kernels.decode_rows(rows, (out,), np.array([0, n]))
        assert float(out[(1 << 24) + 1]) == -3.0 and float(out.sum()) == 4.0
        empty = kernels.selection(x.clone(), torch.tensor([float("inf")], device=DEVICE), table)
        assert int(empty.total) == 0 and empty.take(0)[2].shape == (0, wire.row_bytes(torch.float32))


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("dtype", K.DTYPES)
def test_selection_at_the_production_block_size(dtype, kern):
    """Millions of elements in blocks of :data:`~horovod_safusion.kernels.blocks.BLOCK`, segments
    not a multiple of it (an empty and a one-element one too), thresholds at a quantile: the
    rows and the residual bit for bit as the reference on the CPU."""
    sizes = (3_000_001, 1_048_576, 1, 0, 500_003) if DEVICE.type == "cuda" else (30_001, 10_240, 1, 0, 5_003)
    segments = Segments(tuple(f"s{i}" for i in range(len(sizes))), sizes)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(segments.numel, generator=g).to(dtype)
    thr = torch.tensor([2.5, 3.0, 0.0, 1.0, 0.5]).to(dtype)  # 0: the one element is selected unless zero
    table = kernels.block_table(segments, torch.device("cpu"))
    ref_flat = x.clone()
    ref = reference.Selection(ref_flat, thr, table)
    total = int(ref.total)
    ref_values, ref_idx, ref_rows = ref.take(total)
    flat, dtable = on_device(x, segments, table.block)
    with path(kern):
        sel = kernels.selection(flat, thr.to(DEVICE), dtable)
        assert torch.equal(sel.counts.long().cpu(), ref.counts.long())
        values, idx, rows = sel.take(int(sel.total))
    assert torch.equal(rows.cpu(), ref_rows) and torch.equal(idx.cpu(), ref_idx)
    assert torch.equal(bits(values), bits(ref_values)) and torch.equal(bits(flat), bits(ref_flat))


# ---- compressors: the device path selects as the host path -------------------------------------------
class OnDevice:
    """A compressor whose ``select`` runs on the device path — on :data:`DEVICE` — the way
    ``ThresholdCompressor.select_at`` runs it there (``propose(...).decide(zero=False)``), also
    checking that the values and wire rows taken are the buffer's at the selected indices, bit for
    bit; it returns the indices on the CPU, so that the CPU tests' driver carries residuals as
    before."""

    def __init__(self, compressor) -> None:
        self.compressor = compressor

    def __getattr__(self, name):
        return getattr(self.compressor, name)

    def select(self, flat: torch.Tensor, segments: Segments, step: int, density: float | None = None):
        c, dflat = self.compressor, flat.to(DEVICE)
        if not isinstance(c, ThresholdCompressor):
            return c.select(dflat, segments, step, density).cpu()
        (values, idx, rows), finite = c.propose(dflat, segments, step, c.density_of_step(density)).decide(zero=False)
        assert finite and torch.equal(dflat.cpu(), flat)  # zero=False: the buffer is left as it was
        assert torch.equal(bits(values), bits(dflat[idx]))
        assert rows is None or torch.equal(rows.cpu(), wire.pack(values, idx).cpu())
        return idx.cpu()


@functools.lru_cache(maxsize=None)
def _on_the_host(name: str, dtype: torch.dtype, density: float):
    with path(device_path=False):
        return C._carried(name, dtype=dtype, density=density)


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("dtype,density", [(torch.float32, 0.01), (torch.float64, 0.01), (torch.float32, 0.001)])
@pytest.mark.parametrize("name", C.THRESHOLD_COMPRESSORS)
def test_device_path_selects_as_the_host_path(name, dtype, density, kern, monkeypatch):
    """``tests/unit/test_compressors.py``'s case — twelve steps with residuals carried, through
    reused thresholds, trims, lowerings, new estimates with more effort and DGC's periodic
    estimate — with the device path on the GPU: the same indices every step, the same state.
    Thresholds are kept in units of a segment's mean ``|x|``, and the Triton statistics sum ``|x|``
    in float32 within a block (``triton_ops.segment_stats``; the host and the PyTorch path in
    float64): with them the state agrees to float32's precision, not float64's."""
    host, host_state = _on_the_host(name, dtype, density)
    rtol = 1e-6 if kern == "triton" and dtype != torch.float64 else 1e-9
    make = C.make_compressor
    monkeypatch.setattr(C, "make_compressor", lambda spec, d: OnDevice(make(spec, d)))
    with path(kern):
        device, device_state = C._carried(name, dtype=dtype, density=density)
    for step, (a, b) in enumerate(zip(host, device)):
        assert a.dtype == b.dtype == torch.int64
        assert torch.equal(a, b), (step, a.numel(), b.numel(), np.setxor1d(a.numpy(), b.numpy())[:10])
    for field, values in host_state.items():
        np.testing.assert_allclose(device_state[field], values, rtol=rtol, err_msg=field)


def _distinct(sizes: tuple[int, ...], seed: int = 0) -> tuple[Segments, torch.Tensor]:
    """Segments (equal sizes among them: top-k's batched call) of distinct magnitudes (no ties)."""
    g = torch.Generator().manual_seed(seed)
    segments = C.segs(*sizes)
    n = segments.numel
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return segments, (torch.randperm(n, generator=g) + 1).float() * sign * 1e-3


@pytest.mark.parametrize("name", ["topk", "randomk"])
def test_index_compressors_select_as_the_host_path(name):
    """Top-k (``torch.topk`` on the device, radix selection on the host) and random-k select the
    same elements; their proposals take the buffer's values."""
    for segments, flat in (C.gaussian_segments(), _distinct((5000, 5000, 5000, 300, 1))):
        if name == "topk":
            flat[-16:] = torch.arange(1.0, 17.0)  # no ties in the all-zero segment
        with path(device_path=False):
            host = make_compressor(name, 0.01).select(flat.clone(), segments, 3)
        for k in KERNELS:
            with path(k):
                c, dflat = make_compressor(name, 0.01), flat.to(DEVICE, copy=True)
                dev = c.select(dflat, segments, 3)
                (values, idx, _), finite = c.propose(dflat, segments, 3).decide()
            assert torch.equal(torch.sort(dev.cpu()).values, torch.sort(host).values), (name, k)
            assert finite and torch.equal(torch.sort(idx.cpu()).values, torch.sort(host).values)
            assert torch.equal(bits(values), bits(flat[idx.cpu()])) and not bool(dflat[idx].any())


# ---- synchronisations: at most one per buffer --------------------------------------------------------
@contextlib.contextmanager
def synchronisations():
    """The CUDA calls that make the host wait for the device, as ``file:line`` of the Python code
    that made them (CUDA's sync debug mode warns at each; nothing to count on the CPU)."""
    seen: list[str] = []
    if DEVICE.type != "cuda":
        yield seen
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where = os.path.relpath(w.filename, gpu_env.ROOT) if os.path.isabs(w.filename) else w.filename
            seen.append(f"{where}:{w.lineno}")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA's sync debug mode: nothing synchronises on the CPU")
def test_the_counter_sees_what_synchronises():
    """Reads back and copies from pageable host memory are seen; the device path's replacements
    (a pinned, non-blocking copy; ``nonzero_static``) are not."""
    x = torch.randn(100, device=DEVICE)
    for what, fn in {"item": lambda: x.sum().item(), "tolist": x.tolist, "nonzero": lambda: torch.nonzero(x),
                     "a pageable host-to-device copy": lambda: torch.from_numpy(np.ones(3)).to(DEVICE)}.items():
        with synchronisations() as seen:
            fn()
        assert seen, what
    counts = torch.tensor([1, 2, 3], device=DEVICE)
    with synchronisations() as seen:
        torch.from_numpy(np.ones(3)).pin_memory().to(DEVICE, non_blocking=True)
        torch.nonzero_static(x > 0, size=10)
        torch.repeat_interleave(x[:3], counts, output_size=6)
    assert seen == []


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("name", [c for c in available_compressors() if c != "none"])
def test_one_synchronisation_per_buffer(name, kern):
    """Every sparse compressor: proposing, reading the count and taking the selection of a buffer
    synchronises with the device once (the count that sizes its collective), and the decode of the
    rows once at most, from the second step on (the first builds layouts, tables and thresholds:
    its count is in the message). Two buffers of different layouts, residuals carried."""
    buffers = (Segments(("a0", "a1", "a2", "a3", "a4"), (20_000, 3_000, 3_000, 700, 64)),
               Segments(("b0", "b1"), (5_000, 64)))
    c = make_compressor(name, 0.01)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    residuals = [torch.zeros(s.numel, device=DEVICE) for s in buffers]
    log = []
    with path(kern):
        for step in range(4):
            for b, segments in enumerate(buffers):
                flat = torch.randn(segments.numel, generator=g, device=DEVICE) + residuals[b]
                with synchronisations() as selection:
                    (values, idx, rows), finite = c.propose(flat, segments, step).decide()
                rows = wire.pack(values, idx) if rows is None else rows
                gathered = torch.cat([rows, rows])  # two ranks
                targets = tuple(torch.zeros(n, device=DEVICE) for n in segments.sizes)
                with synchronisations() as decode:
                    kernels.decode_rows(gathered, targets, np.append(segments.offset_array, segments.numel))
                assert finite and 0 < idx.numel() < segments.numel
                assert torch.equal(torch.cat(targets), torch.zeros_like(flat).index_add_(0, idx, 2 * values))
                residuals[b] = flat  # what was taken is zeroed: the residual
                log.append((step, b, selection, decode))
    first = sum(len(s) + len(d) for step, _, s, d in log if step == 0)
    later = collections.Counter(site for step, _, s, d in log if step > 0 for site in s + d)
    gpu_env.SYNCS.append(f"{name:9} {kern:6} first step: {first:3} in all; later steps, per buffer: selection "
                         f"{max(len(s) for step, _, s, _ in log if step > 0)}, decode "
                         f"{max(len(d) for step, _, _, d in log if step > 0)} at most; sites of later steps "
                         f"(calls): {dict(later)}")
    late = [(step, b, s, d) for step, b, s, d in log if step > 0 and (len(s) > 1 or len(d) > 1)]
    assert not late, (f"{name}/{kern}: more than one synchronisation per buffer (first step: {first} in all); "
                      + "; ".join(f"step {st} buffer {b}: selection {s}, decode {d}" for st, b, s, d in late))


def test_a_critical_step_rounds_to_float16_keeping_the_error_bit_for_bit():
    """``stages/half.py`` on the device: the float16 wire is the buffer's rounding, the buffer
    keeps ``x - wire`` exactly (normal, subnormal and flushed float16 values), delivering reads
    the device once per buffer, and an aggregate that overflowed is refused with nothing written."""
    from types import SimpleNamespace

    from horovod_safusion.buffer import FusionBuffer
    from horovod_safusion.residual import ResidualStore
    from horovod_safusion.stages.half import deliver, round_to_half

    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(n, generator=g) * 10.0 ** torch.randint(-9, 4, (n,), generator=g).float()).to(DEVICE)
          for n in (1000, 37, 4096)]
    params = [torch.nn.Parameter(torch.zeros(x.numel(), device=DEVICE)) for x in xs]
    buf = FusionBuffer(0, ["a", "b", "c"], params, "ahead")
    filling = SimpleNamespace(grads=[x.clone() for x in xs])
    wire = round_to_half(buf, filling)
    for slot, x in enumerate(xs):
        seg = buf.segment(slot)
        assert torch.equal(wire[seg], x.half())
        assert torch.equal(buf.flat[seg] + wire[seg].float(), x)
    flight = SimpleNamespace(target=SimpleNamespace(tensors=(wire,)), filling=filling)
    store = ResidualStore()
    with synchronisations() as seen:
        assert deliver(buf, flight, store)
    assert len(seen) <= 1, seen
    for slot, x in enumerate(xs):
        assert torch.equal(filling.grads[slot], x.half().float())
        assert torch.equal(store.peek(buf.names[slot]) + filling.grads[slot], x)
    wire[5] = float("inf")
    before = [t.clone() for t in filling.grads]
    assert not deliver(buf, flight, store)
    assert all(torch.equal(a, b) for a, b in zip(filling.grads, before))
