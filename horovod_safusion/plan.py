"""The fusion plan as data: which tensors share a fusion buffer and where selection happens.

A :class:`FusionPlan` is an ordered list of buffers, each an ordered list of parameter names in
back-propagation order, plus the sparsification order:

* ``ahead``  — every tensor is sparsified on its own before it is merged into its buffer
  (SAFusion §3.1, Steps 1–2; Figure 5), so every tensor with a nonzero gradient keeps elements;
* ``behind`` — the dense gradients are merged first and one selection runs over the whole
  buffer (the traditional scheme of SAFusion §2.4, Figures 1(c) and 2).

The controller keeps the mapping "tensor name → buffer id" (SAFusion §4, "Controller module").
Every rank must run the same plan, or ranks would pair different buffers in one collective;
:func:`check_plan_across_ranks` compares a digest at start and names the first differing buffer
(the alignment property of SAFusion §3.2).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from .session import collective

ORDERS = ("ahead", "behind")
MAX_BUFFER_ELEMENTS = 2**31 - 1  # buffer-relative indices travel as int32
#: The default floor of :func:`send_small_dense`: a tensor that would send fewer elements per step is
#: sent whole (``DistributedOptimizer(min_selected=...)``).
MIN_SELECTED = 64
#: The default share of :func:`send_small_dense`: the smallest tensors that together hold at most
#: this share of the model's elements are sent whole (``DistributedOptimizer(dense_share=...)``).
DENSE_SHARE = 0.15


@dataclass(frozen=True)
class TensorInfo:
    """What a planner knows about one gradient tensor: planners see these records, never the
    model, so plans are data that can be made offline, saved, compared and checked across ranks."""

    name: str
    numel: int
    element_size: int
    group: str  # dtype and device: one fusion buffer is one flat tensor, so never mix groups

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class FusionPlan:
    """Ordered fusion buffers of parameter names plus the sparsification order.

    Attributes:
        buffers: buffer ``i`` holds ``buffers[i]``, names in the order their gradients become
            ready during back-propagation. Buffers are launched as soon as their last tensor is in.
        order: ``"ahead"`` (select per tensor, SAFusion §3.1) or ``"behind"`` (select per buffer).
        planner: name of the planner that made the plan (informational; part of the digest).
        dense: send every element with Horovod's dense allreduce, one per buffer, instead of
            selecting: what ``fusion="safusion"`` does where a dense allreduce is the faster choice
            (a fast link, or a model too small to profit). Residuals are sent along, a chunk per step.
        dense_buffers: indices of buffers sent dense with Horovod's allreduce on every step while
            the others are sparsified: the small tensors (:func:`send_small_dense`).
        communicator: the registered communicator that sends the sparse buffers, where the plan
            chooses one (``communicator="auto"`` under ``fusion="safusion"``: the one the profile
            priced fastest); ``None`` keeps the job's communicator in use.
        density: the density the sparse buffers select at, where the plan chooses it
            (``density="auto"``: :mod:`~horovod_safusion.density`); ``None`` keeps the
            compressor's.
    """

    buffers: tuple[tuple[str, ...], ...]
    order: str = "ahead"
    planner: str = "custom"
    dense: bool = False
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    dense_buffers: tuple[int, ...] = ()
    communicator: str | None = None
    density: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffers", tuple(tuple(b) for b in self.buffers))
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        for i, b in enumerate(self.buffers):
            if len(b) == 0:
                raise ValueError(f"fusion buffer {i} is empty; every buffer needs at least one tensor")
        object.__setattr__(self, "dense_buffers", tuple(sorted(int(i) for i in self.dense_buffers)))
        bad = [i for i in self.dense_buffers if not 0 <= i < len(self.buffers)]
        if bad:
            raise ValueError(f"dense_buffers {bad} are not buffers of this plan (it has {len(self.buffers)})")

    # ---- queries -------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """All tensor names in plan order."""
        return [n for b in self.buffers for n in b]

    def validate(self, trainable: Iterable[str], numel: dict[str, int] | None = None) -> None:
        """Raise ``ValueError`` unless every trainable name appears exactly once and nothing else.

        With ``numel`` given, also check that no buffer exceeds the int32 index range.
        """
        trainable = list(trainable)
        seen: dict[str, int] = {}
        for i, b in enumerate(self.buffers):
            for n in b:
                if n in seen:
                    raise ValueError(f"tensor {n!r} appears in fusion buffers {seen[n]} and {i}; "
                                     "each trainable parameter must appear exactly once")
                seen[n] = i
        unknown = [n for n in seen if n not in set(trainable)]
        if unknown:
            raise ValueError(f"fusion plan names tensors that are not trainable parameters: {unknown[:5]}")
        missing = [n for n in trainable if n not in seen]
        if missing:
            raise ValueError(f"fusion plan misses trainable parameters: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        if numel is not None:
            for i, b in enumerate(self.buffers):
                total = sum(numel[n] for n in b)
                if total > MAX_BUFFER_ELEMENTS:
                    raise ValueError(f"fusion buffer {i} holds {total} elements, more than int32 "
                                     f"buffer-relative indices can address ({MAX_BUFFER_ELEMENTS})")

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"planner": self.planner, "order": self.order, "dense": self.dense,
                "buffers": [list(b) for b in self.buffers], "dense_buffers": list(self.dense_buffers),
                "communicator": self.communicator, "density": self.density, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "FusionPlan":
        return cls(buffers=d["buffers"], order=d.get("order", "ahead"),
                   planner=d.get("planner", "custom"), dense=bool(d.get("dense", False)),
                   meta=d.get("meta", {}), dense_buffers=tuple(d.get("dense_buffers", ())),
                   communicator=d.get("communicator"), density=d.get("density"))

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "FusionPlan":
        return cls.from_dict(json.loads(text))

    def digest(self) -> str:
        """SHA-256 over what ranks must agree on: buffers, order, dense, the dense buffers and the
        communicator and density (not ``meta``)."""
        agreed = {"order": self.order, "dense": self.dense, "buffers": [list(b) for b in self.buffers],
                  "dense_buffers": list(self.dense_buffers)}
        if self.communicator is not None:
            agreed["communicator"] = self.communicator
        if self.density is not None:
            agreed["density"] = self.density
        canon = json.dumps(agreed, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    def first_difference(self, other: "FusionPlan") -> str | None:
        """Human-readable description of the first difference to ``other``, or ``None``."""
        if self.order != other.order:
            return f"sparsification order differs: {self.order!r} vs {other.order!r}"
        if self.dense != other.dense:
            return f"dense allreduce differs: {self.dense} vs {other.dense}"
        if self.communicator != other.communicator:
            return f"communicator differs: {self.communicator!r} vs {other.communicator!r}"
        if self.density != other.density:
            return f"density differs: {self.density!r} vs {other.density!r}"
        if self.dense_buffers != other.dense_buffers:
            return f"dense buffers differ: {list(self.dense_buffers)} vs {list(other.dense_buffers)}"
        for i, (a, b) in enumerate(zip(self.buffers, other.buffers)):
            if a != b:
                return f"fusion buffer {i} differs: {list(a)[:4]}... vs {list(b)[:4]}..."
        if len(self.buffers) != len(other.buffers):
            return f"number of fusion buffers differs: {len(self.buffers)} vs {len(other.buffers)}"
        return None


def check_plan_across_ranks(plan: FusionPlan, process_set=None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``process_set`` hold the same plan.

    One allgather of 32-byte digests; only on a mismatch are two plans broadcast, so that every
    rank can name the first buffer in which it differs from another rank.
    """
    import torch
    import horovod.torch as hvd

    ps = process_set if process_set is not None else hvd.global_process_set
    mine = torch.tensor(list(bytes.fromhex(plan.digest())), dtype=torch.uint8)
    digests = hvd.allgather(mine, name=collective("saf.plan.digest"), process_set=ps).view(-1, 32)
    differs = [i for i in range(len(digests)) if not torch.equal(digests[i], digests[0])]
    if not differs:
        return
    # Ranks that agree with the set's first rank compare against the first rank that does not,
    # and vice versa; both plans travel once.
    ranks = list(ps.ranks) if getattr(ps, "ranks", None) else list(range(len(digests)))
    me = ranks.index(hvd.rank())
    first = hvd.broadcast_object(plan.to_dict(), root_rank=ranks[0], name=collective("saf.plan.a"), process_set=ps)
    other = hvd.broadcast_object(plan.to_dict(), root_rank=ranks[differs[0]], name=collective("saf.plan.b"),
                                 process_set=ps)
    versus, reference = (ranks[differs[0]], other) if me not in differs else (ranks[0], first)
    diff = plan.first_difference(FusionPlan.from_dict(reference))
    raise ValueError("fusion plans differ across ranks (every rank must fuse the same tensors in "
                     f"the same buffers); rank {hvd.rank()} versus rank {versus}: {diff}")


