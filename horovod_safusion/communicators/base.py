"""Communicator interface and registry: how one fusion buffer is synchronised.

A communicator receives, per fusion buffer and step, an :class:`Outgoing` record — the values this
rank selected and their buffer-relative indices, and the :class:`Target` the reduced gradient goes
to — and the job's :class:`Reduction`, starts *one* asynchronous collective (so communication
overlaps the rest of back-propagation, SAFusion §3.1 Step-2), and later writes the reduced
gradient into the target (:class:`Pending`). The target is the buffer's parameters' own ``.grad``
tensors, one per segment, so the reduced buffer needs no memory of its own, as with Horovod's
in-place allreduce. The reduction follows Horovod's scaling: ``postscale · Σ_ranks prescale · x``
and, for ``op=Average``, a further ``1 / size``. Values of different ranks at the same index add
up; sparse communicators decode through one place, :meth:`Communicator.decode_into`.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import numpy as np
import torch
import horovod.torch as hvd

from .. import kernels
from ..checkpoint import Stateful
from ..registry import Registry


#: Communicators that keep per-step statistics (``history``) keep this many, so long jobs do not grow.
HISTORY = 10_000


#: Longest sleep between two polls of a collective in :func:`wait` (seconds).
MAX_POLL_INTERVAL = 5e-4


def wait(handle: int) -> Any:
    """``hvd.synchronize(handle)`` without spinning a core while the collective runs.

    Horovod's own wait spins (``std::this_thread::yield()`` in a loop), so a rank that waits for
    another one burns a core, and with as many workers as cores it takes CPU time from the
    threads that do the communication (Horovod's background thread, Gloo's) and from the other
    rank's back-propagation. Here the caller polls and sleeps between polls, from 20 µs doubling
    up to :data:`MAX_POLL_INTERVAL`; the added latency is below one Horovod cycle
    (:mod:`~horovod_safusion.cycle`)."""
    delay = 2e-5
    while not hvd.poll(handle):
        time.sleep(delay)
        delay = min(2 * delay, MAX_POLL_INTERVAL)
    return hvd.synchronize(handle)


@dataclass(frozen=True)
class Reduction:
    """Horovod's reduction of the job: ``postscale · Σ_ranks prescale · x``, and for
    ``op=Average`` a further ``1 / size`` (``gradient_predivide_factor`` sets the two factors).

    Attributes:
        op: ``hvd.Average`` or ``hvd.Sum``.
        prescale, postscale: Horovod's scale factors.
    """

    op: int
    prescale: float = 1.0
    postscale: float = 1.0

    @property
    def average(self) -> bool:
        return self.op == hvd.Average

    def scale(self, size: int) -> float:
        """The factor applied to the sum of ``size`` ranks' prescaled values."""
        return self.postscale / (size if self.average else 1)

    def prescaled(self, values: torch.Tensor) -> torch.Tensor:
        """``values · prescale`` (``values`` itself when the prescale is 1)."""
        return values * self.prescale if self.prescale != 1.0 else values

    def unprescaled(self, values: torch.Tensor) -> torch.Tensor:
        """``values / prescale``: prescaled values a protocol hands back to error feedback
        (``values`` itself when the prescale is 1)."""
        return values / self.prescale if self.prescale != 1.0 else values


