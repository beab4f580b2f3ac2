"""The device path reads each fusion buffer back to the host at most once (issue: GPU path).

On a GPU, a value read back inside a gradient hook stops the CPU from queueing the rest of
back-propagation. These tests run the whole hook path (gradient hooks → fill → selection → wire →
collective) and ``synchronize()``'s decode on CPU tensors sent down the device path, under a
``TorchDispatchMode`` that counts every operator which synchronises with a CUDA device, and fail
beyond one per buffer.
"""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import horovod_safusion as saf
from horovod_safusion.compressors import available_compressors
from horovod_safusion.fusion import NaivePlanner
from digits import DigitsCNN, load_digits_split

aten = torch.ops.aten
#: Operators whose CUDA implementation reads a device value back to the host (or waits for it).
ALWAYS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
          aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
          aten.unique_consecutive.default, aten.bincount.default, aten.equal.default}


def _in_triton_interpreter() -> bool:
    """Whether Triton's interpreter is running (it copies tensors to NumPy to run a kernel on the
    CPU; a compiled kernel on a GPU reads nothing back)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton."):
            return True
        frame = frame.f_back
    return False


def _has_bool_index(indices) -> bool:
    return any(i is not None and i.dtype == torch.bool for i in indices)


class SyncCounter(TorchDispatchMode):
    """Counts operators that synchronise on CUDA, with what they were (``.seen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _in_triton_interpreter():
            pass
        elif func in ALWAYS:
            self.seen.append(str(func))
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and _has_bool_index(args[1]):
            self.seen.append(f"{func} with a boolean index")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.seen.append(f"{func} without output_size")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting():
    """A :class:`SyncCounter` that also counts host conversions which do not dispatch on CPU
    (``tolist``, ``numpy``: a device-to-host copy on a GPU)."""
    counter = SyncCounter()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)

            def patched(self, *a, _original=original, _name=name, **k):
                if not _in_triton_interpreter():
                    counter.seen.append(f"Tensor.{_name}")
                return _original(self, *a, **k)
            mp.setattr(torch.Tensor, name, patched)
        with counter:
            yield counter


def test_the_counter_counts_what_synchronises(monkeypatch):
    """The counter is not blind: each host read it must catch is caught."""
    x = torch.randn(100)
    with counting() as c:
        x.sum().item()
        x[x > 0]
        torch.nonzero(x)
        x.tolist()
        bool(x.max() > 0)
        torch.repeat_interleave(x[:3], torch.tensor([1, 2, 3]))
    assert len(c.seen) == 6, c.seen
    with counting() as c:  # the device path's replacements do not synchronise
        torch.nonzero_static(x > 0, size=10)
        torch.repeat_interleave(x[:3], torch.tensor([1, 2, 3]), output_size=6)
        x.index_fill_(0, torch.tensor([1, 2]), 0)
    assert c.seen == []


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("compressor", available_compressors())
def test_at_most_one_host_read_per_buffer(hvd, compressor, kernels, paths):
    """Every compressor: during back-propagation (the hooks launch each buffer when it is full) at
    most one host read per buffer — its selected count, which sizes its collective — and the same
    bound for ``synchronize()``'s decode and write-back; steps after the first, when layouts and
    thresholds exist (the first step builds them: its reads are counted too, and bounded alike)."""
    if kernels == "triton":
        pytest.importorskip("triton")
    paths(device_path=True, kernels_=kernels)
    torch.manual_seed(0)
    x, y, _, _ = load_digits_split()
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(), min_selected=0,
                                   compressor=compressor, density=None if compressor == "none" else 0.05,
                                   fusion=NaivePlanner(capacity_bytes=4096))
    buffers = len(opt.plan.buffers)
    assert buffers > 2
    for step in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(x[step * 64:(step + 1) * 64]), y[step * 64:(step + 1) * 64])
        with counting() as backward:
            loss.backward()
        with counting() as sync:
            opt.synchronize()
        assert len(backward.seen) <= buffers, (step, backward.seen)
        assert len(sync.seen) <= buffers, (step, sync.seen)
        if compressor != "none":
            assert 0 < opt.last_stats.selected < opt.last_stats.elements
        with opt.skip_synchronize():
            opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_host_path_would_not_pass(hvd, monkeypatch):
    """The bound is not loose: DGC's CPU path (NumPy decisions per segment) reads far more than
    one value per buffer back, and the counter sees it."""
    torch.manual_seed(0)
    x, y, _, _ = load_digits_split()
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(), min_selected=0,
                                   compressor="dgc", density=0.05, fusion=NaivePlanner(capacity_bytes=4096))
    F.cross_entropy(model(x[:64]), y[:64]).backward()
    opt.synchronize()
    opt.zero_grad()
    loss = F.cross_entropy(model(x[64:128]), y[64:128])
    with counting() as backward:
        loss.backward()
    assert len(backward.seen) > 2 * len(opt.plan.buffers)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("compressor", ["dgc", "topk", "exdyna"])
def test_device_path_conserves_every_element(hvd, compressor, kernels, paths):
    """Error feedback on the device path, with the selection written straight into the wire and
    zeroed in the buffer by the kernels: ``residual_after + sent == residual_before + grad`` per
    parameter, exactly (one worker: what is sent arrives unscaled)."""
    if kernels == "triton":
        pytest.importorskip("triton")
    from test_error_feedback import run_steps

    paths(device_path=True, kernels_=kernels)
    planner = NaivePlanner(capacity_bytes=4096)
    for opt, model, _ in run_steps(hvd, steps=3, compressor=compressor, density=0.02, fusion=planner):
        assert opt.last_stats.missing == 0 and 0 < opt.last_stats.density < 0.2


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("compressor", [c for c in available_compressors() if c != "none"])
def test_an_empty_tensor_selects_nothing_and_changes_nothing(compressor, device_path, paths):
    """A parameter with no elements is a segment of size 0: it selects nothing, the others select
    as without it, and nothing warns (no 0/0 in a segment's mean) — on both paths."""
    from horovod_safusion.compressors import make_compressor
    from horovod_safusion.segment import Segments

    paths(device_path=device_path)

    def run(segments):
        c = make_compressor(compressor, 0.02)
        torch.manual_seed(0)
        flat = torch.randn(800)
        for step in range(3):
            if device_path:
                proposal = c.propose(flat, segments, step)
                total, _ = proposal.read()
                proposal.commit()
                idx = proposal.take(total)[1]
            else:
                idx = c.select(flat, segments, step)
                flat.index_fill_(0, idx, 0)
        return segments.counts(idx).tolist()

    with_empty = run(Segments(("a", "empty", "b"), (500, 0, 300)))
    assert with_empty[1] == 0
    assert [with_empty[0], with_empty[2]] == run(Segments(("a", "b"), (500, 300)))
