"""How the rounds of the point-to-point protocols travel: Horovod's ``alltoall``, or Gloo's send/recv.

SparDL's Spar-Reduce-Scatter and Bruck all-gather (SparDL §3.1, Algorithm 1: 2⌈log2 P⌉ rounds per
buffer), ZEN's push (ZEN §3.2) and its Hierarchical Centralization (ZEN §2.3: ⌈log2 P⌉ rounds, two
more when P is not a power of two) are rounds of point-to-point messages. A round here is started
with the messages this rank sends (``{destination: rows}``) and the ranks it receives from, and
``wait()`` returns the rows received, one tensor per source, in the order the sources were given.
Two transports carry rounds:

* :class:`HorovodRounds`: one ``hvd.alltoall`` per round, whose ``splits`` give the rows per
  destination (zero for ranks this rank does not talk to). Every round is a named Horovod
  collective: it pays the negotiation with the coordinator and up to one cycle
  (``HOROVOD_CYCLE_TIME``) before its bytes move, so a protocol of R rounds pays that toll R times
  per buffer (issue "SparDL and ZEN at the scale they were made for"). It runs wherever Horovod
  runs (Gloo, MPI, NCCL) and is the fallback.
* :class:`GlooRounds`: true point-to-point messages over a ``torch.distributed`` Gloo process
  group built beside Horovod on the same ranks (``ProcessGroupGloo`` on a ``TCPStore`` that rank 0
  opens; Horovod's collectives keep working beside it). Per destination a round sends the row count
  and then the rows; no coordinator, no cycle. The training thread posts the sends at once (Gloo
  moves them on its own threads); the receives run on a thread of this module, which takes the
  count and then posts the receive of the rows, so a round's bytes move while back-propagation goes
  on, as a Horovod collective's do on Horovod's background thread. CPU tensors only: rows of a
  CUDA buffer go through the fallback.

``rounds="auto"`` (the communicators' default) measures both at ``setup()`` with three workers or
more: every rank times ring rounds of one row over each transport, alternating, the slowest rank's
median counts, and the faster transport is kept (the same choice on every rank). Where one
transport is already :data:`PROBE_DECISIVE` times faster after a block of each order, the
remaining blocks are not run. With two workers
it keeps Horovod's: SparDL and ZEN then do not compete with the allgather (:func:`.base.contenders`). A Gloo group lives per process set and Horovod session:
after an elastic reset, ``setup()`` builds a new one on the new ranks.

Every rank starts the same rounds in the same order (the controller starts and collects buffers in
order). Messages of a round are told apart from those of other rounds in flight by a tag derived
from the round's collective name, so rounds of different buffers may overlap. A peer that dies
makes the receive fail (Gloo: connection closed, or the timeout of ``HOROVOD_GLOO_TIMEOUT_SECONDS``,
:data:`GLOO_TIMEOUT_S` by default, as for Horovod's Gloo); the error reaches the training thread
at ``wait()`` as the ``HorovodInternalError`` a Horovod collective raises there: under
``hvd.elastic.run`` the job resets (and the next session builds its group with the new ranks),
otherwise the worker exits with it and the launcher ends the job.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
import time
import warnings
import zlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

from .. import session
from ..announce import announce
from ..session import collective
from .base import Communicator, wait

#: Accepted values of the communicators' ``rounds=``.
ROUNDS = ("auto", "horovod", "gloo")
#: Seconds a Gloo round waits for a peer where ``HOROVOD_GLOO_TIMEOUT_SECONDS`` is unset (Horovod's default).
GLOO_TIMEOUT_S = 30
#: ``rounds="auto"`` times up to :data:`PROBE_BLOCKS` blocks of :data:`PROBE_ROUNDS` ring rounds per transport.
PROBE_BLOCKS, PROBE_ROUNDS = 4, 4
#: After each pair of blocks (one in each order), a transport whose round took at most 1 /
#: ``PROBE_DECISIVE`` of the other's (slowest rank's medians so far) is chosen without the rest.
PROBE_DECISIVE = 1.5


#: The environment variable that sets ``rounds=`` for communicators not given one (e.g. by name).
ROUNDS_ENV = "HOROVOD_SAFUSION_ROUNDS"


def check_rounds(rounds: object) -> str:
    """``rounds`` (``None``: :data:`ROUNDS_ENV`, else ``"auto"``) if it is one of :data:`ROUNDS`,
    else a ``ValueError`` naming it and them."""
    where = "rounds"
    if rounds is None:
        where, rounds = ROUNDS_ENV, os.environ.get(ROUNDS_ENV, "auto")
    if rounds not in ROUNDS:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, ROUNDS))}; got {rounds!r}")
    return rounds


class Round(ABC):
    """One started round: ``wait()`` returns the rows received, one tensor per source.

    Attributes:
        bytes_sent: bytes this rank sends to other ranks in the round.
    """

    bytes_sent: int = 0
    _received_bytes: int = 0

    @abstractmethod
    def wait(self) -> list[torch.Tensor]:
        """The rows received from each source, in the order the sources were given (once)."""

    @property
    def bytes_received(self) -> int:
        """Bytes received from other ranks (after :meth:`wait`)."""
        return self._received_bytes


class HorovodRounds:
    """Rounds as ``hvd.alltoall`` with splits: one named Horovod collective per round."""

    name = "horovod"

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set

    def start(self, sends: Mapping[int, torch.Tensor], sources: Sequence[int], name: str,
              empty: torch.Tensor) -> Round:
        return _AllToAllRound(self.process_set, sends, sources, name, empty)


class _AllToAllRound(Round):
    def __init__(self, ps: Any, sends: Mapping[int, torch.Tensor], sources: Sequence[int], name: str,
                 empty: torch.Tensor) -> None:
        me, size = ps.rank(), ps.size()
        parts = [sends.get(r, empty) for r in range(size)]
        self.bytes_sent = sum(p.numel() for r, p in enumerate(parts) if r != me)
        self._me, self._sources = me, list(sources)
        splits = torch.tensor([p.shape[0] for p in parts], dtype=torch.int32)
        self._handle = hvd.alltoall_async(torch.cat(parts), splits=splits, name=collective(name), process_set=ps)
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            rows, received = wait(self._handle)
            per_rank = torch.split(rows, received.tolist())
            self._result = [per_rank[r] for r in self._sources]
            self._received_bytes = sum(p.numel() for r, p in zip(self._sources, self._result) if r != self._me)
        return self._result


class GlooRounds:
    """Rounds as Gloo send/recv on a process group of the same ranks, beside Horovod.

    Built collectively (every rank of ``process_set`` at once): rank 0 opens a ``TCPStore`` on its
    host's address, Horovod broadcasts where, and every rank joins. The device uses the interface
    Horovod's Gloo uses (``HOROVOD_GLOO_IFACE``, set by ``horovodrun``) or ``GLOO_SOCKET_IFNAME``.
    """

    name = "gloo"

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set
        self.fallback = HorovodRounds(process_set)
        self.rank, self.size = process_set.rank(), process_set.size()
        timeout = datetime.timedelta(seconds=float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", GLOO_TIMEOUT_S)))
        where = failed = None
        if self.rank == 0:
            try:
                host = socket.gethostbyname(socket.gethostname())
                store = torch.distributed.TCPStore(host, 0, self.size, is_master=True, timeout=timeout,
                                                   wait_for_workers=False)
                where = (host, store.port)
            except (RuntimeError, OSError) as e:
                failed = e
        where = hvd.broadcast_object(where, root_rank=0, name=collective("saf.rounds.where"), process_set=process_set)
        if where is None:
            raise RuntimeError(f"rank 0 could not open a TCP store for the Gloo group ({failed or 'see rank 0'})")
        if self.rank != 0:
            store = torch.distributed.TCPStore(where[0], where[1], self.size, is_master=False, timeout=timeout)
        options = torch.distributed.ProcessGroupGloo._Options()
        options._timeout = timeout
        iface = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("HOROVOD_GLOO_IFACE")
        options._devices = [torch.distributed.ProcessGroupGloo.create_device(interface=iface) if iface
                            else torch.distributed.ProcessGroupGloo.create_default_device()]
        self.group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("saf.rounds", store),
                                                        self.rank, self.size, options)
        self._store = store  # rank 0's store must outlive the group's rendezvous
        self._receiver = _Receiver()

    def start(self, sends: Mapping[int, torch.Tensor], sources: Sequence[int], name: str,
              empty: torch.Tensor) -> Round:
        if empty.device.type != "cpu":
            return self.fallback.start(sends, sources, name, empty)
        return _GlooRound(self, sends, sources, name, empty)

    def close(self) -> None:
        self._receiver.close()


def _tag(name: str) -> int:
    """A round's message tag from its collective name (the same on every rank); the count travels
    with tag ``2t``, the rows with ``2t + 1``."""
    return (zlib.crc32(collective(name).encode()) & 0x3FFFFFFF) << 1


class _GlooRound(Round):
    def __init__(self, rounds: GlooRounds, sends: Mapping[int, torch.Tensor], sources: Sequence[int], name: str,
                 empty: torch.Tensor) -> None:
        group, me = rounds.group, rounds.rank
        tag = _tag(name)
        self._sources, self._me = list(sources), me
        self._works, self._kept = [], []  # sends in flight and the tensors they read
        self.bytes_sent = 0
        for dest, rows in sends.items():
            if dest == me:
                continue
            rows = rows.contiguous()
            count = torch.tensor([rows.shape[0]], dtype=torch.int64)
            self._kept += [count, rows]
            try:  # a peer already lost fails the post itself, not only the wait
                self._works.append(group.send([count], dest, tag))
                if rows.shape[0]:
                    self._works.append(group.send([rows], dest, tag + 1))
            except RuntimeError as e:
                raise _lost(e) from e
            self.bytes_sent += rows.numel()
        own = sends.get(me, empty)

        def receive() -> list[torch.Tensor]:
            counts = {src: torch.zeros(1, dtype=torch.int64) for src in self._sources if src != me}
            for work in [group.recv([c], src, tag) for src, c in counts.items()]:
                work.wait()
            rows = {src: empty.new_empty((int(c), empty.shape[1])) for src, c in counts.items()}
            for work in [group.recv([r], src, tag + 1) for src, r in rows.items() if r.shape[0]]:
                work.wait()
            return [own if src == me else rows[src] for src in self._sources]

        self._future = rounds._receiver.submit(receive)
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            try:
                result = self._future.result()
                for work in self._works:
                    work.wait()
            except RuntimeError as e:
                raise _lost(e) from e
            self._works, self._kept = [], []
            self._result = result
            self._received_bytes = sum(p.numel() for r, p in zip(self._sources, result) if r != self._me)
        return self._result


def _lost(e: RuntimeError) -> HorovodInternalError:
    """A failed Gloo round as Horovod's own collectives fail when a peer is lost: ``hvd.elastic.run``
    resets on it, and outside elastic it ends the job as theirs does."""
    return HorovodInternalError(f"horovod_safusion: a Gloo round failed: {e}")


class _Receiver:
    """One daemon thread that runs the receives of rounds in the order they were started."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="saf-rounds", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001  handed to the training thread at wait()
                future.set_exception(e)

    def close(self) -> None:
        self._jobs.put(None)


