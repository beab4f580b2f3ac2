"""The small tensors a job sends whole (``min_selected``, ``dense_share``) as the planner and the
simulator see them: left out of the buffers that select, and priced by the dense allreduce."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from horovod_safusion.fusion import CostCurve, Profile, SAFusionPlanner, simulate
from horovod_safusion.plan import FusionPlan, send_small_dense, small_tensors
from synthetic import synthetic_profile


def sparse_job(sizes, min_selected=0, dense_share=0.0, dense_per_byte=1e-8, density=0.03) -> Profile:
    """A sparse job over the allgather (8-byte rows, 1 ms + 1 ns a byte per message), compression
    0.1 ms + 1 ns a byte, 0.2 ms of fixed work per buffer, a tensor ready every millisecond, and
    Horovod's dense allreduce priced at 50 µs + ``dense_per_byte`` s a byte."""
    p = synthetic_profile(sizes, [1e-3 * i for i in range(len(sizes))], cp=(1e-4, 1e-9), cm=(1e-3, 1e-9),
                          buffer_cost=2e-4)
    big = 4 * sum(sizes) + 4
    return dataclasses.replace(p, density=density, dense_comm=False, min_selected=min_selected,
                               dense_share=dense_share,
                               dense_allreduce=CostCurve([0, big], [5e-5, 5e-5 + dense_per_byte * big]))


def test_the_simulator_prices_a_dense_buffer_by_the_dense_allreduce_with_no_compression():
    profile = sparse_job([400_000, 4_000, 40_000, 800])
    sparse = FusionPlan([["t0", "t2"], ["t1", "t3"]])
    whole = dataclasses.replace(sparse, dense_buffers=(1,))
    rows, dense_rows = simulate(profile, sparse).buffers, simulate(profile, whole).buffers
    assert dense_rows[0] == rows[0]  # the buffer that selects is priced as before
    names = ["t1", "t3"]
    b = dense_rows[1]
    assert b.t_cp == profile.buffer_cost  # nothing selected: the buffer's fixed work alone
    assert b.t_cm == pytest.approx(profile.dense_allreduce(profile.dense_bytes(names)))
    assert b.message_bytes == profile.dense_bytes(names) == 4_000 + 800
    # selected, the same buffer was priced by the allgather's curve at its rows' bytes
    assert rows[1].t_cm == profile.t_cm(names) != b.t_cm and rows[1].message_bytes < b.message_bytes
    # a profile with no dense curve prices it as the sparse buffer it was part of
    unpriced = dataclasses.replace(profile, dense_allreduce=None)
    assert simulate(unpriced, whole).buffers[1].t_cm == rows[1].t_cm


def test_profiles_keep_the_jobs_rule_through_json():
    p = sparse_job([400_000, 4_000], min_selected=64, dense_share=0.15)
    q = Profile.from_dict(p.to_dict())
    assert (q.min_selected, q.dense_share) == (64, 0.15) and q.small() == p.small() == {"t1"}
    assert Profile.from_dict({k: v for k, v in p.to_dict().items()
                              if k not in ("min_selected", "dense_share")}).small() == frozenset()


def test_a_dense_curve_swept_for_the_small_tensors_alone_prices_them_and_no_dense_plan():
    """A ``dense=False`` job sweeps the dense allreduce only up to the bytes of the tensors it sends
    whole (``prices_dense=False``): a saved copy re-planned under ``dense="auto"`` (the plan CLI)
    plans sparse, not a dense plan priced by extrapolating that curve, and says why where asked
    for dense; the small tensors are still priced by the curve."""
    p = sparse_job([400_000, 4_000, 40_000, 800], min_selected=64, dense_per_byte=1e-12)
    assert SAFusionPlanner().plan(p.tensors, p).dense  # priced over the model, dense is cheaper here
    q = Profile.from_dict(dataclasses.replace(p, prices_dense=False).to_dict())
    assert q.prices_dense is False and Profile.from_dict(
        {k: v for k, v in p.to_dict().items() if k != "prices_dense"}).prices_dense is True
    plan = SAFusionPlanner().plan(q.tensors, q)
    assert not plan.dense and plan.dense_buffers and "dense" not in plan.meta.get("predicted_options_s", {})
    whole = [n for i in plan.dense_buffers for n in plan.buffers[i]]
    row = simulate(q, plan).buffers[plan.dense_buffers[0]]
    assert row.t_cm == pytest.approx(q.dense_allreduce(q.dense_bytes(plan.buffers[plan.dense_buffers[0]])))
    assert set(whole) == q.small()
    with pytest.raises(ValueError, match="prices_dense is False: its job swept the dense allreduce"):
        SAFusionPlanner(dense=True).plan(q.tensors, q)
    with pytest.raises(ValueError, match=r"covers only the tensors its job sent whole \(prices_dense=False"):
        q.as_dense()


