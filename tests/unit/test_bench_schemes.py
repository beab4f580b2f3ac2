"""The benchmarks' one label grammar (``benchmarks/schemes.py``): a label means the same
optimizer arguments in every benchmark, and a bad label stops with a message naming it."""
import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_convergence  # noqa: E402
import bench_peers  # noqa: E402
import schemes  # noqa: E402


@pytest.mark.parametrize("label, kwargs", [
    ("safusion", {}),
    ("safusion@0.03", {"density": 0.03}),
    ("safusion@auto", {"density": "auto"}),
    ("wfbp@0.01/topk", {"fusion": "wfbp", "density": 0.01, "compressor": "topk"}),
    ("safusion@0.1+densestart", {"density": 0.1, "warmup_steps": 7, "warmup_schedule": "dense"}),
    ("safusion@0.001+dgc", {"density": 0.001, "warmup_steps": 7, "momentum_correction": True,
                            "momentum_masking": True, "local_clipping": 0.25}),
    ("safusion@0.01+mc+nomask", {"density": 0.01, "momentum_correction": True, "momentum_masking": False}),
    ("safusion+nomask", {"momentum_masking": False}),  # the default's correction, without masking
    ("safusion+classic", {"momentum_correction": False}),
    ("safusion@0.01+ef21", {"density": 0.01, "error_feedback": "ef21-sgdm"}),
    ("safusion:communicator=spardl:dense=false:min_selected=0",
     {"communicator": "spardl", "dense": False, "min_selected": 0}),
    ("safusion:dense_share=0", {"dense_share": 0.0}),
    ("safusion:spread_density=0.03", {"spread_density": 0.03}),
    ("safusion:critical_regimes=none", {"critical_regimes": None}),
    ("safusion:critical_regimes=5", {"critical_regimes": 5}),
    ("safusion@0.5:communicator=scalecom:compression=fp16",
     {"density": 0.5, "communicator": "scalecom", "compression": "fp16"}),
])
def test_a_label_resolves_to_the_same_arguments_everywhere(label, kwargs):
    scheme = schemes.parse(label)
    assert scheme.ours and scheme.kwargs(warmup_steps=7, clip=0.25) == kwargs
    # bench_peers adds nothing of its own at the library's profile_steps; bench_convergence only
    # its documented defaults, dense=False with the default's critical regimes, which a label's own
    # options override
    peers = argparse.Namespace(profile_steps=bench_peers.default_profile_steps())
    assert bench_peers.ours_kwargs(scheme, peers) == scheme.kwargs(warmup_steps=bench_peers.DENSE_WARMUP)
    task = argparse.Namespace(clip=0.25)
    conv = bench_convergence.our_kwargs(scheme, task, 70, argparse.Namespace(warmup_fraction=0.1, min_selected=None))
    assert conv == {"dense": False, "critical_regimes": 10, **scheme.kwargs(warmup_steps=7, clip=0.25)}


def test_peers_and_environment_variables():
    s = schemes.parse("horovod-fp16:HOROVOD_CYCLE_TIME=5")
    assert s.peer == "horovod-fp16" and s.env == {"HOROVOD_CYCLE_TIME": "5"} and not s.torchrun
    assert schemes.parse("ddp-powersgd-1bucket").torchrun
    assert schemes.parse("safusion:dense=false:HOROVOD_CYCLE_TIME=5").kwargs() == {"dense": False}


def test_a_labels_wire_compression_is_horovods():
    import horovod.torch as hvd
    assert schemes.wire_compression("fp16") is hvd.Compression.fp16
    assert schemes.wire_compression("none") is hvd.Compression.none
    with pytest.raises(SystemExit, match="compression='bf16': a label accepts compression=none or compression=fp16"):
        schemes.wire_compression("bf16")


@pytest.mark.parametrize("label, message", [
    ("horovod:density=0.1", "key=value options are for our optimizer, not for horovod"),
    ("safusion+fast", "unknown technique +fast; known: +dgc"),
    ("resnet@0.1", "'resnet' is neither a peer nor a fusion planner"),
    ("safusion@lots", "density='lots' is not a number"),
    ("safusion@0.1/zip", "compressor 'zip' is unknown; known:"),
    ("safusion:fusion=zip", "fusion 'zip' is unknown; known:"),
    ("safusion:dense", "'dense' is not key=value"),
])
def test_a_bad_label_names_itself_and_what_is_known(label, message):
    with pytest.raises(SystemExit, match="scheme '" + label.replace("+", r"\+") + "'") as e:
        schemes.parse(label)
    assert message in str(e.value)


def test_bench_convergence_refuses_ddps_default_buckets_beside_horovod():
    with pytest.raises(SystemExit, match="ddp-powersgd-1bucket"):
        bench_convergence.resolve("ddp-powersgd")


def test_a_scheme_that_failed_at_fewer_hosts_is_reported_without_a_job(tmp_path):
    """``bench_peers.run_model`` with a scheme in ``not_launched``: no job starts (none could here:
    there is no cluster), and its cell carries the earlier failure's reason."""
    args = argparse.Namespace(out=str(tmp_path), np=8, schemes=["ddp-powersgd"], resident=None, alternations=3)
    why = "not launched: failed at 2x1gbit (exit status 1 while warming up)"
    res = bench_peers.run_model("8x1gbit", "lstm", [], args, {"ddp-powersgd": why})
    job = res["jobs"]["ddp-powersgd"]
    assert job["failed"] == why and job["warm"] == [] and job["samples"] == [[] for _ in range(8)]
    assert not (tmp_path / "logs").exists()
