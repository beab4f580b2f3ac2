"""Multi-process tests: pytest launches ``tests/multiproc/worker.py`` with ``horovodrun``.

One launch per configuration runs every scenario (a start costs seconds); the tests below assert
on each scenario's per-rank records. Configurations: 2 workers over Gloo, 2 over MPI, and 3 over
Gloo (not a power of two).
"""
import json
import os
import sys

import pytest

from launch import first_errors, on_localhost, run as run_horovodrun
from horovod_safusion import sweeps
from horovod_safusion.plan import DENSE_SHARE, MIN_SELECTED

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"gloo-2": ("--gloo", 2), "mpi-2": ("--mpi", 2), "gloo-3": ("--gloo", 3)}
LAUNCH_TIMEOUT = 300  # a whole launch takes well under a minute; longer means a hang
_cache = {}


def launch(config, tmp_path_factory):
    if config not in _cache:
        transport, np_ = CONFIGS[config]
        out = tmp_path_factory.mktemp(config)
        cmd = [*on_localhost(np_, transport), sys.executable, os.path.join(HERE, "worker.py"), str(out)]
        proc = run_horovodrun(cmd, LAUNCH_TIMEOUT)
        records = []
        for r in range(np_):
            path = out / f"rank{r}.json"
            records.append(json.loads(path.read_text()) if path.exists() else {})
        _cache[config] = (proc, records)
    return _cache[config]


@pytest.fixture(params=list(CONFIGS), scope="module")
def job(request, tmp_path_factory):
    proc, records = launch(request.param, tmp_path_factory)
    if proc.returncode != 0:
        pytest.fail(f"horovodrun {request.param} exited {proc.returncode}\n"
                    f"--- each rank's first error ---\n{first_errors(proc.stdout + proc.stderr)}\n"
                    f"--- stdout (tail) ---\n{proc.stdout[-4000:]}\n--- stderr (tail) ---\n{proc.stderr[-4000:]}")
    assert [r["rank"] for r in records] == list(range(CONFIGS[request.param][1]))
    return records


def per_rank(job, scenario):
    for r in job:
        assert "exception" not in r[scenario], r[scenario].get("exception")
    return [r[scenario] for r in job]


pytestmark = pytest.mark.multiproc


def test_density_one_equals_horovod(job):
    exact = job[0]["size"] == 2  # with 2 workers a + b is the same sum in every order
    for rec in per_rank(job, "dense_equality"):
        for label, r in rec.items():
            assert r["buffers"] > 1, label
            tol = 0.0 if exact and label != "none-predivide" else 1e-6
            assert r["grad_diff"] <= tol and r["param_diff"] <= tol, (label, r)


def test_sparse_aggregation_matches_independent_reference(job):
    for rec in per_rank(job, "sparse_aggregation"):
        assert rec["topk"]["ref_diff"] < 1e-6, rec
        for c in ("topk", "dgc"):
            assert rec[c]["conservation_diff"] < 1e-6, (c, rec[c])
            assert rec[c]["missing"] == 0, (c, rec[c])
            assert 0.005 < rec[c]["density"] < 0.05, (c, rec[c])


def test_device_path_conserves_and_keeps_replicas_identical(job):
    """The GPU path under horovodrun (CPU tensors; Triton kernels through their interpreter):
    exact conservation across ranks, no tensor missing, replicas identical, and ranks really
    selecting different counts (the wire rows of unequal lengths still add up)."""
    recs = per_rank(job, "device_path")
    for kernels in ("torch", "triton"):
        runs = [r[kernels] for r in recs]
        for r in runs:
            assert r["conservation_diff"] < 1e-6, (kernels, r)
            assert r["missing"] == 0 and 0.005 < r["density"] < 0.05, (kernels, r)
        assert len({r["checksum"] for r in runs}) == 1, (kernels, [r["checksum"] for r in runs])
        assert len({tuple(r["selected"]) for r in runs}) > 1, (kernels, [r["selected"] for r in runs])


