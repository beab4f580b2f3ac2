"""A job's profile: what the generator measured online, and the costs derived from it.

SAFusion §4, "Generator module": "The generator gets the gradient communication time and
compression time by online profiling." A :class:`Profile` holds, for one job,

* the tensors in measured back-propagation order with their *pure* gradient-ready offsets
  (seconds after the first gradient, with the plugin's own work removed),
* the time before the first gradient (forward and the head of backward) and after the last
  collective (write-back and optimizer step),
* the compression cost curve (one buffer of one segment, seconds against dense bytes) plus the
  extra cost of each further segment — the controller selects a whole buffer in one pass, so a
  buffer of many small tensors does not pay a fixed cost per tensor — and the communication cost
  curve (one collective of the active communicator, seconds against message bytes),
* the density and wire format needed to predict message sizes,
* the job's small-tensor rule (:func:`~horovod_safusion.plan.send_small_dense`): the tensors it
  sends whole with Horovod's allreduce at every step, which a plan prices as sent — by the dense
  allreduce's curve, with no compression — and sizes its sparse buffers without,
* the fixed work of one buffer on the training thread beyond its compression (ours, not in the
  paper): starting its collective and decoding what comes back. A plan of more buffers pays it
  more often; without it the simulator prices a plan of many buffers too cheap.

It is the same on every rank (reduced across ranks before use) and round-trips through JSON, so a
plan can be made, inspected and compared offline. The quantities of SAFusion Table 1 for a buffer
of tensors are :meth:`t_b`, :meth:`t_cp` and :meth:`t_cm`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Collection, Sequence

from ..plan import FusionPlan, TensorInfo, send_small_dense, small_tensors
from .costs import CostCurve


@dataclass
class Profile:
    """Measured costs of one job (see the module docstring).

    Attributes:
        tensors: gradient tensors in measured back-propagation order.
        ready: per tensor, seconds from the first gradient to this gradient, plugin work removed.
        prefix: seconds from the end of one step to the first gradient of the next.
        suffix: seconds from the last collective's end to the end of ``step()``.
        compress: compression seconds of a one-segment buffer against its dense bytes.
        communicate: one collective's seconds against the bytes one rank offers (its dense bytes,
            or its selected elements times the wire row).
        density: the compressor's target density.
        wire_bytes: bytes one selected element occupies on the wire, per tensor name.
        dense_comm: the communicator sends whole buffers (message = dense bytes).
        workers: number of ranks of the job.
        segment_cost: extra compression seconds per additional segment of a buffer.
        buffer_cost: seconds of fixed work per buffer on the training thread outside compression
            (starting the collective, decoding its result), part of :meth:`t_cp`; the
            :attr:`suffix` holds the decoding's share that grows with bytes, not this.
        dense_allreduce: Horovod's dense allreduce, seconds against the bytes of one buffer, for
            pricing the dense alternative (``None`` where it was not measured).
        communicators: per communicator the job may send over (``communicator="auto"``), by
            name, its curve as :attr:`communicate` is the one in use's; empty where the job has
            no choice to price.
        densities: per candidate density (``density="auto"``), the compression curve and the
            per-segment cost swept at that density, as :attr:`compress` and
            :attr:`segment_cost` are at :attr:`density`; empty where the density is given.
        floors: the least density of each tensor with one (a spread gradient's,
            :mod:`horovod_safusion.spread`): it selects at the larger of :attr:`density` and that.
        min_selected: the job's ``min_selected`` (0: every tensor sparsified), with
            :attr:`dense_share` the rule of :meth:`small`.
        dense_share: the job's ``dense_share``.
        prices_dense: :attr:`dense_allreduce` was swept over the model's range, so it prices a
            dense plan; ``False`` where the job swept it only up to the bytes of the tensors it
            sends whole (``dense=False``), which a dense plan's buffers would extrapolate far
            beyond (:meth:`as_dense` refuses it, and the planner does not offer dense).
        meta: free-form provenance (compressor, communicator, iterations, observed waits).
    """

    tensors: list[TensorInfo]
    ready: list[float]
    prefix: float
    suffix: float
    compress: CostCurve
    communicate: CostCurve
    density: float
    wire_bytes: dict[str, int]
    dense_comm: bool = False
    segment_cost: float = 0.0
    buffer_cost: float = 0.0
    workers: int = 1
    dense_allreduce: CostCurve | None = None
    communicators: dict[str, CostCurve] = field(default_factory=dict)
    densities: dict[float, tuple[CostCurve, float]] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)
    min_selected: int = 0
    dense_share: float = 0.0
    prices_dense: bool = True
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.ready) != len(self.tensors):
            raise ValueError(f"{len(self.tensors)} tensors but {len(self.ready)} ready times")
        self._index = {t.name: i for i, t in enumerate(self.tensors)}
        self._info = {t.name: t for t in self.tensors}

    # ---- the quantities of SAFusion Table 1 -----------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def ready_of(self, name: str) -> float:
        return self.ready[self._index[name]]

    def density_of(self, name: str) -> float:
        """The density tensor ``name`` selects at: :attr:`density`, or its floor where higher."""
        return max(self.density, self.floors.get(name, 0.0))

    def selected(self, names: Sequence[str], order: str = "ahead") -> int:
        """Elements one rank is expected to send for these tensors."""
        if self.dense_comm:
            return sum(self._info[n].numel for n in names)
        if order == "behind":
            return max(1, round(sum(self.density_of(n) * self._info[n].numel for n in names)))
        return sum(max(1, round(self.density_of(n) * self._info[n].numel)) for n in names)

    def dense_bytes(self, names: Sequence[str]) -> int:
        return sum(self._info[n].nbytes for n in names)

    def message_bytes(self, names: Sequence[str], order: str = "ahead") -> float:
        """Bytes one rank sends for a buffer of these tensors (dense, or selected rows)."""
        if self.dense_comm:
            return float(self.dense_bytes(names))
        row = max(self.wire_bytes[n] for n in names)
        return float(self.selected(names, order) * row)

    def t_cm(self, names: Sequence[str], order: str = "ahead") -> float:
        """T_cm: communication time of one buffer holding ``names``."""
        return self.communicate(self.message_bytes(names, order))

    def t_cp(self, names: Sequence[str], order: str = "ahead") -> float:
        """T_cp: the buffer's fixed work (:attr:`buffer_cost`) plus its compression: one pass, plus
        a segment per tensor under ``ahead`` (none at density 1)."""
        if self.density >= 1.0:
            return self.buffer_cost
        extra = 0 if order == "behind" else len(names) - 1
        return self.buffer_cost + (self.compress(self.dense_bytes(names)) + self.segment_cost * extra)

    def t_whole(self, names: Sequence[str], order: str = "ahead") -> float:
        """T_cm of a buffer sent whole with Horovod's allreduce (a plan's dense buffer of small
        tensors): the dense allreduce's curve at its dense bytes; where the profile has no dense
        curve, the buffer is priced as a sparse one (:meth:`t_cm`)."""
        if self.dense_allreduce is None:
            return self.t_cm(names, order)
        return self.dense_allreduce(float(self.dense_bytes(names)))

    def small(self) -> frozenset[str]:
        """The tensors the job sends whole at :attr:`density` (:attr:`min_selected`,
        :attr:`dense_share`; :func:`~horovod_safusion.plan.small_tensors`): a planner sizes its
        sparse buffers over the others and prices these as sent (:meth:`t_whole`)."""
        if self.density >= 1.0:
            return frozenset()
        numel = {t.name: t.numel for t in self.tensors}
        return frozenset(small_tensors(self.names, numel, self.density, self.min_selected, self.dense_share))

    def send_small_dense(self, plan: FusionPlan) -> FusionPlan:
        """``plan`` as the job runs it: :meth:`small` moved into dense buffers by the controller's
        own rule (:func:`~horovod_safusion.plan.send_small_dense`, dtype and device groups as the
        tensors')."""
        numel = {t.name: t.numel for t in self.tensors}
        group = {t.name: t.group for t in self.tensors}
        return send_small_dense(plan, numel, group, self.density, self.min_selected, self.dense_share)

    def without(self, names: Collection[str]) -> "Profile":
        """The same job with the tensors ``names`` left out (those sent whole)."""
        keep = [i for i, t in enumerate(self.tensors) if t.name not in names]
        return replace(self, tensors=[self.tensors[i] for i in keep], ready=[self.ready[i] for i in keep])

    def t_b(self, names: Sequence[str], previous_last: str | None) -> float:
        """T_b: back-propagation time producing this buffer's gradients, after the previous buffer."""
        start = 0.0 if previous_last is None else self.ready_of(previous_last)
        return max(0.0, max(self.ready_of(n) for n in names) - start)

    def over(self, communicator: str) -> "Profile":
        """The same job priced for sending over ``communicator``, one of :attr:`communicators`."""
        if communicator not in self.communicators:
            raise ValueError(f"this profile prices no communicator {communicator!r}; it prices "
                             f"{sorted(self.communicators)}")
        return replace(self, communicate=self.communicators[communicator],
                       meta=dict(self.meta, communicator=communicator))

    def at(self, density: float) -> "Profile":
        """The same job priced for selecting at ``density``, one of :attr:`densities`."""
        if density not in self.densities:
            raise ValueError(f"this profile prices no density {density!r}; it prices {sorted(self.densities)}")
        compress, segment_cost = self.densities[density]
        return replace(self, density=density, compress=compress, segment_cost=segment_cost)

    def as_dense(self) -> "Profile":
        """The same job priced for Horovod's dense allreduce: every element sent, nothing
        selected (no compression time), the dense allreduce's cost curve."""
        if self.dense_allreduce is None:
            raise ValueError("this profile has no dense allreduce cost curve (dense_allreduce=None)")
        if not self.prices_dense:
            raise ValueError("this profile's dense allreduce curve covers only the tensors its job sent "
                             "whole (prices_dense=False: the job ran with dense=False), not a dense plan")
        return Profile(tensors=self.tensors, ready=self.ready, prefix=self.prefix, suffix=self.suffix,
                       compress=self.compress, communicate=self.dense_allreduce, density=1.0,
                       wire_bytes=self.wire_bytes, dense_comm=True, segment_cost=0.0,
                       buffer_cost=self.buffer_cost, workers=self.workers,
                       dense_allreduce=self.dense_allreduce, meta=dict(self.meta, dense=True))

    # ---- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"tensors": [[t.name, t.numel, t.element_size, t.group] for t in self.tensors],
                "ready": list(self.ready), "prefix": self.prefix, "suffix": self.suffix,
                "compress": self.compress.to_dict(), "communicate": self.communicate.to_dict(),
                "density": self.density, "wire_bytes": self.wire_bytes, "dense_comm": self.dense_comm,
                "segment_cost": self.segment_cost, "buffer_cost": self.buffer_cost, "workers": self.workers,
                "dense_allreduce": None if self.dense_allreduce is None else self.dense_allreduce.to_dict(),
                "communicators": {name: c.to_dict() for name, c in self.communicators.items()},
                "densities": [[d, c.to_dict(), seg] for d, (c, seg) in self.densities.items()],
                "floors": self.floors, "min_selected": self.min_selected, "dense_share": self.dense_share,
                "prices_dense": self.prices_dense, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        return cls(tensors=[TensorInfo(*t) for t in d["tensors"]], ready=list(d["ready"]),
                   prefix=d["prefix"], suffix=d["suffix"], compress=CostCurve.from_dict(d["compress"]),
                   communicate=CostCurve.from_dict(d["communicate"]), density=d["density"],
                   wire_bytes=dict(d["wire_bytes"]), dense_comm=d.get("dense_comm", False),
                   segment_cost=d.get("segment_cost", 0.0), buffer_cost=d.get("buffer_cost", 0.0),
                   workers=d.get("workers", 1),
                   dense_allreduce=None if d.get("dense_allreduce") is None else CostCurve.from_dict(d["dense_allreduce"]),
                   communicators={name: CostCurve.from_dict(c) for name, c in d.get("communicators", {}).items()},
                   densities={float(x): (CostCurve.from_dict(c), float(seg)) for x, c, seg in d.get("densities", [])},
                   floors={n: float(f) for n, f in d.get("floors", {}).items()},
                   min_selected=int(d.get("min_selected", 0)), dense_share=float(d.get("dense_share", 0.0)),
                   prices_dense=bool(d.get("prices_dense", True)), meta=d.get("meta", {}))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            return cls.from_dict(json.load(f))