@dataclass(frozen=True, eq=False)
class Target:
    """Where one fusion buffer's reduced gradient goes: one flat tensor per segment (views of the
    parameters' ``.grad``), segment ``s`` holding buffer indices ``[bounds[s], bounds[s + 1])``.

    Attributes:
        tensors: flat, contiguous, of the buffer's dtype and device.
        bounds: the segments' offsets followed by the buffer's size (int64 NumPy array).
    """

    tensors: tuple[torch.Tensor, ...]
    bounds: np.ndarray

    @property
    def numel(self) -> int:
        return int(self.bounds[-1])

    def zero(self) -> None:
        torch._foreach_zero_(list(self.tensors))

    def scale(self, factor: float) -> None:
        torch._foreach_mul_(list(self.tensors), factor)

    def add(self, values: torch.Tensor, indices: torch.Tensor | None = None) -> None:
        """``values`` added at buffer ``indices`` (equal indices add up), or a whole dense flat
        buffer when ``indices`` is ``None``."""
        if indices is None:
            for t, lo, hi in zip(self.tensors, self.bounds[:-1].tolist(), self.bounds[1:].tolist()):
                t.add_(values[lo:hi])
        else:
            kernels.scatter_add(self.tensors, self.bounds, indices, values)

    def add_rows(self, rows: torch.Tensor) -> None:
        """Every wire row's value added at its index (:mod:`horovod_safusion.wire`)."""
        kernels.decode_rows(rows, self.tensors, self.bounds)


@dataclass(frozen=True, eq=False)
class Outgoing:
    """One fusion buffer's contribution of this rank, as the controller hands it over.

    Attributes:
        tag: short, stable collective name of the buffer (same on every rank).
        values: selected values, or ``None`` for a dense step: the target then holds this rank's
            whole contribution, to be reduced in place.
        indices: buffer-relative int64 indices of ``values`` (``None`` with ``values=None``).
        numel: elements of the buffer.
        residual: the buffer's unselected rest (this rank's new residual), or ``None``.
        rows: the selection already packed as wire rows (:mod:`horovod_safusion.wire`) by the
            device path's kernels, or ``None``.
        target: where the reduced gradient goes (``None`` for a sweep, which only times the
            collective).
        rider: a small tensor of the target's dtype that a dense communicator reduces in the same
            collective, in place, and does not decode (the step's flags,
            :mod:`horovod_safusion.stages.flags`), or ``None``. Sparse communicators take none.

    Valid until the :class:`Pending` that :meth:`Communicator.start` returned has finished
    ``wait()``. ``values``, ``residual`` and ``indices`` are read-only (``residual`` is a view of
    the controller's buffer, which holds the residuals).
    """

    tag: str
    values: torch.Tensor | None
    indices: torch.Tensor | None
    numel: int
    residual: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    target: Target | None = None
    rider: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype if self.values is not None else self.target.tensors[0].dtype

    @property
    def device(self) -> torch.device:
        return self.values.device if self.values is not None else self.target.tensors[0].device


class Pending:
    """An in-flight buffer synchronisation, in two phases.

    ``collect()`` waits for the collective and returns its raw output; ``decode(raw)`` writes the
    reduced gradient into the :class:`Target` (unpacking, ``index_add_``, scaling). The controller
    times them apart: waiting is communication, decoding is computation. ``wait()`` does both;
    every phase runs once.

    Multi-round protocols (SparDL, ZEN, ExDyna) launch their first round when the buffer starts
    and run the later rounds inside ``collect()``, which the controller calls in buffer order on
    every rank, so every rank submits the same collectives in the same order.

    Attributes set by the protocol while it runs (read by the controller after ``wait()``):
        bytes_sent: payload bytes this rank submitted.
        bytes_received: payload bytes this rank received from *other* ranks (``None`` where the
            collective hides it, e.g. a dense allreduce).
        selected: elements this rank's contribution carried, where it differs from what the
            compressor selected (ExDyna sends the union of all ranks' exclusive selections).
        leftover: ``(indices, values)`` (buffer-relative, this rank, unscaled) of values the
            protocol did *not* deliver although the controller counted them as sent — SparDL's
            in-procedure and end-procedure residuals, ExDyna's non-exclusive selections — or
            negative corrections for values it delivered from the residual (ExDyna's
            all-reduce of every rank's accumulator at the gathered indices). Equal indices add
            up. The controller adds them into the residuals, so error feedback loses nothing and
            checkpoints stay complete. ``None``: nothing to hand back.
        feedback: what the job's synchronisation tells the compressor about the buffer's selection
            (ExDyna: the job's selected count k′ = |U|); the controller passes it to
            :meth:`~horovod_safusion.compressors.base.Compressor.feedback`. ``None``: nothing.
    """

    def __init__(self, collect: Callable[[], Any], decode: Callable[[Any], None], bytes_sent: int) -> None:
        self._collect, self._decode = collect, decode
        self._raw: Any = None
        self._collected = self._decoded = False
        self.bytes_sent = bytes_sent
        self.bytes_received: int | None = None
        self.selected: int | None = None
        self.leftover: tuple[torch.Tensor, torch.Tensor] | None = None
        self.feedback: int | None = None

    def collect(self) -> Any:
        if not self._collected:
            self._raw, self._collected = self._collect(), True
        return self._raw

    def wait(self) -> None:
        if not self._decoded:
            raw = self.collect()
            self._raw, self._decoded = None, True  # the raw output is not kept past decoding
            self._decode(raw)
            self._collect = self._decode = None  # a protocol's run refers to this: no cycle outlives it


