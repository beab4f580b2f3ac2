"""FusionPlan as data: validation, JSON, digest; the fixed-capacity planner."""
import os
import sys

import pytest
from hypothesis import given, strategies as st

from horovod_safusion.fusion import GroupsPlanner, NaivePlanner, TensorInfo, make_planner
from horovod_safusion.plan import (DENSE_SHARE, MIN_SELECTED, FusionPlan, send_small_dense, smallest_within,
                                   split_by_capacity)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from digits import DigitsCNN  # noqa: E402
from models import LSTMLanguageModel  # noqa: E402


def test_json_round_trip_and_digest():
    plan = FusionPlan([["c", "b"], ["a"]], order="behind", planner="x", meta={"k": 1})
    back = FusionPlan.from_json(plan.to_json())
    assert back == plan and back.meta == {"k": 1}
    assert back.digest() == plan.digest()
    assert FusionPlan([["c"], ["b", "a"]], order="behind").digest() != plan.digest()
    assert FusionPlan([["c", "b"], ["a"]], order="ahead").digest() != plan.digest()
    dense = FusionPlan([["c", "b"], ["a"]], order="behind", dense_buffers=(1,))
    assert FusionPlan.from_json(dense.to_json()) == dense and dense.digest() != plan.digest()
    assert "dense buffers differ" in plan.first_difference(dense)
    with pytest.raises(ValueError, match=r"dense_buffers \[2\] are not buffers of this plan \(it has 2\)"):
        FusionPlan([["c", "b"], ["a"]], dense_buffers=(2,))


def test_validate_names_each_trainable_once():
    FusionPlan([["a", "b"], ["c"]]).validate(["c", "b", "a"])
    with pytest.raises(ValueError, match="'b' appears in fusion buffers 0 and 1"):
        FusionPlan([["a", "b"], ["b", "c"]]).validate(["a", "b", "c"])
    with pytest.raises(ValueError, match="misses trainable parameters: \\['c'\\]"):
        FusionPlan([["a", "b"]]).validate(["a", "b", "c"])
    with pytest.raises(ValueError, match="not trainable parameters: \\['z'\\]"):
        FusionPlan([["a", "z"]]).validate(["a"])
    with pytest.raises(ValueError, match="more than int32"):
        FusionPlan([["a", "b"]]).validate(["a", "b"], {"a": 2**30, "b": 2**30})
    with pytest.raises(ValueError, match="order must be one of"):
        FusionPlan([["a"]], order="sideways")
    with pytest.raises(ValueError, match="buffer 1 is empty"):
        FusionPlan([["a"], []])


def test_first_difference_names_the_buffer():
    a = FusionPlan([["x", "y"], ["z"]])
    assert a.first_difference(a) is None
    assert "fusion buffer 0 differs" in a.first_difference(FusionPlan([["x"], ["y", "z"]]))
    assert "order differs" in a.first_difference(FusionPlan([["x", "y"], ["z"]], order="behind"))


names_and_sizes = st.lists(st.integers(1, 10_000), min_size=1, max_size=60).map(
    lambda sizes: ([f"t{i}" for i in range(len(sizes))], sizes))


@given(names_and_sizes, st.integers(1, 20_000))
def test_split_by_capacity_keeps_order_and_capacity(ns, capacity):
    names, sizes = ns
    nbytes = dict(zip(names, sizes))
    buffers = split_by_capacity(names, nbytes, capacity)
    assert [n for b in buffers for n in b] == names  # every tensor once, order kept
    for b in buffers:
        assert len(b) == 1 or sum(nbytes[n] for n in b) <= capacity
    for b, nxt in zip(buffers, buffers[1:]):  # greedy: the next tensor did not fit
        assert sum(nbytes[n] for n in b) + nbytes[nxt[0]] > capacity


def test_naive_planner_closes_buffers_at_capacity_and_dtype_change():
    ts = [TensorInfo("a", 100, 4, "f32"), TensorInfo("b", 100, 4, "f32"), TensorInfo("c", 100, 4, "f32"),
          TensorInfo("d", 10, 2, "f16"), TensorInfo("e", 10, 4, "f32")]
    plan = NaivePlanner(capacity_bytes=800).plan(ts)
    assert plan.buffers == (("a", "b"), ("c",), ("d",), ("e",))
    assert plan.order == "ahead" and plan.planner == "safusion-naive"
    assert make_planner("safusion-naive").capacity_bytes == 25 * 2**20
    with pytest.raises(ValueError, match="unknown fusion 'nope'; known fusion planners: .*safusion-naive"):
        make_planner("nope")
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        NaivePlanner(0)


