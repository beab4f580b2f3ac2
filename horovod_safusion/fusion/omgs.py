"""``omgs``: merged-gradient sparsification's layer-merging rule (OMGS), a baseline planner.

OMGS is Shi et al., "Communication-efficient distributed deep learning with merged gradient
sparsification" (INFOCOM'20). SAFusion §2.3 counts it among the *sparsification-behind* fusion
schemes (gradients merged first, one sparsification per merged buffer) and §6.2 says it optimises
fusion over backward, compression and communication for pipelining. That paper is not in this
project's reference set: this module implements the MG-WFBP-style merge rule (Shi et al.'s
merging criterion: merge when the start-up time saved exceeds the waiting added) as the project
specifies it, not from the paper's text.

**Rule.** Walk the tensors in back-propagation order, keeping the pipeline state of the project's
simulator (:mod:`.simulator`): ``C`` the compression time of the closed buffers (it delays
back-propagation), ``L`` when the link is free after their collectives. With an open buffer
``cur`` (its last tensor ``l−1``) and the next tensor ``l``::

    start_alone  = max(ready(l−1) + C + T_cp(cur),      L)   # cur closed now
    start_merged = max(ready(l)   + C + T_cp(cur + l),  L)   # cur waits for l
    added_wait   = start_merged − start_alone
    saved        = communicate(0 B) + compress(0 B)          # one collective, one selection fewer,
                   + buffer_cost                             # one buffer's fixed work fewer

``l`` joins ``cur`` when ``added_wait < saved``; otherwise ``cur`` is closed (``C += T_cp(cur)``,
``L = start_alone + T_cm(cur)``) and ``l`` opens a new buffer. ``saved`` is each profiled curve's
value at 0 bytes, its start-up (α) time; compression counts because selection runs once per buffer
(``compress(0)`` is 0 at density 1, where nothing is compressed), and so does the profile's
fixed work per buffer (:attr:`~.profile.Profile.buffer_cost`). A buffer never spans a change of
dtype/device group. The rule is greedy and local (``O(N)`` decisions); it does not claim optimality.
"""
from __future__ import annotations

from typing import Sequence

from ..plan import FusionPlan, TensorInfo
from .planner import Planner, register_planner
from .profile import Profile
from .simulator import simulate


@register_planner("omgs")
class OMGSPlanner(Planner):
    """Merge a gradient into the open buffer when the waiting it adds is below the start-up it saves."""

    order = "behind"
    needs_profile = True

    def plan(self, tensors: Sequence[TensorInfo], profile: Profile | None = None) -> FusionPlan:
        if profile is None:
            raise ValueError("the 'omgs' planner merges layers by a profile's measured costs; a profile "
                             "is required (the optimizer profiles the job online first; offline: "
                             "planner.plan(tensors, profile))")
        p = profile
        saved = p.communicate(0.0) + (p.compress(0.0) if p.density < 1.0 else 0.0) + p.buffer_cost
        order = sorted(range(len(p.tensors)), key=lambda i: (p.ready[i], i))  # back-propagation order
        names = [p.tensors[i].name for i in order]
        group = {t.name: t.group for t in p.tensors}
        buffers: list[list[str]] = [[names[0]]] if names else []
        cum_cp = link_free = 0.0
        merges = 0
        for name in names[1:]:
            cur = buffers[-1]
            alone = max(p.ready_of(cur[-1]) + cum_cp + p.t_cp(cur, self.order), link_free)
            merged = max(p.ready_of(name) + cum_cp + p.t_cp(cur + [name], self.order), link_free)
            if group[name] == group[cur[-1]] and merged - alone < saved:
                cur.append(name)
                merges += 1
                continue
            cum_cp += p.t_cp(cur, self.order)
            link_free = alone + p.t_cm(cur, self.order)
            buffers.append([name])
        plan = FusionPlan(buffers, order=self.order, planner=self.name,
                          meta={"startup_saved_s": saved, "merges": merges})
        plan.meta["predicted_s"] = simulate(p, plan).iteration
        return plan
