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
    as device tensors; ``bounds`` the segments' offsets followed by the buffer's size, ``sizes``
    the segments' sizes. Nothing here grows with the buffer's elements (a table is kept per
    layout)."""

    segment: torch.Tensor
    start: torch.Tensor
    stop: torch.Tensor
    bounds: torch.Tensor
    sizes: torch.Tensor
    numel: int
    blocks: int
    block: int

    def seg_ids(self) -> torch.Tensor:
        """Every element's segment (the PyTorch path's way to spread per-segment values over the
        buffer): made per call, as long as the buffer, so that no table of that size is kept."""
        segments = torch.arange(self.sizes.numel(), device=self.sizes.device)
        return torch.repeat_interleave(segments, self.sizes, output_size=self.numel)


@lru_cache(maxsize=256)
def block_table(segments: Segments, device: torch.device, block: int = BLOCK) -> BlockTable:
    """The blocks of ``segments`` (cached per layout and device)."""
    sizes = segments.size_array
    per = np.maximum(1, -(-sizes // block))  # an empty segment still gets one (empty) block
    seg = np.repeat(np.arange(len(sizes), dtype=np.int64), per)
    within = np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    start = segments.offset_array[seg] + within * block
    stop = np.minimum(start + block, segments.offset_array[seg] + sizes[seg])

    def on(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    bounds = np.append(segments.offset_array, segments.numel)
    return BlockTable(segment=on(seg), start=on(start), stop=on(stop), bounds=on(bounds), sizes=on(sizes),
                      numel=segments.numel, blocks=len(seg), block=block)