def send_small_dense(plan: FusionPlan, numel: dict[str, int], group: dict[str, object], density: float,
                     min_selected: int, share: float = 0.0) -> FusionPlan:
    """``plan`` with its small tensors moved into dense buffers (one per group: dtype and device),
    after the sparse ones. Small is either of:

    * **few elements a step**: ``ceil(density · numel)`` below ``min_selected``;
    * **a small share of the model**: the smallest tensors (ties by name) whose elements together
      are at most ``share`` of the model's (:func:`smallest_within`).

    Such a tensor is sent whole with Horovod's allreduce at every step.

    Why few elements: with error feedback, a tensor that sends a handful of elements per step (a
    bias, a norm's scale, a small head: k = 1 at density 0.01 for up to 100 elements) holds most of
    its gradient back for many steps and then delivers it at once, and SGD's momentum multiplies
    that burst; such tensors made a small network diverge where dense SGD converged, and an
    error-feedback top-k written from scratch diverged alike (a property of the method). They cost
    nothing worth saving on the wire: below ``min_selected / density`` elements each. PowerSGD
    (Vogels et al., NeurIPS'19, §4 and its PyTorch hook) likewise sends 1-D tensors and matrices
    that compression would not shrink enough uncompressed, in one batch, as do BytePS, CGX and
    Espresso.

    Why a share: error feedback holds what a step does not send for about ``1/density`` steps, and
    that delay costs a tensor whose gradient is spread over all its elements more than one whose
    gradient gathers in a few rows: a language model's embedding and vocabulary decoder keep
    nearly all their gradient's energy in the top few percent (the batch's words), its recurrent
    weights far less. Sent whole, the recurrent weights of the benchmarks' LSTM, an eighth of its
    elements, took its perplexity at 8 workers to dense's, where selected with the rest it ended
    above; the share, not a kind of layer, picks them, because the small tensors of any model cost
    little sent whole (docs/benchmarks.md, "Small tensors sent whole: the LSTM's recurrent weights",
    has the runs and why the share is what it is).

    Names already in a dense buffer stay there (so the rule can be applied again to its own
    result, or to a plan that names its dense buffers itself); a plan sent dense as a whole, or
    ``min_selected <= 0`` (every tensor sparsified, the share too), is returned as it is. Every
    rank computes the same plan."""
    if plan.dense or min_selected <= 0:
        return plan
    kept_dense = {n for i in plan.dense_buffers for n in plan.buffers[i]}
    small = small_tensors(plan.names, numel, density, min_selected, share) - kept_dense
    if not small:
        return plan
    dense = small | kept_dense
    sparse = [[n for n in b if n not in small] for i, b in enumerate(plan.buffers) if i not in plan.dense_buffers]
    sparse = [b for b in sparse if b]
    by_group: dict[object, list[str]] = {}
    for n in plan.names:  # back-propagation order within each dense buffer
        if n in dense:
            by_group.setdefault(group[n], []).append(n)
    buffers = sparse + list(by_group.values())
    return replace(plan, buffers=tuple(tuple(b) for b in buffers),
                   dense_buffers=tuple(range(len(sparse), len(buffers))))


