"""Horovod's cycle time: importing the package before ``hvd.init()`` gives Horovod the plugin's
cycle time where the host's workers outnumber its CPUs, and leaves alone workers with CPUs of
their own, a cycle time the user chose, Horovod's autotuner, and a Horovod that is already
initialised. Each case is a fresh interpreter, as a user's script is."""
import os
import subprocess
import sys

import pytest

from horovod_safusion import cycle, launcher

SHOW = "import os; print(os.environ.get('HOROVOD_CYCLE_TIME'))"


def cycle_time_seen_by_horovod(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in (cycle.ENV, "HOROVOD_AUTOTUNE", *launcher.LOCAL_SIZE)}
    out = subprocess.run([sys.executable, "-c", f"{code}; {SHOW}"], env={**environ, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


CROWDED = {"HOROVOD_LOCAL_SIZE": str((os.cpu_count() or 1) + 1)}  # one worker more than the host's CPUs
IMPORT_FIRST = "import horovod_safusion; import horovod.torch as hvd; hvd.init()"


@pytest.mark.parametrize("code, env, expected", [
    (IMPORT_FIRST, CROWDED, f"{cycle.CYCLE_TIME_MS:g}"),
    (IMPORT_FIRST, {}, "None"),
    (IMPORT_FIRST, {"HOROVOD_LOCAL_SIZE": str(os.cpu_count() or 1)}, "None"),
    (IMPORT_FIRST, {**CROWDED, "HOROVOD_CYCLE_TIME": "2.5"}, "2.5"),
    (IMPORT_FIRST, {**CROWDED, "HOROVOD_AUTOTUNE": "1"}, "None"),
    (IMPORT_FIRST, {**CROWDED, "HOROVOD_AUTOTUNE": "0"}, f"{cycle.CYCLE_TIME_MS:g}"),
    ("import horovod.torch as hvd; hvd.init(); import horovod_safusion", CROWDED, "None"),
], ids=["workers share the CPUs", "one worker", "a CPU each", "user's choice", "autotuner", "autotuner off",
        "imported after init"])
def test_the_package_sets_horovods_cycle_time_only_where_workers_share_cpus_and_nobody_chose_one(code, env, expected):
    assert cycle_time_seen_by_horovod(code, **env) == expected


@pytest.mark.parametrize("workers, cpus, shared", [(1, 1, False), (2, 2, False), (3, 2, True), (8, 2, True),
                                                   (8, 16, False)])
def test_workers_share_cores_only_where_they_outnumber_the_cpus(workers, cpus, shared):
    assert cycle.shares_cores({"HOROVOD_LOCAL_SIZE": str(workers)}, cpus) is shared
