"""``python -m horovod_safusion``: list the registries; plans side by side from a model or a profile."""
import dataclasses
import json

import pytest

from horovod_safusion.__main__ import main
from horovod_safusion.fusion import CostCurve, Profile


def test_list_names_every_registry(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("dgc", "topk", "none", "safusion-naive", "safusion-inter", "safusion", "cupcake", "omgs",
                 "allgather", "allreduce"):
        assert f"  {name} " in out


def test_plan_profiles_a_model_on_the_spot_then_replans_a_saved_profile(hvd, capsys, tmp_path):
    prof, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["plan", "--model", "digits:DigitsCNN", "--steps", "3", "--save-profile", str(prof),
                 "--json", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "16 gradient tensors, 45,418 elements, density 0.03, 1 worker(s)" in out  # the default
    for name in ("safusion-naive", "safusion-inter", "safusion", "cupcake", "omgs"):
        assert f"\n{name:<16} " in out  # one row per planner in the side-by-side table
    assert "T_cm ms" in out and "predicted iteration" in out
    p = Profile.load(prof)
    assert sorted(json.loads(plan.read_text())["buffers"][0])[0] in p.names

    # The same profile under a what-if network: 1 Gbit/s and 100 µs per collective.
    assert main(["plan", "--profile", str(prof), "--latency", "1e-4", "--bandwidth", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "16 gradient tensors" in out
    # A dense=False job's profile: its dense curve reaches its small tensors' bytes alone
    small_only = tmp_path / "sparse_job.json"
    dataclasses.replace(p, workers=2, dense_allreduce=CostCurve([4096, 8192], [1e-4, 2e-4]),
                        prices_dense=False).save(str(small_only))
    assert main(["plan", "--profile", str(small_only), "--json", str(plan)]) == 0
    assert "no dense plan priced: this profile's job ran with dense=False" in capsys.readouterr().out
    assert not json.loads(plan.read_text())["dense"]
    with pytest.raises(SystemExit, match="exactly one of"):
        main(["plan"])