def small_tensors(names: Sequence[str], numel: dict[str, int], density: float, min_selected: int,
                  share: float = 0.0) -> set[str]:
    """The tensors of ``names`` that :func:`send_small_dense` sends whole at ``density``: those
    that would select fewer than ``min_selected`` elements a step, and the smallest within
    ``share`` of the elements (:func:`smallest_within`); none where ``min_selected <= 0``. The
    planner prices them as sent (:meth:`~horovod_safusion.fusion.Profile.small`)."""
    if min_selected <= 0:
        return set()
    few = {n for n in names if math.ceil(density * numel[n]) < min_selected}
    return few | smallest_within(names, numel, share)


def smallest_within(names: Sequence[str], numel: dict[str, int], share: float) -> set[str]:
    """The smallest of ``names`` (ties by name, so that neither the plan's layout nor a rank's
    order of parameters changes the choice) whose elements together are at most ``share`` of all
    of theirs: the longest such run from the smallest up."""
    total, running = sum(numel[n] for n in names), 0
    chosen: set[str] = set()
    for n in sorted(names, key=lambda n: (numel[n], n)):
        running += numel[n]
        if running > share * total:
            break
        chosen.add(n)
    return chosen


def split_by_capacity(names: Sequence[str], nbytes: dict[str, int], capacity: int) -> list[list[str]]:
    """Cut ``names`` into consecutive buffers of at most ``capacity`` dense bytes.

    A tensor larger than ``capacity`` gets a buffer of its own.
    """
    buffers: list[list[str]] = []
    current: list[str] = []
    size = 0
    for n in names:
        if current and size + nbytes[n] > capacity:
            buffers.append(current)
            current, size = [], 0
        current.append(n)
        size += nbytes[n]
    if current:
        buffers.append(current)
    return buffers


def split_at_group_changes(buffers: Sequence[Sequence[str]], group: dict[str, object]) -> list[list[str]]:
    """Cut buffers where the group key (dtype, device) of consecutive tensors changes: one
    buffer is one flat tensor."""
    out: list[list[str]] = []
    for b in buffers:
        current: list[str] = []
        for n in b:
            if current and group[n] != group[current[-1]]:
                out.append(current)
                current = []
            current.append(n)
        out.append(current)
    return out
