"""The drop-in contract, in a one-worker Horovod job: arguments, errors and warnings as Horovod's."""
import inspect
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horovod_safusion as saf


def model_and_sgd(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def backward(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    F.mse_loss(m(torch.randn(4, 6, generator=g)), torch.randn(4, 3, generator=g)).backward()


def test_signature_keeps_horovods_positions(hvd):
    ours = list(inspect.signature(saf.DistributedOptimizer).parameters.values())
    theirs = list(inspect.signature(hvd.DistributedOptimizer).parameters.values())
    assert [(p.name, p.default, p.kind) for p in ours[:len(theirs)]] == \
           [(p.name, p.default, p.kind) for p in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs):])


def test_returns_a_subclass_of_the_users_optimizer(hvd):
    m, sgd = model_and_sgd()
    opt = saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.plan.names == [n for n, _ in reversed(list(m.named_parameters()))]
    torch.optim.lr_scheduler.StepLR(opt, 1)  # schedulers accept it


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_ops_without_sparse_meaning_are_rejected(hvd, op):
    m, sgd = model_and_sgd()
    with pytest.raises(ValueError, match=f"op=hvd.{op} cannot be used with sparse aggregation.*hvd.Average or op=hvd.Sum"):
        saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), op=getattr(hvd, op))


def test_horovods_argument_errors_are_horovods(hvd):
    m, sgd = model_and_sgd()
    named = list(m.named_parameters())
    cases = [
        (dict(named_parameters=[named[0][1]]), "named_parameters should be a sequence of tuples"),
        (dict(named_parameters=[("a", named[0][1]), ("a", named[1][1])] + named[2:]),
         "Parameter names in named_parameters must be unique. Found duplicates: a"),
        (dict(named_parameters=named[:2]), "named_parameters was specified, but one or more model parameters were not named"),
        (dict(backward_passes_per_step=0), "backward_passes_per_step must be > 0"),
        (dict(gradient_predivide_factor=2.0, op=hvd.Sum), "gradient_predivide_factor not supported with op != Average"),
        (dict(groups=-1), "groups should be a non-negative integer or a list of list of torch.Tensor."),
        (dict(groups=[[1]]), "groups must consist of torch.Tensor."),
        (dict(groups=[[named[0][1]], [named[0][1]]]), "A parameter can only appear once in groups."),
    ]
    for kwargs, message in cases:
        for api in (hvd.DistributedOptimizer, saf.DistributedOptimizer):
            with pytest.raises(ValueError) as err:
                api(sgd, **kwargs)
            assert message in str(err.value), (api, kwargs)


def test_safusion_option_errors_name_the_bad_value(hvd):
    m, sgd = model_and_sgd()
    kw = dict(named_parameters=list(m.named_parameters()))
    with pytest.raises(ValueError, match="unknown compressor 'gzip'; known compressors: .*dgc.*topk"):
        saf.DistributedOptimizer(sgd, compressor="gzip", **kw)
    with pytest.raises(ValueError, match="unknown fusion 'best'; known fusion planners: .*safusion-naive"):
        saf.DistributedOptimizer(sgd, fusion="best", **kw)
    with pytest.raises(ValueError, match="unknown communicator 'pigeon'; known communicators: auto, allgather, allreduce"):
        saf.DistributedOptimizer(sgd, communicator="pigeon", **kw)
    with pytest.raises(ValueError, match="density must satisfy 0 < density <= 1, got 2"):
        saf.DistributedOptimizer(sgd, density=2, **kw)
    with pytest.raises(ValueError, match="groups=2 and fusion='safusion-naive' both define"):
        saf.DistributedOptimizer(sgd, groups=2, fusion="safusion-naive", **kw)