def test_groups_planner_matches_horovod_groups():
    ts = [TensorInfo(n, 10, 4, "f32") for n in "abcde"]
    assert GroupsPlanner(2).plan(ts).buffers == (("a", "b", "c"), ("d", "e"))
    plan = GroupsPlanner([["e", "a"]]).plan(ts)
    assert plan.buffers == (("b",), ("c",), ("d",), ("a", "e"))


@given(st.lists(st.tuples(st.integers(1, 20_000), st.integers(0, 1)), min_size=1, max_size=40),
       st.integers(1, 8), st.sampled_from([0.001, 0.01, 0.1, 0.5]), st.integers(0, 200),
       st.sampled_from([0.0, 0.05, 0.15, 0.5, 0.99]))
def test_send_small_dense_moves_exactly_the_small_tensors(tensors, per_buffer, density, min_selected, share):
    """Every tensor with ceil(density * numel) < min_selected, and every one of the smallest that
    together hold at most ``share`` of the elements, ends in a dense buffer of its group (dtype and
    device), in plan order; the others keep their buffers and order; applying the rule again
    changes nothing; min_selected=0 sparsifies every tensor."""
    names = [f"t{i}" for i in range(len(tensors))]
    numel = {n: size for n, (size, _) in zip(names, tensors)}
    group = {n: g for n, (_, g) in zip(names, tensors)}
    plan = FusionPlan([names[i:i + per_buffer] for i in range(0, len(names), per_buffer)], planner="p")
    out = send_small_dense(plan, numel, group, density, min_selected, share)
    out.validate(names)
    by_size = sorted(names, key=lambda n: (numel[n], n))
    total = sum(numel.values())
    within = {n for i, n in enumerate(by_size) if sum(numel[m] for m in by_size[:i + 1]) <= share * total}
    small = [n for n in names if min_selected > 0 and (-(-density * numel[n] // 1) < min_selected or n in within)]
    dense = [n for i in out.dense_buffers for n in out.buffers[i]]
    assert sorted(dense) == sorted(small)
    for i in out.dense_buffers:
        assert len({group[n] for n in out.buffers[i]}) == 1
        assert list(out.buffers[i]) == [n for n in names if n in out.buffers[i]]
    sparse = [[n for n in b if n not in small] for b in plan.buffers]
    assert [list(b) for i, b in enumerate(out.buffers) if i not in out.dense_buffers] == [b for b in sparse if b]
    assert send_small_dense(out, numel, group, density, min_selected, share) == out
    assert send_small_dense(FusionPlan(plan.buffers, dense=True), numel, group, density, min_selected,
                            share).dense_buffers == ()


@given(st.dictionaries(st.text("abc", min_size=1, max_size=3), st.integers(1, 1000), min_size=1, max_size=12),
       st.floats(0, 1))
def test_smallest_within_is_the_longest_run_of_the_smallest_under_the_share(numel, share):
    """The chosen tensors are the first ones in (size, name) order, hold at most ``share`` of the
    elements, and the next one would take them past it."""
    order = sorted(numel, key=lambda n: (numel[n], n))
    chosen = smallest_within(list(reversed(order)), numel, share)
    run = order[:len(chosen)]
    assert set(run) == chosen
    total = sum(numel.values())
    assert sum(numel[n] for n in run) <= share * total
    if len(run) < len(order):
        assert sum(numel[n] for n in order[:len(run) + 1]) > share * total


def test_the_share_sends_an_lstms_recurrent_weights_whole_and_no_large_cnn_layer():
    """With the default share, the benchmarks' LSTM (the models themselves, as the benchmarks
    build them) sends its recurrent weights whole and keeps its embedding and decoder sparse; the
    digits CNN keeps every layer above the count rule sparse, as without the share."""
    lstm = LSTMLanguageModel(4000, embed=128, hidden=128, layers=1, dropout=0.2)
    cnn = DigitsCNN(width=64)
    for model, expect in ((lstm, {"lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.bias_ih_l0", "lstm.bias_hh_l0",
                                  "decoder.bias"}),
                          (cnn, {n for n, p in cnn.named_parameters() if -(-0.03 * p.numel() // 1) < MIN_SELECTED})):
        numel = {n: p.numel() for n, p in model.named_parameters()}
        plan = FusionPlan([list(numel)], planner="p")
        out = send_small_dense(plan, numel, {n: 0 for n in numel}, 0.03, MIN_SELECTED, DENSE_SHARE)
        assert {n for i in out.dense_buffers for n in out.buffers[i]} == expect
        without = send_small_dense(plan, numel, {n: 0 for n in numel}, 0.03, MIN_SELECTED, 0.0)
        assert (out == without) == (model is cnn)
