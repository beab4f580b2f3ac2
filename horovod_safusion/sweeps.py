"""The profile's sweeps: the compressor and the collectives timed over a range of sizes.

SAFusion §4, "Generator module": "The generator gets the gradient communication time and
compression time by online profiling." The profiler (:mod:`horovod_safusion.profiling`) runs these
at the end of its last profiled step, on every rank at the same point, and turns them into the
cost curves of a :class:`~horovod_safusion.fusion.Profile`. Each sweep is given what it times —
a compressor, a communicator, a wire compression — and the dtype and device of the data, never
the controller. Their random data come from a generator of their own (:func:`noise`), so the
user's random stream (dropout, augmentation) is the one it would be without the plugin.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

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

#: Buffer sizes per compression sweep, from the smallest tensor to the largest. A selection costs a
#: fixed part and a part linear in the buffer's elements, which six points fit; each point is
#: eleven selections, the largest ones the sweep's cost.
SWEEP_POINTS = 6
#: Message sizes per communicator sweep: a collective's cost is close to latency + bytes /
#: bandwidth, which four points fit, as they do the dense allreduce's (:data:`DENSE_POINTS`), and
#: each point costs every rank three collectives (several rounds each for SparDL and ZEN), each
#: paced by Horovod's cycle time.
COMMUNICATION_POINTS = 4
#: Buffer sizes per dense allreduce sweep. Horovod's dense allreduce is one ring, whose cost is
#: close to latency + bytes / bandwidth (docs/benchmarks.md, "Per-round latency, fitted"), which
#: four points fit, where each point costs every rank a warm-up, the counted runs and an
#: agreement: four negotiated collectives, each paced by Horovod's cycle.
DENSE_POINTS = 4
#: Collectives are timed up to this many bytes (offered by one rank) and extrapolated linearly
#: beyond (they cost latency + bytes / bandwidth), so that pricing a large model on a slow link
#: takes seconds, not minutes, and the sweep's messages stay small next to the model.
SWEEP_BYTES = 4 << 20
#: A dense allreduce swept whose first run (the warm-up) took at least this long, on the fastest
#: rank, is timed by one more run instead of ``reps``: its bytes dominate it, so its runs agree
#: closely, and on a slow link each run costs the job as long again (:func:`time_collective`; the
#: runs behind the value are in docs/benchmarks.md, "Measurements behind the code's constants").
#: The sparse communicators keep ``reps`` runs: a protocol of several rounds (ZEN) varied more
#: from one run to the next, and one run moved which contender the profile prunes.
ONE_RUN_S = 0.1
#: A contender slower than this many times the best communicator's time at its largest message is
#: not swept further (:func:`communicator_sweeps`): near the best, its whole curve decides.
PRUNE_MARGIN = 1.25
#: A contender whose first run at its largest message (the warm-up, on the fastest rank) already
#: took more than this many times the best's time there is pruned on that run, without the
#: ``reps`` counted ones: at 8 hosts one run of ZEN's largest message can take seconds. Above
#: :data:`PRUNE_MARGIN`, so that a first run slowed by what later runs do not pay still leaves
#: the decision to the counted runs near the margin (docs/benchmarks.md, "Measurements behind
#: the code's constants", has the runs).
GIVE_UP = 1.5

T = TypeVar("T")


def noise(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` normal values for a sweep's data, drawn from a generator of the sweeps' own
    (seeded alike on every rank), never from torch's default one, which the user's job draws
    its dropout and augmentation from."""
    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randn(numel, dtype=dtype, device=device, generator=generator)


