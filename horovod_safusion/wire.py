"""Wire format of one sparse fusion buffer: values and index bits side by side, one tensor.

Each selected element is one row ``[value bytes | index bytes]`` of a ``uint8`` matrix, so a single
``allgather`` (which concatenates along dim 0) carries every rank's values *and* indices however
many elements each rank selected — no second collective for the counts (the authors' prototype
split the gathered output into equal chunks and corrupted gradients; see shared/papers/README.md).
Indices are buffer-relative int32 reinterpreted bit for bit, never converted by value (Ok-Topk's
float32 conversion is exact only below 2**24 elements).
"""
from __future__ import annotations

import torch

INDEX_DTYPE = torch.int32
_INDEX_BYTES = 4


def row_bytes(value_dtype: torch.dtype) -> int:
    """Bytes one selected element occupies on the wire."""
    return torch.empty((), dtype=value_dtype).element_size() + _INDEX_BYTES


def pack(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``(n,)`` values and ``(n,)`` buffer-relative indices → ``(n, row_bytes)`` uint8 rows."""
    if values.shape != indices.shape or values.dim() != 1:
        raise ValueError(f"values {tuple(values.shape)} and indices {tuple(indices.shape)} must be "
                         "1-D of equal length")
    n = values.numel()
    vbytes = values.contiguous().view(torch.uint8).view(n, values.element_size())
    ibytes = indices.to(INDEX_DTYPE).contiguous().view(torch.uint8).view(n, _INDEX_BYTES)
    return torch.cat([vbytes, ibytes], dim=1)


def unpack(rows: torch.Tensor, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack` over the rows of all ranks: ``(values, int64 indices)``."""
    vsize = row_bytes(value_dtype) - _INDEX_BYTES
    # clone, not contiguous(): a one-row slice counts as contiguous but keeps its byte offset,
    # and reinterpreting bytes needs an offset aligned to the element size.
    values = rows[:, :vsize].clone(memory_format=torch.contiguous_format).view(value_dtype).view(-1)
    indices = rows[:, vsize:].clone(memory_format=torch.contiguous_format).view(INDEX_DTYPE).view(-1)
    return values, indices.to(torch.int64)
