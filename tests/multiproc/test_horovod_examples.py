"""Horovod's own example scripts, run with only the optimizer line swapped.

``hvd_examples/synthetic_benchmark.py`` and ``hvd_examples/synthetic_benchmark_elastic.py`` are
copies, in the same shape and with the same flags, of Horovod's
``examples/pytorch/pytorch_synthetic_benchmark.py`` and
``examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py``; ``--optimizer`` picks
``hvd.DistributedOptimizer`` or ``horovod_safusion.DistributedOptimizer`` (called with the same
arguments: ``named_parameters=``, ``compression=``, ``op=hvd.Average``). Each launch is small (a
width-8 ResNet-18 on 32×32 images) and each rank writes a JSON record the tests assert on. The
``horovod`` runs are the reference: they check the scripts and the launches themselves.

Elastic on one machine: with a discovery script printing ``localhost:2``, a worker *process* that
dies gets the host ``localhost`` blacklisted, and as every host of the job is then blacklisted
the driver stops the job ("blacklisted slots count == 2 -> stop running"). So the fault there is a
``HorovodInternalError`` raised in a worker (it restores its last commit and re-joins; the other
worker's collectives fail and it does the same). The process-death case names the machine twice
(``localhost:1`` and ``127.0.0.1:1``, both local to Horovod): the survivor goes on alone, and after
``--blacklist-cooldown-range 1 2`` the driver starts a new worker on the failed "host", which joins.
"""
import json
import math
import os
import sys
import time
import warnings

import pytest

from launch import first_errors, horovodrun, on_localhost, run as run_horovodrun

pytestmark = pytest.mark.multiproc

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "hvd_examples")
LAUNCH_TIMEOUT = 300  # a launch takes 10-40 s on 2 cores; longer means a hang
STACKS_AFTER = "150"  # a worker still running then writes its threads' Python stacks (shown on failure)

SMALL = ["--width", "8", "--image-size", "32", "--batch-size", "8", "--num-warmup-batches", "2"]
# 2 warm-up + 3 x 5 = 17 steps: past safusion's warm-up and 10 profiled steps, so the last steps
# run on the generator's plan
BENCH = SMALL + ["--num-batches-per-iter", "5", "--num-iters", "3"]
# 2 warm-up + 3 x 4 = 14 batches, committed every 2; rank 1 fails when batch 5 starts, so the
# uncommitted batch 4 is rolled back and run again
ELASTIC = SMALL + ["--num-batches-per-iter", "4", "--num-iters", "3", "--num-batches-per-commit", "2",
                   "--fail-rank", "1", "--fail-at-batch", "5"]
ELASTIC_BATCHES = 2 + 3 * 4


