"""The communicator contract in one process: :class:`Reduction`'s scaling, :class:`Outgoing`'s
target, the shared decode into the segments' tensors (equal indices add up), tag-keyed state, and ExDyna's Algorithm 5
driven through ``Pending.feedback`` → ``Compressor.feedback`` rather than a side channel."""
import numpy as np
import pytest
import torch

from horovod_safusion.communicators import (Allgather, Allreduce, ExDynaCommunicator, Outgoing, Reduction, ScaleCom,
                                            SparDL, Target, Zen)
from horovod_safusion.compressors import make_compressor
from horovod_safusion.segment import Segments


def test_reduction_scales_as_horovod(hvd):
    avg, total = Reduction(hvd.Average, 0.5, 2.0), Reduction(hvd.Sum)
    assert avg.average and not total.average
    assert avg.scale(4) == 0.5 and total.scale(4) == 1.0
    x = torch.tensor([1.0, -3.0])
    assert torch.equal(avg.prescaled(x), x * 0.5) and torch.equal(avg.unprescaled(avg.prescaled(x)), x)
    assert total.prescaled(x) is x and total.unprescaled(x) is x


def target_of(sizes, fill=float("nan")):
    """A :class:`Target` of one tensor per segment, filled with junk that decoding must clear."""
    tensors = tuple(torch.full((n,), fill) for n in sizes)
    return Target(tensors, np.cumsum([0, *sizes]))


def test_outgoing_of_a_dense_step_is_its_target():
    target = target_of((3, 2), 1.0)
    dense = Outgoing("0", None, None, 5, target=target)
    assert dense.dtype == torch.float32 and dense.device == torch.device("cpu") and dense.residual is None
    picked = torch.tensor([4, 1])
    out = Outgoing("0", torch.ones(2, dtype=torch.float64)[picked - picked], picked, 5)
    assert out.dtype == torch.float64 and out.rows is None and out.target is None


@pytest.mark.parametrize("communicator", [Allgather, Allreduce, SparDL, ScaleCom, lambda **kw: Zen(seed=1, **kw)])
@pytest.mark.parametrize("op,prescale,postscale", [("Average", 0.5, 2.0), ("Sum", 1.0, 1.0)])
def test_one_worker_start_writes_the_scaled_selection_into_the_target(hvd, communicator, op, prescale, postscale):
    comm = communicator(process_set=hvd.global_process_set, compression=hvd.Compression.none)
    reduction = Reduction(getattr(hvd, op), prescale, postscale)
    indices = torch.tensor([7, 2, 5])
    values = torch.tensor([1.5, -2.0, 4.0])
    target = target_of((4, 6))
    assert comm.start(Outgoing("t", values, indices, 10, target=target), reduction).wait() is None
    expected = torch.zeros(10)
    expected[indices] = values * prescale * postscale
    assert torch.equal(torch.cat(target.tensors), expected)
    if comm.dense:  # a dense step: the target holds the gradients, reduced in place
        dense = torch.randn(10)
        target = Target((dense[:4].clone(), dense[4:].clone()), np.array([0, 4, 10]))
        comm.start(Outgoing("t", None, None, 10, target=target), reduction).wait()
        assert torch.allclose(torch.cat(target.tensors), dense * prescale * postscale)


def test_decode_adds_equal_indices_across_segments_and_scales_once(hvd):
    comm = Allgather(process_set=hvd.global_process_set)
    target = target_of((2, 3))
    out = Outgoing("d", torch.zeros(0), torch.zeros(0, dtype=torch.int64), 5, target=target)
    comm.decode_into(out, Reduction(hvd.Sum, postscale=3.0), torch.tensor([1.0, 2.0, 4.0, 0.5]),
                     torch.tensor([2, 2, 0, 4]))
    assert [t.tolist() for t in target.tensors] == [[12.0, 0.0], [9.0, 0.0, 1.5]]
    comm.decode_into(out, Reduction(hvd.Sum), torch.ones(5), None)  # a dense buffer; the target zeroed first
    assert [t.tolist() for t in target.tensors] == [[1.0] * 2, [1.0] * 3]
    comm.decode_into(Outgoing("d", torch.zeros(0), torch.zeros(0, dtype=torch.int64), 5), Reduction(hvd.Sum),
                     torch.ones(1), torch.tensor([1]))  # no target (a sweep): nothing is written


