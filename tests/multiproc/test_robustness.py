"""Ordinary Horovod training code under ``horovodrun``: no crash, no hang, nothing lost.

Each test launches ``robust_worker.py`` for one scenario (see its docstring) and asserts on the
per-rank records: Gloo ×2 and ×3 (not a power of two) and MPI ×2; and across the hosts of a cluster
on one machine (``scripts/cluster.sh``, as root): a checkpoint of 2 hosts × 2 workers resumed on 3
hosts × 1, and a worker killed on one host.
"""
import json
import os
import sys

import numpy as np
import pytest

from launch import on_hosts, on_localhost, run as run_horovodrun

HERE = os.path.dirname(os.path.abspath(__file__))
TRANSPORTS = {"gloo-2": ("--gloo", 2), "gloo-3": ("--gloo", 3), "mpi-2": ("--mpi", 2)}
HOSTS = {"hosts-2x2": [2, 2], "hosts-3x1": [1, 1, 1]}  # a cluster on one machine: workers per host
LAUNCH_TIMEOUT = 300  # every launch takes well under a minute; longer means a hang
_cache = {}

pytestmark = pytest.mark.multiproc


def command(config: str, worker_args: list[str]) -> tuple[list[str], int]:
    """The launch of ``robust_worker.py`` for ``config`` (one host, or across the cluster's hosts)."""
    if config in HOSTS:
        head, np_ = on_hosts(HOSTS[config]), sum(HOSTS[config])
    else:
        transport, np_ = TRANSPORTS[config]
        head = on_localhost(np_, transport)
    return [*head, sys.executable, os.path.join(HERE, "robust_worker.py"), *worker_args], np_


def records_of(out_dir, scenario, args, np_) -> list[dict]:
    paths = [os.path.join(out_dir, f"{scenario}{''.join('.' + a for a in args)}.rank{r}.json") for r in range(np_)]
    return [json.load(open(p)) if os.path.exists(p) else {} for p in paths]


def run(config, out_dir, scenario, *args):
    """Launch one scenario (once per session) and return its per-rank records."""
    key = (config, str(out_dir), scenario, args)
    if key not in _cache:
        os.makedirs(out_dir, exist_ok=True)
        cmd, np_ = command(config, [str(out_dir), scenario, *args])
        proc = run_horovodrun(cmd, LAUNCH_TIMEOUT)
        records = records_of(out_dir, scenario, args, np_)
        if proc.returncode != 0:
            exc = next((r["exception"] for r in records if "exception" in r), "")
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{exc[-3000:]}\n{proc.stdout[-2000:]}\n"
                        f"{proc.stderr[-3000:]}")
        _cache[key] = [r[scenario] for r in records]
    return _cache[key]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("robust")


@pytest.mark.parametrize("config", list(TRANSPORTS))
def test_unused_toggled_zeroed_and_partial_parameters_neither_crash_nor_lose_gradient(config, out_dir):
    """Every compressor with every communicator (each once at 3 workers): parameters toggling requires_grad, used on one
    rank or one step only, multiplied by 0, one-element; synchronize()+skip_synchronize();
    zero_grad(set_to_none=True). The job conserves gradient mass and replicas agree."""
    which = "all" if config == "gloo-2" else "cover"  # 3 workers on 2 cores: each part once
    for rank_rec in run(config, out_dir / config, "edge", which):
        assert len(rank_rec) == (30 if which == "all" else 12)  # robust_worker.pairs() and covering_pairs()
        for scheme, r in rank_rec.items():
            assert r["replicas_equal"] and r["finite"], (scheme, r)
            assert r["conservation"] < 1e-6, (scheme, r)
            assert r["planner"] == "safusion", (scheme, r)  # profiled and switched with missing gradients


@pytest.mark.parametrize("config", ["gloo-2", "gloo-3"])
def test_non_finite_gradients_skip_the_same_steps_as_horovod_and_residuals_recover(config, out_dir):
    recs = run(config, out_dir / config, "nonfinite", "all" if config == "gloo-2" else "cover")
    for rank, rank_rec in enumerate(recs):
        horovod = rank_rec.pop("horovod")
        assert horovod["skipped"] == [3, 6]  # the NaN batch and the Inf element, on every rank
        for scheme, r in rank_rec.items():
            assert r["skipped"] == horovod["skipped"], (scheme, r)
            assert r["residuals_finite"] and r["params_finite"] and r["replicas_equal"], (scheme, r)
            assert r["selected_last"] > 0, (scheme, r)  # still sending after the bad steps
            if rank == 1:  # finite on rank 1: what it sent in the skipped step is back in its residual
                assert r["take_back_diff"] == 0.0, (scheme, r)


