"""Launching horovodrun from the tests: one place for the command, the time limit and the kill.

A job runs in a session of its own, so a hung job's workers are killed with their launcher, and
what it printed up to then comes back with a note, instead of the test suite hanging.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys


#: Horovod's Gloo timeout (s) for the tests' Gloo jobs of three workers or more. With more workers
#: than cores, Horovod's own collectives have stalled beyond its default of 30 s at times, on one
#: host and across the cluster's hosts alike, which ends the job before its checks run.
GLOO_TIMEOUT_S = 120


def horovodrun() -> str:
    """The ``horovodrun`` next to this Python (the project's virtual environment)."""
    return shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"


def gloo_timeout(transport: str, np_: int) -> list[str]:
    """``horovodrun``'s option for :data:`GLOO_TIMEOUT_S` where a Gloo job has more than two workers."""
    return ["--gloo-timeout-seconds", str(GLOO_TIMEOUT_S)] if transport == "--gloo" and np_ > 2 else []


def on_localhost(np_: int, transport: str = "--gloo") -> list[str]:
    """``horovodrun`` with ``np_`` workers on this host over ``transport`` (``--gloo``, ``--mpi``)."""
    return [horovodrun(), "-np", str(np_), "-H", f"localhost:{np_}", transport, *gloo_timeout(transport, np_)]


def run(cmd: list[str], timeout: float, env: dict | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (in ``cwd``); past ``timeout`` seconds kill its whole process group and say so
    in stderr."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n*** killed after {timeout} s (hang) ***"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_RANK_LINE = re.compile(r"^\[(\d+)\]<std(?:out|err)>:(.*)$")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
#: Horovod's own error lines (its C++ log: ``[date time: E file:line] ...``), e.g. the background
#: loop's exception that shuts Horovod down, which every rank's traceback then only echoes.
_HOROVOD_ERROR = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:.]+: E ")


def first_errors(output: str, lines: int = 40) -> str:
    """Each rank's first Horovod error line and first Python traceback in a ``horovodrun`` log (its
    lines prefixed ``[rank]<stderr>:``), up to ``lines`` lines each: the cause of a failed job,
    which a tail of the log loses when the other ranks' echoes of it come later."""
    by_rank: dict[int, list[str]] = {}
    for line in output.splitlines():
        m = _RANK_LINE.match(line)
        if m:
            by_rank.setdefault(int(m.group(1)), []).append(m.group(2))
    report = []
    for rank in sorted(by_rank):
        text = by_rank[rank]
        block = [line for line in text if _HOROVOD_ERROR.match(line)][:1]
        start = next((i for i, line in enumerate(text) if line.startswith("Traceback")), None)
        if start is not None:
            end = next((i for i in range(start + 1, len(text)) if _EXCEPTION.match(text[i])), len(text) - 1)
            trace = text[start:end + 1]
            if len(trace) > lines:
                trace = trace[:lines // 2] + ["..."] + trace[-(lines // 2):]
            block += trace
        if block:
            report.append(f"[rank {rank}]\n" + "\n".join(block))
    return "\n".join(report) if report else "(no rank printed a traceback)"


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "scripts", "cluster.sh")


def cluster_missing() -> str | None:
    """Why a cluster on one machine cannot run here (``scripts/cluster.sh``), or None."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, tc, one sshd per host)"
    for tool in ("/usr/sbin/sshd", shutil.which("ip"), shutil.which("tc")):
        if not tool or not os.path.exists(tool):
            return "multi-host tests need iproute2 and openssh-server (make install installs them)"
    return None


def on_hosts(slots: list[int], transport: str = "--gloo") -> list[str]:
    """``horovodrun`` from inside host 1 of the cluster, with ``slots[i]`` workers on host i + 1,
    over the hosts' own interface — a real multi-host launch (ssh to every other host)."""
    hosts = ",".join(f"h{i + 1}:{n}" for i, n in enumerate(slots))
    return ["bash", CLUSTER, "run", horovodrun(), "-np", str(sum(slots)), "-H", hosts, transport,
            *gloo_timeout(transport, sum(slots)), "--network-interface", "sfnet"]


def cluster(hosts: int, rate: str = "none") -> subprocess.CompletedProcess:
    """Bring the cluster up (``hosts`` namespaces; a second call replaces the first)."""
    return subprocess.run(["bash", CLUSTER, "up", str(hosts), rate], capture_output=True, text=True, timeout=120)


def cluster_down() -> None:
    subprocess.run(["bash", CLUSTER, "down"], capture_output=True, text=True, timeout=120)