def run_job(cmd, out_dir, timeout=LAUNCH_TIMEOUT, env=None):
    """Run a horovodrun command line (``env``: variables added to this process's); return
    (CompletedProcess, seconds, per-rank records by rank)."""
    env = dict(os.environ, **(env or {}),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    start = time.monotonic()
    proc = run_horovodrun(cmd, timeout, env)
    seconds = time.monotonic() - start
    collect_stacks(proc, out_dir, os.path.join(out_dir, "work"))
    records = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                rec = json.load(f)
            records[rec["rank"]] = rec
    return proc, seconds, records


def describe(proc, seconds):
    text = (f"$ {' '.join(proc.args)}\nexit {proc.returncode} after {seconds:.1f} s\n"
            f"--- each rank's first error ---\n{first_errors(proc.stdout + proc.stderr)}\n"
            f"--- stdout (tail) ---\n{proc.stdout[-4000:]}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}")
    for stacks in getattr(proc, "stacks", []):  # written by workers that hung
        text += f"\n--- {os.path.basename(stacks[0])} ---\n{stacks[1][-4000:]}"
    return text


def collect_stacks(proc, *dirs):
    proc.stacks = []
    for d in dirs:
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            path = os.path.join(d, name)
            if name.startswith("stacks.") and os.path.getsize(path):
                with open(path) as f:
                    proc.stacks.append((path, f.read()))


def assert_ok(proc, seconds):
    if proc.returncode != 0:
        pytest.fail(describe(proc, seconds))


def assert_replicas_equal(records, proc, seconds):
    sums = {r: rec["param_checksum"] for r, rec in records.items()}
    assert len(set(sums.values())) == 1, f"replicas differ: {sums}\n{describe(proc, seconds)}"


# --------------------------------------------------------------------------- synthetic benchmark

BENCH_CASES = {
    # id: (transport, workers, optimizer, extra flags)
    "gloo2-safusion": ("--gloo", 2, "safusion", []),
    "gloo2-safusion-fp16": ("--gloo", 2, "safusion", ["--fp16-allreduce"]),
    "gloo2-horovod": ("--gloo", 2, "horovod", []),
    "gloo2-horovod-fp16": ("--gloo", 2, "horovod", ["--fp16-allreduce"]),
    "mpi2-safusion": ("--mpi", 2, "safusion", []),
    "gloo3-safusion": ("--gloo", 3, "safusion", []),
}


@pytest.mark.parametrize("case", list(BENCH_CASES))
def test_synthetic_benchmark(case, tmp_path):
    transport, np_, optimizer, extra = BENCH_CASES[case]
    cmd = [*on_localhost(np_, transport), sys.executable, os.path.join(EXAMPLES, "synthetic_benchmark.py"),
           "--optimizer", optimizer, *BENCH, *extra, "--dump-stacks-after", STACKS_AFTER, "--json", str(tmp_path / "rank{rank}.json")]
    proc, seconds, records = run_job(cmd, tmp_path)
    assert_ok(proc, seconds)
    assert "Total img/sec on %d CPU(s)" % np_ in proc.stdout
    assert sorted(records) == list(range(np_)), describe(proc, seconds)
    for rec in records.values():
        assert rec["size"] == np_ and rec["optimizer"] == optimizer
        assert rec["steps"] == 2 + 3 * 5
        assert rec["params_finite"] and rec["losses_finite"], rec
        assert rec["img_sec_mean"] > 0
    assert_replicas_equal(records, proc, seconds)


# --------------------------------------------------------------------------- elastic benchmark

def discovery_script(tmp_path, lines):
    path = tmp_path / "discover_hosts.sh"
    path.write_text("#!/bin/sh\n" + "".join(f"echo {line}\n" for line in lines))
    path.chmod(0o755)
    return str(path)


def elastic_cmd(tmp_path, hosts, optimizer, extra_horovodrun=(), extra_script=(), stacks_after=STACKS_AFTER):
    work = tmp_path / "work"
    work.mkdir(parents=True)
    return [horovodrun(), "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", discovery_script(tmp_path, hosts),
            "--network-interface", "lo", *extra_horovodrun, "--gloo",
            sys.executable, os.path.join(EXAMPLES, "synthetic_benchmark_elastic.py"), "--optimizer", optimizer,
            *ELASTIC, *extra_script, "--dump-stacks-after", stacks_after,
            "--work-dir", str(work), "--json", str(tmp_path / "rank{rank}.json")], work


#: What Horovod 0.28.1's own optimizer raises, now and then, in the first step after a reset: the
#: enqueue checks ``shut_down`` before it adds to the tensor queue, so an allreduce submitted while
#: the failed session shut down can land after ``FinalizeTensorQueue`` emptied the queue, and the
#: next session's allreduce of that parameter (same name) is refused. horovod_safusion numbers its
#: collectives' names per session (``session.collective``), so its runs do not meet this.
HOROVOD_ENQUEUE_RACE = "same name as another tensor that is currently being processed"


def run_elastic(tmp_path, hosts, optimizer, timeout=LAUNCH_TIMEOUT, env=None, **cmd_kwargs):
    """Launch the elastic example; return (proc, seconds, records, work directory). The reference
    (Horovod's own optimizer) is launched once more, with a warning, when it met Horovod's race above:
    the reference checks the script and the launch, not Horovod."""
    for attempt in range(2 if optimizer == "horovod" else 1):
        out = tmp_path / f"launch{attempt}"
        cmd, work = elastic_cmd(out, hosts, optimizer, **cmd_kwargs)
        proc, seconds, records = run_job(cmd, out, timeout, env)
        if proc.returncode == 0 or HOROVOD_ENQUEUE_RACE not in proc.stderr:
            break
        warnings.warn(f"Horovod's own optimizer met its enqueue/shutdown race after the reset; launched again:\n"
                      f"{first_errors(proc.stdout + proc.stderr)}")
    return proc, seconds, records, work


def assert_elastic_records(records, optimizer, proc, seconds):
    assert sorted(records) == [0, 1], describe(proc, seconds)
    for rec in records.values():
        assert rec["size"] == 2 and rec["optimizer"] == optimizer, rec
        assert rec["batches_done"] == ELASTIC_BATCHES and rec["iter"] == 3, rec
        assert rec["params_finite"] and rec["losses_finite"], rec
        if optimizer == "safusion":
            assert rec["residual_total"] is not None and math.isfinite(rec["residual_total"]), rec
            # a worker that resets gets back its own committed residuals, bit for bit, and keeps
            # them through the sync (None: another reset came before the next step): nothing is
            # duplicated from rank 0 or dropped
            checks = rec["residual_checks"]
            assert all(c["restored"] and c["after_sync"] is not False for c in checks), checks
            assert all(c["restored_total"] == c["committed_total"] for c in checks), checks
            assert not checks or any(c["after_sync"] for c in checks), checks
    assert_replicas_equal(records, proc, seconds)


@pytest.mark.parametrize("optimizer", ["safusion", "horovod"])
def test_elastic_worker_raises_once(optimizer, tmp_path):
    """``localhost:2``; rank 1 raises HorovodInternalError once: both workers reset and finish."""
    proc, seconds, records, work = run_elastic(tmp_path, ["localhost:2"], optimizer, extra_script=["--fail-mode", "raise"])
    assert_ok(proc, seconds)
    assert (work / "failed-once.marker").exists(), describe(proc, seconds)  # the fault did happen
    assert_elastic_records(records, optimizer, proc, seconds)
    for rec in records.values():
        assert rec["resets"] == 1 and rec["sizes_after_reset"] == [2], rec
        assert len(rec["residual_checks"]) == (1 if optimizer == "safusion" else 0), rec
        assert not rec["started_after_failure"]
        assert rec["steps_run"] > ELASTIC_BATCHES  # the uncommitted batch ran twice


#: SparDL's rounds over a Gloo group beside Horovod (``rounds="gloo"``), sparse from the first step.
SPARDL_GLOO = (["--safusion-kwargs", json.dumps({"communicator": "spardl", "dense": False})],
               {"HOROVOD_SAFUSION_ROUNDS": "gloo"})


@pytest.mark.parametrize("optimizer", ["safusion", "horovod", "safusion-spardl-gloo"])
def test_elastic_worker_dies_once_and_is_replaced(optimizer, tmp_path):
    """Two local "hosts" of one slot; rank 1's process dies once: rank 0 goes on alone, then a new
    worker started on the failed host after its blacklist cooldown joins, and both finish. With
    SparDL's rounds on Gloo, the group of the first session holds the dead worker: the new session
    must build its own with the new one, or its rounds would fail or hang."""
    script, env = SPARDL_GLOO if optimizer == "safusion-spardl-gloo" else ([], {})
    optimizer = optimizer.split("-")[0]
    proc, seconds, records, work = run_elastic(
        tmp_path, ["localhost:1", "127.0.0.1:1"], optimizer, timeout=150, env=env,
        extra_horovodrun=["--blacklist-cooldown-range", "1", "2"],
        extra_script=["--fail-mode", "exit", "--wait-for-size", "2", "--wait-timeout", "120", *script],
        stacks_after="100")
    assert_ok(proc, seconds)
    assert (work / "failed-once.marker").exists(), describe(proc, seconds)
    assert_elastic_records(records, optimizer, proc, seconds)
    survivors = [rec for rec in records.values() if not rec["started_after_failure"]]
    replaced = [rec for rec in records.values() if rec["started_after_failure"]]
    assert len(survivors) == 1 and len(replaced) == 1, records
    assert survivors[0]["sizes_after_reset"] == [1, 2], survivors[0]  # alone, then joined
    assert replaced[0]["resets"] == 0, replaced[0]
    if script:  # the last step was sparse, so its rounds ran on the rebuilt group
        assert all(0 < rec["last_density"] < 1 for rec in records.values()), records

