"""Horovod's cycle time: importing the package before ``hvd.init()`` gives Horovod the plugin's
cycle time, and leaves alone a cycle time the user chose, Horovod's autotuner, and a Horovod that
is already initialised. Each case is a fresh interpreter, as a user's script is."""
import os
import subprocess
import sys

import pytest

from horovod_safusion import cycle

SHOW = "import os; print(os.environ.get('HOROVOD_CYCLE_TIME'))"


def cycle_time_seen_by_horovod(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in (cycle.ENV, "HOROVOD_AUTOTUNE")}
    out = subprocess.run([sys.executable, "-c", f"{code}; {SHOW}"], env={**environ, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("code, env, expected", [
    ("import horovod_safusion; import horovod.torch as hvd; hvd.init()", {}, f"{cycle.CYCLE_TIME_MS:g}"),
    ("import horovod_safusion; import horovod.torch as hvd; hvd.init()", {"HOROVOD_CYCLE_TIME": "2.5"}, "2.5"),
    ("import horovod_safusion; import horovod.torch as hvd; hvd.init()", {"HOROVOD_AUTOTUNE": "1"}, "None"),
    ("import horovod_safusion; import horovod.torch as hvd; hvd.init()", {"HOROVOD_AUTOTUNE": "0"},
     f"{cycle.CYCLE_TIME_MS:g}"),
    ("import horovod.torch as hvd; hvd.init(); import horovod_safusion", {}, "None"),
], ids=["default", "user's choice", "autotuner", "autotuner off", "imported after init"])
def test_the_package_sets_horovods_cycle_time_only_where_nobody_chose_one(code, env, expected):
    assert cycle_time_seen_by_horovod(code, **env) == expected
