"""Communicator interface and registry: how one fusion buffer is synchronised.

A communicator receives, per fusion buffer and step, an :class:`Outgoing` record — the values this
rank selected and their buffer-relative indices — and the job's :class:`Reduction`, starts *one*
asynchronous collective (so communication overlaps the rest of back-propagation, SAFusion §3.1
Step-2), and later returns the reduced dense flat buffer (:class:`Pending`). The reduction follows
Horovod's scaling: ``postscale · Σ_ranks prescale · x`` and, for ``op=Average``, a further
``1 / size``. Values of different ranks at the same index add up; sparse communicators decode
through one place, :meth:`Communicator.decode_into`.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

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
    up to :data:`MAX_POLL_INTERVAL`; the added latency is below one Horovod cycle (1 ms)."""
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
class Outgoing:
    """One fusion buffer's contribution of this rank, as the controller hands it over.

    Attributes:
        tag: short, stable collective name of the buffer (same on every rank).
        values: selected values (all ``numel`` values when ``indices`` is ``None``).
        indices: buffer-relative int64 indices of ``values``, or ``None`` for all.
        numel: elements of the dense flat buffer.
        residual: the buffer's unselected rest (this rank's new residual), or ``None`` when
            everything was selected or nothing may be taken from it (a non-finite buffer).
        rows: the selection already packed as wire rows (:mod:`horovod_safusion.wire`) by the
            device path's kernels, or ``None``.

    Valid until the :class:`Pending` that :meth:`Communicator.start` returned has finished
    ``wait()``. ``residual`` and ``indices`` are read-only (``residual`` is a view of the
    controller's buffer, which holds the residuals); ``values`` may be reduced in place (the dense
    allreduce does: sending everything, it is the buffer itself).
    """

    tag: str
    values: torch.Tensor
    indices: torch.Tensor | None
    numel: int
    residual: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def indices_or_all(self) -> torch.Tensor:
        """The indices of :attr:`values`: :attr:`indices`, or every index when it is ``None``."""
        return torch.arange(self.numel, device=self.device) if self.indices is None else self.indices


class Pending:
    """An in-flight buffer synchronisation, in two phases.

    ``collect()`` waits for the collective and returns its raw output; ``decode(raw)`` turns that
    into the reduced dense flat buffer (unpacking, ``index_add_``, scaling). The controller times
    them apart: waiting is communication, decoding is computation. ``wait()`` does both; every
    phase runs once and later calls return the same result.

    Multi-round protocols (SparDL, ZEN, ExDyna) launch their first round when the buffer starts
    and run the later rounds inside ``collect()``, which the controller calls in buffer order on
    every rank, so every rank submits the same collectives in the same order.

    Attributes set by the protocol while it runs (read by the controller after ``wait()``):
        bytes_sent: payload bytes this rank submitted.
        bytes_received: payload bytes this rank received from *other* ranks (``None`` where the
            collective hides it, e.g. a dense allreduce).
        selected: elements this rank's contribution carried, where it differs from what the
            compressor selected (ExDyna sends the union of all ranks' exclusive selections).
        leftover: a dense flat tensor (``numel`` elements, this rank, unscaled) of values the
            protocol did *not* deliver although the controller counted them as sent — SparDL's
            in-procedure and end-procedure residuals, ExDyna's non-exclusive selections — or
            negative corrections for values it delivered from the residual (ExDyna's
            all-reduce of every rank's accumulator at the gathered indices). The controller adds
            it into the per-parameter residuals, so error feedback loses nothing and checkpoints
            stay complete. ``None``: nothing to hand back.
        feedback: what the job's synchronisation tells the compressor about the buffer's selection
            (ExDyna: the job's selected count k′ = |U|); the controller passes it to
            :meth:`~horovod_safusion.compressors.base.Compressor.feedback`. ``None``: nothing.
    """

    def __init__(self, collect: Callable[[], Any], decode: Callable[[Any], torch.Tensor], bytes_sent: int) -> None:
        self._collect, self._decode = collect, decode
        self._raw: Any = None
        self._result: torch.Tensor | None = None
        self.bytes_sent = bytes_sent
        self.bytes_received: int | None = None
        self.selected: int | None = None
        self.leftover: torch.Tensor | None = None
        self.feedback: int | None = None

    def collect(self) -> Any:
        if self._raw is None:
            self._raw = self._collect()
        return self._raw

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._decode(self.collect())
        return self._result


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
        self._outputs: dict[str, torch.Tensor] = {}  # decoding buffers by tag, see output()
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

    def output(self, tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed dense flat buffer to decode ``tag``'s result into, reused from step to step.
        Memory taken afresh each step arrives as new pages, and faulting them in cost more than
        the decoding itself; zeroing reused memory costs a fraction of that. Valid until ``tag`` is decoded again: the controller copies it into the
        gradients at once."""
        out = self._outputs.get(tag)
        if out is None or out.numel() != numel or out.dtype != dtype or out.device != device:
            out = self._outputs[tag] = torch.zeros(numel, dtype=dtype, device=device)
            return out
        return out.zero_()

    def decode_into(self, out: Outgoing, reduction: Reduction, values: torch.Tensor | None = None,
                    indices: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The reduced dense flat buffer of ``out``: its :meth:`output` buffer with what the ranks
        delivered added in — ``values`` at ``indices`` (at every index when ``indices`` is ``None``)
        or, where the protocol received wire ``rows`` of the buffer's dtype, those rows
        (:func:`~horovod_safusion.kernels.decode_rows`) — equal indices adding up, then scaled by
        ``reduction`` over the process set's size."""
        result = self.output(out.tag, out.numel, out.dtype, out.device)
        if rows is not None:
            kernels.decode_rows(rows, result)
        elif indices is None:
            result.add_(values)
        else:
            result.index_add_(0, indices, values)
        scale = reduction.scale(self.process_set.size())
        if scale != 1.0:
            result.mul_(scale)
        return result

    def release_outputs(self, prefix: str) -> None:
        """Free the decoding buffers of tags starting with ``prefix`` (the profile's sweeps)."""
        for tag in [t for t in self._outputs if t.startswith(prefix)]:
            del self._outputs[tag]

    def setup(self, compressor: Any) -> None:
        """Called once on every rank of the process set when the optimizer is built, after the
        fusion plan was checked across ranks: a communicator may run collectives here (ZEN
        broadcasts its hash seeds) or check that it can work with ``compressor``. Default: nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


COMMUNICATORS: Registry = Registry("communicator", "communicators", Communicator)
register_communicator = COMMUNICATORS.register  # class decorator: ``@register_communicator("name")``
available_communicators = COMMUNICATORS.names   # names accepted by ``communicator=`` besides "auto"


def make_communicator(spec: "str | Communicator", dense_compressor: bool, process_set: Any,
                      compression: Any) -> Communicator:
    """Resolve ``communicator=``: ``"auto"`` picks a dense allreduce for dense compressors and
    the sparse allgather (SAFusion's default, §3.1 Step-2) otherwise."""
    if isinstance(spec, Communicator):
        return spec.bind(process_set, compression)
    if spec == "auto":
        spec = "allreduce" if dense_compressor else "allgather"
    return COMMUNICATORS.get(spec, also=("auto",))(process_set=process_set, compression=compression)