class RoundsCommunicator(Communicator):
    """A communicator whose protocol runs in point-to-point rounds (SparDL, ZEN).

    Args:
        rounds: their transport, one of :data:`ROUNDS`: ``"auto"`` (measured at :meth:`setup`,
            see the module docstring), ``"horovod"`` or ``"gloo"``; ``None`` (the default) takes
            ``$HOROVOD_SAFUSION_ROUNDS``, else ``"auto"``, so that a job (or a communicator asked
            for by name) can set it without code.
    """

    def __init__(self, process_set: Any = None, compression: Any = hvd.Compression.none, *,
                 rounds: str | None = None) -> None:
        super().__init__(process_set, compression)
        self.rounds_asked = check_rounds(rounds)
        self.rounds: HorovodRounds | GlooRounds | None = None  # resolved by setup()
        self.round_seconds: dict[str, float] = {}  # what "auto" measured, per transport

    def setup(self, compressor: Any) -> None:
        self.rounds, self.round_seconds = resolve_rounds(self.rounds_asked, self.process_set)

    def start_round(self, sends: Mapping[int, torch.Tensor], sources: Sequence[int], name: str,
                    empty: torch.Tensor) -> Round:
        """Start one round: ``sends`` (rows per destination rank; to oneself they come back as
        they are), received from ``sources``; :meth:`Round.wait` gives the rows per source."""
        if self.rounds is None:  # driven without setup() (a Controller built by hand): Horovod's
            self.rounds = HorovodRounds(self.process_set)
        return self.rounds.start(sends, sources, name, empty)


