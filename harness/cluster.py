"""A real `linstream serve --replicas N` (HAProxy, N replicas, a redis-server) on loopback ports,
for tests and benchmarks: its processes found by port, killed or stopped one at a time, and its
replicas' metrics read directly."""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .local_server import stop_process, wait_until_up


def missing_tools() -> list[str]:
    """The programs a cluster needs that this machine lacks."""
    from linstream.cluster import _which
    return [t for t in ("haproxy", "redis-server") if _which(t) is None]


def free_ports(n: int) -> int:
    """The first of n consecutive loopback ports that are free now."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class LocalCluster:
    """`linstream serve --replicas n --port P`: the proxy on P, replica i on P+1+i, Redis on P+n+1."""

    def __init__(self, n: int, models: list[str] = (), *extra: str, env: dict | None = None, cwd: str | None = None,
                 within: float = 300):
        self.n = n
        self.port = free_ports(n + 2)
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "linstream", "serve", "--replicas", str(n), "--port", str(self.port),
                "--log-level", "warning", *extra]
        for m in models:
            args += ["--model", m]
        env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "LINSTREAM_STORE"}
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, start_new_session=True)
        if not wait_until_up(self.proc, self.url + "/health", within) or not self.wait_replicas(within):
            self.stop()
            raise RuntimeError("the cluster did not come up")
        self.redis_url = f"redis://127.0.0.1:{self.port + n + 1}/0"

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + 1 + i}"

    def names(self) -> list[str]:
        """Each replica's name (X-Linstream-Replica), in port order."""
        return [httpx.get(self.replica_url(i) + "/health", timeout=5).headers["x-linstream-replica"] for i in range(self.n)]

    def index_of(self, name: str) -> int:
        return int(name.rsplit(":", 1)[1]) - self.port - 1  # the default name is host:port

    def wait_replicas(self, within: float = 120) -> bool:
        """Every replica answers /health (one that was killed has been started again)."""
        deadline = time.time() + within
        for i in range(self.n):
            while True:
                try:
                    if httpx.get(self.replica_url(i) + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline or self.proc.poll() is not None:
                    return False
                time.sleep(0.1)
        return True

    def pid(self, i: int) -> int:
        """The process of replica i (a child of the `serve --replicas` process, found by its port)."""
        port = f"--port\0{self.port + 1 + i}\0"
        for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
            try:
                if port in Path(f"/proc/{child}/cmdline").read_text():
                    return int(child)
            except FileNotFoundError:
                continue
        raise LookupError(f"replica {i} is not running")

    def signal(self, i: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pid(i), sig)

    def metric(self, name: str, i: int | None = None) -> float:
        """The sum of a metric's samples (every label) on replica i, or on all replicas."""
        total = 0.0
        for j in range(self.n) if i is None else [i]:
            text = httpx.get(self.replica_url(j) + "/metrics", timeout=5).text
            total += sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))
        return total

    def metrics(self, name: str) -> list[float]:
        """`metric(name, i)` for each replica; 0 for one that does not answer (killed: a new
        process counts from 0)."""
        out = []
        for i in range(self.n):
            try:
                out.append(self.metric(name, i))
            except httpx.HTTPError:
                out.append(0.0)
        return out

    def stop(self) -> None:
        stop_process(self.proc, grace=90)


def tools_or_skip(pytest) -> None:
    """Skip (fail on CI) where haproxy or redis-server is missing."""
    gone = missing_tools()
    if gone:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide {' and '.join(gone)}")
        pytest.skip(f"needs {' and '.join(gone)} (Debian: apt-get install haproxy redis-server)")

