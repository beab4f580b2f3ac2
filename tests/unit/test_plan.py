"""FusionPlan as data: validation, JSON, digest; the fixed-capacity planner."""
import pytest
from hypothesis import given, strategies as st

from horovod_safusion.fusion import GroupsPlanner, NaivePlanner, TensorInfo, make_planner
from horovod_safusion.plan import FusionPlan, split_by_capacity


def test_json_round_trip_and_digest():
    plan = FusionPlan([["c", "b"], ["a"]], order="behind", planner="x", meta={"k": 1})
    back = FusionPlan.from_json(plan.to_json())
    assert back == plan and back.meta == {"k": 1}
    assert back.digest() == plan.digest()
    assert FusionPlan([["c"], ["b", "a"]], order="behind").digest() != plan.digest()
    assert FusionPlan([["c", "b"], ["a"]], order="ahead").digest() != plan.digest()


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
