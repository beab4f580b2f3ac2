"""Wire format: values and index bits side by side, exact for every dtype and index."""
import torch
from hypothesis import given, strategies as st

from horovod_safusion import wire


@given(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       st.lists(st.integers(0, 2**31 - 1), max_size=50, unique=True))
def test_pack_unpack_is_bit_exact(dtype, idx):
    indices = torch.tensor(idx, dtype=torch.int64)
    values = torch.randn(len(idx)).to(dtype)
    rows = wire.pack(values, indices)
    assert rows.dtype == torch.uint8 and rows.shape == (len(idx), wire.row_bytes(dtype))
    v, i = wire.unpack(rows, dtype)
    assert torch.equal(i, indices)
    assert torch.equal(v.view(torch.uint8), values.view(torch.uint8))


def test_large_indices_survive_where_float32_conversion_would_not():
    indices = torch.tensor([2**24 + 1, 2**31 - 2], dtype=torch.int64)
    assert float(torch.tensor(2**24 + 1, dtype=torch.float32)) != 2**24 + 1  # Ok-Topk's bug
    _, i = wire.unpack(wire.pack(torch.ones(2), indices), torch.float32)
    assert i.tolist() == [2**24 + 1, 2**31 - 2]


def test_rows_of_several_ranks_concatenate():
    a = wire.pack(torch.tensor([1.0, 2.0]), torch.tensor([0, 5]))
    b = wire.pack(torch.tensor([3.0]), torch.tensor([5]))
    v, i = wire.unpack(torch.cat([a, b]), torch.float32)  # what allgather returns
    out = torch.zeros(6).index_add_(0, i, v)
    assert out.tolist() == [1, 0, 0, 0, 0, 5]  # equal indices add up
