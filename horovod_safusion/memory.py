"""What the plugin holds in memory: its own tensors, by where they hang, and the process's RSS.

Memory is measured like speed (``benchmarks/bench_memory.py``; docs/benchmarks.md, "Memory"): a
user who picks a data-parallel plugin for a model that barely fits needs to know what it costs per
gradient element. :func:`held` walks the objects of one ``DistributedOptimizer`` — the controller
and its fusion buffers, the residuals, the compressor, the communicator, the profiler — and sums
the bytes of the *distinct* tensor storages they reach (two views of one storage count once, a
NumPy array that views a tensor's memory counts with it). The model's parameters, their gradients
and the wrapped optimizer's own state (SGD's momentum buffers) belong to the user, as with
``hvd.DistributedOptimizer``, and are left out. :func:`rss` reads the resident set (``VmRSS``) and
its peak (``VmHWM``) of this process, :func:`resident` the resident set with the allocator's free
memory handed back, and :func:`reset_peak` starts a new peak, so that one process can measure the
peak of each phase.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import gc
from typing import Any, Iterator

import numpy as np
import torch


@dataclasses.dataclass
class Held:
    """Tensor storages held by the plugin.

    Attributes:
        bytes: total bytes of the distinct storages.
        by_path: bytes per storage, keyed by the first attribute path that reached it
            (``controller.buffers[0].flat``), largest first.
    """

    bytes: int
    by_path: dict[str, int]

    def table(self, top: int = 12) -> str:
        """The largest storages, one per line, in MB."""
        rows = [f"{n / 1e6:10.2f} MB  {path}" for path, n in list(self.by_path.items())[:top]]
        rest = len(self.by_path) - top
        if rest > 0:
            rows.append(f"{sum(list(self.by_path.values())[top:]) / 1e6:10.2f} MB  ({rest} more)")
        return "\n".join(rows + [f"{self.bytes / 1e6:10.2f} MB  total"])


def _storage_key(obj: Any) -> tuple[str, int, int] | None:
    """(device, base address, bytes) of the memory ``obj`` lives in, or None if it holds none."""
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.layout != torch.strided:
            return None
        storage = obj.untyped_storage()
        return str(obj.device), storage.data_ptr(), storage.nbytes()
    if isinstance(obj, np.ndarray):
        base = obj
        while isinstance(base.base, np.ndarray):
            base = base.base
        return "cpu", base.__array_interface__["data"][0], base.nbytes
    return None


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{path}[{k!r}]", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"{path}[{i}]", v
    elif type(obj).__module__.startswith("horovod_safusion"):
        fields = getattr(obj, "__dict__", None)
        if fields is None and hasattr(obj, "__slots__"):
            fields = {k: getattr(obj, k) for k in obj.__slots__ if hasattr(obj, k)}
        for k, v in (fields or {}).items():
            yield f"{path}.{k}", v
        if isinstance(obj, torch.Generator):
            return


def walk(roots: dict[str, Any], exclude: set[tuple[str, int]] = frozenset()) -> Held:
    """Bytes of the distinct storages reachable from ``roots`` (name → object) through containers
    and the attributes of this package's objects, leaving out storages in ``exclude``
    (``(device, address)`` pairs)."""
    seen_objects: set[int] = set()
    found: dict[tuple[str, int], tuple[str, int]] = {}
    stack = list(reversed(list(roots.items())))
    stack = [(path, obj) for path, obj in stack]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        key = _storage_key(obj)
        if key is not None:
            device, ptr, nbytes = key
            if nbytes and (device, ptr) not in exclude and (device, ptr) not in found:
                found[(device, ptr)] = (path, nbytes)
            continue
        children = list(_children(obj, path))
        stack.extend(reversed(children))
    by_path = dict(sorted(((p, n) for p, n in found.values()), key=lambda kv: -kv[1]))
    return Held(sum(by_path.values()), by_path)


def user_storages(optimizer: torch.optim.Optimizer) -> set[tuple[str, int]]:
    """The storages of the user's side: parameters, their gradients and the wrapped optimizer's
    own state (e.g. SGD's momentum buffers)."""
    out = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            for t in (p, p.grad):
                key = _storage_key(t) if t is not None else None
                if key is not None:
                    out.add(key[:2])
    for state in optimizer.state.values():
        for t in state.values():
            key = _storage_key(t) if isinstance(t, torch.Tensor) else None
            if key is not None:
                out.add(key[:2])
    return out


def held(optimizer: Any) -> Held:
    """What a ``horovod_safusion.DistributedOptimizer`` holds beyond the user's tensors."""
    roots = {name.lstrip("_"): getattr(optimizer, name) for name in
             ("_controller", "_profiler", "_timeline", "_planner") if getattr(optimizer, name, None) is not None}
    return walk(roots, user_storages(optimizer))


def model_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the trainable parameters the optimizer steps (the "model" memory is measured in)."""
    return sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)


def rss() -> dict[str, int]:
    """This process's resident set now (``rss``) and its peak so far (``hwm``), in bytes, from
    ``/proc/self/status`` (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "hwm"] = int(value.split()[0]) * 1024
    return out


def resident() -> int:
    """This process's resident set in bytes after a garbage collection and with the C allocator's
    free memory handed back to the system (``malloc_trim``, glibc), so that what is left is what is
    alive, give or take fragmentation."""
    gc.collect()
    _libc().malloc_trim(0)
    return rss()["rss"]


def reset_peak() -> None:
    """Start a new peak: ``VmHWM`` is set to the current resident set (``/proc/self/clear_refs``,
    Linux 4.0 and later), so :func:`rss`'s ``hwm`` is the peak since this call."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
