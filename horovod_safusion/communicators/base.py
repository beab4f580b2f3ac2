"""Communicator interface and registry: how one fusion buffer is synchronised.

A communicator receives, per fusion buffer and step, the values this rank selected and their
buffer-relative indices, starts *one* asynchronous collective (so communication overlaps the rest
of back-propagation, SAFusion §3.1 Step-2), and later returns the reduced dense flat buffer.
The reduction follows Horovod's scaling: ``postscale · Σ_ranks prescale · x`` and, for
``op=Average``, a further ``1 / size``. Values of different ranks at the same index add up.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

import torch
import horovod.torch as hvd

from ..registry import Registry


class Pending:
    """An in-flight buffer synchronisation, in two phases.

    ``collect()`` waits for the collective and returns its raw output; ``decode(raw)`` turns that
    into the reduced dense flat buffer (unpacking, ``index_add_``, scaling). The controller times
    them apart: waiting is communication, decoding is computation. ``wait()`` does both; every
    phase runs once and later calls return the same result.
    """

    def __init__(self, collect: Callable[[], Any], decode: Callable[[Any], torch.Tensor], bytes_sent: int) -> None:
        self._collect, self._decode = collect, decode
        self._raw: Any = None
        self._result: torch.Tensor | None = None
        self.bytes_sent = bytes_sent

    def collect(self) -> Any:
        if self._raw is None:
            self._raw = self._collect()
        return self._raw

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._decode(self.collect())
        return self._result


class Communicator(ABC):
    """Synchronises fusion buffers across the ranks of a process set.

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

    def bind(self, process_set: Any, compression: Any) -> "Communicator":
        """Attach the optimizer's process set and wire compression (for instances made by users)."""
        self.process_set = process_set
        self.compression = compression
        return self

    @abstractmethod
    def start(self, tag: str, values: torch.Tensor, indices: torch.Tensor | None, numel: int,
              op: int, prescale: float, postscale: float) -> Pending:
        """Start synchronising one buffer.

        Args:
            tag: short, stable collective name of the buffer (same on every rank).
            values: selected values (all ``numel`` values when ``indices`` is ``None``).
            indices: buffer-relative int64 indices of ``values``, or ``None`` for all.
            numel: elements of the dense flat buffer.
            op: ``hvd.Average`` or ``hvd.Sum``.
            prescale, postscale: Horovod's scale factors (``gradient_predivide_factor``).
        """

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