@pytest.mark.parametrize("config", ["gloo-2", "gloo-3"])
def test_a_frozen_layer_and_a_step_without_backward_move_nothing_and_keep_their_residuals(config, out_dir):
    """A layer frozen mid-training moves exactly 0 — with and without momentum in the wrapped SGD,
    sparse and dense — its residual (and momentum) stay bit for bit while it is frozen and join
    its gradient when it is unfrozen; a step() without backward moves no parameter; a layer used
    on rank 0 only keeps replicas identical; conservation holds for the job at every step."""
    for rank_rec in run(config, out_dir / config, "dropin", "all" if config == "gloo-2" else "cover"):
        frozen = rank_rec["frozen"]
        for label, r in frozen.items():
            assert r["frozen_moved"] == 0.0 and r["no_backward_moved"] == 0.0, (label, r)
            assert r["frozen_residual_changed"] == [] and r["frozen_momentum_changed"] == [], (label, r)
            assert r["no_backward_residuals_equal"] and r["replicas_equal"], (label, r)
            assert r["conservation"] < 1e-6, (label, r)
            if not label.startswith(("default", "dense")):  # sparse when frozen: it held a residual
                assert r["unfrozen_used"] > 0, (label, r)
        assert not any(frozen["sparse"]["dense_steps"])
        assert all(frozen["dense+momentum"]["dense_steps"][3:])  # dense once profiled
        # steps 4 (frozen), 5, 7 (a dense plan; step 6 has no backward) and 8 (sparse again)
        assert frozen["sparse, dense while frozen"]["dense_steps"][4:8] == [False, True, True, False]


@pytest.mark.parametrize("config", ["gloo-2", "gloo-3"])
def test_a_param_group_added_during_training_is_synchronised(config, out_dir):
    """A group added by add_param_group at step 3 (its layer initialised differently on every
    rank) and a layer frozen at construction made trainable at step 5 join the plan at the step
    they are added, and the replicas stay bit-identical."""
    for rank_rec in run(config, out_dir / config, "dropin", "all" if config == "gloo-2" else "cover"):
        join = rank_rec["join"]
        for label, r in join.items():
            assert r["replicas_equal"], (label, r)
            assert r["planned"] == [2] * 3 + [4] * 2 + [6] * 5, (label, r)
        assert "head.weight" in join["sparse"]["names"]
        assert "allreduce.noname.1.0" in join["unnamed"]["names"]
        for label in ("default", "sparse"):  # profiled again, with the new tensors
            assert join[label]["profiled"] == join[label]["names"], join[label]


@pytest.mark.parametrize("config,kind", [("gloo-3", "one"), ("gloo-2", "shape")])
def test_a_param_group_added_on_some_ranks_only_is_a_clear_error_on_every_rank(config, kind, tmp_path):
    transport, np_ = TRANSPORTS[config]
    cmd = [*on_localhost(np_, transport), sys.executable, os.path.join(HERE, "robust_worker.py"), str(tmp_path),
           "join_mismatch", kind]
    proc = run_horovodrun(cmd, 120)
    assert proc.returncode != 0 and "killed after" not in proc.stderr, proc.stderr[-3000:]
    for rank in range(np_):
        exc = json.load(open(tmp_path / f"join_mismatch.{kind}.rank{rank}.json"))["exception"]
        assert "parameters join the job on some ranks only: at step 1 rank 1 adds" in exc, exc
        assert ("where rank 0 adds no parameter" if kind == "one" else "of shape [2, 3]") in exc, exc


def test_grad_scaler_with_a_changing_scale_matches_the_unscaled_run_bit_for_bit(out_dir):
    for rank_rec in run("gloo-2", out_dir / "gloo-2", "scaler"):
        assert rank_rec["horovod"]["told_diff"] == 0.0
        assert len(set(rank_rec["horovod"]["scales"])) > 3  # the scale did change
        for comp in ("dgc", "topk", "randomk"):
            assert rank_rec[comp]["told_diff"] == 0.0, (comp, rank_rec[comp])
            assert rank_rec[comp]["untold_rel"] > 1e-4  # without grad_scaler= residuals drift