_chosen: dict[tuple[int, int, int, str], tuple[Any, dict[str, float]]] = {}


def resolve_rounds(spec: str, process_set: Any) -> tuple[Any, dict[str, float]]:
    """The transport ``rounds=spec`` asks for and the seconds per round measured (empty unless
    ``"auto"`` measured). ``"auto"`` keeps Horovod's rounds with two workers (SparDL and ZEN are
    then no better than the allgather, :func:`~.base.contenders`) and where the Gloo group could
    not be built on every rank (with a warning); otherwise it times both (:func:`probe`) and keeps
    the faster. Resolved once per process set and Horovod session; a collective."""
    key = (process_set.process_set_id, session.number(), process_set.size(), spec)
    if key in _chosen:
        return _chosen[key]
    if spec == "horovod" or process_set.size() < 2 or (spec == "auto" and process_set.size() == 2):
        chosen = HorovodRounds(process_set), {}
    elif spec == "gloo":
        chosen = gloo_rounds(process_set), {}
    else:
        gloo = gloo_rounds(process_set, fall_back=True)
        if gloo is None:
            chosen = HorovodRounds(process_set), {}
        else:
            start = time.perf_counter()
            times = probe([gloo.fallback, gloo])
            chosen = (gloo if times["gloo"] < times["horovod"] else gloo.fallback), times
            announce(f"point-to-point rounds over {chosen[0].name} (ms per round: " +
                     ", ".join(f"{name} {1e3 * t:.2f}" for name, t in times.items()) +
                     f"; probed in {time.perf_counter() - start:.2f} s)")
    _chosen[key] = chosen
    return chosen