def test_state_is_keyed_by_tag_and_renewed_with_the_numel(hvd):
    """ZEN's choice lives under the buffer's tag; the tag coming with another numel (a new plan)
    measures anew."""
    comm = Zen(process_set=hvd.global_process_set, choice_steps=1, seed=1)
    indices = torch.tensor([1, 3])

    def step(numel):
        return comm.start(Outgoing("0", torch.ones(2), indices, numel), Reduction(hvd.Sum))

    step(8).wait()
    assert list(comm.choice) == ["0"] and comm.numels == {"0": 8}
    pending = step(8)
    assert list(comm.choice) == ["0"]
    pending.wait()
    pending = step(9)
    assert comm.choice == {} and comm.numels == {"0": 9}
    pending.wait()
    assert list(comm.choice) == ["0"]


def test_exdyna_scales_through_feedback_only(hvd):
    """Scaled globally, the selection leaves the thresholds alone; ``feedback`` applies Algorithm 5
    with the job's k′ against the live segments' target, once; another layout is not touched."""
    torch.manual_seed(0)
    comp = make_compressor("exdyna", 0.1)
    comp.scaled_globally()
    segments = Segments(("a", "b", "zero"), (200, 100, 50), torch.device("cpu"))
    flat = torch.randn(350)
    flat[300:] = 0
    comp.select(flat, segments, 0)
    before = {n: comp._threshold[n] for n in ("a", "b")}
    target = 20 + 10  # the live segments' k (counting the all-zero one, k′ = 30 would scale down)
    for feedback, factor in ((3 * target, 1 + comp.gamma), (target, 1 + comp.gamma / 4), (0, 1 - comp.gamma)):
        comp.select(flat, segments, 0)
        comp.feedback(Segments(("other",), (10,), torch.device("cpu")), feedback)  # not this selection's
        assert {n: comp._threshold[n] for n in ("a", "b")} == before
        comp.feedback(segments, feedback)
        after = {n: comp._threshold[n] for n in ("a", "b")}
        assert after == pytest.approx({n: v * factor for n, v in before.items()}, rel=1e-12)
        comp.feedback(segments, feedback)  # reported once: a second report changes nothing
        assert {n: comp._threshold[n] for n in ("a", "b")} == after
        before = after


def test_exdyna_communicator_reports_the_jobs_count_and_leaves_the_compressor_alone(hvd):
    torch.manual_seed(0)
    comp = make_compressor("exdyna", 0.1)
    comm = ExDynaCommunicator(process_set=hvd.global_process_set)
    comm.setup(comp)
    segments = Segments(("w",), (80,), torch.device("cpu"))
    flat = torch.randn(80)
    indices = comp.select(flat, segments, 0)
    delta = comp._threshold["w"]
    pending = comm.start(Outgoing("x", flat[indices], indices, 80, residual=flat), Reduction(hvd.Sum))
    assert pending.feedback is None
    pending.wait()
    assert pending.feedback == pending.selected == indices.numel() and comp._threshold["w"] == delta
    comp.feedback(segments, pending.feedback)
    assert comp._threshold["w"] == pytest.approx(delta * float(comp._factor(indices.numel() / 8)), rel=1e-12)


def test_exdyna_device_path_feeds_back_on_every_segment(paths):
    """On the device path the commit names every segment (which are all-zero is known only on the
    device), with the target of them all; a selection never committed is never fed back."""
    paths(device_path=True, kernels_="torch")
    torch.manual_seed(0)
    comp = make_compressor("exdyna", 0.1)
    comp.scaled_globally()
    segments = Segments(("a", "zero"), (200, 100), torch.device("cpu"))
    flat = torch.randn(300, dtype=torch.float16)
    flat[200:] = 0
    proposal = comp.propose(flat, segments, 0)
    proposal.read()
    comp.feedback(segments, 30)  # not committed yet: nothing to scale
    proposal.commit()
    before = {n: comp._threshold[n] for n in segments.names}
    comp.feedback(segments, 30)  # k′ = k of both segments (20 + 10)
    assert {n: comp._threshold[n] for n in segments.names} == \
        pytest.approx({n: v * (1 + comp.gamma / 4) for n, v in before.items()}, rel=1e-12)


def test_zens_seed_leaves_pythons_random_stream_as_it_was(hvd):
    """ZEN §4 draws its hash seeds at random on one worker and broadcasts them: drawn from the OS,
    so that rank 0's ``random`` stream (the user's augmentation, sampling) is the one every rank
    and a run without the plugin would have."""
    import random
    state = random.getstate()
    comm = Zen(process_set=hvd.global_process_set)
    comm.setup(make_compressor("topk", 0.1))
    assert comm.seed is not None and 0 <= comm.seed < 1 << 30
    assert random.getstate() == state
