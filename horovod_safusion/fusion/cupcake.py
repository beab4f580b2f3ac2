"""``cupcake``: the optimal fusion strategy of Cupcake (MLSys'23, §4), a baseline planner.

Cupcake fuses consecutive gradient tensors (back-propagation order) into groups that are
compressed together and communicated together — sparsification *behind* fusion — and searches the
contiguous partition that minimises the iteration time.

**Objective, Eq. (1)**: ``f(X) = A + Σ B(T_b) + Σ h(x_i) + Σ g(x_i) − P(X)``; Cupcake does not write
``P(X)`` out but derives the iteration time "from the timelines of back-propagation, compression
and communication" (§4.1). Here that timeline is the project's pipeline simulator
(:mod:`.simulator`): ``A`` is the profile's ``prefix`` (plus ``suffix``), ``B`` the measured ready
offsets, ``h(x_i) = T_cp`` and ``g(x_i) = T_cm`` of a ``behind`` buffer. The search evaluates
partitions with :class:`_Timeline`, which replays the simulator's recurrence on precomputed
``h``/``g`` tables with the same floating-point operations in the same order (the unit tests check
that it equals :func:`~.simulator.simulate`), because calling the simulator per state would cost
a plan object and ``2·M`` curve look-ups each.

**Search, Eqs. (2)–(3) and Algorithm 1**: ``F(M, k) = min_{k ≤ i < N} F(M + fuse(k, i), i + 1)``,
depth first, with the two prunings of §4.2 in the general form of Figure 5. For a prefix ``M``
(tensors ``0..k−1``) let ``M.comp`` be when its last group is compressed and ``M.delay`` how much
later its communication ends:

* **Pruning 2** (Insight #2, Eq. (5), Alg. 1 lines 10–16): the first candidate group is
  ``fuse(k, j*)`` with ``j*`` the largest ``j`` such that ``B(k, i) + h(k, i) ≤ M.delay`` for every
  ``k ≤ i ≤ j`` — shorter groups would only leave the link idle later. Not applied to ``x_0``
  (``M`` empty; Algorithm 1's ``Main`` enumerates every first group).
* **Pruning 1** (Insight #1, Eq. (4), Alg. 1 lines 17–25): skip ``fuse(k, i)`` when the optimistic
  outcome ``M.comp + max(B(k, N−1) + h(k, i) + h(i+1, N−1),
  max(B(k, i) + h(k, i), M.delay) + g(k, i) + g(i+1, N−1))`` already exceeds the best time found.
  Applied to ``x_0`` too, with ``M.comp = M.delay = 0`` (that is Eq. (4) itself). We add to
  ``base`` the least time the last group can communicate after it is compressed,
  ``g(N−1, N−1)`` (``g`` grows with the group): the paper's "no communication overhead" case still
  sends the last group once back-propagation and compression are done. Still a lower bound, and a
  tighter one, so Pruning 1 skips more states (docs/benchmarks.md, "Cupcake planning", has the
  states explored with and without it).
* **Bootstrap** (§4.2, "partition a DNN model into multiple groups with the same number of
  tensors"): the best of the even splits into ``1..N`` groups is the initial upper bound.
* **Dominance** (ours, not in the paper; ``dominance=True`` by default): the rest of the timeline
  depends on ``M`` only through ``k`` and the pair ``(Σ h, link free)``, and the simulator is
  monotone in both, so a state ``(k, C, L)`` is skipped when a state ``(k, C' ≤ C, L' ≤ L)`` was
  searched already. Exact under any cost curves (monotone ones, as :class:`CostCurve` makes them).
  ``dominance=False`` leaves the paper's two prunings alone. Neither makes the worst case
  polynomial: where communication hides behind back-propagation and many strategies tie within
  fractions of a millisecond, the states explored still grow steeply with N (see the benchmark);
  ``max_states`` bounds the search (the plan is then the best found, ``meta["complete"] = False``).

Both prunings are exact — Theorem 1 holds — under the paper's cost model (§4.1:
``g = α_g + β_g·x``, ``h = α_h + β_h·x``, ``α, β ≥ 0``) with additive message sizes: the bound then
needs ``Σ h(parts) ≥ h(union)`` (likewise ``g``), and Insight #2 needs ``h(a) + h(b)`` and
``g(a) + g(b)`` to depend on ``a + b`` only. Profiles with α–β curves and dense messages satisfy this; measured piecewise-linear
curves and sparse messages (``round(density·n)`` per group) only approximately, so there the
search is the paper's heuristic and ``plan.meta["exact"]`` is ``False``.

A buffer never spans a change of dtype/device group (one buffer is one flat tensor): group
boundaries cap every candidate group, and "the rest as one group" (Alg. 1 line 7) becomes the
rest cut at group changes. Worst case ``O(2^N)`` like the paper's; §5.3 reports 2.8 s and 6.6 s for
161 and 314 tensors (``benchmarks/bench_cupcake_planning.py`` measures ours).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..plan import FusionPlan, TensorInfo
from .planner import Planner, register_planner
from .profile import Profile


class _Timeline:
    """The simulator's recurrence for contiguous partitions of one profile, on precomputed tables.

    ``h[k][i]`` and ``g[k][i]`` are ``T_cp`` and ``T_cm`` of the buffer of tensors ``k..i`` under
    ``order="behind"``, ``ready`` the profile's ready offsets (non-decreasing: back-propagation order).
    """

    def __init__(self, profile: Profile) -> None:
        p = profile
        self.profile = p
        self.n = n = len(p.tensors)
        self.ready = [float(r) for r in p.ready]
        numel = np.array([t.numel for t in p.tensors], dtype=np.int64)
        nbytes = np.array([t.nbytes for t in p.tensors], dtype=np.int64)
        wire = np.array([p.wire_bytes.get(t.name, 0) for t in p.tensors], dtype=np.int64)
        selectable = np.array([p.density_of(t.name) for t in p.tensors]) * numel  # expected, per tensor
        h = np.zeros((n, n))
        g = np.zeros((n, n))
        for k in range(n):
            dense = np.cumsum(nbytes[k:])
            if p.dense_comm:
                message = dense.astype(np.float64)
            else:  # Profile.message_bytes: max(1, round(Σ density · numel)) rows of the widest row
                selected = np.maximum(1, np.rint(np.cumsum(selectable[k:])))
                message = selected * np.maximum.accumulate(wire[k:])
            g[k, k:] = p.communicate(message)
            # Profile.t_cp: the buffer's fixed work, plus compression below density 1
            h[k, k:] = p.buffer_cost + (p.compress(dense.astype(np.float64)) if p.density < 1.0 else 0.0)
        self.h, self.g = h.tolist(), g.tolist()  # lists: fast scalar look-ups in the recursion
        # numpy copies for the optimistic outcome of all candidate groups of a state at once;
        # h_rest[i] = h(i+1, N−1), g_rest likewise (0 past the end)
        self.h_np, self.g_np, self.ready_np = h, g, np.asarray(self.ready)
        self.h_rest = np.append(h[1:, n - 1], 0.0)
        self.g_rest = np.append(g[1:, n - 1], 0.0)
        group = [t.group for t in p.tensors]
        # last[k]: the last tensor a buffer starting at k may hold without mixing groups
        self.last = [0] * n
        for k in range(n - 1, -1, -1):
            self.last[k] = k if k == n - 1 or group[k + 1] != group[k] else self.last[k + 1]

    def step(self, cum_cp: float, link_free: float, k: int, i: int) -> tuple[float, float]:
        """State ``(Σ T_cp, link free)`` after the buffer ``k..i`` (the simulator's recurrence)."""
        cum_cp = cum_cp + self.h[k][i]
        fused = self.ready[i] + cum_cp
        start = max(fused, link_free)
        return cum_cp, start + self.g[k][i]

    def finish(self, cum_cp: float, link_free: float, k: int) -> tuple[float, list[int]]:
        """Link-free time when tensors ``k..N−1`` go in as few buffers as groups allow, and their ends."""
        ends = []
        while k < self.n:
            i = self.last[k]
            cum_cp, link_free = self.step(cum_cp, link_free, k, i)
            ends.append(i)
            k = i + 1
        return link_free, ends

    def evaluate(self, ends: Sequence[int]) -> float:
        """Link-free time after the last buffer of the partition whose buffers end at ``ends``."""
        cum_cp = link_free = 0.0
        k = 0
        for i in ends:
            cum_cp, link_free = self.step(cum_cp, link_free, k, i)
            k = i + 1
        return link_free

    def iteration(self, comm_end: float) -> float:
        """Predicted iteration time, as :attr:`Schedule.iteration` adds it up."""
        return self.profile.prefix + comm_end + self.profile.suffix


@register_planner("cupcake")
class CupcakePlanner(Planner):
    """Cupcake's optimal fusion strategy (MLSys'23 §4, Algorithm 1) over a profile; compression behind.

    Args:
        prune_bound: Pruning 1 (Insight #1, Eq. (4)): skip groups whose optimistic outcome is
            already worse than the best strategy found.
        prune_start: Pruning 2 (Insight #2, Eq. (5)): start each group at ``j*``.
        bootstrap: start from the best even split (§4.2) instead of an infinite upper bound.
        dominance: skip states dominated by a searched one (ours, see the module docstring).
        max_states: stop after this many states and return the best plan found (``None``: search
            to the end). The default keeps planning inside training to seconds: the search is
            exponential in the worst case, and where communication hides behind
            back-propagation the states explored grow steeply with the number of tensors
            (docs/benchmarks.md, "Cupcake planning", has the counts).

    The switches exist for ablations (the paper's Table 1 times each pruning alone); every
    combination returns an optimal plan under the paper's cost model, only the time differs.
    ``plan.meta`` records the objective, the bootstrap's, the states explored (FindOptFusion calls,
    each evaluating one complete strategy), the candidate groups each pruning skipped, and the
    seconds spent.
    """

    order = "behind"
    needs_profile = True

    def __init__(self, prune_bound: bool = True, prune_start: bool = True, bootstrap: bool = True,
                 dominance: bool = True, max_states: int | None = 100_000) -> None:
        if max_states is not None and max_states < 1:
            raise ValueError(f"max_states must be a positive number of states or None, got {max_states!r}")
        self.prune_bound = prune_bound
        self.prune_start = prune_start
        self.bootstrap = bootstrap
        self.dominance = dominance
        self.max_states = max_states

    def plan(self, tensors: Sequence[TensorInfo], profile: Profile | None = None) -> FusionPlan:
        if profile is None:
            raise ValueError("the 'cupcake' planner searches fusion strategies on a profile's measured "
                             "costs; a profile is required (the optimizer profiles the job online "
                             "first; offline: planner.plan(tensors, profile))")
        profile = _in_backprop_order(profile)
        if not profile.tensors:
            return FusionPlan([], order=self.order, planner=self.name, meta={"states_explored": 0})
        started = time.perf_counter()
        search = _Search(_Timeline(profile), self.prune_bound, self.prune_start, self.dominance,
                         self.max_states)
        bootstrap_end = search.bootstrap_even_split() if self.bootstrap else None
        search.run()
        names, buffers, k = profile.names, [], 0
        for i in search.best_ends:
            buffers.append(names[k:i + 1])
            k = i + 1
        t = search.timeline
        meta = {"objective_s": t.iteration(search.best_end),
                "bootstrap_s": None if bootstrap_end is None else t.iteration(bootstrap_end),
                "states_explored": search.explored, "pruned_by_bound": search.pruned_bound,
                "pruned_by_start": search.pruned_start, "pruned_by_dominance": search.pruned_dominated,
                "complete": not search.stopped, "search_s": time.perf_counter() - started,
                "exact": _affine_additive(profile),
                "prunings": {"bound": self.prune_bound, "start": self.prune_start, "dominance": self.dominance}}
        return FusionPlan(buffers, order=self.order, planner=self.name, meta=meta)

    def __repr__(self) -> str:
        return (f"CupcakePlanner(prune_bound={self.prune_bound}, prune_start={self.prune_start}, "
                f"bootstrap={self.bootstrap}, dominance={self.dominance}, max_states={self.max_states})")


class _Search:
    """Algorithm 1's depth-first search with its global best (``global_opt_fuse``) and counters."""

    def __init__(self, timeline: _Timeline, prune_bound: bool, prune_start: bool, dominance: bool,
                 max_states: int | None) -> None:
        self.timeline = timeline
        self.prune_bound, self.prune_start, self.max_states = prune_bound, prune_start, max_states
        self.best_end, self.best_ends = float("inf"), []
        self.explored = self.pruned_bound = self.pruned_start = self.pruned_dominated = 0
        self.stopped = False
        # searched (Σ h, link free) pairs per first tensor k, kept Pareto-minimal
        self.front: list[list[tuple[float, float]]] | None = [[] for _ in range(timeline.n)] if dominance else None

    def offer(self, end: float, ends: list[int]) -> None:
        if end < self.best_end:
            self.best_end, self.best_ends = end, ends

    def bootstrap_even_split(self) -> float:
        """Offer the splits into 1..N groups of equal tensor count (cut at group changes); the best
        becomes the initial upper bound. Returns its link-free time."""
        t = self.timeline
        for m in range(1, t.n + 1):
            ends = []
            for chunk in np.array_split(np.arange(t.n), m):
                k = int(chunk[0])
                while t.last[k] < chunk[-1]:  # a group change inside the chunk: cut there
                    ends.append(t.last[k])
                    k = t.last[k] + 1
                ends.append(int(chunk[-1]))
            self.offer(t.evaluate(ends), ends)
        return self.best_end

    def run(self) -> None:
        """Main(): Eq. (2) is FindOptFusion with M empty."""
        self.find(0, 0.0, 0.0, [])

    def find(self, k: int, cum_cp: float, link_free: float, ends: list[int]) -> None:
        """FindOptFusion(M, k), Eq. (3): ``ends`` are M's group ends, ``(cum_cp, link_free)`` its timeline."""
        t = self.timeline
        n, h, g, ready = t.n, t.h, t.g, t.ready
        if self.front is not None and self._dominated(k, cum_cp, link_free):
            self.pruned_dominated += 1
            return
        if self.max_states is not None and self.explored >= self.max_states:
            self.stopped = True
            return
        self.explored += 1
        rest_end, rest_ends = t.finish(cum_cp, link_free, k)  # Alg. 1 lines 7–9: the rest as one group
        self.offer(rest_end, ends + rest_ends)
        before = ready[k - 1] if k > 0 else 0.0
        comp = before + cum_cp      # M.comp: M's last group compressed
        delay = link_free - comp    # M.delay: how much later its communication ends
        last = t.last[k]            # no group past a dtype/device change
        j_star = k
        if self.prune_start and ends:  # Alg. 1 lines 10–16: B(k, i) + h(k, i) ≤ M.delay
            while j_star < last and ready[j_star + 1] + cum_cp + h[k][j_star + 1] <= link_free:
                j_star += 1
            self.pruned_start += j_star - k
        lo, hi = j_star, min(last, n - 2)  # i = N−1 is the rest-as-one-group case above
        if hi < lo:
            return
        candidates = range(lo, hi + 1)
        bounds = None
        if self.prune_bound:  # Alg. 1 lines 17–25, the optimistic outcome of every candidate
            hk = t.h_np[k, lo:hi + 1]
            base = (ready[n - 1] - before) + hk + t.h_rest[lo:hi + 1] + g[n - 1][n - 1]
            cases = np.maximum(t.ready_np[lo:hi + 1] - before + hk, delay) + t.g_np[k, lo:hi + 1] + t.g_rest[lo:hi + 1]
            optimistic = comp + np.maximum(base, cases)
            keep = np.flatnonzero(optimistic <= self.best_end)
            self.pruned_bound += hi - lo + 1 - keep.size
            candidates, bounds = (keep + lo).tolist(), optimistic[keep].tolist()
        for c, i in enumerate(candidates):
            if bounds is not None and bounds[c] > self.best_end:  # the best improved meanwhile
                self.pruned_bound += 1
                continue
            next_cp, next_free = t.step(cum_cp, link_free, k, i)
            self.find(i + 1, next_cp, next_free, ends + [i])

    def _dominated(self, k: int, cum_cp: float, link_free: float) -> bool:
        """Whether a searched state at ``k`` is no later in both; otherwise record this one.

        States at one ``k`` are never each other's ancestors (``k`` grows along a path), so every
        recorded state's subtree is searched by the time another state at ``k`` is entered."""
        front = self.front[k]
        if any(c <= cum_cp and f <= link_free for c, f in front):
            return True
        front[:] = [(c, f) for c, f in front if not (cum_cp <= c and link_free <= f)] + [(cum_cp, link_free)]
        return False


def _in_backprop_order(profile: Profile) -> Profile:
    """The profile with its tensors sorted by ready time (stable), as the online profiler stores them."""
    order = sorted(range(len(profile.tensors)), key=lambda i: (profile.ready[i], i))
    if order == list(range(len(order))):
        return profile
    return Profile.from_dict({**profile.to_dict(), "tensors": [[t.name, t.numel, t.element_size, t.group]
                                                                for t in (profile.tensors[i] for i in order)],
                              "ready": [profile.ready[i] for i in order]})


def _affine_additive(profile: Profile) -> bool:
    """Whether Theorem 1's premises hold: α–β cost curves and message sizes additive over groups."""
    def affine(curve) -> bool:
        x, y = curve.sizes, curve.seconds
        slope = (y[-1] - y[0]) / (x[-1] - x[0]) if x.size > 1 else 0.0
        intercept = y[0] - slope * x[0]  # α ≥ 0, else the curve is clamped at 0 near 0 bytes
        return bool(intercept >= 0 and np.allclose(y, intercept + slope * x, rtol=1e-9, atol=1e-15))
    return profile.dense_comm and affine(profile.compress) and affine(profile.communicate)
