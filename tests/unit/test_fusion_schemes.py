"""The baseline fusion schemes (wfbp, oktopk, horovod, fusion degree) and selection behind fusion,
through the real optimizer in a one-worker Horovod job."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horovod_safusion as saf
from horovod_safusion.fusion import FusionDegreePlanner, TensorInfo, make_planner


def infos(n):
    return [TensorInfo(f"t{i}", 10 * (i + 1), 4, "f32") for i in range(n)]


@pytest.mark.parametrize("degree,sizes", [(0.0, [1] * 8), (0.25, [2] * 4), (0.5, [4, 4]), (0.75, [6, 2]), (1.0, [8])])
def test_fusion_degree_cuts_consecutive_buffers(degree, sizes):
    plan = FusionDegreePlanner(degree).plan(infos(8))
    assert [len(b) for b in plan.buffers] == sizes and plan.names == [f"t{i}" for i in range(8)]
    assert plan.order == "behind"


def test_baselines_by_name_and_groups_never_mixed():
    tensors = infos(4)[:2] + [TensorInfo("h0", 7, 2, "f16")] + infos(4)[2:]
    buffers = lambda planner: [list(b) for b in make_planner(planner).plan(tensors).buffers]
    assert buffers("wfbp") == [[t.name] for t in tensors]
    assert buffers("oktopk") == [["t0", "t1"], ["h0"], ["t2", "t3"]]
    assert make_planner("horovod").dense and not make_planner("oktopk").dense
    with pytest.raises(ValueError, match="degree must satisfy 0 <= degree <= 1, got 1.5"):
        FusionDegreePlanner(1.5)


def model_and_grads(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 10))
    return m, torch.optim.SGD(m.parameters(), lr=0.0)


def backward(m):
    g = torch.Generator().manual_seed(1)
    F.cross_entropy(m(torch.randn(16, 20, generator=g)), torch.randint(10, (16,), generator=g)).backward()


def local_grads(m):
    backward(m)
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("order", ["behind", "ahead"])
def test_selection_behind_is_global_top_k_and_ahead_is_per_tensor(hvd, order):
    m, sgd = model_and_grads()
    grads = local_grads(m)
    m.zero_grad()
    opt = saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), min_selected=0, compressor="topk", density=0.05,
                                   fusion=FusionDegreePlanner(1.0, order))
    backward(m)
    opt.step()
    names = opt.plan.buffers[0]
    flat = torch.cat([grads[n].reshape(-1) for n in names])
    sizes = [grads[n].numel() for n in names]
    if order == "behind":  # one selection over the whole buffer: exactly the global top-k
        want = set(torch.topk(flat.abs(), round(0.05 * flat.numel())).indices.tolist())
    else:
        want, off = set(), 0
        for n in sizes:
            want |= {off + i for i in torch.topk(flat[off:off + n].abs(), max(1, round(0.05 * n))).indices.tolist()}
            off += n
    got = torch.cat([dict(m.named_parameters())[n].grad.reshape(-1) for n in names])
    assert set(torch.nonzero(got).flatten().tolist()) == want
    assert torch.equal(got[sorted(want)], flat[sorted(want)])  # one worker: the values themselves
    missing = sum(1 for s in got.split(sizes) if not s.any())
    assert opt.last_stats.missing == missing and (order == "behind" or missing == 0)


def test_horovod_scheme_is_dense_and_rejects_a_sparsifier(hvd):
    m, sgd = model_and_grads()
    grads = local_grads(m)
    m.zero_grad()
    opt = saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), fusion="horovod")
    assert opt.compressor.dense and opt.communicator.dense and len(opt.plan.buffers) == 4
    backward(m)
    opt.step()
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, grads[n])
    m2, sgd2 = model_and_grads()
    with pytest.raises(ValueError, match="fusion='horovod' is a dense scheme .* compressor='dgc'"):
        saf.DistributedOptimizer(sgd2, named_parameters=m2.named_parameters(), fusion="horovod", compressor="dgc")
