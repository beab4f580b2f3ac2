"""Wire format of one sparse fusion buffer: values and index bits side by side, one tensor.

Each selected element is one row ``[value bytes | index bytes]`` of a ``uint8`` matrix, so a single
``allgather`` (which concatenates along dim 0) carries every rank's values *and* indices however
many elements each rank selected — no second collective for the counts (the authors' prototype
split the gathered output into equal chunks and corrupted gradients whenever ranks selected
different counts).
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
    return torch.cat([_byte_rows(values), _byte_rows(indices.to(INDEX_DTYPE))], dim=1)


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``(n,)`` → ``(n, element_size)`` uint8, the same bits. Reinterpreting bytes needs stride 1,
    which ``contiguous()`` does not promise for tensors of at most one element (one made from an
    empty NumPy array has stride 0, a one-element slice keeps its parent's stride; both count as
    contiguous)."""
    width = t.element_size()
    if t.numel() == 0:
        return torch.empty((0, width), dtype=torch.uint8, device=t.device)
    if t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8).view(t.numel(), width)


def unpack(rows: torch.Tensor, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack` over the rows of all ranks: ``(values, int64 indices)``."""
    vsize = row_bytes(value_dtype) - _INDEX_BYTES
    if rows.shape[0] == 0:
        return (torch.empty(0, dtype=value_dtype, device=rows.device),
                torch.empty(0, dtype=torch.int64, device=rows.device))
    # clone, not contiguous(): a one-row slice counts as contiguous but keeps its byte offset,
    # and reinterpreting bytes needs an offset aligned to the element size.
    values = rows[:, :vsize].clone(memory_format=torch.contiguous_format).view(value_dtype).view(-1)
    indices = rows[:, vsize:].clone(memory_format=torch.contiguous_format).view(INDEX_DTYPE).view(-1)
    return values, indices.to(torch.int64)
