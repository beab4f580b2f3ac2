"""Scale-out on paper: cost models fitted across worker counts, and profiles priced at another P."""
import dataclasses

import numpy as np
import pytest

from horovod_safusion.fusion import CostCurve, SAFusionPlanner, simulate
from horovod_safusion.fusion.scaling import PROTOCOLS, fit, fit_profiles, scaled
from synthetic import synthetic_profile

SIZES = np.geomspace(100, 1e7, 12)


def measured(protocol, p, a0, a1, b0, b1):
    rounds, volume = PROTOCOLS[protocol]
    return CostCurve(SIZES, a0 + a1 * rounds(p) + (b0 + b1 * volume(p)) * SIZES)


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_fit_recovers_the_model_it_was_measured_from_and_predicts_a_larger_p(protocol):
    truth = dict(a0=2e-3, a1=5e-4, b0=1e-9, b1=8e-9)
    f = fit(protocol, {p: measured(protocol, p, **truth) for p in (2, 4, 8)}, rate_bits=1e9)
    assert f.error < 1e-6 and f.workers == (2, 4, 8)
    big = measured(protocol, 64, **truth)
    assert np.allclose(f.seconds(big.sizes, 64), big.seconds, rtol=1e-6)


def test_another_link_rate_swaps_only_the_links_seconds_per_byte():
    truth = dict(a0=1e-3, a1=1e-4, b0=0.0, b1=8e-9 + 2e-9)  # 1 Gbit/s: 8 ns per byte, plus 2 ns on the hosts
    f = fit("allgather", {p: measured("allgather", p, **truth) for p in (2, 4)}, rate_bits=1e9)
    m = 1e6
    at_10 = float(f.seconds(m, 16, rate_bits=1e10))
    expected = 1e-3 + 1e-4 * 15 + (0.8e-9 + 2e-9) * 15 * m
    assert at_10 == pytest.approx(expected, rel=1e-6)


def test_bad_fits_are_clear_errors():
    with pytest.raises(ValueError, match="unknown protocol 'ring'; known: allgather, spardl, zen, dense"):
        fit("ring", {2: CostCurve([0, 1], [0, 1]), 4: CostCurve([0, 1], [0, 1])}, 1e9)
    with pytest.raises(ValueError, match=r"needs curves at two or more, got \[2\]"):
        fit("zen", {2: CostCurve([0, 1], [0, 1])}, 1e9)


def test_a_scaled_profile_prices_every_fitted_protocol_at_the_new_p_and_speed():
    base = synthetic_profile([4_000_000, 400_000, 4_000_000], [0.0, 0.05, 0.1], cp=(1e-3, 1e-9), suffix=0.02)
    profiles = {}
    for p in (2, 4, 8):
        curves = {name: measured(name, p, 1e-3, 2e-4, 1e-10, 8e-9) for name in ("allgather", "spardl", "zen")}
        profiles[p] = dataclasses.replace(base, density=0.01, dense_comm=False, communicators=curves,
                                          communicate=curves["allgather"], workers=p,
                                          dense_allreduce=measured("dense", p, 1e-3, 2e-4, 1e-10, 8e-9),
                                          meta={"communicator": "allgather"})
    fits = fit_profiles(profiles, 1e9)
    assert set(fits) == {"allgather", "spardl", "zen", "dense"}
    at = scaled(profiles[2], fits, 64, rate_bits=1e11, speedup=10)
    assert at.workers == 64 and set(at.communicators) == {"allgather", "spardl", "zen"}
    assert at.ready == pytest.approx([r / 10 for r in base.ready]) and at.suffix == pytest.approx(0.002)
    assert at.compress(1e6) == pytest.approx(base.compress(1e6) / 10)
    # at 64 workers the allgather receives 63 selections, SparDL under 2: the planner leaves it
    assert at.communicators["allgather"](1e5) > at.communicators["spardl"](1e5)
    plan = SAFusionPlanner(dense=False).plan(at.tensors, at)
    assert plan.communicator != "allgather"
    assert simulate(at.over(plan.communicator), plan).iteration == pytest.approx(plan.meta["predicted_iteration_s"])
    with pytest.raises(ValueError, match="speedup must be positive, got 0"):
        scaled(profiles[2], fits, 16, speedup=0)
    # a dense curve swept for a dense=False job's small tensors alone is no dense allreduce to fit
    small_only = {p: dataclasses.replace(q, prices_dense=False) for p, q in profiles.items()}
    fits = fit_profiles(small_only, 1e9)
    assert "dense" not in fits
    at = scaled(small_only[2], fits, 64)
    assert at.dense_allreduce is None and not at.prices_dense
