"""What a checkpoint holds of horovod-safusion, and how residuals move between world sizes.

Error feedback is state like momentum: every unsent gradient element waits in a rank's residual,
and compressors and communicators carry decisions from step to step (thresholds and their
estimation steps, ExDyna's partitions, SparDL's B-SAG ``h``, ZEN's hash seed and scheme choice).
A resume that drops any of it changes the results, and one that drops residuals loses gradient.

Everything here is encoded as tensors, numbers, strings, lists, tuples and dicts, so that a
checkpoint loads with ``torch.load(path)`` under its default ``weights_only=True``.

Residuals are per rank. :func:`redistribute` maps the residuals of a job of P ranks onto a job of
Q ranks so that the job's total unsent gradient is kept: old rank j's residual goes to new rank
``j mod Q`` (summed in old-rank order where several land on one rank). Growing (Q > P) moves
every residual unchanged, so the total is bit for bit the same; shrinking sums in float, in the
order a sum over old ranks takes.
"""
from __future__ import annotations

import importlib
import io
from typing import Any

import numpy as np
import torch

from .session import collective

_OBJECT, _ARRAY, _GENERATOR = "__object__", "__ndarray__", "__generator__"


def encode(value: Any) -> Any:
    """``value`` as tensors and plain Python data (inverse: :func:`decode`)."""
    if isinstance(value, torch.Generator):
        return {_GENERATOR: value.get_state()}
    if isinstance(value, np.ndarray):
        return {_ARRAY: torch.from_numpy(value.copy()) if value.size else torch.empty(0, dtype=_torch_dtype(value))}
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(encode(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    cls = type(value)
    if not cls.__module__.startswith(__package__ + "."):
        raise TypeError(f"cannot checkpoint a {cls.__module__}.{cls.__qualname__}")
    return {_OBJECT: f"{cls.__module__}:{cls.__qualname__}", "state": encode(vars(value))}


def decode(value: Any) -> Any:
    """The object :func:`encode` encoded (classes only from this package)."""
    if isinstance(value, dict):
        if _GENERATOR in value:
            gen = torch.Generator()
            gen.set_state(value[_GENERATOR])
            return gen
        if _ARRAY in value:
            return value[_ARRAY].numpy().copy()
        if _OBJECT in value:
            module, qualname = value[_OBJECT].split(":")
            if not module.startswith(__package__ + "."):
                raise ValueError(f"refusing to rebuild {value[_OBJECT]!r} from a checkpoint")
            cls: Any = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            obj = cls.__new__(cls)
            obj.__dict__.update(decode(value["state"]))
            return obj
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(decode(v) for v in value)
    return value


def _torch_dtype(a: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.zeros(1, dtype=a.dtype)).dtype


class Stateful:
    """Mixin: ``state_dict()`` / ``load_state_dict()`` over the attributes named in
    :attr:`state_fields` — what changes from step to step, never the constructor's settings."""

    state_fields: tuple[str, ...] = ()

    def state_dict(self) -> dict[str, Any]:
        return {f: encode(getattr(self, f)) for f in self.state_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in self.state_fields:
            if f in state:
                setattr(self, f, decode(state[f]))


def redistribute(residuals: dict[int, dict[str, torch.Tensor]], old_size: int, new_size: int,
                 rank: int) -> dict[str, torch.Tensor]:
    """This rank's residuals when the residuals of every old rank (``residuals[j]``, j < old_size)
    move to a job of ``new_size`` ranks: old rank j goes to new rank ``j mod new_size``."""
    mine: dict[str, torch.Tensor] = {}
    for j in range(old_size):
        if j % new_size != rank:
            continue
        for name, r in residuals[j].items():
            mine[name] = r.clone() if name not in mine else mine[name] + r
    return mine


def gather(obj: Any, name: str, process_set: Any) -> list[Any]:
    """Every rank's ``obj`` (tensors and plain data), in rank order, on every rank of
    ``process_set`` — ``hvd.allgather_object`` for any process set (Horovod 0.28's takes none).
    Horovod is imported here, not with the module: the compressors' state mixin lives in this
    module, and the device path runs without Horovod (``tests/gpu`` on a GPU machine)."""
    import horovod.torch as hvd
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    sizes = hvd.allgather(torch.tensor([data.numel()]), name=collective(f"{name}.sizes"), process_set=process_set)
    gathered = hvd.allgather(data, name=collective(f"{name}.bytes"), process_set=process_set)
    return [torch.load(io.BytesIO(part.numpy().tobytes()))
            for part in torch.split(gathered, sizes.tolist())]


def pack(controller: Any, profiler: Any, process_set: Any, all_ranks: bool) -> dict:
    """What the optimizer's ``state_dict()`` adds under ``"safusion"``: per rank (this one, or all
    with ``all_ranks``, a collective) the controller's rank state (residuals, momenta, compressor
    and communicator state); for the job, the controller's state (step, loss scale, plan) and the
    profiler's."""
    size, rank = process_set.size(), process_set.rank()
    local = controller.rank_state()
    per_rank = dict(enumerate(gather(local, "saf.state_dict", process_set))) if all_ranks and size > 1 \
        else {rank: local}
    return {"format": 1, "world_size": size, "rank": rank, "all_ranks": bool(all_ranks or size == 1),
            "ranks": per_rank, **controller.state_dict(), "profiler": profiler.state_dict()}


def unpack(controller: Any, profiler: Any, saved: dict) -> None:
    """Load what :func:`pack` saved (the profiler's state is ``"generator"`` in checkpoints of
    version 0.1.0); where the plan could not be taken (another world size, other parameters), the
    profiler profiles again, from the plan in use."""
    plan_taken = controller.load_state_dict(saved, saved["ranks"], int(saved["world_size"]), bool(saved["all_ranks"]))
    profiler.load_state_dict(saved["profiler"] if "profiler" in saved else saved["generator"])
    if not plan_taken:
        profiler.restart()