def test_dgc_techniques_conserve_and_switch_density_together(job):
    """Momentum correction, masking, local clipping and warm-up: exact conservation of the new
    state, masking where sent, every rank at the same density at every step, replicas identical."""
    recs = per_rank(job, "dgc_techniques")
    for schedule in ("exponential", "dense"):
        runs = [r[schedule] for r in recs]
        for r in runs:
            assert r["conservation_diff"] < 1e-6, (schedule, r)
            assert r["mask_violations"] == 0, (schedule, r)
            assert 0.005 < r["final_density"] < 0.05, (schedule, r)
        assert all(r["densities"] == runs[0]["densities"] for r in runs), schedule
        assert all(r["dense_steps"] == runs[0]["dense_steps"] for r in runs), schedule
        assert len({r["checksum"] for r in runs}) == 1, (schedule, [r["checksum"] for r in runs])
        dense = runs[0]["dense_steps"]
        assert dense == ([True] * 6 + [False] * 3 if schedule == "dense" else [False] * 9), dense
        if schedule == "exponential":
            d = runs[0]["densities"]
            assert d[0] > d[2] > d[3] > d[5] > d[6] == 0.01, d


def test_ef21_sgdm_conserves_and_keeps_replicas_identical(job):
    """EF21-SGDM across ranks: what every rank sent is what it took out of its residual, the
    wrapped SGD's momentum buffer sums the aggregates, and the replicas agree bit for bit."""
    runs = per_rank(job, "ef21_sgdm")
    for r in runs:
        assert r["conservation_diff"] < 1e-6, r
        assert r["buffer_diff"] < 1e-5, r
        assert 0.005 < r["final_density"] < 0.05, r
    assert len({r["checksum"] for r in runs}) == 1, [r["checksum"] for r in runs]


def test_critical_steps_as_float16_keep_the_rounding_and_fall_back_on_overflow(job):
    """Critical steps as float16: each rank's rounding error stays in its residual bit for bit,
    the aggregate is the mean of what the ranks sent, half the bytes go; an overflow on one rank
    sends the buffer again in float32 on every rank, and float32 stays; replicas agree."""
    runs = per_rank(job, "half_critical")
    for r in runs:
        steps = r["steps"]
        assert [s["critical"] for s in steps[:6]] == [True] * 6, steps
        assert [s["half"] for s in steps[:5]] == [True] * 5, steps
        assert [s["overflowed"] for s in steps] == [False] * 4 + [True] * 5, steps
        for s in steps[:4]:
            assert s["exact"], s
            assert s["relative_diff"] < 2 ** -9, s  # the mean of the float16 contributions, rounded
            assert s["bytes_sent"] == 2 * s["numel"], s
        overflow = steps[4]  # float16, then again float32
        assert overflow["exact"] and overflow["relative_diff"] < 1e-6, overflow
        assert overflow["bytes_sent"] == (2 + 4) * overflow["numel"], overflow
        assert not any(s["half"] for s in steps[5:]), steps
        assert steps[5]["bytes_sent"] == 4 * steps[5]["numel"], steps[5]
        for s in steps[5:]:
            assert s["exact"] or not s["critical"], s
            assert s["relative_diff"] < 1e-5, s
    assert len({r["checksum"] for r in runs}) == 1, [r["checksum"] for r in runs]


def test_density_auto_is_chosen_alike_conserves_across_changes_and_resumes_bit_for_bit(job):
    """density="auto": every candidate priced, the trial settled, the same density on every rank
    (or dense on every rank); a checkpoint after the choice resumes bit-identically; switching the
    density between steps loses no gradient."""
    from horovod_safusion.density import CANDIDATES
    recs = per_rank(job, "density_choice")
    for r in recs:
        assert r["priced"] == list(CANDIDATES) and r["settled"], r
        assert (r["density"], r["dense"]) == (recs[0]["density"], recs[0]["dense"]), r
        assert r["dense"] or (r["density"] in CANDIDATES and r["target"] == r["density"]), r
        assert r["resumed"] == {"plan": [r["density"], r["dense"]], "identical": True}, r["resumed"]
        sw = r["switched"]
        assert sw["densities"] == [0.1, 0.1, 0.001, 0.03, 0.003] and sw["replicas_equal"], sw
        assert sw["conservation_diff"] < 1e-6, sw


