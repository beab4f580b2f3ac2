"""The host path's fill (``kernels.host.fill``) against a NumPy reference, element for element:
``dst = g + scale · r``, non-finite gradient elements dropped and counted (the residual keeps its
value there), sums that overflow cleared and counted, and ``drop=False`` letting everything
through. It takes PyTorch's vectorised add where the gradient is finite and no scale is given,
and its compiled kernel otherwise; both must give the reference's bits."""
import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from horovod_safusion.kernels import host

SPECIAL = [0.0, -0.0, 1.0, -2.5, 3e38, -3e38, float("inf"), float("-inf"), float("nan")]


def reference(dst, g, r, scale, drop):
    x = g.copy()
    bad = 0
    if drop:
        nf = ~np.isfinite(x)
        bad += int(nf.sum())
        x[nf] = 0
    with np.errstate(over="ignore", invalid="ignore"):
        y = x if r is None else x + r * x.dtype.type(1.0 if scale is None else scale)
    if drop:
        nf = ~np.isfinite(y)
        bad += int(nf.sum())
        y = np.where(nf, x.dtype.type(0), y)
    return y, bad


@st.composite
def case(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    n = draw(st.integers(1, 64))
    values = st.one_of(st.sampled_from(SPECIAL), st.floats(-1e3, 1e3, width=32))
    g = np.array(draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)
    r = np.array(draw(st.lists(st.floats(-1e3, 1e3, width=32) | st.sampled_from([3e38, -3e38]),
                               min_size=n, max_size=n)), dtype=dtype)
    residual = draw(st.sampled_from(["none", "in place", "apart"]))
    scale = draw(st.sampled_from([None, 0.5, 2.0]))
    drop = draw(st.booleans())
    return g, r, residual, scale, drop


@settings(max_examples=300, deadline=None)
@given(case())
def test_fill_gives_the_references_bits(c):
    g, r, residual, scale, drop = c
    expected, bad = reference(None, g, None if residual == "none" else r, scale, drop)
    dst = torch.from_numpy(r.copy()) if residual == "in place" else torch.zeros(g.size, dtype=torch.from_numpy(g).dtype)
    res = None if residual == "none" else dst if residual == "in place" else torch.from_numpy(r.copy())
    got = host.fill(dst, torch.from_numpy(g.copy()), res, scale, drop=drop)
    assert got == bad
    out = dst.numpy()
    same = (out.view(np.uint8).reshape(g.size, -1) == expected.view(np.uint8).reshape(g.size, -1)).all(axis=1)
    assert (same | (np.isnan(out) & np.isnan(expected))).all(), (g, r, residual, scale, drop, out, expected)


def test_both_paths_are_exercised():
    """A finite gradient without a scale takes the vectorised add; an overflowing sum is cleared
    there too; a NaN gradient takes the compiled kernel."""
    r = torch.tensor([1.0, 3e38, -2.0])
    n = host.fill(r, torch.tensor([0.5, 3e38, 1.0]), r, None)
    assert n == 1 and r.tolist() == [1.5, 0.0, -1.0]
    r = torch.tensor([1.0, 2.0])
    n = host.fill(r, torch.tensor([float("nan"), 1.0]), r, None)
    assert n == 1 and r.tolist() == [1.0, 3.0]


def test_kernels_compile_without_a_writable_cache(tmp_path):
    """A read-only install with no writable cache folder still imports and computes: Numba's
    'cannot cache' error is met by compiling without a cache (one process, with a read-only copy
    of a kernel module and no cache folder Numba may use)."""
    import shutil
    import subprocess
    import sys
    import textwrap
    pkg = tmp_path / "ro"
    pkg.mkdir()
    shutil.copy(host.__file__, pkg / "hostcopy.py")
    pkg.chmod(0o555)
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(pkg)!r})
        import numba.core.caching as caching
        # No locator finds a writable place: as in a read-only install with a read-only home.
        caching.CacheImpl._locator_classes = []
        import hostcopy, torch
        dst, g, r = torch.zeros(4), torch.arange(4.0), torch.ones(4)
        hostcopy.fill(dst, g, r, 2.0)  # the compiled kernel: a scale is given
        print("ok", dst.tolist())
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    pkg.chmod(0o755)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split(None, 1) == ["ok", "[2.0, 3.0, 4.0, 5.0]\n"], run.stdout