class Communicator(Stateful, ABC):
    """Synchronises fusion buffers across the ranks of a process set.

    State kept from step to step (partitions, tuned budgets, a scheme choice) is kept per buffer,
    keyed by :attr:`Outgoing.tag`; a tag that comes with another ``numel`` than at its last start
    names a buffer of a new fusion plan, whose state starts afresh (:meth:`renewed`). After
    :meth:`setup` a communicator never touches the compressor: what the compressor must learn from
    the synchronisation goes back through :attr:`Pending.feedback`.

    Args:
        process_set: Horovod process set whose ranks take part.
        compression: Horovod's wire compression (``hvd.Compression.none`` / ``.fp16``), applied to
            the values that travel, as ``hvd.DistributedOptimizer(compression=...)`` does.
    """

    name: ClassVar[str] = "?"
    dense: ClassVar[bool] = False

    def __init__(self, process_set: Any = None, compression: Any = hvd.Compression.none) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.compression = compression
        self.numels: dict[str, int] = {}  # per tag, the numel of its last start, see renewed()

    def bind(self, process_set: Any, compression: Any) -> "Communicator":
        """Attach the optimizer's process set and wire compression (for instances made by users)."""
        self.process_set = process_set
        self.compression = compression
        return self

    @abstractmethod
    def start(self, out: Outgoing, reduction: Reduction) -> Pending:
        """Start synchronising one buffer: this rank's contribution ``out`` (read-only, see
        :class:`Outgoing` for how long it stays valid), reduced as ``reduction`` says."""

    def renewed(self, out: Outgoing) -> bool:
        """Whether ``out.tag`` starts for the first time or with another ``numel`` than at its last
        start (a new fusion plan): the state kept under the tag must start afresh. Call it once
        per :meth:`start`; a communicator that does carries :attr:`numels` in its ``state_fields``."""
        renewed = self.numels.get(out.tag) != out.numel
        self.numels[out.tag] = out.numel
        return renewed

    def decode_into(self, out: Outgoing, reduction: Reduction, values: torch.Tensor | None = None,
                    indices: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
        """The reduced gradient of ``out`` into its target: zeroed, then what the ranks delivered
        added in — ``values`` at ``indices`` (a dense flat ``values`` when ``indices`` is
        ``None``) or, where the protocol received wire ``rows`` of the buffer's dtype, those rows —
        equal indices adding up, then scaled by ``reduction`` over the process set's size.
        Nothing happens without a target (a sweep)."""
        target = out.target
        if target is None:
            return
        target.zero()
        if rows is not None:
            target.add_rows(rows)
        elif values is not None:
            target.add(values, indices)
        scale = reduction.scale(self.process_set.size())
        if scale != 1.0:
            target.scale(scale)

    def setup(self, compressor: Any) -> None:
        """Called once on every rank of the process set when the optimizer is built, after the
        fusion plan was checked across ranks: a communicator may run collectives here (ZEN
        broadcasts its hash seeds) or check that it can work with ``compressor``. Default: nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


COMMUNICATORS: Registry = Registry("communicator", "communicators", Communicator)
register_communicator = COMMUNICATORS.register  # class decorator: ``@register_communicator("name")``
available_communicators = COMMUNICATORS.names   # names accepted by ``communicator=`` besides "auto"


#: What ``communicator="auto"`` holds for a sparse compressor, the first in use from the start
#: (SAFusion §3.1 Step-2's sparse allgather): the communicators that deliver the compressor's own
#: selection, every rank's, summed — the same update, so the choice between them is one of time
#: alone. ``fusion="safusion"`` prices each that can win at the job's P (:func:`contenders`) from
#: the profile's sweeps and plans the fastest
#: (:attr:`~horovod_safusion.plan.FusionPlan.communicator`). Two seeds are asked for by name
#: instead, because they apply another update, which a step time does not price:
#:
#: * SparDL's Spar-Reduce-Scatter keeps the top k/P of every merged block (SparDL §3.1, Alg. 1),
#:   so a step applies k elements of the sum where the allgather and ZEN apply the union of the
#:   ranks' selections, up to P·k; the rest waits in residuals, and the job learns slower per
#:   step as P grows (docs/benchmarks.md, "SparDL's update");
#: * ExDyna's communicator sends another selection (exclusive partitions, thresholds scaled by the
#:   job's count), with ``compressor="exdyna"``.
AUTO_SPARSE = ("allgather", "zen")


def contenders(communicators: Mapping[str, Communicator], workers: int, active: str) -> dict[str, Communicator]:
    """Which of ``communicators`` (those ``communicator="auto"`` holds) are worth pricing at
    ``workers`` ranks: all of them, except that with two workers the allgather is priced without
    SparDL and ZEN where they are held (``active``, the one in use, is always priced: the profile
    prices its plan).

    With two workers the allgather receives the other rank's selection, k elements, in one
    collective. SparDL (§3.1, Eq. 3: 2⌈log2 P⌉ rounds, 2(P − 1)/P selections received) receives as
    much in two rounds. ZEN's Hierarchical Centralization (§2.3) is one exchange of k, the
    allgather's own volume; its Balanced Parallelism receives k/2 and then the owner's aggregated
    half, k to 1.5k in two collectives. Aggregating on the way pays from three workers on; with two,
    SparDL and ZEN are the allgather's equal at best, and measuring them would let noise choose
    (and cost the profile two thirds of its collective sweeps)."""
    if workers != 2 or "allgather" not in communicators:
        return dict(communicators)
    return {name: c for name, c in communicators.items() if name not in ("spardl", "zen") or name == active}


def make_communicators(spec: "str | Communicator", dense_compressor: bool, process_set: Any,
                       compression: Any, sends_dense: bool = False) -> dict[str, Communicator]:
    """Resolve ``communicator=`` into the communicators a job may send over, by name, the first in
    use from the start: the one named or given, or for ``"auto"`` Horovod's allreduce for a
    dense compressor and :data:`AUTO_SPARSE` otherwise. A job that sends dense throughout
    (``sends_dense``: ``dense=True``) chooses no communicator: ``"auto"`` holds the first of
    :data:`AUTO_SPARSE` alone, so that no other one is set up (ZEN's rounds build a process
    group of their own and probe it)."""
    if isinstance(spec, Communicator):
        return {spec.name: spec.bind(process_set, compression)}
    if spec != "auto":
        names = (spec,)
    elif dense_compressor:
        names = ("allreduce",)
    else:
        names = AUTO_SPARSE[:1] if sends_dense else AUTO_SPARSE
    return {name: COMMUNICATORS.get(name, also=("auto",))(process_set=process_set, compression=compression)
            for name in names}