def test_unused_parameters_neither_hang_nor_lose_gradient(job):
    recs = per_rank(job, "unused_parameters")
    for label in ("none", "topk@0.25"):
        for r in recs:
            assert r[label]["never_grad"] is None  # not a zero gradient: the wrapped optimizer skips it
            assert r[label]["only_rank0_grad_abs"] > 0  # rank 0's gradient reached every rank
        assert recs[1][label]["only_rank0_local_abs"] == 0.0  # rank 1 computed none itself
    for label in ("none/only-rank0", "none-fp16/only-rank0"):  # rank 0 has every gradient, the others not
        for r in recs:
            assert r[label]["only_rank0_grad_abs"] > 0, label
        assert recs[1][label]["only_rank0_local_abs"] == 0.0, label


def test_backward_passes_per_step(job):
    for r in per_rank(job, "backward_passes"):
        assert r["param_diff"] <= 1e-6
        assert "Gradients were computed more than backward_passes_per_step times" in r["error"]


def test_broadcast_optimizer_state_and_skip_synchronize(job):
    for r in per_rank(job, "broadcast_and_skip"):
        assert r["lr"] == pytest.approx(0.001)  # rank 0's learning rate everywhere
        assert r["steps_after_broadcast"] == 0  # no gradient synchronisation happened
        assert r["param_diff"] <= 1e-6
        assert not [w for w in r["warnings"] if "skip_synchronize" in w]


def test_short_training_learns_and_replicas_agree(job):
    for r in per_rank(job, "training"):
        assert r["acc"] > 0.6, r  # chance is 0.1
        assert r["replicas_equal"]


def test_plan_mismatch_is_a_clear_error_on_every_rank(job):
    for r in per_rank(job, "plan_mismatch"):
        assert "fusion plans differ across ranks" in r["error"]
        assert "fusion buffer 0 differs" in r["error"] or "number of fusion buffers differs" in r["error"]


def test_generator_builds_identical_plans_from_different_local_timings(job):
    recs = per_rank(job, "generator_alignment")
    for r in recs:
        assert r["planners"] == ["provisional"] * 3 + ["safusion"] * 3  # warm-up + 3 profiled steps
        assert r["digests_equal"] and r["profiles_equal"]
        assert r["shared_backward"] >= r["local_backward"]  # the element-wise max over ranks
        assert r["switched_at"] == 2
        assert r["switch_param_diff"] <= (0.0 if job[0]["size"] == 2 else 1e-6)
    # rank 1 sleeps 50 ms in backward, rank 0 does not: they measured differently (with a margin
    # that survives a loaded machine)
    assert recs[1]["local_backward"] > recs[0]["local_backward"] + 0.025


def test_the_critical_wire_is_chosen_before_the_profile_on_every_rank_alike(job):
    from horovod_safusion.regime import HALF_MARGIN
    from horovod_safusion.sweeps import DENSE_POINTS

    recs = per_rank(job, "wire_before_profile")
    for r in recs:
        assert r["chosen_at"] == 0  # at the end of the settle step, before the first profiled step
        assert r["wire"] == recs[0]["wire"] and r["half"] == recs[0]["half"]  # the fastest rank's times
        nbytes, float32_s, float16_s = r["wire"]
        assert r["half"] == (float16_s <= HALF_MARGIN * float32_s)
        # the first step went float32 (nothing chosen yet); the profiled ones, critical, on the wire
        assert r["modes"][:3] == [False, r["half"], r["half"]], r
        # the dense sweep's largest point is the wire's float32 time (monotone curve: at least it)
        assert r["dense_top"][0] == nbytes and r["dense_top"][1] >= float32_s
        # sizes spaced geometrically from 1024 elements to the model's: few points fit the ring's
        # latency + bytes / bandwidth, and each costs negotiated collectives of every rank
        assert len(r["dense_sizes"]) == DENSE_POINTS and r["dense_sizes"][0] == 1024 * 4, r["dense_sizes"]
        assert "wires" in r["sweeps"]


def test_each_critical_wire_is_a_warm_up_and_one_run_and_float32_once_after_a_slow_float16(job):
    # float16 first: its warm-up and one counted run; then float32 the same, or once, with no
    # warm-up, where float16 was slow
    for r in per_rank(job, "wire_runs"):
        assert r == {"slow": {"runs": [2, 1], "wired": True}, "fast": {"runs": [2, 2], "wired": True}}, r


