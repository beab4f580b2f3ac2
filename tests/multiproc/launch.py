"""Launching horovodrun from the tests: one place for the command, the time limit and the kill.

A job runs in a session of its own, so a hung job's workers are killed with their launcher, and
what it printed up to then comes back with a note, instead of the test suite hanging.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys


def horovodrun() -> str:
    """The ``horovodrun`` next to this Python (the project's virtual environment)."""
    return shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"


def run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``; past ``timeout`` seconds kill its whole process group and say so in stderr."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n*** killed after {timeout} s (hang) ***"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
