"""Emulated network links for the benchmarks: a network namespace whose loopback is rate-limited.

A link is named ``loopback`` (the plain loopback, nothing limited) or by a ``tc`` rate such as
``1gbit`` or ``200mbit``. For a rate, :func:`limited_link` makes a fresh namespace, brings its
loopback up and limits it with a token bucket (``tc qdisc add dev lo root tbf``); commands run
inside with the prefix it yields (``ip netns exec NAME``). The bucket holds 2 ms of the rate, and
at least twice the loopback's 64 KiB MTU (a bucket below the MTU drops large packets and Gloo times
out): :func:`burst_bytes`. A larger bucket lends its bytes at memory speed after every pause, so
that a step's message of a few hundred kilobytes crossed a "100 Mbit/s" link many times faster than
such a link can carry it (docs/benchmarks.md, "The links' token bucket"); ``scripts/cluster.sh``
sizes its hosts' buckets by the same rule (64 KiB at least: their MTU is 1500). ``netem`` (delay)
is not in every kernel, so only the rate is limited. Needs root and iproute2.

Tear-down always runs: SIGTERM and SIGHUP end a link's (or cluster's) block through its
``finally``, and a namespace left by a process that was killed outright (SIGKILL, a restart) is
deleted by the next :func:`limited_link`, which knows it by the dead process id in its name.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import IO, Callable, Iterable

LOOPBACK = "loopback"
NAMESPACE = "safbench"  # a limited link's namespace: NAMESPACE<pid>x<n>
_count = itertools.count()
CLUSTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "cluster.sh")
INTERFACE = "sfnet"  # every cluster host's interface (scripts/cluster.sh)


def rate_of(link: str | None) -> str | None:
    """The ``tc`` rate of a link name, or None for the plain loopback."""
    return None if link in (None, LOOPBACK) else link


#: A link's token bucket holds this many seconds of its rate (at least :data:`MIN_BURST` bytes).
BURST_S = 0.002
#: Twice the loopback's MTU (65536): a packet larger than the bucket is dropped.
MIN_BURST = 131072
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def burst_bytes(rate: str) -> int:
    """The token bucket's size for a ``tc`` rate such as ``100mbit``: :data:`BURST_S` of it, at
    least :data:`MIN_BURST`."""
    m = re.fullmatch(r"(\d+)(kbit|mbit|gbit)", rate)
    if m is None:
        raise ValueError(f"a link's rate must be a number with kbit, mbit or gbit (e.g. 100mbit), got {rate!r}")
    return max(MIN_BURST, int(int(m.group(1)) * _UNITS[m.group(2)] / 8 * BURST_S))


def check_link(link: str | None, option: str = "--links") -> None:
    """Stop with a clear message if ``link`` needs a namespace and this machine cannot make one."""
    if rate_of(link) is None:
        return
    try:
        burst_bytes(rate_of(link))
    except ValueError as e:
        raise SystemExit(f"{option} {link}: {e}") from None
    require(f"{option} {link}: limiting the link needs root and iproute2 (ip, tc)")


def require(need: str, sshd: bool = False) -> None:
    """Stop with ``need`` and the reason unless this runs as root with ip, tc (and sshd)."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if sshd and not os.path.exists("/usr/sbin/sshd"):
        missing.append("sshd (openssh-server)")
    if os.geteuid() != 0 or missing:
        why = "not running as root" if os.geteuid() != 0 else f"{' and '.join(missing)} not found"
        raise SystemExit(f"{need}: {why}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def remove_stale_links() -> None:
    """Delete the namespaces of limited links whose process is gone (killed before its tear-down)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        owner = re.fullmatch(rf"{NAMESPACE}(\d+)x\d+", name)
        if owner and not _alive(int(owner.group(1))):
            subprocess.run(["ip", "netns", "del", name], check=False)


@contextmanager
def _signals_exit():
    """SIGTERM and SIGHUP raise SystemExit inside the block, so that its ``finally`` runs (their
    default handlers end the process without it). Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum, _frame):
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, leave) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def limited_link(link: str | None, option: str = "--links"):
    """A command prefix that runs inside a namespace whose loopback is limited to ``link``'s rate.

    ``None`` or ``"loopback"`` yields ``[]`` (run as is). The namespace is deleted on exit.
    """
    rate = rate_of(link)
    if rate is None:
        yield []
        return
    check_link(link, option)
    remove_stale_links()
    ns = f"{NAMESPACE}{os.getpid()}x{next(_count)}"
    with _signals_exit():
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                            "rate", rate, "burst", str(burst_bytes(rate)), "limit", "4mb"], check=True)
            yield ["ip", "netns", "exec", ns]
        finally:
            subprocess.run(["ip", "netns", "del", ns], check=False)


