"""A peer's job runs with Horovod's own settings: the benchmarks' modules that a peer's worker
imports do not import the plugin (whose import sets Horovod's cycle time,
``horovod_safusion/cycle.py``), and a driver that parsed one of our labels (so imported the
plugin) launches its jobs without the cycle time that import set, keeping one the user exported.

Each case runs in a fresh interpreter: this process imported the plugin long ago."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
WORKER_MODULES = ("bench_convergence", "bench_time_to_accuracy", "bench_peers", "bench_memory", "bench_scale",
                  "bench_rounds")


def python(code: str, cycle_time: str | None = None, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_CYCLE_TIME"}
    if cycle_time is not None:
        env["HOROVOD_CYCLE_TIME"] = cycle_time
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([BENCHMARKS, ROOT])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_a_peers_worker_module_leaves_horovods_cycle_time(module):
    out = python(f"import os, sys, {module}; "
                 "print(os.environ.get('HOROVOD_CYCLE_TIME'), 'horovod_safusion' in sys.modules)")
    assert out == "None False", f"importing {module} set {out}"


@pytest.mark.parametrize("exported, launched", [(None, "None"), ("2", "2")])
def test_jobs_are_launched_without_the_cycle_time_the_drivers_import_set(exported, launched):
    out = python("import os; from schemes import parse; from links import job_environ; parse('safusion'); "
                 "print(os.environ.get('HOROVOD_CYCLE_TIME'), job_environ(X='1').get('HOROVOD_CYCLE_TIME'), "
                 "job_environ(X='1')['X'])", exported,
                 HOROVOD_LOCAL_SIZE=str((os.cpu_count() or 1) + 1))  # a host whose workers share its CPUs
    driver = "5" if exported is None else exported  # the plugin's import set its own, or kept the user's
    assert out == f"{driver} {launched} 1"