def test_fp16_wire_compression_sends_float16_values_and_keeps_the_rounding_in_the_residual(out_dir):
    for rank_rec in run("gloo-2", out_dir / "gloo-2", "fp16"):
        for scheme, r in rank_rec.items():
            assert r["not_half"] == 0 and r["not_exact"] == 0 and r["replicas_equal"], (scheme, r)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-worker job that saves at step 6 and trains on to step 10."""
    path = tmp_path_factory.mktemp("checkpoints")
    return path, run("gloo-2", path, "save")


@pytest.mark.parametrize("source", ["rank", "all"])  # each rank's own file; rank 0's gathered file
def test_resume_at_the_same_world_size_is_bit_identical_for_every_compressor(saved, source):
    path, before = saved
    after = run("gloo-2", path, "resume", source)
    for rank in range(2):
        for scheme, r in after[rank].items():
            assert r["params"] == before[rank][scheme]["params"], scheme
            assert r["loaded_residuals"] == before[rank][scheme]["saved_residuals"], scheme
            assert not r["warnings"] and r["replicas_equal"], (scheme, r["warnings"])


def _total(records, key, scheme):
    """Σ over ranks of every parameter's residual, in rank order, in float32."""
    names = sorted(records[0][scheme][key])
    total = {}
    for rec in records:
        for n in names:
            r = np.asarray(rec[scheme][key].get(n, np.zeros_like(total.get(n, 0.0))), dtype=np.float32)
            total[n] = r if n not in total else total[n] + r
    return total


def test_gathered_checkpoint_moves_residuals_from_2_to_3_workers_conserving_the_total(saved):
    path, before = saved
    after = run("gloo-3", path, "resume", "all")
    for scheme in before[0]:
        old, new = _total(before, "saved_residuals", scheme), _total(after, "loaded_residuals", scheme)
        assert old.keys() == new.keys()
        for n in old:
            assert np.array_equal(old[n], new[n]), (scheme, n)
        assert any(np.abs(v).sum() > 0 for v in old.values())
        assert all(r[scheme]["replicas_equal"] for r in after)
        assert after[0][scheme]["planner"] == "safusion"  # profiled again for 3 workers


def test_a_checkpoint_saved_on_rank_0_alone_loads_with_a_warning_on_the_others(saved):
    path, _ = saved
    after = run("gloo-2", path, "resume", "rank0only")
    for scheme, r in after[1].items():
        assert any("holds the error-feedback residuals of rank(s) [0]" in w for w in r["warnings"]), scheme
        assert r["replicas_equal"]
    assert all(not r["warnings"] for r in after[0].values())


def test_ranks_agree_which_gradients_are_spread_and_select_those_at_the_floor(out_dir):
    """Every rank votes on each tensor by its first gradient and the maximum decides: the layer
    whose gradient is one element on rank 0 and spread on rank 1 is spread on both, the embedding
    of two tokens is concentrated, and a layer no rank used before step 2 is decided at step 2.
    From the step after, a spread tensor's k is 10 % of it and a concentrated one's 3 %; the job
    conserves gradient mass exactly and the replicas agree."""
    recs = run("gloo-2", out_dir / "gloo-2", "spread")
    assert recs[0]["votes"]["mixed.weight"] == 1 and recs[1]["votes"]["mixed.weight"] == 2
    for r in recs:
        assert r["decided"] == recs[0]["decided"] and r["decided_at"] == recs[0]["decided_at"]
        assert r["decided"]["mixed.weight"] and not r["decided"]["words.weight"], r
        assert r["decided_at"] == {"words.weight": 0, "mixed.weight": 0, "head.weight": 0, "late.weight": 2}, r
        assert r["k"]["mixed.weight"] == 4 and r["k"]["words.weight"] == 96, r  # 10 % of 40, 3 % of 3,200
        assert r["conservation"] < 1e-6 and r["replicas_equal"], r
    assert recs[1]["sent_mixed"][0] == 1 and recs[1]["sent_mixed"][1:] == [4] * 7, recs[1]


def test_a_tiny_mlp_with_momentum_converges_like_horovod(out_dir):
    """The tiny regression MLP whose every tensor sends a few elements per step at the default
    density: with the defaults and with ``dense=False`` its small tensors go dense, and with every
    tensor sparsified (``min_selected=0``) its spread gradients select at the default's floor and
    the default's masking by tensor clears the momentum of the elements sent from them; each ends
    below its starting loss and within 10x of Horovod's final loss. Masking in every tensor, no
    masking, and the default at 0.01 are recorded (this SGD does not survive a gradient two steps
    late, and error feedback holds elements for tens of steps; ``bench_staleness``)."""
    for rec in run("gloo-2", out_dir / "gloo-2", "tiny"):
        horovod = rec["horovod"]["end"]
        for label in ("default", "dense=False", "every tensor sparse"):
            r = rec[label]
            assert r["replicas_equal"], (label, r)
            assert r["end"] < r["start"] and r["end"] <= 10 * horovod, (label, r, horovod)


