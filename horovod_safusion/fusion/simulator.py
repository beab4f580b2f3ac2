"""Pipeline simulator: the schedule and iteration time a plan gets under a profile.

The intra-worker pipeline of SAFusion §3.3 (Figures 9–11): back-propagation produces gradients;
when a buffer's last gradient is in, its sparse tensor fusion (compression, ``T_cp``) runs on the
same thread and delays the rest of back-propagation (``T_cp`` here also holds the buffer's fixed
work outside compression, :attr:`.Profile.buffer_cost`: starting its collective and decoding it,
which every buffer of a plan pays on that thread); its collective (``T_cm``) starts as soon as
both the buffer is fused and the link is free. For buffer ``i`` (in launch order)::

    fused_i      = ready_i + Σ_{j≤i} T_cp^j          (ready_i: pure back-propagation offset)
    comm_start_i = max(fused_i, comm_end_{i−1})
    comm_end_i   = comm_start_i + T_cm^i
    W_i          = max(0, fused_i − comm_end_{i−1})   (the link idles: Figure 9's waiting periods)

The iteration takes ``prefix + comm_end_M + suffix``; the non-overlapped communication time is
``NOCT = comm_end_M − fused_M``, what communication adds after the computation is done. A plan's
dense buffer (its small tensors, sent whole with Horovod's allreduce on every step:
:func:`~horovod_safusion.plan.send_small_dense`) takes the same link in the same order, with no
compression (``T_cp`` is its fixed work alone) and ``T_cm`` from the dense allreduce's curve
(:meth:`.Profile.t_whole`). Planners, tests and the CLI share this one model.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import FusionPlan
from .profile import Profile


@dataclass(frozen=True)
class BufferTiming:
    """One buffer's row of a schedule (seconds relative to the first gradient)."""

    index: int
    tensors: int
    dense_bytes: int
    message_bytes: float
    t_b: float
    t_cp: float
    t_cm: float
    fused: float
    comm_start: float
    comm_end: float
    wait: float


@dataclass(frozen=True)
class Schedule:
    """A plan's predicted pipeline under a profile."""

    buffers: tuple[BufferTiming, ...]
    prefix: float
    suffix: float

    @property
    def compute_end(self) -> float:
        return self.buffers[-1].fused if self.buffers else 0.0

    @property
    def comm_end(self) -> float:
        return max((b.comm_end for b in self.buffers), default=0.0)

    @property
    def noct(self) -> float:
        """Non-overlapped communication time."""
        return max(0.0, self.comm_end - self.compute_end)

    @property
    def iteration(self) -> float:
        """Predicted iteration time."""
        return self.prefix + max(self.compute_end, self.comm_end) + self.suffix

    @property
    def waits(self) -> list[float]:
        """W_i of Figure 9 for buffers 2..M."""
        return [b.wait for b in self.buffers[1:]]

    def table(self) -> str:
        rows = [f"{'buffer':>6} {'tensors':>7} {'dense B':>11} {'sparse B':>10} {'T_b ms':>8} "
                f"{'T_cp ms':>8} {'T_cm ms':>8} {'wait ms':>8}"]
        for b in self.buffers:
            rows.append(f"{b.index:>6} {b.tensors:>7} {b.dense_bytes:>11,} {b.message_bytes:>10,.0f} "
                        f"{1e3 * b.t_b:>8.3f} {1e3 * b.t_cp:>8.3f} {1e3 * b.t_cm:>8.3f} {1e3 * b.wait:>8.3f}")
        rows.append(f"predicted iteration {1e3 * self.iteration:.2f} ms, NOCT {1e3 * self.noct:.2f} ms")
        return "\n".join(rows)


def simulate(profile: Profile, plan: FusionPlan) -> Schedule:
    """Schedule ``plan`` under ``profile`` (see the module docstring for the model)."""
    whole = {plan.buffers[i] for i in plan.dense_buffers}
    buffers = sorted(plan.buffers, key=lambda b: max(profile.ready_of(n) for n in b))
    rows, cum_cp, link_free, prev_last = [], 0.0, 0.0, None
    for i, names in enumerate(buffers):
        last = max(names, key=profile.ready_of)
        t_b = profile.t_b(names, prev_last)
        if names in whole:
            t_cp, t_cm, message = profile.buffer_cost, profile.t_whole(names, plan.order), profile.dense_bytes(names)
        else:
            t_cp, t_cm = profile.t_cp(names, plan.order), profile.t_cm(names, plan.order)
            message = profile.message_bytes(names, plan.order)
        cum_cp += t_cp
        fused = profile.ready_of(last) + cum_cp
        start = max(fused, link_free)
        wait = max(0.0, fused - link_free) if i > 0 else 0.0
        link_free = start + t_cm
        rows.append(BufferTiming(i, len(names), profile.dense_bytes(names), float(message),
                                 t_b, t_cp, t_cm, fused, start, link_free, wait))
        prev_last = last
    return Schedule(tuple(rows), profile.prefix, profile.suffix)
