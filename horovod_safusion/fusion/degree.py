"""The fusion schemes SAFusion is compared with (SAFusion §2.4, §5, §6.2), all selecting *behind*.

SAFusion §2.4 characterises tensor fusion by its *fusion degree*: "fusion degree = 100 % means all
the tensors are fused together in a single buffer and fusion degree = 0 % means no tensors are
fused by putting every tensor into an individual buffer". With sparsification behind fusion the
selection runs over each whole buffer, so the higher the degree, the more tensors lose every
element (Observation #1, Figure 3). The baselines are points on that axis:

* ``wfbp`` — wait-free back-propagation: one buffer per tensor (degree 0 %), each sent as soon as
  its gradient is ready; with one tensor a buffer, ahead and behind select alike.
* ``oktopk`` — every tensor in one buffer selected once (degree 100 %), as SAFusion §6.2
  characterises Ok-Topk's global top-k over the flattened gradient.
* ``horovod`` — Horovod's own dense allreduce: one collective per tensor, merged by Horovod's
  Tensor Fusion (``HOROVOD_FUSION_THRESHOLD``), no compressor — the reference every speed-up is
  measured against.

:class:`FusionDegreePlanner` is that axis; ``wfbp``, ``oktopk`` and ``horovod`` are its named points,
each in the module of its name; the profiled baselines ``omgs`` and ``cupcake`` too. All use the same
compressors and error feedback as SAFusion, so a comparison isolates the fusion scheme.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

from ..plan import ORDERS, FusionPlan, TensorInfo, split_at_group_changes
from .planner import Planner


class FusionDegreePlanner(Planner):
    """Consecutive buffers of ``max(1, round(degree · N))`` tensors each (back-propagation order).

    Args:
        degree: fusion degree in [0, 1]: 0 is one buffer per tensor, 1 is one buffer for all.
        order: ``"behind"`` (select over each whole buffer, the traditional scheme) or ``"ahead"``
            (SAFusion's per-tensor selection on the same buffers).
    """

    def __init__(self, degree: float, order: str = "behind") -> None:
        if not 0.0 <= degree <= 1.0:
            raise ValueError(f"degree must satisfy 0 <= degree <= 1, got {degree!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.degree, self.order = float(degree), order

    def plan(self, tensors: Sequence[TensorInfo], profile=None) -> FusionPlan:
        names = [t.name for t in tensors]
        per = max(1, round(self.degree * len(names)))
        buffers = [names[i:i + per] for i in range(0, len(names), per)]
        buffers = split_at_group_changes(buffers, {t.name: t.group for t in tensors})
        return FusionPlan(buffers, order=self.order, planner=self.name, meta={"fusion_degree": self.degree})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(degree={self.degree}, order={self.order!r})"


class NamedDegreePlanner(FusionDegreePlanner):
    """A named point on the fusion-degree axis (``wfbp``, ``oktopk``, ``horovod``): its degree is a
    class attribute, its order ``behind``, and ``fusion=name`` builds it without arguments."""

    fixed_degree: ClassVar[float]

    def __init__(self) -> None:
        super().__init__(self.fixed_degree, "behind")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