def test_a_swept_allreduce_runs_once_where_its_warm_up_was_slow_on_the_fastest_rank(job):
    # a warm-up and 2 counted runs, or a warm-up and 1 where the fastest rank's warm-up took
    # sweeps.ONE_RUN_S or more; one rank slow alone does not decide, and every rank runs alike
    for r in per_rank(job, "agreed_repetitions"):
        assert r == {"all_slow": 2, "one_slow": 3, "none_slow": 3}, r


def test_randomk_selects_the_same_indices_on_every_rank(job):
    for r in per_rank(job, "randomk_shared_indices"):
        assert r["equal"]
        assert r["nonzero"] <= r["selected"]  # no index from another rank widened the union


def test_baseline_schemes_train_end_to_end(job):
    for rec in per_rank(job, "schemes"):
        assert {"horovod", "wfbp", "oktopk"} <= rec.keys()
        for scheme, r in rec.items():
            assert r["replicas_equal"] and r["planner"] == scheme, (scheme, r)
        assert rec["horovod"]["acc"] > 0.6 and rec["horovod"]["missing"] == 0.0
        assert rec["wfbp"]["order"] == "behind" and rec["wfbp"]["missing"] == 0.0  # one tensor a buffer
        assert rec["oktopk"]["buffers"] == 1


def test_dense_choice_is_priced_measured_and_the_same_on_every_rank(job):
    recs = per_rank(job, "dense_choice")
    for r in recs:
        assert r["auto"]["priced"] and r["auto"]["trial_done"] and r["auto"]["replicas_equal"], r["auto"]
        assert r["auto"]["dense"] == recs[0]["auto"]["dense"]
        # communicator="auto": every communicator that can win priced (with two workers the allgather
        # alone, communicators.base.contenders), or pruned at its largest message where it was
        # slower than the allgather by the margin (sweeps.communicator_sweeps); the same on every
        # rank, and one chosen on every rank alike
        can_win = ["allgather"] if len(recs) == 2 else ["allgather", "zen"]
        pruned = r["auto"]["pruned"]
        assert sorted(r["auto"]["communicators"] + list(pruned)) == can_win, r["auto"]
        assert pruned == recs[0]["auto"]["pruned"]
        for p in pruned.values():
            assert p["best"] == "allgather" and p["seconds"] > sweeps.PRUNE_MARGIN * p["best_seconds"], pruned
        assert r["auto"]["plan_communicator"] in r["auto"]["communicators"] or r["auto"]["dense"], r["auto"]
        assert r["auto"]["plan_communicator"] == recs[0]["auto"]["plan_communicator"]
        assert r["auto"]["sends_over"] == r["auto"]["plan_communicator"] or r["auto"]["dense"], r["auto"]
        assert r["switched"] == {"sent_over": ["zen", "allgather"], "replicas_equal": True}, r["switched"]
        # the profile's sweeps drew their data from a generator of their own, not the user's stream
        assert r["auto"]["rng_untouched"], r["auto"]
        # forced dense: Horovod's dense allreduce from the first step, the provisional plan's steps
        # and the profiled plan's, bit for bit with 2 workers (a + b in any order), under the
        # SGD's own momentum
        forced = r["forced"]
        assert forced["dense"] and not forced["momentum_correction"], forced
        assert forced["plans"][0] == "provisional" and forced["plans"][-1] != "provisional", forced
        tol = 0.0 if len(recs) == 2 else 1e-6
        assert max(forced["grad_diffs"]) <= tol and max(forced["param_diffs"]) <= tol, forced
        # nothing selected, no communicator chosen: neither is timed, nor ZEN held
        assert forced["sweeps"] == ["dense_allreduce"] and forced["priced"] == [], forced
        assert forced["held"] == ["allgather"], forced
        # the small tensors as the plan priced them and the job runs them, sparse or dense="auto"
        for part in (r["auto"]["whole"], r["sparse"]["whole"]):
            assert part["rule"] == [MIN_SELECTED, DENSE_SHARE] and part["small"], part  # this CNN's biases
            assert part["planned"] == part["small"] and part["running"] in (None, part["small"]), part
        # forced sparse prices no dense plan: its dense allreduce is timed up to the small tensors'
        # bytes (from 1,024 elements) to price them
        assert r["sparse"]["swept_up_to"] == max(r["sparse"]["small_bytes"], 4 * 1024), r["sparse"]
        assert r["sparse"]["prices_dense"] is False, r["sparse"]  # so no re-plan extrapolates it to a dense plan
