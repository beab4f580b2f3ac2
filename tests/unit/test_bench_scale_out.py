"""``bench_scale_out``'s calibration takes SparDL's sweeps from the job that names it (the default,
``communicator="auto"``, no longer prices SparDL), and its "auto" column chooses as the plugin
does: among the allgather, ZEN and dense."""
import dataclasses
import os
import sys

import numpy as np

from horovod_safusion.fusion import CostCurve
from horovod_safusion.fusion.scaling import PROTOCOLS, fit_profiles
from synthetic import synthetic_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_scale_out  # noqa: E402

SIZES = np.geomspace(100, 1e7, 12)
SPARDL_JOB = "safusion:communicator=spardl:dense=false"


def curve(protocol: str, p: int, a1: float) -> CostCurve:
    rounds, volume = PROTOCOLS[protocol]
    return CostCurve(SIZES, 1e-3 + a1 * rounds(p) + 2e-9 * volume(p) * SIZES)


def job(profile) -> dict:
    return {"failed": None, "warm": [{"profile": profile.to_dict()}]}


def raw_results() -> dict:
    """Three worker counts at 1 Gbit/s: the default's profile prices the allgather (and ZEN from
    P = 4 on, as ``contenders`` does); the SparDL job's prices SparDL alone, and SparDL is the
    cheapest protocol by far."""
    base = synthetic_profile([4e6] * 6, np.linspace(0.01, 0.06, 6))
    raw = {}
    for p in (2, 4, 8):
        held = {"allgather": curve("allgather", p, 1e-3)} | ({"zen": curve("zen", p, 1e-3)} if p > 2 else {})
        default = dataclasses.replace(base, communicate=held["allgather"], communicators=held if len(held) > 1 else {},
                                      workers=p, meta={"communicator": "allgather"})
        spardl = dataclasses.replace(base, communicate=curve("spardl", p, 1e-5), communicators={}, workers=p,
                                     meta={"communicator": "spardl"})
        raw[f"{p}x1gbit"] = {"lstm": {"jobs": {"safusion": job(default), SPARDL_JOB: job(spardl)}}}
    return raw


def test_spardl_is_fitted_from_its_own_job_and_auto_never_chooses_it():
    raw = raw_results()
    default = bench_scale_out.profiles_by_p(raw, "lstm", "1gbit", "safusion")
    assert all("spardl" not in prof.communicators for prof in default.values())
    calibrated = bench_scale_out.with_named_sweeps(raw, "lstm", "1gbit", default)
    assert {p: sorted(prof.communicators) for p, prof in calibrated.items()} == {
        2: ["allgather", "spardl"], 4: ["allgather", "spardl", "zen"], 8: ["allgather", "spardl", "zen"]}
    fits = fit_profiles(calibrated, 1e9)
    assert fits["spardl"].workers == (2, 4, 8) and fits["zen"].workers == (4, 8)
    rows = bench_scale_out.outlook(calibrated[2], fits, [16, 64], [10.0], speedup=50.0)
    for row in rows:
        assert min(row["options"], key=row["options"].get) == "spardl"  # the fastest on paper
        assert row["auto"] in ("allgather", "zen", "dense")  # not what "auto" holds