def test_a_gathered_checkpoint_of_2_hosts_x_2_resumes_on_3_hosts_x_1_conserving_the_total(hosts, tmp_path_factory):
    """Across hosts as on one: the gathered checkpoint of a job on 2 hosts with 2 workers each
    (local size 2, cross size 2) resumes on 3 hosts of one worker. Shrinking, new rank j holds the
    sum of old ranks j and j + 3 (``checkpoint.redistribute``), bit for bit, so every residual
    element is kept: the job's total is the old one up to the order of a float sum."""
    path = tmp_path_factory.mktemp("hosts-checkpoints")
    before = run("hosts-2x2", path, "save")
    after = run("hosts-3x1", path, "resume", "all")
    for scheme in before[0]:
        for j, rec in enumerate(after):
            loaded = rec[scheme]["loaded_residuals"]
            for n, value in loaded.items():
                expected = np.zeros(len(value), dtype=np.float32)
                for old in before[j::3]:
                    expected = expected + np.asarray(old[scheme]["saved_residuals"].get(n, 0.0), dtype=np.float32)
                assert np.array_equal(np.asarray(value, dtype=np.float32), expected), (scheme, j, n)
        old, new = _total(before, "saved_residuals", scheme), _total(after, "loaded_residuals", scheme)
        assert old.keys() == new.keys() and all(np.allclose(old[n], new[n], rtol=1e-6, atol=1e-7) for n in old)
        assert any(np.abs(v).sum() > 0 for v in old.values())
        assert all(r[scheme]["replicas_equal"] for r in after), scheme


#: What a surviving worker that got as far as recording may have died of: Horovod's shutdown, or
#: with SparDL's rounds on Gloo, the Gloo receive whose peer is gone.
SURVIVOR_ERRORS = ("Horovod has been shut down", "Connection closed by peer", "Connection reset by peer",
                   "Timed out waiting")


def survivors_ended_as_with_horovod(proc, records) -> None:
    assert "killed after" not in proc.stderr, proc.stderr[-3000:]  # our time limit: a hang
    assert proc.returncode != 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Horovod detected that one or more processes exited with non-zero status" in proc.stderr + proc.stdout
    assert not any("killed" in r and r["killed"].get("finished") for r in records), records
    for r in records:  # a survivor that got as far as recording: Horovod's own error, or Gloo's
        assert "exception" not in r or any(e in r["exception"] for e in SURVIVOR_ERRORS), r["exception"][-2000:]


def test_a_worker_killed_during_spardl_rounds_on_gloo_ends_the_job(tmp_path):
    """3 workers on one host, SparDL's rounds on the Gloo group beside Horovod: the last worker
    dies at step 3, and the job ends with an error within the launch's time limit."""
    cmd, np_ = command("gloo-3", [str(tmp_path), "killed", "spardl-gloo"])
    proc = run_horovodrun(cmd, LAUNCH_TIMEOUT)
    survivors_ended_as_with_horovod(proc, records_of(tmp_path, "killed", ["spardl-gloo"], np_))


@pytest.mark.parametrize("optimizer", ["horovod", "safusion", "spardl-gloo"])
def test_a_worker_killed_on_one_host_ends_the_job_as_with_horovod(hosts, optimizer, tmp_path_factory):
    """The last worker (on host 2) dies at step 3 of a 2 hosts × 2 job: the job ends with an error
    within the launch's time limit — no worker waits for it forever — as Horovod's own optimizer's
    job does: horovodrun's error naming the process that exited, and in any survivor that got as
    far as recording, Horovod's shutdown error (or, with SparDL's rounds on Gloo, Gloo's error for
    the peer that is gone); no surviving worker records a finished run."""
    out = tmp_path_factory.mktemp(f"killed-{optimizer}")
    cmd, np_ = command("hosts-2x2", [str(out), "killed", optimizer])
    proc = run_horovodrun(cmd, LAUNCH_TIMEOUT)
    survivors_ended_as_with_horovod(proc, records_of(out, "killed", [optimizer], np_))
