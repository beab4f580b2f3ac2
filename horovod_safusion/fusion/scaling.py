"""Scale-out on paper: communication costs fitted across worker counts, and a profile priced at
another worker count, link rate and compute speed.

A profile (SAFusion §4, "Generator module") is measured at one worker count P. To ask what a plan
would cost at P = 16–64 (the scale SAFusion §5 and its seeds evaluate at), each protocol's sweep
curves measured at several P are fitted by one cost model per protocol, and the pipeline simulator
(SAFusion §3.3) prices the plans under the profile rebuilt at the new P. For a message of ``m``
bytes offered by one rank (``Profile.message_bytes``) at P workers::

    t(m, P) = a0 + a1 · L(P) + b0 · m + b1 · V(P) · m

where L(P) counts the rounds the collective waits through and V(P) the bytes one rank receives per
byte it offers (the protocols' own volume formulas):

=================== =================== ================== ===========================================
protocol            L(P)                V(P)               from
=================== =================== ================== ===========================================
``allgather``       P − 1               P − 1              SAFusion §3.1 Step 2: every rank gets every
                                                           other rank's selection (a ring allgather)
``spardl``          2 ⌈log2 P⌉          2 (P − 1) / P      SparDL §3.1, Eq. 3: Spar-Reduce-Scatter,
                                                           then a Bruck all-gather
``zen``             ⌈log2 P⌉ (+2 when   P − 1              ZEN §2.3, Eq. 2: Hierarchical
                    P is no power of 2)                    Centralization, the union doubling per
                                                           stage on the sweep's disjoint selections
``dense``           2 (P − 1)           2 (P − 1) / P      Horovod's ring allreduce (dense bytes)
=================== =================== ================== ===========================================

The four coefficients are fitted non-negative (``scipy.optimize.nnls``) over every point of every
measured P. ``b1`` holds the link's seconds per byte at the measured rate (8 / rate) and what the
hosts spend per byte received; at another link rate the first part is replaced
(:meth:`FittedCost.curve`). On the compute side (:func:`scaled`) the back-propagation offsets, the
time before and after them and the compression costs are divided by a speed-up factor, the
assumption a user states (a GPU against this machine's cores); the communication costs are kept
except for the link's share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from scipy.optimize import nnls

from .costs import CostCurve
from .profile import Profile

#: Per protocol: (rounds L(P), received bytes per offered byte V(P)); see the module docstring.
PROTOCOLS: dict[str, tuple[Callable[[int], float], Callable[[int], float]]] = {
    "allgather": (lambda p: p - 1, lambda p: p - 1),
    "spardl": (lambda p: 2 * math.ceil(math.log2(p)), lambda p: 2 * (p - 1) / p),
    "zen": (lambda p: math.ceil(math.log2(p)) + (0 if p & (p - 1) == 0 else 2), lambda p: p - 1),
    "dense": (lambda p: 2 * (p - 1), lambda p: 2 * (p - 1) / p),
}


@dataclass(frozen=True)
class FittedCost:
    """One protocol's cost ``a0 + a1·L(P) + b0·m + b1·V(P)·m`` fitted at ``rate_bits`` per second.

    Attributes:
        protocol: a key of :data:`PROTOCOLS`.
        a0, a1, b0, b1: seconds, seconds per round, seconds per byte, seconds per received byte.
        rate_bits: the link rate the sweeps were measured at (bits per second).
        workers: the worker counts fitted.
        error: median relative error of the fit over its points.
    """

    protocol: str
    a0: float
    a1: float
    b0: float
    b1: float
    rate_bits: float
    workers: tuple[int, ...]
    error: float

    def seconds(self, nbytes, workers: int, rate_bits: float | None = None):
        """Predicted seconds of one collective of ``nbytes`` at ``workers`` and ``rate_bits``
        (default: the measured rate): the link's 8 / rate of ``b1`` is swapped for the new rate's."""
        rounds, volume = PROTOCOLS[self.protocol]
        b1 = self.b1
        if rate_bits is not None:
            b1 = max(0.0, b1 - 8.0 / self.rate_bits) + 8.0 / rate_bits
        m = np.asarray(nbytes, dtype=np.float64)
        return self.a0 + self.a1 * rounds(workers) + (self.b0 + b1 * volume(workers)) * m

    def curve(self, workers: int, rate_bits: float | None = None, max_bytes: float = 2**31) -> CostCurve:
        """:meth:`seconds` as a :class:`CostCurve` (linear over ``[0, max_bytes]``, extrapolated beyond)."""
        sizes = [0.0, float(max_bytes)]
        return CostCurve(sizes, [float(s) for s in self.seconds(sizes, workers, rate_bits)])


def fit(protocol: str, curves: dict[int, CostCurve], rate_bits: float) -> FittedCost:
    """Fit ``protocol``'s model to measured ``curves`` by worker count (at least two counts, so that
    the terms in P are told apart from the constant ones)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")
    if len(curves) < 2:
        raise ValueError(f"fitting {protocol} across worker counts needs curves at two or more, got {sorted(curves)}")
    rounds, volume = PROTOCOLS[protocol]
    rows, times = [], []
    for p, c in curves.items():
        for m, t in zip(c.sizes, c.seconds):
            rows.append([1.0, rounds(p), m, volume(p) * m])
            times.append(t)
    a, t = np.asarray(rows), np.asarray(times)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    # relative errors: every point weighs alike, small messages as much as large ones
    w = 1.0 / np.maximum(t, 1e-6)
    coef, _ = nnls(a / scale * w[:, None], t * w)
    coef = coef / scale
    error = float(np.median(np.abs(a @ coef - t) / np.maximum(t, 1e-9)))
    return FittedCost(protocol, *map(float, coef), rate_bits=rate_bits, workers=tuple(sorted(curves)), error=error)