def host_prefix(i: int) -> list[str]:
    """The command prefix that runs on host ``i`` (0-based) of the cluster on one machine."""
    return ["ip", "netns", "exec", f"sfh{i + 1}"]


def host_name(i: int) -> str:
    """Host ``i``'s (0-based) name, as every host resolves it."""
    return f"h{i + 1}"


@contextmanager
def cluster(hosts: int, link: str | None, option: str = "--hosts"):
    """``hosts`` hosts of a cluster on one machine (``scripts/cluster.sh``), each with its own link
    of ``link``'s rate both ways (``loopback``: unlimited); taken down on exit, whatever happens."""
    require(f"{option} {hosts}: a cluster on one machine needs root, iproute2 and openssh-server", sshd=True)
    with _signals_exit():
        try:
            subprocess.run(["bash", CLUSTER, "up", str(hosts), rate_of(link) or "none"], check=True,
                           stdout=subprocess.DEVNULL)
            yield []  # commands say which host they run on (host_prefix)
        finally:
            subprocess.run(["bash", CLUSTER, "down"], check=False)


def job_environ(**extra: str) -> dict[str, str]:
    """The environment to launch a benchmark's job with: this driver's, plus ``extra``, less the
    cycle time that importing the plugin here set (:mod:`horovod_safusion.cycle`; a driver that
    parses one of our labels imports it). A peer's job must run with Horovod's own default; our
    jobs set the plugin's again when their worker imports it, and a cycle time the user exported
    stays."""
    env = dict(os.environ)
    cycle = sys.modules.get("horovod_safusion.cycle")
    if cycle is not None and cycle.set_on_import:
        env.pop(cycle.ENV, None)
    env.update(extra)
    return env


def free_port() -> int:
    """A free TCP port of this host's loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(cmds: list[list[str]], log: IO, env: dict[str, str]) -> list[subprocess.Popen]:
    """Start a job's launcher commands side by side, each in a session of its own (so that
    :func:`kill_tree` ends them and everything they start), their output to ``log``."""
    return [subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for cmd in cmds]


def run_job(cmds: list[list[str]], log: str, env: dict[str, str], timeout: float,
            pids: Callable[[], Iterable[int]] = tuple) -> list[int] | None:
    """Run a job (:func:`start_job`, its output to the file ``log``) to its end: its launchers'
    exit statuses, or ``None`` where one ran past ``timeout`` seconds — a hang: then the launchers,
    what they started and the worker ``pids()`` (workers reached over ssh are no launcher's
    children) are killed, and the log says so."""
    with open(log, "w") as f:
        procs = start_job(cmds, f, env)
        try:
            return [p.wait(timeout=timeout) for p in procs]
        except subprocess.TimeoutExpired:
            kill_tree(procs, pids())
            f.write(f"\n*** killed after {timeout:g} s: a hang ***\n")
            return None


def kill_tree(procs: list[subprocess.Popen], pids: Iterable[int] = ()) -> None:
    """Kill the launchers (started with ``start_new_session=True``), everything they started
    (Horovod puts its workers in sessions of their own) and the worker ``pids`` (workers reached
    over ssh are no launcher's children); stopped processes die too."""
    import psutil

    kids = []
    for proc in procs:
        try:
            kids += psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in {*pids, *(k.pid for k in kids)}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()


def launchers(worker_cmd: list[str], torchrun: bool, np_: int, hosts: int, prefix: list[str]) -> list[list[str]]:
    """A job's launcher commands for ``worker_cmd`` (a Python script and its arguments): torchrun
    (``torchrun=True``) or horovodrun, ``np_`` workers on this host under ``prefix`` (a limited
    link's namespace); or on ``hosts`` hosts of a cluster, one worker each: horovodrun from host 1
    with ``-H h1:1,...`` over ssh, torchrun once per host meeting at host 1 (a static multi-node
    rendezvous)."""
    if torchrun:
        port = str(free_port())
        if not hosts:
            return [prefix + [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(np_),
                              "--master_addr", "127.0.0.1", "--master_port", port, *worker_cmd]]
        return [host_prefix(i) + [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts),
                                  "--node_rank", str(i), "--nproc_per_node", "1", "--master_addr", host_name(0),
                                  "--master_port", port, *worker_cmd] for i in range(hosts)]
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"
    if not hosts:
        return [prefix + [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable,
                          *worker_cmd]]
    slots = ",".join(f"{host_name(i)}:1" for i in range(hosts))
    return [host_prefix(0) + [horovodrun, "-np", str(hosts), "-H", slots, "--gloo", "--network-interface", INTERFACE,
                              sys.executable, *worker_cmd]]