def test_num_groups_is_deprecated_like_horovod_and_becomes_the_plan(hvd):
    m, sgd = model_and_sgd()
    with pytest.warns(DeprecationWarning, match="Parameter `num_groups` has been replaced by `groups`"):
        opt = saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), num_groups=2, min_selected=0)
    assert len(opt.plan.buffers) == 2
    # with the default floor this model's tensors are all small: one dense buffer, sent whole
    m, sgd = model_and_sgd()
    with pytest.warns(DeprecationWarning):
        opt = saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), num_groups=2)
    assert opt.plan.dense_buffers == (0,) and len(opt.plan.buffers) == 1
    with pytest.raises(ValueError, match="min_selected must be an integer >= 0 .*got -1"):
        saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), min_selected=-1)
    for bad in (-0.1, 1, 1.5, "0.1", True):
        with pytest.raises(ValueError, match=r"dense_share must be a number with 0 <= dense_share < 1 .*got "
                                             + re.escape(repr(bad))):
            saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), dense_share=bad)


def test_step_zero_grad_and_backward_passes_contract(hvd):
    m, sgd = model_and_sgd()
    opt = saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), compressor="none")
    backward(m)
    with pytest.raises(AssertionError, match="optimizer.zero_grad\\(\\) was called after loss.backward\\(\\) "
                                             "but before optimizer.step\\(\\) or optimizer.synchronize\\(\\)"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="Gradients were computed more than backward_passes_per_step times"):
        backward(m)
    opt.synchronize()
    with pytest.warns(UserWarning, match="optimizer.step\\(\\) called without optimizer.skip_synchronize\\(\\)"):
        opt.step()
    opt.zero_grad()
    backward(m)
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    opt.set_backward_passes_per_step(2)
    opt.zero_grad()
    backward(m)
    backward(m)  # two passes are now allowed before step()
    opt.step()


def test_unsupported_gradients_fail_clearly(hvd):
    emb = nn.Embedding(10, 4, sparse=True)
    opt = saf.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())
    with pytest.raises(ValueError, match="parameter 'weight' has a sparse gradient.*sparse_as_dense=True"):
        emb(torch.tensor([1, 2])).sum().backward()

    emb = nn.Embedding(10, 4, sparse=True)
    opt = saf.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=True,
                                   compressor="none")
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse

    p = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="dtype torch.complex64; horovod_safusion fuses floating-point"):
        saf.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("c", p)])


def test_state_dict_keeps_this_ranks_residuals(hvd):
    m, sgd = model_and_sgd()
    opt = saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), min_selected=0, compressor="topk",
                                   density=0.1, critical_regimes=None)
    backward(m)
    opt.step()
    state = opt.state_dict()
    held = {n: r.clone() for n, r in state["safusion"]["ranks"][0]["residuals"].items()}
    assert any(r.abs().sum() > 0 for r in held.values())
    m2, sgd2 = model_and_sgd()
    opt2 = saf.DistributedOptimizer(sgd2, named_parameters=m2.named_parameters(), min_selected=0, compressor="topk", density=0.1)
    opt2.load_state_dict(state)
    for n, r in held.items():
        assert torch.equal(opt2.residuals.get(n, r), r)
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_broadcast_optimizer_state_does_not_synchronise(hvd):
    m, _ = model_and_sgd()
    opt = saf.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01), named_parameters=m.named_parameters())
    before = [p.detach().clone() for p in m.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.controller.steps == 0  # the base class's step() initialised the state
    assert len(opt.state_dict()["state"]) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_options_are_declared_once_for_signature_docstring_and_errors(hvd):
    from dataclasses import fields
    from horovod_safusion.options import Options
    names = [f.name for f in fields(Options)]
    params = inspect.signature(saf.DistributedOptimizer).parameters
    assert [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY] == names
    assert all(params[f.name].default == f.default for f in fields(Options))
    assert all(f"        {n}:\n" in saf.DistributedOptimizer.__doc__ for n in names)
    m, sgd = model_and_sgd()
    with pytest.raises(TypeError, match="DistributedOptimizer\\(\\) got an unexpected keyword argument 'densty'"):
        saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), densty=0.1)
    with pytest.raises(ValueError, match="error_feedback must be one of 'classic', 'ef21-sgdm', got 'ef22'"):
        saf.DistributedOptimizer(sgd, named_parameters=m.named_parameters(), error_feedback="ef22")