def curves_of(profile: Profile) -> dict[str, CostCurve]:
    """The cost curves a profile measured, by protocol: each communicator's and the dense allreduce's
    (where it was swept over the model's range, :attr:`~horovod_safusion.fusion.Profile.prices_dense`)."""
    found = dict(profile.communicators) or {profile.meta.get("communicator", "?"): profile.communicate}
    if profile.dense_allreduce is not None and profile.prices_dense:
        found["dense"] = profile.dense_allreduce
    return {k: v for k, v in found.items() if k in PROTOCOLS}


def fit_profiles(profiles: dict[int, Profile], rate_bits: float) -> dict[str, FittedCost]:
    """Every protocol that at least two of ``profiles`` (by worker count) measured, fitted."""
    by_protocol: dict[str, dict[int, CostCurve]] = {}
    for p, profile in profiles.items():
        for name, c in curves_of(profile).items():
            by_protocol.setdefault(name, {})[p] = c
    return {name: fit(name, cs, rate_bits) for name, cs in by_protocol.items() if len(cs) >= 2}


def scaled(profile: Profile, fits: dict[str, FittedCost], workers: int, rate_bits: float | None = None,
           speedup: float = 1.0) -> Profile:
    """``profile`` at ``workers`` and ``rate_bits``, its computation ``speedup`` times faster: the
    communicators' curves (and the dense allreduce's) from ``fits``, the one in use first."""
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup!r}")
    sparse = {name: f.curve(workers, rate_bits) for name, f in fits.items() if name != "dense"}
    if not sparse:
        raise ValueError(f"no sparse protocol among the fits: {sorted(fits)}")
    active = profile.meta.get("communicator")
    first = active if active in sparse else next(iter(sparse))
    c = profile.compress
    return replace(profile, ready=[r / speedup for r in profile.ready], prefix=profile.prefix / speedup,
                   suffix=profile.suffix / speedup, compress=CostCurve(c.sizes, c.seconds / speedup),
                   segment_cost=profile.segment_cost / speedup, buffer_cost=profile.buffer_cost / speedup,
                   communicate=sparse[first],
                   communicators=sparse if len(sparse) > 1 else {}, workers=workers,
                   dense_allreduce=fits["dense"].curve(workers, rate_bits) if "dense" in fits else None,
                   prices_dense="dense" in fits,
                   meta=dict(profile.meta, communicator=first, scaled={"workers": workers, "rate_bits": rate_bits,
                                                                      "speedup": speedup}))
