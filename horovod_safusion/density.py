"""The density chosen for the link (``density="auto"``): send the most that the link hides.

Ours. SAFusion §3.3 sizes fusion buffers so that communication hides behind back-propagation
(Eq. 1); it takes the density as given (§5 uses 0.01 and 0.001). The density decides how much
communication there is to hide, and the right value depends on the link and the model: on a
slow link a lower density saves time until the communication is hidden, and below that it saves
nothing and costs accuracy (DGC, Lin et al., ICLR'18, §3.3 and Table 2: 0.001 needs all of DGC's
techniques to match dense accuracy); on a link that carries more for free, a higher density buys
accuracy back at no cost in time; on a fast link dense is fastest, which the planner's dense
choice already finds. One rule covers all three:

    among the candidate densities (and dense, the cap), choose the highest whose predicted
    iteration time is within :data:`MARGIN` of the fastest option's.

The planner (:class:`~horovod_safusion.fusion.SAFusionPlanner`) predicts each candidate's
iteration time from the profile — compression swept at every candidate density, communication
from the same cost curves — and the measured trial (:mod:`~horovod_safusion.trial`) confirms the
choice with the same preference: the denser of two plans is kept unless the other measured more
than :data:`MARGIN` faster.

Candidates, :data:`CANDIDATES`: 0.03 and 0.1. Error feedback holds what it does not send for about
``1/density`` steps, and the wrapped optimizer tolerates only so much delay: under the default
momentum correction, densities below 0.03 learn measurably slower per step (a language model at
4 workers stays far above dense's perplexity at 0.01 where 0.03 and 0.1 do not), so a density
the link would hide better is no saving when the steps it adds cost more than the time it saves
— priced by time alone, ``"auto"`` chose lower densities that missed the quality target a higher
one reached (docs/benchmarks.md, "Time to accuracy at 4 hosts"). Above 0.1 a selected element costs
a value and an index (8 bytes against 4) and an allgather receives (P − 1)·k of them, so a sparse
step sends about as much as a dense allreduce and dense, the cap, is the better choice.
:data:`MARGIN`: 20 %. A lower density pays only where the time it saves per step outweighs the steps
it adds to reach the same quality, and those are many: a lower density costs accuracy on both
models ``bench_convergence`` trains, while on a slow link where communication is mostly hidden it
saves only a small part of a step. A margin of the order of the steps' noise chooses the lower
density on such a saving; the margin must be wider than the time a step down in density typically saves once
communication is mostly hidden (docs/benchmarks.md, "Choosing the density", has the runs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from .plan import FusionPlan

AUTO = "auto"
#: The densities ``density="auto"`` chooses among, besides dense (see the module docstring).
CANDIDATES = (0.03, 0.1)
#: The density of ``density=None`` (every sparsifier's default): the lowest candidate of
#: ``"auto"``, for the same reason. SAFusion (§5) and DGC evaluate 0.01 and 0.001, with all of
#: DGC's techniques at 0.001; under this plugin's defaults (momentum correction, no warm-up) 0.01
#: learns too slowly per step beyond two workers for its smaller messages to pay:
#: the language model stays far above dense's perplexity at 4 and 8 workers where 0.03 ends near
#: it (docs/benchmarks.md, "The default density").
DEFAULT = min(CANDIDATES)
#: A denser option is preferred while its iteration time is within this fraction of the fastest's.
MARGIN = 0.2
#: The least density of a tensor whose gradient is spread, where ``density`` is left to its default
#: or ``"auto"`` (``spread_density``, :mod:`horovod_safusion.spread`): the densest candidate. Such a
#: gradient's largest 3 % hold a small part of it, so at the default density most of it waits;
#: sent at this density, the convolutional model ``bench_convergence`` trains keeps Horovod's
#: accuracy where the default density does not, while the language model's embedding and decoder,
#: whose gradients concentrate, keep the default's smaller messages (docs/benchmarks.md, "Density
#: by tensor").
SPREAD = max(CANDIDATES)


def is_auto(density: object) -> bool:
    """Whether ``density=`` asks for the density to be chosen (``"auto"``)."""
    return isinstance(density, str) and density == AUTO


def check_auto(density: object) -> None:
    """A string ``density=`` other than ``"auto"`` is an error naming the accepted values."""
    if isinstance(density, str) and density != AUTO:
        raise ValueError(f"density must be a number with 0 < density <= 1 or 'auto', got {density!r}")


def density_of(plan: "FusionPlan") -> float | None:
    """The density ``plan`` chose (1 for a dense plan), or ``None`` where it chose none."""
    return 1.0 if plan.dense else plan.density


def densest_within(predicted: Mapping[str, float], density: Mapping[str, float], margin: float = MARGIN) -> str:
    """The option with the highest ``density`` among those whose ``predicted`` seconds are within
    ``margin`` of the fastest (ties: the faster, then the name)."""
    fastest = min(predicted.values())
    near = [k for k, s in predicted.items() if s <= (1.0 + margin) * fastest]
    return max(near, key=lambda k: (density[k], -predicted[k], k))


def preferred(first: float | None, second: float | None, margin: float = MARGIN) -> tuple[int | None, float]:
    """Between two plans sending at densities ``first`` and ``second`` (``None``: not a density
    choice): the index of the denser one, or ``None`` where neither is preferred, and the factor by
    which the other must be faster to win (``1 + margin``, or 1)."""
    if first is None or second is None or first == second:
        return None, 1.0
    return (0 if first > second else 1), 1.0 + margin
