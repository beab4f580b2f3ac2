"""The profile's sweeps: the compressor and the collectives timed over a range of sizes.

SAFusion §4, "Generator module": "The generator gets the gradient communication time and
compression time by online profiling." The profiler (:mod:`horovod_safusion.profiling`) runs these
at the end of its last profiled step, on every rank at the same point, and turns them into the
cost curves of a :class:`~horovod_safusion.fusion.Profile`. Each sweep is given what it times —
a compressor, a communicator, a wire compression — and the dtype and device of the data, never
the controller.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
import torch
import horovod.torch as hvd

from .clock import Clock
from .communicators import Communicator, Outgoing, Reduction
from .communicators.base import wait
from .compressors import Compressor, sparsify
from .plan import TensorInfo
from .segment import Segments
from .session import collective

SWEEP_POINTS = 12
#: Message sizes per communicator sweep: a collective's cost is latency + bytes / bandwidth, which
#: fewer points fit, and each point costs collectives of every rank (several rounds for SparDL and
#: ZEN) paced by Horovod's cycle time.
COMMUNICATION_POINTS = 8
#: Collectives are timed up to this many bytes (offered by one rank) and extrapolated linearly
#: beyond (they cost latency + bytes / bandwidth), so that pricing a large model on a slow link
#: takes seconds, not minutes, and the sweep's messages stay small next to the model.
SWEEP_BYTES = 4 << 20


def sizes(lo: int, hi: int, points: int = SWEEP_POINTS) -> list[int]:
    """``points`` sizes spaced geometrically from ``lo`` to ``hi`` (fewer where they round alike)."""
    return sorted({int(round(v)) for v in np.geomspace(max(1, lo), max(1, hi), points)})


def time_compression(compressor: Compressor, source: torch.Tensor, seg_sizes: Sequence[int],
                     density: float | None = None, steps: int = 10) -> float:
    """Mean seconds of one selection at ``density`` (default: the compressor's) of a buffer cut
    into ``seg_sizes``, made on the first elements of ``source`` (a flat tensor, e.g. a fusion
    buffer's residuals) and undone after each one, so ``source`` ends as it was; on a copy of
    ``compressor``, so that the caller's state is untouched."""
    comp = copy.deepcopy(compressor)
    seg = Segments(tuple(f"sweep.{i}" for i in range(len(seg_sizes))), tuple(seg_sizes), source.device)
    flat = source[:seg.numel]

    def select(step: int) -> None:
        values, indices = sparsify(comp, flat, seg, step, density)
        if indices is not None:
            flat.index_copy_(0, indices, values)  # the selection undone: bit for bit

    select(0)  # warm-up
    clock = Clock(source.device)
    a = clock.mark()
    for step in range(1, steps + 1):
        select(step)
    return clock.seconds(a, clock.mark()) / steps


def sweep_source(flats: Sequence[torch.Tensor | None], numel: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """What the compression sweep selects from: the largest of ``flats`` (fusion buffers holding
    residuals, left as they were) of ``dtype``, or, where none holds ``numel`` elements, random
    data of that size (memory of its own for the sweep's duration)."""
    held = [f for f in flats if f is not None and f.dtype == dtype and f.device == device]
    largest = max(held, key=lambda f: f.numel(), default=None)
    if largest is not None and largest.numel() >= numel:
        return largest
    return torch.randn(numel, dtype=dtype, device=device)


def compression_sweep(compressor: Compressor, numels: Sequence[int], source: torch.Tensor,
                      density: float | None = None) -> tuple[list[int], list[float], float]:
    """Compression cost curve of ``compressor`` at ``density`` (default: the compressor's; plans
    are made for the steady state, not for a warm-up's denser steps) over the size range of
    ``numels``, timed on the first elements of ``source`` (:func:`sweep_source`; at least
    ``max(numels)`` elements).

    Returns the swept dense sizes in bytes, the seconds to compress a one-segment buffer of each,
    and the extra seconds per additional segment (a buffer cut into 16 segments against one),
    because the controller selects a whole buffer in one pass. The first two are a
    :class:`~horovod_safusion.fusion.CostCurve`'s points.
    """
    swept = sizes(min(numels), max(numels))
    element = source.element_size()
    if compressor.dense:
        return [n * element for n in swept], [0.0] * len(swept), 0.0
    seconds = [time_compression(compressor, source, (n,), density) for n in swept]
    n = min(max(16, int(np.median(numels)) * 16), source.numel())
    per_segment = max(0.0, (time_compression(compressor, source, (n // 16,) * 16, density)
                            - time_compression(compressor, source, (n // 16 * 16,), density)) / 15)
    return [n * element for n in swept], seconds, per_segment


def communication_sweep(communicator: Communicator, tensors: Sequence[TensorInfo], density: float,
                        dtype: torch.dtype, device: torch.device, reps: int = 2) -> tuple[list[float], list[float]]:
    """Seconds of one collective of ``communicator`` for swept message sizes, up to what the
    job's ``tensors`` send at ``density`` or :data:`SWEEP_BYTES`, whichever is smaller (a
    collective: every rank of its process set). The collectives have no target: what they deliver
    is not added anywhere (the steps' decoding is measured in the profiled steps themselves), so
    the sweep holds no buffer of the model's size.

    A message's size is what one rank offers, as :meth:`~horovod_safusion.fusion.Profile.message_bytes`
    prices it: its dense bytes for a dense communicator, else its selected elements times the
    wire row (value + index). That is not what the protocol puts on the wire (SparDL's rounds,
    ZEN's partitions send more or less than the selection), which is the point: curves of
    different communicators answer the same question, what a buffer of this selection costs."""
    total = sum(t.numel for t in tensors)
    dense = communicator.dense
    element = torch.empty((), dtype=dtype).element_size()
    row = element if dense else communicator.compression.compress(torch.zeros(1, dtype=dtype))[0].element_size() + 4
    # up to SWEEP_BYTES offered; the cost curve extrapolates beyond (latency + bytes / bandwidth)
    most = min(total if dense else max(1, int(1.5 * density * total) + len(tensors)), max(1, SWEEP_BYTES // row))
    clock = Clock(device)
    rank = communicator.process_set.rank()
    nbytes, seconds = [], []
    for j, count in enumerate(sizes(1, most, COMMUNICATION_POINTS)):
        numel = count if dense or density >= 1.0 else max(count, int(count / density))
        values = torch.randn(count, dtype=dtype, device=device)
        stride = numel // count
        # every rank its own indices (disjoint while the stride exceeds P): what the ranks select
        # overlaps little at low density, and a protocol that aggregates on the way (SparDL, ZEN)
        # would be priced too cheap on identical ones
        indices = None if dense else torch.arange(count, device=device) * stride + rank % stride
        times = []
        for r in range(reps + 1):  # the first run warms Horovod's caches up and is not counted
            a = clock.mark()
            pending = communicator.start(Outgoing(f"sweep.{j}", values, indices, numel), Reduction(hvd.Sum))
            pending.wait()
            if r:
                times.append(clock.seconds(a, clock.mark()))
        nbytes.append(float(count * row))
        seconds.append(float(np.median(times)))
    return nbytes, seconds


def communicator_sweeps(communicators: dict[str, Communicator], tensors: Sequence[TensorInfo], density: float,
                        dtype: torch.dtype, device: torch.device) -> dict[str, tuple[list[float], list[float]]]:
    """:func:`communication_sweep` of each of ``communicators`` in turn, by name (a collective:
    every rank sweeps the same communicators in the same order)."""
    return {name: communication_sweep(comm, tensors, density, dtype, device) for name, comm in communicators.items()}


def dense_allreduce_sweep(compression: Any, tensors: Sequence[TensorInfo], dtype: torch.dtype,
                          device: torch.device, process_set: Any, reps: int = 2,
                          largest: bool = False) -> tuple[list[float], list[float]]:
    """Seconds of one Horovod dense allreduce (with the wire ``compression``) for swept buffer
    sizes up to the model's gradient bytes or :data:`SWEEP_BYTES`, whichever is smaller
    (a collective): the price of sending dense, for the planner's dense choice. ``largest``: that
    largest size alone (how a critical step's wire is chosen, :mod:`~horovod_safusion.regime`).
    Sizes are the uncompressed buffer's bytes."""
    element = torch.empty((), dtype=dtype).element_size()
    total = sum(t.numel for t in tensors)
    clock = Clock(device)
    nbytes, seconds = [], []
    counts = sizes(1024, min(total, SWEEP_BYTES // element), COMMUNICATION_POINTS)
    tag = "half" if largest else "dense"
    for j, count in enumerate(counts[-1:] if largest else counts):
        dense = torch.randn(count, dtype=dtype, device=device)
        times = []
        for r in range(reps + 1):  # the first run warms Horovod's caches up and is not counted
            a = clock.mark()
            sent, ctx = compression.compress(dense)
            wait(hvd.allreduce_async_(sent, name=collective(f"saf.sweep.{tag}.{j}"), op=hvd.Sum, process_set=process_set))
            compression.decompress(sent, ctx)
            if r:
                times.append(clock.seconds(a, clock.mark()))
        nbytes.append(float(count * element))
        seconds.append(float(np.median(times)))
    return nbytes, seconds


def wire_bytes(compression: Any, dtypes: dict[str, torch.dtype]) -> dict[str, int]:
    """Bytes per selected element on the wire: the (possibly fp16-compressed) value + int32 index."""
    return {name: compression.compress(torch.zeros(1, dtype=dtype))[0].element_size() + 4
            for name, dtype in dtypes.items()}