sizes = st.lists(st.integers(1, 400).map(lambda n: 4 * n * n), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(sizes=sizes, min_selected=st.sampled_from([0, 1, 64, 2_000]), share=st.sampled_from([0.0, 0.15, 0.5]),
       per_byte=st.sampled_from([1e-10, 1e-8, 1e-6]))
def test_the_planner_sizes_what_selects_and_places_the_rest_as_the_controller_would(sizes, min_selected, share,
                                                                                    per_byte):
    """The sparse plan holds every tensor once; its dense buffers hold exactly the tensors the job
    sends whole, so that the controller's own rule moves nothing (it runs the plan that was
    priced); the buffers that select are the plan of the other tensors alone; and its prediction
    is the simulator's for it, dense buffers included."""
    profile = sparse_job(sizes, min_selected, share, per_byte)
    chosen = SAFusionPlanner().plan(profile.tensors, profile)
    plan = chosen if not chosen.dense else FusionPlan.from_dict(chosen.meta["runner_up"])
    numel = {t.name: t.numel for t in profile.tensors}
    group = {t.name: t.group for t in profile.tensors}
    plan.validate(profile.names, numel)
    small = small_tensors(profile.names, numel, profile.density, min_selected, share)
    assert {n for i in plan.dense_buffers for n in plan.buffers[i]} == small
    assert send_small_dense(plan, numel, group, profile.density, min_selected, share) == plan
    selecting = tuple(b for i, b in enumerate(plan.buffers) if i not in plan.dense_buffers)
    rest = dataclasses.replace(profile.without(small), min_selected=0)
    assert selecting == (SAFusionPlanner(dense=False).plan(rest.tensors, rest).buffers if rest.tensors else ())
    assert plan.meta["predicted_iteration_s"] == pytest.approx(simulate(profile, plan).iteration)
    assert plan.meta["predicted_sparse_s"] == pytest.approx(simulate(profile, plan).iteration)


def test_each_density_option_sends_whole_what_that_density_would_and_its_prediction_holds_them():
    """density="auto": a tensor of 1,000 elements selects 30 a step at 0.03 (below min_selected=64,
    so it goes whole) and 100 at 0.1 (selected); each option's plan and prediction hold its own."""
    base = sparse_job([400_000, 4_000, 40_000], min_selected=64, dense_per_byte=1e-7)
    profile = dataclasses.replace(base, densities={d: (base.compress, 0.0) for d in (0.03, 0.1)})
    plan = SAFusionPlanner().plan(profile.tensors, profile)
    plans = [plan] + ([FusionPlan.from_dict(plan.meta["runner_up"])] if plan.meta["runner_up"] else [])
    seen = set()
    for p in plans:
        if p.dense:
            continue
        seen.add(p.density)
        at = profile.at(p.density)
        expected = {"t1"} if p.density == 0.03 else set()
        assert {n for i in p.dense_buffers for n in p.buffers[i]} == at.small() == expected
        assert p.meta["predicted_iteration_s"] == pytest.approx(simulate(at, p).iteration)
        assert p.meta["predicted_options_s"][f"{p.density:g}"] == pytest.approx(simulate(at, p).iteration)
    assert seen == {0.03, 0.1}, plans