class Stopwatch:
    """The wall seconds of named pieces of the profile's work, added into ``took`` (by name): what
    the profile itself costs the job, for :attr:`~horovod_safusion.fusion.Profile.meta` and for
    the user reading rank 0's announcements."""

    def __init__(self, took: dict[str, float]) -> None:
        self.took = took

    def __call__(self, name: str, work: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return work()
        finally:
            self.took[name] = self.took.get(name, 0.0) + time.perf_counter() - start


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
    return noise(numel, dtype, device)


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
    if compressor.dense:
        return uncompressed(numels, source.dtype)
    swept = sizes(min(numels), max(numels))
    element = source.element_size()
    seconds = [time_compression(compressor, source, (n,), density) for n in swept]
    n = min(max(16, int(np.median(numels)) * 16), source.numel())
    per_segment = max(0.0, (time_compression(compressor, source, (n // 16,) * 16, density)
                            - time_compression(compressor, source, (n // 16 * 16,), density)) / 15)
    return [n * element for n in swept], seconds, per_segment


def uncompressed(numels: Sequence[int], dtype: torch.dtype) -> tuple[list[int], list[float], float]:
    """:func:`compression_sweep`'s curve where nothing is selected (a dense compressor, or a job
    that sends dense, ``dense=True``): no seconds at any size, none per segment; timed by nobody."""
    swept = sizes(min(numels), max(numels))
    element = torch.empty((), dtype=dtype).element_size()
    return [n * element for n in swept], [0.0] * len(swept), 0.0


def time_collective(run: Callable[[], None], clock: Clock, reps: int, agree: str | None = None,
                    process_set: Any = None, give_up: tuple[str, float] | None = None,
                    warm: bool = True, least: bool = False) -> float:
    """Median seconds of ``reps`` runs of the collective ``run``, after one that warms Horovod's
    caches up and is not counted (``warm=False``: none, and so neither ``agree`` nor ``give_up``,
    for a collective whose bytes dominate it, run right after one like it). With ``agree`` (a
    collective's name), of one run where that warm-up took :data:`ONE_RUN_S` or more on the
    fastest rank of ``process_set``: the fastest rank's warm-up time is agreed by a small
    allreduce that goes beside the first counted run, so every rank runs the same collectives
    (none where ``reps`` is 1).
    With ``give_up`` (a collective's name and this rank's bar in seconds), none counted where the
    fastest rank's warm-up took longer than the lowest rank's bar (both agreed by one small
    allreduce first): the warm-up's seconds are returned.
    With ``least``, the least of the warm-up and the counted runs rather than the counted runs'
    median: a busy host only adds to a run, and the warm-up's first negotiation is one of
    Horovod's cycles, small beside a collective whose bytes dominate it (a critical wire, timed
    by one counted run, :mod:`~horovod_safusion.profiling`); no collective more on any rank."""
    agreed = None
    if warm:
        a = clock.mark()
        run()
        warmup = torch.tensor([clock.seconds(a, clock.mark())], dtype=torch.float64)
        if give_up is not None:
            name, bar = give_up
            fastest, lowest = wait(hvd.allreduce_async(torch.tensor([warmup.item(), bar], dtype=torch.float64),
                                                       op=hvd.Min, name=collective(name),
                                                       process_set=process_set)).tolist()
            if fastest > lowest:
                return warmup.item()
        if agree is not None and reps > 1:  # (one counted run: none to stop)
            agreed = hvd.allreduce_async(warmup, op=hvd.Min, name=collective(agree), process_set=process_set)
    times = []
    for r in range(reps):
        a = clock.mark()
        run()
        times.append(clock.seconds(a, clock.mark()))
        if r == 0 and agreed is not None and hvd.synchronize(agreed).item() >= ONE_RUN_S:
            break
    if least:
        return min(times + ([warmup.item()] if warm else []))
    return float(np.median(times))


def message_counts(communicator: Communicator, tensors: Sequence[TensorInfo], density: float,
                   dtype: torch.dtype) -> tuple[list[int], int, bool]:
    """The message sizes a sweep of ``communicator`` times, in elements offered by one rank
    (ascending): up to what the job's ``tensors`` send at ``density`` or :data:`SWEEP_BYTES`,
    whichever is smaller; the bytes of one element on the wire (value, and index where sparse);
    and whether :data:`SWEEP_BYTES` cut the range short of the job's own largest message."""
    total = sum(t.numel for t in tensors)
    dense = communicator.dense
    element = torch.empty((), dtype=dtype).element_size()
    row = element if dense else communicator.compression.compress(torch.zeros(1, dtype=dtype))[0].element_size() + 4
    job = total if dense else max(1, int(1.5 * density * total) + len(tensors))
    # up to SWEEP_BYTES offered; the cost curve extrapolates beyond (latency + bytes / bandwidth)
    most = min(job, max(1, SWEEP_BYTES // row))
    return sizes(1, most, COMMUNICATION_POINTS), row, most < job


def communication_sweep(communicator: Communicator, tensors: Sequence[TensorInfo], density: float,
                        dtype: torch.dtype, device: torch.device, reps: int = 2,
                        points: Sequence[int] | None = None,
                        give_up: tuple[str, float] | None = None) -> tuple[list[float], list[float]]:
    """Seconds of one collective of ``communicator`` for swept message sizes
    (:func:`message_counts`; ``points``: only those positions of its list, default all) (a
    collective: every rank of its process set); ``give_up``: :func:`time_collective`'s, for every
    point. The collectives have no target: what they deliver is not added anywhere (the steps'
    decoding is measured in the profiled steps themselves), so the sweep holds no buffer of the
    model's size.

    A message's size is what one rank offers, as :meth:`~horovod_safusion.fusion.Profile.message_bytes`
    prices it: its dense bytes for a dense communicator, else its selected elements times the
    wire row (value + index). That is not what the protocol puts on the wire (SparDL's rounds,
    ZEN's partitions send more or less than the selection), which is the point: curves of
    different communicators answer the same question, what a buffer of this selection costs."""
    counts, row, _ = message_counts(communicator, tensors, density, dtype)
    dense = communicator.dense
    clock = Clock(device)
    rank = communicator.process_set.rank()
    nbytes, seconds = [], []
    for j in range(len(counts)) if points is None else points:
        count = counts[j]
        numel = count if dense or density >= 1.0 else max(count, int(count / density))
        values = noise(count, dtype, device)
        stride = numel // count
        # every rank its own indices (disjoint while the stride exceeds P): what the ranks select
        # overlaps little at low density, and a protocol that aggregates on the way (SparDL, ZEN)
        # would be priced too cheap on identical ones
        indices = None if dense else torch.arange(count, device=device) * stride + rank % stride
        outgoing = Outgoing(f"sweep.{j}", values, indices, numel)
        nbytes.append(float(count * row))
        seconds.append(time_collective(lambda: communicator.start(outgoing, Reduction(hvd.Sum)).wait(), clock, reps,
                                       process_set=communicator.process_set, give_up=give_up))
    return nbytes, seconds


@dataclass(frozen=True)
class Pruned:
    """A contender not swept past its largest message, where it was slower than the best swept
    communicator (the fastest rank's seconds of each, for ``nbytes`` offered)."""
    seconds: float
    best: str
    best_seconds: float
    nbytes: float


def communicator_sweeps(communicators: dict[str, Communicator], tensors: Sequence[TensorInfo], density: float,
                        dtype: torch.dtype, device: torch.device, first: str, process_set: Any,
                        timed: Stopwatch | None = None
                        ) -> tuple[dict[str, tuple[list[float], list[float]]], dict[str, Pruned]]:
    """:func:`communication_sweep` of each of ``communicators`` (a collective: every rank sweeps
    the same communicators in the same order, and prunes the same ones), ``first`` in full; each
    one's seconds into ``timed`` as ``communicate:<name>``.

    Every other contender is timed at its largest message first, and not swept further where it
    took more than :data:`PRUNE_MARGIN` times the best time there, and that message is the job's
    own largest (not cut short by :data:`SWEEP_BYTES`); where its first run there took more than
    :data:`GIVE_UP` times the best time already, that run decides. The contenders (SparDL, ZEN)
    run in more rounds than the allgather, so their latency is higher and their edge is in
    volume: largest at the largest message, so a contender that loses there loses at every
    smaller size. Times are the fastest rank's, as the profile's (the same decision on every
    rank). Returns the swept curves and the pruned contenders."""
    timed = timed or Stopwatch({})
    order = [first] + [name for name in communicators if name != first]
    swept: dict[str, tuple[list[float], list[float]]] = {}
    pruned: dict[str, Pruned] = {}
    for name in order:
        comm = communicators[name]
        counts, row, cut = message_counts(comm, tensors, density, dtype)
        if name == first or cut:
            swept[name] = timed(f"communicate:{name}",
                                lambda: communication_sweep(comm, tensors, density, dtype, device))
            continue
        top = len(counts) - 1
        # the best so far at the same message (swept curves of the same density share their sizes)
        best = min((n for n in swept if swept[n][0][-1] == counts[top] * row), key=lambda n: swept[n][1][-1],
                   default=None)
        theirs = swept[best][1][-1] if best is not None else np.inf
        give_up = None if best is None else (f"saf.sweep.give_up.{name}", GIVE_UP * theirs)
        nbytes, secs = timed(f"communicate:{name}", lambda: communication_sweep(
            comm, tensors, density, dtype, device, points=[top], give_up=give_up))
        mine, theirs = hvd.allreduce(torch.tensor([secs[-1], theirs], dtype=torch.float64),
                                     op=hvd.Min, name=collective(f"saf.sweep.prune.{name}"),
                                     process_set=process_set).tolist()
        if best is not None and mine > PRUNE_MARGIN * theirs:
            pruned[name] = Pruned(mine, best, theirs, nbytes[-1])
            continue
        rest_bytes, rest_secs = timed(f"communicate:{name}", lambda: communication_sweep(
            comm, tensors, density, dtype, device, points=range(top)))
        swept[name] = (rest_bytes + nbytes, rest_secs + secs)
    return {name: swept[name] for name in communicators if name in swept}, pruned


def dense_allreduce_sweep(compression: Any, tensors: Sequence[TensorInfo], dtype: torch.dtype,
                          device: torch.device, process_set: Any, reps: int = 2,
                          largest: bool = False, largest_s: float | None = None,
                          warm: bool = True, least: bool = False) -> tuple[list[float], list[float]]:
    """Seconds of one Horovod dense allreduce (with the wire ``compression``) for swept buffer
    sizes up to the model's gradient bytes or :data:`SWEEP_BYTES`, whichever is smaller
    (a collective): the price of sending dense, for the planner's dense choice. ``largest``: that
    largest size alone (how a critical step's wire is chosen, :mod:`~horovod_safusion.regime`);
    ``largest_s``: that size's seconds, timed already (with the same compression), not timed
    again; ``warm`` and ``least``: :func:`time_collective`'s. Sizes are the uncompressed buffer's
    bytes."""
    element = torch.empty((), dtype=dtype).element_size()
    total = sum(t.numel for t in tensors)
    clock = Clock(device)
    nbytes, seconds = [], []
    counts = sizes(1024, min(total, SWEEP_BYTES // element), DENSE_POINTS)
    # a name per wire: Horovod's response cache keys a collective by name
    tag = f"{'largest' if largest else 'dense'}.{getattr(compression, '__name__', 'wire')}"
    swept = counts[-1:] if largest else counts
    for j, count in enumerate(swept):
        if largest_s is not None and j == len(swept) - 1:
            nbytes.append(float(count * element))
            seconds.append(largest_s)
            continue
        dense = noise(count, dtype, device)

        def run() -> None:
            sent, ctx = compression.compress(dense)
            wait(hvd.allreduce_async_(sent, name=collective(f"saf.sweep.{tag}.{j}"), op=hvd.Sum, process_set=process_set))
            compression.decompress(sent, ctx)
        nbytes.append(float(count * element))
        seconds.append(time_collective(run, clock, reps, f"saf.sweep.agree.{tag}.{j}", process_set, warm=warm,
                                       least=least))
    return nbytes, seconds


def wire_bytes(compression: Any, dtypes: dict[str, torch.dtype]) -> dict[str, int]:
    """Bytes per selected element on the wire: the (possibly fp16-compressed) value + int32 index."""
    return {name: compression.compress(torch.zeros(1, dtype=dtype))[0].element_size() + 4
            for name, dtype in dtypes.items()}
