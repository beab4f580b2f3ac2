"""The communicator contract in one process: :class:`Reduction`'s scaling, :class:`Outgoing`'s
indices and the shared decode (equal indices add up)."""
import pytest
import torch

from horovod_safusion.communicators import Allgather, Allreduce, Outgoing, Reduction, SparDL, Zen


def test_reduction_scales_as_horovod(hvd):
    avg, total = Reduction(hvd.Average, 0.5, 2.0), Reduction(hvd.Sum)
    assert avg.average and not total.average
    assert avg.scale(4) == 0.5 and total.scale(4) == 1.0
    x = torch.tensor([1.0, -3.0])
    assert torch.equal(avg.prescaled(x), x * 0.5) and torch.equal(avg.unprescaled(avg.prescaled(x)), x)
    assert total.prescaled(x) is x and total.unprescaled(x) is x


def test_outgoing_gives_every_index_when_all_are_sent():
    values = torch.arange(5, dtype=torch.float32)
    assert torch.equal(Outgoing("0", values, None, 5).indices_or_all(), torch.arange(5))
    picked = torch.tensor([4, 1])
    out = Outgoing("0", values[picked], picked, 5)
    assert out.indices_or_all() is picked and out.dtype == torch.float32 and out.residual is None and out.rows is None


@pytest.mark.parametrize("communicator", [Allgather, Allreduce, SparDL, lambda **kw: Zen(seed=1, **kw)])
@pytest.mark.parametrize("op,prescale,postscale", [("Average", 0.5, 2.0), ("Sum", 1.0, 1.0)])
def test_one_worker_start_returns_the_scaled_selection(hvd, communicator, op, prescale, postscale):
    comm = communicator(process_set=hvd.global_process_set, compression=hvd.Compression.none)
    reduction = Reduction(getattr(hvd, op), prescale, postscale)
    indices = torch.tensor([7, 2, 5])
    values = torch.tensor([1.5, -2.0, 4.0])
    got = comm.start(Outgoing("t", values, indices, 10), reduction).wait()
    expected = torch.zeros(10)
    expected[indices] = values * prescale * postscale
    assert torch.equal(got, expected)
    dense = torch.randn(10)
    assert torch.allclose(comm.start(Outgoing("t", dense, None, 10), reduction).wait(), dense * prescale * postscale)


def test_decode_adds_equal_indices_and_scales_once(hvd):
    comm = Allgather(process_set=hvd.global_process_set)
    out = Outgoing("d", torch.zeros(0), torch.zeros(0, dtype=torch.int64), 4)
    got = comm.decode_into(out, Reduction(hvd.Sum, postscale=3.0), torch.tensor([1.0, 2.0, 4.0]), torch.tensor([2, 2, 0]))
    assert got.tolist() == [12.0, 0.0, 9.0, 0.0]
    again = comm.decode_into(out, Reduction(hvd.Sum), torch.ones(4), None)  # the reused buffer, zeroed
    assert again.tolist() == [1.0] * 4