_groups: dict[tuple[int, int, int], GlooRounds] = {}


def gloo_rounds(process_set: Any, fall_back: bool = False) -> GlooRounds | None:
    """The Gloo rounds of ``process_set`` in this Horovod session (built collectively on first use;
    an elastic reset begins a new session, whose ranks get a new group). Where building fails on
    any rank: the error, or with ``fall_back`` a warning and ``None`` (on every rank alike)."""
    key = (process_set.process_set_id, session.number(), process_set.size())
    if key not in _groups:
        for old in [k for k in _groups if k[0] == key[0]]:  # an earlier session's group, and what chose it
            _groups.pop(old).close()
        for old in [k for k in _chosen if k[0] == key[0] and k[1:3] != key[1:3]]:
            del _chosen[old]
        try:
            built, error = GlooRounds(process_set), None
        except (RuntimeError, OSError) as e:  # a store or a peer that cannot be reached
            built, error = None, e
        everywhere = hvd.allreduce(torch.tensor(int(built is not None)), op=hvd.Min,
                                   name=collective("saf.rounds.built"), process_set=process_set)
        if not int(everywhere):
            if built is not None:
                built.close()
            if not fall_back:
                raise RuntimeError(f"horovod_safusion: the Gloo group for rounds='gloo' could not be built on "
                                   f"every rank ({error or 'failed on another rank'})") from error
            if process_set.rank() == 0:
                warnings.warn(f"horovod_safusion: rounds='auto' keeps Horovod's alltoall: the Gloo group for "
                              f"point-to-point rounds could not be built on every rank ({error or 'another rank failed'})")
            return None
        _groups[key] = built
    return _groups[key]


def probe(transports: Sequence[Any]) -> dict[str, float]:
    """Seconds per ring round of one 8-byte row (to the next rank, from the previous one) over
    each of ``transports``, by name: up to :data:`PROBE_BLOCKS` blocks of :data:`PROBE_ROUNDS`
    rounds alternate between them (A B B A ..., so that a drift of the machine's speed hits all
    alike), a transport's time is the median of its rounds, and the slowest rank's counts (a
    collective: every rank of the process set calls it). After each pair of blocks the medians so
    far are agreed by one small allreduce; where the fastest transport's is at most 1 /
    :data:`PROBE_DECISIVE` of every other's, the probe ends there (the same point on every rank)."""
    ps = transports[0].process_set
    me, size = ps.rank(), ps.size()
    row = torch.zeros((1, 8), dtype=torch.uint8)
    times: dict[str, list[float]] = {t.name: [] for t in transports}
    slowest: dict[str, float] = {}
    for block in range(PROBE_BLOCKS):
        for t in (transports if block % 2 == 0 else transports[::-1]):
            for i in range(PROBE_ROUNDS + 1):  # the first round of a block warms up
                t0 = time.perf_counter()
                t.start({(me + 1) % size: row}, [(me - 1) % size], f"saf.rounds.probe.{t.name}.{block}.{i}", row[:0]).wait()
                if i:
                    times[t.name].append(time.perf_counter() - t0)
        if block % 2 == 1 or block == PROBE_BLOCKS - 1:
            mine = torch.tensor([float(np.median(times[t.name])) for t in transports], dtype=torch.float64)
            agreed = hvd.allreduce(mine, op=hvd.Max, name=collective(f"saf.rounds.probe.{block}"), process_set=ps)
            slowest = {t.name: float(s) for t, s in zip(transports, agreed)}
            best, *others = sorted(slowest.values())
            if all(other >= PROBE_DECISIVE * best for other in others):
                break
    return slowest
