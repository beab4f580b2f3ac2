"""The cluster on one machine (``scripts/cluster.sh``) itself: hosts with their own address, name,
link rate and sshd; a second ``up`` replaces the first; ``down`` leaves nothing behind. Runs a
cluster of its own (another prefix and subnet), beside the one the multi-host tests share."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from launch import CLUSTER, cluster_missing

ENV = dict(os.environ, CLUSTER_PREFIX="sft", CLUSTER_NET="10.78.0")

pytestmark = pytest.mark.multiproc


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", CLUSTER, *args], capture_output=True, text=True, env=ENV, timeout=120)


def inside(host: int, *cmd: str) -> str:
    return subprocess.run(["ip", "netns", "exec", f"sfth{host}", *cmd], capture_output=True, text=True,
                          check=True, timeout=60).stdout


@pytest.fixture
def own_cluster():
    why = cluster_missing()
    if why:
        pytest.skip(why)
    yield
    sh("down")


def test_up_twice_then_down(own_cluster):
    assert sh("up", "3", "200mbit").returncode == 0
    up = sh("up", "2", "1gbit")  # replaces the first
    assert up.returncode == 0, up.stderr
    assert [line.split()[:2] for line in sh("status").stdout.splitlines()] == [["h1", "10.78.0.1"], ["h2", "10.78.0.2"]]
    for host in (1, 2):
        assert f"10.78.0.{host}" in inside(host, "ip", "-4", "addr", "show", "sfnet")
        # this machine's hostname is the host's own address there (Horovod's Gloo process sets)
        assert inside(host, "getent", "hosts", socket.gethostname()).split()[0] == f"10.78.0.{host}"
        # the bucket holds 2 ms of the rate: no message of a step leaves at memory speed
        assert "rate 1Gbit burst 250000b" in inside(host, "tc", "qdisc", "show", "dev", "sfnet")
        assert "rate 1Gbit" in subprocess.run(["tc", "qdisc", "show", "dev", f"sftv{host}"], capture_output=True,
                                              text=True).stdout  # both directions
    # ssh from host 1 to host 2 by name, as horovodrun does
    assert inside(1, "ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR",
                  "h2", "hostname", "-I").split()[0] == "10.78.0.2"
    assert sh("down").returncode == 0
    assert "sfth" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert sh("status").stdout.strip() == "cluster: no hosts"
    assert sh("down").returncode == 0  # harmless when nothing is up


def test_bad_host_count_is_a_clear_error(own_cluster):
    bad = sh("up", "0")
    assert bad.returncode != 0 and "HOSTS must be 1 to 250, got '0'" in bad.stderr


def test_a_bad_rate_is_a_clear_error(own_cluster):
    bad = sh("up", "2", "fast")
    assert bad.returncode != 0 and "RATE must be a number with kbit, mbit or gbit (e.g. 100mbit), or none; " \
        "got 'fast'" in bad.stderr
    assert sh("status").stdout.strip() == "cluster: no hosts"


def namespaces() -> list[str]:
    return [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                       text=True).stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_limited_link_is_taken_down_when_its_benchmark_is_stopped(how):
    """SIGTERM runs the link's tear-down; after SIGKILL, which nothing can catch, the next link
    deletes the namespace its dead process left."""
    why = cluster_missing()
    if why:
        pytest.skip(why)
    benchmarks = os.path.join(os.path.dirname(CLUSTER), os.pardir, "benchmarks")
    holder = ("import sys, time; sys.path.insert(0, sys.argv[1]); from links import limited_link\n"
              "with limited_link('1gbit') as prefix:\n    print(prefix[-1], flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", holder, benchmarks], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name.startswith("safbench") and name in namespaces()
    proc.send_signal(getattr(signal, how))
    proc.wait(timeout=60)
    proc.stdout.close()
    if how == "SIGKILL":
        assert name in namespaces()  # nothing ran in the killed process
        cleaner = "import sys; sys.path.insert(0, sys.argv[1]); from links import remove_stale_links; remove_stale_links()"
        subprocess.run([sys.executable, "-c", cleaner, benchmarks], check=True, timeout=60)
    assert name not in namespaces()
