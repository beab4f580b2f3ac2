"""A fusion buffer's segments cut into fixed-size blocks, the unit of work of the GPU kernels.

The per-segment kernels (:mod:`~horovod_safusion.kernels.triton_ops`) run one program per block,
and no block straddles two segments, so a program reads one threshold and writes one partial
statistic. The table is built once per layout on the host and kept on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..segment import Segments

#: Elements per block (a power of two, as Triton's ``tl.arange`` needs).
BLOCK = 1024


@dataclass(frozen=True)
class BlockTable:
    """Per block: its segment (``segment``), first element (``start``) and end (``stop``, exclusive),
    as device tensors.
    ``seg_ids`` gives every element its segment (the PyTorch path's way to spread per-segment
    thresholds over the buffer) and ``bounds`` the segments' offsets followed by the buffer's size."""

    segment: torch.Tensor
    start: torch.Tensor
    stop: torch.Tensor
    seg_ids: torch.Tensor
    bounds: torch.Tensor
    blocks: int
    block: int


@lru_cache(maxsize=256)
def block_table(segments: Segments, device: torch.device, block: int = BLOCK) -> BlockTable:
    """The blocks of ``segments`` (cached per layout and device)."""
    sizes = segments.size_array
    per = np.maximum(1, -(-sizes // block))  # an empty segment still gets one (empty) block
    seg = np.repeat(np.arange(len(sizes), dtype=np.int64), per)
    within = np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    start = segments.offset_array[seg] + within * block
    stop = np.minimum(start + block, segments.offset_array[seg] + sizes[seg])
    ids = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)

    def on(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    bounds = np.append(segments.offset_array, segments.numel)
    return BlockTable(segment=on(seg), start=on(start), stop=on(stop), seg_ids=on(ids), bounds=on(bounds),
                      blocks=len(seg), block=block)
