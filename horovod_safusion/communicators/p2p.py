"""What the point-to-point protocols' rounds carry, and what a worker holds between rounds.

SparDL's Spar-Reduce-Scatter and Bruck all-gather (SparDL §3.1), ZEN's push (ZEN §3.2) and
Hierarchical Centralization (ZEN §2.3) exchange, round by round, messages of different sizes
(:mod:`.rounds` carries them). A message is :mod:`horovod_safusion.wire` rows ``[value bytes |
int32 index bits]`` with the values passed through Horovod's wire compression
(``hvd.Compression.fp16`` halves them) (:class:`RowCodec`); a worker holds what it has merged so
far as a sparse sum (:class:`SparseSum`).
"""
from __future__ import annotations

from typing import Any

import torch

from .. import wire


class RowCodec:
    """Values and indices of one buffer ↔ wire rows, with Horovod's wire compression applied.

    Args:
        dtype: the buffer's value dtype (what :meth:`decode` returns).
        compression: ``hvd.Compression.none`` or ``.fp16`` (anything with ``compress``/``decompress``).
    """

    def __init__(self, dtype: torch.dtype, compression: Any) -> None:
        self.dtype, self.compression = dtype, compression
        probe, self._ctx = compression.compress(torch.zeros(1, dtype=dtype))
        self.wire_dtype = probe.dtype
        self.row_bytes = wire.row_bytes(self.wire_dtype)

    def encode(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``(n,)`` values and indices → ``(n, row_bytes)`` uint8 rows."""
        sent, _ = self.compression.compress(values.to(self.dtype))
        return wire.pack(sent, indices)

    def decode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (of any number of ranks) → ``(values in dtype, int64 indices)``."""
        if rows.shape[0] == 0:
            return torch.zeros(0, dtype=self.dtype, device=rows.device), torch.zeros(0, dtype=torch.int64, device=rows.device)
        values, indices = wire.unpack(rows, self.wire_dtype)
        return self.compression.decompress(values, self._ctx).to(self.dtype), indices

    def round(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as they arrive after one trip on the wire (identity without compression)."""
        sent, ctx = self.compression.compress(values)
        return self.compression.decompress(sent, ctx).to(self.dtype)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.zeros((0, self.row_bytes), dtype=torch.uint8, device=device)


class SparseSum:
    """A sparse vector over one buffer: sorted unique indices and their values, as a worker of a
    multi-round protocol holds it (SparDL's blocks, ZEN's recursive doubling). Merging adds the
    values of equal indices, in the order they were merged (so workers that merge the same
    pieces in the same order round alike); memory grows with what is held, not with the buffer.
    """

    def __init__(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        self.indices, self.values = self._summed(indices, values)

    @staticmethod
    def _summed(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted unique ``indices`` with the values of equal ones added (in input order)."""
        if indices.numel() == 0:
            return indices.to(torch.int64), values
        unique, inverse = torch.unique(indices, sorted=True, return_inverse=True)
        return unique, torch.zeros(unique.numel(), dtype=values.dtype, device=values.device).index_add_(0, inverse, values)

    def merge(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` at ``indices`` (after what is held)."""
        self.indices, self.values = self._summed(torch.cat([self.indices, indices]), torch.cat([self.values, values]))

    def span(self, lo: int, hi: int) -> slice:
        """The positions of the held indices in ``[lo, hi)``."""
        a, b = torch.searchsorted(self.indices, torch.tensor([lo, hi], device=self.indices.device)).tolist()
        return slice(a, b)

    def remove(self, keep: torch.Tensor) -> None:
        """Keep only the entries where the boolean ``keep`` (one per entry) is set."""
        self.indices, self.values = self.indices[keep], self.values[keep]

    def take(self, spans: list[slice]) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of ``spans`` (in that order), removed from the vector."""
        if not spans:
            return self.indices[:0], self.values[:0]
        idx = torch.cat([self.indices[s] for s in spans])
        values = torch.cat([self.values[s] for s in spans])
        keep = torch.ones(self.indices.numel(), dtype=torch.bool, device=self.indices.device)
        for s in spans:
            keep[s] = False
        self.remove(keep)
        return idx, values

    def __len__(self) -> int:
        return self.indices.numel()
