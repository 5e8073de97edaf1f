"""The `serve --replicas` supervisor as an operator may mistreat it: SIGKILLed, its replicas,
HAProxy and redis-server end with it (the kernel's parent-death signal) instead of holding the
ports; its Redis is bounded and evicts nothing (a write refused is a 507); a second cluster on ports in use is refused in one line before it starts anything; a
replica that cannot start at all stops the cluster instead of being started again forever."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from harness.cluster import LocalCluster, tools_or_skip
from linstream.cluster import STARTUP_FAILED, Cluster
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it holds no port)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_a_killed_supervisor_takes_its_children_and_a_busy_port_is_refused_in_one_line():
    tools_or_skip(pytest)
    cluster = LocalCluster(1, ["linear"], "--compile", "off", "--threads", "1", cwd=str(ROOT))
    try:
        root = cluster.proc.pid
        children = [int(p) for p in Path(f"/proc/{root}/task/{root}/children").read_text().split()]
        assert len(children) == 3  # the replica, HAProxy, redis-server
        config = redis.Redis(port=cluster.port + 2).config_get("maxmemory*")  # a session is refused, never evicted
        assert config["maxmemory-policy"] == "noeviction" and int(config["maxmemory"]) > 0
        busy = subprocess.run([sys.executable, "-m", "linstream", "serve", "--replicas", "1", "--port", str(cluster.port),
                               "--model", "linear"], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        lines = busy.stderr.strip().splitlines()
        assert busy.returncode != 0 and len(lines) == 1 and f"port {cluster.port} is in use" in lines[0], busy.stderr
        assert all(not gone(pid) for pid in children)  # the refused one touched nothing of the first
        os.kill(root, signal.SIGKILL)
        cluster.proc.wait()
        deadline = time.time() + 30  # the replica drains (SIGTERM) before it exits
        while not all(gone(pid) for pid in children):
            assert time.time() < deadline, [pid for pid in children if not gone(pid)]
            time.sleep(0.1)
        with socket.socket() as s:  # the proxy's port is free again
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", cluster.port))
    finally:
        cluster.stop()


def test_a_replica_that_cannot_start_stops_the_cluster(capsys):
    cluster = Cluster.__new__(Cluster)
    cluster.port, cluster.haproxy, cluster.started = 9000, None, [0.0, 0.0]
    cluster.procs = [SimpleNamespace(poll=lambda: None), SimpleNamespace(poll=lambda: STARTUP_FAILED, returncode=3)]
    assert cluster.watch(lambda: False) == 1
    assert "replica 1 could not start on port 9002" in capsys.readouterr().err
