"""Fusion buffers across a plan switch: the residuals move into the new plan's planes, and the old
plan's storage goes once no residual lives in it (``buffer.gather``)."""
import pytest
import torch

import horovod_safusion as saf
from horovod_safusion import FusionPlan
from horovod_safusion.memory import held


def residual_storages(opt) -> int:
    """Bytes of the distinct storages the residuals live in."""
    storages = {}
    for name in opt.residuals.names():
        r = opt.residuals.peek(name)
        storages[r.untyped_storage().data_ptr()] = r.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("regroup", ["runs of the old order, swapped", "half kept, half reordered", "interleaved"])
def test_a_plan_switch_keeps_every_residual_and_no_old_storage(hvd, regroup):
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(60, 60) for _ in range(4)])
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
                                   fusion="wfbp", min_selected=0, dense=False)

    def step():
        opt.zero_grad()
        m(torch.randn(8, 60)).sum().backward()
        opt.step()

    step()
    step()
    model = sum(p.numel() * p.element_size() for p in m.parameters())
    names = [n for b in opt.plan.buffers for n in b]
    before = {n: opt.residuals.peek(n).clone() for n in names}
    assert residual_storages(opt) == model
    buffers = {"runs of the old order, swapped": [names[4:], names[:4]],
               "half kept, half reordered": [names[:4], [names[5], names[4], *names[6:]]],
               "interleaved": [names[::2], names[1::2]]}[regroup]
    held_before = held(opt).bytes
    opt.set_plan(FusionPlan(buffers, order=opt.plan.order, planner="test"))
    assert all(torch.equal(opt.residuals.peek(n), before[n]) for n in names)  # moved, bit for bit
    assert residual_storages(opt) == model  # no old storage pinned by the buffers that kept a run of it
    assert held(opt).bytes <= held_before
    step()
    assert residual_storages(opt) == model


def test_a_step_leaves_nothing_of_itself_on_the_buffers(hvd):
    """A fusion buffer keeps only what lives across steps (its plan's segments, its planes); what a
    step makes of it — the fill, the selection, the collective in flight — is a record of the
    stages (``stages.record``), so a step adds no attribute to a buffer and rebinds none but its
    planes and, once every rank agreed which gradients are spread, its segments with their floors,
    on a sparse step, with a parameter that got no gradient, and on a dense one."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 40), torch.nn.Linear(40, 4))
    opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=m.named_parameters(), fusion="wfbp", min_selected=0,
                                   dense=False, warmup_steps=1, warmup_schedule="dense")
    buffers = opt.controller.buffers
    fields = [dict(vars(b)) for b in buffers]
    planes = {"flat", "momentum"}

    for step in range(3):  # a dense warm-up step, then sparse ones; the last without m[1]'s gradient
        opt.zero_grad()
        x = torch.randn(8, 40)
        (m[2](m[0](x)) if step == 2 else m(x)).sum().backward()
        opt.step()
        for buf, before in zip(buffers, fields):
            now = vars(buf)
            assert set(now) == set(before), f"step {step} left {sorted(set(now) - set(before))} on a buffer"
            assert all(now[k] is before[k] for k in before if k not in planes | {"segments", "selection"})
            for k in ("segments", "selection"):
                assert (now[k].names, now[k].sizes) == (before[k].names, before[k].sizes)
            assert (now["selection"] is now["segments"]) == (before["selection"] is before["segments"])
    assert all(b.selection.floors for b in buffers if not b.dense)  # every gradient of the MLP is spread
    assert opt.controller.last_stats.selected < opt.controller.last_stats.elements  # the last step was sparse
